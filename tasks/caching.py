"""Cache keys for Prefect tasks: what a task computes from, nothing else.

A task's key hashes its task name, its inputs with the run-only config fields removed (where
it runs, how it reports, what the model is registered as), and the source of the code that
computes the result (`models/`, `training/`, `tasks/`). So the same work under another
`--model-name` or `--device auto` is reused, and an edited loss or network is recomputed.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel

from tasks.environment import PROJECT_ROOT

RUN_ONLY_FIELDS = frozenset({"profile", "model_name", "progress", "threads", "device",
                             "patience", "baseline_gate", "registry", "max_latency_ms"})
CODE_PACKAGES = ("models", "training", "tasks")


@functools.lru_cache(maxsize=1)
def code_version(root: Path = PROJECT_ROOT) -> str:
    """md5 of every Python file of the packages that compute results."""
    digest = hashlib.md5()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def result_fields(value: Any) -> Any:
    """A JSON-able view of an input without its run-only fields."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude=set(RUN_ONLY_FIELDS))
    return value


def computation_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The cache key: task name, result-relevant inputs and code version."""
    inputs = {name: result_fields(value) for name, value in sorted(parameters.items())}
    return hash_objects(context.task.name, inputs, code_version()) or ""
