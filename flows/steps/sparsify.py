"""The `sparsify` step: a classifier's rounds with the activation-sparsity term, the activation
thresholds and the kept network's report on the validation split (`train_sparse`), which the
`sparsify` flow and the `pipeline` both run."""

from __future__ import annotations

from prefect import get_run_logger

from flows.skeleton import Prepared, run_rounds, train_classifier_rounds
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.sections import ClassifierConfig
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.rounds import RoundResult
from tasks.sparsify import (
    Thresholded,
    calibrate_zero_thresholds,
    sparsity_report,
    sparsity_spec,
    zero_target_step,
    zero_target_thresholds,
)
from tasks.training import ClassifierRound
from training.budget import Budget
from training.sparsify.report import SparsityReport

# What the `sparsify` flows, the `pipeline` and the benchmarks may import
# (tests/test_layering.py): the technique's name (its flow's, and the run name of its rounds)
# and a classifier's sparse rounds and their report (`train_sparse`).
__all__ = ["FLOW_NAME", "train_sparse"]

FLOW_NAME = "sparsify"


def train_sparse(config: SparsifyConfig, classifier: ClassifierConfig, prepared: Prepared,
                 budget: Budget, run_id: str, start: ArtifactRef | None = None
                 ) -> tuple[SparsitySpec, RoundResult, SparsityReport]:
    """The config's sparsity term, the rounds trained with it (from `start`'s weights when
    given: fine-tuning), with `--zero-threshold-tolerance` or `--zero-target` the kept round's
    activation thresholds (raised by `--threshold-cycles` of training with them in place, or
    with `--zero-target-ramp` inside the rounds), and the kept network's activations on the
    validation split, logged on `run_id` (`val_zero_fraction_<layer>`, ...)."""
    spec = sparsity_spec(config, prepared.dataset)
    tracking.log_metrics(run_id, {f"lambda_{k.replace('.', '_')}": v
                                  for k, v in spec.lambdas.items()})
    get_run_logger().info("sparsity term %s on %s", spec.build().describe(), ", ".join(
        f"{k} (lambda {v:.3g})" for k, v in spec.lambdas.items()))
    if config.zero_target_ramp is not None:
        best, thresholds = ramped_training(config, classifier, prepared, budget, run_id, spec,
                                           start)
    else:
        best = train_classifier_rounds(classifier, prepared, budget, run_id, config.patience,
                                       FLOW_NAME, sparsity=spec, start=start)
        thresholds: dict[str, float] = {}
        if config.zero_threshold_tolerance is not None or config.zero_target is not None:
            best, thresholds = thresholded_training(config, classifier, prepared, budget,
                                                    run_id, spec, best)
    report = sparsity_report(classifier, prepared.dataset, best.checkpoint, spec
                             ).model_copy(update={"thresholds": thresholds})
    tracking.log_metrics(run_id, report.split_metrics())
    return spec, best, report


def ramped_training(config: SparsifyConfig, classifier: ClassifierConfig, prepared: Prepared,
                    budget: Budget, run_id: str, spec: SparsitySpec, start: ArtifactRef | None
                    ) -> tuple[RoundResult, dict[str, float]]:
    """`--zero-target-ramp FIRST,LAST`: the run's rounds with the thresholds raised inside it.
    Before round r (from 1) = FIRST..LAST a calibration on the last round's network (the
    checkpoint's thresholds in place) takes each layer 1 / (LAST + 1 - r) of the way to the
    zero target; before every later round it tops them up to it (training moves the maps).
    The rounds share the run's optimizer and cosine schedule (they continue from each other's
    checkpoints), like the run without thresholds they are compared with. The round kept is
    one from LAST on, topped up to the target after it; each calibration is logged at the
    step of the round before it; only the final top-up is written as a checkpoint (each
    round stores the thresholds it trained with). The kept round and its thresholds."""
    first, last = config.zero_target_ramp
    layers = tuple(spec.lambdas)

    def ramped_round(index: int, previous: ArtifactRef | None) -> ClassifierRound:
        held = spec
        if index + 1 >= first:  # this calibration closes 1 / (calibrations left) of the gap
            calibrated = zero_target_step(classifier, prepared.dataset, previous or start,
                                          layers, config.zero_target, 1.0 / max(last - index, 1))
            tracking.log_metrics(run_id, calibrated.metrics(), step=index)
            held = spec.model_copy(update={"thresholds": calibrated.thresholds})
        return ClassifierRound(config=classifier, dataset=prepared.dataset, round=index,
                               run_name=FLOW_NAME, repeats=budget.repeats, sparsity=held,
                               start=start)

    best = run_rounds(classifier.rounds, ramped_round, run_id, config.patience,
                      prepared.dataset.sizes["val"], keep_from=last - 1)
    topped = zero_target_thresholds(classifier, prepared.dataset, best.checkpoint, layers,
                                    config.zero_target, 1.0)
    tracking.log_metrics(run_id, topped.metrics(), step=classifier.rounds)
    return best.model_copy(update={"checkpoint": topped.checkpoint, "metrics": (
        best.metrics | {"val_accuracy": topped.val_accuracy})}), topped.thresholds


