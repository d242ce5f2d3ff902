"""A stop asked of every training loop in this process.

A flow stopped by SIGTERM or Ctrl-C ends in its main thread, but its rounds train in a task
runner's worker thread, which the interpreter waits for before it exits: left alone, the
process would live on until the round's last batch. The flow's tracked run asks for a stop
(`request_stop`) as the signal passes through it, and the loops call `check_stop` between
batches, so the worker thread ends within a batch. Nothing half-written is left: checkpoints
and banks are written to a temporary name and renamed only when whole.
"""

from __future__ import annotations

import threading

_STOP = threading.Event()


class StopRequested(BaseException):
    """Raised in a training loop once a stop was asked. A BaseException, like
    KeyboardInterrupt: no `except Exception` swallows it, and Prefect marks the task crashed
    instead of retrying it."""


def request_stop() -> None:
    """Asks every training loop of this process to stop at its next batch."""
    _STOP.set()


def clear_stop() -> None:
    """Lets training loops run again (a new run in the same process)."""
    _STOP.clear()


def stop_requested() -> bool:
    """Whether a stop was asked and not cleared."""
    return _STOP.is_set()


def check_stop() -> None:
    """Raises StopRequested where a stop was asked."""
    if _STOP.is_set():
        raise StopRequested("training stopped: the run was interrupted (SIGTERM or Ctrl-C)")
