"""The `pipeline` flow: the retraining run that chains the techniques into one model.

1. Data check: the data set is prepared and its DVC hash recorded; with `--skip-unchanged`
   (the default) a run whose champion this pipeline trained on the same data, config and code
   ends here, in seconds (scheduled retraining on data that did not change).
2. `distill`'s stages (its subflow): the recency data queue draws each stage's images, the
   teacher trains stage by stage, its features fill the multi-state bank, the student learns
   from the bank and the labels.
   Where the run has descriptions (`--captions`, `--class-descriptions`), `image_text`'s rounds
   train the student's image side against them (contrastive + cross-entropy, the classifier
   started from the class descriptions), and the result, as a plain student
   (`as-classifier`), goes on only if it beats the distilled student on validation.
3. `pbt`'s population (its subflow) on the distilled student (or the image-text step's):
   every member starts from the student's weights, trains a burn-in round and `--pbt-stages`
   stages with evaluation, weight copy and hyperparameter exploration, then the greedy soup.
4. `sparsify`'s rounds on PBT's best: fine-tuning with the activation-sparsity term, then the
   activation thresholds (`--zero-threshold-tolerance`). PBT's best and the sparse student
   each go on only where they are not below the step before on validation and, with
   `--step-level` below 1, significantly better there (`kept_step`); otherwise the next step
   starts from the step before.
5. The fallback cascade (`training.cascade.fallback`): the sparse student answers the images it
   is confident about, the teacher the rest; where the cascade buys at most
   `--fallback-tolerance` of validation accuracy over the student alone, the student answers
   every image and is registered alone. Which images it passes on is the exit rule (its
   confidence) or a predictor fitted on half the validation split, whichever is cheaper for
   the same accuracy on the other half (`training.cascade.routing`), the threshold fitted on
   validation with the measured time of each network as the cost; then every step's network
   and the cascade are timed side by side (`time-steps`).
6. Registration and promotion of the cascade as one pyfunc, as in every flow.

One MLflow run holds it all: each step's metrics on a nested run (`teacher`, `student`,
`image_text`, `pbt` with its members, `sparsify`, `fallback`), and on the parent each step's
validation and test accuracy, time and size (`step_<name>_test_accuracy`, ...) and the table
of steps (`pipeline/steps.md`), so what each step adds or costs is in one place.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.skeleton import (
    Prepared,
    begun_run,
    budgeted_classifier,
    conclude,
    publish,
)
from flows.steps.distill import distill_stages, fitted_plan
from flows.steps.image_text import train_image_text
from flows.steps.pbt import population_step
from flows.steps.sparsify import train_sparse
from tasks.adapters import tracking
from tasks.adapters.caching import code_version, result_fields
from tasks.adapters.registration import CHAMPION, Policy, Registration
from tasks.adapters.reporting import publish_summary
from tasks.adapters.runners import task_runner
from tasks.adapters.versioning import ArtifactRef
from tasks.configs.pipeline import PipelineConfig
from tasks.configs.sections import ClassifierConfig, classifier_config
from tasks.data import DatasetRef
from tasks.image_text.tasks import AsClassifier, as_classifier
from tasks.pbt import SCORED_WEIGHTS
from tasks.pipeline import (
    STEP_TIMING_IMAGES,
    Fallback,
    StepEvidence,
    TimedStep,
    fit_fallback,
    hand_over,
    register_fallback,
    step_evidence,
    time_steps,
)
from tasks.promotion import register_and_promote
from tasks.sparsify import sparsity_spec, test_activations
from tasks.training import TestResult, test_and_export

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary.
__all__ = ["FLOW_NAME", "PipelineSummary", "StepResult", "pipeline"]

FLOW_NAME = "pipeline"
KEY_TAG = "pipeline.key"


class StepResult(BaseModel):
    """One step's model: its checkpoint, classifier config, validation and test accuracy, and
    (the sparse student) the exact-zero fraction of its regularized activations (validation)."""

    model_config = ConfigDict(frozen=True)

    name: str
    classifier: ClassifierConfig
    checkpoint: ArtifactRef
    weights: str
    program: ArtifactRef  # the exported program (`test_and_export`), what a registration serves
    val_accuracy: float
    test_accuracy: float
    zero_fraction: float | None = None
    kept: bool = True  # False: the step lost on validation and the next one starts before it
    ms_per_image_b1: float | None = None  # timed beside every other step (`time-steps`)
    parameters: int | None = None

    @property
    def program_bytes(self) -> int:
        return self.program.size


class PipelineSummary(BaseModel):
    """What a `pipeline` run gives back; `skipped` when the champion already came from the
    same data, config and code (nothing trained)."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    skipped: bool = False
    steps: list[StepResult] = []
    fallback: Fallback | None = None
    test_accuracy: float | None = None
    front: str | None = None  # the step whose student the registered model runs first
    student_alone: bool = False  # registered without the teacher (`student_alone`)
    registration: Registration | None = None


