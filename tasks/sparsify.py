"""The `sparsify` flow's tasks: the sparsity term fitted to the network, activation thresholds
calibrated on validation, what the trained network's activations look like (zeros, dead
channels, memory when stored sparse) on validation and, for the report, on the test split the
thresholds never saw, and the network with its dead channels removed (smaller, re-validated,
timed)."""

from __future__ import annotations

from pathlib import Path

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.reporting import figure_pyplot
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig, classifier_config
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.data import DatasetRef, load_dataset
from tasks.training import trained_model
from training.batches import eval_batches
from training.device import place_model, setup_device
from training.features import export_program
from training.loops import evaluate
from training.rounds import new_model
from training.sparsify.pruning import median_latency, parameter_count, prune_channels
from training.sparsify.report import (
    ActivationReport,
    SparsityReport,
    measured_layers,
    measured_report,
)
from training.sparsify.term import (
    activation_stats,
    layer_lambdas,
    layer_shapes,
    map_area,
)
from training.sparsify.thresholds import (
    calibrate_thresholds,
    raise_thresholds,
    thresholds_in_place,
    thresholds_toward,
)

SPLIT_NAMES = {"val": "validation", "test": "test"}


def sparsity_spec(config: SparsifyConfig, dataset: DatasetRef) -> SparsitySpec:
    """The config's sparsity term for its network on the data's images: each layer's lambda
    (`training.sparsify.term.layer_lambdas`, by the map areas the network really produces)."""
    model = new_model(classifier_config(config), dataset)
    example = torch.zeros(1, dataset.channels, dataset.image_size, dataset.image_size)
    shapes = layer_shapes(model, config.layers(), example)
    lambdas = layer_lambdas({name: map_area(shape) for name, shape in shapes.items()},
                            config.sparsity_lambda, config.lambda_gamma, config.layer_lambdas)
    return SparsitySpec(lambdas=lambdas, transform=config.transform, power=config.power,
                        abs_power=config.abs_power, base=config.base)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="sparsity-report")
def sparsity_report(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                    spec: SparsitySpec) -> SparsityReport:
    """Scores the checkpoint on the validation split and measures its regularized layers:
    exact zeros, |x| < 1e-3, channels dead on 99% of the images, bytes per image stored dense,
    as a bitmap plus values, and as CSR (`training.sparsify.term.activation_memory`)."""
    device = setup_device(config)
    model = place_model(trained_model(config, dataset, checkpoint), device)
    data = load_dataset(dataset)
    val = eval_batches(data, dataset, "val", device)
    accuracy = evaluate(model, val, device)["accuracy"]
    stats = activation_stats(model, list(spec.lambdas), val, device)
    return measured_report(stats, spec.lambdas, "accuracy", accuracy)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="test-activations")
def test_activations(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                     spec: SparsitySpec) -> ActivationReport:
    """The checkpoint's regularized layers (its thresholds in place, as served) measured on
    the test split, which chose neither the round, nor the thresholds, nor the dead channels:
    per layer the share of exact zeros `z = #{x == 0} / #values` over every test image's
    map, |x| < 1e-3, channels all zero on at least 99% of the test images, and the bytes
    stored three ways (`training.sparsify.term.activation_memory`)."""
    device = setup_device(config)
    model = place_model(trained_model(config, dataset, checkpoint), device)
    test = eval_batches(load_dataset(dataset), dataset, "test", device)
    stats = activation_stats(model, list(spec.lambdas), test, device)
    return ActivationReport(split="test", layers=measured_layers(stats, spec.lambdas))


class Calibrated(BaseModel):
    """Activation thresholds calibrated on a checkpoint (`training.sparsify.thresholds`; per layer
    the larger of the checkpoint's own and the new one) and its validation accuracy without the new
    ones and with them."""

    model_config = ConfigDict(frozen=True)

    thresholds: dict[str, float]
    val_accuracy_before: float
    val_accuracy: float

    def metrics(self) -> dict[str, float]:
        """`zero_threshold_<layer>` and the validation accuracy without them."""
        return {f"zero_threshold_{k.replace('.', '_')}": v for k, v in self.thresholds.items()
                } | {"val_accuracy_unthresholded": self.val_accuracy_before}


