"""What the `distill` student learns from, at equal student budget, through the flow itself.

Per data set (`bench.two_sets`) and seed, the real `distill` flow once per variant (no registry;
the first variant of a seed with Prefect's cache refreshed, so its teacher trains anew; the
others reuse that teacher's stages from the cache: one teacher per seed, every student on the
same teacher states, stage images, batches and schedule). Only the student's targets differ:

- `alone`: CE only (`--feature-weight 0`);
- `kd`: Hinton KD from the final teacher state on the student's own augmented batch
  (`--targets final`, logits, T=4, CE and KD 0.5 each): the baseline;
- `states`: teacher state s on the student's own batch at student stage s (`--targets states`,
  logits, KD at T=1 or T=4);
- `bank`: bank s at stage s (`--targets bank`, the teacher's logits of each image unaugmented,
  KD at T=4 or T=1); `bank views`: a consistent bank (`--bank-views augmented`: each entry
  records the augmented view its teacher state saw, and the student is shown that view);
  `bank mean`: each entry the mean over the states that wrote it (`--bank-average mean`);
- `bank pool cosine`: the flow's earlier default (pool features, cosine, masked bank);
- function matching (`--student-mixup 1`: each student batch mixed with a shuffled copy of
  itself, teacher state s run on the same mix): `fm` (KD alone at T=1, no CE, as Beyer et al.),
  `fm final` (the same from the last teacher state, Beyer et al.'s fixed teacher), `states mix`
  (CE on both labels and KD, 0.5 each), and `alone mix` (CE on the mixed batch, no
  teacher term: what mixing alone gives the student); `fm x6` and `alone x6` at 6 times the
  fitted budget, whatever `--patience` says;
- `kd-ls`: KD from the final state on standardized logits (`--feature-loss
  kl-standardized`, Sun et al. CVPR 2024, their recipe: T=2, CE 0.1, KD 9);
- `auto`: the flow's default (`--targets auto`): one student per candidate (labels, KD from
  the final state at T=4, the states at T=1, KD on standardized logits) on the same teacher,
  the one best on validation kept; each candidate is scored too, as the row it equals
  (`alone`, `kd`, `states-T1`, `kd-ls`). The record names the candidates
  (`auto_candidates`): the default had three before `standardized`.

Every student but `alone x1` trains `--patience` times the fitted budget (`--student-patience`).
The teacher is warm-started (`--teacher-pretrain-rounds`) as a strong teacher would be. Scored
by checkpoint on the validation split (the choices read only it), on the test split and on the
images no choice read (`bench.two_sets`); *gap closed*: (variant - alone) / (teacher - alone)
on the unread images, at the seeds' means; the paired columns against `alone` and `kd` (same
seed, unread).

    python -m bench.distill_targets                          # both sets, seeds 0-2
    python -m bench.distill_targets --sets 2500x16 --seeds 0 --variants alone states-T1 \\
        --set stages=2 train_limit=600 teacher_pretrain_rounds=1   # a check that it runs
"""

from __future__ import annotations

import argparse
import time

import torch
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from bench.common import mean_std, parse_overrides, print_json, print_table
from bench.report_set import ReportSet
from bench.sets import set_positions
from bench.small_data import Holdout
from bench.two_sets import SETS, small_data_fields
from flows.distill import distill
from tasks.configs.distill import AUTO_CANDIDATES, DistillConfig
from tasks.configs.sections import DataSection, classifier_config
from tasks.data import load_dataset
from tasks.distill import DistillPlan
from tasks.training import trained_model
from training.batches import Batches, Normalize, eval_batches
from training.loops import evaluate

LOGITS = {"teacher_layer": "fc", "student_layer": "fc", "feature_loss": "kl",
          "feature_weight": 0.5, "ce_weight": 0.5}
ALONE = {"targets": "bank", "teacher_layer": "pool", "student_layer": "pool",
         "feature_loss": "cosine", "feature_weight": 0.0, "ce_weight": 1.0}
