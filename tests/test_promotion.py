"""The registry's decision, pure (`training.promotion`): McNemar's exact test, the paired
bootstrap, the Wilson interval and the rules, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training.promotion import (
    Correct,
    Scored,
    against_champion,
    binomial_tail,
    mcnemar,
    paired_test,
    wilson_interval,
    without_champion,
)


def test_the_binomial_tail_is_exact():
    assert binomial_tail(0, 5) == 1.0 and binomial_tail(6, 5) == 0.0
    assert binomial_tail(5, 5) == 1 / 32
    assert binomial_tail(4, 5) == 6 / 32  # C(5,4) + C(5,5)
    assert binomial_tail(8, 10) == (45 + 10 + 1) / 1024


def test_mcnemar_reads_only_the_images_the_two_disagree_on():
    # 10 images: both right on 4, both wrong on 1, only the new one on 4, only the old on 1
    new = Correct(np.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 0], dtype=bool))
    old = Correct(np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 1], dtype=bool))
    verdict = mcnemar(new, old)
    # b = 4, c = 1: P(X >= 4 | n = 5) = 6/32; P(X <= 4) = 31/32
    assert verdict.p_better == pytest.approx(6 / 32) and verdict.p_worse == pytest.approx(31 / 32)
    assert (verdict.new_score, verdict.old_score) == (0.8, 0.5)
    assert not verdict.better and not verdict.worse  # 0.8 against 0.5 on 10 images: no proof
    many_new, many_old = Correct(new.right.repeat(4)), Correct(old.right.repeat(4))
    assert mcnemar(many_new, many_old).better  # b = 16, c = 4: p = 0.0059
    assert mcnemar(many_new, many_old).p_better == pytest.approx(binomial_tail(16, 20))
    assert mcnemar(many_old, many_new).worse
    with pytest.raises(ValueError, match="same images"):
        mcnemar(new, Correct(old.right[:5]))


def test_the_paired_bootstrap_decides_an_aggregate_that_is_no_mean():
    """A median-like aggregate: the bootstrap sees a clear gain and no gain in a copy."""
    rng = np.random.default_rng(3)
    base = rng.random(300)

    def of(values: np.ndarray) -> Scored:
        return Scored(len(values), lambda index: float(np.median(values[index])), 500)

    better = paired_test(of(base + 0.2), of(base))
    assert better.test == "paired bootstrap" and better.better
    assert better.p_better == pytest.approx(1 / 501)  # ahead in every resample
    same = paired_test(of(base), of(base))
    assert not same.better and not same.worse
    assert paired_test(of(base), of(base + 0.2)).worse


def test_the_wilson_interval():
    low, high = wilson_interval(1.0, 121)
    assert low == pytest.approx(121 / (121 + 1.959963984540054 ** 2)) and high == 1.0
    low, high = wilson_interval(0.5, 100)  # the textbook case: 0.404 to 0.596
    assert (round(low, 3), round(high, 3)) == (0.404, 0.596)
    assert math.isclose(sum(wilson_interval(0.3, 50)) / 2, (0.3 + 1.92 / 50) / (1 + 3.84 / 50),
                        rel_tol=1e-3)


def test_the_rules():
    better = mcnemar(Correct(np.r_[np.ones(30), np.zeros(5)]),
                     Correct(np.r_[np.zeros(30), np.ones(5)]))
    tie = mcnemar(Correct(np.r_[np.ones(3), np.zeros(2)]), Correct(np.r_[np.zeros(3),
                                                                          np.ones(2)]))
    worse = mcnemar(Correct(np.r_[np.zeros(30), np.ones(5)]),
                    Correct(np.r_[np.ones(30), np.zeros(5)]))
    assert against_champion(better, "4").crown
    assert not against_champion(tie, "4").crown
    assert against_champion(tie, "4", 100, 200).crown  # ties and is cheaper
    assert not against_champion(tie, "4", 200, 100).crown
    assert not against_champion(worse, "4", 1, 200).crown  # cheaper but worse
    assert without_champion({}).crown
    assert without_champion({"1": tie, "2": better}).crown
    refused = without_champion({"1": tie, "2": worse})
    assert not refused.crown and "version 2 is better" in refused.reason
