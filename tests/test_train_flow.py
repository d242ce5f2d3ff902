"""The `train` flow end to end: real Prefect, MLflow store, DVC remote and Fashion-MNIST."""

import io

import numpy as np
import pandas as pd
import pytest
from dvc_objects.fs.utils import tmp_fname
from mlflow import MlflowClient
from PIL import Image

from flows.train import train
from tasks.adapters import tracking
from tasks.adapters.versioning import data_dvc_hash
from tasks.configs.train import TrainConfig
from tests.conftest import SMOKE_MODEL as NAME
from tests.conftest import assert_whole_after_kill, kill_when_written, smoke, task_states


def test_run_records_config_metrics_versions_and_champion(first_run):
    run = MlflowClient().get_run(first_run.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.1" and run.data.params["model"] == "cnn2"
    tags = run.data.tags
    assert tags["data.dvc"] == data_dvc_hash() and len(tags["git.commit"]) >= 7
    for artifact in ("dataset", "checkpoint.final", "program"):
        assert len(tags[f"dvc.{artifact}"]) == 32, artifact
    # every round's checkpoint in one JSON artifact, not a tag each
    refs = tracking.artifact_refs(first_run.run_id)
    assert set(refs) == {"dataset", "checkpoint.round-001", "checkpoint.round-002",
                         "checkpoint.final", "program"}
    assert "dvc.checkpoint.round-001" not in tags
    assert refs["program"]["md5"] == tags["dvc.program"]
    assert refs["checkpoint.round-002"]["path"].endswith("round-002.pt")
    # MLflow's own views: a model-development experiment, the data set as the run's inputs
    # (its DVC hash as digest, a split each), the pyfunc as the run's logged model
    experiment = MlflowClient().get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"train", "val", "test"}
    assert {d.digest for d in inputs.values()} == {tags["dvc.dataset"]}
    assert [o.model_id for o in run.outputs.model_outputs] == [
        first_run.registration.model_uri.removeprefix("models:/")]
    history = MlflowClient().get_metric_history(first_run.run_id, "loss_ce")
    assert [m.step for m in history] == [1, 2]
    assert {"loss", "loss_ce", "val_accuracy", "test_accuracy"} <= set(run.data.metrics)
    assert first_run.test_accuracy > 0.25  # 10 classes: chance is 0.1
    registration = first_run.registration
    assert registration.alias == "champion" and registration.champion_version is None
    assert tracking.alias_version(NAME, "champion") == registration.version
    assert registration.accuracy == pytest.approx(first_run.test_accuracy)  # pyfunc == torch


def test_worse_model_is_only_a_challenger(first_run):
    worse = train(smoke(lr=1e-4, seed=1, registry=True))
    reg = worse.registration
    assert reg.alias == "challenger" and reg.champion_version == first_run.registration.version
    assert reg.champion_accuracy == pytest.approx(first_run.test_accuracy)
    assert reg.accuracy < reg.champion_accuracy
    assert tracking.alias_version(NAME, "champion") == first_run.registration.version
    tags = MlflowClient().get_run(worse.run_id).data.tags
    assert tags["registry.decision"].startswith("is worse than the champion")
    assert float(tags["registry.p_worse"]) < 0.05 and tags["registry.test"] == "McNemar exact"


def test_a_model_below_the_raw_pixel_baselines_is_never_champion(first_run):
    # a learning rate too small to learn in 2 rounds: below 3-NN and linear on the pixels
    weak = train(smoke(lr=1e-5, seed=2, baseline_gate=True, model_name="gated-model",
                       registry=True))
    baselines = weak.baselines
    assert baselines["knn_val_accuracy"] > 0.5 and baselines["linear_val_accuracy"] > 0.5
    assert weak.val_accuracy < max(baselines["knn_val_accuracy"],
                                   baselines["linear_val_accuracy"])
    reg = weak.registration
    assert reg.alias == "challenger" and reg.champion_version is None  # no champion at all
    assert reg.decision.startswith("below the raw-pixel")
    run = MlflowClient().get_run(weak.run_id).data
    assert run.tags["baseline.beaten"] == "false"
    assert run.metrics["baseline_knn_val_accuracy"] == baselines["knn_val_accuracy"]
    assert tracking.alias_version("gated-model", "champion") is None


def test_same_config_again_reuses_every_training_task(first_run):
    # in another project (run-only: the same work) and registered: its own experiment and name
    state = train(smoke(project="team-a", registry=True), return_state=True)
    states = task_states(state)
    assert states["round-1"] == "Cached" and states["round-2"] == "Cached"
    assert states["prepare-dataset"] == "Cached" and states["register-and-promote"] == "Completed"
    summary = state.result()
    assert summary.test_accuracy == pytest.approx(first_run.test_accuracy)
    assert MlflowClient().get_run(summary.run_id).info.experiment_id == \
        MlflowClient().get_experiment_by_name("team-a-train").experiment_id
    assert summary.registration.name == f"team-a-{NAME}"
    assert tracking.alias_version(f"team-a-{NAME}", "champion") == "1"


