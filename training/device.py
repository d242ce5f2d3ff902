"""One setting picks the device; bf16 autocast and channels_last where the device gains."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Iterator

import torch
from torch import nn

from training.settings import RunsSettings

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Makes glibc keep freed blocks for reuse: large blocks (one batch's maps of `lenet` at
    width 64 are 25 MB) otherwise come from mmap and go back to the kernel when freed, so
    every step faults them in again, page by page: 18,000 page faults a training step, 15%
    of the CPU time in the kernel in one process and 42% in two Dask workers side by side.
    With the mmap threshold at its maximum and trimming above 1 GB only, the same 20 steps
    take 0.82x the time (`python -m bench.allocator`). Process-wide, done once a process
    (cached); called by `resolve_device` (every training task, Dask worker and DDP process)
    and by served models as they load; returns whether it applied (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl): its allocator has no such knobs
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` takes cuda, then mps, then cpu; an explicit name must be available. (Sets the
    process's allocator up for training first: `keep_freed_memory`.)"""
    keep_freed_memory()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no CUDA device is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but MPS is not available")
    return device


def uses_bf16(device: torch.device) -> bool:
    """bf16 autocast pays on CUDA GPUs that support it; on CPU it is slower, so off."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a device that gains from it, else a no-op context."""
    if uses_bf16(device):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def inference_batch(device: torch.device) -> int:
    """Images per forward pass when scoring or predicting without gradients: 1024 on an
    accelerator; 256 on the CPU, where 1024 images' maps outgrow the caches: a scoring pass at
    256 runs 1.0-1.3x as fast as at 1024, never slower beyond noise (`python -m
    bench.inference_batch`)."""
    return 256 if device.type == "cpu" else 1024


def fast_layout(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` for inference, its 4-d weights in channels_last memory format on the CPU and
    CUDA, where convolutions and pooling without gradients run faster in it (2-core x86 CPU,
    one thread: a `lenet` forward at batch 64 in 0.3x the plain layout's time, `resnet18` 0.9x;
    `python -m bench.layout`); the activations follow the weights' layout. The same numbers to
    float rounding. MPS keeps the plain layout."""
    if device.type in ("cpu", "cuda"):
        model = model.to(memory_format=torch.channels_last)
    return model


@contextlib.contextmanager
def inference_layout(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """`model` in the fast layout (`fast_layout`) for forward passes without gradients within
    the block, and back in its own layout after: a network that trains on the CPU in the plain
    layout (`place_model`) scores its validation split in channels_last (`lenet` at width 64:
    0.5x the time of a scoring pass in the plain layout; the same numbers to float rounding).
    In place: the parameters stay the same objects (an optimizer holding them goes on), their
    data is converted there and back. A no-op where the weights already are in channels_last
    (CUDA) and on devices `fast_layout` leaves alone."""
    weights = [p for p in model.parameters() if p.dim() == 4]
    if device.type != "cpu" or not weights or not all(p.is_contiguous() for p in weights):
        yield model
        return
    fast_layout(model, device)
    try:
        yield model
    finally:
        model.to(memory_format=torch.contiguous_format)


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Moves a model to `device` for training: channels_last on CUDA, the plain layout on the
    CPU. (On the CPU a training step is 0.6-0.75x as long in channels_last, but torch 2.14's CPU
    backward of a strided 1x1 convolution of few channels in that layout corrupts the heap:
    `resnet18`'s shortcuts at width 8 abort the process with `corrupted size vs. prev_size`
    within a few steps under MALLOC_CHECK_=3. Forward passes are exact, and serving uses them.)"""
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def setup_device(config: RunsSettings) -> torch.device:
    """Applies the config's thread count and resolves its device (every training task's
    first line)."""
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    return resolve_device(config.run.device)
