"""Cache keys for Prefect tasks: what a task computes from, nothing else.

A task's key hashes its task name, its inputs with the run-only config fields removed (where
it runs, how it reports, what the model is registered as), the source of the code that
computes the result and the versions of the libraries that do. The code is the task's own
module and every project module it imports, directly or through others (`code_closure`: a
static walk over `import` statements, those inside functions included), so an edited loss or
network is recomputed while an edit to another technique's module leaves the key alone. The
same work under another `--model-name` or `--device auto` is reused.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tasks.environment import PROJECT_ROOT

CODE_PACKAGES = ("models", "training", "serving", "tasks", "flows")
LIBRARIES = ("torch", "torchvision", "compactml")  # their versions decide results too


def module_file(name: str, root: Path = PROJECT_ROOT) -> Path | None:
    """The source file of project module `name` (a module or a package), or None where `name`
    is not one of the project's."""
    if name.split(".")[0] not in CODE_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_names(path: Path) -> frozenset[str]:
    """Every module name the file's `import` statements may load: `import a.b` gives `a` and
    `a.b`; `from a.b import c` gives `a`, `a.b` and `a.b.c` (c may be a module). Each file is
    parsed once a process while it stays unchanged (the closures of many modules share most
    files)."""
    stat = path.stat()
    return _imported_names(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _imported_names(path: Path, _mtime_ns: int, _size: int) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            dotted = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in dotted:
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(names)


@functools.cache
def code_closure(module: str, root: Path = PROJECT_ROOT) -> tuple[Path, ...]:
    """The project files that importing `module` runs: its own and, transitively, those of
    every project module it imports (packages' `__init__.py` included), sorted."""
    seen: set[Path] = set()
    pending = [module]
    while pending:
        name = pending.pop()
        names = {name} | {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for each in names:
            path = module_file(each, root)
            if path is None or path in seen:
                continue
            seen.add(path)
            pending.extend(imported_names(path))
    return tuple(sorted(seen))


def library_versions() -> dict[str, str]:
    """The installed versions of LIBRARIES (`none` where one is not installed)."""
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "none"
    return found


@functools.cache
def code_version(module: str, root: Path = PROJECT_ROOT) -> str:
    """md5 of the source of `code_closure(module)` (paths and bytes) and of the library
    versions: what decides the results computed by `module`."""
    digest = hashlib.md5(repr(sorted(library_versions().items())).encode())
    for path in code_closure(module, root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_only(field: FieldInfo) -> bool:
    """Whether a config field is marked run-only (`tasks.configs.sections.RUN_ONLY`: it says
    where or how a run goes, not what it computes), so left out of every cache key."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("run_only"))


def result_fields(value: Any) -> Any:
    """A JSON-able view of an input without its run-only fields (at any depth: a round's plan
    holds its config)."""
    if isinstance(value, BaseModel):
        return _without_run_only(value, value.model_dump(mode="json"))
    return value


def _without_run_only(value: Any, dumped: Any) -> Any:
    """`dumped` (the JSON dump of `value`) without the fields `value`'s models mark run-only."""
    if isinstance(value, BaseModel) and isinstance(dumped, dict):
        fields = type(value).model_fields
        return {name: _without_run_only(getattr(value, name, None), item)
                for name, item in dumped.items()
                if name not in fields or not run_only(fields[name])}
    if isinstance(value, (list, tuple)) and isinstance(dumped, list):
        return [_without_run_only(v, d) for v, d in zip(value, dumped, strict=False)]
    if isinstance(value, dict) and isinstance(dumped, dict):
        return {key: _without_run_only(value.get(key), item) for key, item in dumped.items()}
    return dumped


def computation_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The cache key: task name, result-relevant inputs and the version of the code that
    computes the result (`code_version`): the task's module and, for an input that is a
    pydantic model, its class and its class's module (a round's plan says how its round
    trains, `tasks.rounds`)."""
    inputs = {name: result_fields(value) for name, value in sorted(parameters.items())}
    modules = {context.task.fn.__module__} | {
        type(value).__module__ for value in parameters.values() if isinstance(value, BaseModel)}
    kinds = sorted(f"{type(v).__module__}.{type(v).__qualname__}"
                   for v in parameters.values() if isinstance(v, BaseModel))
    return hash_objects(context.task.name, inputs, kinds,
                        [code_version(module) for module in sorted(modules)]) or ""
