"""Population-based training's exploit and explore steps, as pure functions (Ray Tune's split).

A member's hyperparameters are a dict of floats. Each searched hyperparameter has bounds and a
scale. `initial_hyperparameters` spreads the members over the space, `best_member` picks the
most accurate member of a stage (exploit: the weights it was scored on are copied to the
others; the incumbent stays the best unless beaten by more than a margin), and `explore` draws
a member's new values around the best's:

- log scale: `best * f` with `log f` uniform in `[log low_factor, log high_factor]`
  (0.5 to 2 by default);
- linear scale: `best + u * (high - low)` with `u` uniform in `[-linear_step, linear_step]`;

then clipped to the bounds (and rounded where the value is an integer, e.g. a batch size).
Every random number comes from the explicit `random.Random` passed in: the same seed gives the
same population history.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from training.scores import standard_error
from training.settings import PopulationSettings

Scale = Literal["log", "linear"]


class PopulationFailed(RuntimeError):
    """Every member of a round failed: there is nothing to go on from."""


@dataclass(frozen=True)
class SearchSpace:
    """One searched hyperparameter: bounds, scale, and whether it is an integer."""

    name: str
    low: float
    high: float
    scale: Scale = "log"
    integer: bool = False

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"{self.name}: low {self.low} must be below high {self.high}")
        if self.scale == "log" and self.low <= 0:
            raise ValueError(f"{self.name}: a log scale needs a positive low bound, got "
                             f"{self.low}")

    def clip(self, value: float) -> float:
        """The value inside the bounds (rounded for an integer hyperparameter)."""
        value = min(max(value, self.low), self.high)
        return float(round(value)) if self.integer else value

    def sample(self, rng: random.Random) -> float:
        """A value drawn uniformly on the scale over the whole range."""
        if self.scale == "log":
            return self.clip(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return self.clip(rng.uniform(self.low, self.high))


def initial_hyperparameters(spaces: Sequence[SearchSpace], members: int,
                            rng: random.Random) -> list[dict[str, float]]:
    """`members` distinct starting points: stratified on each scale (member i draws from the
    i-th of `members` equal slices of every range, slices shuffled per hyperparameter), so no
    two members start alike."""
    columns: dict[str, list[float]] = {}
    for space in spaces:
        order = list(range(members))
        rng.shuffle(order)
        values = []
        for slot in order:
            low, high = slot / members, (slot + 1) / members
            u = rng.uniform(low, high)
            if space.scale == "log":
                value = math.exp(math.log(space.low) + u * (math.log(space.high)
                                                            - math.log(space.low)))
            else:
                value = space.low + u * (space.high - space.low)
            values.append(space.clip(value))
        columns[space.name] = values
    return [{name: columns[name][i] for name in columns} for i in range(members)]


def explore(best: Mapping[str, float], spaces: Sequence[SearchSpace], rng: random.Random,
            low_factor: float = 0.5, high_factor: float = 2.0,
            linear_step: float = 0.25) -> dict[str, float]:
    """New hyperparameters around `best`'s (module docstring); unsearched keys are kept."""
    if not 0 < low_factor <= 1 <= high_factor:
        raise ValueError(f"need 0 < low_factor <= 1 <= high_factor, got {low_factor}, "
                         f"{high_factor}")
    values = dict(best)
    for space in spaces:
        current = best[space.name]
        if space.scale == "log":
            factor = math.exp(rng.uniform(math.log(low_factor), math.log(high_factor)))
            values[space.name] = space.clip(current * factor)
        else:
            step = rng.uniform(-linear_step, linear_step) * (space.high - space.low)
            values[space.name] = space.clip(current + step)
    return values


def scored(scores: Sequence[float | None]) -> dict[int, float]:
    """The members that have a score (`None`: failed; NaN: diverged), by index."""
    return {index: score for index, score in enumerate(scores) if score is not None
            and not math.isnan(score)}


def best_member(scores: Sequence[float | None], margin: float = 0.0,
                incumbent: int | None = None) -> int:
    """The index of the highest score (the first on ties), or `incumbent` where its score is
    within `margin` of the highest; `None` marks a failed member.

    Raises:
        ValueError: no member has a score.
    """
    valid = scored(scores)
    if not valid:
        raise ValueError("no member of the stage has a score: every member failed")
    top = max(valid.values())
    if incumbent in valid and valid[incumbent] >= top - margin:
        return incumbent
    return min(index for index, score in valid.items() if score == top)


@dataclass(frozen=True)
class Decision:
    """What the scheduler decided after a stage: the best member (exploit: every member starts
    the next stage from the weights its score was measured on) and each member's
    hyperparameters for the next stage (explore: the best keeps its own, the others draw around
    them). `score` is the best's; `margin` how much better than the incumbent another member
    had to score."""

    stage: int
    best: int
    score: float
    hyperparameters: tuple[dict[str, float], ...]
    margin: float = 0.0


