"""The `image_text` step: the descriptions, the budget, the alignment rounds and the joint
rounds with early stopping (`train_image_text`), which the `image_text` flow and the
`pipeline` both run."""

from __future__ import annotations

from flows.skeleton import Prepared, log_budget, run_rounds
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.image_text import ImageTextConfig
from tasks.image_text.tasks import Descriptions, ImageTextRound, describe_images
from tasks.rounds import RoundResult
from training.budget import Budget, fit_optim

# What the `image_text` flow, the `pipeline` and the benchmarks may import
# (tests/test_layering.py): the rounds from given weights (`train_image_text`).
__all__ = ["train_image_text"]


def train_image_text(config: ImageTextConfig, prepared: Prepared, run_id: str,
                     start: ArtifactRef | None = None
                     ) -> tuple[ImageTextConfig, Descriptions, Budget, ArtifactRef | None,
                                RoundResult]:
    """The descriptions (logged on `run_id`), the budget, the alignment rounds and the joint
    rounds with early stopping, the image side starting from `start`'s weights when given (a
    classifier of the same network); the config with the budget's batch size, the
    descriptions, the budget, the aligned checkpoint and the best round."""
    dataset = prepared.dataset
    described = describe_images(config, dataset)
    tracking.log_artifact_refs(run_id, {"captions": described.captions,
                                        "class_descriptions": described.classes,
                                        "text_features": described.texts})
    tracking.log_metrics(run_id, {"described_images": described.described_images,
                                  "texts_per_image": described.texts_per_image,
                                  "train_images": described.train_images,
                                  "labelled_images": described.labelled_images,
                                  "val_images": described.val_images}
                         | described.matching)
    if described.pool is not None:
        tracking.log_artifact_refs(run_id, {"pool": described.pool})
    captioned = described.captioned
    if captioned is not None:
        tracking.log_artifact_refs(run_id, {"generated_captions": captioned.captions,
                                            "captioner": captioned.captioner})
        tracking.log_metrics(run_id, {"generated_descriptions": captioned.generated,
                                      "captioner_bleu": captioned.bleu,
                                      "captioner_constant_bleu": captioned.constant_bleu})
    rounds = config.align_rounds + config.rounds
    budget = fit_optim(config.optim, described.train_images, rounds)
    log_budget(run_id, budget)
    config = config.replace(batch_size=budget.batch_size)

    def plan(phase: str, index: int) -> ImageTextRound:
        return ImageTextRound(config=config, dataset=dataset, described=described,
                              phase=phase, round=index, rounds=rounds,
                              repeats=budget.repeats, start=start)

    aligned = None
    if config.align_rounds:  # the alignment phase's last round is where `joint` starts
        aligned = run_rounds(config.align_rounds,
                             lambda index, _previous: plan("align", index), run_id, None,
                             described.val_images, round_name="align",
                             metrics_prefix="align_", keep_last=True).checkpoint

    best = run_rounds(config.rounds,
                      lambda index, _previous: plan("joint", config.align_rounds + index),
                      run_id, config.patience, described.val_images, previous=aligned)
    return config, described, budget, aligned, best
