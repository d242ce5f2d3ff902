"""The registry's lock: one promotion of a registered model at a time, across processes and
machines that share the Prefect server.

A promotion reads the champion, scores both models and moves the alias; two of them
interleaved could both find no champion, or both beat the old one, and leave the alias on the
worse model. Each holds the one slot of a Prefect global concurrency limit named after the
model (created on first use) while it does so; the next waits for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from tasks.adapters.environment import safe_name

WAIT_SECONDS = 3600.0  # a promotion scores two models on the test split: minutes at most


def lock_name(model: str) -> str:
    """The concurrency limit of registered model `model` (Prefect's names allow no `/`, `%`,
    `&`, `>`, `<`)."""
    return "registry-" + safe_name(model)


def _ensure_limit(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # another promotion created it first
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1))


@contextmanager
def registry_lock(model: str, wait_seconds: float = WAIT_SECONDS) -> Iterator[None]:
    """Holds `model`'s registry lock for the block; waits up to `wait_seconds` for it
    (TimeoutError after that)."""
    name = lock_name(model)
    _ensure_limit(name)
    with concurrency(name, occupy=1, timeout_seconds=wait_seconds, strict=True):
        yield
