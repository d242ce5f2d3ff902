"""The registry's locks, held in MLflow itself wherever the registry is shared: one alias move
of a registered model at a time (`registry_lock`), and one run training a registered model at a
time (`run_slot`).

A promotion reads the champion, scores both models and moves the alias; two of them
interleaved could both beat the old champion and leave the alias on the worse model, and the
move history (a read-modify-write) could lose an entry. Every alias move (a flow's promotion,
`promote`, `rollback`) holds the lock, so runs on machines that share nothing but the MLflow
server (each with its own Prefect server, or none) still take turns.

The lock is a lease: the registered model's tag `registry.lock` holds a JSON record (a random
token, the holder's host, process and purpose, and an expiry). MLflow offers no
compare-and-swap, so taking it follows Fischer's protocol: read the tag; if it is free or
expired, write our record, wait `SETTLE_SECONDS`, and read it again; we hold the lock only if
our token is still there. Two writers that both found it free both write, and the later write
wins: the earlier one reads the other's token after the wait and backs off (or its write fails
on the store's unique key, when both insert the tag at once, and it reads again). This holds as long
as a writer's read-to-write takes less than the wait (milliseconds against a second here).
While held, a heartbeat thread pushes the expiry forward every third of `LEASE_SECONDS`; a
holder that dies (kill -9, a lost machine) stops renewing, and the lease expires by itself
`LEASE_SECONDS` later. Before it writes, a holder checks the token again (`RegistryLease.check`),
so a holder that stalled past its expiry and lost the lease fails instead of moving the alias.
A lease whose holder ran on this machine and whose process is gone (kill -9) is taken at once;
one held on another machine waits for its expiry. `python -m flows registry unlock NAME` removes
a lease by hand. Expiry compares wall clocks: machines sharing a registry need clocks within a
few seconds of each other.

The run slot is the same lease under another tag (`registry.run`), held by a flow run for its
whole length (`run_slot`): a second run that would register the same model (a CLI run, a
deployment's run, the scheduled pipeline, on any machine) waits for the first to end, as
Prefect's per-deployment limits `ENQUEUE` does within one deployment.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass

from mlflow.exceptions import MlflowException

from tasks.adapters import tracking
from tasks.environment import seconds_setting

LOCK_TAG = "registry.lock"
RUN_TAG = "registry.run"
WAIT_SECONDS = 3600.0  # a promotion scores models on the test split: minutes at most
# a run waits this long for another run of the same model (a pipeline run takes hours at most)
RUN_WAIT_SECONDS = seconds_setting("COMPACTML_RUN_SLOT_WAIT_SECONDS", 24 * 3600)
LEASE_SECONDS = seconds_setting("COMPACTML_REGISTRY_LEASE_SECONDS", 60)
SETTLE_SECONDS = seconds_setting("COMPACTML_REGISTRY_SETTLE_SECONDS", 1.0)
POLL_SECONDS = 0.5


class LockBusy(RuntimeError):
    """Another holder kept the lease for longer than the caller would wait (not a
    `TimeoutError`, which Prefect would report as the flow's own time limit)."""


class LockLost(RuntimeError):
    """The lease was taken over (its holder stalled past its expiry): nothing was moved."""


@dataclass(frozen=True)
class Lease:
    """One holder's record in the `registry.lock` tag."""

    token: str
    owner: str  # host:pid
    purpose: str
    acquired: float  # epoch seconds
    expires: float

    def expired(self, now: float) -> bool:
        return now >= self.expires

    def holder_gone(self) -> bool:
        """Its holder ran on this machine and its process no longer exists."""
        host, _, pid = self.owner.rpartition(":")
        if host != socket.gethostname() or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False

    def free(self, now: float) -> bool:
        """Another holder may take it: expired, or its holder is gone."""
        return self.expired(now) or self.holder_gone()

    def describe(self, now: float | None = None) -> str:
        left = self.expires - (time.time() if now is None else now)
        return (f"held by {self.owner} ({self.purpose}) since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.acquired))}, "
                + (f"expires in {left:.0f} s" if left > 0 else "expired"))


def read_lease(model: str, tag: str = LOCK_TAG) -> Lease | None:
    """The lease under `tag` on registered model `model` (None: free, or no such model)."""
    try:
        raw = tracking.model_tags(model).get(tag)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    if not raw:
        return None
    try:
        return Lease(**json.loads(raw))
    except (TypeError, ValueError):  # unreadable: treat as expired, the next writer replaces it
        return Lease(token="unreadable", owner="unknown", purpose=raw[:60], acquired=0.0,
                     expires=0.0)


def unlock(model: str, tag: str = LOCK_TAG) -> Lease | None:
    """Removes the lease under `tag` on `model` by hand (`flows registry unlock`); returns the
    one removed. Only for a lease whose holder is known to be gone: a live holder then fails
    its next check instead of moving the alias."""
    lease = read_lease(model, tag)
    if lease is not None:
        tracking.delete_model_tag(model, tag)
    return lease


class RegistryLease:
    """Holds `model`'s lock under `tag` (module docstring): `acquire`, `check` before each
    write, `release`."""

    def __init__(self, model: str, purpose: str, lease_seconds: float = LEASE_SECONDS,
                 settle_seconds: float = SETTLE_SECONDS, tag: str = LOCK_TAG) -> None:
        self.model, self.purpose, self.tag = model, purpose, tag
        self.lease_seconds, self.settle_seconds = lease_seconds, settle_seconds
        self.token = secrets.token_hex(8)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._acquired = 0.0
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._renew_error: Exception | None = None

    def _write(self) -> None:
        now = time.time()
        lease = Lease(self.token, self.owner, self.purpose, self._acquired or now,
                      now + self.lease_seconds)
        tracking.set_model_tag(self.model, self.tag, json.dumps(asdict(lease)))

    def _read(self) -> Lease | None:
        return read_lease(self.model, self.tag)

    def acquire(self, wait_seconds: float = WAIT_SECONDS) -> None:
        """Takes the lock, waiting up to `wait_seconds` for its holder (`LockBusy` after,
        naming the holder)."""
        tracking.ensure_registered_model(self.model)
        deadline = time.monotonic() + wait_seconds
        while True:
            current = self._read()
            if current is None or current.free(time.time()):
                self._acquired = 0.0
                try:
                    self._write()
                except MlflowException:  # another writer inserted the tag at the same moment
                    time.sleep(POLL_SECONDS * random.random())  # (a unique-key conflict)
                    continue
                time.sleep(self.settle_seconds)
                confirmed = self._read()
                if confirmed is not None and confirmed.token == self.token:
                    self._acquired = confirmed.acquired
                    self._start_heartbeat()
                    return
                current = confirmed
            if time.monotonic() > deadline:
                held = current.describe() if current else "taken and released repeatedly"
                what = "registry lock" if self.tag == LOCK_TAG else "run slot"
                raise LockBusy(
                    f"the {what} of {self.model!r} is {held}; waited {wait_seconds:.0f} "
                    f"s. If that holder is gone: python -m flows registry unlock {self.model}")
            time.sleep(POLL_SECONDS * (0.5 + random.random()))

    def _start_heartbeat(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.lease_seconds / 3):
                try:
                    current = self._read()
                    if current is None or current.token != self.token:
                        return  # lost: `check` reports it
                    self._write()
                except Exception as error:  # noqa: BLE001 (reported by `check`)
                    self._renew_error = error
                    return

        self._heartbeat = threading.Thread(target=renew, name=f"lease-{self.model}",
                                           daemon=True)
        self._heartbeat.start()

    def check(self) -> None:
        """Raises `LockLost` unless our token still holds the lease (call before a write)."""
        current = self._read()
        if current is None or current.token != self.token:
            taken = f": now {current.describe()}" if current else ": removed by hand"
            raise LockLost(f"the registry lock of {self.model!r} was lost{taken}"
                           + (f" (renewal failed: {self._renew_error})"
                              if self._renew_error else "") + "; nothing was moved")

    def release(self) -> None:
        """Stops renewing and frees the lease if it is still ours."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with suppress(MlflowException):
            current = self._read()
            if current is not None and current.token == self.token:
                tracking.delete_model_tag(self.model, self.tag)


@contextmanager
def registry_lock(model: str, purpose: str = "promotion",
                  wait_seconds: float = WAIT_SECONDS) -> Iterator[RegistryLease]:
    """Holds `model`'s registry lock for the block (creating the registered model if it does
    not exist yet); yields the lease, whose `check` a writer calls before each write."""
    lease = RegistryLease(model, purpose)
    lease.acquire(wait_seconds)
    try:
        yield lease
    finally:
        lease.release()


@contextmanager
def run_slot(model: str, purpose: str, wait_seconds: float | None = None
             ) -> Iterator[RegistryLease]:
    """Holds `model`'s run slot for the block: one run that registers `model` at a time,
    wherever it runs (waits up to `wait_seconds`, default `COMPACTML_RUN_SLOT_WAIT_SECONDS`
    or a day, for the run that holds it, logging who that is)."""
    lease = RegistryLease(model, purpose, tag=RUN_TAG)
    current = read_lease(model, RUN_TAG)
    if current is not None and not current.free(time.time()):
        logging.getLogger(__name__).warning(
            "waiting for %r: its run slot is %s (one run of a registered model at a time)",
            model, current.describe())
    lease.acquire(RUN_WAIT_SECONDS if wait_seconds is None else wait_seconds)
    try:
        yield lease
    finally:
        lease.release()
