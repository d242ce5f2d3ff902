"""The `pbt` flow: population-based training with weight copy and hyperparameter exploration.

N members warm up with the same hyperparameters; then, stage by stage, each trains one round
with its own hyperparameters, all are scored on the validation split, the best member's
checkpoint becomes every member's starting point, the best keeps its hyperparameters and the
others draw new ones around the best's (`training/pbt.py`). Members of a stage are tasks
submitted together: in turn in-process, in parallel on a Dask cluster (`--runner dask`). A
member that still fails after its retry is recorded and left out of the stage. The final model
is the last stage's best member: tested, registered and promoted as in `train`.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.train import prepare, run_tags
from tasks import tracking
from tasks.config import PBTConfig
from tasks.data import DatasetRef
from tasks.features import recognition_test
from tasks.pbt import (
    HYPERPARAMETERS,
    MemberResult,
    member_config,
    scored_weights,
    search_spaces,
    train_member,
    write_lineage,
)
from tasks.registration import Registration, register_and_promote
from tasks.reporting import publish_summary
from tasks.runners import submitter, task_runner, worker_threads
from tasks.training import classifier_config, run_key, test_and_export
from tasks.versioning import ArtifactRef
from training.pbt import best_member, explore, initial_hyperparameters

FLOW_NAME = "pbt"


class PopulationResult(BaseModel):
    """The population after its last stage."""

    model_config = ConfigDict(frozen=True)

    best: MemberResult
    hyperparameters: dict[str, float]
    stages: int
    lineage: list[dict[str, Any]]
    lineage_log: ArtifactRef


class PBTSummary(BaseModel):
    """What a `pbt` run gives back."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    population: PopulationResult
    test_accuracy: float
    knn_accuracy: float
    registration: Registration


