"""The `train` flow: one classifier trained, tested, registered, and promoted if it wins."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from tasks import tracking
from tasks.config import DataSection, TrainConfig
from tasks.data import DatasetRef, prepare_dataset, source_version
from tasks.registration import Registration, register_and_promote
from tasks.reporting import publish_summary
from tasks.training import EpochResult, classifier_config, test_and_export, train_classifier_epoch

FLOW_NAME = "train"


class TrainSummary(BaseModel):
    """What a `train` run gives back: where everything is and how good it is."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    best_epoch: int
    val_accuracy: float
    test_accuracy: float
    registration: Registration


def data_section(config: BaseModel) -> DataSection:
    """The data part of a flow config."""
    return DataSection(**config.model_dump(include=set(DataSection.model_fields)))


def run_tags(config: BaseModel) -> dict[str, str]:
    """The tags every flow's MLflow run gets: its Prefect flow run, and the config's profile."""
    return {"prefect.flow_run_id": str(flow_run.get_id() or "none"),
            "profile": config.profile}


def prepare(config: BaseModel, run_id: str) -> DatasetRef:
    """Prepares the run's data set and records its version on the run."""
    data = data_section(config)
    dataset = prepare_dataset(data, source_version(data))
    tracking.log_artifact_refs(run_id, {"dataset": dataset.artifact})
    tracking.set_tags(run_id, {"data.version": dataset.version, "data.skipped_images":
                               len(dataset.skipped), "data.classes": ",".join(dataset.classes)})
    tracking.log_metrics(run_id, {f"data_{k}_images": v for k, v in dataset.sizes.items()})
    return dataset


def train_epochs(config: TrainConfig, dataset: DatasetRef, run_id: str) -> EpochResult:
    """Runs the epochs (with early stopping on validation accuracy); returns the best one."""
    logger = get_run_logger()
    classifier = classifier_config(config)
    previous, best, stale = None, None, 0
    for epoch in range(config.epochs):
        result = train_classifier_epoch(classifier, dataset, epoch, previous, FLOW_NAME)
        tracking.log_metrics(run_id, result.metrics, step=epoch + 1)
        tracking.log_artifact_refs(run_id, {f"checkpoint.epoch-{epoch + 1:03d}":
                                            result.checkpoint})
        logger.info("epoch %d/%d: %s", epoch + 1, config.epochs, ", ".join(
            f"{k}={v:.4g}" for k, v in result.metrics.items()))
        previous = result.checkpoint
        if best is None or result.metrics["val_accuracy"] > best.metrics["val_accuracy"]:
            best, stale = result, 0
        else:
            stale += 1
            if config.patience is not None and stale >= config.patience:
                logger.info("early stop: no better validation accuracy for %d epochs", stale)
                break
    return best


@flow(name=FLOW_NAME, description="Train one classifier, test it, register it in MLflow and "
      "promote it to champion only if it beats the current one.")
def train(config: TrainConfig) -> TrainSummary:
    """Trains `config.model` on `config.data`; registers it as `config.model_name`."""
    name = config.registered_name(FLOW_NAME)
    run_name = f"{FLOW_NAME}-{config.model}-seed{config.seed}"
    with tracking.tracked_run(FLOW_NAME, run_name, config, run_tags(config)) as run_id:
        dataset = prepare(config, run_id)
        best = train_epochs(config, dataset, run_id)
        tracking.log_artifact_refs(run_id, {"checkpoint.best": best.checkpoint})
        test = test_and_export(classifier_config(config), dataset, best.checkpoint)
        tracking.log_metrics(run_id, test.metrics)
        tracking.log_artifact_refs(run_id, {"program": test.program})
        registration = register_and_promote(run_id, name, dataset, test.program)
        summary = TrainSummary(run_id=run_id, best_epoch=best.epoch + 1,
                               val_accuracy=best.metrics["val_accuracy"],
                               test_accuracy=test.metrics["test_accuracy"],
                               registration=registration)
    markdown = publish_summary("train-summary", f"train: {config.model} on {config.data}", {
        "test accuracy": f"{summary.test_accuracy:.4f}",
        "best epoch (validation)": f"{summary.best_epoch} ({summary.val_accuracy:.4f})",
        "model": f"{name} version {registration.version}, alias `{registration.alias}`",
        "decision": registration.decision,
        "MLflow run": run_id,
    })
    get_run_logger().info("summary\n%s", markdown)
    return summary
