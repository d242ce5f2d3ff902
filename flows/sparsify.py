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
    begun_run,
    budgeted_classifier,
    finish,
    publish,
    tracked_flow_run,
)
from flows.sparsify_canvas import CanvasSummary, sparsify_canvas
from flows.steps.sparsify import FLOW_NAME, train_sparse
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.sections import ClassifierConfig
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.initial_weights import fetch_initial_weights
from tasks.sparsify import (
    PruneResult,
    log_sweep,
    prune_dead_channels,
    sparsity_figure,
    test_activations,
)
from training.budget import Budget
from training.sparsify.report import ActivationReport, SparsityReport

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary. Its step, which the `pipeline` composes too (a classifier's sparse rounds and their
# report), is `flows.steps.sparsify`'s.
__all__ = ["SparsifySummary", "sparsify"]

class SparsifySummary(ClassifierSummary):
    """What a `sparsify` run gives back: the model, its accuracy and its activations on the
    validation split (`report`: what chose the round, the thresholds and the dead channels)
    and on the test split (`test_report`: the figures to report)."""

    spec: SparsitySpec
    report: SparsityReport
    test_report: ActivationReport
    pruned: PruneResult
    sweep: dict[float, SparsityReport]


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
    config = config.replace(model=config.network_name())
    run_name = f"{FLOW_NAME}-{config.network.model}-{config.transform}-seed{config.run.seed}"
    if config.task != "classification":  # a canvas task prepares its own data
        name = config.run.registered_name(f"{FLOW_NAME}-{config.task}")
        with tracked_flow_run(config, config.run.experiment(FLOW_NAME), run_name, name,
                              {"task": config.task}) as run_id:
            return sparsify_canvas(config, name, run_id)
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        classifier, budget = budgeted_classifier(config, prepared, run_id, config.rounds)
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
        summary = SparsifySummary(run_id=run_id, best_round=best.round + 1,
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
        "best round (validation)": f"{summary.best_round} ({summary.val_accuracy:.4f})",
    })
    return summary