def pipeline_key(config: PipelineConfig, dataset_md5: str) -> str:
    """What the final model depends on: the result-relevant config, the data set's hash and
    the code of this flow and all it imports; the registered version carries it
    (`pipeline.key`)."""
    fields = {k: v for k, v in result_fields(config).items() if k != "skip_unchanged"}
    text = json.dumps([fields, dataset_md5, code_version("flows.pipeline")], sort_keys=True,
                      default=str)
    return hashlib.md5(text.encode()).hexdigest()


def unchanged_champion(name: str, key: str) -> str | None:
    """The champion's version if this pipeline trained it from the same key, else None."""
    version = tracking.alias_version(name, CHAMPION)
    if version is not None and tracking.version_tags(name, version).get(KEY_TAG) == key:
        return version
    return None


def tested(step: str, classifier: ClassifierConfig, prepared: Prepared, checkpoint: ArtifactRef,
           val_accuracy: float, run_id: str, weights: str = "model",
           zero_fraction: float | None = None) -> StepResult:
    """A step's model scored on the test split and exported; logged on the parent run as
    `step_<step>_*`."""
    test = test_and_export(classifier, prepared.dataset, checkpoint, weights)
    result = StepResult(name=step, classifier=classifier, checkpoint=checkpoint, weights=weights,
                        val_accuracy=val_accuracy, test_accuracy=test.metrics["test_accuracy"],
                        zero_fraction=zero_fraction, program=test.program)
    tracking.log_metrics(run_id, {f"step_{step}_val_accuracy": val_accuracy,
                                  f"step_{step}_test_accuracy": result.test_accuracy}
                         | ({} if zero_fraction is None
                            else {f"step_{step}_zero_fraction": zero_fraction}))
    tracking.log_artifact_refs(run_id, {f"program.{step}": test.program})
    return result


def fallback_row(fallback: Fallback) -> str:
    """The summary's line on the fallback cascade."""
    metrics = fallback.metrics
    return (f"the student answers {metrics['test_student_share']:.0%} of the test images; "
            f"{metrics['ms_per_image_b1']:.3f} ms per image at batch 1 (teacher "
            f"{metrics['teacher_ms_per_image_b1']:.3f}, student "
            f"{metrics['student_ms_per_image_b1']:.3f})")


def routing_row(fallback: Fallback) -> str:
    """The summary's line on which routing validation kept."""
    metrics = fallback.metrics
    if fallback.student_alone:
        ahead = metrics.get("val_only_cascade_right", 0.0)
        why = ("buys at most the tolerance" if not ahead else
               f"is not significantly better (right on {ahead:.0f} validation images the "
               f"student alone misses, wrong on {metrics['val_only_student_right']:.0f} it "
               f"gets right: p = {metrics['val_cascade_p_better']:.2g})")
        return (f"none: the cascade {why} on validation over the student alone "
                f"({metrics['val_student_accuracy']:.4f}; the teacher alone "
                f"{metrics['val_teacher_accuracy']:.4f})")
    if "predictors_kept" not in metrics:
        return "the confidence rule (`--fallback-predictor fixed`)"
    compared = (f"on {metrics['val_images_compared']:.0f} validation images the predictor "
                f"passes on at a cost of {metrics['val_fitted_mean_cost']:.3f} ms for accuracy "
                f"{metrics['val_fitted_accuracy']:.4f}, the confidence rule "
                f"{metrics['val_fixed_mean_cost']:.3f} ms for {metrics['val_fixed_accuracy']:.4f}")
    if fallback.router is not None:
        return f"the fitted predictor, kept: {compared}"
    return f"the confidence rule; the fitted predictor was dropped: {compared}"


