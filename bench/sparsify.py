"""The `sparsify` flow: each transform against no sparsity term, on classification, detection
and contour recognition.

Runs the real flow (`quick` profile) once per task, variant and seed; every variant of a task
has the same budget. Classifiers are also scored, as served, on 10,000 unread images no choice
ever read (`bench.report_set`; the official test images chose some defaults earlier).
Classification: Fashion-MNIST (20,000 training images, `lenet`, 8 rounds), every transform;
reported: test accuracy, the share of exact zeros per regularized layer and over all maps
together and the bytes a map takes stored as a bitmap plus values as a share of dense, all on
the test images (the flow's `test_zero_fraction_<layer>`, ...: the validation images chose the
round and calibrated the thresholds, so their zeros, shown beside for reference, are
optimistic), and the network with its dead channels removed (parameters and CPU time at batch
1, as shares of the original's). Detection and contour runs measure theirs on the test canvases
the same way. The last classification variant is the ablation of the map-size rule: one lambda
for every layer (gamma 0) against the default gamma 0.5, at the same lambda and at a lambda
that zeros as many values of all maps together (`all maps`: zeros weighted by map size). `abs,
fine-tuned` starts from the seed's `none` network (registered by that variant) and trains 4
more rounds with the term at lr 0.01 (`--init-from`); `thresholds` zero each layer's
activations below a threshold calibrated to cost at most 0.2 points of validation accuracy
(`--zero-threshold-tolerance 0.002`). Detection (SSDlite, mAP@0.5) and contour recognition (the
contour U-Net, boundary F at 1 pixel): without and with the default term, on the synthetic
layouts of real Fashion-MNIST items.

`abs, fine-tuned, zero target 0.8` sets thresholds for 80% zeros per layer over 8 cycles of
training with them in place (`--zero-target`); `..., zero target Z, ramp` raises them inside
one run of 22 rounds instead (`--zero-target-ramp 1,12`); `none, fine-tuned 22 rounds` trains
the `none` network as many more rounds without the term, their control. `none, 30 rounds`
and `abs, 30 rounds, zero target Z, ramp 3-18` train from scratch on one cosine of 30 rounds
at lr 0.05 (the fine-tuned pair's 8 + 22), the thresholds ramped before rounds 3-18, early
stopping off for both.

Target (issue 10): at least 80% zeros in the regularized layers at no more than 0.3 points of
accuracy lost.

    python -m bench.sparsify                       # every task and variant: ~4 hours on 2 cores
    python -m bench.sparsify --tasks classification --seeds 0 --variants none abs
    python -m bench.sparsify --tasks classification --variants none \
        "none, fine-tuned 22 rounds" "abs, fine-tuned, zero target 0.8"
    python -m bench.sparsify --tasks classification --variants none \
        "none, fine-tuned 22 rounds" "abs, fine-tuned, zero target 0.8, ramp" \
        "abs, fine-tuned, zero target 0.7, ramp" "abs, fine-tuned, zero target 0.6, ramp"
    python -m bench.sparsify --tasks classification --width 32 --variants none \
        "none, fine-tuned 22 rounds" "abs, fine-tuned 12 rounds, zero target 0.8"
    python -m bench.sparsify --tasks classification --variants "none, 30 rounds" \
        "abs, 30 rounds, zero target 0.8, ramp 3-18" "abs, 30 rounds, zero target 0.75, ramp 3-18"
    python -m bench.sparsify --tasks detection contour
    python -m bench.sparsify --tasks contour --variants abs --sparsity-lambda 0.1
    python -m bench.sparsify --tasks classification --width 32 --variants none abs
    python -m bench.sparsify --tasks classification --seeds 0 --variants none abs \
        --set profile=smoke            # a check that it runs end to end: about a minute
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.report_set import REPORT_IMAGES, ReportSet  # noqa: E402
from flows.sparsify import sparsify  # noqa: E402
from tasks.configs.sections import FASHION_MNIST  # noqa: E402
from tasks.configs.sparsify import SparsifyConfig  # noqa: E402

VARIANTS: dict[str, dict] = {
    "none": {"sparsity_lambda": 0.0},
    "abs": {"transform": "abs"},
    "power": {"transform": "power", "power": 2},
    "abs_power": {"transform": "abs_power", "abs_power": 3},  # M=2 would be `power` again
    "exp_abs": {"transform": "exp_abs", "base": 2.0},
    "exp_power": {"transform": "exp_power", "base": 2.0, "power": 2},
    "abs, gamma 0": {"transform": "abs", "lambda_gamma": 0.0},
    # the map-size ablation at equal total sparsity: gamma 0 needs a larger lambda to zero as
    # many of all the maps' values as gamma 0.5 at the default
    "abs, gamma 0, lambda 0.4": {"transform": "abs", "lambda_gamma": 0.0, "sparsity_lambda": 0.4},
    # fine-tuning: the seed's `none` network (registered by that variant, run first), then
    # FINETUNE's rounds with the term
    "abs, fine-tuned": {"transform": "abs"},
    # calibrated activation thresholds (FATReLU) after training: at most TOLERANCE of
    # validation accuracy
    "abs, thresholds": {"transform": "abs", "zero_threshold_tolerance": 0.002},
    "abs, fine-tuned, thresholds": {"transform": "abs", "zero_threshold_tolerance": 0.002},
    # the thresholds raised step by step, the network trained with them in place in between
    # (`--threshold-cycles`): 8 cycles of 2 rounds, all calibrations together at most 0.5
    # points of validation accuracy
    "abs, fine-tuned, threshold cycles": {"transform": "abs", "zero_threshold_tolerance": 0.005,
                                          "threshold_cycles": 8},
    # the scale-free Hoyer-square of each map instead of |x| (Kurtz et al., ICML 2020)
    "hoyer": {"transform": "hoyer"},
    "hoyer, fine-tuned, threshold cycles": {"transform": "hoyer",
                                            "zero_threshold_tolerance": 0.005,
                                            "threshold_cycles": 8},
    # thresholds set by their zeros (`--zero-target`): 80% in every regularized layer, reached
    # in 9 equal steps with 2 rounds of training after each (the last: settling), a lighter
    # term (the thresholds make the zeros; the term only keeps the maps small)
    "abs, fine-tuned, zero target 0.8": {"transform": "abs", "sparsity_lambda": 0.1,
                                         "zero_target": 0.8, "threshold_cycles": 8,
                                         "threshold_settle_rounds": 2},
    # the thresholds raised inside one run of 22 rounds at lr 0.01 (`--zero-target-ramp`):
    # before each of rounds 1-12 in equal steps, topped up before every later round; the
    # control's optimizer and schedule. At lower targets too: what a share of zeros costs
    **{f"abs, fine-tuned, zero target {z:g}, ramp": {
        "transform": "abs", "sparsity_lambda": 0.1, "rounds": 22, "zero_target": z,
        "zero_target_ramp": (1, 12)} for z in (0.8, 0.7, 0.6)},
    # both trained longer (38 rounds after `none`'s 8), the ramp over the first 20. No early
    # stopping: with patience 4 the dense run stopped near round 12 at lr 0.008, while the
    # ramp (kept only from round 20) ran on
    "abs, fine-tuned 38 rounds, zero target 0.8, ramp": {
        "transform": "abs", "sparsity_lambda": 0.1, "rounds": 38, "zero_target": 0.8,
        "zero_target_ramp": (1, 20), "patience": None},
    "none, fine-tuned 38 rounds": {"sparsity_lambda": 0.0, "rounds": 38, "patience": None},
    # the same 22 rounds spent with more on the term before the thresholds: 12 rounds at lr
    # 0.01, then 8 cycles of 1 round and 2 settling rounds
    "abs, fine-tuned 12 rounds, zero target 0.8": {
        "transform": "abs", "sparsity_lambda": 0.1, "rounds": 12, "zero_target": 0.8,
        "threshold_cycles": 8, "threshold_cycle_rounds": 1, "threshold_settle_rounds": 2},
    # its control: the `none` network trained as many more rounds (4 + 8 x 2 + 2) without
    # the term or thresholds, so that the extra training is not counted as the method's
    "none, fine-tuned 22 rounds": {"sparsity_lambda": 0.0, "rounds": 22},
    # from scratch, both 30 rounds at the flow's lr 0.05 (the fine-tuned pair's 8 + 22), no
    # early stopping: the thresholds ramped before rounds 3-18 while the features still form
    "none, 30 rounds": {"sparsity_lambda": 0.0, "rounds": 30, "patience": None},
    **{f"abs, 30 rounds, zero target {z:g}, ramp 3-18": {
        "transform": "abs", "sparsity_lambda": 0.1, "rounds": 30, "zero_target": z,
        "zero_target_ramp": (3, 18), "patience": None} for z in (0.8, 0.75)},
    # the term nearly off: the thresholds alone make the zeros
    "abs 0.001, 30 rounds, zero target 0.8, ramp 3-18": {
        "transform": "abs", "sparsity_lambda": 0.001, "rounds": 30, "zero_target": 0.8,
        "zero_target_ramp": (3, 18), "patience": None},
}
FINETUNE = {"rounds": 4, "lr": 0.01}  # added to the `none` run's 8 rounds


DENSE_VARIANTS = ("none", "abs")
SCORES = {"classification": "test_accuracy", "detection": "test_map_50",
          "contour": "test_boundary_f"}


def run(task: str, variant: str, seed: int, lam: float | None,
        init_from: str | None = None, classifier: dict | None = None,
        overrides: dict | None = None, report: ReportSet | None = None) -> dict:
    """One flow run; its test score, zeros and memory (and, classifiers, the pruned net).
    `lam` None: the task's default lambda. `init_from`: a registered model to fine-tune
    (`FINETUNE`'s rounds, or the variant's). `classifier`: `model` and `width` of a
    classifier, where given. `overrides`: config fields for every run (`--set`), under the
    variant's. Zeros and bitmap bytes on the test split (`test_*`) and on validation
    (`val_*`)."""
    started = time.perf_counter()
    summary = sparsify(SparsifyConfig(**{
        "task": task, "seed": seed, "progress": False, **(overrides or {}),
        **({} if lam is None else {"sparsity_lambda": lam}),
        **((classifier or {}) if task == "classification" else {}),
        "model_name": f"bench-sparsify-{task}",
        **({"init_from": init_from, **FINETUNE} if init_from else {}), **VARIANTS[variant]}))
    val = summary.report
    test = summary.test_report
    return {"score": (summary.test_accuracy if task == "classification"
                      else summary.test[SCORES[task]]),
            "report_accuracy": report.served_accuracy(summary.registration.model_uri)
            if report is not None and task == "classification" else None,
            "test_zero_fraction": {k: v.zero_fraction for k, v in test.layers.items()},
            "total_test_zero_fraction": test.all_maps_zero_fraction(),
            "test_memory_bitmap_ratio": test.metrics()["memory_bitmap_ratio"],
            "val_zero_fraction": {k: v.zero_fraction for k, v in val.layers.items()},
            "total_val_zero_fraction": val.all_maps_zero_fraction(),
            "val_memory_bitmap_ratio": val.metrics()["memory_bitmap_ratio"],
            "model_uri": summary.registration.version_uri,
            "pruned": summary.pruned.metrics() if task == "classification" else None,
            "lambdas": summary.spec.lambdas, "seconds": time.perf_counter() - started}


def layer_label(layer: str) -> str:
    """A layer's short name in the table (`features.3.conv.0` -> `3`)."""
    return layer.split(".")[-3] if "." in layer else layer


