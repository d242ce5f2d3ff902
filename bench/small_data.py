"""Every flow's defaults on small real data sets, against raw-pixel baselines and a long run.

The data sets are ImageFolder directories (as a user's own images would come): `NxS` is N
Fashion-MNIST training images, N/10 per class, drawn with a fixed seed, saved as PNG at S
pixels (bilinear resize for S != 28); `digits` is scikit-learn's 1,797 handwritten digits of
8 x 8 pixels (a data set of another kind, where raw pixels are strong). Each flow runs with
its defaults (`quick` profile) on each set and seed, through the real flow (data preparation,
tracking, versioning, registration), and its test accuracy (the folder's own test split, 20%)
is set beside:

- the raw-pixel baselines of the same splits (3-NN and a linear classifier, `training.baselines`);
- a long run of the same network: the `train` flow's recipe with that flow's network
  (`resnet18` for `train`, the `lenet` student for `distill` and `pbt`), `--long-factor` times
  the minimum steps and the most passes, no early stopping (the network trained long enough).

Targets: every flow above both baselines on every set, and within 1 point of the long run.
A test split of 300 images moves by 2 points between splits, so `--split-per-seed` gives each
seed its own split (`split_seed` = seed, for the baselines and the long runs too): the means
then average over splits as well as seeds.

    python -m bench.small_data                              # 4 sets, 3 seeds, 3 flows
    python -m bench.small_data --sets 1500x28 --seeds 0 --flows train
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.common import mean_std, print_json, print_table  # noqa: E402
from flows.distill import distill  # noqa: E402
from flows.pbt import pbt  # noqa: E402
from flows.train import train  # noqa: E402
from tasks.config import DistillConfig, PBTConfig, TrainConfig  # noqa: E402
from tasks.data import fashion_mnist_root  # noqa: E402
from tasks.environment import data_dir  # noqa: E402
from training.datasets import load_fashion_mnist  # noqa: E402

SETS = ("500x28", "1500x28", "5000x28", "1500x8", "digits")
FLOWS = ("train", "distill", "pbt")
NETWORKS = {"train": TrainConfig.model_fields["model"].default,  # each flow's final network
            "distill": DistillConfig.model_fields["student_model"].default,
            "pbt": PBTConfig.PROFILES["quick"]["model"]}


def digits_folder() -> Path:
    """scikit-learn's handwritten digits (1,797 real 8 x 8 gray images in 10 classes, shipped
    inside the package) as an ImageFolder under data/small/ (made once, then renamed)."""
    root = data_dir() / "small" / "digits-1797x8"
    if root.is_dir():
        return root
    from sklearn.datasets import load_digits

    digits = load_digits()
    partial = root.with_name(root.name + ".partial")
    for n, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = partial / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * 255 / 16).round().clip(0, 255).astype("uint8")  # values 0..16
        Image.fromarray(pixels, mode="L").save(folder / f"{n:05d}.png")
    partial.rename(root)
    return root


def image_folder(images: int, size: int) -> Path:
    """The ImageFolder of `images` Fashion-MNIST training images at `size` pixels (made once
    under data/small/, written under a temporary name and renamed)."""
    root = data_dir() / "small" / f"fashion-{images}x{size}"
    if root.is_dir():
        return root
    source = load_fashion_mnist(fashion_mnist_root(), train=True)
    generator = torch.Generator().manual_seed(images * 1000 + size)
    partial = root.with_name(root.name + ".partial")
    for label, name in enumerate(source.classes):
        picks = (source.labels == label).nonzero().flatten()
        picks = picks[torch.randperm(len(picks), generator=generator)[:images // 10]]
        folder = partial / name.replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
        for n, index in enumerate(picks.tolist()):
            image = Image.fromarray(source.images[index, 0].numpy(), mode="L")
            if size != 28:
                image = image.resize((size, size), Image.BILINEAR)
            image.save(folder / f"{n:05d}.png")
    partial.rename(root)
    return root


def run_flow(flow: str, folder: Path, size: int, seed: int, split_seed: int = 0,
             **overrides) -> dict:
    """One run of `flow` with its defaults on `folder`; its test accuracy and baselines."""
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
    else:
        summary = pbt(PBTConfig(**common))
        baselines = None
    return {"test_accuracy": summary.test_accuracy, "baselines": baselines,
            "seconds": time.perf_counter() - started, "alias": summary.registration.alias}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), help="NxS (N Fashion-MNIST "
                        "images of S pixels) or digits")
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
    args = parser.parse_args()
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
        runs: dict[str, list[dict]] = {}
        for seed in args.seeds:
            for flow in args.flows:
                split = seed if args.split_per_seed else 0
                runs.setdefault(flow, []).append(run_flow(flow, folder, size, seed, split))
                print(f"{spec} seed {seed} {flow}: {runs[flow][-1]}", flush=True)
            for model in long_models if args.long_factor and seed in long_seeds else []:
                fields = TrainConfig.model_fields
                runs.setdefault(f"long {model}", []).append(run_flow(
                    "train", folder, size, seed, seed if args.split_per_seed else 0,
                    model=model, patience=None,
                    min_steps=fields["min_steps"].default * args.long_factor,
                    max_epochs=fields["max_epochs"].default * args.long_factor,
                    model_name=f"bench-small-long-{model}-{folder.name}"))
                print(f"{spec} seed {seed} long {model}: {runs[f'long {model}'][-1]}",
                      flush=True)
        baselines = [r["baselines"] for flow_runs in runs.values() for r in flow_runs
                     if r["baselines"]]
        knn = mean_std([b["knn_test_accuracy"] for b in baselines]) if baselines else None
        linear = mean_std([b["linear_test_accuracy"] for b in baselines]) if baselines else None
        for flow, flow_runs in runs.items():
            long_runs = runs.get(f"long {NETWORKS.get(flow)}")
            long = mean_std([r["test_accuracy"] for r in long_runs]) if long_runs else None
            accuracies = [r["test_accuracy"] for r in flow_runs]
            mean, std = mean_std(accuracies)
            row = {"set": spec, "flow": flow, "test_accuracy": accuracies, "mean": mean,
                   "std": std, "seconds": mean_std([r["seconds"] for r in flow_runs])[0],
                   "aliases": [r["alias"] for r in flow_runs]}
            results.append(row)
            rows.append([spec, flow, f"{mean:.4f} ± {std:.4f}",
                         " / ".join(f"{a:.4f}" for a in accuracies),
                         f"{knn[0]:.4f} ± {knn[1]:.4f}" if knn else "-",
                         f"{linear[0]:.4f} ± {linear[1]:.4f}" if linear else "-",
                         f"{mean - long[0]:+.4f}" if long else "-",
                         f"{row['seconds']:.0f}"])
    print_table(["set", "flow", "test accuracy (mean ± std)", "per seed", "3-NN pixels",
                 "linear pixels", "vs long run", "s / run"], rows)
    print_json({"benchmark": "small_data", "seeds": args.seeds, "long_seeds": long_seeds,
                "split_per_seed": args.split_per_seed,
                "long_factor": args.long_factor, "results": results})


if __name__ == "__main__":
    main()
