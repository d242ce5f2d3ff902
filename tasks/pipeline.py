"""The `pipeline` flow's own tasks: hand one step's weights to the next, fit the fallback
cascade (the sparse student in front of the teacher, `training.cascade.fallback`, routed by the
exit rule or a fitted predictor, `training.cascade.routing`), time every step's network side by
side, and register the cascade. Every other step is a task or subflow of its own flow
(`flows/pipeline.py`)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.registration import Policy, Registration, log_served_model, transient
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.data import DatasetRef, load_dataset
from tasks.promotion import promote_on_test_images
from tasks.training import trained_model
from training.batches import eval_batches, split_batches
from training.cascade.fallback import fallback_infer
from training.cascade.fallback_choice import Scored, choose_fallback
from training.cascade.routing import Router
from training.device import place_model, setup_device
from training.latency import interleaved_ms_per_image
from training.loops import predict
from training.promotion import ALPHA, discordant
from training.sparsify.pruning import parameter_count

STEP_TIMING_IMAGES = 300  # the table of steps times every step's network: fewer images


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="hand-over-{entry}")
def hand_over(checkpoint: ArtifactRef, entry: str, step: str) -> ArtifactRef:
    """The network weights under `entry` of a step's checkpoint (a distilled student's `model`
    without its adapter and optimizer, a PBT member's `kept` weights) as a checkpoint the next
    step starts from (`model` only: its optimizer starts afresh)."""
    store = ArtifactStore()
    payload = load_checkpoint(store, checkpoint)
    if entry not in payload:
        raise ValueError(f"checkpoint {checkpoint.path} has no {entry!r} weights")
    relpath = f"checkpoints/pipeline/{step}-{checkpoint.md5[:12]}-{entry}.pt"
    return save_checkpoint(store, relpath, {"model": payload[entry]})


class Fallback(BaseModel):
    """The fallback cascade's calibrated threshold, its routing and what it measured
    (`fit_fallback`): `router` holds the fitted predictor's weights where validation kept it
    (`training.cascade.routing.Router.to_json`), else None (the exit rule); `latency` the
    latency table, each part's milliseconds per image at batch 1 on this machine."""

    model_config = ConfigDict(frozen=True)

    threshold: float
    metrics: dict[str, float]
    router: dict | None = None
    latency: dict[str, float] = {}

    @property
    def routing(self) -> str:
        return "fixed" if self.router is None else "fitted"

    @property
    def student_alone(self) -> bool:
        """Whether the student answers every validation image at the calibrated threshold:
        then the teacher adds nothing there and the student is registered alone."""
        return self.metrics["val_student_share"] >= 1.0


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="fit-fallback")
def fit_fallback(student: ClassifierConfig, teacher: ClassifierConfig, dataset: DatasetRef,
                 student_checkpoint: ArtifactRef, teacher_checkpoint: ArtifactRef,
                 tolerance: float, predictor: str = "fitted", seed: int = 0,
                 latency_images: int = 1000, student_weights: str = "model",
                 level: float = ALPHA) -> Fallback:
    """The trained student and teacher, their logits on the validation and test splits, and
    the cascade's routing and threshold chosen from them
    (`training.cascade.fallback_choice.choose_fallback`: timed at batch 1, chosen on
    validation, measured on test). `student_weights`: the entry of the student's checkpoint
    that holds its weights (a PBT member's `kept`)."""
    device = setup_device(student)
    small = place_model(trained_model(student, dataset, student_checkpoint, student_weights),
                        device).eval()
    large = place_model(trained_model(teacher, dataset, teacher_checkpoint), device).eval()
    data = load_dataset(dataset)

    def scored(split: str) -> Scored:
        student_logits, labels = predict(small, eval_batches(data, dataset, split, device),
                                         device)
        teacher_logits = predict(large, eval_batches(data, dataset, split, device), device)[0]
        return Scored(student_logits, teacher_logits, labels)

    sample = next(iter(split_batches(data, dataset, "test", latency_images, device)))[1]
    choice = choose_fallback(small, large, scored("val"), scored("test"), sample, device,
                             tolerance, predictor, seed, level)
    return Fallback(threshold=choice.threshold, metrics=choice.metrics,
                    router=None if choice.router is None else choice.router.cpu().to_json(),
                    latency=choice.latency)


