"""Fine-tuning: a run that starts from a registered model's weights (`--init-from`).

`models:/NAME@ALIAS` or `models:/NAME/VERSION` names a classifier in the MLflow registry (any
flow's: `train`'s champion, `distill`'s student, ...). The alias is resolved to its version
once, when the run starts; the version's exported program is read, its weights are written as
a checkpoint versioned in DVC, and the run's first round starts from that checkpoint (its
optimizer from scratch). The checkpoint's hash is part of every round's cache key, so a run
from another version (the champion moved) never reuses these rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from pydantic import BaseModel, ConfigDict

from tasks.adapters.checkpoints import save_checkpoint
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import MODEL_URI, ClassifierConfig
from tasks.data import DatasetRef
from training.datasets import DataError
from training.rounds import new_model

WRAPPER_PREFIX = "model."  # the exported program wraps the network (training.features)


class InitialWeights(BaseModel):
    """Where a fine-tuning run starts: the registry version it came from, as a checkpoint."""

    model_config = ConfigDict(frozen=True)

    source: str
    name: str
    version: str
    checkpoint: ArtifactRef


def resolve(uri: str) -> tuple[str, str]:
    """The registered model's name and the version `uri` names now (an alias resolved)."""
    parts = MODEL_URI.match(uri)
    name, alias = parts["name"], parts["alias"]
    client = MlflowClient()
    try:
        found = (client.get_model_version_by_alias(name, alias) if alias
                 else client.get_model_version(name, parts["version"]))
    except MlflowException as error:
        raise DataError(f"init_from: no registered model version {uri}: "
                        f"{error.message.splitlines()[0]}") from None
    return name, str(found.version)


def program_weights(name: str, version: str) -> dict[str, torch.Tensor]:
    """The network's state dict inside the version's exported program."""
    with tempfile.TemporaryDirectory() as folder:
        local = Path(mlflow.artifacts.download_artifacts(
            f"models:/{name}/{version}", dst_path=folder))
        programs = sorted(local.glob("artifacts/*.pt2"))
        if not programs:
            raise DataError(f"init_from: models:/{name}/{version} holds no exported classifier "
                            "program (only classifiers can be fine-tuned)")
        state = torch.export.load(str(programs[0])).state_dict
    return {key.removeprefix(WRAPPER_PREFIX): value.detach().clone()
            for key, value in state.items()}


@task(task_run_name="fetch-initial-weights")
def fetch_initial_weights(uri: str, config: ClassifierConfig,
                          dataset: DatasetRef) -> InitialWeights:
    """The weights of the registered model `uri` as a versioned checkpoint, checked to fit
    `config`'s network on `dataset` (same architecture, width and classes)."""
    name, version = resolve(uri)
    weights = program_weights(name, version)
    network = new_model(config, dataset)
    try:
        network.load_state_dict(weights)
    except RuntimeError as error:
        detail = str(error).split("\n\t", 1)[-1].splitlines()[0]
        raise DataError(f"init_from: models:/{name}/{version} does not fit --model "
                        f"{config.network.model} (width {config.network.width}) with "
                        f"{len(dataset.classes)} "
                        f"classes: {detail}") from None
    checkpoint = save_checkpoint(ArtifactStore(), f"checkpoints/init/{name}-v{version}.pt",
                                 {"model": network.state_dict()})
    return InitialWeights(source=uri, name=name, version=version, checkpoint=checkpoint)
