"""The staged-distillation core, pure PyTorch: which images a stage draws, its round and
scores, the teacher's features for them, the bank before stage 1, the student network, the
passes of a stage and the order of the stages.

The `distill` flow's tasks call these with their `RoleConfig`, `StudentConfig`, `BankConfig`
and `DatasetRef`, read only through the protocols of `training.settings`; the benchmarks run
the flow itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from training.batches import (
    Batches,
    Normalize,
    RecordedViews,
    draw_views,
    eval_batches,
    unmoved_views,
)
from training.datasets import LoadedDataset
from training.device import autocast, inference_batch, place_model
from training.distill.data_queue import RecencyQueue
from training.distill.feature_bank import DTYPES, FeatureBank
from training.distill.losses import FeatureAdapter, layer_shape
from training.features import FeatureHooks
from training.loops import evaluate
from training.rounds import NetworkSpec, Round, StepSpec, configured_round, image_batches, new_model
from training.settings import (
    BankSettings,
    ClassifierSettings,
    DatasetShape,
    RoleSettings,
    RunsSettings,
    StudentSettings,
)

Role = Literal["teacher", "student"]


def draw_stage_ids(train_ids: Tensor, stage: int, role: Role, seed: int, fraction: float,
                   front_weight: float, back_weight: float,
                   queue: Literal["recency", "uniform"] = "recency") -> Tensor:
    """The dataset ids a role draws at `stage` (1-based): its queue replayed from the seed.

    The teacher and the student have their own queue and generator, so one's draws never shift
    the other's.
    """
    count = min(max(round(fraction * len(train_ids)), 1), len(train_ids) - 1)
    recency = RecencyQueue(train_ids, front_weight, back_weight) if queue == "recency" \
        else RecencyQueue.uniform(train_ids)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + (1 if role == "teacher"
                                                                   else 2))
    drawn = train_ids[:0]
    for _ in range(stage):
        drawn = recency.draw(count, generator)
    return drawn


@torch.no_grad()
def layer_features(model: nn.Module, layer: str, batches: Batches,
                   device: torch.device) -> Tensor:
    """Features at `layer` for every batch (eval mode, no augmentation), float32 on the CPU."""
    model.eval()
    out = []
    with FeatureHooks(model, [layer], detach=True) as hooks:
        for _, x, _ in batches:
            with autocast(device):
                model(x)
            out.append(hooks[layer].float().cpu())
    return torch.cat(out)


def stage_passes(stage: int, stages: int, repeats: int) -> tuple[range, tuple[int, int]]:
    """The global pass numbers of stage `stage` (1-based) and the schedule spanning all stages."""
    return range((stage - 1) * repeats, stage * repeats), (0, stages * repeats)


Waiter = Callable[[], Any]


def run_stages(stages: int, single_bank: bool, teacher_stage: Callable[[int, Any], Waiter],
               bank_snapshot: Callable[[int, Any, Any], Any],
               student_stage: Callable[[int, Any, Any], Waiter],
               on_stage: Callable[[Any, Any, Any], None]) -> None:
    """The order of the method's S stages, so that the teacher's stage s+1 runs beside the
    student's stage s: `teacher_stage(s, previous teacher)` and `student_stage(s, previous
    student, bank)` start a stage and return a waiter for its result (trained elsewhere, in
    parallel where the runner allows); `bank_snapshot(s, teacher s, previous bank)` returns
    bank s. `on_stage(teacher, bank, student)` records each stage once its student is done.
    The previous teacher of stage 1 is `teacher_stage`'s to choose (a warm start); results are
    opaque here (the caller's checkpoints).

    With a `single_bank` (one bank file rewritten each stage) snapshot s+1 waits for the
    student's stage s to finish reading snapshot s; with one file per state it does not."""
    running: tuple[Any, Any, Waiter] | None = None
    bank = student = None

    def finish(stage_parts: tuple[Any, Any, Waiter]) -> Any:
        teacher_done, bank_done, wait = stage_parts
        student_done = wait()
        on_stage(teacher_done, bank_done, student_done)
        return student_done

    waiting_teacher = teacher_stage(1, None)
    for stage in range(1, stages + 1):
        teacher = waiting_teacher()
        if single_bank and running:  # snapshot s+1 rewrites the bank s reads
            student, running = finish(running), None
        bank = bank_snapshot(stage, teacher, bank)
        if stage < stages:  # the teacher's next stage runs beside this student stage
            waiting_teacher = teacher_stage(stage + 1, teacher)
        if running:
            student = finish(running)
        running = (teacher, bank, student_stage(stage, student, bank))
    finish(running)


def stage_ids(role: RoleSettings, train_ids: Tensor, stage: int) -> Tensor:
    """The dataset ids `role` draws at `stage` (1-based): `draw_stage_ids` with its settings."""
    return draw_stage_ids(train_ids, stage, role.role, role.run.seed, role.fraction,
                          role.front_weight, role.back_weight, role.queue)


def stage_round(role: RoleSettings, dataset: DatasetShape, data: LoadedDataset, ids: Tensor,
                stage: int, step: StepSpec, network: NetworkSpec,
                views: RecordedViews | None = None) -> Round:
    """Stage `stage` (1-based) of `role`: `role.repeats` passes over one stream of shuffled,
    augmented batches of the stage's images (`views`: recorded views in place of their
    images' draws), on the cosine schedule spanning all stages
    (`training.distill.stages.stage_passes`)."""
    passes, schedule = stage_passes(stage, role.rounds, role.repeats)
    return configured_round(
        role, network, step, image_batches(role, dataset, data, ids, role.optim.batch_size, passes,
                                           stream_seed=role.run.seed * 1000 + stage,
                                           views=views),
        passes, schedule, role.optim.warmup_rounds * role.repeats,
        progress=f"{role.role} stage {stage}/{role.rounds}" if role.run.progress else None)


def student_mixup_seed(student: RunsSettings, stage: int) -> int:
    """The seed of the student's batch mixes at `stage` (`training.distill.losses.Mixup`)."""
    return student.run.seed * 1000 + stage


def stage_scores(round_: Round, model: nn.Module, dataset: DatasetShape, data: LoadedDataset,
                 device: torch.device) -> dict[str, float]:
    """A stage's validation score and how many images it trained on."""
    scored = evaluate(model, eval_batches(data, dataset, "val", device), device)
    batches = round_.batches
    images = len(round_.passes) * (len(batches.positions) // batches.batch_size) \
        * batches.batch_size
    return {"val_accuracy": scored["accuracy"], "val_loss": scored["loss"],
            "images": float(images)}


def teacher_features(model: nn.Module, layer: str, dataset: DatasetShape, data: LoadedDataset,
                     ids: Tensor, device: torch.device, views: RecordedViews | None = None,
                     augment: float = 0.0) -> Tensor:
    """Features at `layer` of `ids`' images (eval mode, on the CPU): unaugmented, or each
    image in its recorded view (drawn at strength `augment`)."""
    return layer_features(model, layer, Batches(
        data.images, data.labels, ids, inference_batch(device),
        Normalize(dataset.mean, dataset.std), device=device, augment=augment, views=views),
        device)


def stage_views(teacher: ClassifierSettings, dataset: DatasetShape, ids: Tensor, stage: int
                ) -> tuple[Tensor, Tensor]:
    """The augmented views (flips, moves) a consistent bank records for `ids` at `stage`: the
    teacher's augmentation, drawn from the seed and stage (a rerun records the same)."""
    generator = torch.Generator().manual_seed(teacher.run.seed * 1_000_033 + stage)
    return draw_views(len(ids), teacher.optim.augment, dataset.image_size, generator,
                      teacher.optim.flips())


def initial_bank(teacher: ClassifierSettings, bank: BankSettings, dataset: DatasetShape,
                 data: LoadedDataset, model: nn.Module, initial_state: dict[str, Tensor],
                 device: torch.device) -> FeatureBank:
    """The bank before stage 1: every entry masked, or filled by the initial teacher (state 0).

    `model` is the teacher network; it is left holding `initial_state` (the seeded weights).
    """
    train_ids = data.splits["train"]
    model.load_state_dict(initial_state)
    example = data.images[train_ids[:1]].float()
    shape = layer_shape(model, bank.layer, example.to(device))
    views = None  # state 0's entries: the image as it is
    if bank.views == "augmented":
        views = unmoved_views(len(train_ids), teacher.optim.augment, dataset.image_size)
    features = FeatureBank(train_ids, shape, DTYPES[bank.dtype],
                           0 if views is None else views[1].shape[1])
    if bank.initial == "teacher":
        features.update(train_ids, teacher_features(model, bank.layer, dataset, data, train_ids,
                                                    device), 0, bank.average == "mean", views)
    return features


def student_network(student: StudentSettings, dataset: DatasetShape,
                    feature_shape: tuple[int, ...] | None, device: torch.device
                    ) -> tuple[nn.Module, FeatureAdapter]:
    """The seeded student and its adapter to the targets' feature shape (None: no targets,
    an identity adapter)."""
    model = new_model(student, dataset)
    example = torch.zeros(1, dataset.channels, dataset.image_size, dataset.image_size)
    own = layer_shape(model, student.layer, example)
    adapter = FeatureAdapter(own, own if feature_shape is None else feature_shape)
    return place_model(model, device), adapter.to(device)
