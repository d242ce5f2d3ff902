"""Every flow's defaults on small real data sets, against raw-pixel baselines and a long run.

The data sets are ImageFolder directories (as a user's own images would come): `NxS` is N
Fashion-MNIST training images, N/10 per class, drawn with a fixed seed, saved as PNG at S
pixels (bilinear resize for S != 28); `digits` is scikit-learn's 1,797 handwritten digits of
8 x 8 pixels (a data set of another kind, where raw pixels are strong).

Two groups. The tuning sets (`500x28`, `1500x28`, `5000x28`, `1500x8`, `digits`) are the ones
the defaults were tuned on, in earlier sessions, by their scores: a figure there is in-sample.
The report sets (`1000x28`, `2500x16`, the default) were never tuned on: drawn apart from
every tuning set's images, at sizes no tuning set has, and run once with the defaults as they
are.

Each flow runs with its defaults (`quick` profile) on each set and seed, through the real
flow (data preparation, tracking, versioning, registration); reported: its test accuracy (the
folder's own hashed test split, 20%) and, on the Fashion-MNIST sets, its holdout accuracy
(the served model, as registered, on 10,000 images no set draws from, resized alike; by
default the `unread` holdout of `bench.report_set`, training-file images no choice ever read;
`--holdout official`: the test file, which the tuning read), beside:

- the raw-pixel baselines of the same splits (k-NN and a linear classifier, k and the penalty
  chosen on validation, `training.baselines`), also scored on the holdout;
- with `--long-factor` above 0, a long run of the same network: the `train` flow's recipe
  with that flow's network (`resnet18` for `train`, the `lenet` student for `distill` and
  `pbt`), `--long-factor` times the minimum steps and the most passes, no early stopping.

With `train` and `pipeline` both run on a Fashion-MNIST set, their registered models are also
timed as a client meets them (`bench.serving.client_ms`: `predict` on PNG bytes of the
holdout's first images at the set's size, batch 1 and 64, one thread, the two interleaved),
with the parameters each serves.

Targets: every flow above both baselines on every set, and within 1 point of the long run.
A test split of 200 or 500 images moves by 2-5 points between splits, so `--split-per-seed`
gives each seed its own split (`split_seed` = seed, for the baselines and the long runs too):
the means then average over splits as well as seeds. The holdout's 10,000 images take the test
images' noise away (a point is 100 images, not one): what is left is the training's and the
split's.

    python -m bench.small_data --split-per-seed --long-factor 0   # the report sets: README
    python -m bench.small_data --sets digits 1500x8 --split-per-seed --holdout official
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.report_set import REPORT_IMAGES, unread_positions  # noqa: E402
from bench.serving import BATCHES, CALLS, client_ms, png_bytes  # noqa: E402
from bench.sets import (  # noqa: E402
    REPORT_SETS,
    TUNING_SETS,
    class_folder,
    digits_folder,
    image_folder,
    resized,
    set_positions,
)
from flows.distill import distill  # noqa: E402
from flows.pbt import pbt  # noqa: E402
from flows.pipeline import pipeline  # noqa: E402
from flows.train import train  # noqa: E402
from tasks.adapters import tracking  # noqa: E402
from tasks.adapters.registration import pyfunc_accuracy, served_parameters  # noqa: E402
from tasks.configs.distill import DistillConfig  # noqa: E402
from tasks.configs.pbt import PBTConfig  # noqa: E402
from tasks.configs.pipeline import PipelineConfig  # noqa: E402
from tasks.configs.sections import DataSection  # noqa: E402
from tasks.configs.train import TrainConfig  # noqa: E402
from tasks.data import fashion_mnist_root, split_source  # noqa: E402
from training.baselines import raw_pixel_baselines  # noqa: E402
from training.datasets import load_fashion_mnist  # noqa: E402

FLOWS = ("train", "distill", "pbt", "pipeline")
NETWORKS = {"train": TrainConfig.flat_fields()["model"].default,  # each flow's final network
            "distill": DistillConfig.model_fields["student_model"].default,
            "pbt": PBTConfig.PROFILES["quick"]["model"],
            "pipeline": DistillConfig.model_fields["student_model"].default}


class Holdout:
    """10,000 Fashion-MNIST images that no set draws from, at a set's size: `official`, the
    test file (read while the defaults were tuned: the 500 x 28 rows were scored there), or
    `unread`, training-file images apart from the set, every tuning set and every earlier
    validation split (`bench.report_set`), which no choice ever read."""

    def __init__(self, size: int, kind: str = "unread", drawn: set[int] | None = None):
        if kind == "official":
            source = load_fashion_mnist(fashion_mnist_root(), train=False)
            index = torch.arange(len(source.labels))
        else:
            source = load_fashion_mnist(fashion_mnist_root(), train=True)
            left = set(range(len(source.labels))) - (drawn or set())
            index = unread_positions(source.keys, source.labels, left, REPORT_IMAGES,
                                     "the set is too large for an unread holdout")
        self.kind = kind
        self.images = np.stack([np.asarray(resized(image, size))
                                for image in source.images[index]])
        self.labels = [class_folder(source.classes[i]) for i in source.labels[index].tolist()]

    def client_times(self, uris: dict[str, str]) -> dict[str, dict]:
        """Each registered model's client-side milliseconds per image at batch 1 and 64 on
        PNG bytes of the holdout's first images (one thread, the models interleaved), and the
        parameters it serves."""
        frame = png_bytes(self.images[:max(CALLS[1], 64 * 4)])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = client_ms({name: tracking.load_pyfunc(uri) for name, uri in uris.items()},
                              frame)
        finally:
            torch.set_num_threads(threads)
        return {name: {f"client_ms_b{batch}": times[name][batch] for batch in BATCHES}
                | {"parameters": served_parameters(uri)} for name, uri in uris.items()}

    def model_accuracy(self, model_uri: str) -> float:
        """The served model's accuracy on the holdout (its classes are the folder names)."""
        return pyfunc_accuracy(model_uri, self.images, self.labels)

    def baselines(self, folder: Path, size: int, split_seed: int) -> dict[str, float]:
        """The raw-pixel baselines fitted on the split's training images (k-NN; the linear
        classifier's penalty chosen on its validation images), scored on the holdout."""
        source, splits = split_source(DataSection(data=str(folder), image_size=size,
                                                  split_seed=split_seed))
        index = {name: i for i, name in enumerate(source.classes)}
        holdout = torch.from_numpy(self.images)[:, None]
        images = torch.cat([source.images[splits["train"]], source.images[splits["val"]],
                            holdout])
        labels = torch.cat([source.labels[splits["train"]], source.labels[splits["val"]],
                            torch.tensor([index[label] for label in self.labels])])
        ends = torch.tensor([len(splits["train"]), len(splits["val"]), len(holdout)]).cumsum(0)
        positions = torch.arange(len(images))
        found = raw_pixel_baselines(images, labels, {
            "train": positions[:ends[0]], "val": positions[ends[0]:ends[1]],
            "test": positions[ends[1]:]})
        return {"knn": found["knn_test_accuracy"], "linear": found["linear_test_accuracy"]}


