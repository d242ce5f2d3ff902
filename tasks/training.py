"""Training a classifier: its round (`ClassifierRound`, trained by `tasks.rounds.round_task`),
the parts every classifier technique shares (the seeded network, resume, batches, budget), and
the final test evaluation and export.

Each round loads the previous checkpoint by reference, trains, scores the validation split,
writes and versions a new checkpoint, and returns only the reference and the metrics. Rounds
are cached on their inputs (config, data set, round, previous checkpoint) and the code's
version, so re-running a flow after a crash skips the rounds already done and resumes from the
last one.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict
from torch import nn

from models import ImageClassifier
from tasks.adapters.caching import computation_key, result_fields
from tasks.adapters.checkpoints import load_checkpoint
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.configs.sparsify import SparsitySpec
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import RoundPlan
from training.batches import eval_batches
from training.device import place_model, setup_device
from training.features import export_program
from training.loops import evaluate
from training.recipe import make_optimizer, optimizer_to, restore
from training.rounds import (
    Closed,
    Opened,
    Trainee,
    classifier_round,
    new_model,
)
from training.sparsify.thresholds import install_thresholds, thresholds_in_place


def run_key(config: BaseModel, dataset: DatasetRef) -> str:
    """A short digest naming a training run's checkpoints (its result-relevant config, data)."""
    text = json.dumps([result_fields(config), dataset.artifact.md5], sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest()[:12]


def resume(config: ClassifierConfig, dataset: DatasetRef, store: ArtifactStore,
           previous: ArtifactRef | None, device: torch.device, payload: dict | None = None
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded network and its optimizer on `device`, continuing from the checkpoint
    `previous` when given, with `config`'s own momentum and weight decay (see `restore`).
    `payload` is that checkpoint's content when the caller has loaded it already."""
    model = new_model(config, dataset)
    optimizer = make_optimizer(model, config)
    if previous is not None:
        restore(model, optimizer, payload or load_checkpoint(store, previous), config)
    model = place_model(model, device)
    optimizer_to(optimizer, device)
    return model, optimizer


# The live model and optimizer of the last round this process finished, keyed by the checkpoint
# they wrote and the run's key. The next round of the same run continues from them instead of
# rebuilding both from that checkpoint: the same state, and measurably faster on CPUs (a rebuilt
# model trained 3-5% slower for the whole round here). A round takes the entry out before it
# trains, so a failed round never leaves a half-trained model behind to be reused.
_WARM: dict[tuple[str, str], tuple[nn.Module, torch.optim.Optimizer]] = {}
_WARM_LOCK = threading.Lock()


def _take_warm(previous: ArtifactRef | None, key: str):
    with _WARM_LOCK:
        if previous is None:
            return None, None
        return _WARM.pop((previous.md5, key), (None, None))


def _keep_warm(checkpoint: ArtifactRef, key: str, model: nn.Module,
               optimizer: torch.optim.Optimizer) -> None:
    with _WARM_LOCK:
        _WARM.clear()  # one run's model at a time: memory stays bounded
        _WARM[(checkpoint.md5, key)] = (model, optimizer)


class ClassifierRound(RoundPlan):
    """Round `round` (0-based) of `config.rounds`: `repeats` passes over the training images
    (`training.budget`; 1 on a large data set) on the cosine schedule of the whole run, then
    the validation split scored. `sparsity`: the `sparsify` flow's activation-sparsity term,
    added to the loss. `start`: the weights the first round starts from (fine-tuning,
    `tasks.initial_weights`; its optimizer starts afresh), instead of the seed's
    initialization. `run_name` names the checkpoints' folder."""

    config: ClassifierConfig
    dataset: DatasetRef
    round: int
    run_name: str = "train"
    repeats: int = 1
    sparsity: SparsitySpec | None = None
    start: ArtifactRef | None = None

    @property
    def number(self) -> int:
        return self.round

    def task_name(self) -> str:
        return f"round-{self.round + 1}"  # 1-based, like checkpoints and steps

    def key(self) -> str:
        """Names the run's checkpoints: its config, data, passes per round, term, start."""
        return run_key(self.config, self.dataset) + (
            f"-x{self.repeats}" if self.repeats > 1 else "") + (
            "" if self.sparsity is None else "-" + run_key(self.sparsity, self.dataset)) + (
            "" if self.start is None else f"-from-{self.start.md5[:12]}")

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        config, repeats = self.config, self.repeats
        data = load_dataset(self.dataset)
        model, optimizer = _take_warm(previous, self.key())
        if model is None:
            model, optimizer = resume(config, self.dataset, ArtifactStore(),
                                      previous or self.start, device)
        passes = range(self.round * repeats, (self.round + 1) * repeats)
        progress = f"round {self.round + 1}/{config.rounds}" if config.run.progress else None
        round_ = classifier_round(config, self.dataset, data, passes,
                                  (0, config.rounds * repeats),
                                  config.optim.warmup_rounds * repeats,
                                  progress, sparsity=self.sparsity)
        return Opened(Trainee(model, optimizer), round_, {"data": data})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        config, model = self.config, opened.trainee.model
        started = time.perf_counter()
        thresholds = {} if self.sparsity is None else self.sparsity.thresholds
        with thresholds_in_place(model, thresholds):  # the network as it trained
            val = evaluate(model, eval_batches(opened.context["data"], self.dataset, "val",
                                               device), device)
        images = len(opened.round.passes) * (
            self.dataset.sizes["train"] // config.optim.batch_size) * config.optim.batch_size
        metrics = metrics | {"val_accuracy": val["accuracy"], "val_loss": val["loss"],
                             "images_per_second": images / seconds, "train_seconds": seconds,
                             "val_seconds": time.perf_counter() - started}
        timings = {"images_per_second", "train_seconds", "val_seconds"}  # not the state
        payload = {"model": model.state_dict(),
                   "optimizer": opened.trainee.optimizer.state_dict(), "round": self.round,
                   "metrics": {k: v for k, v in metrics.items() if k not in timings}} | (
            {"thresholds": dict(thresholds)} if thresholds else {})
        return Closed(metrics, payload)

    def relpath(self) -> str:
        return f"checkpoints/{self.run_name}/{self.key()}/round-{self.round + 1:03d}.pt"

    def kept(self, checkpoint: ArtifactRef, opened: Opened) -> None:
        _keep_warm(checkpoint, self.key(), opened.trainee.model, opened.trainee.optimizer)


class TestResult(BaseModel):
    """The test split's metrics and the exported program of a checkpoint."""

    model_config = ConfigDict(frozen=True)

    metrics: dict[str, float]
    program: ArtifactRef


def trained_model(config: ClassifierConfig, dataset: DatasetRef, checkpoint: ArtifactRef,
                  weights: str = "model") -> ImageClassifier:
    """The config's network with the checkpoint entry `weights` loaded, on the CPU. A
    checkpoint with activation `thresholds` (`sparsify`) gets them as forward hooks
    (`training.sparsify.thresholds`), so testing, measuring and the exported program all see
    them."""
    model = new_model(config, dataset)
    payload = load_checkpoint(ArtifactStore(), checkpoint)
    if weights not in payload:
        raise ValueError(f"checkpoint {checkpoint.path} has no {weights!r} weights")
    model.load_state_dict(payload[weights])
    install_thresholds(model, payload.get("thresholds", {}))
    return model


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="test-and-export")
def test_and_export(config: ClassifierConfig, dataset: DatasetRef,
                    checkpoint: ArtifactRef, weights: str = "model") -> TestResult:
    """Scores a checkpoint on the test split and exports it as a torch.export program.

    `weights` names the checkpoint's entry to use: `model`, or `kept` (what a PBT member round
    kept: its last weights or their average, `training.recipe.choose_weights`).
    """
    device = setup_device(config)
    model = place_model(trained_model(config, dataset, checkpoint, weights), device)
    data = load_dataset(dataset)
    metrics = evaluate(model, eval_batches(data, dataset, "test", device), device)
    relpath = str(Path(checkpoint.path).with_suffix(".pt2"))
    program = ArtifactStore().write(relpath, lambda path: export_program(
        model, dataset.channels, dataset.image_size, path))
    return TestResult(metrics={f"test_{k}": v for k, v in metrics.items()}, program=program)
