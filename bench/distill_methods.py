"""The distillation methods on the pure training code alone (no Prefect, MLflow or DVC).

For machines that have an accelerator but not the pipeline's packages (the GPU check): the
`distill` flow's method, called from `training/` directly (`training.distill.stages`: the
stages' recency queues replayed from the seed, the teacher's features for the bank, one stage
of training on the cosine schedule spanning all stages), with bf16 autocast and channels_last
where the device gains from them. Per seed it trains the teacher in S stages, filling one bank
of features per bank layer (bank s kept for student stage s), then the student with each
method on the same stage images. Every method's test accuracy, per seed.

The defaults are the flow's (`DistillConfig`): teacher resnet18, student lenet, 10 stages
drawing 80% of the training images each, batch 128, learning rate 0.05, and each role's batch
and passes per stage fitted to the data set by `training.budget.fit_budget` (at least 3,000
optimizer steps up to 4,096 training images, in proportion fewer above, at most 400
passes). On the default 20,000 images that is batch 128 and one pass per stage.

    python bench/distill_methods.py --data data/fashion-mnist --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model  # noqa: E402
from training.batches import Batches, Normalize  # noqa: E402
from training.budget import Budget, fit_budget  # noqa: E402
from training.datasets import (  # noqa: E402
    assign_splits,
    channel_stats,
    limit,
    load_fashion_mnist,
    split_positions,
)
from training.device import place_model, resolve_device  # noqa: E402
from training.distill.feature_bank import FeatureBank  # noqa: E402
from training.distill.losses import (  # noqa: E402
    FeatureAdapter,
    FeatureLoss,
    bank_targets,
    distillation_step,
    layer_shape,
    teacher_targets,
)
from training.distill.stages import Role, draw_stage_ids, layer_features, train_stage  # noqa: E402
from training.features import FeatureHooks  # noqa: E402
from training.loops import Step, classification_step, evaluate  # noqa: E402
from training.recipe import sgd, train_round  # noqa: E402

# method -> (target source, teacher layer, student layer, loss, feature weight, CE weight)
METHODS = {
    "a: alone": None,
    "b: KD (final teacher, T=4)": ("teacher", "fc", "fc", "kl", 0.5, 0.5),
    "c: FitNets (final teacher, pool, l2)": ("teacher", "pool", "pool", "l2", 1.0, 1.0),
    "d: bank logits, kl": ("bank", "fc", "fc", "kl", 0.5, 0.5),
    "d: bank pool, cosine": ("bank", "pool", "pool", "cosine", 1.0, 1.0),
    "d: bank pool, l2": ("bank", "pool", "pool", "l2", 1.0, 1.0),
    "b: KD (final teacher, T=4, weight 0.9)": ("teacher", "fc", "fc", "kl", 0.9, 0.1),
    "d: bank logits, kl, weight 0.2": ("bank", "fc", "fc", "kl", 0.2, 0.8),
    "d: bank pool, l2, weight 4": ("bank", "pool", "pool", "l2", 4.0, 1.0),
    "d: bank stage3 map, l2": ("bank", "stage3", "block2", "l2", 1.0, 1.0),
    "d: bank stage3 map, cosine": ("bank", "stage3", "block2", "cosine", 1.0, 1.0),
    "b: DKD (final teacher, beta 8, T=4)": ("teacher", "fc", "fc", "dkd", 1.0, 1.0),
    "d: bank logits, dkd": ("bank", "fc", "fc", "dkd", 1.0, 1.0),
    "c: L2 on the final teacher's logits": ("teacher", "fc", "fc", "l2", 1.0, 1.0),
    "d: bank logits, l2": ("bank", "fc", "fc", "l2", 1.0, 1.0),
}

# The flow's defaults (`DistillConfig`) for what this benchmark does not vary.
FRONT_WEIGHT, BACK_WEIGHT = 2.0, 1.0
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4
AUGMENT, GRAD_CLIP, WARMUP_EPOCHS = 0.5, 5.0, 0.0
EVAL_BATCH = 2048

Data = tuple[Tensor, Tensor, Normalize]


@dataclass(frozen=True)
class Seeded:
    """What one seed's teacher and students share: the data, each role's budget and stage
    draws, the validation batches scored after every stage."""

    data: Data
    train_ids: Tensor
    val: Batches
    budgets: dict[Role, Budget]
    draws: dict[Role, list[Tensor]]
    lr: float
    seed: int
    device: torch.device


def optional_int(value: str) -> int | None:
    """An integer, or `none`."""
    return None if value.lower() == "none" else int(value)


def classes(run: Seeded) -> int:
    """The number of classes of the run's labels."""
    return int(run.data[1].max()) + 1