def run_flow(flow: str, folder: Path, size: int, seed: int, split_seed: int = 0,
             holdout: Holdout | None = None, **overrides) -> dict:
    """One run of `flow` with its defaults on `folder`: its test accuracy, baselines and (with
    `holdout`) holdout accuracy."""
    common = {"data": str(folder), "image_size": size, "seed": seed, "progress": False,
              "split_seed": split_seed,
              "model_name": f"bench-small-{flow}-{folder.name}", **overrides}
    started = time.perf_counter()
    if flow == "train":
        summary = train(TrainConfig(**common))
        baselines = summary.baselines
    elif flow == "distill":
        summary = distill(DistillConfig(**common))
        baselines = None
    elif flow == "pipeline":  # every run trains: a benchmark must not skip an unchanged one
        summary = pipeline(PipelineConfig(**common, skip_unchanged=False))
        baselines = None
    else:
        summary = pbt(PBTConfig(**common))
        baselines = None
    seconds = time.perf_counter() - started
    shares = {} if flow != "pipeline" else {
        "student_share": summary.fallback.metrics["test_student_share"],
        "student_alone_stands": summary.fallback.metrics.get("student_alone_stands")}
    return {"test_accuracy": summary.test_accuracy, "baselines": baselines, "seconds": seconds,
            "alias": summary.registration.alias, "model_uri": summary.registration.model_uri,
            "holdout_accuracy": None if holdout is None
            else holdout.model_accuracy(summary.registration.model_uri)} | shares


