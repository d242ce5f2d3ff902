"""The `image_text` flow: what the descriptions and the text-initialized classifier buy.

Runs the real flow (`quick` profile: Fashion-MNIST, 20,000 training images, `lenet`, MiniLM
text features, the project's own descriptions) once per seed and variant:
(a) cross-entropy only (no text, random classifier, the same number of rounds);
(b) cross-entropy + the contrastive sub-loss, the classifier from random directions;
(c) (b) with the text-initialized classifier;
each with every label and with 10 labelled images per class; and at 10 labels per class
(d) (c) with its classifier mixed with the zero-shot head (WiSE-FT, `--head-mixing`).
Then (c) without two classes' images, labels and descriptions (`--unseen`), classified
zero-shot among all 10 classes from the descriptions; the ablation: (c) at 10 labels per
class with one description per image instead of every description, weighted; and (c) with
descriptions from the other two sources: matched in the project's own pool of transformed
copies (matching precision and recall), the unmatched images described by the captioner (its
BLEU on held-out images beside the most frequent description's).

The few-label protocol (`PROTOCOL`): only the labelled images get their class's descriptions;
an unlabelled image gets its measured phrases and the description of a captioner trained on
the labelled images' texts; every choice (early stopping, the round kept, the head mixing)
reads 10 validation images per class; the test set is Fashion-MNIST's official one, every
label, never read for a choice.

Target (issue 12): (c) at least 3 points above (a) at 10 labels per class.

    python -m bench.image_text --set train_limit=10000   # every row: 30 runs
    python -m bench.image_text --labels few --set train_limit=10000   # the few-label rows
    python -m bench.image_text --seeds 0 --set train_limit=5000
"""

from __future__ import annotations

import argparse
import os
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from flows.image_text import image_text  # noqa: E402
from tasks.configs.image_text import ImageTextConfig  # noqa: E402

FEW = 10  # labelled images per class in the few-label runs
ROUNDS = ImageTextConfig.model_fields["align_rounds"].default + \
    ImageTextConfig.model_fields["rounds"].default
VARIANTS = {
    "(a) CE only": {"contrastive_weight": 0, "align_rounds": 0, "rounds": ROUNDS,
                    "text_init": False, "head_mixing": False},
    "(b) CE + contrastive": {"text_init": False, "head_mixing": False},
    "(c) (b) + text-initialized classifier": {"head_mixing": False},
}
MIXED = "(d) (c) + head mixing (WiSE-FT)"
PROTOCOL = (f"{FEW} labels per class: only the labelled training images get their class's "
            "descriptions; the unlabelled ones get their measured phrases and the description "
            "of a captioner trained on the labelled images' texts; early stopping, the round "
            f"kept and the head mixing read {FEW} validation images per class; test: the "
            "official Fashion-MNIST test set, every label, never read for a choice")


def plan_runs(labels: str, unseen: str) -> list[tuple[str, str, dict]]:
    """(variant, labels, config fields) of every run per seed: `all`, every label; `few`,
    10 per class; `both`."""
    few = f"{FEW} per class"
    plan = []
    if labels in ("all", "both"):
        plan += [(name, "all", fields) for name, fields in VARIANTS.items()]
    if labels in ("few", "both"):
        plan += [(name, few, fields | {"labels_per_class": FEW})
                 for name, fields in VARIANTS.items()]
        plan += [(MIXED, few, {"labels_per_class": FEW, "head_mixing": True}),
                 ("(c), one description per image", few,
                  {"labels_per_class": FEW, "multi_description": False, "head_mixing": False})]
    if labels in ("all", "both"):
        plan += [("(c), unseen classes", "all", {"unseen_classes": unseen,
                                                 "head_mixing": False}),
                 ("(c), pool matches + captioner", "all", {"captions_source": "pool",
                                                           "head_mixing": False})]
    return plan


