"""`image_text` tasks: describe the images, encode the texts, train a round, mix the heads,
test and export.

Descriptions and text features are versioned artifacts (Parquet tables, a tensor file), so a
round on another machine pulls them by hash. The pretrained text encoder is frozen: every
distinct text is encoded once, and training reads the vectors.

A few-label run (`labels_per_class` K) keeps its labels out of the texts and out of its
choices: only the K labelled images per class get the project's class-derived descriptions;
an unlabelled image gets text only from sources blind to its label (the user's captions, a
pool that holds none of the run's images, its measured phrases, the captioner trained on the
labelled images' texts); and early stopping, the round kept and the head mixing read at most
K validation images per class (`validation_images`). The test split stays fully labelled,
for the report only.
"""

from __future__ import annotations

import pandas as pd
import torch
from prefect import task
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from models.image_text import ImageTextNet, build_image_text, encode_texts
from models.registry import build_model
from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint, torch_save
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.image_text import ImageTextConfig, seen_positions, unseen_labels
from tasks.data import DatasetRef, load_dataset
from tasks.image_text.captioner import Captioned, caption_images
from tasks.image_text.descriptions import image_keys, source_classes, wordnet_classes
from tasks.image_text.pool import own_pool
from tasks.rounds import RoundPlan
from tasks.training import run_key
from training.batches import position_batches
from training.datasets import LoadedDataset, labelled_images, validation_images
from training.device import place_model, setup_device
from training.image_text.captioner import described_positions, undescribed
from training.image_text.descriptions import (
    DescriptionError,
    check_classes,
    check_images,
    own_captions,
    read_descriptions,
)
from training.image_text.losses import ImageTextStep, TextBank
from training.image_text.matching import folder_pool, match_training_images
from training.image_text.text_side import (
    TextSide,
    mix_head,
    score_split,
    start_backbone,
    start_classifier,
)
from training.loops import evaluate
from training.recipe import optimizer_to, sgd
from training.rounds import Closed, Opened, Trainee, configured_round, image_batches


class Descriptions(BaseModel):
    """The versioned description tables and text features of a run."""

    model_config = ConfigDict(frozen=True)

    captions: ArtifactRef  # Parquet: position, text, weight, kind
    classes: ArtifactRef  # Parquet: class, text, weight, kind
    texts: ArtifactRef  # torch: {"texts": [...], "features": tensor, one row per text}
    text_dim: int
    described_images: int
    texts_per_image: float
    train_images: int  # what a round passes over (`training_images`)
    labelled_images: int
    val_images: int  # what the choices read (`validation_images`)
    pool: ArtifactRef | None = None  # the pool matched against (`tasks/image_text/pool.py`)
    matching: dict[str, float] = {}  # its figures: precision, recall, ...
    captioned: Captioned | None = None  # what the captioner wrote for undescribed images


def check_descriptions(config: ImageTextConfig) -> None:
    """Every description problem of `config`, found before any work (`DescriptionError`):
    captions naming images that do not exist, empty texts, negative weights, a class without
    a description, an unseen class the data does not have."""
    classes = source_classes(config.dataset.data)
    checked_tables(config, classes, [])
    unknown = [c for c in config.unseen_classes if c not in classes]
    if unknown:
        raise DescriptionError(f"unseen_classes: no class {', '.join(unknown)} in the data "
                               f"(classes: {', '.join(classes)})")


