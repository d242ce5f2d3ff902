"""The skeleton every flow shares, in one place: prepare the data (and its raw-pixel baselines)
inside the run's MLflow run, fit the budget to the data, train a classifier's rounds with early
stopping, then test, export, register and promote the final model, gated on the baselines, and
publish a summary.

A flow opens with `begun_run` (its MLflow run, the data prepared) and adds only its own
training before `finish`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from prefect import get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from tasks.adapters import tracking
from tasks.adapters.locks import run_slot
from tasks.adapters.registration import Policy, Registration
from tasks.adapters.reporting import publish_summary
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.image_text import unseen_labels
from tasks.configs.sections import (
    ClassifierConfig,
    FormerNameWarning,
    ProfiledConfig,
    RunSection,
    classifier_config,
)
from tasks.configs.sparsify import SparsitySpec
from tasks.data import DatasetRef, pixel_baselines, prepare_dataset, source_version
from tasks.promotion import register_and_promote
from tasks.rounds import RoundPlan, RoundResult, round_task
from tasks.training import ClassifierRound, TestResult, test_and_export
from training.baselines import best_baseline, mirror_safe
from training.budget import Budget, fit_to_data
from training.promotion import Baseline
from training.recipe import EarlyStopping

ConfigT = TypeVar("ConfigT", bound=ProfiledConfig)


class Prepared(BaseModel):
    """A run's data set, the raw-pixel baselines on its splits, and what the data decided."""

    model_config = ConfigDict(frozen=True)

    dataset: DatasetRef
    baselines: dict[str, float]
    flip: bool

    def apply(self, config: ConfigT) -> ConfigT:
        """`config` with the data's choices filled in: `flip` `on` or `off` for `auto`."""
        return config.replace(flip="on" if self.flip else "off")


class Finished(BaseModel):
    """The final model's test metrics, exported program and registration."""

    model_config = ConfigDict(frozen=True)

    test: TestResult
    registration: Registration
    baseline: Baseline

    @property
    def test_accuracy(self) -> float:
        return self.test.metrics["test_accuracy"]


class BestRound(BaseModel):
    """A summary's kept round, `best_round` (from 1); `best_epoch`, its former name, reads it
    for one release."""

    model_config = ConfigDict(frozen=True)

    best_round: int

    @property
    def best_epoch(self) -> int:
        warnings.warn("best_epoch is now best_round; the old name is accepted until the next "
                      "release", FormerNameWarning, stacklevel=2)
        return self.best_round


class ClassifierSummary(BestRound):
    """What a run that trains one classifier in rounds gives back (`train`, `sparsify`)."""

    run_id: str
    val_accuracy: float
    test_accuracy: float
    baselines: dict[str, float]
    registration: Registration


def run_tags(config: ProfiledConfig) -> dict[str, str]:
    """The tags every flow's MLflow run gets: its Prefect flow run, and the config's profile."""
    return {"prefect.flow_run_id": str(flow_run.get_id() or "none"),
            "profile": config.profile}


@contextmanager
def tracked_flow_run(config: ProfiledConfig, experiment: str, run_name: str, registered: str,
                     tags: dict[str, str] | None = None) -> Iterator[str]:
    """A flow's own MLflow run (`tracking.tracked_run`, tagged `run_tags` and `tags`); a run
    that registers holds `registered`'s run slot for its whole length, so a second run of the
    same model (from the command line, a deployment or a schedule, on any machine sharing the
    MLflow server) waits for it (`tasks.adapters.locks.run_slot`)."""
    all_tags = run_tags(config) | (tags or {})
    slot = (run_slot(registered, f"{run_name}, Prefect flow run {all_tags['prefect.flow_run_id']}")
            if config.run.registry else nullcontext())
    with slot, tracking.tracked_run(experiment, run_name, config, all_tags) as run_id:
        yield run_id


class BegunRun(NamedTuple, Generic[ConfigT]):
    """A flow's run once its prologue is done: its MLflow run, the registered model's name,
    the prepared data, and the config with the data's choices applied."""

    run_id: str
    name: str
    prepared: Prepared
    config: ConfigT


@contextmanager
def begun_run(config: ConfigT, flow_name: str, run_name: str, model_name: str | None = None,
              tags: dict[str, str] | None = None) -> Iterator[BegunRun[ConfigT]]:
    """Every flow's prologue: the registered name (`model_name`'s in the project, default the
    flow's), the flow's MLflow run in its experiment holding that name's run slot
    (`tracked_flow_run`), the data prepared in it (`prepare`) and applied to the config.
    `with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):`."""
    name = config.run.registered_name(model_name or flow_name)
    with tracked_flow_run(config, config.run.experiment(flow_name), run_name, name,
                          tags) as run_id:
        prepared = prepare(config, run_id)
        yield BegunRun(run_id, name, prepared, prepared.apply(config))