def run(seed: int, fields: dict) -> dict:
    """One flow run's test metrics, its description sources' figures and time."""
    started = time.perf_counter()
    summary = image_text(ImageTextConfig(**{"seed": seed, "progress": False,
                                            "model_name": "bench-image-text", **fields}))
    described, figures = summary.descriptions, {}
    if described.captioned is not None:
        figures = {"captioner_bleu": described.captioned.bleu,
                   "constant_bleu": described.captioned.constant_bleu,
                   "generated": described.captioned.generated}
    return summary.test_metrics | described.matching | figures | {
        "seconds": time.perf_counter() - started, "val_images": summary.val_images,
        "labelled_images": described.labelled_images,
        "head_mixing_alpha": summary.head_mixing_alpha}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--labels", choices=("all", "few", "both"), default="both",
                        help=f"the runs with every label, those with {FEW} per class "
                        "(and head mixing), or both")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="run only these variants (their names as the table prints them)")
    parser.add_argument("--unseen", default="Sandal,Shirt", help="the classes left out of "
                        "training in the zero-shot runs")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="config fields for every run")
    args = parser.parse_args()
    common = parse_overrides(args.set)
    runs: dict[tuple[str, str], list[dict]] = {}
    plan = plan_runs(args.labels, args.unseen)
    if args.variants:
        unknown = set(args.variants) - {name for name, _, _ in plan}
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; of --labels {args.labels}: "
                         + "; ".join(dict.fromkeys(name for name, _, _ in plan)))
        plan = [run for run in plan if run[0] in args.variants]
    if args.labels != "all":
        print(f"protocol: {PROTOCOL}", flush=True)
    for seed in args.seeds:
        for name, labels, fields in plan:
            result = run(seed, common | fields)
            runs.setdefault((name, labels), []).append(result)
            mixing = ("" if result["head_mixing_alpha"] is None
                      else f", head mixing alpha {result['head_mixing_alpha']:g}")
            print(f"seed {seed} {name}, labels {labels}: test accuracy "
                  f"{result['test_accuracy']:.4f}, zero-shot "
                  f"{result['test_zero_shot_accuracy']:.4f}{mixing} "
                  f"({result['seconds']:.0f} s)", flush=True)
    rows, results = [], []
    for (name, labels), seeds in runs.items():
        accuracy = mean_std([r["test_accuracy"] for r in seeds])
        zero_shot = mean_std([r["test_zero_shot_accuracy"] for r in seeds])
        unseen = [r["test_unseen_zero_shot_accuracy"] for r in seeds
                  if "test_unseen_zero_shot_accuracy" in r]
        rows.append([name, labels, f"{accuracy[0]:.4f} ± {accuracy[1]:.4f}",
                     f"{zero_shot[0]:.4f} ± {zero_shot[1]:.4f}",
                     "{:.4f} ± {:.4f}".format(*mean_std(unseen)) if unseen else "-",
                     f"{mean_std([r['seconds'] for r in seeds])[0]:.0f}"])
        results.append({"variant": name, "labels": labels, "mean": accuracy[0],
                         "std": accuracy[1], "zero_shot_mean": zero_shot[0],
                         "test_accuracy": [r["test_accuracy"] for r in seeds],
                         "zero_shot": [r["test_zero_shot_accuracy"] for r in seeds],
                         "unseen_zero_shot": unseen,
                         "seen_accuracy": [r.get("test_seen_accuracy") for r in seeds],
                         "val_images": [r["val_images"] for r in seeds],
                         "head_mixing_alpha": [r["head_mixing_alpha"] for r in seeds]})
    print_table(["variant", "labels", "test accuracy", "zero-shot (10 classes)",
                 f"unseen zero-shot ({args.unseen})", "s / run"], rows)
    pooled = [r for seeds in runs.values() for r in seeds if "match_precision" in r]
    sources = {k: mean_std([r[k] for r in pooled]) for k in (
        "match_precision", "match_recall", "captioner_bleu", "constant_bleu", "generated")
        if pooled and all(k in r for r in pooled)}
    if sources:
        print_table(["description source", "mean ± std over seeds"],
                    [[k, f"{m:.3f} ± {sd:.3f}"] for k, (m, sd) in sources.items()])
    gains = paired_gains(runs)
    for comparison, (mean, std) in gains.items():
        print(f"{comparison}: {mean:+.4f} ± {std:.4f} (test accuracy, seed by seed)")
    print_json({"benchmark": "image_text", "seeds": args.seeds, "unseen": args.unseen,
                "labels": args.labels, "protocol": PROTOCOL if args.labels != "all" else None,
                "set": common, "results": results, "sources": sources,
                "gains": {k: {"mean": m, "std": sd} for k, (m, sd) in gains.items()}})


COMPARISONS = (("(c) (b) + text-initialized classifier", "(a) CE only"),  # the target
               (MIXED, "(c) (b) + text-initialized classifier"))  # does head mixing win?


def paired_gains(runs: dict[tuple[str, str], list[dict]]) -> dict[str, tuple[float, float]]:
    """For each of `COMPARISONS` and label setting run: the mean and standard deviation over
    seeds of the first variant's test accuracy minus the second's, seed by seed."""
    gains = {}
    for labels in dict.fromkeys(labels for _, labels in runs):
        for better, base in COMPARISONS:
            ours, theirs = runs.get((better, labels)), runs.get((base, labels))
            if ours and theirs and len(ours) == len(theirs):
                name = f"{better.split()[0]} - {base.split()[0]}, labels {labels}"
                gains[name] = mean_std([o["test_accuracy"] - t["test_accuracy"]
                                        for o, t in zip(ours, theirs, strict=True)])
    return gains


if __name__ == "__main__":
    main()