class Thresholded(Calibrated):
    """`Calibrated`, written with the weights as a checkpoint of their own."""

    checkpoint: ArtifactRef


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="calibrate-thresholds")
def calibrate_zero_thresholds(config: ClassifierConfig, dataset: DatasetRef,
                              checkpoint: ArtifactRef, layers: tuple[str, ...],
                              tolerance: float, floor: float | None = None) -> Thresholded:
    """Per layer, the largest activation threshold that keeps validation accuracy within
    `tolerance` of the checkpoint's (`training.sparsify.thresholds.calibrate_thresholds`), written
    with the weights as a new checkpoint versioned in DVC. A checkpoint that has thresholds
    (a `--threshold-cycles` round) is calibrated with them in place, each layer keeps the
    larger of its old and new threshold, and `floor` (the first calibration's unthresholded
    accuracy minus `tolerance`) is the accuracy all of them together may not go below."""
    device = setup_device(config)
    model = place_model(trained_model(config, dataset, checkpoint), device)
    val = eval_batches(load_dataset(dataset), dataset, "val", device)
    added, before, after = calibrate_thresholds(
        model, layers, val, device, lambda net: evaluate(net, val, device)["accuracy"],
        tolerance, floor)
    return write_thresholded(model, checkpoint, Calibrated(
        thresholds=raised_thresholds(checkpoint, added), val_accuracy_before=before,
        val_accuracy=after), f"{tolerance:g}")


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="thresholds-for-zeros")
def zero_target_thresholds(config: ClassifierConfig, dataset: DatasetRef,
                           checkpoint: ArtifactRef, layers: tuple[str, ...], target: float,
                           step: float) -> Thresholded:
    """`--zero-target`: per layer, the activation threshold that takes its share of exact
    zeros on the validation split `step` of the way to `target` (`zero_target_step`), written
    with the weights as a new checkpoint versioned in DVC."""
    model, calibrated = _toward_zero_target(config, dataset, checkpoint, layers, target, step)
    return write_thresholded(model, checkpoint, calibrated, f"zeros-{target:g}")


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="ramp-thresholds")
def zero_target_step(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                     layers: tuple[str, ...], target: float, step: float) -> Calibrated:
    """Per layer, the activation threshold that takes its share of exact zeros on the
    validation split `step` of the way to `target` (1: all the way; the checkpoint's thresholds in
    place, each layer keeps the larger; `training.sparsify.thresholds.thresholds_toward`), and the
    validation accuracy before and after. Nothing is written: a ramp's next round trains with these
    thresholds and stores them in its own checkpoint."""
    return _toward_zero_target(config, dataset, checkpoint, layers, target, step)[1]


def _toward_zero_target(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                        layers: tuple[str, ...], target: float, step: float
                        ) -> tuple[torch.nn.Module, Calibrated]:
    device = setup_device(config)
    model = place_model(trained_model(config, dataset, checkpoint), device)
    val = eval_batches(load_dataset(dataset), dataset, "val", device)
    before = evaluate(model, val, device)["accuracy"]
    added = thresholds_toward(model, layers, val, device, target, step)
    with thresholds_in_place(model, added):
        after = evaluate(model, val, device)["accuracy"]
    return model, Calibrated(thresholds=raised_thresholds(checkpoint, added),
                             val_accuracy_before=before, val_accuracy=after)


def raised_thresholds(checkpoint: ArtifactRef, added: dict[str, float]) -> dict[str, float]:
    """The checkpoint's thresholds raised by `added` (per layer the larger)."""
    return raise_thresholds(load_checkpoint(ArtifactStore(), checkpoint).get("thresholds", {}),
                            added)


def write_thresholded(model: torch.nn.Module, checkpoint: ArtifactRef, calibrated: Calibrated,
                      label: str) -> Thresholded:
    """`model`'s weights with `calibrated`'s thresholds as a new checkpoint beside
    `checkpoint` (`...-thresholds-<label>.pt`, versioned in DVC)."""
    payload = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
               "thresholds": calibrated.thresholds}
    relpath = str(Path(checkpoint.path).with_name(Path(checkpoint.path).stem +
                                                  f"-thresholds-{label}.pt"))
    return Thresholded(**calibrated.model_dump(),
                       checkpoint=save_checkpoint(ArtifactStore(), relpath, payload))


def sparsity_figure(report: ActivationReport, title: str):
    """A bar chart of each layer's share of exact zeros and of |x| < 1e-3 on the report's
    split."""
    pyplot = figure_pyplot()
    names = list(report.layers)
    figure, axis = pyplot.subplots(figsize=(1.6 + 1.2 * len(names), 3.2))
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], [report.layers[n].zero_fraction for n in names],
             width=0.4, label="exact zeros")
    axis.bar([p + 0.2 for p in positions], [report.layers[n].near_zero_fraction for n in names],
             width=0.4, label="|x| < 1e-3")
    axis.set_xticks(list(positions), names)
    axis.set_ylim(0, 1)
    axis.set_ylabel(f"share of activations ({SPLIT_NAMES[report.split]})")
    axis.set_title(title)
    axis.legend(loc="lower right")
    figure.tight_layout()
    return figure