def zeros_cell(per_layer: dict) -> str:
    """A table cell: each layer's mean share of exact zeros."""
    return " / ".join(f"{layer_label(layer)} {value[0]:.3f}"
                      for layer, value in per_layer.items())


def seed_mean(runs: list[dict], key: str) -> dict | None:
    """Per layer (a dict of layers) or for one value, the mean and standard deviation of
    `key` over the runs; None where the runs have none."""
    if runs[0][key] is None:
        return None
    if isinstance(runs[0][key], dict):
        return {layer: mean_std([r[key][layer] for r in runs]) for layer in runs[0][key]}
    return mean_std([r[key] for r in runs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(SCORES), choices=list(SCORES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="the variants to run (detection, contour: none and abs only)")
    parser.add_argument("--sparsity-lambda", type=float, default=None,
                        help="default: each task's (classification 0.42 for every map; "
                             "detection 0.3, contour 0.02 by the area rule)")
    parser.add_argument("--model", default=None, help="the classifier (default: lenet)")
    parser.add_argument("--width", type=int, default=None,
                        help="the classifier's width (default: the model's, lenet 16)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run, under each variant's (e.g. "
                             "profile=smoke, train_limit=5000)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    for variant in args.variants:  # each fine-tuning starts from its seed's `none` network
        if "fine-tuned" in variant and "none" not in args.variants[:args.variants.index(variant)]:
            parser.error(f"variant {variant!r} fine-tunes the `none` networks: list `none` "
                         "before it")
    classifier = {k: v for k, v in (("model", args.model), ("width", args.width))
                  if v is not None}
    results, rows = [], []
    settings = SparsifyConfig(**{"task": "classification", "progress": False, **overrides})
    report = ReportSet(settings.dataset, 500 if settings.profile == "smoke" else
                       REPORT_IMAGES) if "classification" in args.tasks and \
        settings.dataset.data == FASHION_MNIST else None
    for task in args.tasks:
        for variant in [v for v in args.variants
                        if task == "classification" or v in DENSE_VARIANTS]:
            runs = []
            for seed in args.seeds:
                init_from = None
                if "fine-tuned" in variant:
                    dense = next(r for r in results if r["task"] == task
                                 and r["variant"] == "none")
                    init_from = dense["runs"][args.seeds.index(seed)]["model_uri"]
                runs.append(run(task, variant, seed, args.sparsity_lambda, init_from,
                                classifier, overrides, report))
                print(f"{task} {variant} seed {seed}: {runs[-1]}", flush=True)
            score = mean_std([r["score"] for r in runs])
            reported = seed_mean(runs, "report_accuracy")
            figures = {key: seed_mean(runs, key) for key in (
                "test_zero_fraction", "total_test_zero_fraction", "test_memory_bitmap_ratio",
                "val_zero_fraction", "total_val_zero_fraction", "val_memory_bitmap_ratio")}
            pruned = {key: mean_std([r["pruned"][key] for r in runs])[0]
                      for key in ("pruned_parameter_ratio", "pruned_latency_ratio_b1")
                      } if task == "classification" else None
            results.append({"task": task, "variant": variant, "runs": runs,
                            SCORES[task]: score, "report_accuracy": reported, **figures,
                            "pruned": pruned})
            test_total, test_memory = (figures["total_test_zero_fraction"],
                                       figures["test_memory_bitmap_ratio"])
            rows.append([task, variant, "-" if reported is None else
                         f"{reported[0]:.4f} ± {reported[1]:.4f}",
                         f"{SCORES[task]} {score[0]:.4f} ± {score[1]:.4f}",
                         zeros_cell(figures["test_zero_fraction"]),
                         "-" if test_total is None else f"{test_total[0]:.3f}",
                         "-" if test_memory is None else f"{test_memory[0]:.3f}",
                         zeros_cell(figures["val_zero_fraction"]),
                         f"{figures['val_memory_bitmap_ratio'][0]:.3f}",
                         f"{pruned['pruned_parameter_ratio']:.3f}" if pruned else "-",
                         f"{pruned['pruned_latency_ratio_b1']:.3f}" if pruned else "-"])
    print_table(["task", "variant", "unread accuracy", "test score", "exact zeros (test)",
                 "all maps (test)",
                 "bitmap bytes / dense (test)", "exact zeros (validation)",
                 "bitmap / dense (validation)", "pruned parameters", "pruned time, batch 1"],
                rows)
    print_json({"benchmark": "sparsify", "seeds": args.seeds,
                "report_images": len(report) if report else 0,
                "sparsity_lambda": args.sparsity_lambda, "overrides": overrides,
                "results": results})


if __name__ == "__main__":
    main()