def spread(pair: tuple[float, float] | None) -> str:
    """`mean ± std`, or `-` for none."""
    return "-" if pair is None else f"{pair[0]:.4f} ± {pair[1]:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(REPORT_SETS), help="NxS (N "
                        "Fashion-MNIST images of S pixels) or digits; default: the report "
                        f"sets (the tuning sets: {' '.join(TUNING_SETS)})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--flows", nargs="*", default=list(FLOWS), choices=FLOWS)
    parser.add_argument("--long-factor", type=int, default=4, help="the long run's minimum "
                        "steps and most passes, as multiples of the default's (0: no long run)")
    parser.add_argument("--long-seeds", type=int, nargs="+", default=None,
                        help="seeds of the long run (default: --seeds)")
    parser.add_argument("--long-models", nargs="*", default=None, help="networks given a long "
                        "run (default: those of --flows)")
    parser.add_argument("--split-per-seed", action="store_true", help="each seed its own "
                        "train / validation / test split (split_seed = seed)")
    parser.add_argument("--no-holdout", action="store_true", help="skip scoring on "
                        "a Fashion-MNIST holdout")
    parser.add_argument("--holdout", choices=["unread", "official"], default="unread",
                        help="the holdout: 10,000 training-file images no choice read, or "
                        "the official test file (read while tuning)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="config fields of the flows' runs (not the long runs')")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    long_seeds = args.seeds if args.long_seeds is None else args.long_seeds
    long_models = args.long_models if args.long_models is not None else sorted(
        {NETWORKS[flow] for flow in args.flows})
    rows, results = [], []
    for spec in args.sets:
        if spec == "digits":
            folder, size = digits_folder(), 8
        else:
            images, size = (int(part) for part in spec.split("x"))
            folder = image_folder(images, size)
        holdout = None if spec == "digits" or args.no_holdout else Holdout(
            size, args.holdout, None if spec == "digits" else set_positions(spec))
        runs: dict[str, list[dict]] = {}
        held_baselines = []
        for seed in args.seeds:
            split = seed if args.split_per_seed else 0
            if holdout is not None and (args.split_per_seed or not held_baselines):
                held_baselines.append(holdout.baselines(folder, size, split))
            for flow in args.flows:
                runs.setdefault(flow, []).append(run_flow(flow, folder, size, seed, split,
                                                          holdout, **overrides))
                print(f"{spec} seed {seed} {flow}: {runs[flow][-1]}", flush=True)
            if holdout is not None and {"train", "pipeline"} <= set(args.flows):
                timed = holdout.client_times({flow: runs[flow][-1]["model_uri"]
                                              for flow in ("train", "pipeline")})
                for flow, figures in timed.items():
                    runs[flow][-1] |= figures
                print(f"{spec} seed {seed} served: {timed}", flush=True)
            for model in long_models if args.long_factor and seed in long_seeds else []:
                fields = TrainConfig.flat_fields()
                runs.setdefault(f"long {model}", []).append(run_flow(
                    "train", folder, size, seed, split, holdout, model=model, patience=None,
                    min_steps=fields["min_steps"].default * args.long_factor,
                    max_epochs=fields["max_epochs"].default * args.long_factor,
                    model_name=f"bench-small-long-{model}-{folder.name}"))
                print(f"{spec} seed {seed} long {model}: {runs[f'long {model}'][-1]}",
                      flush=True)
        baselines = [r["baselines"] for flow_runs in runs.values() for r in flow_runs
                     if r["baselines"]]
        knn = mean_std([b["knn_test_accuracy"] for b in baselines]) if baselines else None
        linear = mean_std([b["linear_test_accuracy"] for b in baselines]) if baselines else None
        held = {name: mean_std([b[name] for b in held_baselines]) if held_baselines else None
                for name in ("knn", "linear")}
        for flow, flow_runs in runs.items():
            long_runs = runs.get(f"long {NETWORKS.get(flow)}")
            row = {"set": spec, "flow": flow, "seconds": mean_std(
                [r["seconds"] for r in flow_runs])[0], "aliases": [r["alias"] for r in flow_runs]}
            row |= {key: [r[key] for r in flow_runs] for key in (
                "student_share", "student_alone_stands", "parameters",
                *(f"client_ms_b{batch}" for batch in BATCHES))
                    if key in flow_runs[0]}  # seed by seed
            cells = []
            for score in ("test_accuracy", "holdout_accuracy"):
                accuracies = [r[score] for r in flow_runs]
                if None in accuracies:
                    cells += ["-", "-"]
                    continue
                mean, std = mean_std(accuracies)
                long = mean_std([r[score] for r in long_runs])[0] if long_runs else None
                row |= {score: accuracies, f"{score}_mean": mean, f"{score}_std": std,
                        f"{score}_vs_long": None if long is None else mean - long}
                cells += [f"{mean:.4f} ± {std:.4f}", "-" if long is None else f"{mean - long:+.4f}"]
            results.append(row)
            rows.append([spec, flow, *cells[:2], spread(knn), spread(linear), *cells[2:],
                         spread(held["knn"]), spread(held["linear"]), f"{row['seconds']:.0f}"])
        results.append({"set": spec, "holdout_baselines": held_baselines})
    print_table(["set", "flow", "test accuracy", "vs long", "3-NN pixels", "linear pixels",
                 "holdout accuracy", "vs long", "3-NN holdout", "linear holdout", "s / run"],
                rows)
    print_json({"benchmark": "small_data", "seeds": args.seeds, "long_seeds": long_seeds,
                "sets": args.sets, "tuning_sets": list(TUNING_SETS),
                "holdout": None if args.no_holdout else args.holdout,
                "split_per_seed": args.split_per_seed, "overrides": overrides,
                "long_factor": args.long_factor, "results": results})


if __name__ == "__main__":
    main()
