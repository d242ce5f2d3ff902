"""The `cascade` flow's evaluation tasks: threshold calibration on validation, the test of the
real cascade beside the full network, the plain confidence cascade, the two routings the
calibration chose between (fixed sub-networks, fitted predictors) and the oracle (with the
accuracy-latency sweep), and registration of the pyfunc that runs the real cascade.
"""

from __future__ import annotations

import dataclasses

import torch
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
from tasks.rounds import setup_device
from tasks.training import eval_batches, run_key
from training.batches import Normalize
from training.cascade.calibration import (
    CalibrationGoal,
    Routing,
    calibrate_cascade,
    full_network,
    routed_variant,
)
from training.cascade.learning import ExitTable, exit_table, oracles
from training.device import inference_batch, place_model
from training.latency import full_network_cost, interleaved_ms_per_image, part_costs

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
    """The calibrated cascade (the registered model: no prefix) on the test split beside the
    full network (`full_`: no exits, every super-network module at its most expensive
    sub-network), the plain confidence cascade (`plain_`: those sub-networks, exits
    calibrated alike) and, where the calibration chose between them, both routings of the
    super-network modules, each with the thresholds calibrated for it on validation:
    `fixed_` (each routed module's most frequent sub-network fixed, no predictor run) and
    `fitted_` (the fitted predictors route); the registered model is the one of them
    `Calibration.routing` names (or, `most_expensive`, the plain cascade's sub-networks).
    For each: accuracy of the real cascade, each exit's share, milliseconds per image measured
    at batch 1 (the first `timing_images` test images) and at the serving batch (interleaved
    passes), the speed-up over the full network (`speedup_b1` = full ms / its ms), the latency
    table's predicted cost and FLOPs per image, and the cost over the oracle's
    (`cost_over_oracle` = mean table cost / the oracle's; `flops_over_oracle` likewise in
    FLOPs). The oracle (`oracle_`: its cost by the table and, cheapest in FLOPs, its FLOPs).
    Then the sweep's accuracy, time at batch 1 (on at most 300 of those images) and cost by
    the table (over the full network's and over the oracle's)."""
    device = setup_device(config)
    net = place_model(trained_cascade(config, dataset, calibrated), device)
    payload = load_checkpoint(ArtifactStore(), calibrated)
    data = load_dataset(dataset)
    test = data.splits["test"]
    images = Normalize(dataset.mean, dataset.std)(data.images[test].to(device))
    labels = data.labels[test].to(device)
    full = full_network(net)
    never = torch.ones_like(net.thresholds)
    variants = {"": {}, "full_": {"thresholds": never, "fixed": full},
                "plain_": {"thresholds": payload["plain_thresholds"].to(device), "fixed": full}}
    nets = dict.fromkeys(variants, net)
    for name, chosen in payload.get("routing", {}).items():
        nets[f"{name}_"], variants[f"{name}_"] = routed_variant(net, chosen), {}
    table = read_table(latency)
    costs, flops = part_costs(table), part_costs(table, key="flops")
    full_cost, full_flops = full_network_cost(net, costs), full_network_cost(net, flops)
    metrics: dict[str, float] = {}
    tables: dict[str, ExitTable] = {}
    step = inference_batch(device)
    for prefix, kwargs in variants.items():
        variant = nets[prefix]
        out = [variant.infer(images[i:i + step], **kwargs) for i in range(0, len(images), step)]
        predicted, exits = torch.cat([o.labels for o in out]), torch.cat([o.exits for o in out])
        shares = torch.bincount(exits.cpu(), minlength=net.modules_count).float() / len(exits)
        fixed = kwargs.get("fixed")
        batches = eval_batches(data, dataset, "test", device)
        paths = tables[prefix] = exit_table(variant, batches, costs, fixed)
        thresholds = kwargs.get("thresholds", variant.thresholds).cpu()
        spent = paths.outcome(thresholds)
        spent_flops = paths.priced(variant, flops).outcome(thresholds)
        metrics |= {f"{prefix}test_accuracy": (predicted == labels).float().mean().item(),
                    f"{prefix}table_cost_ratio": spent["mean_cost"] / full_cost,
                    f"{prefix}flops_per_image": spent_flops["mean_cost"],
                    **{f"{prefix}exit_share_{k}": v for k, v in enumerate(shares.tolist())}}
    # (a) is timed as what it is, the plain forward pass (no exit heads but the last, no
    # bookkeeping); its accuracy above came from the cascade's code with no exit taken
    calls = {prefix: lambda x, n=nets[prefix], kw=kwargs: n.infer(x, **kw)
             for prefix, kwargs in variants.items() if prefix != "full_"} | {"full_": net}
    for batch, suffix in ((1, "b1"), (config.serving_batch, "serving")):
        sample = images[:config.timing_images] if batch == 1 else images
        measured = interleaved_ms_per_image(calls, sample, batch)
        metrics |= {f"{prefix}ms_per_image_{suffix}": ms for prefix, ms in measured.items()}
        metrics |= {f"{prefix}speedup_{suffix}": measured["full_"] / ms
                    for prefix, ms in measured.items() if prefix != "full_"}
    best, best_flops = oracles(net, eval_batches(data, dataset, "test", device),
                               [costs, flops])
    metrics |= {"oracle_accuracy": best["accuracy"],
                "oracle_table_cost_ratio": best["mean_cost"] / full_cost,
                "oracle_flops_per_image": best_flops["mean_cost"], "full_flops": full_flops}
    for prefix in variants.keys() - {"full_"}:
        metrics |= {f"{prefix}cost_over_oracle":
                    metrics[f"{prefix}table_cost_ratio"] * full_cost / best["mean_cost"],
                    f"{prefix}flops_over_oracle":
                    metrics[f"{prefix}flops_per_image"] / best_flops["mean_cost"]}
    sweep = []
    sample = images[:min(config.timing_images, 300)]
    for tolerance, thresholds in payload["sweep"].items():
        priced = tables[""].outcome(thresholds.cpu())["mean_cost"]
        thresholds = thresholds.to(device)
        predicted = torch.cat([net.infer(images[i:i + step], thresholds).labels
                               for i in range(0, len(images), step)])
        measured = interleaved_ms_per_image({"cascade": lambda x, t=thresholds: net.infer(x, t),
                                             "full": net},
                                            sample, 1)
        sweep.append({"tolerance": float(tolerance),
                      "test_accuracy": (predicted == labels).float().mean().item(),
                      "ms_per_image_b1": measured["cascade"],
                      "speedup_b1": measured["full"] / measured["cascade"],
                      "table_cost_ratio": priced / full_cost,
                      "cost_over_oracle": priced / best["mean_cost"],
                      **{f"threshold_{k}": t for k, t in enumerate(thresholds.tolist())}})
    return CascadeTest(metrics=metrics, sweep=sweep)


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
