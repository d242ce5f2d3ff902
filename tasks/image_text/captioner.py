"""Descriptions by a trained captioner (`training.image_text.captioner`): the `image_text` flow's
third source, for training images that neither the captions table nor the pool describes, and, in a
few-label run of the project's own texts, for the unlabelled images (which carry only their measured
phrases: their class's descriptions would hand them their label).

The captioner trains on the described training images, less a held-out tenth on which its
captions are scored by BLEU (sacrebleu, every description of an image a reference) beside a
constant caption (the most frequent description), then writes one description for each
undescribed training image. The written table and the captioner are versioned artifacts.
"""

from __future__ import annotations

import pandas as pd
import torch
from prefect import task
from pydantic import BaseModel, ConfigDict

from models.image_text import image_backbone
from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import torch_save
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.image_text import ImageTextConfig, seen_positions
from tasks.data import DatasetRef, load_dataset
from tasks.training import run_key
from training.batches import Normalize
from training.device import place_model, setup_device
from training.image_text.captioner import (
    Captioner,
    Vocabulary,
    bleu,
    described_positions,
    fit_captions,
    undescribed,
    write_captions,
)

HELD_OUT = 0.1  # the share of described images the captioner is scored on


class Captioned(BaseModel):
    """What the captioner wrote and how well it describes held-out images."""

    model_config = ConfigDict(frozen=True)

    captions: ArtifactRef  # Parquet: position, text, weight, kind `generated`
    captioner: ArtifactRef  # its weights and vocabulary
    generated: int  # images it described
    held_out: int  # described images it was scored on
    bleu: float  # corpus BLEU (0-100) of its captions on them
    constant_bleu: float  # ... of the most frequent description for every one of them


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="caption-images")
def caption_images(config: ImageTextConfig, dataset: DatasetRef,
                   captions: ArtifactRef) -> Captioned:
    """Trains the captioner on the described training images (`captions`: position, text,
    weight, kind; every row of an image `described_positions` names), scores it on a
    held-out tenth, and describes every undescribed training image (weight
    `config.generated_weight`). In a few-label run of the project's own texts the described
    images are the labelled ones: the captioner learns from their texts and reads only the
    pixels of the images it describes."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    table = pd.read_parquet(store.fetch(captions))
    train = seen_positions(config, dataset.classes, data.labels, data.splits["train"])
    table = table[table["position"].isin(set(train.tolist()))]
    described = described_positions(table)
    if len(described) < 2:
        raise ValueError(f"the captioner needs at least 2 described training images, got "
                         f"{len(described)}: set --no-caption-missing or give descriptions")
    table = table[table["position"].isin(set(described.tolist()))]
    generator = torch.Generator().manual_seed(config.run.seed + 31)
    order = described[torch.randperm(len(described), generator=generator)]
    held = order[:max(1, round(HELD_OUT * len(order)))]
    fit = table[~table["position"].isin(set(held.tolist()))]
    vocabulary = Vocabulary(fit["text"].tolist())
    torch.manual_seed(config.run.seed)
    encoder, features = image_backbone(config.network.model, dataset.channels, len(dataset.classes),
                                       config.network.width)
    model = place_model(Captioner(encoder, features, len(vocabulary)), device)
    normalize = Normalize(dataset.mean, dataset.std)
    fit_captions(model, data.images, fit["position"].tolist(), fit["text"].tolist(),
                 fit["weight"].tolist(), vocabulary, normalize, config.caption_steps,
                 config.run.seed, device)
    references = table.groupby("position")["text"].apply(list)
    held_texts = write_captions(model, data.images, held, vocabulary, normalize, device)
    held_refs = [references[p] for p in held.tolist()]
    constant = fit.groupby("text")["weight"].sum().idxmax()
    missing = undescribed(train, table)
    written = write_captions(model, data.images, missing, vocabulary, normalize, device)
    generated = pd.DataFrame({"position": missing.tolist(), "text": written,
                              "weight": config.generated_weight, "kind": "generated"})
    generated = generated[generated["text"] != ""]  # a caption of no words describes nothing
    key = run_key(config, dataset)
    generated_ref = store.write(f"image_text/{key}/generated.parquet",
                                lambda path: generated.to_parquet(path, index=False))
    model_ref = store.write(f"image_text/{key}/captioner.pt", lambda path: torch_save(
        {"model": model.state_dict(), "vocabulary": vocabulary.itos}, path))
    return Captioned(captions=generated_ref, captioner=model_ref, generated=len(generated),
                     held_out=len(held), bleu=bleu(held_texts, held_refs),
                     constant_bleu=bleu([constant] * len(held), held_refs))
