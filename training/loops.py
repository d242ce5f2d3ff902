"""Train and evaluation loops over any step that returns a named dict of losses.

A step maps `(model, ids, images, labels)` (ids: the images' dataset ids) to a dict of scalar
tensors whose key `loss` is minimised; every key becomes a metric under the same name (`loss`,
`loss_ce`, ...).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from training.device import autocast
from training.distributed import sum_over_processes
from training.stopping import check_stop

Step = Callable[[nn.Module, Tensor, Tensor, Tensor], dict[str, Tensor]]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite: training stops rather than writing a broken model."""


def classification_step(label_smoothing: float = 0.0) -> Step:
    """Cross-entropy on the labels: `loss = loss_ce = CE(model(x), y)`."""

    def step(model: nn.Module, _ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        ce = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
        return {"loss": ce, "loss_ce": ce}

    return step


def cosine_lr(base_lr: float, step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """Linear warm-up to `base_lr`, then cosine decay to 0 at `total_steps`.

    A pure function of the step, so a resumed run gets the configured rate, never a stored one.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[Tensor, Tensor, Tensor]],
    step: Step,
    device: torch.device,
    lr_at: Callable[[int], float] | None = None,
    first_step: int = 0,
    grad_clip: float | None = None,
    progress: str | None = None,
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """One pass over `batches`; returns each loss key's mean over the images seen (by every
    process, under data-parallel training).

    Args:
        lr_at: learning rate for a global step number, set before each step when given.
        first_step: global step number of this epoch's first batch.
        grad_clip: clip the gradients' total norm to this value.
        progress: a label for a progress bar (batches, running loss) on a terminal (stderr a
            TTY); `None` hides it.
        after_step: called after every optimizer step (e.g. to update a weight average).

    Raises:
        NonFiniteLossError: the loss is NaN or infinite at some batch.
        StopRequested: the run was interrupted (`training.stopping`).
    """
    model.train()
    sums: dict[str, Tensor] = {}
    seen = 0
    # a bar only on a terminal: in a log file or CI each round's one line says enough (a bar
    # per epoch wrote a line of `0/13 batch` per epoch there)
    bar = tqdm(batches, desc=progress, leave=False, unit="batch", mininterval=0.5,
               disable=progress is None or not sys.stderr.isatty())
    for index, (ids, x, y) in enumerate(bar):
        check_stop()
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(first_step + index)
        with autocast(device):
            losses = step(model, ids, x, y)
        loss = losses["loss"]
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"loss is {loss.item()} at batch {index} (lr {optimizer.param_groups[0]['lr']:.4g})"
                ": lower the learning rate or set grad_clip"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step()
        n = len(y)
        seen += n
        for key, value in losses.items():
            sums[key] = sums.get(key, 0.0) + value.detach().float() * n
        if index % 20 == 0 and progress is not None:
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    keys = sorted(sums)
    totals = sum_over_processes(torch.stack([*(sums[k] for k in keys),
                                             torch.tensor(float(seen), device=device)]))
    return {key: (totals[i] / max(totals[-1].item(), 1)).item() for i, key in enumerate(keys)}


def weight_average(model: nn.Module, decay: float, state: dict | None = None
                   ) -> AveragedModel:
    """An exponential moving average of `model`'s weights and buffers (PyTorch's
    `AveragedModel` with its EMA rule: `average = decay * average + (1 - decay) * weights`);
    call `update_parameters(model)` after every step. `state` (an averaged module's state
    dict, as stored in a checkpoint) continues an earlier average; without it the first update
    copies the model."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"average decay must be in (0, 1), got {decay}")
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    if state is not None:
        averaged.module.load_state_dict(state)
        averaged.n_averaged.fill_(1)  # the next update blends into `state`, not over it
    return averaged


@torch.no_grad()
def predict(
    model: nn.Module, batches: Iterable[tuple[Tensor, Tensor, Tensor]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Logits (float32, on the CPU) and labels for every batch, in order."""
    model.eval()
    logits, labels = [], []
    for _, x, y in batches:
        with autocast(device):
            out = model(x)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    return torch.cat(logits), torch.cat(labels)


def evaluate(
    model: nn.Module, batches: Iterable[tuple[Tensor, Tensor, Tensor]], device: torch.device
) -> dict[str, float]:
    """`accuracy` (fraction correct) and mean cross-entropy `loss` over the batches."""
    logits, labels = predict(model, batches, device)
    return {
        "accuracy": (logits.argmax(1) == labels).float().mean().item(),
        "loss": F.cross_entropy(logits, labels).item(),
    }
