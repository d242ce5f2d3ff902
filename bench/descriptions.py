"""The `image_text` flow's several weighted descriptions per image against one, at 10 labels
per class, on two data sets (`bench.two_sets`).

The flow's own idea: each image carries several descriptions in the contrastive loss, each
pulling by its weight. Variants, all with the text-initialized classifier and no head mixing,
the same rounds and budget, under the few-label protocol of `bench.image_text` (only the 100
labelled training images get their class's descriptions; every other image gets its two
measured phrases and the description of a captioner trained on the labelled images' texts;
every choice reads 10 validation images per class):

- `several` (the default): every description, weighted by its kind (class description 1,
  captioner 0.5, measured phrase 0.25);
- `one`: each image's heaviest description only (`--no-multi-description`), the simpler
  version;
- `no phrases`: every description but the measured phrases (`--no-phrases`), which are shared
  across classes ("a wide, low item filling half the frame");
- `agreement`: every description, each weight also following how well the image agrees with
  it among its own descriptions (`--description-weights agreement`).

Fashion-MNIST: the class descriptions are the project's own (`tests/data/fashion_classes.csv`
is not used; the flow's default), `--train-limit` training images; `2500x16`: the ImageFolder's
class names looked up in WordNet (the flow's default for a user's folder). Reported on images no
choice read: the test split and the unread images of `bench.two_sets`.

    python -m bench.descriptions                   # both sets, 4 variants, seeds 0-2
    python -m bench.descriptions --sets 2500x16 --seeds 0 --variants several one \
        --set profile=smoke                       # a check that it runs
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.image_text import FEW, PROTOCOL  # noqa: E402
from bench.two_sets import SETS, DataSet  # noqa: E402
from flows.image_text import image_text  # noqa: E402
from tasks.configs.image_text import ImageTextConfig  # noqa: E402

VARIANTS = {
    "several": {},
    "one": {"multi_description": False},
    "no phrases": {"phrases": False},
    "agreement": {"description_weights": "agreement"},
}
BASE = "one"  # the simpler version every other variant is paired against


def run(data: DataSet, seed: int, fields: dict) -> dict:
    """One few-label `image_text` run: validation, test and unread accuracy."""
    started = time.perf_counter()
    summary = image_text(ImageTextConfig(**{
        "progress": False, "model_name": "bench-descriptions", "labels_per_class": FEW,
        "head_mixing": False, **fields, **data.config(seed)}))
    return {"val_accuracy": summary.val_accuracy, "test_accuracy": summary.test_accuracy,
            "unread_accuracy": data.score(summary.registration.model_uri),
            "zero_shot": summary.test_metrics["test_zero_shot_accuracy"],
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--train-limit", type=int, default=5000,
                        help="Fashion-MNIST's training images (labelled or not)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run (e.g. profile=smoke)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    results, rows = [], []
    for name in args.sets:
        fields = overrides | ({"train_limit": args.train_limit} if name == "fashion-mnist"
                              else {})
        data = DataSet(name, ImageTextConfig(**{"progress": False, **fields}).dataset,
                       overrides.get("profile") == "smoke")
        runs = {}
        for seed in args.seeds:
            for variant in args.variants:
                figures = run(data, seed, fields | VARIANTS[variant])
                runs.setdefault(variant, []).append(figures)
                print(f"{name} {variant} seed {seed}: {figures}", flush=True)
        entry = {"set": name, "variants": {}}
        for variant, seeds in runs.items():
            summary = {k: mean_std([r[k] for r in seeds]) for k in
                       ("val_accuracy", "test_accuracy", "unread_accuracy", "zero_shot")}
            paired = None
            if variant != BASE and BASE in runs:
                paired = mean_std([r["unread_accuracy"] - b["unread_accuracy"]
                                   for r, b in zip(seeds, runs[BASE], strict=True)])
            entry["variants"][variant] = {"runs": seeds, **summary, "minus_one_unread": paired}
            rows.append([name, variant, *(f"{summary[k][0]:.4f} ± {summary[k][1]:.4f}" for k in
                                          ("unread_accuracy", "test_accuracy", "val_accuracy")),
                         "-" if paired is None else f"{paired[0]:+.4f} ± {paired[1]:.4f}"])
        results.append(entry)
    print_table(["set", "descriptions", "unread accuracy", "test accuracy",
                 f"validation ({FEW} per class)", "unread, minus `one` (paired)"], rows)
    print_json({"benchmark": "descriptions", "seeds": args.seeds, "protocol": PROTOCOL,
                "train_limit": args.train_limit, "overrides": overrides, "results": results})


if __name__ == "__main__":
    main()
