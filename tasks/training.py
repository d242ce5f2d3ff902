"""Training tasks: one epoch of a classifier, and the final test evaluation and export.

Each epoch is one Prefect task that loads the previous checkpoint by reference, trains, scores
the validation split, writes and versions a new checkpoint, and returns only the reference and
the metrics. Tasks are cached on their inputs (config, data set, epoch, previous checkpoint)
and the code's version, so re-running a flow after a crash skips the epochs already done and
resumes from the last one.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.optim.swa_utils import AveragedModel

from models import ImageClassifier, build_model
from tasks.adapters.caching import computation_key, result_fields
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.torchrun import round_job, train_round_data_parallel
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.configs.sparsify import SparsitySpec
from tasks.data import DatasetRef, LoadedDataset, load_dataset
from training.batches import Batches, Normalize
from training.budget import Budget, fit_budget
from training.device import inference_batch, place_model, resolve_device
from training.features import WithEmbedding
from training.loops import classification_step, evaluate
from training.recipe import optimizer_to, set_momentum_and_decay, sgd, train_round
from training.sparsify.term import sparsity_regularized
from training.sparsify.thresholds import install_thresholds, thresholds_in_place


class EpochResult(BaseModel):
    """What an epoch task returns: the checkpoint written and the epoch's metrics."""

    model_config = ConfigDict(frozen=True)

    epoch: int
    checkpoint: ArtifactRef
    metrics: dict[str, float]


