"""The `distill` step: the teacher, bank and student stages as a subflow (`distill_stages`,
in `training.distill.stages.run_stages`' order) on the plan fitted to the data
(`fitted_plan`, `role_budgets`), which the `distill` flow and the `pipeline` both run."""

from __future__ import annotations

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.skeleton import log_budget, run_rounds
from tasks.adapters import tracking
from tasks.adapters.runners import submitter, worker_threads
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.distill import DistillConfig
from tasks.data import DatasetRef
from tasks.distill import (
    BankSnapshot,
    DistillPlan,
    StudentConfig,
    StudentRound,
    TeacherRound,
    bank_snapshot,
    pretrain_config,
)
from tasks.rounds import RoundResult, round_task
from tasks.training import ClassifierRound
from training.budget import Budget, fit_to_data
from training.distill.stages import run_stages

# What the `distill` flow, the `pipeline` and the benchmarks may import
# (tests/test_layering.py): the stages as a subflow (`distill_stages`), what each stage gives
# back (`StageRecord`), and the plan fitted to the data (`fitted_plan`, `role_budgets`).
__all__ = ["StageRecord", "distill_stages", "fitted_plan", "role_budgets"]


class StageRecord(BaseModel):
    """One stage's results: the teacher's, the bank's (none where the student learns from the
    teacher states themselves) and the student's. With `--targets auto`, every candidate's
    student at this stage (`candidates`) and which of them is `student` (`chosen`)."""

    model_config = ConfigDict(frozen=True)

    teacher: RoundResult
    bank: BankSnapshot | None
    student: RoundResult
    candidates: dict[str, RoundResult] = {}
    chosen: str | None = None

    def candidate_scores(self) -> str:
        """Each candidate's validation accuracy at this stage: `labels 0.9, final ...`."""
        return ", ".join(f"{name} {result.metrics['val_accuracy']:.4f}"
                         for name, result in self.candidates.items())


class _Stages:
    """Submits one stage's tasks to the config's runner; each call gives back a `wait()`
    for the task's result."""

    def __init__(self, config: DistillConfig, plan: DistillPlan, dataset: DatasetRef,
                 pretrained: ArtifactRef | None) -> None:
        self.submit, self.plan, self.dataset = submitter(config.cluster), plan, dataset
        self.pretrained = pretrained

    def teacher(self, stage: int, previous: RoundResult | None):
        return self.submit(round_task, TeacherRound(config=self.plan.teacher,
                                                    dataset=self.dataset, stage=stage),
                           previous.checkpoint if previous else self.pretrained).result

    def snapshot(self, stage: int, teacher: RoundResult, previous: BankSnapshot | None):
        return self.submit(bank_snapshot, self.plan.teacher, self.plan.bank, self.dataset,
                           stage, teacher.checkpoint, previous.bank if previous else None,
                           self.pretrained).result

    def student(self, config: StudentConfig, stage: int, previous: RoundResult | None,
                bank: BankSnapshot | None = None, teacher: ArtifactRef | None = None):
        return self.submit(round_task, StudentRound(
            config=config, dataset=self.dataset, stage=stage,
            bank=bank.bank if bank is not None else None, teacher=teacher,
            teacher_config=None if teacher is None else self.plan.teacher),
            previous.checkpoint if previous else None).result


