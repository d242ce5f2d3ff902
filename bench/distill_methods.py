"""The distillation methods on the pure training code alone (no Prefect, MLflow or DVC).

For machines that have an accelerator but not the pipeline's packages (the GPU check): the same
teacher stages, recency queues, feature banks, losses and loops as the `distill` flow, called
directly, with bf16 autocast and channels_last where the device gains from them. Per seed it
trains the teacher in S stages, filling one bank of pooled features and one of logits, then
the student with each method on the same stage images. Every method's test accuracy, per seed.

    python bench/distill_methods.py --data data/fashion-mnist --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model  # noqa: E402
from training.batches import Batches, Normalize  # noqa: E402
from training.data_queue import RecencyQueue  # noqa: E402
from training.datasets import channel_stats, limit, load_fashion_mnist, stratified_split  # noqa: E402
from training.device import autocast, place_model, resolve_device  # noqa: E402
from training.distillation import (  # noqa: E402
    FeatureAdapter,
    FeatureLoss,
    bank_targets,
    distillation_step,
    layer_shape,
    teacher_targets,
)
from training.feature_bank import FeatureBank  # noqa: E402
from training.features import FeatureHooks  # noqa: E402
from training.loops import classification_step, cosine_lr, evaluate, train_epoch  # noqa: E402

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
}


def stage_draws(ids: torch.Tensor, fraction: float, stages: int, seed: int) -> list[torch.Tensor]:
    queue = RecencyQueue(ids, 2.0, 1.0)
    generator = torch.Generator().manual_seed(seed)
    count = round(fraction * len(ids))
    return [queue.draw(count, generator) for _ in range(stages)]


def run_stages(model, extra, step, draws, data, args, device, seed) -> None:
    params = list(model.parameters()) + (list(extra.parameters()) if extra else [])
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4,
                                nesterov=True)
    images, labels, normalize = data
    for stage, ids in enumerate(draws):
        batches = Batches(images, labels, ids, args.batch_size, normalize, shuffle=True,
                          seed=seed * 1000 + stage + 1, augment=0.5, drop_last=True,
                          device=device)
        total = len(draws) * len(batches)
        train_epoch(model, optimizer, batches, step, device,
                    lr_at=lambda n, total=total: cosine_lr(args.lr, n, total),
                    first_step=stage * len(batches), grad_clip=5.0)


@torch.no_grad()
def features_of(model, layer, ids, data, device) -> torch.Tensor:
    images, labels, normalize = data
    model.eval()
    out = []
    with FeatureHooks(model, [layer], detach=True) as hooks:
        for _, x, _ in Batches(images, labels, ids, 2048, normalize, device=device):
            with autocast(device):
                model(x)
            out.append(hooks[layer].float())
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="folder holding FashionMNIST/raw")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-limit", type=int, default=20000)
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--teacher", default="resnet18")
    parser.add_argument("--student", default="cnn3")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    args = parser.parse_args()
    device = resolve_device(args.device)
    train, test = load_fashion_mnist(args.data, True), load_fashion_mnist(args.data, False)
    images = torch.cat([train.images, test.images])
    labels = torch.cat([train.labels, test.labels])
    rest, _val = stratified_split(train.labels, 0.1, 0)
    train_ids = limit(rest, args.train_limit, 0)
    test_ids = torch.arange(len(train.labels), len(labels))
    normalize = Normalize(*channel_stats(images[train_ids]))
    data = (images.to(device), labels.to(device), normalize)
    test_batches = Batches(images, labels, test_ids, 2048, normalize, device=device)
    results: dict[str, list[float]] = {m: [] for m in ["teacher", *args.methods]}
    seconds: dict[str, float] = {}
    for seed in args.seeds:
        started = time.perf_counter()
        torch.manual_seed(seed)
        teacher = place_model(build_model(args.teacher, 1, 10), device)
        banks = {layer: FeatureBank(train_ids, layer_shape(
            teacher, layer, data[0][train_ids[:1]].float())).to(device)
            for layer in sorted({METHODS[m][1] for m in args.methods
                                 if METHODS[m] and METHODS[m][0] == "bank"})}
        teacher_draws = stage_draws(train_ids, args.fraction, args.stages, seed * 7 + 1)
        snapshots: list[dict[str, FeatureBank]] = []
        params = list(teacher.parameters())
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4,
                                    nesterov=True)
        for stage, ids in enumerate(teacher_draws):
            batches = Batches(data[0], data[1], ids, args.batch_size, normalize, shuffle=True,
                              seed=seed * 1000 + stage + 1, augment=0.5, drop_last=True,
                              device=device)
            total = args.stages * len(batches)
            train_epoch(teacher, optimizer, batches, classification_step(), device,
                        lr_at=lambda n, total=total: cosine_lr(args.lr, n, total),
                        first_step=stage * len(batches), grad_clip=5.0)
            for layer, bank in banks.items():
                bank.update(ids, features_of(teacher, layer, ids, data, device), stage + 1)
            snapshots.append({layer: FeatureBank.from_state_dict(
                {k: v.clone() for k, v in bank.state_dict().items()})
                for layer, bank in banks.items()})
        seconds["teacher"] = time.perf_counter() - started
        results["teacher"].append(evaluate(teacher, test_batches, device)["accuracy"])
        student_draws = stage_draws(train_ids, args.fraction, args.stages, seed * 7 + 2)
        for method in args.methods:
            started = time.perf_counter()
            torch.manual_seed(seed)
            student = place_model(build_model(args.student, 1, 10), device)
            spec = METHODS[method]
            if spec is None:
                run_stages(student, None, classification_step(), student_draws, data, args,
                           device, seed)
            else:
                source, t_layer, s_layer, kind, weight, ce = spec
                example = data[0][train_ids[:1]].float()
                adapter = FeatureAdapter(layer_shape(student, s_layer, example),
                                         layer_shape(teacher, t_layer, example)).to(device)
                with FeatureHooks(student, [s_layer]) as hooks:
                    if source == "teacher":
                        step = distillation_step(hooks, s_layer, adapter,
                                                 teacher_targets(teacher, t_layer),
                                                 FeatureLoss(kind), ce, weight)
                        run_stages(student, adapter, step, student_draws, data, args, device,
                                   seed)
                    else:  # stage s reads bank s: one stage at a time with its snapshot
                        params = list(student.parameters()) + list(adapter.parameters())
                        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9,
                                                    weight_decay=5e-4, nesterov=True)
                        for stage, ids in enumerate(student_draws):
                            step = distillation_step(
                                hooks, s_layer, adapter,
                                bank_targets(snapshots[stage][t_layer], device),
                                FeatureLoss(kind), ce, weight)
                            batches = Batches(data[0], data[1], ids, args.batch_size,
                                              normalize, shuffle=True,
                                              seed=seed * 1000 + stage + 1, augment=0.5,
                                              drop_last=True, device=device)
                            total = args.stages * len(batches)
                            train_epoch(student, optimizer, batches, step, device,
                                        lr_at=lambda n, total=total: cosine_lr(args.lr, n,
                                                                               total),
                                        first_step=stage * len(batches), grad_clip=5.0)
            results[method].append(evaluate(student, test_batches, device)["accuracy"])
            seconds[method] = time.perf_counter() - started
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in results.items()),
              flush=True)
    alone = statistics.fmean(results.get("a: alone", [float("nan")]))
    teacher_mean = statistics.fmean(results["teacher"])
    print(f"\ndevice {device}, {len(train_ids)} training images, {args.stages} stages")
    for method, values in results.items():
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        gap = (mean - alone) / (teacher_mean - alone) if method != "teacher" else 1.0
        print(f"{method:40s} {mean:.4f} ± {std:.4f}  gap closed {gap:+.2f}  "
              f"{' / '.join(f'{v:.4f}' for v in values)}  {seconds.get(method, 0):.0f} s/seed")
    print(json.dumps({"benchmark": "distill_methods", "device": str(device), "results": results,
                      "seconds_last_seed": seconds, "args": {k: str(v) for k, v in
                                                             vars(args).items()}}))


if __name__ == "__main__":
    main()
