"""The `distill` flow's own idea, a bank of the teacher's states read stage by stage, against
distilling from the final teacher alone, on two data sets (`bench.two_sets`).

Per data set and seed, one teacher (`resnet18`): a warm start of `--warm-epochs` epochs on every
training image (the flow's `--teacher-pretrain-epochs`), whose state 0 fills the bank of logits
(`--initial-bank teacher`), then the flow's S stages, each rewriting its images' entries. Then
the student (`lenet`) once per variant, on the same stage images, batches, schedule, clipping
(`bench.distill_methods`, the flow's stage code without Prefect, MLflow or DVC):

- `alone`: CE only;
- `kd`: Hinton KD from the final teacher (T=4, KD 0.5, CE 0.5);
- `l2`: L2 on the final teacher's logits (weights 1 and 1), the strongest baseline so far;
- `dkd`: decoupled KD from the final teacher (beta 8, T=4, weights 1 and 1);
- `bank l2`: at stage s, L2 on bank s (the teacher's states up to s), weights 1 and 1;
- `bank dkd`: at stage s, decoupled KD on bank s;
- `mean bank l2`, `mean bank dkd`: the same against a bank that keeps every state of an image:
  at stage s each entry is the mean of the logits of the states (0 to s) that wrote it, a
  temporal ensemble of the teacher's route (`state_means`).

No weight, temperature or beta was tuned here: KD's are the project's baselines', DKD's the
paper's CIFAR-100 values. The choice between the variants reads only the validation split; the
figures to report are the test split's and the unread images' (`bench.two_sets`: 10,000
training-file images no choice read, at the set's size).

    python -m bench.distill_bank                          # both sets, seeds 0-2
    python -m bench.distill_bank --sets 2500x16 --seeds 0 --variants alone "bank dkd" \\
        --train-limit 600 --stages 2 --warm-epochs 1 --min-steps 20   # a check that it runs
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor

from bench.common import mean_std, print_json, print_table
from bench.distill_methods import (
    AUGMENT,
    BACK_WEIGHT,
    EVAL_BATCH,
    FRONT_WEIGHT,
    METHODS,
    Seeded,
    train_student,
    train_teacher,
)
from bench.report_set import ReportSet
from bench.small_data import Holdout, set_positions
from bench.two_sets import SETS, small_data_fields
from tasks.configs.distill import DistillConfig
from tasks.configs.sections import DataSection
from tasks.data import split_source
from training.batches import Batches, Normalize
from training.budget import fit_budget
from training.datasets import channel_stats
from training.device import resolve_device
from training.distill.feature_bank import FeatureBank
from training.distill.stages import Role, draw_stage_ids
from training.loops import evaluate

# variant -> (`bench.distill_methods` method, which bank: each entry's latest state, or the
# mean over the states that wrote it)
VARIANTS: dict[str, tuple[str, str | None]] = {
    "alone": ("a: alone", None),
    "kd": ("b: KD (final teacher, T=4)", None),
    "l2": ("c: L2 on the final teacher's logits", None),
    "dkd": ("b: DKD (final teacher, beta 8, T=4)", None),
    "bank l2": ("d: bank logits, l2", "latest"),
    "bank dkd": ("d: bank logits, dkd", "latest"),
    "mean bank l2": ("d: bank logits, l2", "mean"),
    "mean bank dkd": ("d: bank logits, dkd", "mean"),
}
BANK_VARIANTS = tuple(v for v, (_, bank) in VARIANTS.items() if bank)
FINAL_VARIANTS = ("kd", "l2", "dkd")
SPLITS = ("val", "test", "unread")


def unread_images(name: str, data: DataSection, classes: list[str]) -> tuple[Tensor, Tensor]:
    """The images no choice read (`bench.two_sets`) as uint8 N x 1 x H x W and class indices
    of the data set's `classes`."""
    if name == "fashion-mnist":
        report = ReportSet(data)
        return report.tensor, report.labels
    holdout = Holdout(data.image_size, "unread", set_positions(name))
    index = {label: i for i, label in enumerate(classes)}
    return (torch.from_numpy(holdout.images)[:, None],
            torch.tensor([index[label] for label in holdout.labels]))


def state_means(snapshots: list[dict[str, FeatureBank]], layer: str
                ) -> list[dict[str, FeatureBank]]:
    """Bank s holding, per entry, the mean feature of the states 0..s that wrote it (snapshot s
    has the entries state s wrote marked with state s); unwritten entries stay unfilled."""
    total = torch.zeros_like(snapshots[0][layer].features, dtype=torch.float32)
    count = torch.zeros(len(total), device=total.device)
    means = []
    for state, snapshot in enumerate(snapshots):
        bank = snapshot[layer]
        written = bank.state == state
        total[written] += bank.features[written].float()
        count[written] += 1
        mean = total / count.clamp(min=1).view(-1, *[1] * (total.dim() - 1))
        means.append({layer: FeatureBank.from_state_dict({
            "ids": bank.ids, "features": mean.to(bank.features.dtype), "state": bank.state})})
    return means


