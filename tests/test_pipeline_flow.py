"""The `pipeline` flow end to end (real Prefect, MLflow, DVC and Fashion-MNIST): the steps chain
(each starts from the last one's weights), everything lands on one MLflow run, the registered
pyfunc runs the real fallback cascade, and a rerun on unchanged data trains nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from tasks.adapters import tracking
from tasks.configs.pipeline import PipelineConfig
from tests.conftest import run_cli, task_states

NAME = "smoke-pipeline"
# descriptions of Fashion-MNIST's classes, so the image-text step runs
CLASS_DESCRIPTIONS = str(Path(__file__).parent / "data" / "fashion_classes.csv")


def smoke_pipeline(**overrides) -> PipelineConfig:
    """The smoke pipeline with a warm-started teacher, better than the student after its
    later steps, tolerance 0 (every image the teacher gets right is kept) and level 1 (any
    advantage counts, significant on the smoke run's few validation images or not): the
    teacher answers some images and the registered model is the cascade."""
    return PipelineConfig(**{"profile": "smoke", "registry": True, "model_name": NAME,
                             "class_descriptions": CLASS_DESCRIPTIONS,
                             "teacher_pretrain_rounds": 4, "fallback_tolerance": 0.0,
                             "fallback_level": 1.0, **overrides})


@pytest.fixture(scope="module")
def run():
    from flows.pipeline import pipeline

    return pipeline(smoke_pipeline())


def test_every_step_is_tracked_under_one_parent_run(run):
    client = MlflowClient()
    parent = client.get_run(run.run_id)
    metrics = parent.data.metrics
    assert [s.name for s in run.steps] == ["teacher", "distill", "image_text", "pbt",
                                           "sparsify"]
    for step in run.steps:
        assert metrics[f"step_{step.name}_test_accuracy"] == step.test_accuracy
        assert len(tracking.artifact_refs(run.run_id)[f"program.{step.name}"]["md5"]) == 32
    assert 0 < metrics["step_sparsify_zero_fraction"] < 1
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{run.run_id}'")
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == [
        "fallback", "image_text", "pbt", "sparsify", "student", "teacher"]
    pbt = next(c for c in children if c.data.tags["mlflow.runName"] == "pbt")
    members = client.search_runs([parent.info.experiment_id],
                                 f"tags.mlflow.parentRunId = '{pbt.info.run_id}'")
    assert len(members) == 2
    assert parent.data.tags["pipeline.key"] == tracking.version_tags(
        NAME, run.registration.version)["pipeline.key"]
    assert not run.student_alone and run.fallback.metrics["val_student_share"] < 1
    assert metrics["test_accuracy"] == run.fallback.metrics["test_accuracy"] > 0.2
    # each step's size and time beside the others, and the table of steps on the run
    steps = {step.name: step for step in run.steps}
    assert steps["teacher"].parameters > steps["sparsify"].parameters == steps["pbt"].parameters
    assert all(step.ms_per_image_b1 > 0 and step.program_bytes > 0 for step in run.steps)
    assert metrics["step_sparsify_parameters"] == steps["sparsify"].parameters
    assert run.fallback.metrics["steps_parameters"] == (steps["teacher"].parameters
                                                        + steps[run.front].parameters)
    table = client.download_artifacts(run.run_id, "pipeline/steps.md")
    rows = [line.split(" | ")[0].strip("| ") for line in Path(table).read_text().splitlines()[2:]]
    assert rows == ["teacher", "distill", *(name + ("" if steps[name].kept else " (not kept)")
                                            for name in ("image_text", "pbt", "sparsify")),
                    f"cascade ({run.fallback.routing} routing)"]
    # the cascade's routing and latency table on its own run
    fallback = next(c for c in children if c.data.tags["mlflow.runName"] == "fallback")
    assert fallback.data.tags["cascade.routing"] == run.fallback.routing
    assert fallback.data.metrics["predictors_kept"] == float(run.fallback.router is not None)
    latency = json.loads(Path(client.download_artifacts(fallback.info.run_id,
                                                        "cascade/latency.json")).read_text())
    assert set(latency) == {"student", "teacher", "student_predictor"}
    # the logged model sits in the run's experiment, so the run's page lists it
    model = client.get_logged_model(run.registration.model_uri.removeprefix("models:/"))
    assert (model.experiment_id, model.source_run_id) == (parent.info.experiment_id, run.run_id)


def test_each_step_starts_from_the_last_ones_weights(run):
    """PBT's members start from the distilled student and sparsity fine-tuning from PBT's
    best: the hand-over checkpoints hold exactly those weights."""
    from tasks.adapters.versioning import ArtifactStore

    store = ArtifactStore()
    refs = tracking.artifact_refs(run.run_id)  # this run's own hand-overs, not the store's
    handed = {step: torch.load(store.path_of(refs[f"handover.{step}"]["path"]),
                               map_location="cpu", weights_only=True)
              for step in ("distill", "pbt") if f"handover.{step}" in refs}
    client = MlflowClient()
    student = next(c for c in client.search_runs(
        [client.get_run(run.run_id).info.experiment_id],
        f"tags.mlflow.parentRunId = '{run.run_id}' and tags.mlflow.runName = 'student'"))
    last = max(k for k in tracking.artifact_refs(student.info.run_id) if k.startswith(
        "checkpoint.stage-"))
    student_weights = torch.load(store.path_of(tracking.artifact_refs(
        student.info.run_id)[last]["path"]), map_location="cpu", weights_only=True)["model"]
    assert set(handed["distill"]) == {"model"}
    for key, value in student_weights.items():
        assert torch.equal(handed["distill"]["model"][key], value), key
    assert "program.pbt" in refs
    # sparsity fine-tuning starts from PBT's best only where PBT did not lose on validation
    steps = {step.name: step for step in run.steps}
    assert steps["pbt"].kept == (steps["pbt"].val_accuracy >= steps["distill"].val_accuracy)
    assert ("pbt" in handed) == steps["pbt"].kept
    if steps["pbt"].kept:
        best = torch.load(store.path_of(steps["pbt"].checkpoint.path), map_location="cpu",
                          weights_only=True)["kept"]
        assert best and set(handed["pbt"]["model"]) == set(best)  # every weight, compared
        for key, value in best.items():
            assert torch.equal(handed["pbt"]["model"][key], value), key
    kept = [s for s in run.steps if s.name in ("distill", "pbt", "sparsify") and s.kept]
    assert run.front == kept[-1].name
    assert client.get_run(run.run_id).data.tags["pipeline.front"] == run.front


def test_a_step_goes_on_below_level_1_only_on_a_significant_validation_advantage():
    """`--step-level`: PBT or the sparse step two images ahead of the step before on
    validation (p = 0.25) goes on at level 1 (not below), not at 0.05; five clean wins
    (p = 0.03) go on at both; a step below the one before goes on at neither."""
    from flows.pipeline import StepResult, kept_over
    from tasks.pipeline import StepEvidence
    from training.promotion import binomial_tail

    def step(name: str, val: float) -> StepResult:
        return StepResult.model_construct(name=name, val_accuracy=val, kept=True)

    distill = step("distill", 0.8500)
    for only_step, only_before, val, level, kept in [
            (2, 0, 0.8750, 1.0, True), (2, 0, 0.8750, 0.05, False), (5, 0, 0.9125, 0.05, True),
            (5, 0, 0.9125, 1.0, True), (1, 3, 0.8250, 1.0, False), (1, 3, 0.8250, 0.05, False)]:
        evidence = StepEvidence(only_step_right=only_step, only_before_right=only_before,
                                p_better=binomial_tail(only_step, only_step + only_before))
        result, words = kept_over(step("pbt", val), distill, evidence, level)
        assert result.kept == kept, (only_step, only_before, level)
        assert words.startswith("kept" if kept else "not kept")
        assert f"right on {only_step} images it misses, wrong on {only_before}" in words
        assert ("not significant at 0.05" in words) == (level < 1 and not kept and val >= 0.85)


def test_the_paired_step_evidence_counts_what_the_validation_accuracies_say(run):
    """`step_evidence` scores PBT's and the distilled student's networks on every validation
    image: the images only one of them gets right differ by what their validation accuracies
    (each logged by its own step) differ by."""
    from tasks.data import prepare_dataset, source_version
    from tasks.pipeline import TimedStep, step_evidence

    data = smoke_pipeline().dataset
    dataset = prepare_dataset(data, source_version(data))
    steps = {step.name: step for step in run.steps}
    pbt, distill = (TimedStep(name=s.name, classifier=s.classifier, checkpoint=s.checkpoint,
                              weights=s.weights) for s in (steps["pbt"], steps["distill"]))
    evidence = step_evidence.fn(pbt, distill, dataset)
    images = dataset.sizes["val"]
    assert (evidence.only_step_right - evidence.only_before_right) / images == pytest.approx(
        steps["pbt"].val_accuracy - steps["distill"].val_accuracy, abs=0.5 / images)
    assert 0.0 < evidence.p_better <= 1.0


def test_a_student_answering_every_validation_image_is_registered_without_the_teacher(run):
    import mlflow

    from flows.pipeline import pipeline

    # a sparsity term strong enough to lose on validation: the student before it goes on
    alone = pipeline(smoke_pipeline(fallback_tolerance=1.0, sparsity_lambda=1000.0))
    assert alone.student_alone and alone.fallback.metrics["val_student_share"] == 1.0
    steps = {step.name: step for step in alone.steps}
    assert not steps["sparsify"].kept and alone.front == "pbt"  # a PBT member's `kept` weights
    model = mlflow.pyfunc.load_model(alone.registration.model_uri)
    served = model.unwrap_python_model().implementation
    assert not hasattr(served, "fallback")  # a plain classifier: the student's program only
    served_size = sum(t.numel() for t in (*served.program.parameters(),
                                          *served.program.buffers()))
    assert int(tracking.version_tags(NAME, alone.registration.version)["parameters"]) == \
        served_size < steps["teacher"].parameters
    assert sum(p.numel() for p in served.program.parameters()) == steps[alone.front].parameters
    # the summary's cascade row counts what is registered: the student's parameters only
    assert alone.fallback.metrics["steps_parameters"] == steps[alone.front].parameters
    assert alone.test_accuracy == alone.fallback.metrics["test_student_accuracy"]


def test_the_image_text_step_goes_on_only_where_it_beats_the_student_on_validation(run):
    """The image-text step trains from the distilled student and, as a plain student network,
    predicts what its image-text classifier predicts; PBT starts from it only where it beats
    the distilled student on validation."""
    from tasks.adapters.versioning import ArtifactStore
    from tasks.data import load_dataset, prepare_dataset, source_version
    from tasks.image_text.tasks import describe_images, new_network
    from tasks.training import trained_model
    from training.batches import eval_batches

    steps = {step.name: step for step in run.steps}
    text, student = steps["image_text"], steps["distill"]
    assert text.kept == (text.val_accuracy > student.val_accuracy)
    refs = tracking.artifact_refs(run.run_id)
    assert refs["start.pbt"]["md5"] == (text.checkpoint.md5 if text.kept
                                        else refs["handover.distill"]["md5"])
    decision = MlflowClient().get_run(run.run_id).data.tags["pipeline.image_text"]
    assert decision.startswith("kept" if text.kept else "not kept")
    # the plain network predicts what the image-text network it came from predicts
    client = MlflowClient()
    text_run = next(c for c in client.search_runs(
        [client.get_run(run.run_id).info.experiment_id],
        f"tags.mlflow.parentRunId = '{run.run_id}' and tags.mlflow.runName = 'image_text'"))
    # the smoke profile trains one joint round: the last is the one converted
    trained = max(k for k in tracking.artifact_refs(text_run.info.run_id)
                  if k.startswith("checkpoint.round-"))
    config = smoke_pipeline().image_text_config()
    dataset = prepare_dataset(config.dataset, source_version(config.dataset))
    network = new_network(config, dataset, describe_images(config, dataset))
    network.load_state_dict(torch.load(ArtifactStore().path_of(tracking.artifact_refs(
        text_run.info.run_id)[trained]["path"]), weights_only=True)["model"])
    plain = trained_model(text.classifier, dataset, text.checkpoint)
    _, images, _ = next(iter(eval_batches(load_dataset(dataset), dataset, "test",
                                          torch.device("cpu"))))
    with torch.no_grad():
        assert torch.equal(plain.eval()(images).argmax(1), network.eval()(images).argmax(1))


def test_the_registered_pyfunc_runs_the_fallback_cascade(run):
    import mlflow

    from tasks.data import prepare_dataset, source_version
    from tasks.promotion import test_images

    config = smoke_pipeline()
    data = config.dataset
    images, labels = test_images(prepare_dataset(data, source_version(data)))
    model = mlflow.pyfunc.load_model(f"models:/{NAME}/{run.registration.version}")
    out = model.predict(images)
    assert list(out.columns) == ["label", "confidence", "exit"]
    assert model.metadata.get_output_schema().input_names() == list(out.columns)
    assert set(out["exit"]) <= {1, 2}
    share = float((out["exit"] == 1).mean())
    assert share == pytest.approx(run.fallback.metrics["test_student_share"], abs=0.02)
    accuracy = float((np.array(out["label"]) == np.array(labels)).mean())
    assert accuracy == pytest.approx(run.fallback.metrics["test_accuracy"], abs=0.02)
    assert run.registration.accuracy == pytest.approx(accuracy)
    # the version's cost, what a tie is decided by: the student's and the teacher's networks,
    # and the fitted predictor where validation kept it
    served = model.unwrap_python_model().implementation
    nets = (served.program, served.fallback) + (() if served.router is None else (served.router,))
    counted = {id(p): p.numel() for net in nets for p in (*net.parameters(), *net.buffers())}
    assert int(tracking.version_tags(NAME, run.registration.version)["parameters"]) == \
        sum(counted.values()) > sum(p.numel() for p in served.program.parameters())


def test_the_served_cascade_routes_by_a_fitted_predictor_where_one_is_kept(run, tmp_path):
    """The registered pyfunc built again with a predictor in its meta (as when validation keeps
    one): the teacher answers exactly the images the predictor scores at most the threshold."""
    import mlflow

    from serving.fallback import FallbackModel
    from serving.inputs import input_images
    from tasks.data import prepare_dataset, source_version
    from tasks.promotion import test_images
    from training.cascade.routing import fit_router
    from training.preprocess import images_to_batch

    config = smoke_pipeline()
    images = test_images(prepare_dataset(config.dataset, source_version(config.dataset)))[0]
    folder = Path(mlflow.artifacts.download_artifacts(
        f"models:/{NAME}/{run.registration.version}", dst_path=str(tmp_path / "model")))
    flavor = mlflow.models.Model.load(str(folder)).flavors["python_function"]
    artifacts = {name: str(folder / entry["path"])
                 for name, entry in flavor["artifacts"].items()}
    plain = FallbackModel()
    plain.load_context(SimpleNamespace(artifacts=artifacts))
    batch = plain.normalize(images_to_batch(input_images(images[:200]), plain.size,
                                            plain.channels))
    logits = plain.student(batch)
    # a predictor that wants the teacher on the images the student is least sure of
    confidence = logits.softmax(1).amax(1)
    router = fit_router(logits, confidence > confidence.median(), seed=0)
    meta = json.loads(Path(artifacts["meta"]).read_text()) | {"router": router.to_json(),
                                                         "threshold": 0.5}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    routed = FallbackModel()
    routed.load_context(SimpleNamespace(artifacts=artifacts | {"meta": str(tmp_path /
                                                                           "meta.json")}))
    out = routed.predict(None, images[:200])
    with torch.no_grad():
        expected = (router(logits) <= 0.5).long() + 1
    assert out["exit"].tolist() == expected.tolist()
    assert 0 < (expected == 2).sum() < len(expected)


def test_a_rerun_on_unchanged_data_trains_nothing_and_changed_data_retrains(run):
    from flows.pipeline import pipeline, pipeline_key

    versions = tracking.model_versions(NAME)
    state = pipeline(smoke_pipeline(), return_state=True)
    again = state.result()
    assert again.skipped and again.steps == []
    assert set(task_states(state)) == {"prepare-dataset", "raw-pixel-baselines"}
    assert tracking.model_versions(NAME) == versions
    tags = MlflowClient().get_run(again.run_id).data.tags
    assert tags["registry.decision"].startswith(f"the champion (models:/{NAME}/")
    assert "was trained by this pipeline on the same data" in tags["registry.decision"]
    assert "step_teacher_test_accuracy" not in MlflowClient().get_run(again.run_id).data.metrics
    config = smoke_pipeline()
    assert pipeline_key(config, "a" * 32) != pipeline_key(config, "b" * 32)
    assert pipeline_key(config, "a" * 32) != pipeline_key(smoke_pipeline(pbt_stages=2), "a" * 32)
    assert pipeline_key(config, "a" * 32) == pipeline_key(smoke_pipeline(
        skip_unchanged=False, progress=True), "a" * 32)


@pytest.mark.parametrize(("flags", "message"), [
    (["--sparse-layers", "nope"], "sparse_layers ['nope'] are not modules of cnn2"),
    (["--pbt-lr-range", "0.1,0.01"], "lr_range: low 0.1 must be below high 0.01"),
    (["--fallback-tolerance", "2"], "fallback_tolerance"),
    (["--class-descriptions", "/no/such/file.csv"], "no such file"),
])
def test_bad_input_is_one_error_line_before_any_work(flags, message, capsys):
    code, _, err = run_cli(capsys, "pipeline", "--profile", "smoke", *flags)
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: invalid configuration:"]
    assert message in err, err


def test_later_steps_take_the_pipelines_sections_and_none_of_distills_own_fields():
    """PBT and the sparsity fine-tuning train on the pipeline's data, optimizer, budget and run
    fields as given, with the student's network; the teacher, stage and bank fields stay with
    distillation."""
    config = smoke_pipeline(batch_size=96, seed=5, train_limit=640, student_width=8,
                            weight_decay=1e-4, dask_workers=3)
    pbt, sparse = config.pbt_config(), config.sparsify_config()
    for step in (pbt, sparse):
        assert (step.optim.batch_size, step.run.seed, step.dataset.train_limit,
                step.optim.weight_decay) == (96, 5, 640, 1e-4)
        assert (step.network.model, step.network.width) == (config.student_model, 8)
        assert step.dataset == config.dataset and step.run == config.run
    assert pbt.cluster.dask_workers == 3


def test_the_summary_says_why_the_student_stands_alone():
    """Within the tolerance, or ahead but not significantly: the run's summary says which."""
    from flows.pipeline import routing_row
    from tasks.pipeline import Fallback

    base = {"val_student_share": 1.0, "val_student_accuracy": 0.9048,
            "val_teacher_accuracy": 0.881, "val_only_cascade_right": 0.0,
            "val_only_student_right": 0.0, "val_cascade_p_better": 1.0}
    assert routing_row(Fallback(threshold=0.0, metrics=base)).startswith(
        "none: the cascade buys at most the tolerance on validation")
    ahead = base | {"val_only_cascade_right": 2.0, "val_cascade_p_better": 0.25}
    assert routing_row(Fallback(threshold=0.0, metrics=ahead)) == (
        "none: the cascade is not significantly better (right on 2 validation images the "
        "student alone misses, wrong on 0 it gets right: p = 0.25) on validation over the "
        "student alone (0.9048; the teacher alone 0.8810)")
