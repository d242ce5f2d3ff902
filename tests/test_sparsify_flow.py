"""The `sparsify` flow end to end (real Prefect, MLflow, DVC and Fashion-MNIST), and its bad
input on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactStore
from tasks.configs.sparsify import SparsifyConfig
from tests.conftest import run_cli


def smoke_sparsify(**overrides) -> SparsifyConfig:
    return SparsifyConfig(**{"profile": "smoke", "rounds": 2, "train_limit": 768, "lr": 0.1,
                             "model_name": "smoke-sparsify", **overrides})


@pytest.fixture(scope="module")
def sparse():
    """lambda 0.5 by the area rule, and a sweep point without the term (a nested run)."""
    from flows.sparsify import sparsify

    return sparsify(smoke_sparsify(sparsity_lambda=0.5, lambda_gamma=0.5, lambda_sweep="0,0.5",
                                   registry=True))


def test_the_term_raises_the_zeros_of_every_regularized_layer(sparse):
    plain = sparse.sweep[0.0]
    assert set(sparse.sweep) == {0.0, 0.5} and sparse.sweep[0.5] == sparse.report
    assert list(sparse.spec.lambdas) == ["block1", "block2"]  # lenet's feature maps
    # the area rule at gamma 0.5 (classification's default is gamma 0, one lambda): block2's
    # 7 x 7 map weighs (196 / 49) ** 0.5 = 2 times block1's 14 x 14
    assert sparse.spec.lambdas == pytest.approx({"block1": 0.5, "block2": 1.0})
    for layer in ("block1", "block2"):
        assert sparse.report.layers[layer].zero_fraction > \
            plain.layers[layer].zero_fraction + 0.1, layer
        assert sparse.report.layers[layer].near_zero_fraction >= \
            sparse.report.layers[layer].zero_fraction
    assert sparse.report.layers["block1"].shape == (16, 14, 14)
    assert sparse.report.metrics()["memory_bitmap_ratio"] < plain.metrics()["memory_bitmap_ratio"]
    assert sparse.test_accuracy > 0.25  # it still learns (chance: 0.1)


def test_metrics_report_and_plots_are_in_mlflow(sparse):
    client = MlflowClient()
    run = client.get_run(sparse.run_id)
    metrics = run.data.metrics
    assert metrics["lambda_block2"] == pytest.approx(1.0)
    # validation's figures (the split that chose the round) are named for it
    assert metrics["val_zero_fraction_block1"] == pytest.approx(
        sparse.report.layers["block1"].zero_fraction)
    assert "zero_fraction_block1" not in metrics
    assert {"loss_sparsity", "sparsity_block1", "sparsity_block2", "loss_ce",
            "test_accuracy", "val_memory_csr_ratio", "test_memory_csr_ratio"} <= set(metrics)
    history = client.get_metric_history(sparse.run_id, "loss_sparsity")
    assert [m.step for m in history] == [1, 2] and all(m.value > 0 for m in history)
    assert run.data.params["transform"] == "abs"
    files = {f.path for f in client.list_artifacts(sparse.run_id, "sparsity")}
    assert files == {"sparsity/report.json", "sparsity/layers.png", "sparsity/sweep.json",
                     "sparsity/sweep.png", "sparsity/test_report.json",
                     "sparsity/test_layers.png"}
    sweep = json.loads(Path(client.download_artifacts(sparse.run_id,
                                                      "sparsity/sweep.json")).read_text())
    assert set(sweep) == {"0", "0.5"}
    children = client.search_runs([run.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{sparse.run_id}'")
    assert [child.info.run_name for child in children] == ["lambda-0"]
    assert children[0].data.metrics["val_zero_fraction"] == pytest.approx(
        sweep["0"]["val_zero_fraction"])
    report = json.loads(Path(client.download_artifacts(sparse.run_id,
                                                       "sparsity/report.json")).read_text())
    assert report["layers"]["block2"]["dead_channels"] == sparse.report.layers[
        "block2"].dead_channels
    assert int(sparse.registration.version) >= 1
    # the dead channels removed: a smaller network, re-validated, timed, versioned
    pruned = sparse.pruned
    dead = sum(layer.dead_channels for layer in sparse.report.layers.values())
    assert (pruned.pruned_parameters < pruned.parameters) == (dead > 0)
    assert pruned.val_accuracy == pytest.approx(sparse.report.val_score)
    assert abs(pruned.pruned_val_accuracy - pruned.val_accuracy) <= 0.02
    assert {"pruned_parameter_ratio", "pruned_latency_ratio_b1",
            "pruned_latency_ratio_b256"} <= set(metrics)
    assert len(run.data.tags["dvc.program.pruned"]) == 32


def counted_test_zeros(summary, config: SparsifyConfig) -> dict[str, float]:
    """Each regularized layer's share of exact zeros over the run's test images, counted here
    with forward hooks on the network of the run's final checkpoint (`checkpoint.final`, its
    activation thresholds applied by the hooks themselves: |x| <= t becomes 0, and the next
    layer reads that), on the test split's raw images normalized by hand."""
    import torch

    from models import build_model
    from tasks.data import load_dataset, prepare_dataset, source_version
    from training.device import place_model

    data_config = config.dataset
    dataset = prepare_dataset(data_config, source_version(data_config))
    data = load_dataset(dataset)
    ref = tracking.artifact_refs(summary.run_id)["checkpoint.final"]
    payload = torch.load(ArtifactStore().path_of(ref["path"]), map_location="cpu",
                         weights_only=True)
    model = build_model(config.network_name(), dataset.channels, len(dataset.classes),
                        config.network.width)
    model.load_state_dict(payload["model"])
    # in the layout the flow ran it (background pixels give tied values; where a threshold
    # sits on a tie, a layout's rounding moves the whole tie across it)
    model = place_model(model.eval(), torch.device("cpu"))
    thresholds = payload.get("thresholds", {})
    zeros, values = dict.fromkeys(summary.spec.lambdas, 0), dict.fromkeys(summary.spec.lambdas, 0)

    def counting(name: str):
        def hook(_module, _inputs, output):
            if name in thresholds:
                output = torch.where(output.abs() > thresholds[name], output, 0.0)
            zeros[name] += int((output == 0).sum())
            values[name] += output.numel()
            return output
        return hook

    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(counting(name)) for name in zeros]
    shape = (1, -1, 1, 1)
    x = data.images[data.splits["test"]].float().div(255)
    with torch.no_grad():
        model((x - torch.tensor(dataset.mean).view(shape)) / torch.tensor(dataset.std).view(shape))
    for handle in handles:
        handle.remove()
    assert min(values.values()) > 0
    return {name: zeros[name] / values[name] for name in zeros}


