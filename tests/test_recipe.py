"""The train-and-validate recipe: early stopping, the kept round, the choice between the last
weights and their average, BatchNorm re-estimation, and the PBT scheduler."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from torch import nn

from models import build_model
from training.loops import weight_average
from training.pbt.scheduler import PBTScheduler, SearchSpace, explore, initial_hyperparameters
from training.recipe import EarlyStopping, choose_weights, recompute_batchnorm


def test_early_stopping_counts_rounds_below_the_best_and_ties_reset():
    stopping = EarlyStopping(patience=2)
    for index, score in enumerate([0.5, 0.7, 0.6, 0.7, 0.65]):
        stopping.update(index, score)
        assert not stopping.should_stop
    stopping.update(5, 0.6)
    assert stopping.should_stop and stopping.best_score == 0.7
    assert stopping.kept_round == 3  # the later of the two rounds at the best
    assert not EarlyStopping(None).should_stop


def test_the_latest_round_within_one_standard_error_of_the_best_is_kept():
    stopping = EarlyStopping(patience=None, val_images=100)
    stopping.update(0, 0.80)
    assert stopping.tolerance() == pytest.approx(math.sqrt(0.8 * 0.2 / 100))  # 0.04
    assert stopping.update(1, 0.77)  # within 0.04 of 0.80: the later round is kept
    assert not stopping.update(2, 0.75)  # 0.05 below: not kept
    assert stopping.kept_round == 1
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(0)


def batches(n=4, size=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.arange(size), torch.randn(size, 1, 8, 8, generator=generator) * 3 + 1,
             torch.randint(0, 3, (size,), generator=generator)) for _ in range(n)]


def test_batchnorm_statistics_are_re_estimated_for_the_weights():
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    data = batches()
    assert recompute_batchnorm(model, data)
    with torch.no_grad():
        outputs = torch.cat([model[0](x) for _, x, _ in data])
    expected = outputs.mean((0, 2, 3))  # equal batches: the mean of the batch means
    assert torch.allclose(model[1].running_mean, expected, atol=1e-5)
    assert model[1].momentum == 0.1  # restored
    assert not recompute_batchnorm(nn.Linear(2, 2), data)


def test_the_better_of_the_last_weights_and_the_average_is_kept():
    torch.manual_seed(0)
    model = build_model("cnn2", 1, 3, 4)
    averaged = weight_average(model, 0.5)
    averaged.update_parameters(model)
    with torch.no_grad():  # ruin the last weights: the average must win
        for parameter in model.parameters():
            parameter.mul_(-50)
    train = batches(seed=2)
    reference = copy.deepcopy(averaged.module)  # label the images as the average sees them
    recompute_batchnorm(reference, train)
    reference.eval()
    val = [(ids, x, reference(x).argmax(1)) for ids, x, _ in batches(seed=1)]
    choice = choose_weights(model, averaged, val, train, torch.device("cpu"))
    assert choice.source == "averaged" and choice.metrics["val_accuracy"] == 1.0
    assert choice.metrics["val_accuracy"] > choice.metrics["val_accuracy_last"]
    assert choice.module is not averaged.module  # a copy: the average goes on averaging
    alone = choose_weights(model, None, val, train, torch.device("cpu"))
    assert alone.source == "model" and alone.module is model


def test_the_scheduler_decides_as_the_pure_steps_do():
    spaces = [SearchSpace("lr", 0.01, 1.0, "log"), SearchSpace("augment", 0.0, 1.0, "linear")]
    base = {"lr": 0.1, "augment": 0.5, "momentum": 0.9}
    scheduler = PBTScheduler(spaces, 3, base, seed=7)
    rng = random.Random(7)
    expected = [base | drawn for drawn in initial_hyperparameters(spaces, 3, rng)]
    assert scheduler.hyperparameters == expected
    decision = scheduler.decide([0.5, None, 0.75])
    assert (decision.stage, decision.best, decision.score) == (1, 2, 0.75)
    assert decision.hyperparameters[2] == expected[2]  # the best keeps its values
    assert decision.hyperparameters[0] == explore(expected[2], spaces, rng)
    assert decision.hyperparameters[1] == explore(expected[2], spaces, rng)
    assert decision.hyperparameters[0]["momentum"] == 0.9  # unsearched: carried along
    with pytest.raises(ValueError, match="every member failed"):
        scheduler.decide([None, None, None])


def test_the_shift_of_the_augmentation_is_a_fraction_of_the_image():
    from training.batches import max_shift_for

    assert [max_shift_for(a, 28) for a in (0.0, 0.5, 1.0)] == [0, 2, 4]  # as before at 28
    assert max_shift_for(0.5, 8) == pytest.approx(4 / 7)  # below a pixel: kept as a fraction
    assert max_shift_for(1.0, 8) == 1  # never past size / 7
    assert max_shift_for(0.5, 16) == 1 and max_shift_for(1.0, 64) == 9