class PBTScheduler:
    """Population-based training's decisions from scores alone (Ray Tune's exploit / explore
    split): no weights, no I/O. The same seed and the same scores give the same decisions, so a
    run's history is replayed from its scores (`replay`).

    A noisy score must not move the search (a validation split of 120 images measures to 3.6
    points): the incumbent (the last stage's best, who kept its values; at stage 1 member 0,
    which with `keep_base` starts from `base`'s values) stays the best unless another member
    beats it by more than `margin`. The search then leaves the configured values only on
    evidence.

    Args:
        spaces: the searched hyperparameters.
        members: the population size.
        base: every member's values before the stages (the burn-in's); unsearched keys are
            carried along.
        seed: seed of the scheduler's own random generator.
        low_factor, high_factor, linear_step: `explore`'s perturbation sizes.
        margin: how much better than the incumbent a member must score to replace it;
            `None`: one standard error of the highest score on `val_images` images.
        val_images: the validation images the scores are measured on (for `margin=None`).
        keep_base: member 0 starts from `base`'s values (clipped to the bounds) instead of a
            draw; the others' draws are unchanged.
        explore: False turns the search off: every member starts from `base`'s values and
            keeps them, so the stages only copy the best's weights (the control PBT's
            exploration must beat).
    """

    def __init__(self, spaces: Sequence[SearchSpace], members: int, base: Mapping[str, float],
                 seed: int, low_factor: float = 0.5, high_factor: float = 2.0,
                 linear_step: float = 0.25, margin: float | None = 0.0,
                 val_images: int | None = None, keep_base: bool = False,
                 explore: bool = True) -> None:
        if margin is None and not val_images:
            raise ValueError("a margin of one standard error needs the validation images")
        self.spaces, self.members = list(spaces), members
        self.rng = random.Random(seed)
        self.perturbation = (low_factor, high_factor, linear_step)
        self.margin, self.val_images = margin, val_images
        self.hyperparameters = [dict(base) | drawn for drawn in initial_hyperparameters(
            self.spaces, members, self.rng)]
        self.incumbent: int | None = None
        self.explore = explore
        if not explore:
            self.hyperparameters = [dict(base) | {space.name: space.clip(base[space.name])
                                                  for space in self.spaces}] * members
        if keep_base:
            self.hyperparameters[0] = dict(base) | {
                space.name: space.clip(base[space.name]) for space in self.spaces}
            self.incumbent = 0
        self.decisions: list[Decision] = []

    def tie_margin(self, scores: Sequence[float | None]) -> float:
        """How much better than the incumbent a member must score (`margin`, or one standard
        error of the highest of `scores`)."""
        valid = scored(scores)
        if self.margin is not None or not valid:
            return self.margin or 0.0
        return standard_error(max(valid.values()), self.val_images)

    def decide(self, scores: Sequence[float | None]) -> Decision:
        """The decision after a stage whose members scored `scores` (`None`: failed)."""
        if len(scores) != self.members:
            raise ValueError(f"{len(scores)} scores for {self.members} members")
        margin = self.tie_margin(scores)
        best = best_member(scores, margin, self.incumbent)
        self.incumbent = best  # it keeps its values; the others explore around them
        kept = self.hyperparameters[best]
        low, high, step = self.perturbation
        self.hyperparameters = [kept if m == best or not self.explore else explore(
            kept, self.spaces, self.rng, low, high, linear_step=step)
            for m in range(self.members)]
        decision = Decision(len(self.decisions) + 1, best, float(scores[best]),
                            tuple(self.hyperparameters), margin)
        self.decisions.append(decision)
        return decision


def replay(scheduler: PBTScheduler, stage_scores: Sequence[Sequence[float | None]]
           ) -> list[Decision]:
    """The decisions a fresh scheduler makes on a run's recorded scores, stage by stage."""
    return [scheduler.decide(scores) for scores in stage_scores]


def search_spaces(config: PopulationSettings) -> list[SearchSpace]:
    """The searched hyperparameters of a `pbt` config, with their bounds and scales."""
    return [SearchSpace("lr", *config.lr_range, "log"),
            SearchSpace("weight_decay", *config.weight_decay_range, "log"),
            SearchSpace("momentum", *config.momentum_range, "linear"),
            SearchSpace("augment", *config.augment_range, "linear")]


def population_scheduler(config: PopulationSettings, members: int, base: dict[str, float],
                         val_images: int) -> PBTScheduler:
    """The `pbt` config's scheduler: its search space and perturbations, member 0 at `base`'s
    values, the incumbent kept within `--tie-margin` (none: one standard error on
    `val_images`)."""
    return PBTScheduler(search_spaces(config), members, base, config.run.seed,
                        *config.explore_factors, linear_step=config.explore_step,
                        margin=config.tie_margin, val_images=val_images, keep_base=True,
                        explore=config.explore)
