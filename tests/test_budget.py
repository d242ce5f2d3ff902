"""Budgets fitted to the data set size, against hand-computed values."""

from __future__ import annotations

import pytest

from training.budget import fit_budget, fitted_batch_size, needed_steps


def test_a_large_data_set_keeps_the_configured_batch_and_epochs():
    budget = fit_budget(18000, 128, 8, 1000, 400)  # 140 steps an epoch: 1,120 >= 1,000
    assert (budget.batch_size, budget.steps_per_epoch, budget.repeats, budget.epochs) == \
        (128, 140, 1, 8)


def test_a_small_data_set_gets_more_passes_to_reach_the_minimum_steps():
    budget = fit_budget(1080, 128, 8, 1000, 400)  # 8 steps an epoch, 64 in 8 epochs
    assert (budget.batch_size, budget.steps_per_epoch) == (128, 8)
    assert budget.repeats == 16  # ceil(1000 / 64)
    assert budget.steps == 1024 and budget.epochs == 128


def test_a_tiny_data_set_gets_a_smaller_batch_and_is_capped_in_passes():
    assert fitted_batch_size(360, 128) == 32  # 360 // 8 = 45 -> the power of two 32
    assert fitted_batch_size(50, 128) == 16  # never below 16 images ...
    assert fitted_batch_size(10, 128) == 10  # ... nor above the images there are
    assert fitted_batch_size(360, 24) == 24  # a batch already small enough stays
    budget = fit_budget(40, 128, 8, 1000, 400)  # 16 images a step, 2 steps an epoch
    assert (budget.batch_size, budget.steps_per_epoch) == (16, 2)
    assert budget.repeats == 50 and budget.epochs == 400  # 500 wanted, capped at 400 / 8


def test_a_lowered_batch_takes_proportionally_more_steps():
    # 360 images: batch 32 (a quarter of 128), 11 steps an epoch, 88 in 8 epochs; the minimum
    # of 1,000 steps of 128 images is 4,000 steps of 32: ceil(4000 / 88) = 46 repeats
    budget = fit_budget(360, 128, 8, 1000, 400)
    assert (budget.batch_size, budget.repeats, budget.steps) == (32, 46, 4048)
    assert budget.steps * budget.batch_size >= 1000 * 128  # the same images seen
    # the default minimum on the same images reaches the cap of 400 passes first
    assert fit_budget(360, 128, 8, 3000, 400).epochs == 400
    # a batch configured small enough is not lowered, so nothing is scaled
    assert fit_budget(360, 32, 8, 1000, 400).repeats == 12  # ceil(1000 / 88)


def test_rounds_that_draw_a_subset_and_no_minimum():
    budget = fit_budget(1000, 64, 10, 1000, 400, images_per_round=800)  # 12 steps a stage
    assert (budget.batch_size, budget.steps_per_epoch, budget.repeats) == (64, 12, 9)
    assert fit_budget(1000, 64, 10, None, 400) == fit_budget(1000, 64, 10, None, 1)
    assert fit_budget(1000, 64, 10, None, 400).repeats == 1


def test_the_minimum_shrinks_in_proportion_above_full_below():
    assert needed_steps(1080, 3000, 4096) == 3000  # in full up to 4,096 images
    assert needed_steps(8192, 3000, 4096) == 1500  # twice the images: half the steps
    assert needed_steps(18000, 3000, 4096) == 683  # ceil(3000 * 4096 / 18000)
    assert needed_steps(18000, 3000, None) == 3000
    small = fit_budget(1080, 128, 8, 3000, 400, full_below=4096)  # 8 steps an epoch
    assert small.repeats == 47 and small.steps == 3008  # ceil(3000 / 64)
    large = fit_budget(18000, 128, 8, 3000, 400, full_below=4096)  # 1,120 steps >= 683
    assert (large.batch_size, large.repeats, large.steps) == (128, 1, 1120)
    assert fit_budget(18000, 128, 8, 3000, 400).repeats == 3  # ceil(3000 / 1120) in full


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="rounds"):
        fit_budget(100, 16, 0, 10, 10)
    with pytest.raises(ValueError, match="image"):
        fitted_batch_size(0, 16)
