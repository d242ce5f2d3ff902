"""Retention: `python -m flows gc --keep N` frees the artifacts old runs left behind.

Every run records its versioned artifacts (`dvc/artifacts.json`: data set, per-round
checkpoints, banks, programs). What is kept: the artifacts of the last N top-level runs of
every experiment, of every run still running, and of every registered model version's run
tree (the run that made it, its parent and siblings: the lineage the version came from), also
when that run was deleted in the MLflow UI, plus every hash a version's own tags name (its data
set, which a promotion reads back to leave out the images the champion saw). The registered
models themselves live in MLflow's artifact store and are never touched.

Everything else is removed where it is stored: the file and its `.dvc` pointer in the artifact
store, its object in the store's DVC cache and on the DVC remote. A content hash that a kept
run also records stays. A file no run records (a killed run's) goes only once it is older
than `min_age_hours` and no run is running, since a running task records its files when its
run ends. Prefect's
persisted task results that name a removed hash are dropped too, so a later run recomputes
the task instead of being handed a file that no longer exists.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import ViewType
from pydantic import Field

from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactStore, data_dvc_hash
from tasks.configs.sections import StrictConfig

MD5 = re.compile(r"[0-9a-f]{32}")


class GcConfig(StrictConfig):
    """`python -m flows gc --keep N`."""

    keep: int = Field(5, ge=0, le=100_000, description="the last N top-level runs of every "
                      "experiment keep their artifacts (so do running runs and every registered "
                      "version's runs)")
    min_age_hours: float = Field(1.0, ge=0.0, description="a file that no run records is "
                                 "removed only when older than this, and while no run is "
                                 "running")
    dry_run: bool = Field(False, description="print what would be freed, remove nothing")


class Freed(StrictConfig):
    """What a gc removed (or would remove)."""

    kept_runs: int
    removed_runs: int
    files: list[str]
    bytes: int
    hashes: int
    results: int


def _every(search: Callable[..., Any]) -> list:
    """Every item of a paged MLflow search."""
    items, token = [], None
    while True:
        page = search(page_token=token)
        items += list(page)
        token = page.token
        if not token:
            return items


def _all_runs() -> list:
    """Every run, those deleted in the UI too (a registered version's may be one)."""
    client = tracking.client()
    experiments = [e.experiment_id for e in _every(
        lambda page_token: client.search_experiments(ViewType.ALL, page_token=page_token))]
    if not experiments:
        return []
    return _every(lambda page_token: client.search_runs(experiments, run_view_type=ViewType.ALL,
                                                        max_results=1000,
                                                        page_token=page_token))


def _registered_versions() -> list:
    client = tracking.client()
    return [version for model in _every(client.search_registered_models)
            for version in _every(lambda page_token, name=model.name:
                                  client.search_model_versions(f"name = '{name}'",
                                                               page_token=page_token))]


def lineage_hashes(tags: dict[str, str]) -> set[str]:
    """The content hashes a registered version's tags name (`dataset`, `program`, the data
    set's `dataset.ref`: what a promotion reads back), whatever became of its run."""
    hashes = set()
    for value in tags.values():
        if MD5.fullmatch(value):
            hashes.add(value)
        elif value.startswith("{"):
            try:
                found = json.loads(value).get("md5", "")
            except (ValueError, AttributeError):
                continue
            if isinstance(found, str) and MD5.fullmatch(found):
                hashes.add(found)
    return hashes


def kept_run_ids(runs: list, keep: int, registered: set[str]) -> set[str]:
    """The runs whose artifacts stay (the module docstring); a run deleted in the UI counts
    only through a registered version (`registered`: their run ids)."""
    parent = {r.info.run_id: r.data.tags.get("mlflow.parentRunId") for r in runs}

    def root(run_id: str) -> str:
        while parent.get(run_id):
            run_id = parent[run_id]
        return run_id

    roots: set[str] = set()
    by_experiment: dict[str, list] = {}
    live = [run for run in runs if run.info.lifecycle_stage != "deleted"]
    for run in live:
        if not parent[run.info.run_id]:
            by_experiment.setdefault(run.info.experiment_id, []).append(run)
    for tops in by_experiment.values():
        tops.sort(key=lambda r: r.info.start_time or 0, reverse=True)
        roots |= {r.info.run_id for r in tops[:keep]}
    roots |= {root(r.info.run_id) for r in live if r.info.status == "RUNNING"}
    roots |= {root(run_id) for run_id in registered if run_id in parent}
    return {run_id for run_id in parent if root(run_id) in roots}


def _dropped_results(hashes: set[str], dry_run: bool) -> int:
    """Prefect's persisted results (base64 pickles) that name one of `hashes`; deleted."""
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH

    folder = Path(PREFECT_RESULTS_LOCAL_STORAGE_PATH.value())
    if not hashes or not folder.is_dir():
        return 0
    needles = [h.encode() for h in hashes]
    dropped = 0
    for path in folder.iterdir():
        try:
            payload = base64.b64decode(json.loads(path.read_text())["result"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a result record
        if any(needle in payload for needle in needles):
            dropped += 1
            if not dry_run:
                path.unlink(missing_ok=True)
    return dropped


def collect(config: GcConfig, store: ArtifactStore | None = None) -> Freed:
    """Removes (with `dry_run`: only lists) what no kept run records (the module
    docstring)."""
    store = store or ArtifactStore()
    runs, versions = _all_runs(), _registered_versions()
    kept = kept_run_ids(runs, config.keep, {v.run_id for v in versions if v.run_id})
    recorded: dict[str, set[str]] = {}  # run id -> the hashes it records
    for run in runs:
        recorded[run.info.run_id] = {ref["md5"] for ref in
                                     tracking.artifact_refs(run.info.run_id).values()}
    keep_hashes = set().union(*(recorded[run_id] for run_id in kept)) if kept else set()
    keep_hashes |= set().union(*(lineage_hashes(v.tags) for v in versions)) if versions \
        else set()
    anyone = set().union(*recorded.values()) if recorded else set()
    old = time.time() - config.min_age_hours * 3600
    # a running task records its files when its run ends: while any run is running, a file
    # that no run records may be its, whatever its age
    running = any(run.info.status == "RUNNING" for run in runs)
    files, size, removed_hashes = [], 0, set()
    for pointer in sorted(store.root.rglob("*.dvc")):
        if ".dvc" in pointer.relative_to(store.root).parts[:-1] or not pointer.is_file():
            continue  # DVC's own folder
        md5 = data_dvc_hash(pointer)
        target = pointer.with_suffix("")
        unrecorded_may_live = md5 not in anyone and (running or pointer.stat().st_mtime > old)
        if md5 in keep_hashes or unrecorded_may_live:
            continue
        files.append(target.relative_to(store.root).as_posix())
        size += target.stat().st_size if target.is_file() else 0
        removed_hashes.add(md5)
        if not config.dry_run:
            target.unlink(missing_ok=True)
            pointer.unlink()
    removed_hashes |= anyone - keep_hashes  # other machines' files: their remote objects
    if not config.dry_run and removed_hashes:
        store.delete_objects(removed_hashes)
    results = _dropped_results(removed_hashes, config.dry_run)
    return Freed(kept_runs=len(kept), removed_runs=len(runs) - len(kept), files=files,
                 bytes=size, hashes=len(removed_hashes), results=results)
