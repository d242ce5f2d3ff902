"""The `sparsify` flow's area rule against one lambda for every layer, at the same zeros.

The rule (`--lambda-gamma 0.5` at `--sparsity-lambda 0.3`, classification's default before
this ablation) weighs each regularized map by `(A_max / A)^gamma`, so `lenet`'s smaller
`block2` gets twice `block1`'s lambda. Its simpler version is one lambda for both (gamma 0).
A larger uniform lambda always buys more zeros, so the two are compared where they zero as
many values: the uniform lambda is chosen, on the choice seed (the first) of each data set, as
the one whose share of exact zeros over all the maps on the **validation** images is nearest
the rule's (a secant search in log lambda, `--search-runs` runs). Both then train on every
seed with the same budget (the flow's other defaults, `quick` profile, default width), and are
reported on images no choice read (`bench.two_sets`): Fashion-MNIST's official test images and
unread report images; the 2500x16 ImageFolder's test split and unread holdout.

Zeros are reported on the test images; validation's chose the lambda. A difference in accuracy
is the rule's gain at equal zeros; the classification default keeps the rule only where it wins
(it did not: one lambda, 0.42, is the default now).

    python -m bench.area_rule                      # both data sets, seeds 0-2: ~17 minutes
    python -m bench.area_rule --sets 2500x16 --seeds 0 --search-runs 1 --set profile=smoke
"""

from __future__ import annotations

import argparse
import math
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.two_sets import SETS, DataSet  # noqa: E402
from flows.sparsify import sparsify  # noqa: E402
from tasks.configs.sparsify import SparsifyConfig  # noqa: E402

RULE = {"lambda_gamma": 0.5, "sparsity_lambda": 0.3}  # the flow's default until this ablation
FIRST_GUESS = 1.4  # the uniform lambda's first try, as a multiple of the rule's base lambda


def run(data: DataSet, seed: int, variant: dict, overrides: dict) -> dict:
    """One `sparsify` run: validation and test accuracy and zeros, unread accuracy."""
    started = time.perf_counter()
    summary = sparsify(SparsifyConfig(**{
        "task": "classification", "progress": False, "model_name": "bench-area-rule",
        **overrides, **data.config(seed), **variant}))
    return {"val_accuracy": summary.val_accuracy, "test_accuracy": summary.test_accuracy,
            "unread_accuracy": data.score(summary.registration.model_uri),
            "val_zeros": summary.report.all_maps_zero_fraction(),
            "test_zeros": summary.test_report.all_maps_zero_fraction(),
            "test_zero_fraction": {k: v.zero_fraction
                                   for k, v in summary.test_report.layers.items()},
            "lambdas": summary.spec.lambdas, "seconds": time.perf_counter() - started}


def next_lambda(tried: list[tuple[float, float]], target: float) -> float:
    """The next uniform lambda to try for `target` validation zeros: the secant in log lambda
    through the two tries nearest the target, or a step of 1.5x from a single try."""
    if len(tried) == 1:
        lam, zeros = tried[0]
        return lam * (1.5 if zeros < target else 1 / 1.5)
    (l1, z1), (l2, z2) = sorted(tried, key=lambda pair: abs(pair[1] - target))[:2]
    if abs(z2 - z1) < 1e-6:
        return l1 * (1.5 if z1 < target else 1 / 1.5)
    step = (target - z1) * (math.log(l2) - math.log(l1)) / (z2 - z1)
    return l1 * math.exp(max(-1.0, min(1.0, step)))  # at most e x per step


def matched_lambda(data: DataSet, seed: int, target: float, base: float, runs: int,
                   overrides: dict) -> tuple[float, list[dict]]:
    """The uniform lambda whose validation zeros on `seed` come nearest `target`, and every
    search run (their figures, lambda first)."""
    tried, searched = [], []
    lam = base * FIRST_GUESS
    for _ in range(runs):
        figures = run(data, seed, {"lambda_gamma": 0.0, "sparsity_lambda": lam}, overrides)
        searched.append({"sparsity_lambda": lam, **figures})
        tried.append((lam, figures["val_zeros"]))
        print(f"{data.name} uniform lambda {lam:.4f} seed {seed}: validation zeros "
              f"{figures['val_zeros']:.4f} (target {target:.4f})", flush=True)
        lam = next_lambda(tried, target)
    best = min(searched, key=lambda r: abs(r["val_zeros"] - target))
    return best["sparsity_lambda"], searched


def summary_of(runs: list[dict]) -> dict:
    """Each figure's mean and standard deviation over the seeds."""
    return {key: mean_std([r[key] for r in runs])
            for key in ("val_accuracy", "test_accuracy", "unread_accuracy", "val_zeros",
                        "test_zeros")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--search-runs", type=int, default=3,
                        help="runs of the uniform lambda's search on the first seed")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run (e.g. profile=smoke)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    base = RULE["sparsity_lambda"]
    results, rows = [], []
    for name in args.sets:
        data = DataSet(name, SparsifyConfig(**{"progress": False, **overrides}).dataset,
                       overrides.get("profile") == "smoke")
        rule = []
        for seed in args.seeds:
            rule.append(run(data, seed, RULE, overrides))
            print(f"{name} area rule seed {seed}: {rule[-1]}", flush=True)
        lam, searched = matched_lambda(data, args.seeds[0], rule[0]["val_zeros"], base,
                                       args.search_runs, overrides)
        uniform = [next(r for r in searched if r["sparsity_lambda"] == lam)]
        for seed in args.seeds[1:]:
            uniform.append(run(data, seed, {"lambda_gamma": 0.0, "sparsity_lambda": lam},
                               overrides))
            print(f"{name} uniform seed {seed}: {uniform[-1]}", flush=True)
        entry = {"set": name, "uniform_lambda": lam, "search": searched,
                 "rule": {"runs": rule, **summary_of(rule)},
                 "uniform": {"runs": uniform, **summary_of(uniform)}}
        results.append(entry)
        for label, key in ((f"area rule (gamma 0.5, lambda {base:g})", "rule"),
                           (f"uniform (gamma 0, lambda {lam:.3f})", "uniform")):
            figures = entry[key]
            rows.append([name, label, *(f"{figures[k][0]:.4f} ± {figures[k][1]:.4f}"
                                        for k in ("unread_accuracy", "test_accuracy",
                                                  "val_accuracy")),
                         f"{figures['test_zeros'][0]:.3f}", f"{figures['val_zeros'][0]:.3f}"])
    print_table(["set", "variant", "unread accuracy", "test accuracy", "validation accuracy",
                 "zeros, all maps (test)", "zeros (validation)"], rows)
    print_json({"benchmark": "area_rule", "seeds": args.seeds, "overrides": overrides,
                "search_runs": args.search_runs, "results": results})


if __name__ == "__main__":
    main()