def optimizer(modules: list[nn.Module], lr: float) -> torch.optim.SGD:
    """The flow's optimizer (`training.recipe.sgd`) over `modules`."""
    return sgd([p for module in modules for p in module.parameters()], lr, MOMENTUM,
               WEIGHT_DECAY)


def stage_batches(run: Seeded, role: Role, stage: int) -> Batches:
    """Shuffled, augmented batches over `role`'s images at `stage` (1-based), seeded as the
    flow's (`seed * 1000 + stage`); a short last batch is dropped."""
    images, labels, normalize = run.data
    return Batches(images, labels, run.draws[role][stage - 1], run.budgets[role].batch_size,
                   normalize, shuffle=True, seed=run.seed * 1000 + stage, augment=AUGMENT,
                   drop_last=True, device=run.device)


def train_role_stages(run: Seeded, role: Role, model: nn.Module,
                      optimizer: torch.optim.Optimizer, step_at: Callable[[int], Step],
                      after_stage: Callable[[int], None] | None = None) -> None:
    """`role`'s stages in turn (`train_stage`), stage s with the loss `step_at(s)`;
    `after_stage(s)` runs after stage s (the teacher fills its banks there)."""
    stages = len(run.draws[role])
    for stage in range(1, stages + 1):
        train_stage(model, optimizer, stage_batches(run, role, stage), run.val, step_at(stage),
                    run.device, stage, stages, run.budgets[role].repeats, run.lr,
                    WARMUP_EPOCHS, GRAD_CLIP)
        if after_stage is not None:
            after_stage(stage)


def warm_up(run: Seeded, teacher: nn.Module, budget: Budget) -> None:
    """The flow's `--teacher-pretrain-epochs`: CE on every training image for the budget's
    rounds, on a cosine schedule of its own, before stage 1."""
    images, labels, normalize = run.data
    passes = budget.rounds * budget.repeats

    def batches_for(epoch: int) -> Batches:
        return Batches(images, labels, run.train_ids, budget.batch_size, normalize,
                       shuffle=True, seed=run.seed * 1000 - 1 - epoch, augment=AUGMENT,
                       drop_last=True, device=run.device)

    train_round(teacher, optimizer([teacher], run.lr), batches_for, classification_step(),
                run.device, range(passes), run.lr, (0, passes), WARMUP_EPOCHS, GRAD_CLIP)


def train_teacher(run: Seeded, name: str, bank_layers: list[str], example: Tensor,
                  warm: Budget | None = None
                  ) -> tuple[nn.Module, list[dict[str, FeatureBank]]]:
    """The teacher trained in stages with CE, and the banks: entry `s` holds, per layer, the
    bank as teacher stage s left it (its images' features rewritten), entry 0 the initial bank:
    empty, or with a `warm` budget filled by the warmed-up teacher (`warm_up`), its state 0
    (the flow's `--initial-bank teacher`)."""
    torch.manual_seed(run.seed)
    teacher = place_model(build_model(name, run.data[0].shape[1], classes(run)), run.device)
    banks = {layer: FeatureBank(run.train_ids,
                                layer_shape(teacher, layer, example)).to(run.device)
             for layer in bank_layers}
    snapshots: list[dict[str, FeatureBank]] = []

    def fill_banks(stage: int, ids: Tensor | None = None) -> None:
        images, labels, normalize = run.data
        ids = run.draws["teacher"][stage - 1] if ids is None else ids
        for layer, bank in banks.items():
            bank.update(ids, layer_features(teacher, layer, Batches(
                images, labels, ids, EVAL_BATCH, normalize, device=run.device), run.device),
                stage)
        keep()

    def keep() -> None:
        snapshots.append({layer: FeatureBank.from_state_dict(
            {k: v.clone() for k, v in bank.state_dict().items()})
            for layer, bank in banks.items()})

    if warm is not None:
        warm_up(run, teacher, warm)
        fill_banks(0, run.train_ids)
    else:
        keep()
    train_role_stages(run, "teacher", teacher, optimizer([teacher], run.lr),
               lambda _: classification_step(), fill_banks)
    return teacher, snapshots


