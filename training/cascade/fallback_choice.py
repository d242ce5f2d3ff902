"""Choosing a fallback cascade's routing and threshold (the `pipeline`'s last step), in pure
PyTorch: given the student's and the teacher's logits on the validation and test splits, time
both networks at batch 1 (interleaved: the latency table), choose the routing on validation
(`training.cascade.routing`: a predictor fitted on one half competes with the exit rule on the
other, kept only where it is cheaper at the goal; the exit rule, when it stays, calibrated on
the whole split, `training.cascade.fallback`; no predictor where the student alone stands),
then measure the real cascade of each routing on
the test split: accuracy, the share the student answers, milliseconds per image at batch 1
beside each network's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from training.cascade.fallback import (
    calibrate_fallback,
    cascade_evidence,
    fallback_infer,
    fallback_table,
)
from training.cascade.learning import split_disjoint
from training.cascade.routing import Router, choose_routing, fit_router, stands
from training.latency import interleaved_ms_per_image
from training.promotion import ALPHA


@dataclass(frozen=True)
class Scored:
    """A split's logits of the student and the teacher, and its labels."""

    student: Tensor
    teacher: Tensor
    labels: Tensor


@dataclass(frozen=True)
class FallbackChoice:
    """The chosen threshold, what was measured, the kept predictor (None: the exit rule) and
    the latency table (each part's milliseconds per image at batch 1)."""

    threshold: float
    metrics: dict[str, float]
    router: Router | None
    latency: dict[str, float]


def timing_calls(small: nn.Module, large: nn.Module, router: Router | None,
                 thresholds: dict[str, float] | None = None
                 ) -> dict[str, Callable[[Tensor], object]]:
    """What is timed: each network alone and the student with the predictor (the latency
    table), or (`thresholds`) the real cascade of each routing beside the networks alone."""
    calls: dict[str, Callable[[Tensor], object]] = {"teacher": large, "student": small}
    if thresholds is None:
        if router is not None:
            calls["student_predictor"] = lambda x: router(small(x))
        return calls
    calls["fixed"] = lambda x: fallback_infer(small, large, x, thresholds["fixed"])
    if "fitted" in thresholds:
        calls["fitted"] = lambda x: fallback_infer(small, large, x, thresholds["fitted"],
                                                   router)
    return calls


def choose_fallback(small: nn.Module, large: nn.Module, val: Scored, test: Scored,
                    sample: Tensor, device: torch.device, tolerance: float,
                    predictor: str = "fitted", seed: int = 0, level: float = ALPHA
                    ) -> FallbackChoice:
    """The module docstring: `sample` is the batch the timings run on; `predictor` "fitted"
    fits and offers a predictor, "fixed" keeps the exit rule. The student stands alone where
    the cascade is at most `tolerance` more accurate on validation, and also where its
    advantage is not significant at `level` (`cascade_evidence`; 1: any advantage counts):
    on a small validation split one or two images are not a reason to ship the teacher."""
    router, choice = None, None
    # the exit rule's threshold, calibrated once: the cheapest cascade sends the fewest images
    # on whatever each network costs, so unit costs give the timed table's threshold
    unit = fallback_table(val.student, val.teacher, val.labels, 1.0, 1.0)
    fixed = calibrate_fallback(unit, tolerance)
    only_cascade, only_student, p_better = cascade_evidence(unit, fixed)
    if p_better >= level:
        fixed = 0.0
    on_its_own = fixed == 0.0  # the student alone stands: no predictor is fitted
    if predictor == "fitted" and not on_its_own:
        fit_rows, rows = split_disjoint(len(val.labels), 0.5, seed)
        router = fit_router(val.student[fit_rows], stands(
            val.student[fit_rows], val.teacher[fit_rows], val.labels[fit_rows]), seed)
        router.to(device)
    with torch.no_grad():
        alone = interleaved_ms_per_image(timing_calls(small, large, router), sample, 1)
        router_cost = None if router is None else alone["student_predictor"]

        def table(scored: Scored, routed: bool, rows=slice(None)):
            student = scored.student[rows]
            return fallback_table(
                student, scored.teacher[rows], scored.labels[rows],
                router_cost if routed else alone["student"], alone["teacher"],
                router(student.to(device)).cpu() if routed else None)

        full = table(val, False)
        thresholds = {"fixed": fixed}
        metrics: dict[str, float] = {"student_alone_stands": float(on_its_own),
                                     "val_only_cascade_right": float(only_cascade),
                                     "val_only_student_right": float(only_student),
                                     "val_cascade_p_better": p_better}
        if router is not None:
            compared = table(val, True, rows)
            choice = choose_routing(table(val, False, rows), compared, tolerance)
            thresholds["fitted"] = choice.fitted_threshold
            metrics |= {"predictors_kept": float(choice.fitted_kept),
                        "val_images_predictor": float(len(fit_rows)),
                        "val_images_compared": float(len(rows))} | {
                f"val_{name}_{key}": value for name, outcome in
                (("fixed", choice.fixed), ("fitted", choice.fitted))
                for key, value in outcome.items() if key in ("accuracy", "mean_cost")}
        kept = "fitted" if choice is not None and choice.fitted_kept else "fixed"
        timed = interleaved_ms_per_image(timing_calls(small, large, router, thresholds),
                                         sample, 1)
        val_outcome = (compared if kept == "fitted" else full).outcome(
            torch.tensor([thresholds[kept]]))
        test_table = table(test, False)
        for name, threshold in thresholds.items():
            routed = test_table if name == "fixed" else table(test, True)
            outcome = routed.outcome(torch.tensor([threshold]))
            metrics |= {f"{name}_test_accuracy": outcome["accuracy"],
                        f"{name}_test_student_share": outcome["exit_share_0"],
                        f"{name}_ms_per_image_b1": timed[name], f"{name}_threshold": threshold}
    metrics |= {"val_accuracy": val_outcome["accuracy"],
                "val_student_share": val_outcome["exit_share_0"],
                "val_teacher_accuracy": full.full_accuracy(),
                "val_student_accuracy": full.correct[:, 0].float().mean().item(),
                "test_accuracy": metrics[f"{kept}_test_accuracy"],
                "test_student_share": metrics[f"{kept}_test_student_share"],
                "test_teacher_accuracy": test_table.full_accuracy(),
                "test_student_accuracy": test_table.correct[:, 0].float().mean().item(),
                "ms_per_image_b1": timed[kept],
                "teacher_ms_per_image_b1": timed["teacher"],
                "student_ms_per_image_b1": timed["student"],
                "speedup_over_teacher_b1": timed["teacher"] / timed[kept],
                "threshold": thresholds[kept]}
    return FallbackChoice(thresholds[kept], metrics, None if kept == "fixed" else router, alone)
