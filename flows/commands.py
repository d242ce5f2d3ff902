"""The sub-commands of `python -m flows`: the flows and the data tool."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from flows.cli import Command

if TYPE_CHECKING:  # the stack is imported by the command that runs, not by `--help`
    from tasks.adapters.aliases import PromoteConfig, RegistryConfig, RollbackConfig
    from tasks.adapters.prediction import PredictConfig
    from tasks.adapters.retention import GcConfig
    from tasks.adapters.serve import ServeConfig
    from tasks.configs.cascade import CascadeConfig
    from tasks.configs.distill import DistillConfig
    from tasks.configs.image_text import ImageTextConfig
    from tasks.configs.pbt import PBTConfig
    from tasks.configs.pipeline import PipelineConfig
    from tasks.configs.sections import SplitsConfig
    from tasks.configs.sparsify import SparsifyConfig
    from tasks.configs.train import TrainConfig
    from tasks.features import FeaturesConfig

SERVER_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


class _NoTracebackFor(logging.Filter):
    """Keeps a log line about one of `errors` but drops its traceback: bad input is the
    user's to fix, not a bug (the command ends with its own `error:` line)."""

    def __init__(self, errors: tuple[type[BaseException], ...]):
        super().__init__()
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.errors):
            record.exc_info, record.exc_text = None, None
        if isinstance(record.msg, str) and "\nTraceback (most recent call last)" in record.msg \
                and any(e.__name__ in record.msg for e in self.errors):
            record.msg = record.msg.split("\nTraceback (most recent call last)")[0]
        return True


def _quiet_tracebacks(errors: tuple[type[BaseException], ...]) -> None:
    """Installs `_NoTracebackFor(errors)` on every log handler there is."""
    loggers = [logging.getLogger()] + [logger for logger in
                                       logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        if not any(isinstance(f, _NoTracebackFor) for f in handler.filters):
            handler.addFilter(_NoTracebackFor(errors))


def _exit_on_data_error(call):
    """Runs `call()`; bad input ends with one clear `error:` line and exit code 2; a Prefect
    server that does not answer, or a population that failed whole, with one such line and
    exit code 1 (tracebacks are kept for bugs, dropped from the log for these)."""
    from training.datasets import DataError
    from training.pbt.scheduler import PopulationFailed

    _quiet_tracebacks((DataError, PopulationFailed))
    try:
        return call()
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as error:
        if str(error).startswith(SERVER_TIMEOUT):
            limit = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "20")
            print(f"error: Prefect's temporary API server did not answer within {limit} s (the "
                  "machine may be busy): raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS "
                  "(project.env or the environment), or start a server (`make ui`) and set "
                  "PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
            raise SystemExit(1) from None
        if isinstance(error, PopulationFailed):
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1) from None
        raise


def _print_registration(summary) -> None:
    from tasks.adapters.reporting import ui_commands

    reg = summary.registration
    print(f"registered {reg.name} version {reg.version} as '{reg.alias}': {reg.decision}"
          if reg.registered else f"{reg.decision}; the model is {reg.model_uri}")
    print(f"MLflow run {summary.run_id}\n{ui_commands()}")


def run_train(config: TrainConfig) -> None:
    """Train one classifier, test it, register it and promote it if it beats the champion."""
    from flows.train import train

    summary = _exit_on_data_error(lambda: train(config))
    print(f"\ntest accuracy {summary.test_accuracy:.4f} "
          f"(kept round {summary.best_round}, validation {summary.val_accuracy:.4f})")
    _print_registration(summary)


def run_distill(config: DistillConfig) -> None:
    """Distil a teacher trained in stages into a student that learns from its states (or their
    feature bank); register it."""
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
    print(f"\ntest accuracy {summary.test_accuracy:.4f}, {config.knn_k}-NN on its embeddings "
          f"{summary.knn_accuracy:.4f} (best member {population.best_member} "
          f"after {population.stages} stages: " + ", ".join(
              f"{k}={v:.4g}" for k, v in population.hyperparameters.items()) + ")")
    _print_registration(summary)


def run_sparsify(config: SparsifyConfig) -> None:
    """Train a classifier, detector or contour network with an activation-sparsity term;
    measure its zeros; register it."""
    from flows.sparsify import sparsify

    summary = _exit_on_data_error(lambda: sparsify(config))
    zeros = ", ".join(f"{name} {layer.zero_fraction:.3f}"
                      for name, layer in summary.report.layers.items())
    scores = (", ".join(f"{k} {v:.4f}" for k, v in summary.test.items())
              if config.task != "classification" else f"test accuracy {summary.test_accuracy:.4f}")
    print(f"\n{scores} (kept round {summary.best_round}, validation "
          f"{summary.report.score_name} {summary.report.val_score:.4f}); exact zeros on "
          f"validation: {zeros}")
    _print_registration(summary)


