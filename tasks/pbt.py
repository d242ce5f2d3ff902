"""PBT tasks: one member's training round, and the population's lineage log.

A member round loads the checkpoint it starts from by reference (its own, or after a copy the
best member's), sets the member's own hyperparameters on the rebuilt optimizer (the stored
state keeps only the momentum buffers), trains, scores the validation split, and writes and
versions a checkpoint. Members exchange weights only through these versioned artifacts, so a
member on another machine gets the best's checkpoint by hash.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from tasks.caching import computation_key
from tasks.checkpoints import load_checkpoint, save_checkpoint
from tasks.data import DatasetRef, load_dataset
from tasks.training import (
    ClassifierConfig,
    _setup,
    resume,
    split_batches,
)
from tasks.versioning import ArtifactRef, ArtifactStore
from training.loops import (
    classification_step,
    cosine_lr,
    evaluate,
    train_epoch,
    weight_average,
)
from training.pbt import SearchSpace

HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "augment")


class MemberResult(BaseModel):
    """What a member round returns: its checkpoint and metrics."""

    model_config = ConfigDict(frozen=True)

    member: int
    checkpoint: ArtifactRef
    metrics: dict[str, float]


def search_spaces(config: Any) -> list[SearchSpace]:
    """The searched hyperparameters of a `pbt` config, with their bounds and scales."""
    return [SearchSpace("lr", *config.lr_range, "log"),
            SearchSpace("weight_decay", *config.weight_decay_range, "log"),
            SearchSpace("momentum", *config.momentum_range, "linear"),
            SearchSpace("augment", *config.augment_range, "linear")]


def scored_weights(average_decay: float | None) -> str:
    """The checkpoint entry that `train_member` scored and that gets tested and exported."""
    return "model" if average_decay is None else "averaged"


def member_config(base: ClassifierConfig, member: int, hyperparameters: dict[str, float]
                  ) -> ClassifierConfig:
    """A member's classifier config: the base with its seed and hyperparameters."""
    return base.model_copy(update={"seed": base.seed * 1000 + member, **{
        name: hyperparameters[name] for name in HYPERPARAMETERS}})


def _member_run_name() -> str:
    p = task_run.parameters
    return f"member-{p['member']}-{p['phase']}-{p['index']}"


@task(cache_key_fn=computation_key, persist_result=True, retries=1,
      task_run_name=_member_run_name)
def train_member(config: ClassifierConfig, dataset: DatasetRef, population: str, member: int,
                 phase: str, index: int, first_epoch: int, epochs: int,
                 cycle: tuple[int, int], previous: ArtifactRef | None,
                 average_decay: float | None = None) -> MemberResult:
    """Trains `epochs` epochs of one member from `previous` with `config`'s hyperparameters.

    The learning rate is the member's `lr` times a cosine decay from epoch `cycle[0]` (the
    peak) to epoch `cycle[1]` (zero), so members of a stage share one schedule shape.

    With `average_decay`, an exponential moving average of the weights (and batch-norm
    statistics) follows every step, carried in the checkpoint under `averaged`; the average,
    not the last step's weights, is scored, so a member with a large learning rate is not
    ranked on its noisiest point. Training itself always continues from the last weights.
    """
    cycle_start, cycle_end = cycle
    device = _setup(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    before = load_checkpoint(store, previous) if previous is not None else {}
    model, optimizer = resume(config, dataset, store, previous, device, before)  # own values
    averaged = None
    if average_decay is not None:
        averaged = weight_average(model, average_decay, before.get("averaged"))
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    for epoch in range(first_epoch, first_epoch + epochs):
        batches = split_batches(data, dataset, "train", config.batch_size, device, shuffle=True,
                                seed=config.seed * 1000 + epoch, augment=config.augment)
        start, total = cycle_start * len(batches), (cycle_end - cycle_start) * len(batches)
        metrics = train_epoch(model, optimizer, batches,
                              classification_step(config.label_smoothing), device,
                              lr_at=lambda n, start=start, total=total: cosine_lr(
                                  config.lr, n - start, total),
                              first_step=epoch * len(batches), grad_clip=config.grad_clip,
                              after_step=None if averaged is None else (
                                  lambda: averaged.update_parameters(model)))
    scored = model if averaged is None else averaged.module
    val = evaluate(scored, split_batches(data, dataset, "val", 1024, device), device)
    metrics |= {"val_accuracy": val["accuracy"], "val_loss": val["loss"],
                "train_seconds": time.perf_counter() - started}
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "member": member, "phase": phase, "index": index,
               "hyperparameters": {name: getattr(config, name) for name in HYPERPARAMETERS}}
    if averaged is not None:
        payload["averaged"] = averaged.module.state_dict()
    relpath = f"checkpoints/pbt/{population}/member-{member:02d}-{phase}-{index:03d}.pt"
    return MemberResult(member=member, checkpoint=save_checkpoint(store, relpath, payload),
                        metrics=metrics)


def write_lineage(population: str, records: list[dict[str, Any]]) -> ArtifactRef:
    """The lineage log (JSON lines, one record per member and stage, in order), written whole
    and atomically after each stage: earlier lines never change, new ones are added."""
    text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
    return ArtifactStore().write(f"pbt/{population}/lineage.jsonl",
                                 lambda path: Path(path).write_text(text))
