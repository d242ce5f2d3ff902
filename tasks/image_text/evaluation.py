"""`image_text` evaluation: score a split (the classifier, zero-shot from the class
descriptions, the unseen classes apart), test, and register the image-text pyfunc
(`serving.image_text`) gated like every flow's models."""

from __future__ import annotations

from mlflow.models import ModelSignature
from mlflow.types.schema import ParamSchema, ParamSpec
from prefect import task

from models.image_text import ImageTextNet
from serving.image_text import ZERO_SHOT_PARAM
from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint
from tasks.adapters.registration import Policy, Registration, log_weights_pyfunc, transient
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.image_text import ImageTextConfig
from tasks.data import DatasetRef, load_dataset
from tasks.image_text.tasks import Descriptions, new_network, text_side
from tasks.promotion import promote_on_test_images
from training.batches import eval_batches
from training.device import place_model, setup_device
from training.image_text.text_side import score_split

# `classes` is a parameter of the served model (`serving.image_text`): MLflow passes
# parameters only to models whose signature declares them (inputs and outputs are left free).
SIGNATURE = ModelSignature(inputs=None, outputs=None,
                           params=ParamSchema([ParamSpec(ZERO_SHOT_PARAM, "string", "")]))


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="test")
def test_image_text(config: ImageTextConfig, dataset: DatasetRef, described: Descriptions,
                    checkpoint: ArtifactRef) -> dict[str, float]:
    """The final network's `score_split` on the whole test split, every label known (the
    report, never a choice), as `test_*` metrics."""
    device = setup_device(config)
    data = load_dataset(dataset)
    side = text_side(config, dataset, data, described)
    model = trained_network(config, dataset, described, checkpoint)
    scores = score_split(place_model(model, device), side,
                         eval_batches(data, dataset, "test", device), device)
    return {f"test_{k}": v for k, v in scores.items()}


def trained_network(config: ImageTextConfig, dataset: DatasetRef, described: Descriptions,
                    checkpoint: ArtifactRef) -> ImageTextNet:
    """The network of `checkpoint`, on the CPU."""
    model = new_network(config, dataset, described)
    model.load_state_dict(load_checkpoint(ArtifactStore(), checkpoint)["model"])
    return model


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: transient(state))
def register_image_text(run_id: str, name: str, config: ImageTextConfig, dataset: DatasetRef,
                        described: Descriptions, checkpoint: ArtifactRef,
                        refusal: str | None) -> Registration:
    """Logs the network as a pyfunc (`serving.image_text`: the classifier, or zero-shot
    among descriptions given when predicting), scores it and the champion through their
    pyfuncs on the same test images, registers it, and makes it champion only if it scores
    higher and nothing refuses it (`refusal`: the raw-pixel baseline gate)."""
    meta = {"classes": dataset.classes, "image_size": dataset.image_size,
            "channels": dataset.channels, "mean": dataset.mean, "std": dataset.std,
            "network": {"model": config.network.model, "width": config.network.width,
                        "dim": config.dim,
                        "text_dim": described.text_dim, "text_encoder": config.text_encoder,
                        "buckets": config.buckets}}
    weights = trained_network(config, dataset, described, checkpoint).state_dict()
    model_uri = log_weights_pyfunc(run_id, "image_text", meta, weights,
                                   SIGNATURE)
    return promote_on_test_images(run_id, name, model_uri, dataset, checkpoint.md5,
                                  Policy.of(config.run), refusal)
