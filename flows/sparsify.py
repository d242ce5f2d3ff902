"""The `sparsify` flow: a classifier trained with its task loss plus an activation-sparsity term.

loss = CE + sum over the chosen layers of lambda_l x S(map_l), where S is the mean of a
transform T of the layer's activations that is smallest at 0 (`training/sparsify/term.py`), and a
smaller map gets a larger lambda_l. The rounds are the `train` flow's (same budget, early
stopping, checkpoints); after them the kept network's activations are measured on the
validation split (exact zeros, near zeros, dead channels, bytes stored sparse: `val_...`),
logged and plotted (with `--lambda-sweep`, more networks in nested runs give accuracy against
zeros); its dead channels are removed (a smaller network, re-validated and timed on the CPU,
exported beside it); and the network is tested, registered and promoted like `train`'s, its
activations measured again on the test split (`test_...`): validation chose the round, the
activation thresholds and the dead channels, so only the test split's zeros are reported.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.skeleton import (
    ClassifierSummary,
    Prepared,
    budgeted_classifier,
    finish,
    prepare,
    publish,
    run_rounds,
    run_tags,
    train_epochs,
)
from flows.sparsify_canvas import FLOW_NAME, CanvasSummary, sparsify_canvas
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.sections import ClassifierConfig
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.initial_weights import fetch_initial_weights
from tasks.rounds import RoundResult
from tasks.sparsify import (
    ActivationReport,
    PruneResult,
    SparsityReport,
    Thresholded,
    calibrate_zero_thresholds,
    log_sweep,
    prune_dead_channels,
    sparsity_figure,
    sparsity_report,
    sparsity_spec,
    test_activations,
    zero_target_step,
    zero_target_thresholds,
)
from tasks.training import ClassifierRound
from training.budget import Budget

# What other flows and the benchmarks may import (tests/test_layering.py): the flow, its
# summary and the step the `pipeline` composes: a classifier's sparse rounds and their report
# (`train_sparse`).
__all__ = ["SparsifySummary", "sparsify", "train_sparse"]

class SparsifySummary(ClassifierSummary):
    """What a `sparsify` run gives back: the model, its accuracy and its activations on the
    validation split (`report`: what chose the round, the thresholds and the dead channels)
    and on the test split (`test_report`: the figures to report)."""

    spec: SparsitySpec
    report: SparsityReport
    test_report: ActivationReport
    pruned: PruneResult
    sweep: dict[float, SparsityReport]


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
        best = train_epochs(classifier, prepared, budget, run_id, config.patience, FLOW_NAME,
                            sparsity=spec, start=start)
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

    def ramped_round(epoch: int, previous: ArtifactRef | None) -> ClassifierRound:
        held = spec
        if epoch + 1 >= first:  # this calibration closes 1 / (calibrations left) of the gap
            calibrated = zero_target_step(classifier, prepared.dataset, previous or start,
                                          layers, config.zero_target, 1.0 / max(last - epoch, 1))
            tracking.log_metrics(run_id, calibrated.metrics(), step=epoch)
            held = spec.model_copy(update={"thresholds": calibrated.thresholds})
        return ClassifierRound(config=classifier, dataset=prepared.dataset, epoch=epoch,
                               run_name=FLOW_NAME, repeats=budget.repeats, sparsity=held,
                               start=start)

    best = run_rounds(classifier.epochs, ramped_round, run_id, config.patience,
                      prepared.dataset.sizes["val"], keep_from=last - 1)
    topped = zero_target_thresholds(classifier, prepared.dataset, best.checkpoint, layers,
                                    config.zero_target, 1.0)
    tracking.log_metrics(run_id, topped.metrics(), step=classifier.epochs)
    return best.model_copy(update={"checkpoint": topped.checkpoint, "metrics": (
        best.metrics | {"val_accuracy": topped.val_accuracy})}), topped.thresholds


def thresholded_training(config: SparsifyConfig, classifier: ClassifierConfig,
                         prepared: Prepared, budget: Budget, run_id: str, spec: SparsitySpec,
                         best: RoundResult) -> tuple[RoundResult, dict[str, float]]:
    """Activation thresholds on `best`'s network: calibrated to `--zero-threshold-tolerance`
    or set for `--zero-target` (in equal steps, one per calibration), raised over
    `--threshold-cycles` of training with them in place, then `--threshold-settle-epochs`
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
    if not config.threshold_settle_epochs:
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
    """Cycle `cycle` (0-based) of `--threshold-cycles`: `--threshold-cycle-epochs` rounds
    from the calibrated checkpoint with its thresholds in place while training (FATReLU
    fine-tuning, Kurtz et al. 2020: the network adapts to the zeros it is given) and the term,
    at `--threshold-cycle-lr`, with a fresh optimizer; logged after the main rounds as
    `checkpoint.cycle-N.epoch-NNN`. `settle`: the `--threshold-settle-epochs` rounds after
    the last cycle (`checkpoint.settle.epoch-NNN`), with the final thresholds. Returns the
    round with the best validation accuracy (thresholds in place)."""
    rounds = config.threshold_settle_epochs if settle else config.threshold_cycle_epochs
    cycling = classifier.replace(epochs=rounds, lr=config.threshold_cycle_lr, warmup_epochs=0.0)
    held = spec.model_copy(update={"thresholds": thresholded.thresholds})
    get_run_logger().info("threshold %s: %s", "settling" if settle else
                          f"cycle {cycle + 1}/{config.threshold_cycles}",
                          ", ".join(f"{k} {v:.3g}" for k, v in thresholded.thresholds.items()))
    return train_epochs(cycling, prepared, budget, run_id, None, FLOW_NAME, sparsity=held,
                        start=thresholded.checkpoint,
                        name="checkpoint.settle" if settle else f"checkpoint.cycle-{cycle + 1}",
                        first_step=classifier.epochs + cycle * config.threshold_cycle_epochs)


