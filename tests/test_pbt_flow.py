"""The `pbt` flow end to end: lineage, weight copy, exploration, Dask, and failing members;
the member task through `.fn()`: exploit copies the weights the best was ranked on."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from flows.cli import main
from flows.commands import COMMANDS
from flows.pbt import pbt
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.versioning import ArtifactStore
from tasks.configs.pbt import PBTConfig
from tasks.configs.sections import classifier_config
from tasks.data import prepare_dataset, source_version
from tasks.pbt import (
    HYPERPARAMETERS,
    MemberRound,
    exploit_weights,
    member_config,
)
from tasks.rounds import round_task
from training.pbt.scheduler import population_scheduler, replay

NAME = "pbt-smoke"


def train_member(config, dataset, population, member, phase, index, first_epoch, epochs, cycle,
                 previous, average_decay=None, weights="model"):
    """The round task on one member's round."""
    return round_task.fn(MemberRound(
        config=config, dataset=dataset, population=population, member=member, phase=phase,
        index=index, first_epoch=first_epoch, epochs=epochs, cycle=cycle,
        average_decay=average_decay, weights=weights), previous)


def pbt_smoke(**overrides) -> PBTConfig:
    """Seconds long: 2 cnn2 members, 1 burn-in round, 2 stages on 512 images, 1 thread."""
    return PBTConfig(**{"profile": "smoke", "model_name": NAME, "threads": 1, **overrides})


def stage_rows(lineage):
    return [r for r in lineage if r["phase"] == "stage"]


@pytest.fixture(scope="module")
def first_pbt():
    return pbt(pbt_smoke(registry=True))


