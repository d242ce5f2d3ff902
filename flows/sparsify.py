"""The `sparsify` flow: a classifier trained with its task loss plus an activation-sparsity term.

loss = CE + sum over the chosen layers of lambda_l x S(map_l), where S is the mean of a
transform T of the layer's activations that is smallest at 0 (`training/sparsity.py`), and a
smaller map gets a larger lambda_l. The rounds are the `train` flow's (same budget, early
stopping, checkpoints); after them the kept network's activations are measured on the
validation split (exact zeros, near zeros, dead channels, bytes stored sparse), logged and
plotted, and the network is tested, registered and promoted like `train`'s.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.skeleton import budgeted_classifier, finish, prepare, publish, run_tags, train_epochs
from tasks import tracking
from tasks.config import SparsifyConfig, SparsitySpec
from tasks.registration import Registration
from tasks.sparsify import SparsityReport, sparsity_figure, sparsity_report, sparsity_spec

FLOW_NAME = "sparsify"


class SparsifySummary(BaseModel):
    """What a `sparsify` run gives back: the model, its accuracy and its activations."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    best_epoch: int
    val_accuracy: float
    test_accuracy: float
    baselines: dict[str, float]
    spec: SparsitySpec
    report: SparsityReport
    registration: Registration


@flow(name=FLOW_NAME, description="Train a classifier with an activation-sparsity term on "
      "chosen layers; measure its zeros, register it and promote it if it beats the champion "
      "and the raw-pixel baselines.")
def sparsify(config: SparsifyConfig) -> SparsifySummary:
    """Trains `config.model` with the sparsity term; registers it as `config.model_name`."""
    name = config.registered_name(FLOW_NAME)
    run_name = f"{FLOW_NAME}-{config.model}-{config.transform}-seed{config.seed}"
    with tracking.tracked_run(FLOW_NAME, run_name, config, run_tags(config)) as run_id:
        prepared = prepare(config, run_id)
        config = prepared.apply(config)
        classifier, budget = budgeted_classifier(config, prepared, run_id, config.epochs)
        spec = sparsity_spec(config, prepared.dataset)
        tracking.log_metrics(run_id, {f"lambda_{k.replace('.', '_')}": v
                                      for k, v in spec.lambdas.items()})
        get_run_logger().info("sparsity term %s on %s", spec.build().describe(), ", ".join(
            f"{k} (lambda {v:.3g})" for k, v in spec.lambdas.items()))
        best = train_epochs(classifier, prepared, budget, run_id, config.patience, FLOW_NAME,
                            sparsity=spec)
        report = sparsity_report(classifier, prepared.dataset, best.checkpoint, spec)
        tracking.log_metrics(run_id, report.metrics())
        tracking.log_dict(run_id, report.model_dump(), "sparsity/report.json")
        tracking.log_figure(run_id, sparsity_figure(
            report, f"{config.model}, {spec.build().describe()}"), "sparsity/layers.png")
        finished = finish(run_id, name, classifier, prepared, best.checkpoint,
                          best.metrics["val_accuracy"], gate=config.baseline_gate)
        summary = SparsifySummary(run_id=run_id, best_epoch=best.epoch + 1,
                                  val_accuracy=best.metrics["val_accuracy"],
                                  test_accuracy=finished.test_accuracy,
                                  baselines=prepared.baselines, spec=spec, report=report,
                                  registration=finished.registration)
    publish("sparsify-summary", f"sparsify: {config.model} on {config.data}", run_id, finished, {
        "sparsity term": f"{spec.build().describe()}, " + ", ".join(
            f"{k}: lambda {v:.3g}" for k, v in spec.lambdas.items()),
        "exact zeros (validation)": ", ".join(
            f"{k} {v.zero_fraction:.3f}" for k, v in report.layers.items()),
        "stored as bitmap + values": f"{report.metrics()['memory_bitmap_ratio']:.3f} of dense",
        "best round (validation)": f"{summary.best_epoch} ({summary.val_accuracy:.4f})",
    })
    return summary