def checked_tables(config: ImageTextConfig, classes: list[str], skipped: list[str]
                   ) -> tuple[pd.DataFrame | None, pd.DataFrame]:
    """The user's captions (None: the project's own) and the class descriptions, checked:
    every named image exists, every class has a description (`DescriptionError` otherwise)."""
    captions = None
    if config.captions is not None:
        captions = read_descriptions(config.captions, "image")
        check_images(captions, image_keys(config.dataset.data, skipped), config.captions)
    if config.class_descriptions is None:
        table = wordnet_classes(classes)
    else:
        table = read_descriptions(config.class_descriptions, "class")
        check_classes(table, classes, config.class_descriptions)
        table = table.assign(kind="given")
    return captions, table


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="describe-images")
def describe_images(config: ImageTextConfig, dataset: DatasetRef) -> Descriptions:
    """The captions of the images of the prepared data set (by position) and each class's
    descriptions, as versioned tables, and every distinct text encoded (`encode_texts`).

    Sources: the user's table; or pool matches (a few-label run's own pool holds no copy of
    its images, `own_pool`); or the project's own texts, whose class descriptions go to the
    labelled images only (every image without `labels_per_class`) and whose measured phrases
    go to every image. The captioner, trained on the described training images, writes a
    description for each training image that has none but phrases (`undescribed`)."""
    data = load_dataset(dataset)
    given, classes = checked_tables(config, dataset.classes, dataset.skipped)
    train, labelled = training_images(config, dataset, data)
    few = config.labels_per_class is not None
    pool_ref, matching = None, {}
    store = ArtifactStore()
    key = run_key(config, dataset)
    if config.source() == "pool":
        pool = folder_pool(config.pool) if config.pool is not None else own_pool(
            data, dataset, classes, config.pool_share, config.pool_distractors,
            config.class_texts_per_image, config.phrases, config.run.seed, train_copies=not few)
        pool_ref = store.write(f"image_text/{key}/pool.parquet",
                               lambda path: pool.to_parquet(path, index=False))
        captions, matching = match_training_images(data, pool, config.match_threshold,
                                                   config.match_margin)
    elif given is None:
        captions = own_captions(data.images, data.labels, data.splits["train"], classes,
                                dataset.classes, config.class_texts_per_image, config.phrases,
                                config.run.seed, labelled.nonzero().flatten() if few else None)
    else:
        position = {name: p for p, name in enumerate(
            [image_keys(config.dataset.data, dataset.skipped)[i] for i in data.ids.tolist()])}
        kept = given[given["image"].isin(position)]
        captions = pd.DataFrame({"position": kept["image"].map(position).astype(int),
                                 "text": kept["text"], "weight": kept["weight"],
                                 "kind": "given"})
    captions_ref = store.write(f"image_text/{key}/captions.parquet",
                               lambda path: captions.to_parquet(path, index=False))
    captioned = None
    seen = seen_positions(config, dataset.classes, data.labels, data.splits["train"])
    seen_captions = captions[captions["position"].isin(set(seen.tolist()))]
    if config.caption_missing and config.contrastive_weight > 0 and \
            len(undescribed(seen, seen_captions)) and \
            len(described_positions(seen_captions)) > 1:  # it needs some to learn from
        captioned = caption_images(config, dataset, captions_ref)
        captions = pd.concat([captions, pd.read_parquet(store.fetch(captioned.captions))],
                             ignore_index=True)
    classes_ref = store.write(f"image_text/{key}/classes.parquet",
                              lambda path: classes.to_parquet(path, index=False))
    texts = sorted(set(captions["text"]) | set(classes["text"]))
    features = encode_texts(texts, config.text_encoder, config.buckets)
    texts_ref = store.write(f"image_text/{key}/texts-{config.text_encoder}.pt",
                            lambda path: torch_save({"texts": texts, "features": features},
                                                    path))
    counts = captions[captions["position"].isin(set(train.tolist()))].groupby("position").size()
    return Descriptions(captions=captions_ref, classes=classes_ref, texts=texts_ref,
                        text_dim=features.shape[1] if config.text_encoder == "minilm"
                        else config.text_dim,
                        described_images=len(counts),
                        texts_per_image=float(counts.mean()) if len(counts) else 0.0,
                        train_images=len(train), labelled_images=int(labelled.sum()),
                        val_images=len(chosen_validation(config, dataset, data)),
                        pool=pool_ref, matching=matching, captioned=captioned)


def text_side(config: ImageTextConfig, dataset: DatasetRef, data: LoadedDataset,
              described: Descriptions) -> TextSide:
    """The run's `TextSide`, read from the described run's artifacts (the captions, the
    captioner's, the class descriptions and the text features)."""
    store = ArtifactStore()
    captions = pd.read_parquet(store.fetch(described.captions))
    if described.captioned is not None:
        captions = pd.concat([captions, pd.read_parquet(
            store.fetch(described.captioned.captions))], ignore_index=True)
    classes = pd.read_parquet(store.fetch(described.classes))
    payload = torch.load(store.fetch(described.texts), weights_only=True)
    text_id = {text: i for i, text in enumerate(payload["texts"])}
    features = payload["features"]
    if not config.multi_description:  # the ablation: each image's heaviest text only
        captions = captions.sort_values(["position", "weight"], ascending=[True, False],
                                        kind="stable").drop_duplicates("position")
    name_to_label = {name: i for i, name in enumerate(dataset.classes)}
    train, labelled = training_images(config, dataset, data)
    return TextSide(
        features=features,
        bank=TextBank.build(captions["position"].tolist(), captions["text"].map(text_id).tolist(),
                            captions["weight"].tolist(), len(data.labels), features),
        class_rows=torch.tensor(classes["text"].map(text_id).tolist()),
        class_labels=torch.tensor(classes["class"].map(name_to_label).tolist()),
        train=train, labelled=labelled,
        validation=chosen_validation(config, dataset, data),
        unseen=unseen_labels(config, dataset.classes))


