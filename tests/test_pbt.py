"""PBT's exploit and explore steps against hand-checked bounds, seeds and ties."""

from __future__ import annotations

import math
import random

import pytest

from training.pbt.scheduler import (
    PBTScheduler,
    SearchSpace,
    best_member,
    explore,
    initial_hyperparameters,
)
from training.scores import standard_error

SPACES = [SearchSpace("lr", 0.01, 0.4), SearchSpace("momentum", 0.5, 0.99, "linear"),
          SearchSpace("batch_size", 32, 256, "log", integer=True)]


def test_initial_members_fall_in_different_slices_of_each_range():
    members = initial_hyperparameters(SPACES, 4, random.Random(0))
    slices = sorted(int(4 * (math.log(m["lr"]) - math.log(0.01)) / (math.log(0.4)
                                                                     - math.log(0.01)))
                    for m in members)
    assert slices == [0, 1, 2, 3]
    assert len({m["momentum"] for m in members}) == 4
    assert all(m["batch_size"] == round(m["batch_size"]) and 32 <= m["batch_size"] <= 256
               for m in members)
    assert members == initial_hyperparameters(SPACES, 4, random.Random(0))  # seeded


def test_explore_stays_within_the_factor_and_the_bounds():
    rng = random.Random(1)
    best = {"lr": 0.1, "momentum": 0.9, "batch_size": 128, "weight_decay": 5e-4}
    for _ in range(200):
        new = explore(best, SPACES, rng)
        assert 0.05 <= new["lr"] <= 0.2
        assert 0.9 - 0.25 * 0.49 - 1e-12 <= new["momentum"] <= 0.99
        assert 64 <= new["batch_size"] <= 256 and new["batch_size"] == round(new["batch_size"])
        assert new["weight_decay"] == 5e-4  # not searched: kept
    at_edge = explore({"lr": 0.4, "momentum": 0.99, "batch_size": 256}, SPACES,
                      random.Random(2), low_factor=1.0, high_factor=4.0)
    assert at_edge["lr"] == 0.4 and at_edge["batch_size"] == 256  # clipped to the bounds
    assert explore(best, SPACES, random.Random(3)) == explore(best, SPACES, random.Random(3))


def test_best_member_takes_the_first_of_equals_and_skips_failed_members():
    assert best_member([0.8, 0.9, 0.9]) == 1
    assert best_member([None, 0.5, float("nan")]) == 1
    with pytest.raises(ValueError, match="every member failed"):
        best_member([None, None])
    with pytest.raises(ValueError, match="positive low bound"):
        SearchSpace("wd", 0.0, 1.0)


def test_the_incumbent_stays_the_best_unless_beaten_by_more_than_the_margin():
    scores = [0.80, 0.825, 0.79]
    assert best_member(scores, 0.03, incumbent=0) == 0  # 2.5 points ahead: within 3
    assert best_member(scores, 0.02, incumbent=0) == 1  # beyond 2
    assert best_member(scores, 0.03, incumbent=2) == 1  # 3.5 points behind
    assert best_member([None, 0.9, 0.7], 0.5, incumbent=0) == 1  # a failed incumbent
    assert standard_error(0.8, 100) == pytest.approx(0.04)  # sqrt(0.8 * 0.2 / 100)


def test_member_0_starts_at_the_configured_values_and_noise_does_not_move_it():
    spaces = [SearchSpace("lr", 0.01, 1.0), SearchSpace("augment", 0.0, 1.0, "linear")]
    base = {"lr": 0.05, "augment": 0.5, "momentum": 0.9}
    plain = PBTScheduler(spaces, 3, base, seed=4)
    anchored = PBTScheduler(spaces, 3, base, seed=4, margin=None, val_images=100,
                            keep_base=True)
    assert anchored.hyperparameters[0] == base
    assert anchored.hyperparameters[1:] == plain.hyperparameters[1:]  # the draws unchanged
    # one standard error of 0.84 on 100 images is 3.7 points: 3 points ahead is noise
    decision = anchored.decide([0.81, 0.84, 0.80])
    assert (decision.best, decision.score) == (0, 0.81)
    assert decision.margin == pytest.approx(math.sqrt(0.84 * 0.16 / 100))
    assert decision.hyperparameters[0] == base  # the incumbent keeps its values
    # 10 points ahead is not: member 2 becomes the incumbent and keeps its values
    decision = anchored.decide([0.80, 0.78, 0.90])
    assert decision.best == 2 and anchored.incumbent == 2
    assert decision.hyperparameters[2] == anchored.decisions[0].hyperparameters[2]
    assert plain.decide([0.81, 0.84, 0.80]).best == 1  # margin 0: the highest
    with pytest.raises(ValueError, match="validation images"):
        PBTScheduler(spaces, 3, base, seed=4, margin=None)


def test_with_exploration_off_every_member_keeps_the_configured_values_and_only_copies():
    spaces = [SearchSpace("lr", 0.01, 1.0), SearchSpace("augment", 0.0, 1.0, "linear")]
    base = {"lr": 0.05, "augment": 0.5, "momentum": 0.9}
    control = PBTScheduler(spaces, 3, base, seed=4, keep_base=True, explore=False)
    assert control.hyperparameters == [base] * 3
    for scores in ([0.81, 0.84, 0.80], [0.9, 0.7, 0.95]):
        decision = control.decide(scores)
        assert decision.best == scores.index(max(scores))  # the weights still go from the best
        assert list(decision.hyperparameters) == [base] * 3
    searching = PBTScheduler(spaces, 3, base, seed=4, keep_base=True)
    assert searching.hyperparameters[1] != base
    assert searching.decide([0.81, 0.84, 0.80]).hyperparameters[0] != base
