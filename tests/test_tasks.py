"""Task logic through `.fn()`: the data and round tasks on a fresh artifact store."""

import math

import pytest
import torch

from tasks.adapters.versioning import ArtifactStore
from tasks.configs.sections import classifier_config
from tasks.configs.train import TrainConfig
from tasks.data import load_dataset, prepare_dataset, source_version
from tasks.rounds import round_task
from tasks.training import ClassifierRound, run_key


def test_prepare_dataset_splits_and_versions_the_subset():
    config = TrainConfig(profile="smoke", train_limit=300, test_limit=100, val_fraction=0.2,
                         val_limit=None)
    data = config.dataset
    ref = prepare_dataset.fn(data, source_version(data))
    # validation: a hash of each image's key below 0.2 (60,000 x 0.2 +- 3 binomial sd)
    assert (ref.sizes["train"], ref.sizes["test"]) == (300, 100)
    assert abs(ref.sizes["val"] - 12000) < 300
    assert ref.classes[9] == "Ankle boot" and ref.channels == 1 and ref.image_size == 28
    loaded = load_dataset(ref)
    ids = {name: set(loaded.ids[idx].tolist()) for name, idx in loaded.splits.items()}
    assert ids["train"].isdisjoint(ids["val"]) and ids["train"].isdisjoint(ids["test"])
    assert min(ids["test"]) >= 60000  # Fashion-MNIST's own test images
    keys = {name: {loaded.keys[i] for i in idx.tolist()} for name, idx in loaded.splits.items()}
    assert all(k.startswith("test/") for k in keys["test"])
    assert loaded.seen_keys() == keys["train"] | keys["val"]
    assert ArtifactStore().fetch(ref.artifact).stat().st_size == ref.artifact.size
    again = prepare_dataset.fn(data, source_version(data))
    assert again.artifact == ref.artifact  # same inputs, same bytes, same hash


def test_resized_rgb_fashion_mnist():
    data = TrainConfig(profile="smoke", image_size=32, channels=3).dataset
    ref = prepare_dataset.fn(data, source_version(data))
    assert (ref.channels, ref.image_size) == (3, 32)
    assert load_dataset(ref).images.shape[1:] == (3, 32, 32)


def test_round_task_resumes_with_the_configured_learning_rate():
    config = TrainConfig(profile="smoke", rounds=2, lr=0.2, momentum=0.0, train_limit=256)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    classifier = classifier_config(config)
    first = round_task.fn(ClassifierRound(config=classifier, dataset=dataset, round=0))
    assert first.checkpoint.path.endswith(f"{run_key(classifier, dataset)}/round-001.pt")
    # A checkpoint written with another learning rate: the resumed run must not inherit it.
    stored = torch.load(ArtifactStore().fetch(first.checkpoint), weights_only=True)
    assert stored["optimizer"]["param_groups"][0]["lr"] == first.metrics["lr"]
    faster = classifier.replace(lr=0.4)
    second = round_task.fn(ClassifierRound(config=faster, dataset=dataset, round=1),
                            first.checkpoint)
    # 256 images in batches of 64: 4 steps an epoch; the last step is step 7 of 8, and the
    # cosine schedule of the configured 0.4 gives 0.4 * (1 + cos(7/8 pi)) / 2 there.
    assert second.metrics["lr"] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_warm_continuation_equals_a_cold_resume_from_the_checkpoint():
    from tasks import training

    config = TrainConfig(profile="smoke", rounds=2, train_limit=256, seed=3)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    classifier = classifier_config(config)
    first = round_task.fn(ClassifierRound(config=classifier, dataset=dataset, round=0))
    second = ClassifierRound(config=classifier, dataset=dataset, round=1)
    warm = round_task.fn(second, first.checkpoint)  # live model
    training._WARM.clear()
    cold = round_task.fn(second, first.checkpoint)  # from disk
    store = ArtifactStore()
    warm_state = torch.load(store.fetch(warm.checkpoint), weights_only=True)
    cold_state = torch.load(store.fetch(cold.checkpoint), weights_only=True)
    for name, tensor in warm_state["model"].items():
        assert torch.equal(tensor, cold_state["model"][name]), name
    assert cold.metrics["loss"] == warm.metrics["loss"]


def test_rounds_before_keep_from_are_neither_kept_nor_counted_by_early_stopping():
    """Validation accuracy falls every round: without `keep_from` the first round is kept and
    patience 1 stops the run after the second; with `keep_from` 2 the first two rounds count
    for nothing, so round 3 is kept and the run stops after round 4."""
    from prefect import flow

    from flows.skeleton import run_rounds
    from tasks.adapters import tracking
    from tasks.adapters.versioning import ArtifactRef
    from tasks.rounds import RoundResult

    scores = [0.9, 0.8, 0.7, 0.6, 0.5]
    trained: list[int] = []

    def scored_round(index: int, _previous: ArtifactRef | None) -> RoundResult:
        trained.append(index)
        return RoundResult(round=index, metrics={"val_accuracy": scores[index]},
                           checkpoint=ArtifactRef(path=f"round-{index}.pt", md5=f"{index:032x}",
                                                  size=1))

    @flow
    def rounds(keep_from: int) -> int:
        with tracking.tracked_run("test-rounds", f"keep-from-{keep_from}") as run_id:
            return run_rounds(len(scores), lambda index, _previous: index, run_id, 1, 100000,
                              keep_from=keep_from, train=scored_round).round

    assert rounds(0) == 0 and trained == [0, 1]
    trained.clear()
    assert rounds(2) == 2 and trained == [0, 1, 2, 3]
