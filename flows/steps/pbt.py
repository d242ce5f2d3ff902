"""The `pbt` step: the population (`pbt_population`, a subflow of burn-in and stages of train /
evaluate / copy / explore) on the prepared data, from given weights where the `pipeline` hands
its student on, its members' runs and lineage logged (`population_step`), which the `pbt` flow
and the `pipeline` both run."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.skeleton import Prepared, budgeted_classifier
from tasks.adapters import tracking
from tasks.adapters.runners import submitter, task_runner, worker_threads
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.pbt import PBTConfig
from tasks.configs.sections import ClassifierConfig, classifier_config
from tasks.data import DatasetRef
from tasks.pbt import (
    HYPERPARAMETERS,
    LAST_WEIGHTS,
    MemberRound,
    exploit_weights,
    member_config,
    member_round,
    soup_members,
    write_lineage,
)
from tasks.rounds import RoundResult
from tasks.training import run_key
from training.budget import Budget
from training.pbt.population import (
    MemberStart,
    PopulationRound,
    PopulationSettings,
    run_population,
)
from training.pbt.scheduler import population_scheduler

# What the `pbt` flow, the `pipeline` and the benchmarks may import (tests/test_layering.py):
# the technique's name (its flow's, and the experiment its members' runs go to), the
# population from given weights (`population_step`) and what it gives back.
__all__ = ["FLOW_NAME", "PopulationResult", "population_step"]

FLOW_NAME = "pbt"


class PopulationResult(BaseModel):
    """The population after its last stage."""

    model_config = ConfigDict(frozen=True)

    best: RoundResult
    best_member: int  # whose round (or whose soup) `best` is
    hyperparameters: dict[str, float]
    stages: int
    lineage: list[dict[str, Any]]
    lineage_log: ArtifactRef
    val_images: int  # what the scores were measured on (their ties, `training.pbt.scheduler`)


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


@flow(name="pbt-population", description="The burn-in and the stages of `pbt`.")
def pbt_population(config: PBTConfig, dataset: DatasetRef, member_runs: list[str],
                   batch_size: int, repeats: int, start: ArtifactRef | None = None
                   ) -> PopulationResult:
    """Burn-in, then stages of train / evaluate / copy / explore; see the module docstring.

    Every round of the config is `repeats` passes at `batch_size` images (the budget fitted to
    the data set, `training.budget`). `start`: weights every member starts from (a checkpoint
    of `model` weights only, e.g. the `pipeline`'s distilled student) instead of its seed's
    initialization."""
    logger = get_run_logger()
    submit = submitter(config.cluster)
    threads = worker_threads(config.cluster, config.run.threads)
    base = classifier_config(config.replace(threads=threads, batch_size=batch_size))
    population = run_key(config, dataset) + ("" if start is None else f"-from-{start.md5[:12]}")
    burn_in_values = {name: getattr(base.optim, name) for name in HYPERPARAMETERS}

    def train(round_: PopulationRound, starts: Sequence[MemberStart]):
        futures = [submit(member_round, MemberRound(
            config=member_config(base, s.member, s.hyperparameters), dataset=dataset,
            population=population, member=s.member, phase=round_.phase, index=round_.index,
            first_epoch=round_.first, epochs=round_.passes, cycle=round_.cycle,
            average_decay=round_.average_decay, weights=s.weights), s.checkpoint)
            for s in starts]
        return [future.result for future in futures]

    def on_member(m: int, round_: PopulationRound, result: RoundResult,
                  hyperparameters: dict[str, float]) -> None:
        step = round_.index if round_.phase == "stage" else \
            round_.index - config.burn_in_rounds
        tracking.log_metrics(member_runs[m], result.metrics | {
            f"hp_{k}": v for k, v in hyperparameters.items()}, step=step)

    logs: list[ArtifactRef] = []

    def on_stage(stage: int, best: int, values: dict[str, float],
                 lineage: list[dict[str, Any]]) -> None:
        tracking.log_dict(member_runs[best], {"stage": stage, **values},
                          f"best/stage-{stage:03d}.json")
        logs.append(write_lineage(population, lineage))

    def soup(trained: list[RoundResult], members: list[int], first: int) -> RoundResult:
        return submit(soup_members, base, dataset, population, trained, members,
                      first).result()

    settings = PopulationSettings(
        members=config.members, burn_in_rounds=config.burn_in_rounds,
        burn_in_patience=config.burn_in_patience, stages=config.stages,
        stage_rounds=config.stage_rounds, repeats=repeats, average_decay=config.average_decay,
        target_accuracy=config.target_accuracy, stage_patience=config.stage_patience,
        soup=config.soup)
    result = run_population(
        settings, lambda: population_scheduler(config, config.members, burn_in_values,
                                               dataset.sizes["val"]),
        burn_in_values, start, train, exploit_weights, LAST_WEIGHTS, on_member, on_stage,
        soup, logger)
    if result.lineage[-1]["phase"] == "soup":  # the lineage log ends with the soup's record
        logs.append(write_lineage(population, result.lineage))
    return PopulationResult(best=result.best, best_member=result.best_member,
                            hyperparameters=result.hyperparameters, stages=result.stages,
                            lineage=result.lineage, lineage_log=logs[-1],
                            val_images=dataset.sizes["val"])


def population_step(config: PBTConfig, prepared: Prepared, run_id: str,
                   start: ArtifactRef | None = None
                   ) -> tuple[ClassifierConfig, PopulationResult, Budget]:
    """The population's budget on the prepared data, its members' runs nested under `run_id`,
    the population itself (`pbt_population`, from `start`'s weights when
    given) and its lineage logged; the best's classifier config, the population and its
    budget."""
    classifier, budget = budgeted_classifier(
        config, prepared, run_id, config.burn_in_rounds + config.stages * config.stage_rounds)
    member_runs = [tracking.start_run(FLOW_NAME, f"member-{m}", parent_run_id=run_id)
                   for m in range(config.members)]
    try:
        runner = task_runner(config.cluster, config.run.device)
        population = pbt_population.with_options(task_runner=runner)(
            config, prepared.dataset, member_runs, budget.batch_size, budget.repeats, start)
    finally:
        for member_run in member_runs:
            tracking.end_run(member_run)
    lineage = population.lineage
    tracking.log_dict(run_id, {"lineage": lineage}, "pbt/lineage.json")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lineage.jsonl"
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lineage))
        tracking.log_file(run_id, path, "pbt")
    tracking.log_artifact_refs(run_id, {"lineage": population.lineage_log})
    tracking.log_figure(run_id, lineage_figure(lineage), "pbt/lineage.png")
    tracking.log_metrics(run_id, {"stages_run": population.stages} | {
        f"best_{k}": v for k, v in population.hyperparameters.items()})
    return member_config(classifier, population.best_member,
                         population.hyperparameters), population, budget