def sweep_point(config: SparsifyConfig, lam: float, classifier: ClassifierConfig,
                prepared: Prepared, budget: Budget, run_id: str,
                start: ArtifactRef | None) -> SparsityReport:
    """One more network trained with `lam` as `--sparsity-lambda` (a nested MLflow run with
    its own rounds and report); its activations on the validation split."""
    varied = config.replace(sparsity_lambda=lam, layer_lambdas=None, lambda_sweep=None)
    with tracking.tracked_run(FLOW_NAME, f"lambda-{lam:g}", varied,
                              parent_run_id=run_id) as child:
        report = train_sparse(varied, classifier, prepared, budget, child, start)[2]
        tracking.log_metrics(child, {f"val_{report.score_name}": report.val_score})
    return report


def initial_weights(config: SparsifyConfig, classifier: ClassifierConfig, prepared: Prepared,
                    run_id: str) -> ArtifactRef | None:
    """With `--init-from`, the registered model's weights to fine-tune (the version it
    resolved to is tagged on the run, the checkpoint versioned); else None."""
    if config.init_from is None:
        return None
    initial = fetch_initial_weights(config.init_from, classifier, prepared.dataset)
    tracking.set_tags(run_id, {"init_from": f"models:/{initial.name}/{initial.version}"})
    tracking.log_artifact_refs(run_id, {"checkpoint.init": initial.checkpoint})
    get_run_logger().info("fine-tuning models:/%s/%s (%s)", initial.name, initial.version,
                          config.init_from)
    return initial.checkpoint


@flow(name=FLOW_NAME, description="Train a classifier, a detector or a contour network with "
      "an activation-sparsity term on chosen layers; measure its zeros, register it and promote "
      "it if it beats the champion (and, classifiers, the raw-pixel baselines).")