def test_the_zeros_reported_are_counted_on_the_test_images(sparse):
    """The run logs each layer's exact zeros on the test split (`test_zero_fraction_<layer>`),
    which chose nothing, beside validation's (`val_...`); the logged shares are what a count
    of the zeros on that run's test images gives."""
    metrics = MlflowClient().get_run(sparse.run_id).data.metrics
    counted = counted_test_zeros(sparse, smoke_sparsify())
    assert sparse.test_report.split == "test" and list(sparse.test_report.layers) == list(counted)
    for layer, share in counted.items():
        assert metrics[f"test_zero_fraction_{layer}"] == pytest.approx(share, abs=1e-6), layer
        assert sparse.test_report.layers[layer].zero_fraction == pytest.approx(share, abs=1e-6)
        assert metrics[f"val_zero_fraction_{layer}"] == pytest.approx(
            sparse.report.layers[layer].zero_fraction)
        assert f"test_dead_channels_{layer}" in metrics
        assert f"test_memory_bitmap_ratio_{layer}" in metrics
    assert metrics["test_zero_fraction"] == pytest.approx(sum(counted.values()) / len(counted))
    assert metrics["test_memory_bitmap_ratio"] == pytest.approx(
        sparse.test_report.metrics()["memory_bitmap_ratio"])


def test_the_hoyer_square_trains_through_the_flow_and_raises_the_zeros(sparse):
    """`--transform hoyer`: each image's map's Hoyer-square, in (0, 1], is the term logged
    per layer, and at the same lambda and budget it zeros more than no term."""
    from flows.sparsify import sparsify

    hoyer = sparsify(smoke_sparsify(transform="hoyer", sparsity_lambda=0.5,
                                    model_name="smoke-sparsify-hoyer"))
    run = MlflowClient().get_run(hoyer.run_id)
    assert run.data.params["transform"] == "hoyer"
    for layer in ("block1", "block2"):
        assert 0 < run.data.metrics[f"sparsity_{layer}"] <= 1, layer
        zeros, plain = (r.layers[layer].zero_fraction for r in (hoyer.report, sparse.sweep[0.0]))
        assert zeros > plain + 0.05, (layer, zeros, plain)
    assert hoyer.test_accuracy > 0.25


