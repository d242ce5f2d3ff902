"""Images per second of the `train` flow's training step against a bare PyTorch loop.

Both train the same model on the same Fashion-MNIST images with the same batch size, the same
augmentation, schedule and gradient clipping, and both score the validation split after each
epoch. The flow side runs the real round task (a classifier round of one pass, `repeats` 1)
inside a Prefect flow with an MLflow run, metric logging and a checkpoint written, added to DVC
and pushed: everything the `train` flow does per round. The two alternate epoch by epoch in
one process (order swapped every round), so machine noise hits both; the ratio is the median
of the rounds' paired ratios (this machine's speed drifts by 20% between minutes, so pairs
beat pooled means).

Because that drift is larger than the effect, the flow's own cost is also measured directly in
each flow epoch: wall time minus the time the task spent in the training loop and the
validation pass (what the bare loop does too). That is the orchestration, tracking and
versioning cost per epoch; `cost ratio` = bare epoch / (bare epoch + that cost).

    python -m bench.throughput            # quick profile data: ~8 minutes on 2 cores
    python -m bench.throughput --full     # GPU-sized: all 54k images, wider models
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from prefect import flow

from bench.common import mean_std, print_json, print_table
from tasks.adapters import tracking
from tasks.configs.sections import ClassifierConfig, classifier_config
from tasks.configs.train import TrainConfig
from tasks.data import DatasetRef, load_dataset, prepare_dataset, source_version
from tasks.rounds import round_task
from tasks.training import ClassifierRound
from training.batches import eval_batches, split_batches
from training.device import autocast, place_model, resolve_device
from training.loops import cosine_lr, evaluate
from training.recipe import make_optimizer
from training.rounds import new_model

EXPERIMENT = "bench-throughput"


class BareLoop:
    """The plain loop: zero_grad, forward (autocast where the flow uses it), cross-entropy,
    backward, clip, step; then validation. Same schedule and loss settings as the flow."""

    def __init__(self, config: ClassifierConfig, dataset: DatasetRef) -> None:
        self.config, self.dataset = config, dataset
        self.device = resolve_device(config.run.device)
        self.data = load_dataset(dataset)
        self.model = place_model(new_model(config, dataset), self.device)
        self.optimizer = make_optimizer(self.model, config)

    def epoch(self, epoch: int) -> float:
        """Trains one epoch and scores validation; returns training images per second."""
        config = self.config
        batches = split_batches(self.data, self.dataset, "train", config.optim.batch_size,
                                self.device, shuffle=True, seed=config.run.seed * 1000 + epoch,
                                augment=config.optim.augment)
        total = config.rounds * len(batches)
        warmup = round(config.optim.warmup_rounds * len(batches))
        started = time.perf_counter()
        self.model.train()
        for index, (_, x, y) in enumerate(batches):
            for group in self.optimizer.param_groups:
                group["lr"] = cosine_lr(config.optim.lr, epoch * len(batches) + index, total,
                                        warmup)
            self.optimizer.zero_grad(set_to_none=True)
            with autocast(self.device):
                loss = torch.nn.functional.cross_entropy(
                    self.model(x), y, label_smoothing=config.optim.label_smoothing)
            loss.backward()
            if config.optim.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.optim.grad_clip)
            self.optimizer.step()
        evaluate(self.model, eval_batches(self.data, self.dataset, "val", self.device),
                 self.device)
        return len(batches) * config.optim.batch_size / (time.perf_counter() - started)


class FlowSide:
    """The `train` flow's per-round work: the round task plus tracking of its results."""

    def __init__(self, config: ClassifierConfig, dataset: DatasetRef, run_id: str) -> None:
        self.config, self.dataset, self.run_id = config, dataset, run_id
        self.task = round_task.with_options(refresh_cache=True)
        self.previous = None
        self.fixed_costs: list[float] = []

    def epoch(self, epoch: int) -> float:
        """Runs one round task and logs it; returns training images per second."""
        started = time.perf_counter()
        result = self.task(ClassifierRound(config=self.config, dataset=self.dataset,
                                           round=epoch, run_name=EXPERIMENT), self.previous)
        tracking.log_metrics(self.run_id, result.metrics, step=epoch + 1)
        tracking.log_artifact_refs(self.run_id, {f"checkpoint.round-{epoch + 1:03d}":
                                                 result.checkpoint})
        self.previous = result.checkpoint
        wall = time.perf_counter() - started
        self.fixed_costs.append(wall - result.metrics["train_seconds"]
                                - result.metrics["val_seconds"])
        batch = self.config.optim.batch_size
        trained = self.dataset.sizes["train"] // batch * batch
        return trained / wall


@flow(name=EXPERIMENT)
def measure(model_names: list[str], rounds: int, full: bool) -> list[dict]:
    """Alternates bare and flow epochs for each model; returns their rates and ratio."""
    results = []
    for name in model_names:
        config = TrainConfig(profile="full" if full else "quick", model=name, rounds=rounds + 1,
                             progress=False)
        data_cfg = config.dataset
        dataset = prepare_dataset(data_cfg, source_version(data_cfg))
        classifier = classifier_config(config)
        rates: dict[str, list[float]] = {"bare": [], "flow": []}
        with tracking.tracked_run(EXPERIMENT, f"throughput-{name}", config) as run_id:
            sides = {"bare": BareLoop(classifier, dataset),
                     "flow": FlowSide(classifier, dataset, run_id)}
            for epoch in range(rounds + 1):  # epoch 0 warms both sides up and is not counted
                for side in (("bare", "flow") if epoch % 2 == 0 else ("flow", "bare")):
                    rate = sides[side].epoch(epoch)
                    if epoch > 0:
                        rates[side].append(rate)
        bare, flow_ = mean_std(rates["bare"]), mean_std(rates["flow"])
        pairs = [f / b for f, b in zip(rates["flow"], rates["bare"], strict=True)]
        images = dataset.sizes["train"] // config.optim.batch_size * config.optim.batch_size
        fixed = statistics.median(sides["flow"].fixed_costs[1:])
        bare_epoch = images / statistics.median(rates["bare"])
        results.append({"model": name, "images": images,
                        "batch_size": config.optim.batch_size, "rounds": rounds,
                        "bare_images_per_s": bare[0], "bare_std": bare[1],
                        "flow_images_per_s": flow_[0], "flow_std": flow_[1],
                        "ratio": statistics.median(pairs), "round_ratios": pairs,
                        "fixed_cost_s_per_epoch": fixed,
                        "cost_ratio": bare_epoch / (bare_epoch + fixed)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="GPU-sized run")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed epochs per side and model (after one warm-up epoch)")
    parser.add_argument("--models", nargs="+", default=["lenet", "resnet18"])
    args = parser.parse_args()
    results = measure(args.models, args.rounds, args.full)
    print_table(["model", "images/epoch", "batch", "bare img/s", "flow img/s",
                 "flow/bare (median)", "per round", "flow's own s/epoch", "cost ratio"],
                [[r["model"], r["images"], r["batch_size"],
                  f"{r['bare_images_per_s']:.0f} ± {r['bare_std']:.0f}",
                  f"{r['flow_images_per_s']:.0f} ± {r['flow_std']:.0f}", f"{r['ratio']:.3f}",
                  " ".join(f"{x:.2f}" for x in r["round_ratios"]),
                  f"{r['fixed_cost_s_per_epoch']:.2f}", f"{r['cost_ratio']:.3f}"]
                 for r in results])
    print_json({"benchmark": "throughput", "device": str(resolve_device("auto")),
                "results": results, "min_ratio": min(r["ratio"] for r in results)})


if __name__ == "__main__":
    main()