# variant -> the `distill` config fields it sets, every one that differs between variants (so
# a change of the flow's defaults leaves them as measured); patience: the benchmark's, except
# `alone x1`
VARIANTS: dict[str, dict] = {
    "alone x1": {**ALONE, "student_patience": 1},
    "alone": ALONE,
    "kd": {"targets": "final", **LOGITS, "temperature": 4.0},
    "states-T1": {"targets": "states", **LOGITS, "temperature": 1.0},
    "states-T4": {"targets": "states", **LOGITS, "temperature": 4.0},
    "bank": {"targets": "bank", **LOGITS, "temperature": 4.0},
    "bank-T1": {"targets": "bank", **LOGITS, "temperature": 1.0, "bank_views": "clean",
                "bank_average": "latest"},
    "bank views-T1": {"targets": "bank", **LOGITS, "temperature": 1.0,
                      "bank_views": "augmented", "bank_average": "latest"},
    "bank mean-T1": {"targets": "bank", **LOGITS, "temperature": 1.0, "bank_views": "clean",
                     "bank_average": "mean"},
    "bank pool cosine": {"targets": "bank", "teacher_layer": "pool", "student_layer": "pool",
                         "feature_loss": "cosine", "feature_weight": 1.0, "ce_weight": 1.0},
    # function matching (Beyer et al.): the student and teacher state s on the same mixed view
    "alone mix": {**ALONE, "targets": "states", "teacher_layer": "fc", "student_layer": "fc",
                  "feature_loss": "kl", "student_mixup": 1.0},
    "states mix-T1": {"targets": "states", **LOGITS, "temperature": 1.0, "student_mixup": 1.0},
    "fm-T1": {"targets": "states", **LOGITS, "temperature": 1.0, "ce_weight": 0.0,
              "feature_weight": 1.0, "student_mixup": 1.0},
    "fm final-T1": {"targets": "final", **LOGITS, "temperature": 1.0, "ce_weight": 0.0,
                    "feature_weight": 1.0, "student_mixup": 1.0},
    "fm-T1 x6": {"targets": "states", **LOGITS, "temperature": 1.0, "ce_weight": 0.0,
                 "feature_weight": 1.0, "student_mixup": 1.0, "student_patience": 6},
    "alone x6": {**ALONE, "student_patience": 6},
    # the flow's default: one student per candidate on the same teacher, the best on validation
    # kept; each candidate is scored as the variant it is (`CANDIDATE_ROWS`)
    "auto": {"targets": "auto", **LOGITS, "temperature": 1.0},
    # KD from the final state on standardized logits, the recipe of Sun et al. (CVPR 2024)
    "kd-ls": {"targets": "final", **LOGITS, "feature_loss": "kl-standardized",
              "temperature": 2.0, "ce_weight": 0.1, "feature_weight": 9.0},
}
# `--targets auto`'s candidates as the variants above they equal (the `auto` variant's loss
# fields and T=1; `final` is KD at T=4; `labels` is CE alone, like `alone`)
CANDIDATE_ROWS = {"labels": "alone", "final": "kd", "states": "states-T1",
                  "standardized": "kd-ls"}


SPLITS = ("val", "test", "unread")