def _stage_loop(config: DistillConfig, plan: DistillPlan, dataset: DatasetRef,
                on_stage, pretrained: ArtifactRef | None = None) -> list[StageRecord]:
    """The stages in `training.distill.stages.run_stages`' order (the teacher's stage s+1
    beside the student's stage s), each a task submitted to the config's runner. With
    `--targets states` the student's stage s reads teacher state s instead of bank s (no bank
    is written); with `--targets final` every student stage waits for the last teacher
    state; with `labels` it reads no teacher. `--targets auto`: `_candidate_loop`."""
    stages = _Stages(config, plan, dataset, pretrained)
    if plan.candidates:
        records = _candidate_loop(config, plan, stages)
        for record in records:
            on_stage(record)
        return records
    records: list[StageRecord] = []
    targets = plan.student.targets

    def snapshot(stage: int, teacher: RoundResult, previous: BankSnapshot | None):
        return stages.snapshot(stage, teacher, previous)() if targets == "bank" else None

    def recorded(teacher: RoundResult, bank: BankSnapshot | None, student: RoundResult) -> None:
        records.append(StageRecord(teacher=teacher, bank=bank, student=student))
        on_stage(records[-1])

    if targets == "final":
        teachers: list[RoundResult] = []
        for stage in range(1, config.stages + 1):
            teachers.append(stages.teacher(stage, teachers[-1] if teachers else None)())
        student = None
        for stage, teacher in enumerate(teachers, 1):
            student = stages.student(plan.student, stage, student, None,
                                     teachers[-1].checkpoint)()
            recorded(teacher, None, student)
        return records
    teachers_by_stage: dict[int, RoundResult] = {}

    def teacher_then_keep(stage: int, previous: RoundResult | None):
        wait = stages.teacher(stage, previous)

        def kept() -> RoundResult:
            teachers_by_stage[stage] = wait()
            return teachers_by_stage[stage]
        return kept

    run_stages(config.stages, targets == "bank" and plan.bank.mode == "single",
               teacher_then_keep, snapshot,
               lambda stage, previous, bank: stages.student(
                   plan.student, stage, previous, bank, None if targets != "states"
                   else teachers_by_stage[stage].checkpoint), recorded)
    return records


def _candidate_loop(config: DistillConfig, plan: DistillPlan, stages: _Stages
                    ) -> list[StageRecord]:
    """`--targets auto`: one student per candidate (`plan.candidates`), all on the same
    teacher stages. The teacher's stage s+1 runs beside stage s of every candidate that does
    not wait for the last state (`labels`, `states`); the `final` candidates' stages follow
    the last teacher stage. The student kept is the candidate best on validation after the
    last stage (the first of them on a tie, in `AUTO_CANDIDATES`' order)."""
    now = {name: c for name, c in plan.candidates.items() if c.targets != "final"}
    chains: dict[str, list[RoundResult]] = {name: [] for name in plan.candidates}
    teachers: list[RoundResult] = []
    teacher = stages.teacher(1, None)()
    for stage in range(1, config.stages + 1):
        following = stages.teacher(stage + 1, teacher) if stage < config.stages else None
        waits = {name: stages.student(candidate, stage, chains[name][-1] if chains[name]
                                      else None, None, teacher.checkpoint
                                      if candidate.targets == "states" else None)
                 for name, candidate in now.items()}
        for name, wait in waits.items():
            chains[name].append(wait())
        teachers.append(teacher)
        if following is not None:
            teacher = following()
    for name, candidate in plan.candidates.items():
        if name in now:
            continue
        for stage in range(1, config.stages + 1):  # on the last teacher state
            chains[name].append(stages.student(
                candidate, stage, chains[name][-1] if chains[name] else None, None,
                teachers[-1].checkpoint)())
    chosen = max(plan.candidates, key=lambda name: chains[name][-1].metrics["val_accuracy"])
    return [StageRecord(teacher=teacher, bank=None, student=chains[chosen][index],
                        candidates={name: chain[index] for name, chain in chains.items()},
                        chosen=chosen)
            for index, teacher in enumerate(teachers)]


