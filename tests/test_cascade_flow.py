"""The `cascade` flow end to end (real Prefect, MLflow, DVC and Fashion-MNIST), its registered
pyfunc, and its bad input on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from tasks.adapters import tracking
from tasks.configs.cascade import CascadeConfig
from tests.conftest import assert_whole_after_kill, kill_when_written, run_cli, task_states


def smoke_cascade(**overrides) -> CascadeConfig:
    return CascadeConfig(**{"profile": "smoke", "rounds": 2, "train_limit": 768, "lr": 0.1,
                            "min_steps": 150,
                            "model_name": "smoke-cascade", **overrides})


@pytest.fixture(scope="module")
def run():
    from flows.cascade import cascade

    return cascade(smoke_cascade(registry=True))


def test_modules_train_in_order_on_rising_difficulty_and_everything_is_tracked(run):
    client = MlflowClient()
    data = client.get_run(run.run_id).data
    metrics, tags = data.metrics, data.tags
    images = [metrics[f"module{k}_images"] for k in range(3)]
    difficulty = [metrics[f"module{k}_mean_difficulty"] for k in range(3)]
    assert images == sorted(images) and images[0] < images[-1]
    assert difficulty == sorted(difficulty) and difficulty[0] < difficulty[-1]
    # the training split: 20% held out for the predictors, the rest the modules' first set
    assert metrics["second_set_images"] + images[-1] == metrics["data_train_images"]
    assert metrics["second_set_images"] == round(0.2 * metrics["data_train_images"])
    for key in ("difficulty_sets", "latency_table", "checkpoint.calibrated",
                "checkpoint.module-1.predictor", "checkpoint.exits-refit"):
        assert len(tags[f"dvc.{key}"]) == 32, key
    assert len(tracking.artifact_refs(run.run_id)["checkpoint.module-2.round-002"]["md5"]) == 32
    for k in range(3):
        history = client.get_metric_history(run.run_id, f"module{k}_val_accuracy")
        assert [m.step for m in history] == [1, 2]
    assert {"module1_loss_route", "predictor1_share_0", "predictor2_share_1", "val_accuracy",
            "test_accuracy", "full_test_accuracy", "plain_test_accuracy", "speedup_b1",
            "oracle_accuracy", "threshold_0", "threshold_1", "exit0_distill_loss",
            "exit1_val_accuracy_before_refit", "exit1_val_accuracy"} <= set(metrics)
    assert metrics["predictor1_share_0"] + metrics["predictor1_share_1"] == pytest.approx(1)
    files = {f.path for f in client.list_artifacts(run.run_id, "cascade")}
    assert files == {"cascade/latency.json", "cascade/sweep.json",
                     "cascade/accuracy_latency.png"}
    table = json.loads(Path(client.download_artifacts(run.run_id, "cascade/latency.json"))
                       .read_text())
    assert table["batch_sizes"] == [1, 32] and "2.sub1" in table["parts"]


def test_the_exit_refit_changes_the_early_heads_alone(run):
    from tasks.adapters.versioning import ArtifactStore, md5_of

    refs = tracking.artifact_refs(run.run_id)

    def weights(name: str) -> dict:
        path = ArtifactStore().path_of(refs[name]["path"])
        assert md5_of(path) == refs[name]["md5"]
        return torch.load(path, map_location="cpu", weights_only=True)["model"]

    before, after = weights("checkpoint.module-2.predictor"), weights("checkpoint.exits-refit")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= {
        f"exits.{k}.fc.{layer}.{p}" for k in (0, 1) for layer in (0, 2) for p in ("weight", "bias")
    }


def test_the_calibrated_cascade_keeps_its_promise_on_validation(run):
    metrics = run.test.metrics
    calibration = run.calibration.metrics
    # the target, or no early exit at all where the routed network misses it
    assert calibration["val_accuracy"] >= min(calibration["val_full_accuracy"] - 0.003,
                                              calibration["val_routed_accuracy"]) - 1e-9
    assert sum(metrics[f"exit_share_{k}"] for k in range(3)) == pytest.approx(1)
    # the predictors (or the most expensive sub-networks fixed, the plain cascade) are kept
    # only if the calibrated cascade with them meets the target where the predictors' most
    # frequent choices fixed for good (no predictor run) miss it, or is cheaper
    target = calibration["val_full_accuracy"] - 0.003 - 1e-9
    # (missed, cost): where the most frequent choices won, the run's figures are theirs
    choices_fixed = (calibration["val_accuracy_predictors_fixed"] < target,
                     calibration["val_cost_ratio_predictors_fixed"])
    as_run = (calibration["val_accuracy"] < target, calibration["val_cost_ratio"])
    other = calibration["predictors_kept"] or calibration["most_expensive_fixed"]
    assert bool(other) == (as_run < choices_fixed)
    from tasks.adapters.checkpoints import load_checkpoint
    from tasks.adapters.versioning import ArtifactStore

    weights = load_checkpoint(ArtifactStore(), run.calibration.checkpoint)["model"]
    fixed = [int(weights[f"blocks.{k}.fixed"]) for k in (1, 2)]
    assert (min(fixed) < 0) == bool(calibration["predictors_kept"]), fixed
    assert metrics["test_accuracy"] > 0.3  # it learns (chance: 0.1)
    assert metrics["full_test_accuracy"] > 0.3
    assert metrics["oracle_accuracy"] >= max(metrics["test_accuracy"],
                                             metrics["full_test_accuracy"])
    # the oracle's cheapest right path never costs more than every module at its dearest
    assert 0 < metrics["oracle_flops_per_image"] <= metrics["full_flops_per_image"]
    assert [point["tolerance"] for point in run.test.sweep] == sorted(
        point["tolerance"] for point in run.test.sweep)


def test_both_routings_are_tested_and_the_registered_one_is_the_calibrations_choice(run):
    """The test task scores both routings the calibration chose between, each with its own
    thresholds: the most frequent sub-networks fixed (`fixed_...`) and the fitted predictors
    (`fitted_...`); the run records which one validation chose (`Calibration.routing`, the tag
    `cascade.routing`), and the registered model's own figures (no prefix) are that one's."""
    from tasks.adapters.checkpoints import load_checkpoint
    from tasks.adapters.versioning import ArtifactStore

    data = MlflowClient().get_run(run.run_id).data
    metrics, tags = data.metrics, data.tags
    calibration = run.calibration
    kept, expensive = (calibration.metrics[key] for key in ("predictors_kept",
                                                             "most_expensive_fixed"))
    expected = "fitted" if kept else "most_expensive" if expensive else "fixed"
    assert calibration.routing == expected and tags["cascade.routing"] == expected
    for prefix in ("fixed_", "fitted_"):
        assert {f"{prefix}{key}" for key in (
            "test_accuracy", "speedup_b1", "ms_per_image_b1", "table_cost_ratio",
            "flops_per_image", "cost_over_oracle", "flops_over_oracle", "exit_share_0",
            "exit_share_1", "exit_share_2")} <= set(metrics), prefix
        assert sum(metrics[f"{prefix}exit_share_{k}"] for k in range(3)) == pytest.approx(1)
        assert metrics[f"{prefix}cost_over_oracle"] == pytest.approx(
            metrics[f"{prefix}table_cost_ratio"] / metrics["oracle_table_cost_ratio"])
    # the two are different networks: the fitted predictors pay for their own time
    weights = load_checkpoint(ArtifactStore(), calibration.checkpoint)["model"]
    registered = [int(weights[f"blocks.{k}.fixed"]) for k in (1, 2)]
    routing = load_checkpoint(ArtifactStore(), calibration.checkpoint)["routing"]
    assert routing["fitted"]["fixed"] == {1: -1, 2: -1}
    assert min(routing["fixed"]["fixed"].values()) >= 0
    # the registered checkpoint is the chosen routing, with the thresholds calibrated for it
    if expected != "most_expensive":
        assert registered == [routing[expected]["fixed"][k] for k in (1, 2)]
        assert calibration.thresholds == pytest.approx(
            routing[expected]["thresholds"].tolist())
    same = {"fixed": "fixed_", "fitted": "fitted_", "most_expensive": "plain_"}[expected]
    for key in ("test_accuracy", "table_cost_ratio", "flops_per_image", "exit_share_0",
                "exit_share_1", "exit_share_2", "cost_over_oracle", "flops_over_oracle"):
        assert metrics[key] == pytest.approx(metrics[f"{same}{key}"]), key
    assert run.registration.accuracy == pytest.approx(metrics[f"{same}test_accuracy"])
    assert calibration.metrics["val_accuracy"] == pytest.approx(
        {"fixed": calibration.metrics["val_accuracy_predictors_fixed"],
         "fitted": calibration.metrics["val_accuracy_predictors_fitted"]}.get(
            expected, calibration.metrics["val_accuracy"]))


def test_the_registered_pyfunc_runs_the_real_cascade(run):
    """The served model gives each image the exit and the sub-networks the network itself
    gives it, and only names the super-network modules the image reached."""
    import mlflow

    from tasks.cascade.tasks import trained_cascade
    from tasks.data import load_dataset
    from tasks.promotion import test_images

    config = smoke_cascade()
    prepared = _prepared(config)
    images, _ = test_images(prepared)
    model = mlflow.pyfunc.load_model(f"models:/smoke-cascade/{run.registration.version}")
    out = model.predict(images[:64])
    assert list(out.columns) == ["label", "confidence", "exit", "subnetworks"]
    for exit_, routes in zip(out["exit"], out["subnetworks"], strict=True):
        modules = [int(part.split(":")[0]) for part in routes.split()]
        assert modules == [m for m in (2, 3) if m <= exit_]  # only the modules it reached
    net = trained_cascade(config, prepared, run.calibration.checkpoint)
    data = load_dataset(prepared)
    shape = (1, -1, 1, 1)
    x = data.images[data.splits["test"][:64]].float().div(255)
    direct = net.infer((x - torch.tensor(prepared.mean).view(shape))
                       / torch.tensor(prepared.std).view(shape))
    assert (np.array(out["exit"]) == direct.exits.numpy() + 1).all()
    assert [prepared.classes[i] for i in direct.labels.tolist()] == list(out["label"])
    assert run.registration.accuracy == pytest.approx(run.test_accuracy)  # as served


def test_killed_run_resumes_from_the_last_finished_round(own_store):
    from flows.cascade import cascade

    args = ["--profile", "smoke", "--rounds", "2", "--train-limit", "768", "--lr", "0.1",
            "--min-steps", "150", "--seed", "7", "--threads", "1", "--model-name",
            "cascade-resume"]
    # (--threads 1 also checks that the latency table is named for the threads the tasks
    # set, not the calling process's: the run had stopped on a device mismatch)
    checkpoints = own_store / "checkpoints" / "cascade"
    # module 1's first round written: the sets, the latency table and module 0 are stored
    written = kill_when_written(["cascade", *args], checkpoints, "module-1-round-001.pt.dvc")
    run_folder = written[0].parent
    assert_whole_after_kill(run_folder, "module-*.pt")
    state = cascade(smoke_cascade(seed=7, threads=1, model_name="cascade-resume"),
                    return_state=True)
    states = task_states(state)
    assert states["difficulty-sets"] == states["latency-table"] == "Cached"
    assert states["module-0-round-1"] == states["module-0-round-2"] == "Cached"
    assert states["module-2-round-2"] == "Completed"
    assert state.result().test_accuracy > 0.3
    assert tracking.model_versions("cascade-resume") == []  # smoke runs never register
    assert not list(run_folder.rglob(".*.tmp"))  # the rerun's commits removed DVC's debris


def _prepared(config: CascadeConfig):
    from tasks.data import prepare_dataset, source_version

    data = config.dataset
    return prepare_dataset(data, source_version(data))


@pytest.mark.parametrize(("fields", "names"), [
    ({"thresholds": "0.5,1.5"}, ["thresholds", "(0, 1]"]),
    ({"thresholds": "0,0.5"}, ["thresholds", "(0, 1]"]),
    ({"thresholds": "0.5"}, ["thresholds needs 2 values"]),
    ({"sub_widths": "1.0"}, ["sub_widths", "two or more sub-networks"]),
    ({"predictor_fraction": 0}, ["predictor_fraction", "greater than 0"]),
    ({"widths": "8,16"}, ["widths", "K >= 3"]),
    ({"super_modules": "5"}, ["super_modules", "0..2"]),
    ({"curriculum": "0.9,0.5,1"}, ["curriculum", "rising"]),
    ({"calibrate": "budget"}, ["latency_budget"]),
])
def test_bad_config_names_the_field(fields, names):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as error:
        CascadeConfig(profile="smoke", **fields)
    for name in names:
        assert name in str(error.value), (name, str(error.value))


@pytest.mark.parametrize(("flags", "message"), [
    (["--thresholds", "0.5,1.5"], "every threshold must be in (0, 1]"),
    (["--latency-table", "{table}"], "latency_table was measured on 'cuda: NVIDIA H200'"),
])
def test_bad_input_is_one_error_line_before_any_work(flags, message, tmp_path, capsys):
    table = tmp_path / "latency.json"
    table.write_text(json.dumps({"device": "cuda: NVIDIA H200", "parts": {}}))
    flags = [flag.format(table=table) for flag in flags]
    code, _, err = run_cli(capsys, "cascade", "--profile", "smoke", *flags)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: invalid configuration:"]  # then one line per bad field
    assert message in err, err
