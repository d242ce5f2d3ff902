"""The `distill` flow end to end: stages, bank versions, runners, resume, and `predict`."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
)
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from flows.cli import main
from flows.commands import COMMANDS
from flows.distill import distill
from tasks.adapters import tracking
from tasks.configs.distill import AUTO_CANDIDATES, DistillConfig
from tests.conftest import kill_when_written

NAME = "distill-smoke"


# The bank's recipe (pooled features, cosine), which most tests here are about; the flow's
# default learns from the teacher states themselves (a test below).
BANK = {"targets": "bank", "teacher_layer": "pool", "student_layer": "pool",
        "feature_loss": "cosine", "feature_weight": 1.0, "ce_weight": 1.0}


def distill_smoke(**overrides) -> DistillConfig:
    """A seconds-long `distill` config: resnet8 -> cnn2, 3 stages on 1024 images, 1 thread,
    the bank's recipe."""
    return DistillConfig(**{"profile": "smoke", "model_name": NAME, "stages": 3,
                            "train_limit": 1024, "threads": 1, **BANK, **overrides})


def all_task_states(flow_state) -> dict[str, str]:
    """Task run name -> state name, over a flow run and its sub-flow runs."""
    flow_run_id = flow_state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        ids = [flow_run_id, *(run.id for run in children)]
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    return {run.name: run.state.name for run in runs}


def checkpoints_of(summary) -> list[tuple[str, str, str]]:
    return [(r.teacher.checkpoint.md5, r.bank.bank.md5, r.student.checkpoint.md5)
            for r in summary.stages]


@pytest.fixture(scope="module")
def first_distill():
    return distill(distill_smoke(registry=True))