def test_killed_run_resumes_from_the_last_finished_round(own_store):
    config = ["--profile", "smoke", "--model-name", "resume", "--rounds", "4",
              "--train-limit", "3000", "--seed", "5"]
    checkpoints = own_store / "checkpoints" / "train"
    # round 2's checkpoint appearing means round 1's task has returned and its result is stored
    written = kill_when_written(["train", *config], checkpoints, "round-002.pt.dvc",
                                timeout=300)
    # the kill lands during round 2's `dvc commit`: no checkpoint is half-written
    run_folder = written[0].parent
    assert_whole_after_kill(run_folder, "round-*.pt")
    (run_folder / tmp_fname()).write_bytes(b"test")  # named and filled as DVC's link test
    config_obj = TrainConfig(profile="smoke", model_name="resume", rounds=4, train_limit=3000,
                             seed=5)
    state = train(config_obj, return_state=True)
    states = task_states(state)
    assert states["round-1"] == "Cached"
    assert states["round-4"] == "Completed"
    # and the resumed run has removed whatever temporary file the killed one left
    assert not list(run_folder.rglob(".*.tmp")) and not list(run_folder.rglob(".round-*"))


def test_image_folder_trains_end_to_end(fashion_folder):
    summary = train(TrainConfig(profile="smoke", data=str(fashion_folder), rounds=3,
                                model_name="folder-model", lr=0.1, registry=True))
    assert summary.registration.alias == "champion"
    model = tracking.load_pyfunc("models:/folder-model@champion")
    image = next((fashion_folder / "Trouser").glob("*.png"))
    out = model.predict(pd.DataFrame({"image": [image.read_bytes()]}))
    assert out["label"].iloc[0] in {p.name for p in fashion_folder.iterdir()}


def test_pyfunc_takes_encoded_bytes_base64_and_arrays(first_run):
    import base64

    model = tracking.load_pyfunc(f"models:/{NAME}@champion")
    pixels = np.stack([np.full((28, 28), v, dtype=np.uint8) for v in (0, 90, 200)])
    png = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        png.append(buffer.getvalue())
    from_array = model.predict(pixels)
    from_png = model.predict(pd.DataFrame({"image": png}))
    from_b64 = model.predict(pd.DataFrame({"image": [base64.b64encode(b).decode() for b in png]}))
    from_rgb = model.predict(np.repeat(pixels[..., None], 3, axis=3))
    assert list(from_array.columns) == ["label", "confidence"]
    # what the model says it returns and takes, as `mlflow models serve` and the UI show it
    from mlflow.models import get_model_info

    info = get_model_info(f"models:/{NAME}@champion")
    assert info.signature.outputs.input_names() == list(from_array.columns)
    assert "column 'image' of encoded image bytes" in info.metadata["input"]
    assert from_array.equals(from_png) and from_png.equals(from_b64)
    assert from_rgb["label"].tolist() == from_array["label"].tolist()
    assert ((from_array["confidence"] > 0) & (from_array["confidence"] <= 1)).all()
    with pytest.raises(ValueError, match="column 'image'"):
        model.predict(pd.DataFrame({"pixels": png}))
    with pytest.raises(ValueError, match="cannot decode"):
        model.predict(pd.DataFrame({"image": [b"not an image"]}))


def test_a_run_killed_while_it_holds_the_registry_lock_leaves_it_to_the_rerun(monkeypatch):
    """kill -9 during the promotion (the registry lock and the run slot held by the dead
    process, leases of an hour): the same command again takes both at once (their holder's
    process is gone), registers the model once and crowns it, and frees both."""
    from tasks.adapters.locks import RUN_TAG, read_lease
    from tests.conftest import kill_when, subprocess_env

    name = "killed-in-promotion"
    args = ["--profile", "smoke", "--register", "--model-name", name, "--rounds", "1",
            "--train-limit", "512", "--seed", "7"]
    kill_when(["train", *args], lambda: read_lease(name), "the run never held the registry lock",
              timeout=300, env={**subprocess_env(), "COMPACTML_REGISTRY_LEASE_SECONDS": "3600"})
    assert read_lease(name) is not None and read_lease(name, RUN_TAG) is not None

    from tasks.adapters import locks

    monkeypatch.setattr(locks, "RUN_WAIT_SECONDS", 5.0)  # not the hour its lease has left
    summary = train(TrainConfig(profile="smoke", model_name=name, rounds=1, train_limit=512,
                                seed=7, registry=True))
    assert summary.registration.alias == "champion"
    assert tracking.model_versions(name) == [summary.registration.version]
    assert read_lease(name) is None and read_lease(name, RUN_TAG) is None
