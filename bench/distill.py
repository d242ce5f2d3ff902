"""Distillation methods side by side: the student alone, Hinton KD, FitNets, the feature bank.

For each seed, the `distill` flow runs once per bank mode (the teacher's stages are computed by
the first and reused by the second: same config, same cache key; a repeated benchmark is served
from Prefect's cache, except the timed pair). The baselines then train the
same student architecture with the same stages, the same images per stage (the student's
queue), the same batches, schedule, gradient clipping and divergence check; only the loss
differs:

(a) student alone: CE;
(b) Hinton KD: CE and KL on logits softened by T from the distill run's final teacher;
(c) FitNets: CE and an L2 hint between the adapted student feature and the final teacher's
    feature at the bank's layer;
(d) the multi-state bank (the flow), in `single` and `per-state` mode.

Also reported: the bank's memory against entries x values x bytes per value, and the wall time
of the overlapped schedule (Dask, 2 workers) against the sequential one (in-process), both
measured here, one after the other, with Prefect's cache off, on a smaller run (10,000 images,
5 stages by default).

    python -m bench.distill                  # quick profile, seeds 0-2: about an hour on 2 cores
    python -m bench.distill --seeds 0 --no-timing
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from bench.common import mean_std, print_json, print_table
from flows.distill import distill
from flows.steps.distill import role_budgets
from tasks.adapters.checkpoints import load_checkpoint
from tasks.adapters.versioning import ArtifactStore
from tasks.configs.distill import DistillConfig
from tasks.data import load_dataset
from tasks.distill import (
    DistillPlan,
    StudentConfig,
    stage_ids,
    stage_round,
    student_network,
)
from tasks.training import (
    classifier_network,
    eval_batches,
    make_optimizer,
    new_model,
    restore,
)
from training.device import place_model, resolve_device
from training.distill.losses import TeacherStep, layer_shape
from training.loops import NonFiniteLossError, evaluate
from training.rounds import ClassifyStep, Trainee, train

BASELINES = {
    "a: student alone": None,
    "b: Hinton KD": {"layer": "fc", "student_layer": "fc", "loss": "kl"},
    "c: FitNets hint": {"layer": None, "student_layer": None, "loss": "l2"},
}


def baseline(method: str, plan: DistillPlan, config: DistillConfig, dataset,
             teacher_checkpoint, kd_weight: float, hint_weight: float) -> float | str:
    """Trains one baseline student stage by stage (`tasks.distill.stage_round`, the flow's
    stages with another step); returns its test accuracy, or why it failed."""
    student: StudentConfig = plan.student
    device = resolve_device(config.run.device)
    data = load_dataset(dataset)
    spec = BASELINES[method]
    torch.manual_seed(student.run.seed)
    if spec is None:
        model = place_model(new_model(student, dataset), device)
        trainee = Trainee(model, make_optimizer(model, student))
        step = ClassifyStep(student.optim.label_smoothing)
    else:
        teacher = new_model(plan.teacher, dataset)
        restore(teacher, None, load_checkpoint(ArtifactStore(), teacher_checkpoint))
        layer = spec["layer"] or plan.bank.layer
        student_layer = spec["student_layer"] or student.layer
        example = data.images[:1].float()
        model, adapter = student_network(student.replace(layer=student_layer), dataset,
                                         layer_shape(teacher, layer, example), device)
        weight = kd_weight if spec["loss"] == "kl" else hint_weight
        step = TeacherStep(student_layer, (adapter.student_shape, adapter.teacher_shape),
                           spec["loss"], config.temperature,
                           ce_weight=1.0 - weight if spec["loss"] == "kl" else 1.0,
                           feature_weight=weight, label_smoothing=student.optim.label_smoothing,
                           teacher=teacher, teacher_layer=layer)
        trainee = Trainee(model, make_optimizer(torch.nn.ModuleList([model, adapter]), student),
                          {"adapter": adapter})
    network = classifier_network(student, dataset)
    try:
        for stage in range(1, config.stages + 1):
            ids = stage_ids(student, data.splits["train"], stage)
            train(stage_round(student, dataset, data, ids, stage, step, network), trainee,
                  device)
    except NonFiniteLossError as error:
        return f"diverged: {error}"
    return evaluate(model, eval_batches(data, dataset, "test", device), device)["accuracy"]


def timed_distill(config: DistillConfig, refresh: bool = False):
    """A `distill` run and its wall time; `refresh` recomputes every task (no cache)."""
    started = time.perf_counter()
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: refresh}):
        summary = distill(config)
    return summary, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=["smoke", "quick", "full"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kd-weight", type=float, default=0.5,
                        help="weight of the KD term (CE gets 1 - weight)")
    parser.add_argument("--hint-weight", type=float, default=1.0, help="FitNets hint weight")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="compare the methods over the seeds (the long part)")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the overlapped schedule against the sequential one")
    parser.add_argument("--modes", nargs="+", default=["single", "per-state"],
                        choices=["single", "per-state"], help="bank modes to run (single "
                        "always runs: its final teacher teaches the baselines)")
    parser.add_argument("--timing-train-limit", type=int, default=10000,
                        help="training images of the timed pair of runs")
    parser.add_argument("--timing-stages", type=int, default=5, help="stages of the timed pair")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="distill config overrides for every run, e.g. feature_loss=l2")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    accuracy: dict[str, list] = {}
    teachers, banks = [], []
    for seed in args.seeds if args.accuracy else []:
        config = DistillConfig(**{"profile": args.profile, "seed": seed, "progress": False,
                                  "model_name": "bench-distill", **overrides})
        single, seconds = timed_distill(config)
        teachers.append(single.teacher_test_accuracy)
        accuracy.setdefault("d: bank, single", []).append(single.test_accuracy)
        if "per-state" in args.modes:
            per_state = distill(config.replace(bank_mode="per-state"))
            accuracy.setdefault("d: bank, per-state", []).append(per_state.test_accuracy)
        budgets = role_budgets(config, single.dataset)
        plan = DistillPlan.of(config, budgets["teacher"], budgets["student"])
        dataset = single.dataset
        for method in BASELINES:
            accuracy.setdefault(method, []).append(baseline(
                method, plan, config, dataset, single.stages[-1].teacher.checkpoint,
                args.kd_weight, args.hint_weight))
        last = single.stages[-1].bank
        banks.append({"entries": last.entries, "values": last.feature_values,
                      "bytes": last.nbytes, "file_bytes": last.bank.size,
                      "seconds_single_run": seconds})
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]}" for k, v in accuracy.items()),
              flush=True)
    rows, results, bank, ideal = [], [], None, None
    if args.accuracy:
        teacher_mean, teacher_std = mean_std(teachers)
        alone = [a for a in accuracy["a: student alone"] if isinstance(a, float)]
        alone_mean = mean_std(alone)[0] if alone else float("nan")
        for method, values in accuracy.items():
            ok = [v for v in values if isinstance(v, float)]
            mean, std = mean_std(ok) if ok else (float("nan"), 0.0)
            gap = (mean - alone_mean) / (teacher_mean - alone_mean) if ok else float("nan")
            failures = [v for v in values if not isinstance(v, float)]
            rows.append([method, f"{mean:.4f} ± {std:.4f}", " / ".join(
                f"{v:.4f}" if isinstance(v, float) else "FAILED" for v in values),
                f"{gap:+.2f}", len(failures)])
            results.append({"method": method, "test_accuracy": values, "mean": mean, "std": std,
                            "gap_closed": gap, "failures": failures})
        print(f"\nteacher {config.teacher_model}: {teacher_mean:.4f} ± {teacher_std:.4f} "
              f"({' / '.join(f'{t:.4f}' for t in teachers)})")
        print_table(["method", "test accuracy (mean ± std)", "per seed", "gap closed", "failed"],
                    rows)
        bytes_per_value = torch.finfo(getattr(torch, config.bank_dtype)).bits // 8
        bank = banks[-1]
        ideal = bank["entries"] * bank["values"] * bytes_per_value
        print(f"\nbank: {bank['entries']} entries x {bank['values']} values x "
              f"{bytes_per_value} B = {ideal} B; tensors {bank['bytes']} B "
              f"({bank['bytes'] / ideal:.3f}x), file {bank['file_bytes']} B "
              f"({bank['file_bytes'] / ideal:.3f}x)")
    timing = None
    if args.timing:
        config = DistillConfig(**{"profile": args.profile, "seed": args.seeds[0],
                                  "progress": False, "model_name": "bench-distill-timing",
                                  "train_limit": args.timing_train_limit,
                                  "stages": args.timing_stages, **overrides})
        _, sequential = timed_distill(config, refresh=True)
        _, overlapped = timed_distill(config.replace(runner="dask",
                                                                dask_workers=2),
                                      refresh=True)
        timing = {"sequential_s": sequential, "overlapped_s": overlapped,
                  "speedup": sequential / overlapped}
        print(f"schedule ({config.dataset.train_limit} images, {config.stages} stages, cache off): "
              f"sequential {sequential:.0f} s, overlapped (Dask, 2 workers) {overlapped:.0f} s:"
              f" speed-up {sequential / overlapped:.2f}x ({os.cpu_count()} cores)")
    print_json({"benchmark": "distill", "profile": args.profile, "seeds": args.seeds,
                "overrides": overrides, "teacher": teachers, "results": results,
                "bank": bank and bank | {"ideal_bytes": ideal}, "timing": timing,
                "device": str(resolve_device("auto"))})


if __name__ == "__main__":
    main()
