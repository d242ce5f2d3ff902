"""PBT's population loop, pure: the burn-in, the stages of train / evaluate / exploit /
explore, the lineage, and the final soup, over a callable that trains member rounds.

The loop decides; the caller trains and records. `train(round_, starts)` trains one round of
every member (`starts[m]`: member m's hyperparameters and the checkpoint entry it starts from)
and returns one waiter per member, so members may run side by side (the `pbt` flow submits
Prefect tasks to a Dask cluster; a waiter that raises is a member that failed, after its own
retries). The checkpoints are opaque here: whatever the trainer returns and takes back.

Burn-in: every member at the burn-in values, one cosine over the whole run, no weight
average, until `burn_in_rounds` or no better best score for `burn_in_patience` rounds.
Stages: each member at its own values on a new cosine (the `cycle`) decaying to zero at the
last stage; after each, the scheduler (`training.pbt.scheduler.PBTScheduler`) picks the best
(ties within its margin to the incumbent), every member starts the next stage from the
weights the best was ranked on (`exploit_entry(best)`: its average or its last weights), and
the others draw new values around the best's. A stage where every member fails ends the run
(`PopulationFailed`). With `soup`, the last stage's members are souped from the best
(`training.pbt.soup`) and the soup is kept when it holds more than one member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from training.pbt.scheduler import PBTScheduler, PopulationFailed

logger = logging.getLogger(__name__)


class Trained(Protocol):
    """A member round's result, as the loop reads it."""

    checkpoint: Any
    metrics: dict[str, float]
    kept: str


@dataclass(frozen=True)
class PopulationRound:
    """One round of every member: `passes` passes from pass `first`, on the cosine `cycle`
    (peak at `cycle[0]`, zero at `cycle[1]`), with a weight average of `average_decay`."""

    phase: str  # "burn-in" or "stage"
    index: int  # the burn-in round or the stage, from 1
    first: int
    passes: int
    cycle: tuple[int, int]
    average_decay: float | None


@dataclass(frozen=True)
class MemberStart:
    """Where member `member` starts a round: its hyperparameters, the checkpoint (None: the
    run's start) and the entry of it whose weights it takes (`LAST_WEIGHTS` or another)."""

    member: int
    hyperparameters: dict[str, float]
    checkpoint: Any
    weights: str


@dataclass(frozen=True)
class PopulationSettings:
    """What the loop needs of a `pbt` config (counted in rounds, each `repeats` passes over the
    training images)."""

    members: int
    burn_in_rounds: int
    burn_in_patience: int | None
    stages: int
    stage_rounds: int
    repeats: int
    average_decay: float | None
    target_accuracy: float | None
    stage_patience: int | None
    soup: bool


@dataclass
class Population:
    """The population after its last stage: the best (a member's round or the soup), whose
    member it is, its hyperparameters, the stages run and the lineage (one record per member
    and round, then the soup's)."""

    best: Trained
    best_member: int
    hyperparameters: dict[str, float]
    stages: int
    lineage: list[dict[str, Any]]


Train = Callable[[PopulationRound, Sequence[MemberStart]], list[Callable[[], Trained]]]
OnMember = Callable[[int, PopulationRound, Trained, dict[str, float]], None]
OnStage = Callable[[int, int, dict[str, float], list[dict[str, Any]]], None]
Soup = Callable[[list[Trained], list[int], int], Trained]