def test_init_from_fine_tunes_the_registered_weights_and_thresholds_add_zeros(sparse):
    """A near-zero learning rate keeps the registered network: the fine-tuned copy scores
    what it scored (a fresh network would be at chance; the thresholds cost at most their
    tolerance), the run records its origin, and the calibrated thresholds only add zeros."""
    from flows.sparsify import sparsify
    from training.datasets import DataError

    version = sparse.registration.version
    assert sparse.registration.alias == "champion"  # the first of its name in this session
    tuned = sparsify(smoke_sparsify(init_from="models:/smoke-sparsify@champion", lr=1e-9,
                                    rounds=1, sparsity_lambda=0.0, lambda_sweep=None,
                                    zero_threshold_tolerance=0.03, threshold_cycles=1,
                                    threshold_cycle_rounds=1, threshold_cycle_lr=1e-9,
                                    model_name="smoke-sparsify-tuned", registry=True))
    assert tuned.test_accuracy == pytest.approx(sparse.test_accuracy, abs=0.06)
    assert tuned.test_accuracy > 0.25
    metrics = MlflowClient().get_run(tuned.run_id).data.metrics
    assert {"zero_threshold_block1", "zero_threshold_block2"} & set(metrics)
    assert metrics["val_accuracy"] >= metrics["val_accuracy_unthresholded"] - 0.03 - 1e-9
    for layer, report in tuned.report.layers.items():
        assert report.zero_fraction >= sparse.report.layers[layer].zero_fraction - 1e-3, layer
    # the threshold cycle trained with the first thresholds in place (at lr 1e-9 the weights
    # stay: its round scores what the first calibration left), then calibrated on top of them
    client = MlflowClient()
    cycle = client.get_metric_history(tuned.run_id, "val_accuracy")
    unthresholded = {m.step: m.value for m in
                     client.get_metric_history(tuned.run_id, "val_accuracy_unthresholded")}
    assert sorted(unthresholded) == [0, 1]
    assert [m.value for m in cycle if m.step == 2] == [pytest.approx(unthresholded[1])]
    for layer in ("block1", "block2"):
        raised = {m.step: m.value for m in
                  client.get_metric_history(tuned.run_id, f"zero_threshold_{layer}")}
        assert raised.get(1, 0.0) >= raised.get(0, 0.0), layer  # thresholds only rise
    assert "checkpoint.cycle-1.round-001" in tracking.artifact_refs(tuned.run_id)
    assert tuned.registration.accuracy == pytest.approx(tuned.test_accuracy)  # as served
    tags = MlflowClient().get_run(tuned.run_id).data.tags
    assert tags["init_from"] == f"models:/smoke-sparsify/{version}"  # the alias resolved
    assert "dvc.checkpoint.init" in tags
    with pytest.raises(DataError, match="does not fit --model resnet18"):
        sparsify(smoke_sparsify(model="resnet18", init_from=sparse.registration.version_uri))
    with pytest.raises(DataError, match="no registered model version models:/no-such-model"):
        sparsify(smoke_sparsify(init_from="models:/no-such-model@champion"))


def test_a_zero_target_is_reached_in_steps_and_settled(sparse):
    """`--zero-target 0.7` over one cycle: the first calibration goes half the way, the
    second all the way; at a learning rate of 1e-9 the cycle and the settling rounds keep the
    weights, so the registered network has the target's zeros in every layer (it had fewer)."""
    from flows.sparsify import sparsify

    client = MlflowClient()
    target = sparsify(smoke_sparsify(init_from=sparse.registration.version_uri, lr=1e-9,
                                     rounds=1, sparsity_lambda=0.0, lambda_sweep=None,
                                     zero_target=0.7, threshold_cycles=1,
                                     threshold_cycle_rounds=1, threshold_settle_rounds=1,
                                     threshold_cycle_lr=1e-9, model_name="smoke-sparsify-zt"))
    for layer, report in target.report.layers.items():
        assert sparse.report.layers[layer].zero_fraction < 0.7 <= report.zero_fraction, layer
        steps = {m.step: m.value for m in
                 client.get_metric_history(target.run_id, f"zero_threshold_{layer}")}
        # half the way, all the way, then the top-up after settling: nothing left to add
        assert sorted(steps) == [0, 1, 2] and 0 < steps[0] < steps[1] == steps[2], steps
    refs = tracking.artifact_refs(target.run_id)
    assert "checkpoint.settle.round-001" in refs and "checkpoint.cycle-1.round-001" in refs
    assert target.test_accuracy > 0.25
    # the thresholds were set on validation; the zeros logged for the test images are a
    # count there with the thresholds in place
    metrics = client.get_run(target.run_id).data.metrics
    counted = counted_test_zeros(target, smoke_sparsify())
    for layer, share in counted.items():
        assert metrics[f"test_zero_fraction_{layer}"] == pytest.approx(share, abs=1e-6), layer