def test_run_records_stages_banks_nested_runs_and_registers_the_student(first_distill):
    summary = first_distill
    assert [r.teacher.round for r in summary.stages] == [1, 2, 3]
    fills = [r.bank.fill_fraction for r in summary.stages]
    assert fills[0] == pytest.approx(0.8, abs=0.01) and fills == sorted(fills)
    assert summary.stages[-1].bank.state_histogram.get(3) == round(0.8 * 1024)
    assert summary.registration.alias == "champion"
    client = MlflowClient()
    run = client.get_run(summary.run_id)
    assert run.data.params["bank_mode"] == "single" and run.data.params["stages"] == "3"
    assert run.data.metrics["test_accuracy"] == summary.test_accuracy
    assert run.data.metrics["teacher_test_accuracy"] == summary.teacher_test_accuracy
    refs = tracking.artifact_refs(summary.run_id)
    assert refs["bank.stage-003"]["md5"] == summary.stages[-1].bank.bank.md5
    history = client.get_metric_history(summary.run_id, "bank_fill_fraction")
    assert [m.step for m in history] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(summary.run_id, "banks")}
    assert artifacts == {f"banks/stage-00{s}.json" for s in (1, 2, 3)}
    children = client.search_runs([run.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary.run_id}'")
    by_name = {child.info.run_name: child for child in children}
    assert set(by_name) == {"teacher", "student"}
    assert by_name["teacher"].data.params["model"] == "resnet8"
    assert by_name["student"].data.params["feature_loss"] == "cosine"
    student_history = client.get_metric_history(by_name["student"].info.run_id, "loss_feat")
    assert [m.step for m in student_history] == [1, 2, 3]


def test_per_state_banks_are_kept_apart_and_teach_the_same_student(first_distill):
    per_state = distill(distill_smoke(bank_mode="per-state"))
    paths = [r.bank.bank.path for r in per_state.stages]
    assert [p.rsplit("/", 1)[1] for p in paths] == ["bank-001.pt", "bank-002.pt", "bank-003.pt"]
    assert checkpoints_of(per_state) == checkpoints_of(first_distill)


def test_students_learn_from_each_teacher_state_or_the_last_on_their_own_batches(
        first_distill):
    teachers = [r.teacher.checkpoint.md5 for r in first_distill.stages]
    for targets, read in (("states", teachers), ("final", [teachers[-1]] * 3)):
        summary = distill(distill_smoke(targets=targets, teacher_layer="fc", student_layer="fc",
                                        feature_loss="kl") if targets == "final" else
                          DistillConfig(profile="smoke", model_name=NAME, stages=3,
                                        train_limit=1024, threads=1, targets="states"))
        # the same teacher (its stages come from the cache), no bank, and student stage s
        # trained against the teacher state it names: s, or the last one
        assert [r.teacher.checkpoint.md5 for r in summary.stages] == teachers
        assert all(r.bank is None for r in summary.stages)
        assert [r.student.checkpoint.path.split("/")[2].rsplit("-", 1)[1]
                for r in summary.stages] == [md5[:16] for md5 in read]
        assert all(r.student.metrics["loss_feat"] > 0 for r in summary.stages)


def test_auto_trains_every_candidate_on_the_same_teacher_and_keeps_the_best_on_validation(
        first_distill):
    teachers = [r.teacher.checkpoint.md5 for r in first_distill.stages]
    smoke = {"profile": "smoke", "model_name": NAME, "stages": 3, "train_limit": 1024,
             "threads": 1}
    summary = distill(DistillConfig(**smoke, targets="auto"))  # the flow's default
    assert DistillConfig().targets == "auto"
    assert [r.teacher.checkpoint.md5 for r in summary.stages] == teachers
    names = ("labels", "final", "states", "standardized")
    assert all(set(r.candidates) == set(names) for r in summary.stages)
    # each candidate read its own targets: none, the last state, state s, the last state
    read = {name: [r.candidates[name].checkpoint.path.split("/")[2].rsplit("-", 1)[1]
                   for r in summary.stages] for name in names}
    assert read == {"labels": ["none"] * 3, "final": [teachers[-1][:16]] * 3,
                    "states": [md5[:16] for md5 in teachers],
                    "standardized": [teachers[-1][:16]] * 3}
    assert all(r.candidates["labels"].metrics["loss_feat"] == 0 for r in summary.stages)
    assert all(r.candidates[name].metrics["loss_feat"] > 0 for r in summary.stages
               for name in ("final", "standardized"))
    # the two students of the last state differ in their loss alone, each its own checkpoint
    assert all(r.candidates["final"].checkpoint.path != r.candidates["standardized"]
               .checkpoint.path for r in summary.stages)
    # a candidate is the student a run with its targets alone trains, to the bit
    alone = distill(DistillConfig(**smoke, targets="labels"))
    assert [r.student.checkpoint.md5 for r in alone.stages] == \
        [r.candidates["labels"].checkpoint.md5 for r in summary.stages]
    # the student kept: the candidate best on validation after the last stage
    last = {name: result.metrics["val_accuracy"]
            for name, result in summary.stages[-1].candidates.items()}
    assert summary.targets_chosen == max(last, key=last.get)
    assert all(r.student == r.candidates[summary.targets_chosen] for r in summary.stages)
    client = MlflowClient()
    run = client.get_run(summary.run_id)
    assert run.data.tags["targets_chosen"] == summary.targets_chosen
    children = client.search_runs([run.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary.run_id}'")
    student = next(c for c in children if c.info.run_name == "student")
    kept = AUTO_CANDIDATES[summary.targets_chosen]  # the kept one's params
    assert {key: student.data.params[key] for key in kept} == {
        key: str(value) for key, value in kept.items()}
    history = client.get_metric_history(student.info.run_id, "val_accuracy_states")
    assert [m.value for m in history] == [r.candidates["states"].metrics["val_accuracy"]
                                          for r in summary.stages]


def test_a_live_teacher_under_ddp_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["distill", "--targets", "states", "--ddp-procs", "2"])
    assert exit_info.value.code == 2
    assert "targets 'states' runs a live teacher" in capsys.readouterr().err


def test_teacher_not_deeper_than_the_student_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["distill", "--teacher-model", "cnn2", "--student-model", "cnn3"])
    assert exit_info.value.code == 2
    assert "teacher must be deeper" in capsys.readouterr().err