def train_student(run: Seeded, name: str, spec: tuple | None, teacher: nn.Module,
                  snapshots: list[dict[str, FeatureBank]], example: Tensor) -> nn.Module:
    """The student trained in stages with `spec`'s method: CE alone (`None`), or CE plus a
    feature loss against the final teacher (`teacher`) or, at stage s, bank s (`bank`)."""
    torch.manual_seed(run.seed)
    student = place_model(build_model(name, run.data[0].shape[1], classes(run)), run.device)
    if spec is None:
        train_role_stages(run, "student", student, optimizer([student], run.lr),
                   lambda _: classification_step())
        return student
    source, t_layer, s_layer, kind, weight, ce = spec
    adapter = FeatureAdapter(layer_shape(student, s_layer, example),
                             layer_shape(teacher, t_layer, example)).to(run.device)
    loss = FeatureLoss(kind)
    final = teacher_targets(teacher, t_layer) if source == "teacher" else None  # hooked once
    with FeatureHooks(student, [s_layer]) as hooks:
        def step_at(stage: int) -> Step:
            targets = final if final is not None else bank_targets(
                snapshots[stage][t_layer], run.device)
            return distillation_step(hooks, s_layer, adapter, targets, loss, ce, weight)

        train_role_stages(run, "student", student, optimizer([student, adapter], run.lr), step_at)
    return student


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="folder holding FashionMNIST/raw")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-limit", type=int, default=20000)
    parser.add_argument("--val-limit", type=optional_int, default=None,
                        help="validation images scored after every stage (default: all 6,000)")
    parser.add_argument("--test-limit", type=optional_int, default=None,
                        help="test images (default: all 10,000)")
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.8,
                        help="share of the training images each role draws per stage")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--min-steps", type=optional_int, default=3000,
                        help="fit_budget's min_steps per role; none: the batch and one pass")
    parser.add_argument("--min-steps-full-below", type=optional_int, default=4096,
                        help="fit_budget's full_below")
    parser.add_argument("--max-epochs", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--teacher", default="resnet18")
    parser.add_argument("--student", default="lenet")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    args = parser.parse_args()
    device = resolve_device(args.device)
    train, test = load_fashion_mnist(args.data, True), load_fashion_mnist(args.data, False)
    images = torch.cat([train.images, test.images])
    labels = torch.cat([train.labels, test.labels])
    # the flows' splits (split seed 0, 10% validation, the official test file), then limits
    splits = assign_splits(train.keys + test.keys, 0.1, 0.0, 0, train_limit=args.train_limit,
                           test_limit=args.test_limit)
    train_ids = split_positions(splits, "train")
    val_ids = limit(split_positions(splits, "val"), args.val_limit, 1)
    test_ids = split_positions(splits, "test")
    normalize = Normalize(*channel_stats(images[train_ids]))
    data = (images.to(device), labels.to(device), normalize)
    val_batches = Batches(data[0], data[1], val_ids, EVAL_BATCH, normalize, device=device)
    test_batches = Batches(data[0], data[1], test_ids, EVAL_BATCH, normalize, device=device)
    roles: tuple[Role, ...] = ("teacher", "student")
    budgets = {role: fit_budget(len(train_ids), args.batch_size, args.stages, args.min_steps,
                                args.max_epochs, round(args.fraction * len(train_ids)),
                                args.min_steps_full_below)
               for role in roles}
    example = data[0][train_ids[:1]].float()
    bank_layers = sorted({METHODS[m][1] for m in args.methods
                          if METHODS[m] and METHODS[m][0] == "bank"})
    results: dict[str, list[float]] = {m: [] for m in ["teacher", *args.methods]}
    seconds: dict[str, float] = {}
    for seed in args.seeds:
        draws = {role: [draw_stage_ids(train_ids, stage, role, seed, args.fraction,
                                       FRONT_WEIGHT, BACK_WEIGHT)
                        for stage in range(1, args.stages + 1)] for role in roles}
        run = Seeded(data, train_ids, val_batches, budgets, draws, args.lr, seed, device)
        started = time.perf_counter()
        teacher, snapshots = train_teacher(run, args.teacher, bank_layers, example)
        seconds["teacher"] = time.perf_counter() - started
        results["teacher"].append(evaluate(teacher, test_batches, device)["accuracy"])
        for method in args.methods:
            started = time.perf_counter()
            student = train_student(run, args.student, METHODS[method], teacher, snapshots,
                                    example)
            results[method].append(evaluate(student, test_batches, device)["accuracy"])
            seconds[method] = time.perf_counter() - started
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in results.items()),
              flush=True)
    alone = statistics.fmean(results.get("a: alone", [float("nan")]))
    teacher_mean = statistics.fmean(results["teacher"])
    print(f"\ndevice {device}, {len(train_ids)} training images, {args.stages} stages, "
          + ", ".join(f"{role} batch {b.batch_size} x {b.repeats} passes/stage"
                      for role, b in budgets.items()))
    for method, values in results.items():
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        gap = (mean - alone) / (teacher_mean - alone) if method != "teacher" else 1.0
        print(f"{method:40s} {mean:.4f} ± {std:.4f}  gap closed {gap:+.2f}  "
              f"{' / '.join(f'{v:.4f}' for v in values)}  {seconds.get(method, 0):.0f} s/seed")
    print(json.dumps({"benchmark": "distill_methods", "device": str(device), "results": results,
                      "seconds_last_seed": seconds,
                      "budgets": {role: asdict(b) for role, b in budgets.items()},
                      "args": {k: str(v) for k, v in vars(args).items()}}))


if __name__ == "__main__":
    main()
