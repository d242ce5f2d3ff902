"""The `sparsify` flow on Fashion-MNIST classification: each transform against no sparsity term.

Runs the real flow (`quick` profile: 20,000 training images, `lenet`, its 8 rounds) once per
variant and seed; every variant has the same budget. Reported per variant: test accuracy, the
share of exact zeros in each regularized layer (validation images), the bytes a map takes
stored as a bitmap plus values, as a share of dense, and the network with its dead channels
removed: its parameters and its CPU time at batch 1, as shares of the original's. The last
variant is the ablation of the map-size rule: one lambda for every layer (gamma 0) against the
default gamma 0.5.

Target (issue 10): at least 80% zeros in the regularized layers at no more than 0.3 points of
accuracy lost.

    python -m bench.sparsify                       # 7 variants x 3 seeds: ~25 minutes, 2 cores
    python -m bench.sparsify --seeds 0 --variants none abs
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, print_json, print_table  # noqa: E402
from flows.sparsify import sparsify  # noqa: E402
from tasks.config import SparsifyConfig  # noqa: E402

LAMBDA = SparsifyConfig.model_fields["sparsity_lambda"].default
VARIANTS: dict[str, dict] = {
    "none": {"sparsity_lambda": 0.0},
    "abs": {"transform": "abs"},
    "power": {"transform": "power", "power": 2},
    "abs_power": {"transform": "abs_power", "abs_power": 3},  # M=2 would be `power` again
    "exp_abs": {"transform": "exp_abs", "base": 2.0},
    "exp_power": {"transform": "exp_power", "base": 2.0, "power": 2},
    "abs, gamma 0": {"transform": "abs", "lambda_gamma": 0.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sparsity-lambda", type=float, default=LAMBDA)
    args = parser.parse_args()
    results, rows = [], []
    for variant in args.variants:
        runs = []
        for seed in args.seeds:
            started = time.perf_counter()
            summary = sparsify(SparsifyConfig(**{
                "seed": seed, "progress": False, "sparsity_lambda": args.sparsity_lambda,
                "model_name": "bench-sparsify", **VARIANTS[variant]}))
            runs.append({"test_accuracy": summary.test_accuracy,
                         "zero_fraction": {k: v.zero_fraction
                                           for k, v in summary.report.layers.items()},
                         "memory_bitmap_ratio": summary.report.metrics()["memory_bitmap_ratio"],
                         "pruned": summary.pruned.metrics(),
                         "lambdas": summary.spec.lambdas,
                         "seconds": time.perf_counter() - started})
            print(f"{variant} seed {seed}: {runs[-1]}", flush=True)
        accuracy = mean_std([r["test_accuracy"] for r in runs])
        layers = list(runs[0]["zero_fraction"])
        zeros = {layer: mean_std([r["zero_fraction"][layer] for r in runs]) for layer in layers}
        memory = mean_std([r["memory_bitmap_ratio"] for r in runs])
        pruned = {key: mean_std([r["pruned"][key] for r in runs])[0]
                  for key in ("pruned_parameter_ratio", "pruned_latency_ratio_b1")}
        results.append({"variant": variant, "runs": runs, "test_accuracy": accuracy,
                        "zero_fraction": zeros, "memory_bitmap_ratio": memory,
                        "pruned": pruned})
        rows.append([variant, f"{accuracy[0]:.4f} ± {accuracy[1]:.4f}",
                     " / ".join(f"{layer} {zeros[layer][0]:.3f}" for layer in layers),
                     f"{memory[0]:.3f}", f"{pruned['pruned_parameter_ratio']:.3f}",
                     f"{pruned['pruned_latency_ratio_b1']:.3f}"])
    print_table(["variant", "test accuracy", "exact zeros (validation)", "bitmap bytes / dense",
                 "pruned parameters", "pruned time, batch 1"], rows)
    print_json({"benchmark": "sparsify", "seeds": args.seeds,
                "sparsity_lambda": args.sparsity_lambda, "results": results})


if __name__ == "__main__":
    main()
