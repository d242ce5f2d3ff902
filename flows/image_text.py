"""The `image_text` flow: an image network trained from images and their descriptions.

Prepare the data; describe every image (the user's captions table, matches in a pool of
image-text pairs, or the project's own: each class's WordNet descriptions and phrases measured
from the image), let a captioner trained on the described images describe the rest
(`caption-images`), and encode every distinct text (`describe-images`); align image and text
features with the contrastive loss alone for `--align-rounds` rounds; start the classifier
from the text features of each class's descriptions; train both sub-losses with early
stopping on validation; with `--head-mixing`, mix the classifier with the zero-shot head
(WiSE-FT, the weight chosen on validation); test the classifier and zero-shot classification
from the class descriptions; register the network as a pyfunc that classifies, or classifies
zero-shot among descriptions given when predicting, and promote it like `train`'s models.

With `--labels-per-class K`, unlabelled images get no text derived from their labels and
every choice reads at most K validation images per class (`tasks/image_text/tasks.py`).
"""

from __future__ import annotations

from prefect import flow

from flows.skeleton import BestRound, begun_run, conclude, publish
from flows.steps.image_text import train_image_text
from tasks.adapters import tracking
from tasks.adapters.registration import Registration
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.image_text import ImageTextConfig
from tasks.image_text.evaluation import register_image_text, test_image_text
from tasks.image_text.tasks import Descriptions, mix_heads
from tasks.training import TestResult

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary. Its step, which the `pipeline` composes too (the rounds from given weights), is
# `flows.steps.image_text`'s.
__all__ = ["FLOW_NAME", "ImageTextSummary", "image_text"]

FLOW_NAME = "image_text"


class ImageTextSummary(BestRound):
    """What an `image_text` run gives back."""

    run_id: str
    descriptions: Descriptions
    aligned: ArtifactRef | None  # the checkpoint the classifier started from
    val_accuracy: float  # of the model kept (the mixed head's with head mixing)
    val_images: int  # the validation images the choices read
    head_mixing_alpha: float | None  # the weight of the trained head (None: not mixed)
    test_metrics: dict[str, float]
    baselines: dict[str, float]
    registration: Registration

    @property
    def test_accuracy(self) -> float:
        return self.test_metrics["test_accuracy"]


@flow(name=FLOW_NAME, description="Train an image network from images and their "
      "descriptions (contrastive + cross-entropy, a text-initialized classifier), test it, "
      "register it and promote it if it beats the champion and the raw-pixel baselines.")
def image_text(config: ImageTextConfig) -> ImageTextSummary:
    """Trains `config.network.model` with descriptions on `config.dataset.data`; registers it as
    `config.run.model_name`."""
    run_name = f"{FLOW_NAME}-{config.network.model}-{config.text_encoder}-seed{config.run.seed}"
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        dataset = prepared.dataset
        config, described, budget, aligned, best = train_image_text(config, prepared, run_id)
        captioned = described.captioned
        final, val_accuracy, alpha = best.checkpoint, best.metrics["val_accuracy"], None
        if config.head_mixing:
            mixed = mix_heads(config, dataset, described, best.checkpoint)
            tracking.log_metrics(run_id, {"head_mixing_alpha": mixed.alpha} | {
                f"head_mixing_val_accuracy_{a}": v for a, v in mixed.accuracies.items()})
            final, val_accuracy, alpha = mixed.checkpoint, mixed.val_accuracy, mixed.alpha
        metrics = test_image_text(config, dataset, described, final)
        tracking.log_metrics(run_id, metrics | {"val_accuracy": val_accuracy})
        tracking.log_artifact_refs(run_id, {"checkpoint.final": final})
        finished = conclude(run_id, config.run, prepared, val_accuracy,
                            TestResult(metrics=metrics, program=final),
                            lambda refusal: register_image_text(run_id, name, config, dataset,
                                                                described, final, refusal))
        summary = ImageTextSummary(run_id=run_id, descriptions=described, aligned=aligned,
                                   best_round=best.round + 1, val_accuracy=val_accuracy,
                                   val_images=described.val_images, head_mixing_alpha=alpha,
                                   test_metrics=metrics, baselines=prepared.baselines,
                                   registration=finished.registration)
    rows = {
        "zero-shot from the class descriptions": f"test {metrics['test_zero_shot_accuracy']:.4f}",
        "descriptions": f"{described.described_images} images, "
                        f"{described.texts_per_image:.1f} texts each ({config.text_encoder})",
        "best round (validation)": f"{summary.best_round} ({best.metrics['val_accuracy']:.4f} "
                                   f"on {described.val_images} images)",
        "budget": f"{config.align_rounds} alignment + {config.rounds} rounds x "
                  f"{budget.repeats} passes, batch {budget.batch_size}",
    }
    if alpha is not None:
        rows["head mixing (validation)"] = (f"alpha {alpha:g} x trained + {1 - alpha:g} x "
                                            f"zero-shot ({val_accuracy:.4f})")
    if config.labels_per_class is not None:
        rows["labels"] = (f"{described.labelled_images} training images, "
                          f"{described.val_images} validation images (at most "
                          f"{config.labels_per_class} per class)")
    if described.matching:
        rows["matched against the pool"] = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in described.matching.items())
    if captioned is not None:
        rows["captioner"] = (f"described {captioned.generated} images; BLEU "
                             f"{captioned.bleu:.1f} on {captioned.held_out} held-out images "
                             f"(the most frequent description: {captioned.constant_bleu:.1f})")
    if "test_unseen_zero_shot_accuracy" in metrics:
        rows["unseen classes, zero-shot"] = (
            f"{metrics['test_unseen_zero_shot_accuracy']:.4f} on their test images "
            f"({', '.join(config.unseen_classes)})")
    publish("image-text-summary",
            f"image_text: {config.network.model} on {config.dataset.data}", run_id, finished,
            rows)
    return summary
