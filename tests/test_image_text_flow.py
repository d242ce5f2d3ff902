"""The `image_text` flow end to end (real Prefect, MLflow, DVC, Fashion-MNIST, WordNet and the
pretrained MiniLM from its wheel), its text-initialized classifier, what a few-label run gives
its unlabelled images and its choices, its head mixing, its registered pyfunc, and its bad
input on the command line."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from tasks.adapters import tracking
from tasks.configs.image_text import ImageTextConfig
from tests.conftest import run_cli

UNSEEN = ("Sandal", "Bag")


def smoke_image_text(**overrides) -> ImageTextConfig:
    return ImageTextConfig(**{"profile": "smoke", "text_encoder": "minilm", "rounds": 2,
                              "train_limit": 768, "lr": 0.1, "min_steps": 60,
                              "labels_per_class": 20, "unseen_classes": UNSEEN,
                              "model_name": "smoke-image-text", **overrides})


@pytest.fixture(scope="module")
def run():
    from flows.image_text import image_text

    return image_text(smoke_image_text(registry=True))


def _prepared(config: ImageTextConfig):
    from tasks.data import prepare_dataset, source_version

    data = config.dataset
    return prepare_dataset(data, source_version(data))


def test_descriptions_rounds_and_zero_shot_are_tracked_and_versioned(run):
    client = MlflowClient()
    data = client.get_run(run.run_id).data
    metrics, tags = data.metrics, data.tags
    for key in ("captions", "class_descriptions", "text_features", "checkpoint.final"):
        assert len(tags[f"dvc.{key}"]) == 32, key
    refs = tracking.artifact_refs(run.run_id)
    assert {"checkpoint.align-001", "checkpoint.round-002", "captions"} <= set(refs)
    # labelled: 2 of the class's descriptions + 2 phrases; unlabelled: 2 phrases + 1 written
    assert 3 <= metrics["texts_per_image"] < 4
    assert [m.step for m in client.get_metric_history(run.run_id, "align_loss")] == [1]
    assert {"loss_ce", "loss_contrastive", "val_zero_shot_accuracy", "test_accuracy",
            "test_zero_shot_accuracy", "test_unseen_zero_shot_accuracy",
            "test_seen_accuracy"} <= set(metrics)
    # the classifier never saw an unseen class: it cannot name one; zero-shot can
    assert metrics["test_unseen_accuracy"] == 0.0
    assert 0.0 <= metrics["test_unseen_zero_shot_accuracy"] <= 1.0
    assert metrics["test_seen_accuracy"] > 0.3  # it learns (chance 0.125 among 8)


def test_the_classifier_starts_from_the_class_descriptions(run):
    """The first joint round's classifier: each class's text direction times the similarity
    scale; without text initialization, other directions of the same norms."""
    from tasks.adapters.checkpoints import load_checkpoint
    from tasks.adapters.versioning import ArtifactStore
    from tasks.data import load_dataset
    from tasks.image_text.tasks import new_network, text_side
    from training.image_text.text_side import start_classifier

    config = smoke_image_text()
    dataset = _prepared(config)
    side = text_side(config, dataset, load_dataset(dataset), run.descriptions)
    model = new_network(config, dataset, run.descriptions)
    model.load_state_dict(load_checkpoint(ArtifactStore(), run.aligned)["model"])
    start_classifier(model, side, config.text_init, config.run.seed, torch.device("cpu"))
    text_weights = side.class_weights(model, torch.device("cpu"))
    assert torch.allclose(model.head.weight, text_weights, atol=1e-5)
    scale = float(model.logit_scale.detach().exp())
    assert text_weights.norm(dim=1).tolist() == pytest.approx([scale] * 10, rel=1e-4)
    start_classifier(model, side, False, config.run.seed, torch.device("cpu"))
    assert torch.allclose(model.head.weight.norm(dim=1), text_weights.norm(dim=1))
    cosines = torch.nn.functional.cosine_similarity(model.head.weight, text_weights, dim=1)
    assert cosines.abs().max() < 0.99


def test_unlabelled_images_get_no_text_derived_from_their_labels(run):
    """A few-label run (20 per class) of the project's own texts: every row of an unlabelled
    training image is one of its measured phrases or the captioner's, the class descriptions
    go to the labelled images only, and the choices read at most 20 validation images per
    class. The raw-pixel baselines its gate compares with hold the same labels: fitted on
    the labelled training images, chosen on the same validation images."""
    from tasks.adapters.versioning import ArtifactStore
    from tasks.data import load_dataset
    from tasks.image_text.tasks import chosen_validation, training_images

    config = smoke_image_text()
    dataset = _prepared(config)
    data = load_dataset(dataset)
    train, labelled = training_images(config, dataset, data)
    store, described = ArtifactStore(), run.descriptions
    generated = pd.read_parquet(store.fetch(described.captioned.captions))
    rows = pd.concat([pd.read_parquet(store.fetch(described.captions)), generated])
    rows = rows[rows["position"].isin(set(train.tolist()))]
    known = rows["position"].map(lambda p: bool(labelled[p]))
    assert set(rows[~known]["kind"]) == {"phrase", "generated"}
    assert set(rows[known]["kind"]) == {"name", "synonyms", "definition", "hypernym",
                                        "phrase"}
    assert not set(generated["position"]) & set(rows[known]["position"])
    assert described.labelled_images == int(labelled.sum()) == 8 * 20  # 2 classes unseen
    assert 0 < described.captioned.generated <= len(train) - described.labelled_images
    # the choices read 20 validation images of each class but the 2 unseen ones, whose
    # labels the zero-shot figure claims the run never saw
    val = chosen_validation(config, dataset, data)
    counts = torch.bincount(data.labels[val], minlength=10)
    unseen = [dataset.classes.index(name) for name in UNSEEN]
    assert counts[unseen].sum() == 0 and counts.max() <= 20
    assert described.val_images == len(val) == 8 * 20
    metrics = MlflowClient().get_run(run.run_id).data.metrics
    assert metrics["val_images"] == 160
    assert metrics["baseline_train_images"] == described.labelled_images
    assert metrics["baseline_val_images"] == 160


def test_a_few_label_runs_own_pool_holds_none_of_its_images():
    from tasks.data import load_dataset
    from tasks.image_text.descriptions import wordnet_classes
    from tasks.image_text.pool import own_pool
    from training.image_text.matching import NO_MATCH

    dataset = _prepared(smoke_image_text())
    data = load_dataset(dataset)
    classes = wordnet_classes(dataset.classes)
    pool = own_pool(data, dataset, classes, 0.5, 40, 2, True, 0, train_copies=False)
    assert pool["item"].nunique() == 40 and (pool["source"] == NO_MATCH).all()
    every = own_pool(data, dataset, classes, 0.5, 40, 2, True, 0)
    assert every["item"].nunique() == 40 + round(0.5 * len(data.splits["train"]))


def test_the_registered_pyfunc_classifies_images(run):
    import mlflow

    from tasks.promotion import test_images

    images, labels = test_images(_prepared(smoke_image_text()))
    model = mlflow.pyfunc.load_model(f"models:/smoke-image-text/{run.registration.version}")
    out = model.predict(images[:64])
    assert {"label", "confidence"} <= set(out.columns)
    accuracy = (out["label"] == pd.Series(labels[:64])).mean()
    assert accuracy > 0.2
    assert run.registration.accuracy == pytest.approx(run.test_accuracy)  # as served


def test_the_registered_pyfunc_classifies_zero_shot_among_given_descriptions(run, tmp_path,
                                                                            capsys):
    """Zero-shot among descriptions given when predicting: in Python (a parameter of the
    pyfunc) and on the command line (`predict --classes`), which refuses other models."""
    import mlflow

    from tasks.promotion import test_images

    images, labels = test_images(_prepared(smoke_image_text()))
    uri = f"models:/smoke-image-text/{run.registration.version}"
    texts = [f"a {name.split('/')[0].lower()}" for name in sorted(set(labels))]
    out = mlflow.pyfunc.load_model(uri).predict(images[:200], params={"classes": ";".join(texts)})
    assert set(out["label"]) <= set(texts)
    assert out["confidence"].between(1 / len(texts), 1).all()
    named = [f"a {name.split('/')[0].lower()}" for name in labels[:200]]
    # above chance (1 in len(texts)) by a one-sided binomial test: a 2-round smoke model's
    # accuracy depends on which 20 images per class keep their label
    hits, n, chance = int((out["label"] == pd.Series(named)).sum()), len(named), 1 / len(texts)
    p = sum(math.comb(n, k) * chance ** k * (1 - chance) ** (n - k) for k in range(hits, n + 1))
    assert p < 0.01, (hits, n, chance)
    folder = tmp_path / "images"
    folder.mkdir()
    from PIL import Image

    for i in range(3):
        Image.fromarray(images[i]).save(folder / f"{i}.png")
    classes = tmp_path / "classes.txt"
    classes.write_text("a sandal\na boot\na bag\n")
    code, out, err = run_cli(capsys, "predict", "--model-name", "smoke-image-text",
                             "--version", run.registration.version, "--images", str(folder),
                             "--classes", str(classes))
    assert code == 0, err
    rows = out.strip().splitlines()[1:]
    assert len(rows) == 3 and all(any(t in row for t in ("a sandal", "a boot", "a bag"))
                                  for row in rows), out
    code, out, err = run_cli(capsys, "predict", "--model-name", "smoke-image-text",
                             "--version", run.registration.version, "--images", str(folder),
                             "--classes", "a sandal")
    assert code == 2 and "at least two class descriptions" in err


@pytest.fixture(scope="module")
def pooled():
    """Sources 2 and 3: the training images matched against the project's own pool, the
    unmatched ones described by the captioner."""
    from flows.image_text import image_text

    return image_text(smoke_image_text(captions_source="pool", pool_distractors=500,
                                       unseen_classes=(), labels_per_class=None,
                                       caption_steps=150, rounds=1, head_mixing=True,
                                       registry=True, model_name="smoke-image-text-pool"))


def test_pool_matches_and_the_captioner_describes_the_rest(pooled):
    from tasks.adapters.versioning import ArtifactStore

    described = pooled.descriptions
    assert described.matching["match_precision"] > 0.7
    assert described.matching["match_recall"] > 0.5
    captioned = described.captioned
    matched = int(described.matching["matched_images"])
    assert captioned is not None and captioned.generated > 0
    assert matched + captioned.generated == described.described_images
    generated = pd.read_parquet(ArtifactStore().fetch(captioned.captions))
    assert (generated["kind"] == "generated").all() and (generated["text"] != "").all()
    assert len(generated) == captioned.generated
    # trained on the matched images' descriptions, it describes held-out ones better than
    # their most frequent description does
    assert captioned.bleu > captioned.constant_bleu
    metrics = MlflowClient().get_run(pooled.run_id).data.metrics
    assert metrics["captioner_bleu"] == pytest.approx(captioned.bleu)
    assert metrics["match_precision"] == pytest.approx(described.matching["match_precision"])


def test_the_mixed_head_is_chosen_on_validation_tested_and_registered(pooled):
    """Head mixing: every alpha's validation accuracy is logged, the best one's is the run's,
    the final checkpoint's classifier is the kept round's mixed with its zero-shot head, and
    the registered pyfunc scores as the test did."""
    from tasks.adapters.versioning import ArtifactStore
    from tasks.data import load_dataset
    from tasks.image_text.tasks import new_network, text_side
    from training.image_text.losses import mixed_head

    metrics = MlflowClient().get_run(pooled.run_id).data.metrics
    accuracies = {a: metrics[f"head_mixing_val_accuracy_{a}"]
                  for a in ("0", "0.25", "0.5", "0.75", "1")}
    alpha = pooled.head_mixing_alpha
    assert metrics["head_mixing_alpha"] == alpha and accuracies[f"{alpha:g}"] == max(
        accuracies.values()) == pytest.approx(pooled.val_accuracy)
    store, refs = ArtifactStore(), tracking.artifact_refs(pooled.run_id)

    def checkpoint(name: str) -> dict:
        return torch.load(store.path_of(refs[name]["path"]), weights_only=True)

    final = checkpoint("checkpoint.final")
    config = smoke_image_text(captions_source="pool", pool_distractors=500, unseen_classes=(),
                              labels_per_class=None, caption_steps=150, rounds=1)
    kept = checkpoint(f"checkpoint.round-{final['round'] - config.align_rounds + 1:03d}")
    dataset = _prepared(config)
    side = text_side(config, dataset, load_dataset(dataset), pooled.descriptions)
    model = new_network(config, dataset, pooled.descriptions)
    model.load_state_dict(kept["model"])
    zero_shot = side.class_weights(model, torch.device("cpu"))
    assert final["head_mixing"] == alpha
    assert torch.allclose(final["model"]["head.weight"],
                          mixed_head(kept["model"]["head.weight"], zero_shot, alpha), atol=1e-5)
    assert pooled.registration.accuracy == pytest.approx(pooled.test_accuracy)  # as served


def _runs() -> int:
    """How many MLflow runs the image_text experiment holds (none before its first run)."""
    experiment = MlflowClient().get_experiment_by_name("image_text")
    return 0 if experiment is None else len(MlflowClient().search_runs(
        [experiment.experiment_id]))


@pytest.mark.parametrize(("rows", "column", "message"), [
    ({"image": ["3", "99999999", "88888888"], "text": ["a", "b", "c"]}, "--captions",
     "2 images not in the data set, e.g. 88888888, 99999999"),
    ({"image": ["3", "4"], "text": ["a shoe", ""]}, "--captions",
     "1 rows with an empty text (lines 3)"),
    ({"image": ["3"], "text": ["a shoe"], "weight": [-1]}, "--captions",
     "1 rows with a negative or non-numeric weight (lines 2)"),
    ({"class": ["Sneaker"], "text": ["a shoe"]}, "--class-descriptions",
     "no description for classes T-shirt/top, Trouser"),
])
def test_bad_descriptions_are_one_error_line_before_any_work(rows, column, message, tmp_path,
                                                             capsys):
    table = tmp_path / "table.csv"
    pd.DataFrame(rows).to_csv(table, index=False)
    runs = _runs()
    code, _, err = run_cli(capsys, "image-text", "--profile", "smoke", column, str(table))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert _runs() == runs  # no flow ran


def test_bad_options_name_the_field(capsys):
    def cli(*flags: str) -> tuple[int, str]:
        code, _, err = run_cli(capsys, "image-text", "--profile", "smoke", *flags)
        return code, err

    code, err = cli("--unseen-classes", "Sandal,Spaceship")
    assert code == 2 and "no class Spaceship in the data" in err
    code, err = cli("--captions", "/no/such/file.csv")
    assert code == 2 and "captions" in err and "no such file" in err
    code, err = cli("--contrastive-weight", "0")
    assert code == 2 and "align_rounds needs the contrastive" in err
    code, err = cli("--ddp-procs", "2")  # refused, never accepted and ignored
    assert code == 2 and "ddp_procs: the image_text flow trains in one process" in err
