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
    # features + int32 id + int16 state + int16 write count
    assert bank.nbytes() == 1000 * 64 * 2 + 1000 * (4 + 2 + 2)
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


def test_a_mean_bank_averages_every_state_that_wrote_an_entry():
    bank = FeatureBank(torch.tensor([1, 2]), (2,), dtype=torch.float32)
    bank.update(torch.tensor([1, 2]), torch.tensor([[1.0, 0.0], [4.0, 4.0]]), 1, average=True)
    bank.update(torch.tensor([1]), torch.tensor([[3.0, 6.0]]), 2, average=True)
    bank.update(torch.tensor([1]), torch.tensor([[5.0, 0.0]]), 3, average=True)
    assert bank.lookup(torch.tensor([1, 2]))[0].tolist() == [[3.0, 2.0], [4.0, 4.0]]
    assert bank.writes.tolist() == [3, 1] and bank.state.tolist() == [3, 1]
    bank.update(torch.tensor([1]), torch.tensor([[9.0, 9.0]]), 4)  # latest: replaces the mean
    assert bank.lookup(torch.tensor([1]))[0].tolist() == [[9.0, 9.0]]
    # a bank written before write counts were kept counts one write per filled entry
    old = {k: v for k, v in bank.state_dict().items() if k != "writes"}
    assert FeatureBank.from_state_dict(old).writes.tolist() == [1, 1]


def test_a_bank_with_views_records_the_view_of_each_entry_and_hands_them_to_batches():
    bank = FeatureBank(torch.tensor([30, 10, 20]), (1,), views=2)
    with pytest.raises(ValueError, match="pass the views"):
        bank.update(torch.tensor([10]), torch.ones(1, 1), 1)
    bank.update(torch.tensor([20, 10]), torch.ones(2, 1), 1,
                views=(torch.tensor([True, False]), torch.tensor([[1, -2], [0, 3]])))
    with pytest.raises(ValueError, match="mix features of different views"):
        bank.update(torch.tensor([10]), torch.ones(1, 1), 2, average=True,
                    views=(torch.tensor([True]), torch.zeros(1, 2)))
    copy = FeatureBank.from_state_dict(bank.state_dict())
    views = copy.recorded_views()
    assert views.ids.tolist() == [10, 20, 30] and views.recorded.tolist() == [True, True, False]
    # a batch of 30, 20, 10: 20 and 10 shown as recorded, 30 (unfilled) keeps its draw
    flips, moves = views.over(torch.tensor([30, 20, 10]), torch.tensor([True, False, True]),
                              torch.tensor([[4, 4], [0, 0], [0, 0]]))
    assert flips.tolist() == [True, True, False]
    assert moves.tolist() == [[4, 4], [1, -2], [0, 3]] and moves.dtype == torch.long
    with pytest.raises(ValueError, match="another augmentation strength"):
        views.over(torch.tensor([10]), torch.tensor([False]), torch.zeros(1, 4))
    assert FeatureBank(torch.tensor([1]), (1,)).recorded_views() is None
