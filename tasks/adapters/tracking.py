"""The one MLflow adapter: runs, params, metrics, tags, models and the model registry.

Every call names its run id explicitly (MlflowClient), so it works the same from the flow's
thread, a task thread or a Dask worker. The tracking URI comes from `MLFLOW_TRACKING_URI`
(project.env defaults it to an SQLite database in `mlruns/`, with artifacts beside it).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from prefect.exceptions import TerminationSignal
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from tasks.adapters.versioning import ArtifactRef, data_dvc_hash
from tasks.environment import PROJECT_ROOT
from training.stopping import StopRequested, clear_stop, request_stop


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


# The MLflow UI opens such an experiment in its classic training view (runs, metrics, models),
# not as a GenAI evaluation.
EXPERIMENT_KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"


def experiment_id(name: str) -> str:
    """The id of experiment `name`, created on first use."""
    mlflow_client = client()
    existing = mlflow_client.get_experiment_by_name(name)
    if existing is None:
        try:
            return mlflow_client.create_experiment(name, _artifact_location(name),
                                                   tags={EXPERIMENT_KIND: MODEL_DEVELOPMENT})
        except MlflowException:  # created meanwhile by a concurrent run
            existing = mlflow_client.get_experiment_by_name(name)
    if existing.tags.get(EXPERIMENT_KIND) != MODEL_DEVELOPMENT:  # made by an older version
        mlflow_client.set_experiment_tag(existing.experiment_id, EXPERIMENT_KIND,
                                         MODEL_DEVELOPMENT)
    return existing.experiment_id


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
    """Creates a run in `experiment` and logs its params and tags; nested under
    `parent_run_id` if given, then in the parent's experiment whatever `experiment` says."""
    all_tags = {"mlflow.runName": run_name, "git.commit": git_commit(),
                "data.dvc": data_dvc_hash(), **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
        experiment_key = client().get_run(parent_run_id).info.experiment_id
    else:
        experiment_key = experiment_id(experiment)
    run = client().create_run(experiment_key, tags=all_tags, run_name=run_name)
    if params:
        log_params(run.info.run_id, params)
    return run.info.run_id


def log_params(run_id: str, params: Mapping[str, Any]) -> None:
    """Logs `params` (nested mappings flattened) on the run; a param is logged once."""
    client().log_batch(run_id, params=[Param(k, v[:6000]) for k, v in flatten(params).items()])


def log_config(run_id: str, config: BaseModel) -> None:
    """Logs a config's fields as the run's params, as `tracked_run` does."""
    log_params(run_id, to_jsonable_python(
        config.flat() if hasattr(config, "flat") else config.model_dump()))


def end_run(run_id: str, status: str = "FINISHED") -> None:
    """Marks a run FINISHED, FAILED or KILLED."""
    client().set_terminated(run_id, status=status)


def unanswered(error: BaseException) -> str | None:
    """Where `error` (or an error it came from) is the tracking server not answering, a
    sentence saying so that names its URI; None for any other error."""
    import requests

    seen: BaseException | None = error
    while seen is not None:
        text = str(seen)
        if isinstance(seen, requests.exceptions.ConnectionError) or (
                isinstance(seen, MlflowException) and "API request to" in text
                and any(sign in text for sign in ("Max retries exceeded", "Connection refused",
                                                  "Failed to establish", "timed out"))):
            return (f"the MLflow tracking server at {tracking_uri()} did not answer; the run "
                    "stopped there. Its finished rounds are cached: run the same command again "
                    "once the server is back, and it resumes from them")
        seen = seen.__cause__ or seen.__context__
    return None


# what ends a run as KILLED rather than FAILED: a signal or Ctrl-C (Prefect turns SIGTERM into
# TerminationSignal during a flow; the command line's handler into SystemExit outside one)
INTERRUPTIONS = (KeyboardInterrupt, SystemExit, TerminationSignal, StopRequested)


@contextmanager
def tracked_run(
    experiment: str,
    run_name: str,
    config: BaseModel | None = None,
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
) -> Iterator[str]:
    """A run for the block: params are the whole config, by the fields' command-line names;
    KILLED if the block was interrupted (SIGTERM, Ctrl-C: the training loops of the process are
    then asked to stop, `training.stopping`), FAILED if it raised anything else."""
    if parent_run_id is None:  # a new top-level run: an earlier interruption is over
        clear_stop()
    run_id = start_run(experiment, run_name, None, tags, parent_run_id)
    if config is not None:
        log_config(run_id, config)
    try:
        yield run_id
    except BaseException as error:
        interrupted = isinstance(error, INTERRUPTIONS)
        if interrupted:
            request_stop()
        if unanswered(error) is None:  # (a server that did not answer cannot mark the run)
            end_run(run_id, "KILLED" if interrupted else "FAILED")
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


ARTIFACT_REFS = "dvc/artifacts.json"
# a round's artifact: checkpoint.round-003, bank.stage-002, checkpoint.align-001, ...
PER_ROUND = re.compile(r"\b(round|stage|align|pretrain)-\d+$")


def artifact_refs(run_id: str) -> dict[str, dict[str, str]]:
    """Every versioned artifact recorded on the run: name -> {"md5", "path"}."""
    if not any(f.path == ARTIFACT_REFS for f in client().list_artifacts(run_id, "dvc")):
        return {}
    with tempfile.TemporaryDirectory() as folder:
        return json.loads(Path(client().download_artifacts(run_id, ARTIFACT_REFS, folder))
                          .read_text())


def log_artifact_refs(run_id: str, refs: Mapping[str, ArtifactRef]) -> None:
    """Records each versioned artifact (content hash and path) in the run's
    `dvc/artifacts.json`, and all but the per-round ones (`checkpoint.round-003`) also as tag
    `dvc.<name>` = content hash, so the run's page shows the few that matter."""
    set_tags(run_id, {f"dvc.{name}": ref.md5 for name, ref in refs.items()
                      if not PER_ROUND.search(name)})
    log_dict(run_id, artifact_refs(run_id) | {
        name: {"md5": ref.md5, "path": ref.path} for name, ref in refs.items()}, ARTIFACT_REFS)


def log_dataset(run_id: str, name: str, digest: str, source: str, sizes: Mapping[str, int]
                ) -> None:
    """Logs the run's data set as MLflow inputs, one per split (`mlflow.data.context` = the
    split), with its content hash as the digest, so the run page lists what it trained on."""
    inputs = [DatasetInput(Dataset(name=f"{name} ({split})", digest=digest[:36],
                                   source_type="dvc", source=source,
                                   profile=json.dumps({"images": images})),
                           [InputTag(MLFLOW_DATASET_CONTEXT, split)])
              for split, images in sizes.items()]
    client().log_inputs(run_id, datasets=inputs)


def log_dict(run_id: str, values: Mapping[str, Any], artifact_file: str) -> None:
    """Stores `values` as a JSON (or YAML, by extension) artifact of the run."""
    client().log_dict(run_id, dict(values), artifact_file)


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    """Stores `text` as a text artifact of the run (markdown, say)."""
    client().log_text(run_id, text, artifact_file)


def log_figure(run_id: str, figure: Any, artifact_file: str) -> None:
    """Stores a matplotlib figure as an image artifact of the run."""
    client().log_figure(run_id, figure, artifact_file)


def log_file(run_id: str, path: Path, artifact_path: str | None = None) -> None:
    """Stores a local file as an artifact of the run."""
    client().log_artifact(run_id, str(path), artifact_path)


def log_pyfunc_model(run_id: str, python_model: str,
                     artifacts: Mapping[str, str], pip_requirements: list[str],
                     code_paths: list[str] | None = None, name: str = "model",
                     signature: ModelSignature | None = None,
                     model_config: dict[str, Any] | None = None,
                     metadata: dict[str, Any] | None = None) -> str:
    """Logs a pyfunc model (a models-from-code file) as an MLflow logged model linked to the
    run (its page lists it under "Logged models"); returns its `models:/m-...` URI.
    `signature`: what the model declares (its outputs, its prediction parameters);
    `model_config`: what its `load_context` reads as `context.model_config`; `metadata`: shown
    with the model (what it takes).

    The logged model is created in the run's experiment first: left to `Model.log`, MLflow
    puts it in the active or Default experiment (0), where the run's page never finds it."""
    run = client().get_run(run_id)
    logged = client().create_logged_model(
        experiment_id=run.info.experiment_id, name=name, source_run_id=run_id,
        params={key: str(value) for key, value in run.data.params.items()})
    with warnings.catch_warnings():
        # our signatures declare outputs only (`serving.entry`): there is no input to exemplify
        warnings.filterwarnings("ignore", message=".*input example was not provided")
        info = Model.log(artifact_path=None, name=name, flavor=mlflow.pyfunc, run_id=run_id,
                         model_id=logged.model_id, python_model=python_model,
                         artifacts=dict(artifacts), pip_requirements=pip_requirements,
                         code_paths=code_paths, signature=signature, model_config=model_config,
                         metadata=metadata)
    return info.model_uri


def register_version(model_uri: str, name: str, run_id: str, tags: Mapping[str, str]) -> str:
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


def _versions(name: str) -> list:
    """The versions of registered model `name`, oldest first (none when there is no such
    model)."""
    try:
        versions = client().search_model_versions(f"name = '{name}'")
    except MlflowException as error:
        if _missing(error):
            return []
        raise
    return sorted(versions, key=lambda v: int(v.version))


def find_version(name: str, tag: str, value: str) -> str | None:
    """The first version of `name` whose tag `tag` equals `value`, or None."""
    return next((str(v.version) for v in _versions(name) if v.tags.get(tag) == value), None)


def model_versions(name: str) -> list[str]:
    """The version numbers of `name`, in order (empty when there is no such model)."""
    return [str(v.version) for v in _versions(name)]


def model_tags(name: str) -> dict[str, str]:
    """The tags of registered model `name`."""
    return dict(client().get_registered_model(name).tags)


def ensure_registered_model(name: str) -> None:
    """Creates registered model `name` unless it exists (another process may create it
    first)."""
    try:
        client().create_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def delete_model_tag(name: str, key: str) -> None:
    """Removes one tag of registered model `name` (none there: nothing to do)."""
    try:
        client().delete_registered_model_tag(name, key)
    except MlflowException as error:
        if not _missing(error):
            raise


def set_model_tag(name: str, key: str, value: str) -> None:
    """Sets one tag of registered model `name`."""
    client().set_registered_model_tag(name, key, value)


def set_version_tags(name: str, version: str, tags: Mapping[str, str]) -> None:
    """Sets tags of one model version."""
    for key, value in tags.items():
        client().set_model_version_tag(name, version, key, value)


def set_alias(name: str, alias: str, version: str) -> None:
    """Points `alias` of `name` at `version`."""
    client().set_registered_model_alias(name, alias, version)


def load_pyfunc(model_uri: str) -> mlflow.pyfunc.PyFuncModel:
    """Loads a logged or registered pyfunc model (`runs:/...`, `models:/name@alias`). A URI
    that always names the same model (a run's, a version number's: no `@alias`) is loaded
    once per process and tracking server (a promotion scores, times and counts it)."""
    if "@" in model_uri:
        return mlflow.pyfunc.load_model(model_uri)
    return _load_fixed_pyfunc(tracking_uri(), model_uri)


@functools.lru_cache(maxsize=8)
def _load_fixed_pyfunc(server: str, model_uri: str) -> mlflow.pyfunc.PyFuncModel:
    return mlflow.pyfunc.load_model(model_uri)


def tracking_uri() -> str:
    """The tracking URI in force (MLflow reads MLFLOW_TRACKING_URI itself)."""
    return mlflow.get_tracking_uri()