def test_a_zero_target_ramp_raises_the_thresholds_inside_the_run(sparse):
    """`--zero-target-ramp 1,2` over 2 rounds at a learning rate of 1e-9 (the weights stay):
    before round 1 half the way to 0.7, before round 2 all the way, after it a top-up with
    nothing to add; the round kept is the one at the target (round 2, though round 1 had
    fewer zeros to lose accuracy to), and the registered network has the target's zeros in
    every layer (it had fewer). Only the final top-up writes a thresholded checkpoint: each
    round stores the thresholds it trained with."""
    from flows.sparsify import sparsify

    client = MlflowClient()
    ramped = sparsify(smoke_sparsify(init_from=sparse.registration.version_uri, lr=1e-9,
                                     rounds=2, sparsity_lambda=0.0, lambda_sweep=None,
                                     zero_target=0.7, zero_target_ramp="1,2",
                                     model_name="smoke-sparsify-ramp"))
    for layer, report in ramped.report.layers.items():
        assert sparse.report.layers[layer].zero_fraction < 0.7 <= report.zero_fraction, layer
        steps = {m.step: m.value for m in
                 client.get_metric_history(ramped.run_id, f"zero_threshold_{layer}")}
        assert sorted(steps) == [0, 1, 2] and 0 < steps[0] < steps[1] == steps[2], steps
    assert ramped.best_round == 2
    refs = tracking.artifact_refs(ramped.run_id)
    assert {"checkpoint.round-001", "checkpoint.round-002"} <= set(refs)
    folder = ArtifactStore().path_of(refs["checkpoint.round-002"]["path"]).parent
    assert [p.name for p in folder.glob("*-thresholds-*.pt")] == [
        "round-002-thresholds-zeros-0.7.pt"]


@pytest.fixture(scope="module", params=["detection", "contour"])
def canvas(request):
    """A detector and a contour network, each 2 rounds on 48 small canvases; the contour
    network also without the term (a sweep point)."""
    from flows.sparsify import sparsify

    config = smoke_sparsify(task=request.param, canvas=64, layouts="48,16,16", lr=0.05,
                            sparsity_lambda=0.5, model_name=f"smoke-{request.param}", registry=True,
                            lambda_sweep="0,0.5" if request.param == "contour" else None)
    return config, sparsify(config)


def test_canvas_tasks_train_measure_and_register_through_their_pyfunc(canvas):
    config, summary = canvas
    client = MlflowClient()
    run = client.get_run(summary.run_id)
    metrics, tags = run.data.metrics, run.data.tags
    score = {"detection": "map_50", "contour": "boundary_f"}[config.task]
    # the served pyfunc scores the test canvases exactly as the network did
    assert metrics[f"registry_test_{score}"] == pytest.approx(summary.test[f"test_{score}"])
    assert summary.registration.metric == f"test_{score}"
    assert summary.registration.alias == "champion"  # the first of its name
    assert len(tags["dvc.layouts"]) == 32 and len(tags["dvc.dataset"]) == 32
    assert metrics["layouts_train_canvases"] == 48
    assert list(summary.report.layers) == list(config.layers())
    for layer in summary.report.layers.values():
        assert 0 <= layer.zero_fraction <= layer.near_zero_fraction <= 1
    # the zeros to report are the test canvases' (validation chose the round), named by split
    assert summary.test_report.split == "test"
    assert list(summary.test_report.layers) == list(config.layers())
    for name, layer in summary.test_report.layers.items():
        key = name.replace(".", "_")
        assert metrics[f"test_zero_fraction_{key}"] == pytest.approx(layer.zero_fraction)
        assert metrics[f"val_zero_fraction_{key}"] == pytest.approx(
            summary.report.layers[name].zero_fraction)
        assert f"zero_fraction_{key}" not in metrics
    losses = [m.value for m in client.get_metric_history(summary.run_id, "loss_sparsity")]
    assert len(losses) == 2 and all(value > 0 for value in losses)
    if config.task == "contour":
        # map areas 64^2, 32^2, 16^2, 32^2, 64^2 at gamma 0.5: lambda x 1, 2, 4, 2, 1
        assert summary.spec.lambdas == pytest.approx(
            {"enc1": 0.5, "enc2": 1.0, "enc3": 2.0, "dec2": 1.0, "dec1": 0.5})
        assert {"test_boundary_precision", "test_boundary_recall", "test_mask_iou"} <= set(
            metrics)
        assert set(summary.sweep) == {0.0, 0.5}
        assert summary.sweep[0.5].metrics()["zero_fraction"] > \
            summary.sweep[0.0].metrics()["zero_fraction"]
        files = {f.path for f in client.list_artifacts(summary.run_id, "sparsity")}
        assert {"sparsity/sweep.json", "sparsity/sweep.png", "sparsity/layers.png"} <= files
    else:
        assert {"loss_bbox_regression", "loss_classification", "test_map"} <= set(metrics)