def lineage_figure(lineage: list[dict[str, Any]]):
    """Each member's hyperparameters and validation accuracy across stages."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    names = [*HYPERPARAMETERS, "score"]
    figure, axes = pyplot.subplots(1, len(names), figsize=(4 * len(names), 3.2))
    members = sorted({r["member"] for r in lineage})
    for member in members:
        rows = [r for r in lineage if r["member"] == member and r["phase"] == "stage"]
        for axis, name in zip(axes, names, strict=True):
            values = [r["score"] if name == "score" else r["hyperparameters"][name]
                      for r in rows]
            axis.plot([r["stage"] for r in rows], values, marker="o", label=f"member {member}")
    for axis, name in zip(axes, names, strict=True):
        axis.set_title("validation accuracy" if name == "score" else name)
        axis.set_xlabel("stage")
        if name in ("lr", "weight_decay"):
            axis.set_yscale("log")
    axes[-1].legend(fontsize=7)
    figure.tight_layout()
    return figure


@flow(name="pbt-population", description="The warm-up and the stages of `pbt`.")
def pbt_population(config: PBTConfig, dataset: DatasetRef, member_runs: list[str]
                   ) -> PopulationResult:
    """Warm-up, then stages of train / evaluate / copy / explore; see the module docstring."""
    logger = get_run_logger()
    submit = submitter(config)
    threads = worker_threads(config, config.threads)
    base = classifier_config(config.model_copy(update={"threads": threads}))
    population = run_key(config, dataset)
    members = config.members
    total_epochs = config.warmup_epochs + config.stages * config.round_epochs
    rng = random.Random(config.seed)
    spaces = search_spaces(config)
    hyperparameters = [{name: getattr(base, name) for name in HYPERPARAMETERS}] * members
    checkpoints: list[Any] = [None] * members
    parents: list[int | None] = [None] * members
    lineage: list[dict[str, Any]] = []

    def run_round(phase: str, index: int, first_epoch: int, epochs: int
                  ) -> list[MemberResult | None]:
        # the warm-up follows one cosine over the whole run at the preset learning rate; the
        # stages start a new one at each member's own rate, decaying to zero at the last stage
        cycle = ((0, total_epochs) if phase == "warmup" else
                 (stages_from, stages_from + config.stages * config.round_epochs))
        futures = [submit(train_member, member_config(base, m, hyperparameters[m]), dataset,
                          population, m, phase, index, first_epoch, epochs, cycle,
                          checkpoints[m], config.average_decay) for m in range(members)]
        results: list[MemberResult | None] = []
        for m, future in enumerate(futures):
            try:
                results.append(future.result())
            except Exception as error:  # retried once already: record it, go on without it
                logger.warning("member %d failed in %s %d: %s", m, phase, index, error)
                results.append(None)
                lineage.append({"phase": phase, "stage": index, "member": m,
                                "parent": parents[m], "hyperparameters": hyperparameters[m],
                                "score": None, "error": f"{type(error).__name__}: {error}"})
        for m, result in enumerate(results):
            if result is None:
                continue
            lineage.append({"phase": phase, "stage": index, "member": m, "parent": parents[m],
                            "hyperparameters": hyperparameters[m],
                            "score": result.metrics["val_accuracy"]})
            step = index if phase == "stage" else index - config.warmup_epochs
            tracking.log_metrics(member_runs[m], result.metrics | {
                f"hp_{k}": v for k, v in hyperparameters[m].items()}, step=step)
        return results

    best_val, stale, epoch = -1.0, 0, 0
    for epoch in range(1, config.warmup_epochs + 1):
        results = run_round("warmup", epoch, epoch - 1, 1)
        checkpoints = [r.checkpoint if r else c for r, c in zip(results, checkpoints,
                                                                 strict=True)]
        val = max(r.metrics["val_accuracy"] for r in results if r)
        best_val, stale = (val, 0) if val > best_val else (best_val, stale + 1)
        if config.warmup_patience is not None and stale >= config.warmup_patience:
            logger.info("warm-up stops after epoch %d: no better validation accuracy", epoch)
            break
    first_epoch, best_score, stale = epoch, -1.0, 0
    stages_from = epoch  # the epoch the stages start at
    hyperparameters = [hyperparameters[0] | drawn for drawn in initial_hyperparameters(
        spaces, members, rng)]  # stage 1: every member starts from different values
    best_result, best_hyperparameters, stage = None, hyperparameters[0], 0
    for stage in range(1, config.stages + 1):
        results = run_round("stage", stage, first_epoch, config.round_epochs)
        first_epoch += config.round_epochs
        best = best_member([r.metrics["val_accuracy"] if r else None for r in results])
        best_result, best_hyperparameters = results[best], hyperparameters[best]
        score = best_result.metrics["val_accuracy"]
        logger.info("stage %d: best member %d, validation %.4f, %s", stage, best, score,
                    ", ".join(f"{k}={v:.4g}" for k, v in best_hyperparameters.items()))
        tracking.log_dict(member_runs[best], {"stage": stage, **best_hyperparameters},
                          f"best/stage-{stage:03d}.json")
        lineage_log = write_lineage(population, lineage)
        best_score, stale = (score, 0) if score > best_score else (best_score, stale + 1)
        if (config.target_accuracy is not None and score >= config.target_accuracy) or \
                (config.stage_patience is not None and stale >= config.stage_patience):
            logger.info("stop after stage %d (validation %.4f)", stage, score)
            break
        # exploit: every member starts the next stage from the best's checkpoint
        checkpoints = [best_result.checkpoint] * members
        parents = [best] * members
        # explore: the best keeps its values, the others draw around them
        hyperparameters = [best_hyperparameters if m == best else
                           explore(best_hyperparameters, spaces, rng, *config.explore_factors,
                                   linear_step=config.explore_step) for m in range(members)]
    return PopulationResult(best=best_result, hyperparameters=best_hyperparameters,
                            stages=stage, lineage=lineage, lineage_log=lineage_log)


@flow(name=FLOW_NAME, description="Population-based training: members train in stages, the "
      "best's weights are copied to all and the others explore hyperparameters around its; "
      "the final best is registered and promoted if it beats the champion.")
def pbt(config: PBTConfig) -> PBTSummary:
    """Runs the population, then tests, registers and promotes its best member."""
    name = config.registered_name(FLOW_NAME)
    run_name = f"{FLOW_NAME}-{config.model}-x{config.members}-seed{config.seed}"
    with tracking.tracked_run(FLOW_NAME, run_name, config, run_tags(config)) as run_id:
        dataset = prepare(config, run_id)
        member_runs = [tracking.start_run(FLOW_NAME, f"member-{m}", parent_run_id=run_id)
                       for m in range(config.members)]
        try:
            population = pbt_population.with_options(task_runner=task_runner(config))(
                config, dataset, member_runs)
        finally:
            for member_run in member_runs:
                tracking.end_run(member_run)
        lineage = population.lineage
        tracking.log_dict(run_id, {"lineage": lineage}, "pbt/lineage.json")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "lineage.jsonl"
            path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lineage))
            tracking.log_file(run_id, path, "pbt")
        tracking.log_figure(run_id, lineage_figure(lineage), "pbt/lineage.png")
        best_config = member_config(classifier_config(config), population.best.member,
                                    population.hyperparameters)
        test = test_and_export(best_config, dataset, population.best.checkpoint,
                               scored_weights(config.average_decay))
        tracking.log_metrics(run_id, test.metrics | {
            "val_accuracy": population.best.metrics["val_accuracy"],
            "stages_run": population.stages} | {
            f"best_{k}": v for k, v in population.hyperparameters.items()})
        tracking.log_artifact_refs(run_id, {"program": test.program,
                                            "checkpoint.best": population.best.checkpoint,
                                            "lineage": population.lineage_log})
        registration = register_and_promote(run_id, name, dataset, test.program)
        recognition = recognition_test(f"models:/{name}/{registration.version}", dataset,
                                       config.knn_k)
        tracking.log_metrics(run_id, {"test_knn_accuracy": recognition["knn_accuracy"]})
        summary = PBTSummary(run_id=run_id, population=population,
                             test_accuracy=test.metrics["test_accuracy"],
                             knn_accuracy=recognition["knn_accuracy"],
                             registration=registration)
    markdown = publish_summary("pbt-summary", f"pbt: {config.members} x {config.model} on "
                               f"{config.data}", {
        "test accuracy": f"{summary.test_accuracy:.4f}",
        f"test accuracy by {config.knn_k}-NN on embeddings": f"{summary.knn_accuracy:.4f}",
        "best member (validation)": f"{population.best.member} "
                                    f"({population.best.metrics['val_accuracy']:.4f})",
        "hyperparameters": ", ".join(f"{k}={v:.4g}" for k, v in
                                     population.hyperparameters.items()),
        "stages": str(population.stages),
        "model": f"{name} version {registration.version}, alias `{registration.alias}`",
        "decision": registration.decision,
        "MLflow run": run_id,
    })
    get_run_logger().info("summary\n%s", markdown)
    return summary