def test_dkd_on_features_that_are_not_logits_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["distill", "--feature-loss", "dkd", "--teacher-layer", "pool"])
    assert exit_info.value.code == 2
    assert "feature_loss dkd compares logits" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--targets", "bank"], "a bank holds targets of single images"),
    (["--feature-loss", "dkd"], "feature_loss dkd needs one"),
])
def test_mixup_without_a_live_teacher_or_with_dkd_is_refused(capsys, args, says):
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["distill", "--student-mixup", "1", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "student_mixup 1.0" in err and says in err


def test_killed_run_resumes_from_the_last_finished_stage(own_store):
    # with a warm-started teacher (one round) whose state 0 fills the initial bank
    args = ["--profile", "smoke", "--model-name", "distill-resume", "--stages", "3",
            "--train-limit", "1024", "--seed", "6", "--threads", "1", "--teacher-width", "4",
            "--teacher-pretrain-rounds", "1", "--initial-bank", "teacher", "--targets", "bank",
            "--teacher-layer", "pool", "--student-layer", "pool", "--feature-loss", "cosine",
            "--feature-weight", "1", "--ce-weight", "1"]
    # teacher 2 runs before student 1 in-process: student 1's checkpoint appearing means
    # the warm start, teacher 1, bank 1 and teacher 2 have returned and their results are stored
    kill_when_written(["distill", *args], own_store, "student-001.pt.dvc")
    config = distill_smoke(model_name="distill-resume", train_limit=1024, seed=6,
                           teacher_width=4, teacher_pretrain_rounds=1, initial_bank="teacher")
    state = distill(config, return_state=True)
    states = all_task_states(state)
    assert states["round-1"] == "Cached"
    assert states["teacher-1"] == states["bank-1"] == states["teacher-2"] == "Cached"
    assert state.result().stages[0].bank.state_histogram[0] > 0  # the warm teacher's entries
    assert states["student-3"] == "Completed"
    # a write interrupted by the kill leaves only its hidden temporary file, never a bank or
    # checkpoint under its real name; the rerun replaced whatever was half done. Neither smoke
    # run touched the registry.
    assert not state.result().registration.registered
    assert tracking.model_versions("distill-resume") == []


def test_predict_prints_a_label_and_confidence_per_image(first_distill, fashion_folder, capsys,
                                                         tmp_path):
    main(COMMANDS, ["predict", "--images", str(fashion_folder), "--model-name", NAME])
    lines = capsys.readouterr().out.strip().splitlines()
    files = sorted(p for p in fashion_folder.rglob("*") if p.is_file())
    assert lines[0].split() == ["path", "label", "confidence"] and len(lines) == len(files) + 1
    from tasks.data import fashion_mnist_root
    from training.datasets import load_fashion_mnist

    classes = load_fashion_mnist(fashion_mnist_root(), train=False).classes
    for line, file in zip(lines[1:], files, strict=True):
        path, rest = line.strip().split(maxsplit=1)
        label, confidence = rest.rsplit(maxsplit=1)
        assert path == str(file) and label.strip() in classes
        assert 0.0 < float(confidence) <= 1.0
    single = next(fashion_folder.rglob("*.png"))
    main(COMMANDS, ["predict", "--images", str(single), "--model-name", NAME, "--version", "1"])
    assert len(capsys.readouterr().out.strip().splitlines()) == 2
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["predict", "--images", str(tmp_path), "--model-name", NAME])
    assert exit_info.value.code == 2 and "broken.png" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(COMMANDS, ["predict", "--images", str(single), "--model-name", "no-such-model"])
    assert "no-such-model" in capsys.readouterr().err
    assert tracking.alias_version(NAME, "champion") == first_distill.registration.version


def test_dask_runner_overlaps_stages_and_gives_the_same_results(first_distill, monkeypatch):
    # Last in this file: it recomputes every task (the workers inherit the environment) and
    # its results replace the cached ones, which agree with them only to rounding (below).
    monkeypatch.setenv("PREFECT_TASKS_REFRESH_CACHE", "true")
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        overlapped = distill(distill_smoke(runner="dask", dask_workers=2))
    # The same images drawn, the same banks filled: the schedule changes nothing but timing.
    for ours, theirs in zip(overlapped.stages, first_distill.stages, strict=True):
        assert ours.bank.state_histogram == theirs.bank.state_histogram
        assert ours.teacher.metrics["images"] == theirs.teacher.metrics["images"]
        # Same seed and threads; worker processes may sum floats in another order than this
        # one (PyTorch's CPU kernels), so values agree to rounding, not always to the bit.
        assert ours.teacher.metrics["loss"] == pytest.approx(theirs.teacher.metrics["loss"],
                                                             rel=1e-2)
        assert ours.student.metrics["loss"] == pytest.approx(theirs.student.metrics["loss"],
                                                             rel=1e-2)
    assert overlapped.test_accuracy == pytest.approx(first_distill.test_accuracy, abs=0.02)
