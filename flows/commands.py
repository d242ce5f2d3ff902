"""The sub-commands of `python -m flows`: the flows and the data tool."""

from __future__ import annotations

import sys

from tasks.config import TrainConfig
from tasks.data import install_fashion_mnist
from tasks.reporting import ui_commands
from tasks.versioning import project_data_status, track_project_data
from training.datasets import DataError


def run_train(config: TrainConfig) -> None:
    """Train one classifier, test it, register it and promote it if it beats the champion."""
    from flows.train import train

    try:
        summary = train(config)
    except DataError as error:  # bad input: one clear line at the end, not only a traceback
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    reg = summary.registration
    print(f"\ntest accuracy {summary.test_accuracy:.4f} "
          f"(best epoch {summary.best_epoch}, validation {summary.val_accuracy:.4f})")
    print(f"registered {reg.name} version {reg.version} as '{reg.alias}': {reg.decision}")
    print(f"MLflow run {summary.run_id}\n{ui_commands()}")


def prepare_data() -> None:
    """Install Fashion-MNIST into data/, track it with data.dvc and push it to the remote."""
    written = install_fashion_mnist()
    ref = track_project_data()
    status = project_data_status()
    print(f"data: {len(written)} files unpacked; data.dvc md5 {ref.md5}; pushed to the DVC "
          f"remote; dvc status: {status or 'up to date'}")


COMMANDS = [
    ("train", TrainConfig, run_train),
    ("prepare-data", None, prepare_data),
]