def unread_images(name: str, data: DataSection, classes: list[str]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The images no choice read (`bench.two_sets`) as uint8 N x 1 x H x W and class indices
    of the data set's `classes`."""
    if name == "fashion-mnist":
        report = ReportSet(data)
        return report.tensor, report.labels
    holdout = Holdout(data.image_size, "unread", set_positions(name))
    index = {label: i for i, label in enumerate(classes)}
    return (torch.from_numpy(holdout.images)[:, None],
            torch.tensor([index[label] for label in holdout.labels]))


def split_summary(runs: list[dict], variants: list[str]) -> dict[str, dict]:
    """The teacher's and each variant's mean and std on every split over `runs` (seeds), with
    each variant's gap closed on the unread images where `alone` ran: (variant - alone) /
    (teacher - alone), on the seeds' means."""
    summary = {v: {split: mean_std([r["accuracy"][v][split] for r in runs]) for split in SPLITS}
               for v in ["teacher", *variants]}
    if "alone" in variants:
        alone = summary["alone"]["unread"][0]
        gap = summary["teacher"]["unread"][0] - alone
        for variant in variants:
            figures = summary[variant]
            figures["gap_closed_unread"] = (figures["unread"][0] - alone) / gap if gap > 0 \
                else None
    return summary


def scored(model, images: torch.Tensor, labels: torch.Tensor, dataset) -> float:
    """A network's accuracy on `images` (uint8 N x C x H x W) with the data set's
    normalization, as the flows evaluate."""
    cpu = torch.device("cpu")
    batches = Batches(images, labels, torch.arange(len(labels)), 512,
                      Normalize(dataset.mean, dataset.std), device=cpu)
    return evaluate(model, batches, cpu)["accuracy"]


def figures(classifier, dataset, checkpoint, unread: tuple[torch.Tensor, torch.Tensor]
            ) -> dict[str, float]:
    """A checkpoint's accuracy on the validation and test splits and the unread images."""
    cpu = torch.device("cpu")
    model = trained_model(classifier, dataset, checkpoint)
    data = load_dataset(dataset)
    return {split: evaluate(model, eval_batches(data, dataset, split, cpu), cpu)["accuracy"]
            for split in ("val", "test")} | {"unread": scored(model, *unread, dataset)}


def run_seed(name: str, seed: int, variants: list[str], base: dict,
             cached_teacher: bool = False) -> dict:
    """One teacher and each variant's student on data set `name` and `seed` (the teacher
    trained anew by the first variant, or, `cached_teacher`, read from Prefect's cache where
    an earlier run of this checkout left it)."""
    started = time.perf_counter()
    accuracy: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    chosen: dict[str, str] = {}
    unread = None
    for n, variant in enumerate(variants):
        config = DistillConfig(**{**base, **small_data_fields(name, seed), "seed": seed,
                                  "progress": False, "registry": False, **VARIANTS[variant]})
        begun = time.perf_counter()
        with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: n == 0 and not cached_teacher}):
            summary = distill(config)
        seconds[variant] = time.perf_counter() - begun
        dataset = summary.dataset
        if unread is None:
            unread = unread_images(name, config.dataset, dataset.classes)
        plan = DistillPlan.of(config)
        last = summary.stages[-1]
        if "teacher" not in accuracy:
            accuracy["teacher"] = figures(classifier_config(plan.teacher), dataset,
                                          last.teacher.checkpoint, unread)
        accuracy[variant] = figures(classifier_config(plan.student), dataset,
                                    last.student.checkpoint, unread)
        for candidate, result in last.candidates.items():  # auto: each candidate its own row
            row = CANDIDATE_ROWS[candidate]
            if row not in accuracy:  # (the kept one is scored above already)
                accuracy[row] = accuracy[variant] if result == last.student else figures(
                    classifier_config(plan.student), dataset, result.checkpoint, unread)
        if summary.targets_chosen is not None:
            chosen[variant] = summary.targets_chosen
        print(f"{name} seed {seed} {variant}: {accuracy[variant]} "
              f"({seconds[variant]:.0f} s; teacher {accuracy['teacher']})", flush=True)
    return {"seed": seed, "accuracy": accuracy, "seconds": seconds, "chosen": chosen,
            "total_seconds": time.perf_counter() - started}


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: each split's mean and std, the gap closed on the unread images and the
    paired unread differences to `alone` and `kd`; the variant best on validation."""
    summary = split_summary(runs, variants)
    for variant in variants:
        for other in ("alone", "kd"):
            if other in variants and variant != other:
                summary[variant][f"minus_{other}_unread"] = mean_std([
                    r["accuracy"][variant]["unread"] - r["accuracy"][other]["unread"]
                    for r in runs])
    return {"variants": summary,
            "chosen_on_val": max(variants, key=lambda v: summary[v]["val"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--patience", type=int, default=3,
                        help="the students' --student-patience (not `alone x1`'s)")
    parser.add_argument("--cached-teacher", action="store_true",
                        help="take the teacher's stages from Prefect's cache where an earlier "
                        "run in this checkout trained them (more variants on the same teacher)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="distill config fields for every run")
    args = parser.parse_args()
    base = {"teacher_pretrain_rounds": 8, "student_patience": args.patience,
            **parse_overrides(args.set)}
    results, rows = [], []
    for name in args.sets:
        runs = [run_seed(name, seed, args.variants, base, args.cached_teacher)
                for seed in args.seeds]
        scored_rows = list(dict.fromkeys(v for run in runs for v in run["accuracy"]
                                         if v != "teacher"))
        entry = {"set": name, "runs": runs, **summarize(runs, scored_rows)}
        results.append(entry)
        for variant, row in entry["variants"].items():
            gap = row.get("gap_closed_unread")
            rows.append([name, variant, *(f"{row[s][0]:.4f} ± {row[s][1]:.4f}" for s in SPLITS),
                         "-" if gap is None else f"{gap:+.2f}"])
    print_table(["set", "variant", "validation", "test", "unread", "gap closed (unread)"], rows)
    print_json({"benchmark": "distill_targets", "seeds": args.seeds, "base": base,
                "variants": {v: VARIANTS[v] for v in args.variants},
                "auto_candidates": list(AUTO_CANDIDATES), "results": results})


if __name__ == "__main__":
    main()
