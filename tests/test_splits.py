"""Stable splits: an image's split is a function of its path, so a growing folder keeps it.

The measured failure this guards against: with a positional shuffle, growing a folder of
10 classes x 150 images to 165 per class moved 82% of the old test images into training or
validation, and the champion was then scored on images it had trained on.
"""

from __future__ import annotations

import csv
import io
from collections import Counter

import pytest
from PIL import Image

from tasks.configs.sections import SplitsConfig
from tasks.data import source_keys, split_assignment
from tests.conftest import run_cli
from training.datasets import UNUSED, group_key, stable_split, unit_hash


def folder_keys(classes: int, per_class: int, start: int = 0) -> list[str]:
    return [f"class{c}/img_{i:04d}.png" for c in range(classes)
            for i in range(start, start + per_class)]


def test_a_growing_and_shrinking_folder_keeps_every_remaining_images_split():
    before = folder_keys(10, 150)
    # grows by 20% (165 -> 180 per class) and loses 5% of the old images
    after = [k for k in before if unit_hash(k, 99, "drop") >= 0.05] + folder_keys(10, 30, 150)
    old = dict(zip(before, stable_split(before, 0.1, 0.2, seed=0), strict=True))
    new = dict(zip(after, stable_split(after, 0.1, 0.2, seed=0), strict=True))
    kept = set(old) & set(new)
    assert len(kept) > 0.9 * len(before)
    assert all(old[k] == new[k] for k in kept)
    # the new test split holds no image the old split trained or validated on
    assert not {k for k in kept if new[k] == "test" and old[k] != "test"}


def test_shares_follow_the_fractions_per_class():
    keys = folder_keys(4, 2000)
    splits = stable_split(keys, 0.1, 0.2, seed=3)
    for c in range(4):
        counts = Counter(s for k, s in zip(keys, splits, strict=True) if k.startswith(f"class{c}/"))
        # test: 20%; validation: 10% of the other 80% = 8%; binomial sd ~ 0.9 / 0.6 points
        assert counts["test"] / 2000 == pytest.approx(0.20, abs=0.03)
        assert counts["val"] / 2000 == pytest.approx(0.08, abs=0.025)
    other = stable_split(keys, 0.1, 0.2, seed=4)
    assert sum(a != b for a, b in zip(splits, other, strict=True)) > 0.2 * len(keys)


def test_a_group_pattern_keeps_variants_of_one_original_together():
    keys = [f"cat/cat_{i:03d}{suffix}.png" for i in range(300) for suffix in ("", "_flip",
                                                                             "_crop")]
    assert group_key("cat/cat_001_flip.png", r"(cat_\d+)") == "cat/cat_001"
    assert group_key("cat/other.png", r"(cat_\d+)") == "cat/other.png"  # no match: its own
    assert group_key("dog_7.png", r"dog_\d+") == "dog_7"  # no group: the whole match
    grouped = dict(zip(keys, stable_split(keys, 0.1, 0.2, 0, r"(cat_\d+)"), strict=True))
    for i in range(300):
        assert len({grouped[f"cat/cat_{i:03d}{s}.png"] for s in ("", "_flip", "_crop")}) == 1
    alone = dict(zip(keys, stable_split(keys, 0.1, 0.2, 0), strict=True))
    assert any(len({alone[f"cat/cat_{i:03d}{s}.png"] for s in ("", "_flip", "_crop")}) > 1
               for i in range(300))


def test_fashion_mnist_keeps_its_official_test_set_and_a_stable_validation():
    data = SplitsConfig(train_limit=None)
    keys = source_keys(data)
    splits = split_assignment(data, keys)
    assert len(keys) == 70000
    assert all((s == "test") == k.startswith("test/") for k, s in zip(keys, splits, strict=True))
    assert Counter(splits)["val"] == pytest.approx(6000, abs=250)
    limited = split_assignment(SplitsConfig(train_limit=20000), keys)
    assert Counter(limited)["train"] == 20000
    assert all(b in (a, UNUSED) for a, b in zip(splits, limited, strict=True))


def _image_folder(root, per_class):
    for name in ("a", "b"):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.new("L", (8, 8), color=i).save(root / name / f"{i:03d}.png")
    return root


def test_the_splits_command_prints_every_images_split(tmp_path, capsys):
    root = _image_folder(tmp_path / "imgs", 40)
    code, out, _ = run_cli(capsys, "splits", "--data", str(root))
    assert code == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["path", "split"]
    table = dict(rows[1:])
    assert len(table) == 80 and set(table) == {f"{c}/{i:03d}.png" for c in "ab"
                                               for i in range(40)}
    assert set(table.values()) <= {"train", "val", "test"}
    _image_folder(tmp_path / "imgs", 60)  # 20 more per class
    _, grown, _ = run_cli(capsys, "splits", "--data", str(root))
    grown_table = dict(list(csv.reader(io.StringIO(grown)))[1:])
    assert all(grown_table[path] == split for path, split in table.items())
    code, _, err = run_cli(capsys, "splits", "--data", str(root), "--group-pattern", "(")
    assert code == 2 and "group_pattern" in err


