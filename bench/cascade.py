"""The `cascade` flow against the full network, the plain confidence cascade and the oracle.

Runs the real flow (`quick` profile: Fashion-MNIST, 20,000 training images) once per seed; its
test task measures, on the same trained modules and the same test images:
(a) the full network: every module, each super-network module at its most expensive
    sub-network, no exits;
(b) early exits alone: the same sub-networks, exits calibrated alike (BranchyNet / SDN);
(c) the whole method: exits and the predictors' choice of sub-network;
(d) the oracle: each image leaves at the cheapest exit and sub-networks that get it right.
For each: test accuracy, milliseconds per image measured at batch 1 (the real cascade on 1,000
test images, passes interleaved with the full network's) and at the serving batch, and FLOPs
per image; the oracle is not a runnable model, its cost comes from the latency table (its
FLOPs from the same search with FLOPs as the cost). (c) over
a sweep of accuracy tolerances gives the accuracy-latency curve (logged to MLflow).

Targets (issue 11): (c) at least 2.5 times faster than (a) at batch 1 at no more than 0.3
points of accuracy lost, and (c)'s cost within 1.3 times the oracle's (by the table, the
measured times decisions use; in FLOPs beside it).

    python -m bench.cascade                    # 3 seeds
    python -m bench.cascade --seeds 0 --set predictor=fixed
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from flows.cascade import cascade  # noqa: E402
from tasks.cascade_config import CascadeConfig  # noqa: E402

ROWS = {  # variant: (accuracy, ms at batch 1, ms at the serving batch, FLOPs) metric names
    "(a) full network": ("full_test_accuracy", "full_ms_per_image_b1",
                         "full_ms_per_image_serving", "full_flops"),
    "(b) early exits alone": ("plain_test_accuracy", "plain_ms_per_image_b1",
                              "plain_ms_per_image_serving", "plain_flops_per_image"),
    "(c) cascade": ("test_accuracy", "ms_per_image_b1", "ms_per_image_serving",
                    "flops_per_image"),
}


def run(seed: int, overrides: dict[str, str]) -> dict:
    """One flow run: its test metrics, sweep and thresholds."""
    started = time.perf_counter()
    summary = cascade(CascadeConfig(**{"seed": seed, "progress": False,
                                       "model_name": "bench-cascade", **overrides}))
    return {"metrics": summary.test.metrics, "sweep": summary.test.sweep,
            "thresholds": summary.calibration.thresholds,
            "val": summary.calibration.metrics, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run (e.g. predictor=fixed)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    runs = []
    for seed in args.seeds:
        runs.append(run(seed, overrides))
        print(f"seed {seed}: {runs[-1]}", flush=True)

    def stat(key: str) -> tuple[float, float]:
        return mean_std([r["metrics"][key] for r in runs])

    rows, figures = [], {"benchmark": "cascade", "runs": runs, "overrides": overrides}
    full_accuracy = stat("full_test_accuracy")[0]
    for name, (accuracy, b1, serving, flops) in ROWS.items():
        acc, ms, ms_serving, flop = stat(accuracy), stat(b1), stat(serving), stat(flops)
        speedup = mean_std([r["metrics"]["full_ms_per_image_b1"] / r["metrics"][b1]
                            for r in runs])
        rows.append([name, f"{acc[0]:.4f} ± {acc[1]:.4f}", f"{acc[0] - full_accuracy:+.4f}",
                     f"{ms[0]:.3f}", f"{speedup[0]:.2f} ± {speedup[1]:.2f}",
                     f"{1000 / ms_serving[0]:.0f}", f"{flop[0] / 1e6:.2f}"])
        figures[name] = {"accuracy": acc, "ms_b1": ms, "speedup_b1": speedup,
                         "images_per_second_serving": 1000 / ms_serving[0], "flops": flop}
    oracle, ratio = stat("oracle_accuracy"), stat("oracle_table_cost_ratio")
    oracle_flops = stat("oracle_flops_per_image")
    rows.append(["(d) oracle", f"{oracle[0]:.4f} ± {oracle[1]:.4f}",
                 f"{oracle[0] - full_accuracy:+.4f}", "", f"{1 / ratio[0]:.2f} (table)", "",
                 f"{oracle_flops[0] / 1e6:.2f}"])
    figures["(d) oracle"] = {"accuracy": oracle, "cost_ratio": ratio, "flops": oracle_flops}
    print_table(["variant", "test accuracy", "vs (a)", "ms / image, batch 1",
                 "speed-up over (a), batch 1", "images / s, serving batch", "MFLOPs / image"],
                rows)
    exits = {k: stat(f"exit_share_{k}") for k in range(len(runs[0]["thresholds"]) + 1)}
    over_oracle, flops_over = stat("cost_over_oracle"), stat("flops_over_oracle")
    print("\n(c) exits taken: " + ", ".join(f"exit {k + 1} {v[0]:.3f}" for k, v in exits.items())
          + f"; cost over the oracle's {over_oracle[0]:.2f} ± {over_oracle[1]:.2f} by the table"
          f" (measured time), {flops_over[0]:.2f} ± {flops_over[1]:.2f} in FLOPs")
    print("sweep (seed mean): tolerance, test accuracy, speed-up at batch 1, by the table, "
          "cost over the oracle's")
    sweep = []
    for index, point in enumerate(runs[0]["sweep"]):
        mean = {key: mean_std([r["sweep"][index][key] for r in runs])
                for key in ("test_accuracy", "speedup_b1", "table_cost_ratio", "cost_over_oracle")}
        print(f"  {point['tolerance']:<6g} {mean['test_accuracy'][0]:.4f} "
              f"({mean['test_accuracy'][0] - full_accuracy:+.4f})  {mean['speedup_b1'][0]:.2f}x  "
              f"{1 / mean['table_cost_ratio'][0]:.2f}x  {mean['cost_over_oracle'][0]:.2f} "
              f"± {mean['cost_over_oracle'][1]:.2f}")
        sweep.append({"tolerance": point["tolerance"], **mean})
    figures |= {"exit_shares": exits, "cost_over_oracle": over_oracle,
                "flops_over_oracle": flops_over, "sweep": sweep}
    print_json(figures)


if __name__ == "__main__":
    main()