def step_table(steps: list[StepResult], fallback: Fallback) -> str:
    """The run's steps, each beside the one before: validation and test accuracy, time per
    image at batch 1 (timed side by side), parameters, exported program, exact zeros."""
    lines = ["| step | validation | test | test vs the step before | ms / image, batch 1 | "
             "parameters | program | exact zeros |", "|---|---|---|---|---|---|---|---|"]
    previous = None

    def cell(value, form: str) -> str:
        return "" if value is None else format(value, form)

    rows = [(s.name if s.kept else f"{s.name} (not kept)", s.val_accuracy, s.test_accuracy,
             s.ms_per_image_b1, s.parameters,
             s.program_bytes / 1e6, s.zero_fraction)
            for s in steps]
    metrics = fallback.metrics
    rows.append((f"cascade ({fallback.routing} routing)", metrics["val_accuracy"],
                 metrics["test_accuracy"], metrics.get("steps_ms_per_image_b1"),
                 metrics.get("steps_parameters"), None, None))
    for name, val, test, ms, parameters, megabytes, zeros in rows:
        change = "" if previous is None else f"{test - previous:+.4f}"
        lines.append(f"| {name} | {val:.4f} | {test:.4f} | {change} | {cell(ms, '.3f')} | "
                     f"{cell(parameters, ',.0f')} | {cell(megabytes, '.2f')}"
                     f"{'' if megabytes is None else ' MB'} | {cell(zeros, '.3f')} |")
        previous = test
    return "\n".join(lines)


def run_distill(config: PipelineConfig, prepared: Prepared, run_id: str):
    """Step 2: `distill`'s stages; the teacher's and the student's last stage."""
    plan = fitted_plan(config, prepared.dataset, run_id)
    with tracking.tracked_run(FLOW_NAME, "teacher", plan.teacher, parent_run_id=run_id) \
            as teacher_run, \
            tracking.tracked_run(FLOW_NAME, "student", plan.student, parent_run_id=run_id) \
            as student_run:
        runner = task_runner(config.cluster, config.run.device)
        stages = distill_stages.with_options(task_runner=runner)(
            config, plan, prepared.dataset, run_id, teacher_run, student_run)
    return plan, stages[-1]


def run_image_text(config: PipelineConfig, prepared: Prepared, run_id: str,
                   start: ArtifactRef) -> AsClassifier:
    """Step 2b: `image_text`'s rounds from the distilled student's weights, then the trained
    network as a plain classifier of the student's network (`as-classifier`), what PBT would
    start from."""
    text = prepared.apply(config.image_text_config())
    with tracking.tracked_run(FLOW_NAME, "image_text", text, parent_run_id=run_id) as text_run:
        text, described, _, _, best = train_image_text(text, prepared, text_run, start)
        plain = as_classifier(text, prepared.dataset, described, best.checkpoint)
        tracking.log_metrics(text_run, {"val_accuracy_as_classifier": plain.val_accuracy})
        tracking.log_artifact_refs(text_run, {"checkpoint.as_classifier": plain.checkpoint})
    return plain