class TimedStep(BaseModel):
    """One step's network as the latency table times it (and `step_evidence` scores it): its
    classifier config, checkpoint and weights entry."""

    model_config = ConfigDict(frozen=True)

    name: str
    classifier: ClassifierConfig
    checkpoint: ArtifactRef
    weights: str = "model"


class StepEvidence(BaseModel):
    """A step's model against the step before it on the validation split, paired
    (`step_evidence`): the images only it gets right, those only the step before gets right,
    and McNemar's exact one-sided p-value that it is better."""

    model_config = ConfigDict(frozen=True)

    only_step_right: int
    only_before_right: int
    p_better: float


@task(task_run_name="step-evidence-{step.name}")
def step_evidence(step: TimedStep, before: TimedStep, dataset: DatasetRef) -> StepEvidence:
    """`step`'s network against `before`'s on every validation image, paired, with the
    registry's test (`training.promotion.discordant`): a step whose own choices read the
    validation split (PBT's members, the sparse step's round) looks better there than it is,
    and on a small split one or two images decide a plain comparison."""
    device = setup_device(step.classifier)
    data = load_dataset(dataset)

    def correct(of: TimedStep) -> Tensor:
        model = place_model(trained_model(of.classifier, dataset, of.checkpoint, of.weights),
                            device).eval()
        logits, labels = predict(model, eval_batches(data, dataset, "val", device), device)
        return logits.argmax(dim=1) == labels

    only_step, only_before, p_better = discordant(correct(step), correct(before))
    return StepEvidence(only_step_right=only_step, only_before_right=only_before,
                        p_better=p_better)


@task(task_run_name="time-steps")
def time_steps(steps: list[TimedStep], dataset: DatasetRef, fallback: Fallback,
               student: str, teacher: str, latency_images: int = STEP_TIMING_IMAGES
               ) -> dict[str, dict[str, float]]:
    """Every step's network and the cascade (`student` in front of `teacher`, with
    `fallback`'s routing) timed side by side at batch 1 on test images (passes interleaved,
    so they compare on one machine at one moment): `ms_per_image_b1` and `parameters` per
    name, the cascade's parameters what it registers (the teacher's only where it is not the
    student alone). Not cached: times belong to the machine
    the run is on."""
    device = setup_device(steps[0].classifier)
    models = {step.name: place_model(trained_model(step.classifier, dataset, step.checkpoint,
                                                   step.weights), device).eval()
              for step in steps}
    router = None if fallback.router is None else Router.from_json(fallback.router).to(device)
    data = load_dataset(dataset)
    sample = next(iter(split_batches(data, dataset, "test", latency_images, device)))[1]
    calls: dict[str, Callable[[Tensor], object]] = dict(models)
    calls["cascade"] = lambda x: fallback_infer(models[student], models[teacher], x,
                                                fallback.threshold, router)
    with torch.no_grad():
        timed = interleaved_ms_per_image(calls, sample, 1)
    sizes = {name: float(parameter_count(model)) for name, model in models.items()}
    sizes["cascade"] = sizes[student] + (0.0 if fallback.student_alone else sizes[teacher])
    return {name: {"ms_per_image_b1": timed[name], "parameters": sizes[name]} for name in calls}


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: transient(state))
def register_fallback(run_id: str, name: str, dataset: DatasetRef, student_program: ArtifactRef,
                      teacher_program: ArtifactRef, fallback: Fallback, policy: Policy,
                      refusal: str | None, tags: dict[str, str]) -> Registration:
    """Logs the fallback cascade as a pyfunc (`serving.fallback`: the two exported
    programs and the threshold), scores it and the champion through their pyfuncs on the same
    test images, registers it (tagged with `tags`), and makes it champion only if it scores
    higher and nothing refuses it."""
    store = ArtifactStore()
    meta = {"classes": dataset.classes, "image_size": dataset.image_size,
            "channels": dataset.channels, "mean": dataset.mean, "std": dataset.std,
            "threshold": fallback.threshold, "router": fallback.router}
    with tempfile.TemporaryDirectory() as folder:
        meta_path = Path(folder) / "meta.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        model_uri = log_served_model(run_id, "fallback", {
            "program": str(store.fetch(student_program)),
            "fallback": str(store.fetch(teacher_program)), "meta": str(meta_path)})
    identity = hashlib.md5(json.dumps([student_program.md5, teacher_program.md5,
                                       fallback.threshold, fallback.router]).encode()
                           ).hexdigest()
    return promote_on_test_images(run_id, name, model_uri, dataset, identity, policy, refusal,
                                  tags)