def test_a_validation_limit_keeps_the_images_that_hash_lowest_and_they_stay_as_a_folder_grows():
    from training.datasets import UNUSED, assign_splits

    keys = [f"train/{n:05d}.png" for n in range(4000)]
    full = assign_splits(keys, 0.2, 0.0, 3)
    limited = assign_splits(keys, 0.2, 0.0, 3, val_limit=100)
    assert limited.count("val") == 100 and full.count("val") > 700
    # only validation images are left out; train and test are untouched
    assert [s for s in limited if s != UNUSED] == [
        s for s, kept in zip(full, limited, strict=True) if kept != UNUSED]
    assert all(f == "val" for f, s in zip(full, limited, strict=True) if s == UNUSED)
    # a grown folder: an old validation image is still validation or left out (a new one may
    # hash lower), never moved to training or test
    grown = assign_splits(keys + [f"train/new{n}.png" for n in range(500)], 0.2, 0.0, 3,
                          val_limit=100)
    assert grown.count("val") == 100
    assert all(g in ("val", UNUSED) for s, g in zip(limited, grown, strict=False) if s == "val")


def test_copies_of_an_image_share_a_split_whatever_their_names():
    """The same image under several names is grouped by its content: a copy never lands in
    the test split while the original trains, and a copy added later never takes an image
    out of the test split."""
    keys = [f"cls/img{n:04d}.png" for n in range(600)]
    contents = [f"c{n}" for n in range(600)]
    copies = {n: 300 + n for n in range(0, 300, 3)}  # 100 images copied under another name
    for original, copy in copies.items():
        contents[copy] = contents[original]
    by_name = stable_split(keys, 0.1, 0.3, 0)
    assert any(by_name[a] != by_name[b] for a, b in copies.items())  # by path alone: apart
    by_content = stable_split(keys, 0.1, 0.3, 0, contents=contents)
    assert all(by_content[a] == by_content[b] for a, b in copies.items())
    assert all(by_content[n] == "test" for n in range(600) if by_name[n] == "test")
    alone = [n for n in range(600) if n not in copies and n not in copies.values()]
    assert all(by_content[n] == by_name[n] for n in alone)  # every other image stays put


def test_a_class_without_validation_or_test_images_gets_them_or_is_named(tmp_path, capsys):
    """A class the hashes leave without a validation or test image gets one of its training
    images moved there; one too small for three splits is refused by name (or, by flag,
    warned about)."""
    from tasks.configs.sections import DataSection
    from training.datasets import DataError, empty_splits, fill_empty_splits

    keys = [f"big/{n:03d}.png" for n in range(50)] + [f"small/{n}.png" for n in range(6)]
    hashed = stable_split(keys, 0.1, 0.2, 0)
    splits = ["train" if k.startswith("small/") else s for k, s in zip(keys, hashed,
                                                                       strict=True)]
    filled, moved = fill_empty_splits(keys, splits, 0)
    unfilled = empty_splits(keys, filled)
    small = [s for k, s in zip(keys, filled, strict=True) if k.startswith("small/")]
    assert sorted(small) == ["test", "train", "train", "train", "train", "val"]
    assert moved == {"small": ["val", "test"]} and unfilled == {}
    assert all(f == s for k, f, s in zip(keys, filled, splits, strict=True)
               if k.startswith("big/"))
    assert fill_empty_splits(keys, splits, 0) == (filled, moved)  # deterministic

    root = _image_folder(tmp_path / "imgs", 40)
    (root / "rare").mkdir()
    for i in range(2):  # two images cannot fill three splits
        Image.new("L", (8, 8), color=200 + i).save(root / "rare" / f"{i}.png")
    data = DataSection(data=str(root))
    keys = source_keys(data)
    with pytest.raises(DataError, match="'rare': ") as refused:
        split_assignment(data, keys)
    assert "--tiny-classes warn" in str(refused.value) and "'a'" not in str(refused.value)
    warned = split_assignment(data.replace(tiny_classes="warn"), keys)
    assert len(warned) == len(keys)
    code, _, err = run_cli(capsys, "splits", "--data", str(root))
    assert code == 2 and "'rare'" in err


def test_few_label_draws_are_stable_as_the_folder_grows():
    """The K labelled images per class are those whose keys hash lowest: adding images keeps
    them unless a new one hashes lower (a positional draw reshuffled all of them)."""
    import torch

    from training.datasets import labelled_images

    keys = [f"{c}/{n:03d}.png" for c in "ab" for n in range(100)]
    labels = torch.tensor([0] * 100 + [1] * 100)
    kept = {keys[i] for i in labelled_images(labels, torch.arange(200), 5, 0, keys).tolist()}
    grown_keys = keys[:100] + [f"a/new{n}.png" for n in range(50)] + keys[100:]
    grown_labels = torch.tensor([0] * 150 + [1] * 100)
    grown = {grown_keys[i] for i in labelled_images(grown_labels, torch.arange(250), 5, 0,
                                                     grown_keys).tolist()}
    assert len(kept) == len(grown) == 10
    assert {k for k in kept if k.startswith("b/")} == {k for k in grown if k.startswith("b/")}
    new_ones = {k for k in grown if "new" in k}  # a new image that hashes lower displaces one
    assert len(kept - grown) == len(new_ones) < 5