def run_cascade(config: CascadeConfig) -> None:
    """Train a cascaded early-exit network with super-network modules; calibrate, measure and
    register it."""
    from flows.cascade import cascade

    summary = _exit_on_data_error(lambda: cascade(config))
    metrics = summary.test.metrics
    print(f"\ntest accuracy {summary.test_accuracy:.4f} (full network "
          f"{metrics['full_test_accuracy']:.4f}); {metrics['speedup_b1']:.2f}x faster than the "
          f"full network at batch 1, {metrics['speedup_serving']:.2f}x at batch "
          f"{config.serving_batch}; exits " + ", ".join(
              f"{metrics[f'exit_share_{k}']:.2f}" for k in range(len(config.widths))))
    _print_registration(summary)


def run_image_text(config: ImageTextConfig) -> None:
    """Train an image network from images and their descriptions, with a text-initialized
    classifier; test it (and zero-shot from the class descriptions) and register it."""
    from flows.image_text import image_text
    from tasks.image_text.tasks import check_descriptions

    _exit_on_data_error(lambda: check_descriptions(config))
    summary = _exit_on_data_error(lambda: image_text(config))
    metrics = summary.test_metrics
    print(f"\ntest accuracy {summary.test_accuracy:.4f}; zero-shot from the class "
          f"descriptions {metrics['test_zero_shot_accuracy']:.4f}" + (
              f"; unseen classes zero-shot {metrics['test_unseen_zero_shot_accuracy']:.4f}"
              if "test_unseen_zero_shot_accuracy" in metrics else ""))
    _print_registration(summary)


def run_pipeline(config: PipelineConfig) -> None:
    """The retraining pipeline: distill, PBT on the student, sparsity fine-tuning, a fallback
    cascade of the sparse student and the teacher; register and promote it. Ends at once when
    the champion came from the same data, config and code."""
    from flows.pipeline import pipeline

    summary = _exit_on_data_error(lambda: pipeline(config))
    if summary.skipped:
        print(f"\nnothing to retrain: the champion came from the same data, config and code "
              f"(MLflow run {summary.run_id})")
        return
    print("\n" + "\n".join(
        f"{step.name:>9}: test {step.test_accuracy:.4f}" + (
            "" if step.zero_fraction is None else f", exact zeros {step.zero_fraction:.3f}")
        for step in summary.steps))
    metrics = summary.fallback.metrics
    print(f"{'cascade':>9}: test {summary.test_accuracy:.4f}; the student answers "
          f"{metrics['test_student_share']:.0%}, {metrics['ms_per_image_b1']:.3f} ms per image "
          f"at batch 1 (teacher {metrics['teacher_ms_per_image_b1']:.3f})")
    _print_registration(summary)


def _exit_on_model_error(config, call):
    """Runs `call()`; a model version that does not load, like bad input, exits with code 2."""
    from mlflow.exceptions import MlflowException

    try:
        return _exit_on_data_error(call)
    except MlflowException as error:
        print(f"error: cannot load {config.model_uri()}: {error.message}", file=sys.stderr)
        raise SystemExit(2) from None


def run_predict(config: PredictConfig) -> None:
    """Print the label and confidence a registered model gives each image of a file or folder."""
    from tasks.adapters.prediction import predict_images

    table, skipped = _exit_on_model_error(config, lambda: predict_images(config))
    print(table.to_string(index=False, formatters={"confidence": "{:.4f}".format}))
    if skipped:
        print(f"skipped {len(skipped)} unreadable images: {', '.join(map(str, skipped[:5]))}",
              file=sys.stderr)


def run_features(config: FeaturesConfig) -> None:
    """Embed images with a registered model (Parquet); recognize them by nearest neighbours.

    With --gallery, --images are recognized against labelled embeddings; --evaluate reports
    the k-NN accuracy on the test split of --data.
    """
    from pathlib import Path

    from tasks import features
    from training.recognition import read_gallery, recognize

    embedder = _exit_on_model_error(config, lambda: features.load_embedder(config.model_uri()))
    if config.images is not None:
        def embed_and_recognize():
            table = features.embed_images(embedder, config.images, config.skip_bad_images)
            accuracy = None
            if config.gallery is not None:
                table, accuracy = recognize(table, *read_gallery(Path(config.gallery)),
                                            config.k)
            return table, accuracy

        table, accuracy = _exit_on_data_error(embed_and_recognize)
        out = features.write_table(table, Path(config.out))
        print(f"{len(table)} embeddings of {len(table.embedding.iloc[0])} values -> {out}")
        if config.gallery is not None:
            shown = table[["path", "label", "recognized_label", "similarity"]]
            print(shown.to_string(index=False, max_rows=20,
                                  formatters={"similarity": "{:.4f}".format}))
            if accuracy is not None:
                print(f"recognition accuracy ({config.k}-NN against {config.gallery}): "
                      f"{accuracy:.4f}")
    if config.evaluate:
        result = _exit_on_data_error(lambda: features.recognition_accuracy(
            embedder, config, config.k))
        print(f"test split of {config.data}: {config.k}-NN recognition accuracy "
              f"{result['knn_accuracy']:.4f} against {int(result['gallery_images'])} training "
              f"embeddings ({int(result['test_images'])} test images; the classifier's own "
              f"accuracy {result['classifier_accuracy']:.4f})")