def chosen_validation(config: ImageTextConfig, dataset: DatasetRef, data: LoadedDataset
                      ) -> Tensor:
    """The validation positions the run's choices read (`validation_images`): the unseen
    classes' images left out, like their training images, so that no choice (the round kept,
    the head mixing) reads a label of a class the zero-shot figure claims was never seen."""
    return validation_images(data.labels, seen_positions(config, dataset.classes, data.labels,
                                                         data.splits["val"]),
                             config.labels_per_class, config.dataset.split_seed, data.keys)


def training_images(config: ImageTextConfig, dataset: DatasetRef, data: LoadedDataset
                    ) -> tuple[Tensor, Tensor]:
    """The training positions a round passes over (the unseen classes' left out; without the
    contrastive sub-loss, the labelled ones only) and, over all positions, which keep their
    label."""
    train = seen_positions(config, dataset.classes, data.labels, data.splits["train"])
    labelled = torch.zeros(len(data.labels), dtype=torch.bool)
    labelled[labelled_images(data.labels, train, config.labels_per_class,
                             config.dataset.split_seed, data.keys)] = True
    if config.contrastive_weight == 0:
        train = train[labelled[train]]
    return train, labelled


def new_network(config: ImageTextConfig, dataset: DatasetRef,
                described: Descriptions) -> ImageTextNet:
    torch.manual_seed(config.run.seed)
    return build_image_text(config.network.model, dataset.channels, len(dataset.classes),
                            config.network.width, config.dim, described.text_dim,
                            config.buckets if config.text_encoder == "builtin" else None)


class ImageTextRound(RoundPlan):
    """Round `round` (0-based, counted over all `rounds` of the run) of `repeats` passes:
    phase `align`, the contrastive sub-loss alone; phase `joint`, both sub-losses
    (`training.image_text.losses.ImageTextStep`), its first round starting the classifier from
    the class descriptions' text features (or from random directions of the same norm,
    `--no-text-init`). Scores the validation split: the classifier's accuracy
    (`val_accuracy`; zero-shot while aligning) and zero-shot accuracy from the class
    descriptions (`val_zero_shot_accuracy`) on the validation images the choices read
    (`validation_images`). `start`: a classifier checkpoint of the same network (the
    pipeline's distilled student) whose weights but its classifier the image side starts
    from."""

    config: ImageTextConfig
    dataset: DatasetRef
    described: Descriptions
    phase: str
    round: int
    rounds: int
    repeats: int
    start: ArtifactRef | None = None

    @property
    def number(self) -> int:
        return self.round

    def task_name(self) -> str:
        return f"{self.phase}-{self.round + 1}"

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        config, dataset, store = self.config, self.dataset, ArtifactStore()
        data = load_dataset(dataset)
        side = text_side(config, dataset, data, self.described)
        model = new_network(config, dataset, self.described)
        optimizer = sgd(model.parameters(), config.optim.lr, config.optim.momentum,
                        config.optim.weight_decay)
        before = load_checkpoint(store, previous) if previous is not None else {}
        if before:
            model.load_state_dict(before["model"])
            optimizer.load_state_dict(before["optimizer"])
        elif self.start is not None:
            start_backbone(model, load_checkpoint(store, self.start)["model"])
        model = place_model(model, device)
        optimizer_to(optimizer, device)
        if self.phase == "joint" and before.get("phase") != "joint":
            start_classifier(model, side, config.text_init, config.run.seed, device)
        passes = range(self.round * self.repeats, (self.round + 1) * self.repeats)
        step = ImageTextStep(side.bank, side.labelled, config.contrastive_weight,
                             config.ce_weight if self.phase == "joint" else 0.0,
                             config.optim.label_smoothing, config.agreement_temperature())
        round_ = configured_round(  # no network spec: one process (`ImageTextStep`)
            config, None, step,
            image_batches(config, dataset, data, side.train, config.optim.batch_size, passes,
                          seeds=[config.run.seed * 1000 + n for n in passes]),
            passes, (0, self.rounds * self.repeats), config.optim.warmup_rounds * self.repeats)
        return Opened(Trainee(model, optimizer), round_, {"data": data, "side": side})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        model, side = opened.trainee.model, opened.context["side"]
        scores = score_split(model, side, position_batches(
            opened.context["data"], self.dataset, side.validation, device), device)
        metrics = metrics | {
            "val_accuracy": scores["zero_shot_accuracy" if self.phase == "align"
                                   else "accuracy"],
            "val_zero_shot_accuracy": scores["zero_shot_accuracy"],
            "logit_scale": float(model.logit_scale.detach().exp()), "train_seconds": seconds}
        payload = {"model": model.state_dict(),
                   "optimizer": opened.trainee.optimizer.state_dict(),
                   "phase": self.phase, "round": self.round,
                   "metrics": {k: v for k, v in metrics.items() if k != "train_seconds"}}
        return Closed(metrics, payload)

    def relpath(self) -> str:
        start = "" if self.start is None else f"from-{self.start.md5[:12]}/"
        return (f"checkpoints/image_text/{run_key(self.config, self.dataset)}/{start}"
                f"{self.phase}-{self.round + 1:03d}.pt")


