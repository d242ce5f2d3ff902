"""The `sparsify` flow's detection and contour tasks: the layout canvases built from the data's
images and versioned, rounds of training with the sparsity term (checkpointed, resumable),
scoring, and the activations of the regularized layers.

The canvases depend on the data and `split_seed` only, never on the training seed, so every
run of the same data is scored on the same test canvases (the champion comparison needs that).
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
import torch
from prefect import task
from pydantic import BaseModel, ConfigDict
from torch import nn

from models.canvas import build_task_model
from serving.canvas import served_scores
from tasks.adapters import tracking
from tasks.adapters.caching import computation_key, result_fields
from tasks.adapters.checkpoints import load_checkpoint, torch_save
from tasks.adapters.registration import (
    Policy,
    Registration,
    log_weights_pyfunc,
    promote,
    served_ms_per_image,
    transient,
)
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import RoundPlan
from training.canvas.contours import contour_scores
from training.canvas.detection import as_rgb, detect, mean_average_precision
from training.canvas.layouts import LayoutBatches, Layouts, LayoutSpec, make_layouts
from training.canvas.rounds import TARGET, CanvasStep, LayoutPasses
from training.device import place_model, setup_device
from training.promotion import Scored
from training.recipe import make_optimizer, optimizer_to
from training.rounds import Closed, Opened, Trainee, configured_round
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

SPLITS = ("train", "val", "test")
SCORE = {"detection": "map_50", "contour": "boundary_f"}
EVAL_BATCH = 32


class LayoutsRef(BaseModel):
    """The versioned canvases of a run (`training.canvas.layouts`), with what they were made of."""

    model_config = ConfigDict(frozen=True)

    artifact: ArtifactRef
    classes: list[str]
    canvas: int
    sizes: dict[str, int]
    objects: dict[str, int]


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="build-layouts")
def build_layouts(dataset: DatasetRef, canvas: int, counts: tuple[int, int, int],
                  max_objects: int, seed: int) -> LayoutsRef:
    """Canvases of the data set's train, validation and test images (each split's canvases
    hold only that split's images), written, renamed and versioned in DVC."""
    if dataset.channels != 1 or dataset.image_size != 28:
        raise ValueError(f"layouts need 28-pixel gray items, got {dataset.channels} channels "
                         f"at {dataset.image_size} pixels")
    data = load_dataset(dataset)
    spec = LayoutSpec(canvas=canvas, max_objects=max_objects)
    parts = {}
    for index, (split, count) in enumerate(zip(SPLITS, counts, strict=True)):
        rows = data.splits[split]
        parts[split] = make_layouts(data.images[rows, 0], data.labels[rows], count, spec,
                                    seed=seed * len(SPLITS) + index).state()
    key = hashlib.md5(json.dumps([dataset.artifact.md5, canvas, list(counts), max_objects,
                                  seed]).encode()).hexdigest()[:16]
    ref = ArtifactStore().write(f"layouts/{key}.pt", lambda path: torch_save(parts, path))
    return LayoutsRef(artifact=ref, classes=dataset.classes, canvas=canvas,
                      sizes={s: len(parts[s]["images"]) for s in SPLITS},
                      objects={s: sum(len(b) for b in parts[s]["boxes"]) for s in SPLITS})


def load_layouts(ref: LayoutsRef, split: str) -> Layouts:
    """One split's canvases (pulled by hash if missing; the file is read once per process)."""
    return Layouts.from_state(_layout_parts(ref.artifact)[split])


@functools.lru_cache(maxsize=2)
def _layout_parts(artifact: ArtifactRef) -> dict:
    return torch.load(ArtifactStore().fetch(artifact), map_location="cpu", weights_only=True)


def new_network(config: SparsifyConfig, layouts: LayoutsRef) -> nn.Module:
    """The config's untrained network for the layouts' classes, initialised from the seed."""
    torch.manual_seed(config.run.seed)
    return build_task_model(config.task, config.network_name(), len(layouts.classes),
                            layouts.canvas, config.network.width)


def canvas_sparsity_spec(config: SparsifyConfig, layouts: LayoutsRef) -> SparsitySpec:
    """The sparsity term for the network on a canvas: each layer's lambda by its map's area
    (`training.sparsify.term.layer_lambdas`)."""
    model = new_network(config, layouts).eval()
    example = torch.zeros(1, 1, layouts.canvas, layouts.canvas)
    if config.task == "detection":
        example = torch.stack(as_rgb(example))
    shapes = layer_shapes(model, config.layers(), example)
    lambdas = layer_lambdas({name: map_area(shape) for name, shape in shapes.items()},
                            config.sparsity_lambda, config.lambda_gamma, config.layer_lambdas)
    return SparsitySpec(lambdas=lambdas, transform=config.transform, power=config.power,
                        abs_power=config.abs_power, base=config.base)


def trained_network(config: SparsifyConfig, layouts: LayoutsRef, checkpoint: ArtifactRef
                    ) -> nn.Module:
    """The network with a checkpoint's weights, on the CPU."""
    model = new_network(config, layouts)
    model.load_state_dict(load_checkpoint(ArtifactStore(), checkpoint)["model"])
    return model


def score(config: SparsifyConfig, model: nn.Module, layouts: Layouts,
          device: torch.device) -> dict[str, float]:
    """The task's scores on canvases: `map_50`, `map` (detection) or `boundary_f`, its
    precision and recall, and `mask_iou` (contour)."""
    batches = LayoutBatches(layouts, TARGET[config.task], EVAL_BATCH, device)
    if config.task == "detection":
        return mean_average_precision(*detect(model, batches, device))
    return contour_scores(model, batches, device, config.boundary_tolerance)