@flow(name="distill-stages", description="The teacher, bank and student stages of `distill`.")
def distill_stages(config: DistillConfig, plan: DistillPlan, dataset: DatasetRef, run_id: str,
                   teacher_run_id: str, student_run_id: str) -> list[StageRecord]:
    """Runs the S stages and logs each one as it finishes (see `_stage_loop`)."""
    logger = get_run_logger()

    def on_stage(record: StageRecord) -> None:
        stage = record.teacher.round
        tracking.log_metrics(teacher_run_id, record.teacher.metrics, step=stage)
        tracking.log_metrics(student_run_id, record.student.metrics, step=stage)
        tracking.log_metrics(student_run_id, {
            f"val_accuracy_{name}": result.metrics["val_accuracy"]
            for name, result in record.candidates.items()}, step=stage)
        bank = record.bank
        if bank is not None:
            tracking.log_metrics(run_id, {"bank_fill_fraction": bank.fill_fraction,
                                          "bank_bytes": bank.nbytes} | {
                f"bank_entries_state_{state}" if state >= 0 else "bank_entries_unfilled": count
                for state, count in bank.state_histogram.items()}, step=stage)
            tracking.log_dict(run_id, {"stage": stage, "fill_fraction": bank.fill_fraction,
                                       "state_histogram": bank.state_histogram,
                                       "artifact": bank.bank.model_dump()},
                              f"banks/stage-{stage:03d}.json")
            tracking.log_artifact_refs(run_id, {f"bank.stage-{stage:03d}": bank.bank})
        tracking.log_artifact_refs(teacher_run_id, {f"checkpoint.stage-{stage:03d}":
                                                    record.teacher.checkpoint})
        tracking.log_artifact_refs(student_run_id, {f"checkpoint.stage-{stage:03d}":
                                                    record.student.checkpoint})
        logger.info("stage %d/%d: teacher val %.4f, %s, student val %.4f "
                    "(loss_ce %.4f, loss_feat %.4f)", stage, config.stages,
                    record.teacher.metrics["val_accuracy"],
                    f"bank filled {bank.fill_fraction:.3f}" if bank is not None
                    else f"targets: {record.chosen} of {record.candidate_scores()}"
                    if record.candidates else f"targets: {config.targets}",
                    record.student.metrics["val_accuracy"], record.student.metrics["loss_ce"],
                    record.student.metrics["loss_feat"])

    return _stage_loop(config, plan, dataset, on_stage,
                       pretrain_teacher(plan, dataset, teacher_run_id))


def pretrain_teacher(plan: DistillPlan, dataset: DatasetRef, teacher_run_id: str
                     ) -> ArtifactRef | None:
    """The teacher's warm start (`--teacher-pretrain-rounds`, logged on the teacher's run as
    `pretrain_*` and `checkpoint.pretrain-NNN`): its last checkpoint, or None."""
    if plan.teacher.pretrain_rounds == 0:
        return None
    config = pretrain_config(plan.teacher)
    return run_rounds(config.rounds, lambda index, _previous: ClassifierRound(
        config=config, dataset=dataset, round=index, run_name="distill-pretrain",
        repeats=plan.teacher.repeats), teacher_run_id, None, dataset.sizes["val"],
        round_name="pretrain", metrics_prefix="pretrain_", keep_last=True).checkpoint


def role_budgets(config: DistillConfig, dataset: DatasetRef) -> dict[str, Budget]:
    """The teacher's and the student's budgets: `stages` rounds over the images each draws
    per stage (`training.budget`)."""
    return {role: fit_to_data(config, dataset, config.stages, round(
        fraction * dataset.sizes["train"])) for role, fraction in (
        ("teacher", config.teacher_fraction), ("student", config.student_fraction))}


def fitted_plan(config: DistillConfig, dataset: DatasetRef, run_id: str) -> DistillPlan:
    """The plan with each role's budget fitted to the data set (logged as `teacher_budget_*`
    and `student_budget_*`) and the worker threads of the runner."""
    budgets = role_budgets(config, dataset)
    for role, budget in budgets.items():
        log_budget(run_id, budget, f"{role}_")
    threads = worker_threads(config.cluster, config.run.threads)
    return DistillPlan.of(config.replace(threads=threads), budgets["teacher"],
                          budgets["student"])