def run_seed(name: str, seed: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One teacher and every variant's student on data set `name` and `seed`: each variant's
    accuracy on the validation split, the test split and the unread images."""
    started = time.perf_counter()
    data = DataSection(**{"train_limit": args.train_limit, **small_data_fields(name, seed)})
    source, splits = split_source(data)
    extra, extra_labels = unread_images(name, data, source.classes)
    images = torch.cat([source.images, extra]).to(device)
    labels = torch.cat([source.labels, extra_labels]).to(device)
    positions = {**splits, "unread": torch.arange(len(extra)) + len(source.images)}
    train_ids = positions["train"]
    normalize = Normalize(*channel_stats(source.images[train_ids]))
    scored = {split: Batches(images, labels, positions[split], EVAL_BATCH, normalize,
                             device=device) for split in SPLITS}
    roles: tuple[Role, ...] = ("teacher", "student")
    defaults = DistillConfig()
    optim, fraction = defaults.optim, defaults.teacher_fraction
    budgets = {role: fit_budget(len(train_ids), optim.batch_size, args.stages, args.min_steps,
                                optim.max_epochs, round(fraction * len(train_ids)),
                                optim.min_steps_full_below) for role in roles}
    warm = fit_budget(len(train_ids), optim.batch_size, args.warm_epochs, args.min_steps,
                      optim.max_epochs, None, optim.min_steps_full_below) \
        if args.warm_epochs else None
    draws = {role: [draw_stage_ids(train_ids, stage, role, seed, fraction, FRONT_WEIGHT,
                                   BACK_WEIGHT) for stage in range(1, args.stages + 1)]
             for role in roles}
    run = Seeded((images, labels, normalize), train_ids, scored["val"], budgets, draws,
                 optim.lr, seed, device)
    example = images[train_ids[:1]].float()
    teacher, latest = train_teacher(run, defaults.teacher_model, ["fc"], example, warm)
    banks = {"latest": latest, "mean": state_means(latest, "fc"), None: latest}
    figures = {"teacher": {split: evaluate(teacher, scored[split], device)["accuracy"]
                           for split in SPLITS}}
    for variant in args.variants:
        method, bank = VARIANTS[variant]
        student = train_student(run, defaults.student_model, METHODS[method], teacher,
                                banks[bank], example)
        figures[variant] = {split: evaluate(student, scored[split], device)["accuracy"]
                            for split in SPLITS}
        print(f"{name} seed {seed} {variant}: {figures[variant]}", flush=True)
    return {"seed": seed, "accuracy": figures, "seconds": time.perf_counter() - started,
            "train_images": len(train_ids),
            "budgets": {role: vars(b) for role, b in budgets.items()} | (
                {"warm": vars(warm)} if warm else {})}


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


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: mean and std of each split's accuracy, the gap closed on the unread images
    ((variant - alone) / (teacher - alone), on the seeds' means), and the paired unread
    difference to the best final-teacher baseline on validation."""
    summary = split_summary(runs, variants)
    finals = [v for v in FINAL_VARIANTS if v in variants]
    best_final = max(finals, key=lambda v: summary[v]["val"][0]) if finals else None
    for variant in variants:
        figures = summary[variant]
        if best_final and variant in BANK_VARIANTS:
            figures["minus_best_final_unread"] = mean_std([
                r["accuracy"][variant]["unread"] - r["accuracy"][best_final]["unread"]
                for r in runs])
    return {"variants": summary, "best_final_on_val": best_final,
            "chosen_on_val": max(variants, key=lambda v: summary[v]["val"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--train-limit", type=int, default=20000,
                        help="Fashion-MNIST's training images (the quick profile's)")
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--warm-epochs", type=int, default=8,
                        help="the teacher's warm start; 0: none, the bank starts empty")
    parser.add_argument("--min-steps", type=int, default=3000)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    results, rows = [], []
    for name in args.sets:
        runs = [run_seed(name, seed, args, device) for seed in args.seeds]
        entry = {"set": name, "runs": runs, **summarize(runs, args.variants)}
        results.append(entry)
        for variant, figures in entry["variants"].items():
            gap = figures.get("gap_closed_unread")
            rows.append([name, variant, *(f"{figures[s][0]:.4f} ± {figures[s][1]:.4f}"
                                          for s in SPLITS),
                         "-" if gap is None else f"{gap:+.2f}"])
    print_table(["set", "variant", "validation", "test", "unread", "gap closed (unread)"], rows)
    print_json({"benchmark": "distill_bank", "device": str(device), "seeds": args.seeds,
                "augment": AUGMENT, "stages": args.stages, "warm_epochs": args.warm_epochs,
                "train_limit": args.train_limit, "min_steps": args.min_steps,
                "results": results})


if __name__ == "__main__":
    main()