def run_population(settings: PopulationSettings, scheduler: Callable[[], PBTScheduler],
                   burn_in_values: dict[str, float], start: Any, train: Train,
                   exploit_entry: Callable[[Trained], str], last_weights: str,
                   on_member: OnMember | None = None,
                   on_stage: OnStage | None = None,
                   soup: Soup | None = None, log: Any = logger) -> Population:
    """The module docstring's loop. `scheduler()` builds the stages' scheduler (after the
    burn-in); `on_member(m, round_, result, hyperparameters)` records a member's round,
    `on_stage(stage, best_member, its hyperparameters, lineage)` a stage's decision, with the
    lineage so far;
    `log` takes the loop's messages (the flow's run logger)."""
    members, repeats = settings.members, settings.repeats
    total = (settings.burn_in_rounds + settings.stages * settings.stage_rounds) * repeats
    hyperparameters = [burn_in_values] * members
    checkpoints: list[Any] = [start] * members
    weights = [last_weights] * members  # the entry of `checkpoints[m]` member m starts from
    parents: list[int | None] = [None] * members
    copied: list[str | None] = [None] * members  # which of the parent's weights: its `kept`
    lineage: list[dict[str, Any]] = []

    def run_round(round_: PopulationRound) -> list[Trained | None]:
        starts = [MemberStart(m, hyperparameters[m], checkpoints[m], weights[m])
                  for m in range(members)]
        waiters = train(round_, starts)
        results: list[Trained | None] = []
        errors = []
        for m, wait in enumerate(waiters):
            record = {"phase": round_.phase, "stage": round_.index, "member": m,
                      "parent": parents[m], "copied": copied[m],
                      "hyperparameters": hyperparameters[m]}
            try:
                result = wait()
            except Exception as error:  # retried by the trainer: record it, go on without it
                log.warning("member %d failed in %s %d: %s", m, round_.phase, round_.index,
                               error)
                errors.append(f"member {m}: {type(error).__name__}: {error}")
                results.append(None)
                lineage.append(record | {"score": None, "error": errors[-1]})
                continue
            results.append(result)
            lineage.append(record | {"score": result.metrics["val_accuracy"],
                                     "kept": result.kept})
            if on_member is not None:
                on_member(m, round_, result, hyperparameters[m])
        if not any(results):
            raise PopulationFailed(f"every member failed in {round_.phase} {round_.index}; "
                                   + "; ".join(errors))
        return results

    # burn-in: one cosine over the whole run at the burn-in values, no weight average
    best_val, stale, burned = -1.0, 0, 0
    for burned in range(1, settings.burn_in_rounds + 1):
        results = run_round(PopulationRound("burn-in", burned, (burned - 1) * repeats, repeats,
                                            (0, total), None))
        checkpoints = [r.checkpoint if r else c for r, c in zip(results, checkpoints,
                                                                 strict=True)]
        val = max(r.metrics["val_accuracy"] for r in results if r)
        best_val, stale = (val, 0) if val > best_val else (best_val, stale + 1)
        if settings.burn_in_patience is not None and stale >= settings.burn_in_patience:
            log.info("burn-in stops after round %d: no better validation accuracy", burned)
            break
    # stages: a new cosine at each member's own rate, decaying to zero at the last stage
    stages_from = burned * repeats
    passes = settings.stage_rounds * repeats
    cycle = (stages_from, stages_from + settings.stages * passes)
    deciding = scheduler()
    hyperparameters = deciding.hyperparameters  # every member starts from different values
    first, best_score, stale, stage = stages_from, -1.0, 0, 0
    best_result, best_member, best_hyperparameters = None, 0, hyperparameters[0]
    for stage in range(1, settings.stages + 1):
        results = run_round(PopulationRound("stage", stage, first, passes, cycle,
                                            settings.average_decay))
        first += passes
        decision = deciding.decide([r.metrics["val_accuracy"] if r else None for r in results])
        best_result, best_member = results[decision.best], decision.best
        best_hyperparameters = hyperparameters[decision.best]
        score = decision.score
        log.info("stage %d: best member %d (%s weights), validation %.4f (ties within "
                    "%.4f), %s", stage, decision.best, best_result.kept, score, decision.margin,
                    ", ".join(f"{k}={v:.4g}" for k, v in best_hyperparameters.items()))
        if on_stage is not None:
            on_stage(stage, best_member, best_hyperparameters, lineage)
        best_score, stale = (score, 0) if score > best_score else (best_score, stale + 1)
        if (settings.target_accuracy is not None and score >= settings.target_accuracy) or \
                (settings.stage_patience is not None and stale >= settings.stage_patience):
            log.info("stop after stage %d (validation %.4f)", stage, score)
            break
        # exploit: every member starts the next stage from the weights the best was ranked on
        # (its average or its last weights); explore: the best keeps its values, the others
        # draw around them (the scheduler's decision)
        checkpoints = [best_result.checkpoint] * members
        weights = [exploit_entry(best_result)] * members
        parents = [decision.best] * members
        copied = [best_result.kept] * members
        hyperparameters = list(decision.hyperparameters)
    trained = [r for r in results if r is not None]
    trained_members = [m for m, r in enumerate(results) if r is not None]
    if soup is not None and settings.soup and stage > 1 and len(trained) > 1:
        # (stage 1's members share no start)
        souped = soup(trained, trained_members, trained.index(best_result))
        log.info("soup of members %s: validation %.4f (the best alone %.4f)",
                    souped.metrics["soup_ingredients"], souped.metrics["val_accuracy"],
                    best_result.metrics["val_accuracy"])
        lineage.append({"phase": "soup", "stage": stage, "member": best_member,
                        "parent": None, "copied": None, "hyperparameters": best_hyperparameters,
                        "score": souped.metrics["val_accuracy"],
                        "ingredients": int(souped.metrics["soup_ingredients"])})
        if souped.metrics["soup_ingredients"] > 1:
            best_result = souped
    return Population(best=best_result, best_member=best_member,
                      hyperparameters=best_hyperparameters, stages=stage, lineage=lineage)
