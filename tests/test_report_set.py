"""The benchmarks' report images (`bench.report_set`) are images nothing read: not in the
run's splits, not in the validation split of before stable splits, not in a tuning set of
`bench.small_data`; and the same for every run of a data section."""

import pytest
import torch

from bench.report_set import earlier_validation, report_positions
from bench.sets import tuning_sets
from tasks.configs.sections import DataSection
from tasks.data import split_source


@pytest.fixture(scope="module")
def source():
    data = DataSection(train_limit=20000)
    images, splits = split_source(data)
    return data, images, splits


def test_report_images_are_read_by_no_split_and_no_earlier_choice(source):
    data, images, splits = source
    chosen = report_positions(data, images.keys, images.labels, 2000)
    assert len(chosen) == 2000 == len(set(chosen.tolist()))
    assert all(images.keys[i].startswith("train/") for i in chosen.tolist())
    used = set(torch.cat(list(splits.values())).tolist())
    assert not used & set(chosen.tolist())
    train_file = torch.tensor([i for i, k in enumerate(images.keys) if k.startswith("train/")])
    labels = images.labels[train_file]
    earlier = earlier_validation(labels)
    assert len(earlier) == 6000 and torch.bincount(labels[list(earlier)]).tolist() == [600] * 10
    tuned = tuning_sets(labels)
    assert 8000 < len(tuned) <= 500 + 1500 + 5000 + 1500  # the four sets may share images
    assert not (earlier | tuned) & set(chosen.tolist())  # train-file positions = source's
    assert torch.equal(chosen, report_positions(data, images.keys, images.labels, 2000))
    # every class is there, about a tenth each
    assert torch.bincount(images.labels[chosen], minlength=10).min() > 120


def test_a_data_set_that_leaves_too_few_images_is_refused(source):
    data, images, _ = source
    with pytest.raises(ValueError, match="only .* unread training images are left"):
        report_positions(data.model_copy(update={"train_limit": None}), images.keys,
                         images.labels, 2000)