class PruneResult(BaseModel):
    """The network with its dead channels removed, re-validated and timed against the original
    on this machine's CPU."""

    model_config = ConfigDict(frozen=True)

    parameters: int
    pruned_parameters: int
    val_accuracy: float
    pruned_val_accuracy: float
    latency: dict[str, float]  # seconds per forward pass: `original_b1`, `pruned_b1`, ...
    program: ArtifactRef

    def metrics(self) -> dict[str, float]:
        """`pruned_parameter_ratio`, `pruned_val_accuracy`, `pruned_latency_ratio_b<N>`."""
        batches = sorted({int(k.split("_b")[1]) for k in self.latency})
        return {"pruned_parameter_ratio": self.pruned_parameters / self.parameters,
                "pruned_val_accuracy": self.pruned_val_accuracy,
                "pruned_val_accuracy_change": self.pruned_val_accuracy - self.val_accuracy} | {
            f"pruned_latency_ratio_b{n}": self.latency[f"pruned_b{n}"]
            / self.latency[f"original_b{n}"] for n in batches}


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="prune-dead-channels")
def prune_dead_channels(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                        report: SparsityReport, batch_sizes: tuple[int, ...] = (1, 256)
                        ) -> PruneResult:
    """Removes the report's dead channels (`training.sparsify.pruning`), re-validates the smaller
    network, times both on the CPU (median of interleaved forward passes at each batch size)
    and exports the pruned network as a program versioned in DVC."""
    model = trained_model(config, dataset, checkpoint).eval()
    example = torch.zeros(1, dataset.channels, dataset.image_size, dataset.image_size)
    pruned = prune_channels(model, {name: layer.dead_channel_ids
                                    for name, layer in report.layers.items()}, example)
    data = load_dataset(dataset)
    cpu = torch.device("cpu")
    val = eval_batches(data, dataset, "val", cpu)
    accuracy = {name: evaluate(net, val, cpu)["accuracy"]
                for name, net in (("original", model), ("pruned", pruned))}
    latency = {}
    for size in batch_sizes:
        inputs = torch.randn(size, *example.shape[1:])
        timed = median_latency({"original": model, "pruned": pruned}, inputs)
        latency |= {f"{name}_b{size}": seconds for name, seconds in timed.items()}
    relpath = f"sparsify/{checkpoint.md5}/pruned.pt2"
    program = ArtifactStore().write(relpath, lambda path: export_program(
        pruned, dataset.channels, dataset.image_size, path))
    return PruneResult(parameters=parameter_count(model), pruned_parameters=parameter_count(
        pruned), val_accuracy=accuracy["original"], pruned_val_accuracy=accuracy["pruned"],
        latency=latency, program=program)


def sweep_figure(points: dict[float, SparsityReport], title: str):
    """The validation score against the mean share of exact zeros, one point per lambda."""
    pyplot = figure_pyplot()
    lambdas = sorted(points)
    zeros = [points[lam].metrics()["zero_fraction"] for lam in lambdas]
    scores = [points[lam].val_score for lam in lambdas]
    figure, axis = pyplot.subplots(figsize=(4.8, 3.4))
    axis.plot(zeros, scores, marker="o")
    for lam, x, y in zip(lambdas, zeros, scores, strict=True):
        axis.annotate(f"{lam:g}", (x, y), textcoords="offset points", xytext=(4, 4))
    axis.set_xlabel("exact zeros in the regularized layers (validation)")
    axis.set_ylabel(f"validation {points[lambdas[0]].score_name}")
    axis.set_title(title)
    figure.tight_layout()
    return figure


def log_sweep(run_id: str, points: dict[float, SparsityReport], title: str) -> None:
    """A lambda sweep's points on the run: `sparsity/sweep.json` (each lambda's zeros and
    score, on validation: `val_zero_fraction`, `val_accuracy`, ...) and the plot
    `sparsity/sweep.png`."""
    from tasks.adapters import tracking

    tracking.log_dict(run_id, {
        f"{lam:g}": point.split_metrics() | {f"val_{point.score_name}": point.val_score}
        for lam, point in sorted(points.items())}, "sparsity/sweep.json")
    tracking.log_figure(run_id, sweep_figure(points, title), "sparsity/sweep.png")
