"""Test accuracy of the `train` flow for the teacher and the student models, over seeds.

Runs the real flow (data preparation, rounds, test, registration) once per model and seed on
Fashion-MNIST and reports mean and standard deviation of the accuracy, with every seed, on the
official test images (some defaults were chosen on them earlier) and on 10,000 unread images
no choice ever read (`bench.report_set`).

    python -m bench.train_accuracy              # quick profile, 3 seeds: ~12 minutes on 2 cores
    python -m bench.train_accuracy --full       # full profile (GPU-sized)
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, print_json, print_table
from bench.report_set import ReportSet
from flows.train import train
from tasks.configs.train import TrainConfig
from training.device import resolve_device

ROLES = {"teacher": "resnet18", "student": "lenet"}  # the distill flow's defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full profile (GPU-sized)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    profile = "full" if args.full else "quick"
    results = []
    report = ReportSet(TrainConfig(profile=profile, progress=False).dataset)
    for role, model in ROLES.items():
        accuracies, reported, seconds = [], [], []
        for seed in args.seeds:
            started = time.perf_counter()
            summary = train(TrainConfig(profile=profile, model=model, seed=seed, progress=False,
                                        model_name=f"bench-{role}"))
            seconds.append(time.perf_counter() - started)
            accuracies.append(summary.test_accuracy)
            reported.append(report.served_accuracy(summary.registration.model_uri))
        mean, std = mean_std(accuracies)
        report_mean, report_std = mean_std(reported)
        results.append({"role": role, "model": model, "profile": profile, "seeds": args.seeds,
                        "test_accuracy": accuracies, "mean": mean, "std": std,
                        "report_accuracy": reported, "report_mean": report_mean,
                        "report_std": report_std, "seconds_per_run": mean_std(seconds)[0]})
    print_table(["role", "model", "profile", "unread accuracy (mean ± std)",
                 "test accuracy (mean ± std)", "per seed (test)", "s / run"],
                [[r["role"], r["model"], r["profile"],
                  f"{r['report_mean']:.4f} ± {r['report_std']:.4f}",
                  f"{r['mean']:.4f} ± {r['std']:.4f}",
                  " ".join(f"{a:.4f}" for a in r["test_accuracy"]), f"{r['seconds_per_run']:.0f}"]
                 for r in results])
    print_json({"benchmark": "train_accuracy", "device": str(resolve_device("auto")),
                "seeds": args.seeds, "report_images": len(report), "results": results})


if __name__ == "__main__":
    main()