def test_registered_canvas_models_take_raw_images(canvas):
    import io

    import mlflow
    import numpy as np
    import pandas as pd
    from PIL import Image

    config, summary = canvas
    model = mlflow.pyfunc.load_model(f"models:/{summary.registration.name}@champion")
    canvas = np.zeros((80, 100), dtype=np.uint8)
    canvas[20:50, 30:60] = 200
    buffer = io.BytesIO()
    Image.fromarray(canvas).save(buffer, format="PNG")
    out = model.predict(pd.DataFrame({"image": [buffer.getvalue()]}))
    assert len(out) == 1
    assert model.metadata.get_output_schema().input_names() == list(out.columns)
    if config.task == "contour":
        assert out["boundary"][0].shape == (80, 100) and out["mask"][0].shape == (80, 100)
        assert set(np.unique(out["boundary"][0])) <= {0, 1}
    else:
        row = out.iloc[0]
        assert len(row.boxes) == len(row.labels) == len(row.scores)
        classes = client_classes(summary)
        assert set(row.labels) <= set(classes)
        assert all(0 <= x1 <= x2 <= 100 and 0 <= y1 <= y2 <= 80 for x1, y1, x2, y2 in row.boxes)


def client_classes(summary) -> list[str]:
    tags = MlflowClient().get_model_version(summary.registration.name,
                                            summary.registration.version).tags
    return json.loads(tags["classes"])


@pytest.mark.parametrize(("flags", "names"), [
    (["--sparse-layers", "block9"], ["sparse_layers", "block9", "block1.1"]),
    (["--transform", "power", "--power", "3"], ["power must be even"]),
    (["--transform", "exp_abs", "--base", "1"], ["base must be > 1"]),
    (["--sparsity-lambda", "-0.1"], ["sparsity_lambda"]),
    (["--layer-lambdas", "1,2,3"], ["layer_lambdas has 3 values for 2 sparse_layers"]),
    (["--lambda-sweep", "0.1,-1"], ["lambda_sweep must be >= 0"]),
    (["--task", "detection", "--model", "lenet"], ["unknown detection model 'lenet'",
                                                   "ssdlite320_mobilenet_v3_large"]),
    (["--task", "contour", "--sparse-layers", "enc9"], ["sparse_layers", "enc9", "dec1"]),
    (["--task", "contour", "--layouts", "10,0,5"], ["layouts", "every layout count"]),
    (["--init-from", "runs:/abc/model"], ["init_from", "models:/NAME@ALIAS"]),
    (["--task", "contour", "--init-from", "models:/train@champion"],
     ["init_from: fine-tuning is for --task classification"]),
    (["--task", "detection", "--ddp-procs", "2"],
     ["ddp_procs: --task detection trains in one process"]),
    (["--threshold-cycles", "2"], ["threshold_cycles", "--zero-threshold-tolerance"]),
    (["--zero-target", "0.8", "--zero-threshold-tolerance", "0.01"],
     ["zero_target: 0.8 sets the thresholds by their zeros", "give one"]),
    (["--zero-target", "1.2"], ["zero_target"]),
    (["--zero-target-ramp", "2,3"], ["zero_target_ramp: 2,3", "--zero-target"]),
    (["--zero-target", "0.8", "--zero-target-ramp", "2,99"],
     ["zero_target_ramp: 2,99", "within the run's"]),
    (["--zero-target", "0.8", "--zero-target-ramp", "3,2"], ["FIRST <= LAST"]),
    (["--zero-target", "0.8", "--zero-target-ramp", "1,2", "--rounds", "3"],
     ["before round 1", "--init-from"]),
    (["--zero-target", "0.8", "--zero-target-ramp", "2,2", "--threshold-cycles", "2"],
     ["--threshold-cycles", "give one"]),
])
def test_bad_input_is_one_error_line_before_any_work(flags, names, capsys):
    code, _, err = run_cli(capsys, "sparsify", "--profile", "smoke", *flags)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: invalid configuration:"]  # then one line per bad field
    for name in names:
        assert name in err, (name, err)
