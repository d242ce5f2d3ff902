"""A Dask worker preload: a worker whose event loop stops dumps the stack of every thread.

A worker's event loop sends its heartbeats. When it stops for minutes (the GIL held, a lock
never released), the scheduler restarts the worker once `distributed.scheduler.worker-ttl`
passes and its tasks run again from their inputs: the run ends whole but late, and nothing says
where the worker was stuck (a `pbt` run lost 506 s so, docs/pbt.md). Every local worker
(`tasks.adapters.runners.task_runner`) loads this module: its loop re-arms `faulthandler`'s
timer every few seconds, so a loop stuck for `COMPACTML_STALL_SECONDS` (default 60; Dask
itself warns at 3) gets every thread's Python stack written to the worker's stderr (the
flow's), again every `COMPACTML_STALL_SECONDS` while it stays stuck. faulthandler writes from
a thread of its own that needs neither the loop nor the GIL, so the dump comes out of a
deadlock too. Nothing is stopped or killed.
"""

from __future__ import annotations

import faulthandler
import sys

from tornado.ioloop import PeriodicCallback

from tasks.environment import seconds_setting

MODULE = __name__  # what `distributed.worker.preload` names
_rearming: list[PeriodicCallback] = []  # this worker process's callback


def stall_seconds() -> float:
    """How long a worker's loop may stop before its stacks are dumped (a ValueError names a
    value that is not a positive number)."""
    return seconds_setting("COMPACTML_STALL_SECONDS", 60)


def dask_setup(worker: object) -> None:
    """Arms the dump and re-arms it from the worker's loop (run on that loop at its start)."""
    seconds = stall_seconds()

    def rearm() -> None:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)

    rearm()
    callback = PeriodicCallback(rearm, 1000 * min(5.0, seconds / 4))
    callback.start()
    _rearming.append(callback)


def dask_teardown(worker: object) -> None:
    """Disarms the dump as the worker closes."""
    for callback in _rearming:
        callback.stop()
    _rearming.clear()
    faulthandler.cancel_dump_traceback_later()
