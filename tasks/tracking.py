"""The one MLflow adapter: runs, params, metrics, tags, models and the model registry.

Every call names its run id explicitly (MlflowClient), so it works the same from the flow's
thread, a task thread or a Dask worker. The tracking URI comes from `MLFLOW_TRACKING_URI`
(project.env defaults it to an SQLite database in `mlruns/`, with artifacts beside it).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from pydantic import BaseModel

from tasks.environment import PROJECT_ROOT
from tasks.versioning import ArtifactRef, data_dvc_hash


def client() -> MlflowClient:
    """A client on the configured tracking and registry URI."""
    return MlflowClient(tracking_uri=tracking_uri())


def _artifact_location(experiment: str) -> str | None:
    """For a local SQLite store, artifacts go to `<db folder>/artifacts/<experiment>`."""
    uri = tracking_uri()
    if urlparse(uri).scheme != "sqlite":
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return (database.parent / "artifacts" / experiment).resolve().as_uri()


def experiment_id(name: str) -> str:
    """The id of experiment `name`, created on first use."""
    mlflow_client = client()
    existing = mlflow_client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    try:
        return mlflow_client.create_experiment(name, artifact_location=_artifact_location(name))
    except MlflowException:  # created meanwhile by a concurrent run
        return mlflow_client.get_experiment_by_name(name).experiment_id


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as flat `a.b` keys with string values (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


def git_commit(root: Path = PROJECT_ROOT) -> str:
    """The project's git commit, with `-dirty` when the work tree has changes."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], check=True,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def start_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
) -> str:
    """Creates a run (nested under `parent_run_id` if given) and logs its params and tags."""
    all_tags = {"mlflow.runName": run_name, "git.commit": git_commit(),
                "data.dvc": data_dvc_hash(), **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client().create_run(experiment_id(experiment), tags=all_tags, run_name=run_name)
    if params:
        client().log_batch(run.info.run_id,
                           params=[Param(k, v[:6000]) for k, v in flatten(params).items()])
    return run.info.run_id


def end_run(run_id: str, status: str = "FINISHED") -> None:
    """Marks a run FINISHED, FAILED or KILLED."""
    client().set_terminated(run_id, status=status)


@contextmanager
def tracked_run(
    experiment: str,
    run_name: str,
    config: BaseModel | None = None,
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
) -> Iterator[str]:
    """A run for the block: params are the whole config; FAILED if the block raises."""
    params = config.model_dump(mode="json") if config is not None else None
    run_id = start_run(experiment, run_name, params, tags, parent_run_id)
    try:
        yield run_id
    except BaseException:
        end_run(run_id, "FAILED")
        raise
    end_run(run_id, "FINISHED")


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int | None = None,
                prefix: str = "") -> None:
    """Logs metrics under their own names (the loss dict's keys), with an optional prefix."""
    now = int(time.time() * 1000)
    batch = [Metric(f"{prefix}{key}", float(value), now, step or 0)
             for key, value in metrics.items()]
    if batch:
        client().log_batch(run_id, metrics=batch)


def set_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    """Sets tags on a run (values as strings)."""
    if tags:
        client().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_artifact_refs(run_id: str, refs: Mapping[str, ArtifactRef]) -> None:
    """Records each versioned artifact as tag `dvc.<name>` = content hash (and its path)."""
    set_tags(run_id, {f"dvc.{name}": ref.md5 for name, ref in refs.items()})
    set_tags(run_id, {f"dvc.{name}.path": ref.path for name, ref in refs.items()})


def log_dict(run_id: str, values: Mapping[str, Any], artifact_file: str) -> None:
    """Stores `values` as a JSON (or YAML, by extension) artifact of the run."""
    client().log_dict(run_id, dict(values), artifact_file)


def log_figure(run_id: str, figure: Any, artifact_file: str) -> None:
    """Stores a matplotlib figure as an image artifact of the run."""
    client().log_figure(run_id, figure, artifact_file)


def log_file(run_id: str, path: Path, artifact_path: str | None = None) -> None:
    """Stores a local file as an artifact of the run."""
    client().log_artifact(run_id, str(path), artifact_path)


def log_pyfunc_model(run_id: str, python_model: str,
                     artifacts: Mapping[str, str], pip_requirements: list[str],
                     code_paths: list[str] | None = None, artifact_path: str = "model",
                     signature: ModelSignature | None = None) -> str:
    """Saves a pyfunc model (a models-from-code file) on the run; returns its `runs:/` URI.
    `signature`: what the model declares (its prediction parameters)."""
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / artifact_path
        mlflow.pyfunc.save_model(str(local), python_model=python_model,
                                 artifacts=dict(artifacts), pip_requirements=pip_requirements,
                                 code_paths=code_paths, signature=signature)
        client().log_artifacts(run_id, str(local), artifact_path)
    return f"runs:/{run_id}/{artifact_path}"


def register_model(model_uri: str, name: str, run_id: str, tags: Mapping[str, str]) -> str:
    """Registers `model_uri` as a new version of `name`; returns the version number."""
    version = mlflow.register_model(model_uri, name, tags=dict(tags))
    return str(version.version)


def _missing(error: MlflowException) -> bool:
    return error.error_code == "RESOURCE_DOES_NOT_EXIST"


def alias_version(name: str, alias: str) -> str | None:
    """The version of `name` that holds `alias`; None only when there is none (or no model)."""
    try:
        model = client().get_registered_model(name)
    except MlflowException as error:
        if _missing(error):
            return None
        raise
    version = model.aliases.get(alias)  # a model may have no champion (the baseline gate)
    return None if version is None else str(version)


def version_tags(name: str, version: str) -> dict[str, str]:
    """The tags of one model version."""
    return dict(client().get_model_version(name, version).tags)


def find_version(name: str, tag: str, value: str) -> str | None:
    """The first version of `name` whose tag `tag` equals `value`, or None."""
    try:
        versions = client().search_model_versions(f"name = '{name}'")
    except MlflowException as error:
        if _missing(error):
            return None
        raise
    for version in sorted(versions, key=lambda v: int(v.version)):
        if version.tags.get(tag) == value:
            return str(version.version)
    return None


def set_alias(name: str, alias: str, version: str) -> None:
    """Points `alias` of `name` at `version`."""
    client().set_registered_model_alias(name, alias, version)


def load_pyfunc(model_uri: str) -> mlflow.pyfunc.PyFuncModel:
    """Loads a logged or registered pyfunc model (`runs:/...`, `models:/name@alias`)."""
    return mlflow.pyfunc.load_model(model_uri)


def tracking_uri() -> str:
    """The tracking URI in force (MLflow reads MLFLOW_TRACKING_URI itself)."""
    return mlflow.get_tracking_uri()
