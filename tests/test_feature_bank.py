"""The feature bank: entries by dataset id, state ids, masking, memory, and state round trips."""

from __future__ import annotations

import pytest
import torch

from training.distill.feature_bank import UNFILLED, FeatureBank


def test_entries_are_found_by_dataset_id_and_keep_the_state_that_wrote_them():
    bank = FeatureBank(torch.tensor([40, 7, 19, 3]), (2,))
    bank.update(torch.tensor([19, 3]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), state=1)
    bank.update(torch.tensor([3, 40]), torch.tensor([[5.0, 6.0], [7.0, 8.0]]), state=2)
    features, filled = bank.lookup(torch.tensor([3, 7, 19, 40]))
    assert features.dtype == torch.float32
    assert features.tolist() == [[5.0, 6.0], [0.0, 0.0], [1.0, 2.0], [7.0, 8.0]]
    assert filled.tolist() == [True, False, True, True]
    assert bank.state_histogram() == {UNFILLED: 1, 1: 1, 2: 2}
    assert bank.fill_fraction() == 0.75


def test_unknown_ids_and_misshapen_features_are_refused():
    bank = FeatureBank(torch.tensor([1, 2, 3]), (4,))
    with pytest.raises(KeyError, match=r"\[9\]"):
        bank.lookup(torch.tensor([2, 9]))
    with pytest.raises(ValueError, match="do not fit"):
        bank.update(torch.tensor([1]), torch.zeros(1, 5), state=1)
    with pytest.raises(ValueError, match="distinct"):
        FeatureBank(torch.tensor([1, 1]), (4,))


def test_features_are_float16_and_memory_is_entries_times_values_times_two_bytes():
    bank = FeatureBank(torch.arange(1000), (64,))
    assert bank.features.dtype == torch.float16
    assert bank.nbytes() == 1000 * 64 * 2 + 1000 * (4 + 2)  # features + int32 id + int16 state
    value = torch.tensor([[1 / 3] * 64])
    bank.update(torch.tensor([5]), value, state=1)
    assert bank.lookup(torch.tensor([5]))[0][0, 0].item() == pytest.approx(1 / 3, abs=1e-3)


def test_state_dict_round_trip_and_maps():
    bank = FeatureBank(torch.tensor([10, 20]), (3, 2, 2), dtype=torch.float32)
    bank.update(torch.tensor([20]), torch.ones(1, 3, 2, 2), state=4)
    copy = FeatureBank.from_state_dict(bank.state_dict())
    assert copy.feature_shape == (3, 2, 2)
    assert torch.equal(copy.lookup(torch.tensor([20]))[0], torch.ones(1, 3, 2, 2))
    assert copy.state_histogram() == {UNFILLED: 1, 4: 1}
    with pytest.raises(ValueError, match="disagree"):
        FeatureBank.from_state_dict({"ids": torch.zeros(2, dtype=torch.int32),
                                     "features": torch.zeros(3, 1),
                                     "state": torch.zeros(2, dtype=torch.int16)})