def _move_alias(call) -> None:
    from tasks.adapters.aliases import RegistryError

    try:
        print(call())
    except RegistryError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def run_promote(config: PromoteConfig) -> None:
    """Make a registered model version champion by hand (who and why recorded on the
    versions)."""
    from tasks.adapters.aliases import promote_by_hand

    _move_alias(lambda: promote_by_hand(config.registered_name(), config.version, config.reason,
                                        config.by))


def run_rollback(config: RollbackConfig) -> None:
    """Give the champion alias back to the version that held it before the current one."""
    from tasks.adapters.aliases import rollback

    _move_alias(lambda: rollback(config.registered_name(), config.reason, config.by))


def run_registry(config: RegistryConfig) -> None:
    """Show who holds a registered model's lock and its champion's last moves (status), or
    remove a lock whose holder is gone (unlock; a lease also expires by itself)."""
    from tasks.adapters.aliases import registry_status, unlock_by_hand

    name = config.registered_name()
    _move_alias(lambda: registry_status(name) if config.action == "status"
                else unlock_by_hand(name))


def run_serve(config: ServeConfig) -> None:
    """Serve a registered model's champion over HTTP (MLflow's scoring server), following the
    alias: when the registry crowns another version, the server restarts on it."""
    from tasks.adapters.serve import follow_champion

    follow_champion(config)


def run_splits(config: SplitsConfig) -> None:
    """Print every image's split as CSV (`path,split`): train, val, test, or unused (left out
    by --train-limit / --test-limit); the path is relative to --data (Fashion-MNIST: train/N,
    test/N)."""
    import csv

    from tasks.data import source_contents, source_keys, split_assignment

    def rows():
        keys = source_keys(config)
        return zip(keys, split_assignment(config, keys, source_contents(config)), strict=True)

    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["path", "split"])
    writer.writerows(_exit_on_data_error(rows))


def run_gc(config: GcConfig) -> None:
    """Free the artifacts of old runs (checkpoints, banks, reports) from the artifact store,
    its DVC cache and the DVC remote, keeping those of the last --keep runs of each
    experiment, of running runs and of every registered version's runs."""
    from tasks.adapters.retention import collect

    freed = collect(config)
    free, drop = ("would free", "would drop") if config.dry_run else ("freed", "dropped")
    for path in freed.files:
        print(f"  {path}")
    print(f"{free} {len(freed.files)} files ({freed.bytes / 1e6:.1f} MB here) and "
          f"{freed.hashes} objects in the DVC cache and remote, {drop} {freed.results} cached "
          f"task results; kept the artifacts of {freed.kept_runs} runs, not of "
          f"{freed.removed_runs}")


def prepare_data() -> None:
    """Install Fashion-MNIST into data/, track it with data.dvc and push it to the remote."""
    from tasks.adapters.versioning import project_data_status, track_project_data
    from tasks.data import install_fashion_mnist

    written = install_fashion_mnist()
    ref = track_project_data()
    status = project_data_status()
    print(f"data: {len(written)} files unpacked; data.dvc md5 {ref.md5}; pushed to the DVC "
          f"remote; dvc status: {status or 'up to date'}")


COMMANDS = [
    Command("train", "tasks.configs.train:TrainConfig", run_train),
    Command("distill", "tasks.configs.distill:DistillConfig", run_distill),
    Command("pbt", "tasks.configs.pbt:PBTConfig", run_pbt),
    Command("sparsify", "tasks.configs.sparsify:SparsifyConfig", run_sparsify),
    Command("cascade", "tasks.configs.cascade:CascadeConfig", run_cascade),
    Command("image-text", "tasks.configs.image_text:ImageTextConfig", run_image_text),
    Command("pipeline", "tasks.configs.pipeline:PipelineConfig", run_pipeline),
    Command("predict", "tasks.adapters.prediction:PredictConfig", run_predict),
    Command("features", "tasks.features:FeaturesConfig", run_features),
    Command("promote", "tasks.adapters.aliases:PromoteConfig", run_promote),
    Command("rollback", "tasks.adapters.aliases:RollbackConfig", run_rollback),
    Command("registry", "tasks.adapters.aliases:RegistryConfig", run_registry),
    Command("serve", "tasks.adapters.serve:ServeConfig", run_serve),
    Command("splits", "tasks.configs.sections:SplitsConfig", run_splits),
    Command("gc", "tasks.adapters.retention:GcConfig", run_gc),
    Command("prepare-data", None, prepare_data),
]
