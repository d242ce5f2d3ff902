"""The `cascade` flow against the full network, the plain confidence cascade and the oracle.

Runs the real flow (`quick` profile: Fashion-MNIST, 20,000 training images) once per seed; its
test task measures, on the same trained modules and the same test images:
(a) the full network: every module, each super-network module at its most expensive
    sub-network, no exits;
(b) early exits alone: the same sub-networks, exits calibrated alike (BranchyNet / SDN);
(c1) exits with fixed sub-networks: each super-network module runs its predictor's most
    frequent choice on validation for every image (no predictor run), exits calibrated for it;
(c2) exits with fitted predictors: a sub-network chosen per image, exits calibrated for it;
(c) the registered model: whichever of (c1), (c2) and the most expensive sub-networks the
    flow's calibration chose on validation, per seed (the `registered` column and line);
(d) the oracle: each image leaves at the cheapest exit and sub-networks that get it right.
(c1) and (c2) are the same seeds' networks, each with the thresholds calibrated for it on
validation; neither is chosen by its test figures. For each: test accuracy, milliseconds per
image measured at batch 1 (the real cascade on 1,000 test images, passes interleaved with the
full network's) and at the serving batch, FLOPs per image, the cost over the oracle's (mean
cost by the latency table over the oracle's, the measured times decisions use; and in FLOPs)
and each exit's share of the test images; the oracle is not a runnable model, its cost comes
from the latency table (its FLOPs from the same search with FLOPs as the cost). (c) over a
sweep of accuracy tolerances gives the accuracy-latency curve (logged to MLflow).

Targets (issue 11): (c) at least 2.5 times faster than (a) at batch 1 at no more than 0.3
points of accuracy lost, and (c)'s cost within 1.3 times the oracle's (by the table, the
measured times decisions use; in FLOPs beside it).

    python -m bench.cascade                    # 3 seeds, about 15 minutes on 2 cores
    python -m bench.cascade --data-set 2500x16  # the second data set (`bench.two_sets`)
    python -m bench.cascade --set routing_target=cost route_shares=0   # the earlier predictor
    python -m bench.cascade --seeds 0 --set predictor=fixed
    python -m bench.cascade --seeds 0 --set profile=smoke   # a check that it runs: a minute
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.two_sets import SETS, small_data_fields  # noqa: E402
from flows.cascade import cascade  # noqa: E402
from tasks.configs.cascade import CascadeConfig  # noqa: E402

# variant: the prefix of its test metrics, and the routing it is when the calibration
# registers it (`Calibration.routing`)
ROWS: dict[str, tuple[str, str | None]] = {
    "(a) full network": ("full_", None),
    "(b) early exits alone": ("plain_", "most_expensive"),
    "(c1) exits, fixed sub-networks": ("fixed_", "fixed"),
    "(c2) exits, fitted predictors": ("fitted_", "fitted"),
    "(c) registered model (per seed: c1, c2 or b)": ("", None),
}
ROUTING_ROWS = {"fixed": "c1", "fitted": "c2", "most_expensive": "b"}


def run(seed: int, overrides: dict) -> dict:
    """One flow run: its test metrics, sweep, thresholds and what its calibration registered
    (`routing`: fixed, fitted, most_expensive; None where nothing was chosen)."""
    started = time.perf_counter()
    summary = cascade(CascadeConfig(**{"seed": seed, "progress": False,
                                       "model_name": "bench-cascade", **overrides}))
    return {"metrics": summary.test.metrics, "sweep": summary.test.sweep,
            "thresholds": summary.calibration.thresholds,
            "routing": summary.calibration.routing,
            "val": summary.calibration.metrics, "seconds": time.perf_counter() - started}


def variant_figures(runs: list[dict], prefix: str) -> dict | None:
    """One variant's figures over the seeds (mean, standard deviation): test accuracy, ms per
    image at batch 1 and at the serving batch, speed-up over (a) at batch 1 (per seed, full
    ms / its ms), MFLOPs, cost over the oracle's by the table and in FLOPs, exit shares. None
    where the runs did not measure it ((c1), (c2) without fitted predictors)."""
    if f"{prefix}test_accuracy" not in runs[0]["metrics"]:
        return None

    def stat(key: str) -> tuple[float, float]:
        return mean_std([r["metrics"][key] for r in runs])

    def per_run(value) -> tuple[float, float]:
        return mean_std([value(r["metrics"]) for r in runs])

    flops = "full_flops" if prefix == "full_" else f"{prefix}flops_per_image"
    figures = {"accuracy": stat(f"{prefix}test_accuracy"),
               "ms_b1": stat(f"{prefix}ms_per_image_b1"),
               "ms_serving": stat(f"{prefix}ms_per_image_serving"),
               "speedup_b1": per_run(lambda m: m["full_ms_per_image_b1"]
                                     / m[f"{prefix}ms_per_image_b1"]),
               "flops": stat(flops),
               "exit_shares": {k: stat(f"{prefix}exit_share_{k}")
                               for k in range(len(runs[0]["thresholds"]) + 1)}}
    if prefix == "full_":  # no exits: every image pays the full network
        figures |= {"cost_over_oracle": per_run(lambda m: 1 / m["oracle_table_cost_ratio"]),
                    "flops_over_oracle": per_run(lambda m: m["full_flops"]
                                                 / m["oracle_flops_per_image"])}
    else:
        figures |= {"cost_over_oracle": stat(f"{prefix}cost_over_oracle"),
                    "flops_over_oracle": stat(f"{prefix}flops_over_oracle")}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data-set", default=SETS[0], choices=SETS,
                        help="Fashion-MNIST (the `quick` profile's images) or the ImageFolder "
                             "report set of `bench.two_sets` (each seed its own split)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run (e.g. predictor=fixed)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    runs = []
    for seed in args.seeds:
        runs.append(run(seed, overrides | small_data_fields(args.data_set, seed)))
        print(f"seed {seed}: {runs[-1]}", flush=True)

    def stat(key: str) -> tuple[float, float]:
        return mean_std([r["metrics"][key] for r in runs])

    registered = {seed: r["routing"] for seed, r in zip(args.seeds, runs, strict=True)}
    rows, figures = [], {"benchmark": "cascade", "runs": runs, "overrides": overrides,
                         "data_set": args.data_set, "registered": registered}
    full_accuracy = stat("full_test_accuracy")[0]
    for name, (prefix, routing) in ROWS.items():
        figure = variant_figures(runs, prefix)
        figures[name] = figure
        if routing is not None:  # the seeds that registered this variant
            cell = ", ".join(str(seed) for seed, chosen in registered.items()
                             if chosen == routing) or "none"
        elif not prefix:  # the registered model: each seed's choice
            cell = ", ".join(f"{seed}: {ROUTING_ROWS.get(chosen, '-')}"
                             for seed, chosen in registered.items())
        else:
            cell = ""
        if figure is None:
            rows.append([name, "not measured (no fitted predictor to choose against)"]
                        + [""] * 9)
            continue
        acc, speedup = figure["accuracy"], figure["speedup_b1"]
        over, flops_over = figure["cost_over_oracle"], figure["flops_over_oracle"]
        rows.append([name, f"{acc[0]:.4f} ± {acc[1]:.4f}", f"{acc[0] - full_accuracy:+.4f}",
                     f"{figure['ms_b1'][0]:.3f}", f"{speedup[0]:.2f} ± {speedup[1]:.2f}",
                     f"{1000 / figure['ms_serving'][0]:.0f}", f"{figure['flops'][0] / 1e6:.2f}",
                     f"{over[0]:.2f} ± {over[1]:.2f}", f"{flops_over[0]:.2f} ± {flops_over[1]:.2f}",
                     " / ".join(f"{v[0]:.3f}" for v in figure["exit_shares"].values()),
                     cell])
    oracle, ratio = stat("oracle_accuracy"), stat("oracle_table_cost_ratio")
    oracle_flops = stat("oracle_flops_per_image")
    rows.append(["(d) oracle", f"{oracle[0]:.4f} ± {oracle[1]:.4f}",
                 f"{oracle[0] - full_accuracy:+.4f}", "", f"{1 / ratio[0]:.2f} (table)", "",
                 f"{oracle_flops[0] / 1e6:.2f}", "1.00", "1.00", "", ""])
    figures["(d) oracle"] = {"accuracy": oracle, "cost_ratio": ratio, "flops": oracle_flops}
    print_table(["variant", "test accuracy", "vs (a)", "ms / image, batch 1",
                 "speed-up over (a), batch 1", "images / s, serving batch", "MFLOPs / image",
                 "cost / oracle's (table)", "cost / oracle's (FLOPs)", "exit shares",
                 "registered (seeds)"], rows)
    print("\nregistered (the flow's calibration on validation): " + ", ".join(
        f"seed {seed} {'nothing chosen' if chosen is None else ROUTING_ROWS[chosen]} "
        f"({chosen or 'no routing to choose'})" for seed, chosen in registered.items()))
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
    figures |= {"exit_shares": figures[list(ROWS)[-1]]["exit_shares"],
                "cost_over_oracle": stat("cost_over_oracle"),
                "flops_over_oracle": stat("flops_over_oracle"), "sweep": sweep}
    print_json(figures)


if __name__ == "__main__":
    main()
