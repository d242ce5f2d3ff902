"""The round task: one Prefect task trains a round of any technique.

Every technique's training is a chain of rounds, and every round does the same five things:
resume (rebuild the network, its optimizer and what trains beside it from the previous
round's checkpoint), build the round (`training.rounds.Round`: the step spec, the batches,
the schedule), train it (in this process, or with `--ddp-procs` > 1 in every process of a
torchrun job, from the same `Round`), validate, and write a versioned checkpoint. What differs
is said by the technique's `RoundPlan` (`ClassifierRound`, `MemberRound`, `TeacherRound`,
`StudentRound`, `ModuleRound`, `ImageTextRound`, `CanvasRound`): a frozen pydantic model of
the round's inputs, whose `open` resumes and builds and whose `close` validates and says what
the checkpoint holds. `round_task(plan, previous)` runs it and returns one `RoundResult`.

A round is cached on its plan, its previous checkpoint and the code of its plan's module (and
what that imports; `tasks.adapters.caching`), so a re-run, or a run resumed after a crash,
skips the rounds already done.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import save_checkpoint
from tasks.adapters.torchrun import train_data_parallel
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from training.device import setup_device
from training.rounds import Closed, Opened, Round, Trainee, train_passes


class RoundResult(BaseModel):
    """What a round returns: its number (as its plan counts: a classifier's round from 0, a
    stage from 1), the checkpoint it wrote, its metrics, and which of its weights the
    checkpoint's scored entry holds (`model`, the last weights; `averaged` or `soup` for PBT
    members)."""

    model_config = ConfigDict(frozen=True)

    round: int
    checkpoint: ArtifactRef
    metrics: dict[str, float]
    kept: str = "model"


class RoundPlan(BaseModel):
    """One round of a technique (the module docstring). A subclass holds the round's inputs
    as fields (its config under `config`) and says how to resume, validate and store it."""

    model_config = ConfigDict(frozen=True)

    @property
    def number(self) -> int:
        """The round's number in its chain (`RoundResult.round`)."""
        raise NotImplementedError

    def task_name(self) -> str:
        """The task run's name in the Prefect UI (`round-3`, `teacher-2`, ...)."""
        raise NotImplementedError

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        """The trainee resumed from `previous` (or started), and the round it trains."""
        raise NotImplementedError

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        """The round's metrics (`metrics`: the training losses; `seconds`: its training
        time) with its validation scores, and the checkpoint's content."""
        raise NotImplementedError

    def relpath(self) -> str:
        """Where the round's checkpoint goes in the artifact store."""
        raise NotImplementedError

    def kept(self, checkpoint: ArtifactRef, opened: Opened) -> None:
        """Called with the written checkpoint (the classifier keeps its live model warm)."""


def train_trainee(config: Any, round_: Round, trainee: Trainee, device: torch.device
                  ) -> dict[str, float]:
    """`training.rounds.train_passes` in this process, or with `config.run.ddp_procs` > 1 in a
    torchrun job of that many processes (`tasks.adapters.torchrun`), from the same `Round`."""
    procs = config.run.ddp_procs
    if procs == 1:
        return train_passes(round_, trainee, device)
    return train_data_parallel(procs, round_, trainee, config.run.device, config.run.threads)


def _round_run_name() -> str:
    return task_run.parameters["plan"].task_name()


@task(cache_key_fn=computation_key, persist_result=True, task_run_name=_round_run_name,
      retries=0)
def round_task(plan: RoundPlan, previous: ArtifactRef | None = None) -> RoundResult:
    """Trains one round of `plan` from the checkpoint `previous` (None: its start) and writes
    its checkpoint (the module docstring)."""
    device = setup_device(plan.config)
    opened = plan.open(previous, device)
    started = time.perf_counter()
    metrics = train_trainee(plan.config, opened.round, opened.trainee, device)
    closed = plan.close(opened, device, metrics, time.perf_counter() - started)
    checkpoint = save_checkpoint(ArtifactStore(), plan.relpath(), closed.payload)
    plan.kept(checkpoint, opened)
    return RoundResult(round=plan.number, checkpoint=checkpoint, metrics=closed.metrics,
                       kept=closed.kept)