def prepare(config: ProfiledConfig, run_id: str) -> Prepared:
    """Prepares the run's data set, records its version, and logs the raw-pixel baselines
    (`baseline_knn_val_accuracy`, ...) on the run."""
    data = config.dataset
    dataset = prepare_dataset(data, source_version(data))
    tracking.log_artifact_refs(run_id, {"dataset": dataset.artifact})
    tracking.log_dataset(run_id, Path(config.dataset.data).name, dataset.artifact.md5,
                         dataset.artifact.path, dataset.sizes)
    tracking.set_tags(run_id, {"data.version": dataset.version, "data.skipped_images":
                               len(dataset.skipped), "data.classes": ",".join(dataset.classes)})
    tracking.log_metrics(run_id, {f"data_{k}_images": v for k, v in dataset.sizes.items()})
    baselines = pixel_baselines(dataset, *label_budget(config, dataset.classes))
    tracking.log_metrics(run_id, {f"baseline_{k}": v for k, v in baselines.items()})
    logger = get_run_logger()
    logger.info("raw-pixel baselines: k-NN validation %.4f, linear validation %.4f (fitted on "
                "%d labelled training images, chosen on %d validation images)",
                baselines["knn_val_accuracy"], baselines["linear_val_accuracy"],
                baselines["train_images"], baselines["val_images"])
    flip = config.optim.flip == "on" or (config.optim.flip == "auto" and mirror_safe(
        baselines, len(dataset.classes)))
    tracking.set_tags(run_id, {"augment.flip": "on" if flip else "off"})
    if config.optim.flip == "auto":
        logger.info("flips %s: k-NN keeps %.4f of %.4f on mirrored validation images", "on"
                    if flip else "off", baselines["knn_val_mirrored_accuracy"],
                    baselines["knn_val_accuracy"])
    return Prepared(dataset=dataset, baselines=baselines, flip=flip)


def label_budget(config: ProfiledConfig, classes: list[str]
                 ) -> tuple[int | None, int, tuple[int, ...]]:
    """The labels a run holds, as `pixel_baselines` takes them: `labels_per_class` (None:
    every label), the split seed its draw uses, and the labels of the classes it never trains
    on (`unseen_classes`); a flow without those fields holds every label."""
    unseen = unseen_labels(config, classes) if hasattr(config, "unseen_classes") else None
    return (getattr(config, "labels_per_class", None), config.dataset.split_seed,
            tuple(unseen.tolist()) if unseen is not None else ())


def log_budget(run_id: str, budget: Budget, prefix: str = "") -> None:
    """Records how the budget was fitted to the data (`budget_batch_size`, `budget_repeats`,
    `budget_steps`, ...)."""
    tracking.log_metrics(run_id, {f"{prefix}budget_{k}": v for k, v in {
        "batch_size": budget.batch_size, "repeats": budget.repeats, "rounds": budget.rounds,
        "epochs": budget.epochs, "steps": budget.steps}.items()})


def budgeted_classifier(config: ProfiledConfig, prepared: Prepared, run_id: str, rounds: int
                        ) -> tuple[ClassifierConfig, Budget]:
    """The budget of `rounds` rounds of `config` on the prepared data (logged), and the
    classifier part of `config` with that budget's batch."""
    budget = fit_to_data(config, prepared.dataset, rounds)
    log_budget(run_id, budget)
    return classifier_config(config).replace(
        batch_size=budget.batch_size, rounds=rounds), budget


def run_rounds(rounds: int, plan_of: Callable[[int, ArtifactRef | None], RoundPlan],
               run_id: str, patience: int | None, val_images: int, key: str = "val_accuracy",
               name: str = "checkpoint", first_step: int = 0, keep_from: int = 0,
               previous: ArtifactRef | None = None, round_name: str = "round",
               metrics_prefix: str = "", keep_last: bool = False,
               train: Callable[[RoundPlan, ArtifactRef | None], RoundResult] = round_task
               ) -> RoundResult:
    """Runs the round task (`tasks.rounds.round_task`, or `train`) on
    `plan_of(index, previous)` (`index` from 0) from the previous round's checkpoint (the
    first from `previous`) for up to `rounds` rounds, logging each round's metrics (named
    `<metrics_prefix><metric>`, at step `first_step` + the round's number) and checkpoint (as
    `<name>.<round_name>-NNN`), with early stopping on the metric `key` after `patience` rounds
    below the best; returns the round to keep (`training.recipe.EarlyStopping`), or with
    `keep_last` the last one (a warm start, an alignment phase: no choice to make). Rounds
    before `keep_from` (0-based) are neither kept nor counted by the early stopping."""
    logger = get_run_logger()
    stopping = EarlyStopping(patience, val_images)
    best = result = None
    for index in range(rounds):
        result = train(plan_of(index, previous), previous)
        tracking.log_metrics(run_id, {f"{metrics_prefix}{k}": v
                                      for k, v in result.metrics.items()},
                             step=first_step + index + 1)
        tracking.log_artifact_refs(run_id, {f"{name}.{round_name}-{index + 1:03d}":
                                            result.checkpoint})
        logger.info("round %d/%d: %s", index + 1, rounds, ", ".join(
            f"{k}={v:.4g}" for k, v in result.metrics.items()))
        previous = result.checkpoint
        if keep_last or index < keep_from:
            continue
        if stopping.update(index, result.metrics[key]):
            best = result
        if stopping.should_stop:
            logger.info("early stop: %d rounds below the best %s", stopping.stale, key)
            break
    return result if keep_last else best


