"""The one train-and-validate recipe that every flow and benchmark calls.

A run is `rounds` rounds of `repeats` passes each (`training.budget`): a round trains its passes
on one cosine schedule that spans the whole run, then scores the validation split once. Where a
weight average is kept, both the last weights and the average are scored and the better one is
the round's result (`choose_weights`), so an average never makes a model worse. Early stopping
(`EarlyStopping`) and PBT's choice look at these round scores.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from training.device import inference_layout
from training.loops import Step, cosine_lr, evaluate, train_epoch, weight_average
from training.scores import standard_error
from training.settings import OptimizedSettings

Batches = Iterable[tuple[Tensor, Tensor, Tensor]]


def sgd(params: Iterable[nn.Parameter], lr: float, momentum: float, weight_decay: float
        ) -> torch.optim.SGD:
    """The optimizer of every flow: SGD, with Nesterov momentum when there is momentum (the
    learning rate is set at every step from the schedule)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           nesterov=momentum > 0)


def set_momentum_and_decay(optimizer: torch.optim.Optimizer, momentum: float,
                           weight_decay: float) -> None:
    """Gives a restored optimizer these values instead of the stored ones: a resumed run, or a
    PBT member starting from another's state, trains with its own hyperparameters."""
    for group in optimizer.param_groups:
        group.update(momentum=momentum, weight_decay=weight_decay, nesterov=momentum > 0)


def optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Moves the optimizer's state (momentum buffers) to the model's device."""
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value):
                state[name] = value.to(device)


def start_average(model: nn.Module, decay: float, state: dict | None) -> AveragedModel:
    """A weight average of `model` (`training.loops.weight_average`) that continues `state`
    (an average stored in a checkpoint), or starts from `model`'s current weights."""
    averaged = weight_average(model, decay, state)
    if state is None:
        averaged.update_parameters(model)  # the first update copies the weights
    return averaged


def train_round(model: nn.Module, optimizer: torch.optim.Optimizer,
                batches_for: Callable[[int], Batches], step: Step, device: torch.device,
                passes: Sequence[int], lr: float, schedule: tuple[int, int],
                warmup_epochs: float = 0.0, grad_clip: float | None = None,
                progress: str | None = None, averaged: AveragedModel | None = None
                ) -> dict[str, float]:
    """One round: trains the passes over the data numbered `passes` (counted over the whole run)
    and returns the last pass's losses.

    The learning rate follows `cosine_lr(lr, ...)` from pass `schedule[0]` (the peak, after
    `warmup_epochs` passes of linear warm-up) to zero at pass `schedule[1]`, so consecutive
    rounds of one run share one schedule. `batches_for(epoch)` gives pass `epoch`'s (shuffled,
    augmented) batches; `averaged`, when given, is updated after every optimizer step.
    """
    start_epoch, end_epoch = schedule
    metrics: dict[str, float] = {}
    for epoch in passes:
        batches = batches_for(epoch)
        per_epoch = len(batches)
        start, total = start_epoch * per_epoch, (end_epoch - start_epoch) * per_epoch
        warmup = round(warmup_epochs * per_epoch)
        metrics = train_epoch(
            model, optimizer, batches, step, device,
            lr_at=lambda n, start=start, total=total, warmup=warmup: cosine_lr(
                lr, n - start, total, warmup),
            first_step=epoch * per_epoch, grad_clip=grad_clip,
            progress=None if progress is None else f"{progress} epoch {epoch + 1}",
            after_step=None if averaged is None else lambda: averaged.update_parameters(model))
    return metrics | {"lr": optimizer.param_groups[0]["lr"]}