def run_key(config: BaseModel, dataset: DatasetRef) -> str:
    """A short digest naming a training run's checkpoints (its result-relevant config, data)."""
    text = json.dumps([result_fields(config), dataset.artifact.md5], sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest()[:12]


def new_model(config: ClassifierConfig, dataset: DatasetRef) -> ImageClassifier:
    """The configured network for the data set, initialised from the seed."""
    torch.manual_seed(config.seed)
    return build_model(config.model, dataset.channels, len(dataset.classes), config.width)


def make_optimizer(model: nn.Module, config: ClassifierConfig) -> torch.optim.SGD:
    """SGD with the config's momentum and weight decay (`training.recipe.sgd`)."""
    return sgd(model.parameters(), config.lr, config.momentum, config.weight_decay)


def split_batches(data: LoadedDataset, dataset: DatasetRef, split: str, batch_size: int,
                  device: torch.device, shuffle: bool = False, seed: int = 0,
                  augment: float = 0.0, flip: bool = True) -> Batches:
    """Batches over one split of a loaded data set; a shuffled (training) pass drops a short
    last batch, so BatchNorm never sees a batch of one."""
    return Batches(data.images, data.labels, data.splits[split], batch_size,
                   Normalize(dataset.mean, dataset.std), shuffle=shuffle, seed=seed,
                   augment=augment, drop_last=shuffle, device=device, flip=flip)


def eval_batches(data: LoadedDataset, dataset: DatasetRef, split: str,
                 device: torch.device) -> Batches:
    """One split in order, unaugmented, in batches of the device's `inference_batch`: for
    scoring and predicting without gradients."""
    return position_batches(data, dataset, data.splits[split], device)


def position_batches(data: LoadedDataset, dataset: DatasetRef, positions: torch.Tensor,
                     device: torch.device) -> Batches:
    """`eval_batches` over the images at `positions` (a part of a split, such as the
    validation images a few-label run's choices read)."""
    return Batches(data.images, data.labels, positions, inference_batch(device),
                   Normalize(dataset.mean, dataset.std), device=device)


def restore(model: nn.Module, optimizer: torch.optim.Optimizer | None,
            checkpoint: dict, config: ClassifierConfig | None = None) -> None:
    """Loads weights (and optimizer state) from a checkpoint payload.

    With `config`, the optimizer keeps the configured momentum and weight decay, not the
    stored ones (the learning rate is set at every step from the schedule): a resumed run, or
    a PBT member starting from another's checkpoint, trains with its own hyperparameters.
    """
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None and "optimizer" in checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        if config is not None:
            set_momentum_and_decay(optimizer, config.momentum, config.weight_decay)


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


def setup_device(config: ClassifierConfig) -> torch.device:
    """Applies the config's thread count and resolves its device (every training task's
    first line)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    return resolve_device(config.device)


def fit_to_data(config: BaseModel, dataset: DatasetRef, rounds: int,
                images_per_round: int | None = None) -> Budget:
    """The budget of a run of `rounds` configured epochs (or stages) of `config` on
    `dataset`'s training split (`training.budget.fit_budget`)."""
    return fit_budget(dataset.sizes["train"], config.batch_size, rounds, config.min_steps,
                      config.max_epochs, images_per_round, config.min_steps_full_below)


# The live model and optimizer of the last epoch this process finished, keyed by the checkpoint
# they wrote and the run's key. The next epoch of the same run continues from them instead of
# rebuilding both from that checkpoint: the same state, and measurably faster on CPUs (a rebuilt
# model trained 3-5% slower for the whole epoch here). An epoch takes the entry out before it
# trains, so a failed epoch never leaves a half-trained model behind to be reused.
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


def train_passes(config: ClassifierConfig, dataset: DatasetRef, data: LoadedDataset,
                 model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 passes: range, schedule: tuple[int, int], warmup_epochs: float = 0.0,
                 progress: str | None = None, averaged: AveragedModel | None = None,
                 average_decay: float | None = None, sparsity: SparsitySpec | None = None
                 ) -> dict[str, float]:
    """Trains `passes` of a classifier on the training split (`training.recipe.train_round`):
    in this process, or with `config.ddp_procs` > 1 data-parallel under torchrun
    (`tasks/adapters/torchrun.py`), with the same batches, schedule and weight average either way.
    `sparsity` adds its activation-sparsity term to the loss (`training.sparsify.term`)."""

    def seed_of(epoch: int) -> int:  # each pass's shuffling and augmentation
        return config.seed * 1000 + epoch

    def batches_for(epoch: int) -> Batches:
        return split_batches(data, dataset, "train", config.batch_size, device, shuffle=True,
                             seed=seed_of(epoch), augment=config.augment, flip=config.flips())

    if config.ddp_procs == 1:
        step = classification_step(config.label_smoothing)
        with nullcontext(step) if sparsity is None else sparsity_regularized(
                step, model, sparsity.lambdas, sparsity.build(), sparsity.thresholds) as step:
            return train_round(model, optimizer, batches_for, step, device, passes, config.lr,
                               schedule, warmup_epochs, config.grad_clip, progress, averaged)
    job = round_job(config, dataset, data, model, optimizer, data.splits["train"], passes,
                    schedule, warmup_epochs, seeds=[seed_of(epoch) for epoch in passes],
                    averaged=averaged, average_decay=average_decay,
                    sparsity=None if sparsity is None else sparsity.model_dump())
    return train_round_data_parallel(config.ddp_procs, job, model, optimizer, averaged,
                                     config.threads)


def _epoch_run_name() -> str:
    return f"epoch-{task_run.parameters['epoch'] + 1}"  # 1-based, like checkpoints and steps


@task(cache_key_fn=computation_key, persist_result=True, task_run_name=_epoch_run_name)
def train_classifier_epoch(config: ClassifierConfig, dataset: DatasetRef, epoch: int,
                           previous: ArtifactRef | None, run_name: str = "train",
                           repeats: int = 1, sparsity: SparsitySpec | None = None,
                           start: ArtifactRef | None = None) -> EpochResult:
    """Trains round `epoch` (0-based) of `config.epochs` from `previous`: `repeats` passes
    over the training images (`training.budget`; 1 on a large data set) on the cosine schedule
    of the whole run, then scores the validation split. `sparsity`: the `sparsify` flow's
    activation-sparsity term, added to the loss. `start`: the weights the first round starts
    from (fine-tuning, `tasks.initial_weights`; its optimizer starts afresh), instead of the
    seed's initialization."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    key = run_key(config, dataset) + (f"-x{repeats}" if repeats > 1 else "") + (
        "" if sparsity is None else "-" + run_key(sparsity, dataset)) + (
        "" if start is None else f"-from-{start.md5[:12]}")
    model, optimizer = _take_warm(previous, key)
    if model is None:
        model, optimizer = resume(config, dataset, store, previous or start, device)

    started = time.perf_counter()
    passes = range(epoch * repeats, (epoch + 1) * repeats)
    metrics = train_passes(config, dataset, data, model, optimizer, device, passes,
                           (0, config.epochs * repeats), config.warmup_epochs * repeats,
                           f"round {epoch + 1}/{config.epochs}" if config.progress else None,
                           sparsity=sparsity)
    seconds = time.perf_counter() - started
    thresholds = {} if sparsity is None else sparsity.thresholds
    with thresholds_in_place(model, thresholds):  # the network as it trained
        val = evaluate(model, eval_batches(data, dataset, "val", device), device)
    images = len(passes) * (dataset.sizes["train"] // config.batch_size) * config.batch_size
    metrics |= {"val_accuracy": val["accuracy"], "val_loss": val["loss"],
                "images_per_second": images / seconds, "train_seconds": seconds,
                "val_seconds": time.perf_counter() - started - seconds}
    timings = {"images_per_second", "train_seconds", "val_seconds"}  # not part of the state
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
               "metrics": {k: v for k, v in metrics.items() if k not in timings}} | (
        {"thresholds": dict(thresholds)} if thresholds else {})
    relpath = f"checkpoints/{run_name}/{key}/epoch-{epoch + 1:03d}.pt"
    checkpoint = save_checkpoint(store, relpath, payload)
    _keep_warm(checkpoint, key, model, optimizer)
    return EpochResult(epoch=epoch, checkpoint=checkpoint, metrics=metrics)


def export_program(model: nn.Module, channels: int, size: int, path: Path) -> None:
    """Exports an eval-mode copy of `model` on the CPU, with a dynamic batch dimension; the
    program returns the logits and the embedding (`WithEmbedding`)."""
    model = model.to("cpu").eval()
    example = torch.zeros(2, channels, size, size)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    program = torch.export.export(WithEmbedding(model).eval(), (example,),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


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