def train_classifier_rounds(classifier: ClassifierConfig, prepared: Prepared, budget: Budget,
                            run_id: str, patience: int | None, run_name: str = "train",
                            sparsity: SparsitySpec | None = None,
                            start: ArtifactRef | None = None, name: str = "checkpoint",
                            first_step: int = 0) -> RoundResult:
    """The classifier's rounds of `budget` (`run_rounds`: early stopping on validation
    accuracy, checkpoints logged as `<name>.round-NNN`, metrics from step `first_step` + 1);
    the round to keep. `sparsity` adds the `sparsify` flow's activation-sparsity term to the
    loss; `start`: weights to fine-tune instead of a fresh network."""
    return run_rounds(classifier.rounds, lambda index, _previous: ClassifierRound(
        config=classifier, dataset=prepared.dataset, round=index, run_name=run_name,
        repeats=budget.repeats, sparsity=sparsity, start=start),
        run_id, patience, prepared.dataset.sizes["val"], name=name, first_step=first_step)


def judge_baseline(run_id: str, prepared: Prepared, val_accuracy: float) -> Baseline:
    """The stronger raw-pixel baseline set beside the model's validation accuracy (tagged on
    the run as `baseline.beaten`, and `baseline.passed`: not below its 95% Wilson interval,
    what the gate asks)."""
    name, baseline_val = best_baseline(prepared.baselines)
    read = prepared.baselines.get("val_images", prepared.dataset.sizes["val"])  # K per class
    baseline = Baseline(name=name, val_accuracy=baseline_val, model_val_accuracy=val_accuracy,
                        val_images=max(int(read), 1))
    tracking.set_tags(run_id, {"baseline.beaten": str(baseline.beaten).lower(),
                               "baseline.passed": str(baseline.passed).lower()})
    return baseline


def finish(run_id: str, name: str, run: RunSection, classifier: ClassifierConfig,
           prepared: Prepared, checkpoint: ArtifactRef, val_accuracy: float,
           weights: str = "model") -> Finished:
    """Tests and exports the checkpoint's `weights`; unless the run may not register
    (`run.registry` false), registers the program and promotes it only if it beats the
    champion, (with `run.baseline_gate`) the stronger raw-pixel baseline on validation and (with
    `run.max_latency_ms`) the latency budget."""
    test = test_and_export(classifier, prepared.dataset, checkpoint, weights)
    tracking.log_metrics(run_id, test.metrics | {"val_accuracy": val_accuracy})
    tracking.log_artifact_refs(run_id, {"program": test.program, "checkpoint.final": checkpoint})
    return conclude(run_id, run, prepared, val_accuracy, test, lambda refusal: (
        register_and_promote(run_id, name, prepared.dataset, test.program, Policy.of(run),
                             refusal)))


def conclude(run_id: str, run: RunSection, prepared: Prepared, val_accuracy: float,
             test: TestResult, register: Callable[[str | None], Registration]) -> Finished:
    """How every flow ends: the model's validation accuracy judged against the raw-pixel
    baselines (`judge_baseline`), then `register(refusal)` with the gate's refusal when
    `run.baseline_gate` is on and the model is below them (registered, never champion),
    else None. `finish` is this for a classifier's exported program; a flow whose model is
    not one (a cascade, an image-text network, the pipeline's fallback pair) tests it its own
    way and registers its own pyfunc."""
    baseline = judge_baseline(run_id, prepared, val_accuracy)
    registration = register(baseline.refusal() if run.baseline_gate else None)
    return Finished(test=test, registration=registration, baseline=baseline)


def publish(key: str, title: str, run_id: str, finished: Finished,
            rows: dict[str, object], table: str = "") -> str:
    """Publishes and logs the run's summary: the flow's own `rows`, then the test accuracy
    beside the baselines and the registry's decision; `table`: markdown after them."""
    registration, baseline = finished.registration, finished.baseline
    markdown = publish_summary(key, title, {
        "test accuracy": f"{finished.test_accuracy:.4f}",
        **rows,
        f"raw-pixel {baseline.name} baseline (validation)":
            f"{baseline.val_accuracy:.4f} against the model's {baseline.model_val_accuracy:.4f}"
            + ("" if baseline.beaten else " (within its 95% Wilson interval)" if baseline.passed
               else ": **below its 95% Wilson interval**"),
        "model": registration.describe(),
        "decision": registration.decision,
        "MLflow run": run_id,
    }, table)
    get_run_logger().info("summary\n%s", markdown)
    return markdown