class AsClassifier(BaseModel):
    """The image-text network as a plain classifier of its image network (`as_classifier`):
    its checkpoint and validation accuracy."""

    model_config = ConfigDict(frozen=True)

    checkpoint: ArtifactRef
    val_accuracy: float


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="as-classifier")
def as_classifier(config: ImageTextConfig, dataset: DatasetRef, described: Descriptions,
                  checkpoint: ArtifactRef) -> AsClassifier:
    """The trained image-text network as its image network alone (`config.network.model`,
    the weights a classifier flow trains): the backbone as trained, and for the classifier
    `fc` the text-initialized head through the projection, `head(proj(x)) / s`. The
    image-text classifier normalizes `proj(x)` before its head; dividing by one positive
    number per image does not change the top class, so the plain network predicts what the
    image-text classifier predicts; `s`, the mean norm of `proj(x)` over the validation
    images, keeps its logits at the same scale on average. Written as a `model` checkpoint
    (the pipeline's next step starts from it), with its validation accuracy."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    model = new_network(config, dataset, described)
    model.load_state_dict(load_checkpoint(store, checkpoint)["model"])
    model.eval()
    plain = build_model(config.network.model, dataset.channels, len(dataset.classes),
                        config.network.width)
    plain.load_state_dict(dict(model.backbone.state_dict())
                          | {"fc.weight": plain.fc.weight, "fc.bias": plain.fc.bias})
    validation = chosen_validation(config, dataset, data)
    with torch.no_grad():
        norms = [model.image_proj(model.backbone(x.cpu())).norm(dim=1) for _, x, _ in
                 position_batches(data, dataset, validation, torch.device("cpu"))]
        scale = torch.cat(norms).mean().clamp_min(1e-6)
        head, proj = model.head.weight, model.image_proj
        plain.fc.weight.copy_(head @ proj.weight / scale)
        plain.fc.bias.copy_(head @ proj.bias / scale)
    plain = place_model(plain, device)
    accuracy = evaluate(plain, position_batches(data, dataset, validation, device),
                        device)["accuracy"]
    relpath = (f"checkpoints/image_text/{run_key(config, dataset)}/"
               f"as-classifier-{checkpoint.md5[:12]}.pt")
    saved = save_checkpoint(store, relpath, {"model": {k: v.cpu() for k, v in
                                                       plain.state_dict().items()}})
    return AsClassifier(checkpoint=saved, val_accuracy=accuracy)


class MixedHead(BaseModel):
    """The checkpoint with the mixed classifier, the alpha chosen and every alpha's validation
    accuracy (`mix_heads`)."""

    model_config = ConfigDict(frozen=True)

    checkpoint: ArtifactRef
    alpha: float
    val_accuracy: float
    accuracies: dict[str, float]  # alpha (as text) -> validation accuracy


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="mix-heads")
def mix_heads(config: ImageTextConfig, dataset: DatasetRef, described: Descriptions,
              checkpoint: ArtifactRef) -> MixedHead:
    """WiSE-FT on the classifier: its weights become `alpha * trained + (1 - alpha) *
    zero-shot`, the zero-shot head being the class descriptions' text features in the shared
    space times the similarity scale (`TextSide.class_weights`, as zero-shot scoring and the
    served model build it), alpha chosen on the validation images the choices read
    (`choose_mixing`). Writes the network with the mixed head as a checkpoint of its own: the
    one tested and registered."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    side = text_side(config, dataset, data, described)
    payload = load_checkpoint(store, checkpoint)
    model = new_network(config, dataset, described)
    model.load_state_dict(payload["model"])
    model = place_model(model, device).eval()
    alpha, accuracies = mix_head(model, side, position_batches(data, dataset, side.validation,
                                                               device), device)
    payload = payload | {"model": {k: v.cpu() for k, v in model.state_dict().items()},
                         "head_mixing": alpha}
    relpath = f"checkpoints/image_text/{run_key(config, dataset)}/mixed-head.pt"
    return MixedHead(checkpoint=save_checkpoint(store, relpath, payload), alpha=alpha,
                     val_accuracy=accuracies[alpha],
                     accuracies={f"{a:g}": v for a, v in accuracies.items()})
