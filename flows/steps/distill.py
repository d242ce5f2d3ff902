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
    teacher states themselves) and the student's."""

    model_config = ConfigDict(frozen=True)

    teacher: RoundResult
    bank: BankSnapshot | None
    student: RoundResult


def _stage_loop(config: DistillConfig, plan: DistillPlan, dataset: DatasetRef,
                on_stage, pretrained: ArtifactRef | None = None) -> list[StageRecord]:
    """The stages in `training.distill.stages.run_stages`' order (the teacher's stage s+1
    beside the student's stage s), each a task submitted to the config's runner. With
    `--targets states` the student's stage s reads teacher state s instead of bank s (no bank
    is written); with `--targets final` every student stage waits for the last teacher
    state."""
    submit = submitter(config.cluster)
    records: list[StageRecord] = []
    targets = plan.student.targets

    def teacher_stage(stage: int, previous: RoundResult | None):
        return submit(round_task, TeacherRound(config=plan.teacher, dataset=dataset,
                                                stage=stage),
                      previous.checkpoint if previous else pretrained).result

    def snapshot(stage: int, teacher: RoundResult, previous: BankSnapshot | None):
        if targets != "bank":
            return None
        return submit(bank_snapshot, plan.teacher, plan.bank, dataset, stage, teacher.checkpoint,
                      previous.bank if previous else None, pretrained).result()

    def student_stage(stage: int, previous: RoundResult | None, bank: BankSnapshot | None,
                      teacher: ArtifactRef | None = None):
        return submit(round_task, StudentRound(
            config=plan.student, dataset=dataset, stage=stage,
            bank=bank.bank if bank is not None else None, teacher=teacher,
            teacher_config=None if teacher is None else plan.teacher),
            previous.checkpoint if previous else None).result

    def recorded(teacher: RoundResult, bank: BankSnapshot | None, student: RoundResult) -> None:
        records.append(StageRecord(teacher=teacher, bank=bank, student=student))
        on_stage(records[-1])

    if targets == "final":
        teachers: list[RoundResult] = []
        for stage in range(1, config.stages + 1):
            teachers.append(teacher_stage(stage, teachers[-1] if teachers else None)())
        student = None
        for stage, teacher in enumerate(teachers, 1):
            student = student_stage(stage, student, None, teachers[-1].checkpoint)()
            recorded(teacher, None, student)
        return records
    teachers_by_stage: dict[int, RoundResult] = {}

    def teacher_then_keep(stage: int, previous: RoundResult | None):
        wait = teacher_stage(stage, previous)

        def kept() -> RoundResult:
            teachers_by_stage[stage] = wait()
            return teachers_by_stage[stage]
        return kept

    run_stages(config.stages, targets == "bank" and plan.bank.mode == "single",
               teacher_then_keep, snapshot,
               lambda stage, previous, bank: student_stage(
                   stage, previous, bank, None if targets == "bank"
                   else teachers_by_stage[stage].checkpoint), recorded)
    return records


@flow(name="distill-stages", description="The teacher, bank and student stages of `distill`.")
def distill_stages(config: DistillConfig, plan: DistillPlan, dataset: DatasetRef, run_id: str,
                   teacher_run_id: str, student_run_id: str) -> list[StageRecord]:
    """Runs the S stages and logs each one as it finishes (see `_stage_loop`)."""
    logger = get_run_logger()

    def on_stage(record: StageRecord) -> None:
        stage = record.teacher.round
        tracking.log_metrics(teacher_run_id, record.teacher.metrics, step=stage)
        tracking.log_metrics(student_run_id, record.student.metrics, step=stage)
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
                    else f"targets: teacher {config.targets}",
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