def image_text_decision(config: PipelineConfig, prepared: Prepared, run_id: str,
                    student_checkpoint: ArtifactRef, student: StepResult
                    ) -> tuple[StepResult | None, ArtifactRef, str]:
    """Step 2b where the run has descriptions: the image-text step, tested; the checkpoint PBT
    starts from (the step's only where it beats the distilled `student` on validation); and
    the decision in words (also when skipped)."""
    if not config.has_descriptions:
        return None, student_checkpoint, ("skipped: the run has no descriptions (--captions, "
                                          "--class-descriptions)")
    plain = run_image_text(config, prepared, run_id, student_checkpoint)
    kept = plain.val_accuracy > student.val_accuracy
    step = tested("image_text", student.classifier, prepared, plain.checkpoint,
                  plain.val_accuracy, run_id)
    decision = (f"{'kept' if kept else 'not kept'}: validation {plain.val_accuracy:.4f} "
                f"against the distilled student's {student.val_accuracy:.4f}")
    return (step.model_copy(update={"kept": kept}),
            plain.checkpoint if kept else student_checkpoint, decision)


def run_pbt(config: PipelineConfig, prepared: Prepared, run_id: str, start: ArtifactRef):
    """Step 3: `pbt`'s population from the distilled student's weights; the best member's
    classifier config and result."""
    pbt = prepared.apply(config.pbt_config())
    with tracking.tracked_run(FLOW_NAME, "pbt", pbt, parent_run_id=run_id) as pbt_run:
        best_config, population, _ = population_step(pbt, prepared, pbt_run, start)
    return best_config, population.best


def run_sparsify(config: PipelineConfig, prepared: Prepared, run_id: str, start: ArtifactRef):
    """Step 4: `sparsify`'s rounds from PBT's best; its classifier config, kept round and
    activation report on the test split (the validation one chose the round and thresholds)."""
    sparse = prepared.apply(config.sparsify_config())
    with tracking.tracked_run(FLOW_NAME, "sparsify", sparse, parent_run_id=run_id) as sparse_run:
        classifier, budget = budgeted_classifier(sparse, prepared, sparse_run, sparse.rounds)
        _, best, report = train_sparse(sparse, classifier, prepared, budget, sparse_run, start)
        tracking.log_dict(sparse_run, report.model_dump(), "sparsity/report.json")
        test_report = test_activations(classifier, prepared.dataset, best.checkpoint,
                                       sparsity_spec(sparse, prepared.dataset))
        tracking.log_dict(sparse_run, test_report.model_dump(), "sparsity/test_report.json")
        tracking.log_metrics(sparse_run, test_report.split_metrics())
    return classifier, best, test_report


def run_cascade(config: PipelineConfig, dataset: DatasetRef, run_id: str,
                steps: list[StepResult], front: str) -> tuple[Fallback, list[StepResult]]:
    """Step 5 on its nested run `fallback`: the cascade of the `front` step's student and the
    teacher (`fit-fallback`: its routing and threshold), its latency table, then every step's
    network and the cascade timed side by side (`time-steps`); the cascade and the steps with
    their times and sizes."""
    by_name = {step.name: step for step in steps}
    student, teacher = by_name[front], by_name["teacher"]
    with tracking.tracked_run(FLOW_NAME, "fallback", parent_run_id=run_id) as fallback_run:
        fallback = fit_fallback(student.classifier, teacher.classifier, dataset,
                                student.checkpoint, teacher.checkpoint,
                                config.fallback.tolerance, config.fallback.predictor,
                                config.run.seed, config.fallback.timing_images,
                                student_weights=student.weights,
                                level=config.fallback.level)
        tracking.log_dict(fallback_run, fallback.latency, "cascade/latency.json")
        tracking.set_tags(fallback_run, {"cascade.routing": fallback.routing})
        timing = time_steps([TimedStep(name=s.name, classifier=s.classifier,
                                       checkpoint=s.checkpoint, weights=s.weights)
                             for s in steps], dataset, fallback, front, "teacher",
                            min(config.fallback.timing_images, STEP_TIMING_IMAGES))
        steps = [s.model_copy(update={"ms_per_image_b1": timing[s.name]["ms_per_image_b1"],
                                      "parameters": int(timing[s.name]["parameters"])})
                 for s in steps]
        fallback = fallback.model_copy(update={"metrics": fallback.metrics | {
            f"steps_{key}": value for key, value in timing["cascade"].items()}})
        tracking.log_metrics(fallback_run, fallback.metrics
                             | {"tolerance": config.fallback.tolerance})
    return fallback, steps