@torch.no_grad()
def recompute_batchnorm(model: nn.Module, batches: Batches, max_batches: int = 50) -> bool:
    """Re-estimates every BatchNorm layer's running statistics for `model`'s own weights
    (PyTorch's `update_bn`: a cumulative average over up to `max_batches` batches in training
    mode). Weight-averaged models need it: the average of the running statistics of many
    weights is not the statistics of the averaged weights. Returns whether there was any."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return False
    momenta = {norm: norm.momentum for norm in norms}
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the batches
    was_training = model.training
    model.train()
    for index, (_, x, _) in enumerate(batches):
        if index >= max_batches:
            break
        model(x)
    for norm, momentum in momenta.items():
        norm.momentum = momentum
    model.train(was_training)
    return True


@dataclass
class Choice:
    """The weights a round keeps: `source` is `model` (the last weights) or `averaged`."""

    source: str
    module: nn.Module
    metrics: dict[str, float]


def choose_weights(model: nn.Module, averaged: AveragedModel | None, val: Batches,
                   train: Batches, device: torch.device) -> Choice:
    """Scores the last weights and, when there is one, the weight average (its BatchNorm
    statistics re-estimated on `train`) on the validation batches, in the fast layout
    (`training.device.inference_layout`); keeps the more accurate (the last weights on a
    tie). The average itself is left untouched, so it goes on averaging; the returned module
    is a copy of it."""
    with inference_layout(model, device):
        own = evaluate(model, val, device)
    choice = Choice("model", model, own)
    if averaged is not None:
        candidate = copy.deepcopy(averaged.module)
        recompute_batchnorm(candidate, train)
        with inference_layout(candidate, device):
            scored = evaluate(candidate, val, device)
        if scored["accuracy"] > own["accuracy"]:
            choice = Choice("averaged", candidate, scored)
    choice.metrics = {"val_accuracy": choice.metrics["accuracy"],
                      "val_loss": choice.metrics["loss"],
                      "val_accuracy_last": own["accuracy"],
                      "val_averaged": float(choice.source == "averaged")}
    return choice


class EarlyStopping:
    """Early stopping on the validation accuracy of each round, and the round to keep.

    A round counts as no worse when its score reaches the best so far (ties count: with a
    cosine schedule the later weights are the better trained); `patience` rounds in a row
    below the best stop the run (`None`: never). The round kept is the latest one within one
    standard error of the best score at its time, `sqrt(best * (1 - best) / val_images)`: on a
    validation split of a hundred images, accuracy moves by several points between rounds by
    chance, and an early round that led by chance would otherwise be kept over the fully
    trained one.
    """

    def __init__(self, patience: int | None, val_images: int | None = None) -> None:
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be at least 1 or None, got {patience}")
        self.patience = patience
        self.val_images = val_images
        self.best_score: float | None = None
        self.kept_round: int | None = None
        self.stale = 0

    def tolerance(self) -> float:
        """One standard error of the best score on `val_images` images (0 if unknown)."""
        if not self.val_images or self.best_score is None:
            return 0.0
        return standard_error(self.best_score, self.val_images)

    def update(self, round_index: int, score: float) -> bool:
        """Records a round's score; returns whether this round is now the one to keep."""
        if self.best_score is None or score >= self.best_score:
            self.best_score, self.stale = score, 0
        else:
            self.stale += 1
        if score >= self.best_score - self.tolerance():
            self.kept_round = round_index
            return True
        return False

    @property
    def should_stop(self) -> bool:
        """Whether `patience` rounds in a row scored below the best."""
        return self.patience is not None and self.stale >= self.patience


def make_optimizer(model: nn.Module, config: OptimizedSettings) -> torch.optim.SGD:
    """SGD with the config's momentum and weight decay (`training.recipe.sgd`)."""
    optim = config.optim
    return sgd(model.parameters(), optim.lr, optim.momentum, optim.weight_decay)


def restore(model: nn.Module, optimizer: torch.optim.Optimizer | None,
            checkpoint: dict, config: OptimizedSettings | None = None) -> None:
    """Loads weights (and optimizer state) from a checkpoint payload.

    With `config`, the optimizer keeps the configured momentum and weight decay, not the
    stored ones (the learning rate is set at every step from the schedule): a resumed run, or
    a PBT member starting from another's checkpoint, trains with its own hyperparameters.
    """
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None and "optimizer" in checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        if config is not None:
            set_momentum_and_decay(optimizer, config.optim.momentum, config.optim.weight_decay)