class CanvasRound(RoundPlan):
    """Round `round` (0-based) of `config.rounds`: one shuffled, flipped pass over the
    training canvases on the cosine schedule of the whole run, with the sparsity term when
    given; then the validation canvases are scored (`val_map_50` or `val_boundary_f`). It
    trains in one process (`training.canvas.rounds`)."""

    config: SparsifyConfig
    layouts: LayoutsRef
    round: int
    sparsity: SparsitySpec | None = None

    @property
    def number(self) -> int:
        return self.round

    def task_name(self) -> str:
        return f"{self.config.task}-{self.round + 1}"

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        config = self.config
        model = new_network(config, self.layouts)
        optimizer = make_optimizer(model, config)
        if previous is not None:
            state = load_checkpoint(ArtifactStore(), previous)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        model = place_model(model, device)
        optimizer_to(optimizer, device)
        round_ = configured_round(
            config, None, CanvasStep(config.task),
            LayoutPasses(load_layouts(self.layouts, "train"), config.task, config.optim.batch_size,
                         config.run.seed),
            (self.round,), (0, config.rounds), config.optim.warmup_rounds,
            sparsity=None if self.sparsity is None else self.sparsity.term(),
            progress=config.task if config.run.progress else None)
        return Opened(Trainee(model, optimizer), round_)

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        model = opened.trainee.model
        scores = score(self.config, model, load_layouts(self.layouts, "val"), device)
        payload = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
                   "optimizer": opened.trainee.optimizer.state_dict(), "round": self.round}
        return Closed(metrics | {f"val_{k}": v for k, v in scores.items()}, payload)

    def relpath(self) -> str:
        key = hashlib.md5(json.dumps([result_fields(self.config), self.layouts.artifact.md5,
                                      self.sparsity.model_dump() if self.sparsity else None],
                                     sort_keys=True).encode()).hexdigest()[:12]
        return f"sparsify/{key}/round-{self.round + 1:03d}.pt"


def _activations(config: SparsifyConfig, model: nn.Module, layouts: Layouts, layers: list[str],
                 device: torch.device) -> dict:
    """`activation_stats` of `layers` over one split's canvases."""
    batches = LayoutBatches(layouts, TARGET[config.task], EVAL_BATCH, device)
    if config.task == "detection":
        batches = [(ids, torch.stack(as_rgb(x)), y) for ids, x, y in batches]
    return activation_stats(model, layers, batches, device)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="sparsity-report")
def canvas_sparsity_report(config: SparsifyConfig, layouts: LayoutsRef, checkpoint: ArtifactRef,
                          spec: SparsitySpec) -> SparsityReport:
    """The checkpoint's regularized layers on the validation canvases (zeros, dead channels,
    bytes stored sparse), with its validation score."""
    device = setup_device(config)
    model = place_model(trained_network(config, layouts, checkpoint), device)
    val = load_layouts(layouts, "val")
    stats = _activations(config, model, val, list(spec.lambdas), device)
    name = SCORE[config.task]
    return measured_report(stats, spec.lambdas, name, score(config, model, val, device)[name])


class CanvasTest(BaseModel):
    """The kept network on the test canvases, which chose nothing: its scores
    (`test_map_50`, `test_boundary_f`, ...) and its regularized layers' activations."""

    model_config = ConfigDict(frozen=True)

    scores: dict[str, float]
    activations: ActivationReport


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="test-canvases")
def test_canvas(config: SparsifyConfig, layouts: LayoutsRef, checkpoint: ArtifactRef,
               spec: SparsitySpec) -> CanvasTest:
    """The checkpoint's scores and its regularized layers' exact zeros (as `sparsify`'s
    classification reports them) on the test canvases."""
    device = setup_device(config)
    model = place_model(trained_network(config, layouts, checkpoint), device)
    test = load_layouts(layouts, "test")
    stats = _activations(config, model, test, list(spec.lambdas), device)
    return CanvasTest(scores={f"test_{k}": v for k, v in score(config, model, test,
                                                              device).items()},
                     activations=ActivationReport(split="test",
                                                  layers=measured_layers(stats, spec.lambdas)))


CANVAS_RESAMPLES = 200  # one aggregate is a whole COCO evaluation: a paired bootstrap of 200


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: transient(state))
def register_canvas(run_id: str, name: str, config: SparsifyConfig, layouts: LayoutsRef,
                   checkpoint: ArtifactRef) -> Registration:
    """Logs the network as a pyfunc (`serving.canvas`), scores it and the champion
    through their pyfuncs on the same test canvases (`test_map_50` or `test_boundary_f`),
    registers it and makes it champion only if it scores higher."""
    meta = {"task": config.task, "model": config.network_name(), "width": config.network.width,
            "classes": layouts.classes, "canvas": layouts.canvas}
    model_uri = log_weights_pyfunc(run_id, "canvas", meta,
                                   trained_network(config, layouts, checkpoint).state_dict())
    test = load_layouts(layouts, "test")
    images = test.images[:, 0].numpy()
    metric = SCORE[config.task]

    def served(uri: str) -> Scored:
        predictions = tracking.load_pyfunc(uri).predict(images)

        def aggregate(index: np.ndarray) -> float:
            return served_scores(config.task, predictions.iloc[index].reset_index(drop=True),
                                 test.subset(torch.as_tensor(index)), layouts.classes,
                                 config.boundary_tolerance)[metric]

        return Scored(len(images), aggregate, CANVAS_RESAMPLES)

    return promote(run_id, name, model_uri, served, layouts.classes, checkpoint.md5,
                   {"dataset": layouts.artifact.md5, "task": config.task}, Policy.of(config.run),
                   metric=f"test_{metric}", timer=lambda uri: served_ms_per_image(uri, images))
