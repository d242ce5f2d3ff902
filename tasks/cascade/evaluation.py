"""The `cascade` flow's evaluation tasks: threshold calibration on validation, the test of the
real cascade beside the full network, the plain confidence cascade, the two routings the
calibration chose between (fixed sub-networks, fitted predictors) and the oracle (with the
accuracy-latency sweep), and registration of the pyfunc that runs the real cascade.
"""

from __future__ import annotations

import dataclasses

from prefect import task
from pydantic import BaseModel, ConfigDict

from models.cascade import CascadeNet
from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.registration import Policy, Registration, log_weights_pyfunc, transient
from tasks.adapters.reporting import figure_pyplot
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.cascade.tasks import read_table, trained_cascade
from tasks.configs.cascade import CascadeConfig
from tasks.data import DatasetRef, load_dataset
from tasks.promotion import promote_on_test_images
from tasks.training import run_key
from training.batches import Normalize, eval_batches
from training.cascade.calibration import CalibrationGoal, Routing, calibrate_cascade
from training.cascade.learning import ExitTable, exit_table
from training.cascade.testing import ScoredImages, measure_cascade
from training.device import inference_batch, place_model, setup_device
from training.latency import part_costs

ROUTINGS: dict[str, str] = {  # what each routing of the super-network modules is, for people
    "fixed": "exits with fixed sub-networks (each routed module's most frequent choice on "
             "validation, no predictor run)",
    "fitted": "exits with fitted predictors (a sub-network chosen per image)",
    "most_expensive": "exits with the most expensive sub-networks (the plain cascade)",
}


class Calibration(BaseModel):
    """The thresholds written into the checkpoint, the cascade on validation, and `routing`:
    what the calibration chose for the super-network modules whose predictors were fitted
    (`ROUTINGS`), which is what the checkpoint, and so the registered model, runs; None when
    there was no choice (no fitted predictor, or `--thresholds` given)."""

    model_config = ConfigDict(frozen=True)

    checkpoint: ArtifactRef
    thresholds: list[float]
    metrics: dict[str, float]
    routing: Routing | None = None


class CascadeTest(BaseModel):
    """The test split's metrics, and the accuracy-latency curve over the sweep's tolerances."""

    model_config = ConfigDict(frozen=True)

    metrics: dict[str, float]
    sweep: list[dict[str, float]]


def validation_table(config: CascadeConfig, dataset: DatasetRef, net: CascadeNet,
                     costs: dict[str, float], split: str = "val",
                     fixed: dict[int, int] | None = None) -> ExitTable:
    device = setup_device(config)
    data = load_dataset(dataset)
    return exit_table(place_model(net, device), eval_batches(data, dataset, split, device), costs,
                      fixed)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="calibrate-thresholds")
def calibrate_exit_thresholds(config: CascadeConfig, dataset: DatasetRef, latency: ArtifactRef,
                         checkpoint: ArtifactRef) -> Calibration:
    """The exit thresholds and routing calibrated on validation for the config's goal
    (`training.cascade.calibration.calibrate_cascade`), written into a new checkpoint beside
    the thresholds of the references the test measures: the plain confidence cascade, the
    sweep of accuracy tolerances (the accuracy-latency curve) and, where fitted predictors
    route, both routings the calibration chose between, each with its own thresholds."""
    net = trained_cascade(config, dataset, checkpoint)
    goal = CalibrationGoal(calibrate=config.calibrate,
                           accuracy_tolerance=config.accuracy_tolerance,
                           latency_budget=config.latency_budget,
                           count_gains=config.count_gains, thresholds=config.thresholds,
                           route_shares=config.route_shares)
    costs = part_costs(read_table(latency))
    done = calibrate_cascade(
        net, lambda fixed: validation_table(config, dataset, net, costs, fixed=fixed), costs,
        goal)
    relpath = f"checkpoints/cascade/{run_key(config, dataset)}/calibrated.pt"
    payload = {"model": net.state_dict(), "plain_thresholds": done.plain_thresholds,
               "sweep": done.sweep, "routing": done.routing}
    return Calibration(checkpoint=save_checkpoint(ArtifactStore(), relpath, payload),
                       thresholds=done.thresholds.tolist(), metrics=done.metrics,
                       routing=done.chosen)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="test-cascade")
def test_cascade(config: CascadeConfig, dataset: DatasetRef, latency: ArtifactRef,
                 calibrated: ArtifactRef) -> CascadeTest:
    """The calibrated cascade (the registered model: the routing `Calibration.routing` names)
    on the test split beside the full network, the plain confidence cascade and the routings
    the calibration chose between, with the oracle and the accuracy-latency sweep
    (`training.cascade.testing.measure_cascade` says what each metric is)."""
    device = setup_device(config)
    net = place_model(trained_cascade(config, dataset, calibrated), device)
    data = load_dataset(dataset)
    test = data.splits["test"]
    images = ScoredImages(
        Normalize(dataset.mean, dataset.std)(data.images[test].to(device)),
        data.labels[test].to(device), lambda: eval_batches(data, dataset, "test", device))
    table = read_table(latency)
    measured = measure_cascade(net, images, load_checkpoint(ArtifactStore(), calibrated),
                               part_costs(table), part_costs(table, key="flops"),
                               inference_batch(device), config.serving_batch,
                               config.timing_images)
    return CascadeTest(metrics=measured.metrics, sweep=measured.sweep)


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: transient(state))
def register_cascade(run_id: str, name: str, config: CascadeConfig, dataset: DatasetRef,
                     calibrated: ArtifactRef, refusal: str | None) -> Registration:
    """Logs the calibrated cascade as a pyfunc (`serving.cascade`: the real cascade on
    raw images), scores it and the champion through their pyfuncs on the same test images,
    registers it, and makes it champion only if it scores higher and nothing refuses it
    (`refusal`: the raw-pixel baseline gate)."""
    meta = {"classes": dataset.classes, "image_size": dataset.image_size,
            "channels": dataset.channels, "mean": dataset.mean, "std": dataset.std,
            "spec": dataclasses.asdict(config.spec())}  # every field of the network's shape
    model_uri = log_weights_pyfunc(run_id, "cascade", meta,
                                   trained_cascade(config, dataset, calibrated).state_dict())
    return promote_on_test_images(run_id, name, model_uri, dataset, calibrated.md5,
                                  Policy.of(config.run), refusal)


def sweep_figure(sweep: list[dict[str, float]], full_accuracy: float, title: str):
    """Test accuracy against measured milliseconds per image at batch 1 over the sweep of
    accuracy tolerances, the full network marked."""
    pyplot = figure_pyplot()
    figure, axis = pyplot.subplots(figsize=(5.0, 3.4))
    times = [point["ms_per_image_b1"] for point in sweep]
    axis.plot(times, [point["test_accuracy"] for point in sweep], "o-", label="cascade")
    for point in sweep:
        axis.annotate(f"{point['tolerance']:g}", (point["ms_per_image_b1"],
                                                  point["test_accuracy"]), fontsize=7)
    full_ms = sweep[0]["ms_per_image_b1"] * sweep[0]["speedup_b1"]
    axis.plot([full_ms], [full_accuracy], "s", label="full network")
    axis.set_xlabel("ms per image, batch 1 (measured)")
    axis.set_ylabel("test accuracy")
    axis.set_title(title)
    axis.legend(loc="lower right")
    figure.tight_layout()
    return figure