def kept_over(step: StepResult, before: StepResult, evidence: StepEvidence | None = None,
              level: float = 1.0) -> tuple[StepResult, str]:
    """`step` marked kept where it does not lose to `before` on validation and, below level
    1, where its advantage there is significant at `level` (`evidence`, `step_evidence`);
    the decision in words."""
    ahead = step.val_accuracy >= before.val_accuracy
    significant = evidence is None or evidence.p_better <= level
    kept = ahead and significant
    words = (f"{'kept' if kept else 'not kept'}: validation {step.val_accuracy:.4f} against "
             f"{before.name}'s {before.val_accuracy:.4f}")
    if evidence is not None:
        words += (f" (right on {evidence.only_step_right} images it misses, wrong on "
                  f"{evidence.only_before_right} it gets right: p = {evidence.p_better:.2g}"
                  + (f", not significant at {level:g}" if ahead and not significant else "")
                  + ")")
    return step.model_copy(update={"kept": kept}), words


def kept_step(config: PipelineConfig, step: StepResult, before: StepResult,
              dataset: DatasetRef) -> tuple[StepResult, str]:
    """`kept_over` at the config's `step_level`, with the paired evidence where the level
    asks for it (below 1)."""
    if config.step_level >= 1.0:
        return kept_over(step, before)
    evidence = step_evidence(*(TimedStep(name=s.name, classifier=s.classifier,
                                         checkpoint=s.checkpoint, weights=s.weights)
                               for s in (step, before)), dataset)
    return kept_over(step, before, evidence, config.step_level)


@flow(name=FLOW_NAME, description="The retraining pipeline: data check, distillation from a "
      "multi-state teacher feature bank, PBT on the student, sparsity fine-tuning, a fallback "
      "cascade of the sparse student and the teacher; registered and promoted only if it beats "
      "the champion and the raw-pixel baselines. Finishes at once when the champion came from "
      "the same data, config and code.")