def sparsify(config: SparsifyConfig) -> SparsifySummary | CanvasSummary:
    """Trains the config's network with the sparsity term; registers it as
    `config.run.model_name`. `--task detection|contour`: `flows.sparsify_canvas`."""
    name = config.run.registered_name(FLOW_NAME if config.task == "classification"
                                  else f"{FLOW_NAME}-{config.task}")
    config = config.replace(model=config.network_name())
    run_name = f"{FLOW_NAME}-{config.network.model}-{config.transform}-seed{config.run.seed}"
    canvas = config.task != "classification"
    experiment = config.run.experiment(FLOW_NAME)
    with tracking.tracked_run(experiment, run_name, config, run_tags(config)
                              | ({"task": config.task} if canvas else {})) as run_id:
        if canvas:
            return sparsify_canvas(config, name, run_id)
        prepared = prepare(config, run_id)
        config = prepared.apply(config)
        classifier, budget = budgeted_classifier(config, prepared, run_id, config.epochs)
        start = initial_weights(config, classifier, prepared, run_id)
        spec, best, report = train_sparse(config, classifier, prepared, budget, run_id, start)
        tracking.log_dict(run_id, report.model_dump(), "sparsity/report.json")
        tracking.log_figure(run_id, sparsity_figure(
            report, f"{config.network.model}, {spec.build().describe()}"), "sparsity/layers.png")
        pruned = prune_dead_channels(classifier, prepared.dataset, best.checkpoint, report)
        tracking.log_metrics(run_id, pruned.metrics())
        tracking.log_artifact_refs(run_id, {"program.pruned": pruned.program})
        sweep = {config.sparsity_lambda: report}
        for lam in config.lambda_sweep or ():
            sweep[lam] = sweep.get(lam) or sweep_point(config, lam, classifier, prepared,
                                                       budget, run_id, start)
        if len(sweep) > 1:
            log_sweep(run_id, sweep, f"{config.network.model}, {spec.build().describe()}")
        finished = finish(run_id, name, config.run, classifier, prepared, best.checkpoint,
                          best.metrics["val_accuracy"])
        test_report = test_activations(classifier, prepared.dataset, best.checkpoint, spec)
        tracking.log_metrics(run_id, test_report.split_metrics())
        tracking.log_dict(run_id, test_report.model_dump(), "sparsity/test_report.json")
        tracking.log_figure(run_id, sparsity_figure(
            test_report, f"{config.network.model}, {spec.build().describe()}"),
            "sparsity/test_layers.png")
        summary = SparsifySummary(run_id=run_id, best_epoch=best.round + 1,
                                  val_accuracy=best.metrics["val_accuracy"],
                                  test_accuracy=finished.test_accuracy,
                                  baselines=prepared.baselines, spec=spec, report=report,
                                  test_report=test_report, pruned=pruned, sweep=sweep,
                                  registration=finished.registration)
    publish("sparsify-summary", f"sparsify: {config.network.model} on {config.dataset.data}",
            run_id, finished, {
        "sparsity term": f"{spec.build().describe()}, " + ", ".join(
            f"{k}: lambda {v:.3g}" for k, v in spec.lambdas.items()),
        "exact zeros (test)": ", ".join(
            f"{k} {v.zero_fraction:.3f}" for k, v in test_report.layers.items()),
        "exact zeros (validation: chose the round and the thresholds)": ", ".join(
            f"{k} {v.zero_fraction:.3f}" for k, v in report.layers.items()),
        **({"activation thresholds": ", ".join(f"{k} {v:.3g}" for k, v in
                                                report.thresholds.items()) or "none affordable"}
           if config.zero_threshold_tolerance is not None or config.zero_target is not None
           else {}),
        "stored as bitmap + values (test)":
            f"{test_report.metrics()['memory_bitmap_ratio']:.3f} of dense",
        "dead channels removed": f"{pruned.pruned_parameters} of {pruned.parameters} parameters "
                                 f"left, validation {pruned.pruned_val_accuracy:.4f}, CPU time "
                                 f"{pruned.metrics()['pruned_latency_ratio_b1']:.2f} of the "
                                 f"original's at batch 1",
        "best round (validation)": f"{summary.best_epoch} ({summary.val_accuracy:.4f})",
    })
    return summary