def thresholded_training(config: SparsifyConfig, classifier: ClassifierConfig,
                         prepared: Prepared, budget: Budget, run_id: str, spec: SparsitySpec,
                         best: RoundResult) -> tuple[RoundResult, dict[str, float]]:
    """Activation thresholds on `best`'s network: calibrated to `--zero-threshold-tolerance`
    or set for `--zero-target` (in equal steps, one per calibration), raised over
    `--threshold-cycles` of training with them in place, then `--threshold-settle-rounds`
    (with a zero target, topped up to it after them: the settled network may have moved
    below it), kept where it is no worse on validation; each calibration logged at its
    cycle. The kept round and its thresholds."""
    layers = tuple(spec.lambdas)
    steps = config.threshold_cycles + 1

    def calibrate(checkpoint: ArtifactRef, done: int, floor: float | None) -> Thresholded:
        if config.zero_target is not None:  # this step closes 1 / (steps left) of the gap
            return zero_target_thresholds(classifier, prepared.dataset, checkpoint, layers,
                                          config.zero_target, 1.0 / (steps - done))
        return calibrate_zero_thresholds(classifier, prepared.dataset, checkpoint, layers,
                                         config.zero_threshold_tolerance, floor)

    thresholded = calibrate(best.checkpoint, 0, None)
    tracking.log_metrics(run_id, thresholded.metrics(), step=0)
    # one budget for all calibrations: the first one's unthresholded accuracy - tolerance
    floor = thresholded.val_accuracy_before - (config.zero_threshold_tolerance or 0.0)
    for cycle in range(config.threshold_cycles):
        best = threshold_cycle(config, classifier, prepared, budget, run_id, spec, thresholded,
                               cycle)
        thresholded = calibrate(best.checkpoint, cycle + 1, floor)
        tracking.log_metrics(run_id, thresholded.metrics(), step=cycle + 1)
    best = best.model_copy(update={"checkpoint": thresholded.checkpoint, "metrics": (
        best.metrics | {"val_accuracy": thresholded.val_accuracy})})
    if not config.threshold_settle_rounds:
        return best, thresholded.thresholds
    settled = threshold_cycle(config, classifier, prepared, budget, run_id, spec, thresholded,
                              config.threshold_cycles, settle=True)
    kept = thresholded.thresholds
    if config.zero_target is not None:  # settling moves a map's zeros: topped up to the target
        topped = calibrate(settled.checkpoint, steps - 1, floor)
        tracking.log_metrics(run_id, topped.metrics(), step=config.threshold_cycles + 1)
        settled = settled.model_copy(update={"checkpoint": topped.checkpoint, "metrics": (
            settled.metrics | {"val_accuracy": topped.val_accuracy})})
        kept = topped.thresholds
    if settled.metrics["val_accuracy"] < best.metrics["val_accuracy"]:
        return best, thresholded.thresholds
    return settled, kept


def threshold_cycle(config: SparsifyConfig, classifier: ClassifierConfig, prepared: Prepared,
                    budget: Budget, run_id: str, spec: SparsitySpec, thresholded: Thresholded,
                    cycle: int, settle: bool = False) -> RoundResult:
    """Cycle `cycle` (0-based) of `--threshold-cycles`: `--threshold-cycle-rounds` rounds
    from the calibrated checkpoint with its thresholds in place while training (FATReLU
    fine-tuning, Kurtz et al. 2020: the network adapts to the zeros it is given) and the term,
    at `--threshold-cycle-lr`, with a fresh optimizer; logged after the main rounds as
    `checkpoint.cycle-N.round-NNN`. `settle`: the `--threshold-settle-rounds` rounds after
    the last cycle (`checkpoint.settle.round-NNN`), with the final thresholds. Returns the
    round with the best validation accuracy (thresholds in place)."""
    rounds = config.threshold_settle_rounds if settle else config.threshold_cycle_rounds
    cycling = classifier.replace(rounds=rounds, lr=config.threshold_cycle_lr, warmup_rounds=0.0)
    held = spec.model_copy(update={"thresholds": thresholded.thresholds})
    get_run_logger().info("threshold %s: %s", "settling" if settle else
                          f"cycle {cycle + 1}/{config.threshold_cycles}",
                          ", ".join(f"{k} {v:.3g}" for k, v in thresholded.thresholds.items()))
    return train_classifier_rounds(
        cycling, prepared, budget, run_id, None, FLOW_NAME, sparsity=held,
        start=thresholded.checkpoint,
        name="checkpoint.settle" if settle else f"checkpoint.cycle-{cycle + 1}",
        first_step=classifier.rounds + cycle * config.threshold_cycle_rounds)