def pipeline(config: PipelineConfig) -> PipelineSummary:
    """Runs the steps of the module docstring; registers the cascade as `config.run.model_name`
    (default `pipeline`)."""
    logger = get_run_logger()
    run_name = f"{FLOW_NAME}-{config.teacher_model}-to-{config.student_model}-seed{config.run.seed}"
    # 1. the data check, in the run's prologue
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        key = pipeline_key(config, prepared.dataset.artifact.md5)
        tracking.set_tags(run_id, {KEY_TAG: key})
        if config.skip_unchanged and config.run.registry and (
                version := unchanged_champion(name, key)):
            message = (f"the champion (models:/{name}/{version}) was trained by this pipeline "
                       f"on the same data ({prepared.dataset.artifact.md5[:12]}), config and "
                       "code: nothing to retrain")
            logger.info(message)
            tracking.set_tags(run_id, {"registry.decision": message})
            publish_summary("pipeline-summary", f"pipeline on {config.dataset.data}: unchanged",
                            {"decision": message, "MLflow run": run_id})
            return PipelineSummary(run_id=run_id, skipped=True)
        dataset = prepared.dataset
        plan, last = run_distill(config, prepared, run_id)  # 2.
        teacher = classifier_config(plan.teacher)
        steps = []
        teacher_step = tested("teacher", teacher, prepared, last.teacher.checkpoint,
                              last.teacher.metrics["val_accuracy"], run_id)
        student_step = tested("distill", classifier_config(plan.student), prepared,
                              last.student.checkpoint, last.student.metrics["val_accuracy"],
                              run_id)
        steps += [teacher_step, student_step]
        handed = hand_over(last.student.checkpoint, "model", "distill")
        tracking.log_artifact_refs(run_id, {"handover.distill": handed})
        text_step, handed, text_decision = image_text_decision(  # 2b.
            config, prepared, run_id, handed, student_step)
        steps += [] if text_step is None else [text_step]
        logger.info("image-text step %s", text_decision)
        tracking.set_tags(run_id, {"pipeline.image_text": text_decision})
        tracking.log_artifact_refs(run_id, {"start.pbt": handed})
        front = text_step if text_step is not None and text_step.kept else student_step
        pbt_classifier, best = run_pbt(config, prepared, run_id, handed)  # 3.
        pbt_step = tested("pbt", pbt_classifier, prepared, best.checkpoint,
                          best.metrics["val_accuracy"], run_id, SCORED_WEIGHTS)
        pbt_step, pbt_decision = kept_step(config, pbt_step, front, dataset)
        steps.append(pbt_step)
        if pbt_step.kept:
            front = pbt_step
            handed = hand_over(best.checkpoint, SCORED_WEIGHTS, "pbt")
            tracking.log_artifact_refs(run_id, {"handover.pbt": handed})
        sparse_classifier, sparse, report = run_sparsify(config, prepared, run_id, handed)  # 4.
        zeros = sum(layer.zero_fraction for layer in report.layers.values()) / max(
            len(report.layers), 1)
        sparse_step = tested("sparsify", sparse_classifier, prepared, sparse.checkpoint,
                             sparse.metrics["val_accuracy"], run_id, zero_fraction=zeros)
        sparse_step, sparse_decision = kept_step(config, sparse_step, front, dataset)
        steps.append(sparse_step)
        if sparse_step.kept:
            front = sparse_step
        tracking.set_tags(run_id, {"pipeline.pbt": pbt_decision,
                                   "pipeline.sparsify": sparse_decision,
                                   "pipeline.front": front.name})
        logger.info("PBT step %s; sparse step %s; the cascade's student: %s", pbt_decision,
                    sparse_decision, front.name)
        fallback, steps = run_cascade(config, dataset, run_id, steps, front.name)  # 5.
        alone = fallback.student_alone
        test_accuracy = fallback.metrics["test_student_accuracy" if alone else "test_accuracy"]
        tracking.log_metrics(run_id, {f"fallback_{k}": v for k, v in fallback.metrics.items()}
                             | {"test_accuracy": test_accuracy,
                                "val_accuracy": fallback.metrics["val_accuracy"],
                                "registered_student_alone": float(alone)}
                             | {f"step_{s.name}_{key}": getattr(s, key) for s in steps
                                for key in ("ms_per_image_b1", "parameters")})
        table = step_table(steps, fallback)
        tracking.log_text(run_id, table, "pipeline/steps.md")
        finished = conclude(  # 6.
            run_id, config.run, prepared, fallback.metrics["val_accuracy"],
            TestResult(metrics={"test_accuracy": test_accuracy}, program=front.program),
            lambda refusal: register_and_promote(
                run_id, name, dataset, front.program, Policy.of(config.run), refusal,
                {KEY_TAG: key}) if alone else register_fallback(
                run_id, name, dataset, front.program, teacher_step.program, fallback,
                Policy.of(config.run), refusal, {KEY_TAG: key}))
        summary = PipelineSummary(run_id=run_id, steps=steps, fallback=fallback,
                                  test_accuracy=test_accuracy, front=front.name,
                                  student_alone=alone, registration=finished.registration)
    publish("pipeline-summary", f"pipeline: {config.teacher_model} -> {config.student_model} "
            f"on {config.dataset.data}", run_id, finished, {
                "image-text step": text_decision,
                "PBT step": pbt_decision,
                "sparse step": sparse_decision,
                "registered": f"the {front.name} student alone: it answers every validation "
                              "image at the calibrated threshold" if alone else
                              f"the cascade of the {front.name} student and the teacher",
                "fallback cascade": fallback_row(fallback),
                "routing (chosen on validation)": routing_row(fallback),
            }, table)
    return summary