def test_lineage_records_copies_and_draws_and_the_best_is_registered(first_pbt):
    population = first_pbt.population
    rows = stage_rows(population.lineage)
    assert [(r["stage"], r["member"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    stage1, stage2 = rows[:2], rows[2:]
    assert stage1[0]["hyperparameters"] != stage1[1]["hyperparameters"]  # distinct starts
    best1 = max(stage1, key=lambda r: (r["score"], -r["member"]))
    assert all(r["parent"] == best1["member"] for r in stage2)  # everyone copied the best
    assert all(r["copied"] is None for r in stage1)
    assert all(r["copied"] == best1["kept"] for r in stage2)  # the weights it was ranked on
    kept = next(r for r in stage2 if r["member"] == best1["member"])
    assert kept["hyperparameters"] == best1["hyperparameters"]  # the best keeps its values
    other = next(r for r in stage2 if r["member"] != best1["member"])
    ratio = other["hyperparameters"]["lr"] / best1["hyperparameters"]["lr"]
    assert 0.5 <= ratio <= 2.0 or other["hyperparameters"]["lr"] in (0.005, 0.3)  # or clipped
    assert first_pbt.registration.alias == "champion"
    client = MlflowClient()
    run = client.get_run(first_pbt.run_id)
    artifacts = {a.path for a in client.list_artifacts(first_pbt.run_id, "pbt")}
    assert {"pbt/lineage.jsonl", "pbt/lineage.png", "pbt/lineage.json"} <= artifacts
    assert run.data.metrics["stages_run"] == 2
    children = client.search_runs([run.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{first_pbt.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["member-0", "member-1"]
    history = client.get_metric_history(children[0].info.run_id, "hp_lr")
    assert [m.step for m in history] == [0, 1, 2]  # burn-in, then the stages
    logged = ArtifactStore().fetch(population.lineage_log)
    assert run.data.tags["dvc.lineage"] == population.lineage_log.md5
    assert [json.loads(line) for line in logged.read_text().splitlines()] == \
        population.lineage


def test_the_best_is_its_weights_its_average_or_a_soup_and_is_exported(first_pbt):
    store = ArtifactStore()
    population = first_pbt.population
    best = population.best
    payload = load_checkpoint(store, best.checkpoint)
    kept = payload["kept"]
    assert payload["kept_source"] == best.kept
    soup = next(r for r in population.lineage if r["phase"] == "soup")
    stage_best = next(r for r in stage_rows(population.lineage)
                      if r["stage"] == soup["stage"] and r["member"] == population.best_member)
    assert soup["member"] == population.best_member  # the soup starts from the stage's best
    if soup["ingredients"] > 1:  # kept: never below the member it started from
        assert best.kept == "soup" and payload["ingredients"][0] == population.best_member
        assert len(payload["ingredients"]) == soup["ingredients"]
        assert best.metrics["val_accuracy"] == soup["score"] >= stage_best["score"] - 1e-9
    else:
        averaged, last = payload["averaged"], payload["model"]
        assert set(averaged) == set(last) == set(kept)
        assert any(not torch.equal(averaged[k], last[k]) for k in last)  # an average
        assert best.metrics["val_accuracy"] >= best.metrics["val_accuracy_last"]
        if best.kept == "model":
            assert all(torch.equal(kept[k], last[k]) for k in last)
    program = torch.export.load(str(store.path_of(best.checkpoint).with_suffix(".pt2")))
    exported = {key.removeprefix("model."): value for key, value in program.state_dict.items()}
    assert exported.keys() == kept.keys()
    assert all(torch.equal(exported[key], kept[key]) for key in kept)


def test_the_lineage_replays_through_the_scheduler(first_pbt):
    config = pbt_smoke()
    rows = stage_rows(first_pbt.population.lineage)
    members = config.members
    scores = [[r["score"] for r in rows[i:i + members]] for i in range(0, len(rows), members)]
    burn_in = {name: getattr(config.optim, name) for name in HYPERPARAMETERS}
    replayed = replay(population_scheduler(config, members, burn_in,
                                           first_pbt.population.val_images), scores)
    following = [rows[i:i + members] for i in range(members, len(rows), members)]
    assert len(following) == len(replayed) - 1  # the last stage's decision has no stage after
    for decision, next_rows in zip(replayed, following, strict=False):
        assert [r["hyperparameters"] for r in next_rows] == list(decision.hyperparameters)
        assert all(r["parent"] == decision.best for r in next_rows)


@pytest.fixture(scope="module")
def burnt_in():
    """The smoke config (ties to the highest score), its data set, its member config, and the
    weights of a member trained 2 passes (16 steps at lr 0.05): accurate well above chance."""
    config = pbt_smoke(tie_margin=0.0)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    base = classifier_config(config)
    burn_in = train_member(base, dataset, "exploit", 0, "burn-in", 1, 0, 2, (0, 2), None)
    return config, dataset, base, load_checkpoint(ArtifactStore(), burn_in.checkpoint)["model"]


BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _head_negated(state):
    """`state` with the classifier's weight and bias negated: the same features, the logits
    times -1, so the network predicts the class `state` ranks last."""
    return {key: -value if key.startswith("fc.") else value.clone()
            for key, value in state.items()}


@pytest.mark.parametrize("winner", ["averaged", "model"])
def test_every_member_starts_the_next_stage_from_the_weights_the_best_was_ranked_on(
        burnt_in, winner):
    # Stage 1 at a learning rate of 1e-6 (the weights stay where they start) from built
    # checkpoints: member 0's last weights and average both have the head negated; member 1
    # has the trained weights in `winner` and the negated head in the other. An average of 8
    # steps at decay 0.98 holds 0.98**8 = 0.85 of where it started and 0.15 of the weights, so
    # its head is +-0.70 times the trained one: it predicts as that start does. So member 1
    # wins the stage on its `winner` weights.
    config, dataset, base, trained = burnt_in
    store, negated, population = ArtifactStore(), _head_negated(trained), f"exploit-{winner}"
    other = "model" if winner == "averaged" else "averaged"
    starts = [{"model": negated, "averaged": negated}, {winner: trained, other: negated}]
    still = {"lr": 1e-6, "weight_decay": 1e-5, "momentum": 0.9, "augment": 0.0}
    stage1 = [train_member(
        member_config(base, m, still), dataset, population, m, "stage", 1, 2, 1, (2, 4),
        save_checkpoint(store, f"checkpoints/pbt/{population}/start-{m}.pt", start),
        config.average_decay) for m, start in enumerate(starts)]
    scheduler = population_scheduler(config, 2, still, dataset.sizes["val"])
    decision = scheduler.decide([r.metrics["val_accuracy"] for r in stage1])
    best = stage1[decision.best]
    assert (decision.best, best.kept) == (1, winner)  # the case is the one built
    ranked = load_checkpoint(store, best.checkpoint)

    # stage 2 as the flow runs it, with no passes: each member's checkpoint holds the weights,
    # optimizer state and average it started from
    stage2 = [train_member(
        member_config(base, m, decision.hyperparameters[m]), dataset, population, m, "stage", 2,
        3, 0, (2, 4), best.checkpoint, config.average_decay, exploit_weights(best))
        for m in range(2)]
    for m, result in enumerate(stage2):
        started = load_checkpoint(store, result.checkpoint)
        weights, optimizer = started["model"], started["optimizer"]
        assert weights.keys() == ranked["kept"].keys()
        assert all(torch.equal(weights[k], ranked["kept"][k]) for k in weights)
        assert result.metrics["val_accuracy_last"] == best.metrics["val_accuracy"]
        assert optimizer["param_groups"][0]["momentum"] == decision.hyperparameters[m][
            "momentum"]
        if winner == "averaged":  # the average (BatchNorm re-estimated), not the last weights
            assert not all(torch.equal(weights[k], ranked["model"][k]) for k in weights)
            parameters = [k for k in weights if not k.endswith(BATCHNORM_STATISTICS)]
            assert all(torch.equal(weights[k], ranked["averaged"][k]) for k in parameters)
            assert optimizer["state"] == {}  # no momentum gathered on the last weights' path
            assert all(torch.equal(started["averaged"][k], weights[k]) for k in weights)
        else:  # the last weights, with their momentum buffers and their average
            kept_buffers = ranked["optimizer"]["state"]
            assert optimizer["state"].keys() == kept_buffers.keys() and kept_buffers
            assert all(torch.equal(optimizer["state"][i]["momentum_buffer"],
                                   kept_buffers[i]["momentum_buffer"]) for i in kept_buffers)
            assert all(torch.equal(started["averaged"][k], ranked["averaged"][k])
                       for k in ranked["averaged"])


def _copy_images(source, target, picks):
    """An ImageFolder under `target` with the images of `source` that `picks(n)` selects."""
    for folder in sorted(p for p in source.iterdir() if p.is_dir()):
        for n, image in enumerate(sorted(folder.iterdir())):
            if picks(n):
                (target / folder.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(image, target / folder.name / image.name)
    return target


def test_features_embed_to_parquet_and_recognize_by_nearest_neighbours(
        first_pbt, fashion_folder, tmp_path, capsys):
    gallery_images = _copy_images(fashion_folder, tmp_path / "gallery", lambda n: n % 2 == 0)
    queries = _copy_images(fashion_folder, tmp_path / "queries", lambda n: n % 2 == 1)
    gallery = tmp_path / "gallery.parquet"
    main(COMMANDS, ["features", "--model-name", NAME, "--images", str(gallery_images),
                    "--out", str(gallery)])
    table = pd.read_parquet(gallery)
    assert list(table.columns) == ["path", "label", "predicted_label", "confidence",
                                   "embedding"]
    assert len(table) == 60 and set(table.label) == {p.name for p in gallery_images.iterdir()}
    assert len(table.embedding.iloc[0]) == 32  # cnn2's pooled width at the smoke profile
    out = tmp_path / "queries.parquet"
    main(COMMANDS, ["features", "--model-name", NAME, "--images", str(queries), "--out",
                    str(out), "--gallery", str(gallery), "--k", "3"])
    printed = capsys.readouterr().out
    recognized = pd.read_parquet(out)
    accuracy = float((recognized.label == recognized.recognized_label).mean())
    assert f"recognition accuracy (3-NN against {gallery}): {accuracy:.4f}" in printed
    assert accuracy >= 0.6  # three easy classes (T-shirt, Trouser, Sneaker); chance is 1/3
    # the flow's k-NN test accuracy, recomputed from the same splits by the command
    main(COMMANDS, ["features", "--model-name", NAME, "--evaluate", "--train-limit", "512",
                    "--test-limit", "256"])
    printed = capsys.readouterr().out
    assert f"5-NN recognition accuracy {first_pbt.knn_accuracy:.4f} against 512 training " \
        "embeddings (256 test images" in printed
    run = MlflowClient().get_run(first_pbt.run_id)
    assert run.data.metrics["test_knn_accuracy"] == first_pbt.knn_accuracy
    table.drop(columns="label").to_parquet(tmp_path / "unlabelled.parquet")
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["features", "--model-name", NAME, "--images", str(queries),
                        "--out", str(out), "--gallery", str(tmp_path / "unlabelled.parquet")])
    assert exit_info.value.code == 2 and "lacks the column(s) ['label']" in \
        capsys.readouterr().err


def test_same_seed_gives_the_same_lineage_on_a_dask_cluster(first_pbt, monkeypatch):
    monkeypatch.setenv("PREFECT_TASKS_REFRESH_CACHE", "true")
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        on_dask = pbt(pbt_smoke(runner="dask", dask_workers=2))
    ours, theirs = on_dask.population.lineage, first_pbt.population.lineage
    assert [(r["phase"], r["stage"], r["member"], r["parent"], r["copied"],
             r["hyperparameters"]) for r in ours] == [
        (r["phase"], r["stage"], r["member"], r["parent"], r["copied"],
         r["hyperparameters"]) for r in theirs]
    assert [r["score"] for r in ours] == pytest.approx([r["score"] for r in theirs], abs=0.02)


def test_a_member_that_keeps_failing_is_recorded_and_the_stage_goes_on():
    # learning rates up to 1e12 without clipping: the members drawn in the top of the range
    # blow up, and the loop's check stops them with NonFiniteLossError (retried once, then
    # recorded); the lowest quarter of the range (below 6) trains
    summary = pbt(pbt_smoke(members=4, stages=1, lr_range=(1e-3, 1e12), grad_clip=None,
                            model_name="pbt-failing"))
    rows = stage_rows(summary.population.lineage)
    failed = [r for r in rows if r["score"] is None]
    assert failed and all("NonFiniteLossError" in r["error"] for r in failed)
    assert len(failed) < 4 and summary.population.best_member not in {r["member"]
                                                                      for r in failed}


def test_a_population_that_fails_whole_ends_in_one_error_line(capsys, monkeypatch):
    # fault injection: every step's loss is NaN, so the real loop stops every member (retried
    # once) in the burn-in, and there is nothing to go on from
    def nan_step(label_smoothing=0.0):
        def step(model, _ids, x, y):
            loss = model(x).sum() * float("nan")
            return {"loss": loss, "loss_ce": loss}
        return step

    monkeypatch.setattr("training.rounds.classification_step", nan_step)
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["pbt", "--profile", "smoke", "--members", "2", "--stages", "1",
                        "--threads", "1", "--model-name", "pbt-all-failing"])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: every member failed in burn-in 1")
    assert "NonFiniteLossError" in error
