"""The `distill` flow: stage-wise distillation from a multi-state teacher.

Stage s = 1..S: the teacher trains on N queued images (state s -> s+1); the student trains on
P queued images with CE plus a loss against its targets: teacher state s itself, run on the
student's own augmented batch (`--targets states`); or bank s, the features the states wrote
for the images they trained on (`bank`); or the last state (`final`, plain KD); or none
(`labels`). By default (`auto`) the student trains once with each of `labels`, `final` and
`states` on the same teacher stages, and the one best on validation is kept.
The teacher's stage s+1 needs only its own state, so it runs while the student runs stage s:
on two Dask workers they overlap, in-process they run in turn, and the results are the same
either way (every task is a function of its inputs and the seed). The stages are the step
`flows.steps.distill`, which the `pipeline` runs too. After stage S the student is tested,
registered, and promoted if it beats the champion.
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.skeleton import begun_run, finish, publish
from flows.steps.distill import StageRecord, distill_stages, fitted_plan
from tasks.adapters import tracking
from tasks.adapters.registration import Registration
from tasks.adapters.runners import task_runner
from tasks.configs.distill import DistillConfig
from tasks.configs.sections import classifier_config
from tasks.data import DatasetRef
from tasks.training import test_and_export

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary. Its step, which the `pipeline` composes too (the stages as a subflow on the plan
# fitted to the data), is `flows.steps.distill`'s.
__all__ = ["FLOW_NAME", "DistillSummary", "distill"]

FLOW_NAME = "distill"


class DistillSummary(BaseModel):
    """What a `distill` run gives back."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    dataset: DatasetRef
    stages: list[StageRecord]
    teacher_test_accuracy: float
    test_accuracy: float
    registration: Registration
    targets_chosen: str | None = None  # --targets auto: the candidate kept


@flow(name=FLOW_NAME, description="Distil a deeper teacher, trained in stages, into a patient "
      "student: by default trained four ways on it (labels alone, KD from the last state, KD "
      "on standardized logits, each state on the student's batches; or the multi-state "
      "feature bank they fill), the best on validation kept; register the student and "
      "promote it if it beats the champion and the raw-pixel baselines.")
def distill(config: DistillConfig) -> DistillSummary:
    """Runs the stages, then tests, registers and promotes the student."""
    run_name = f"{FLOW_NAME}-{config.teacher_model}-to-{config.student_model}-seed{config.run.seed}"
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        dataset = prepared.dataset
        plan = fitted_plan(config, dataset, run_id)
        with tracking.tracked_run(FLOW_NAME, "teacher", plan.teacher, parent_run_id=run_id) \
                as teacher_run_id, \
                tracking.tracked_run(FLOW_NAME, "student", None if plan.candidates
                                     else plan.student, parent_run_id=run_id) \
                as student_run_id:  # (auto: the params of the candidate kept, below)
            runner = task_runner(config.cluster, config.run.device)
            stages = distill_stages.with_options(task_runner=runner)(
                config, plan, dataset, run_id, teacher_run_id, student_run_id)
            chosen = stages[-1].chosen
            if chosen is not None:
                tracking.log_config(student_run_id, plan.candidates[chosen])
                tracking.set_tags(student_run_id, {"targets_chosen": chosen})
                tracking.set_tags(run_id, {"targets_chosen": chosen})
            teacher_test = test_and_export(classifier_config(plan.teacher), dataset,
                                           stages[-1].teacher.checkpoint)
            tracking.log_metrics(teacher_run_id, teacher_test.metrics)
            tracking.log_metrics(run_id, {
                "teacher_test_accuracy": teacher_test.metrics["test_accuracy"]})
            finished = finish(run_id, name, config.run, classifier_config(plan.student),
                              prepared, stages[-1].student.checkpoint,
                              stages[-1].student.metrics["val_accuracy"])
            tracking.log_metrics(student_run_id, finished.test.metrics)
        summary = DistillSummary(run_id=run_id, dataset=dataset, stages=stages,
                                 teacher_test_accuracy=teacher_test.metrics["test_accuracy"],
                                 test_accuracy=finished.test_accuracy,
                                 registration=finished.registration, targets_chosen=chosen)
    publish("distill-summary", f"distill: {config.teacher_model} -> {config.student_model} on "
            f"{config.dataset.data}", run_id, finished, {
                "teacher test accuracy": f"{summary.teacher_test_accuracy:.4f}",
                "stages": f"{config.stages}, {plan.student.repeats} passes each (student), "
                          f"{plan.teacher.repeats} (teacher)",
                "targets": f"bank ({config.bank_mode}, layer {config.teacher_layer}, "
                           f"{config.bank_dtype}, {config.bank_views} views, "
                           f"{config.bank_average} state, filled "
                           f"{stages[-1].bank.fill_fraction:.3f})"
                           if stages[-1].bank is not None else
                           f"auto: {chosen} kept, validation "
                           f"{stages[-1].candidate_scores()}"
                           if chosen is not None else
                           f"labels alone (CE), patience {config.student_patience}"
                           if config.targets == "labels" else
                           f"teacher {config.targets}, layer {config.teacher_layer}, "
                           f"{config.feature_loss} (T={config.temperature}), patience "
                           f"{config.student_patience}",
            })
    return summary
