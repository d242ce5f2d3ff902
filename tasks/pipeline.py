"""The `pipeline` flow's own tasks: hand one step's weights to the next, fit the fallback
cascade (the sparse student in front of the teacher, `training.cascade.fallback`), and register it.
Every other step is a task or subflow of its own flow (`flows/pipeline.py`)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.registration import (
    Policy,
    Registration,
    log_served_model,
    promote_on_test_images,
    transient,
)
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import setup_device
from tasks.training import eval_batches, split_batches, trained_model
from training.cascade.fallback import calibrate_fallback, fallback_infer, fallback_table
from training.device import place_model
from training.latency import interleaved_ms_per_image
from training.loops import predict


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
    """The fallback cascade's calibrated threshold and what it measured (`fit_fallback`)."""

    model_config = ConfigDict(frozen=True)

    threshold: float
    metrics: dict[str, float]


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="fit-fallback")
def fit_fallback(student: ClassifierConfig, teacher: ClassifierConfig, dataset: DatasetRef,
                 student_checkpoint: ArtifactRef, teacher_checkpoint: ArtifactRef,
                 tolerance: float, latency_images: int = 1000) -> Fallback:
    """Times the student and the teacher at batch 1 (passes interleaved), calibrates the
    student's confidence threshold on the validation split (`training.cascade.fallback`), then
    measures the real cascade on the test split: accuracy, the share the student answers,
    and milliseconds per image at batch 1 beside the teacher's and the student's alone."""
    device = setup_device(student)
    small = place_model(trained_model(student, dataset, student_checkpoint), device).eval()
    large = place_model(trained_model(teacher, dataset, teacher_checkpoint), device).eval()
    data = load_dataset(dataset)

    def logits(split: str):
        return (predict(small, eval_batches(data, dataset, split, device), device),
                predict(large, eval_batches(data, dataset, split, device), device)[0])

    sample = next(iter(split_batches(data, dataset, "test", latency_images, device)))[1]
    alone = interleaved_ms_per_image({"student": small, "teacher": large}, sample, 1)
    (val_small, val_labels), val_large = logits("val")
    table = fallback_table(val_small, val_large, val_labels, alone["student"], alone["teacher"])
    threshold = calibrate_fallback(table, tolerance)
    val = table.outcome(torch.tensor([threshold]))
    (test_small, test_labels), test_large = logits("test")
    test_table = fallback_table(test_small, test_large, test_labels, alone["student"],
                                alone["teacher"])
    test = test_table.outcome(torch.tensor([threshold]))
    timed = interleaved_ms_per_image({
        "fallback": lambda x: fallback_infer(small, large, x, threshold),
        "teacher": large, "student": small}, sample, 1)
    metrics = {"val_accuracy": val["accuracy"], "val_student_share": val["exit_share_0"],
               "val_teacher_accuracy": table.full_accuracy(),
               "val_student_accuracy": table.correct[:, 0].float().mean().item(),
               "test_accuracy": test["accuracy"], "test_student_share": test["exit_share_0"],
               "test_teacher_accuracy": test_table.full_accuracy(),
               "test_student_accuracy": test_table.correct[:, 0].float().mean().item(),
               "ms_per_image_b1": timed["fallback"],
               "teacher_ms_per_image_b1": timed["teacher"],
               "student_ms_per_image_b1": timed["student"],
               "speedup_over_teacher_b1": timed["teacher"] / timed["fallback"],
               "threshold": threshold}
    return Fallback(threshold=threshold, metrics=metrics)


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
            "threshold": fallback.threshold}
    with tempfile.TemporaryDirectory() as folder:
        meta_path = Path(folder) / "meta.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        model_uri = log_served_model(run_id, "fallback", {
            "program": str(store.fetch(student_program)),
            "fallback": str(store.fetch(teacher_program)), "meta": str(meta_path)})
    identity = hashlib.md5(json.dumps([student_program.md5, teacher_program.md5,
                                       fallback.threshold]).encode()).hexdigest()
    return promote_on_test_images(run_id, name, model_uri, dataset, identity, policy, refusal,
                                  tags)
