"""The sub-commands of `python -m flows`: the flows and the data tool."""

from __future__ import annotations

import sys

from tasks.config import DistillConfig, PBTConfig, TrainConfig
from tasks.data import install_fashion_mnist
from tasks.prediction import PredictConfig, predict_images
from tasks.reporting import ui_commands
from tasks.versioning import project_data_status, track_project_data
from training.datasets import DataError


def _exit_on_data_error(call):
    """Runs `call()`; bad input ends with one clear `error:` line and exit code 2."""
    try:
        return call()
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _print_registration(summary) -> None:
    reg = summary.registration
    print(f"registered {reg.name} version {reg.version} as '{reg.alias}': {reg.decision}")
    print(f"MLflow run {summary.run_id}\n{ui_commands()}")


def run_train(config: TrainConfig) -> None:
    """Train one classifier, test it, register it and promote it if it beats the champion."""
    from flows.train import train

    summary = _exit_on_data_error(lambda: train(config))
    print(f"\ntest accuracy {summary.test_accuracy:.4f} "
          f"(best epoch {summary.best_epoch}, validation {summary.val_accuracy:.4f})")
    _print_registration(summary)


def run_distill(config: DistillConfig) -> None:
    """Distil a teacher trained in stages into a student through a feature bank; register it."""
    from flows.distill import distill

    summary = _exit_on_data_error(lambda: distill(config))
    print(f"\nstudent test accuracy {summary.test_accuracy:.4f} "
          f"(teacher {summary.teacher_test_accuracy:.4f}, {len(summary.stages)} stages)")
    _print_registration(summary)


def run_pbt(config: PBTConfig) -> None:
    """Population-based training: members copy the best's weights and explore around it."""
    from flows.pbt import pbt

    summary = _exit_on_data_error(lambda: pbt(config))
    population = summary.population
    print(f"\ntest accuracy {summary.test_accuracy:.4f} (best member {population.best.member} "
          f"after {population.stages} stages: " + ", ".join(
              f"{k}={v:.4g}" for k, v in population.hyperparameters.items()) + ")")
    _print_registration(summary)


def run_predict(config: PredictConfig) -> None:
    """Print the label and confidence a registered model gives each image of a file or folder."""
    from mlflow.exceptions import MlflowException

    try:
        table, skipped = _exit_on_data_error(lambda: predict_images(config))
    except MlflowException as error:
        print(f"error: cannot load {config.model_uri()}: {error.message}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table.to_string(index=False, formatters={"confidence": "{:.4f}".format}))
    if skipped:
        print(f"skipped {len(skipped)} unreadable images: {', '.join(map(str, skipped[:5]))}",
              file=sys.stderr)


def prepare_data() -> None:
    """Install Fashion-MNIST into data/, track it with data.dvc and push it to the remote."""
    written = install_fashion_mnist()
    ref = track_project_data()
    status = project_data_status()
    print(f"data: {len(written)} files unpacked; data.dvc md5 {ref.md5}; pushed to the DVC "
          f"remote; dvc status: {status or 'up to date'}")


COMMANDS = [
    ("train", TrainConfig, run_train),
    ("distill", DistillConfig, run_distill),
    ("pbt", PBTConfig, run_pbt),
    ("predict", PredictConfig, run_predict),
    ("prepare-data", None, prepare_data),
]
