"""The registry's lock: one alias move of a registered model at a time, wherever the registry is
shared, held in MLflow itself.

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
`python -m flows registry unlock NAME` removes a lease by hand. Expiry compares wall clocks:
machines sharing a registry need clocks within a few seconds of each other.
"""

from __future__ import annotations

import json
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

LOCK_TAG = "registry.lock"
WAIT_SECONDS = 3600.0  # a promotion scores models on the test split: minutes at most
LEASE_SECONDS = float(os.environ.get("COMPACTML_REGISTRY_LEASE_SECONDS", 60))
SETTLE_SECONDS = float(os.environ.get("COMPACTML_REGISTRY_SETTLE_SECONDS", 1.0))
POLL_SECONDS = 0.5


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

    def describe(self, now: float | None = None) -> str:
        left = self.expires - (time.time() if now is None else now)
        return (f"held by {self.owner} ({self.purpose}) since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.acquired))}, "
                + (f"expires in {left:.0f} s" if left > 0 else "expired"))


def read_lease(model: str) -> Lease | None:
    """The lease on registered model `model` (None: free, or no such model)."""
    try:
        raw = tracking.model_tags(model).get(LOCK_TAG)
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


def unlock(model: str) -> Lease | None:
    """Removes the lease on `model` by hand (`flows registry unlock`); returns the one removed.
    Only for a lease whose holder is known to be gone: a live holder then fails its next
    check instead of moving the alias."""
    lease = read_lease(model)
    if lease is not None:
        tracking.delete_model_tag(model, LOCK_TAG)
    return lease


class RegistryLease:
    """Holds `model`'s lock (module docstring): `acquire`, `check` before each write,
    `release`."""

    def __init__(self, model: str, purpose: str, lease_seconds: float = LEASE_SECONDS,
                 settle_seconds: float = SETTLE_SECONDS) -> None:
        self.model, self.purpose = model, purpose
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
        tracking.set_model_tag(self.model, LOCK_TAG, json.dumps(asdict(lease)))

    def acquire(self, wait_seconds: float = WAIT_SECONDS) -> None:
        """Takes the lock, waiting up to `wait_seconds` for its holder (TimeoutError after,
        naming the holder)."""
        tracking.ensure_registered_model(self.model)
        deadline = time.monotonic() + wait_seconds
        while True:
            current = read_lease(self.model)
            if current is None or current.expired(time.time()):
                self._acquired = 0.0
                try:
                    self._write()
                except MlflowException:  # another writer inserted the tag at the same moment
                    time.sleep(POLL_SECONDS * random.random())  # (a unique-key conflict)
                    continue
                time.sleep(self.settle_seconds)
                confirmed = read_lease(self.model)
                if confirmed is not None and confirmed.token == self.token:
                    self._acquired = confirmed.acquired
                    self._start_heartbeat()
                    return
                current = confirmed
            if time.monotonic() > deadline:
                held = current.describe() if current else "taken and released repeatedly"
                raise TimeoutError(
                    f"the registry lock of {self.model!r} is {held}; waited {wait_seconds:.0f} "
                    f"s. If that holder is gone: python -m flows registry unlock {self.model}")
            time.sleep(POLL_SECONDS * (0.5 + random.random()))

    def _start_heartbeat(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.lease_seconds / 3):
                try:
                    current = read_lease(self.model)
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
        current = read_lease(self.model)
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
            current = read_lease(self.model)
            if current is not None and current.token == self.token:
                tracking.delete_model_tag(self.model, LOCK_TAG)


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
