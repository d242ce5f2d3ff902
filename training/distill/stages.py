"""The staged-distillation core, pure PyTorch: which images a stage draws, the teacher's
features for them, the passes of a stage and the order of the stages.

The `distill` flow's tasks call these; the benchmarks run the flow itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from training.batches import Batches
from training.device import autocast
from training.distill.data_queue import RecencyQueue
from training.features import FeatureHooks

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
