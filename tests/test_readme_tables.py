"""Every generated table (the README's summary, docs/benchmarks.md's tables) equals what its
committed raw records give (`bench.tables`), every benchmark record names the commit and the
command that made it, and the README stays a five-minute read."""

from __future__ import annotations

import json

import pytest

from bench.tables import BENCHMARKS, DOCUMENTS, README, RESULTS, readme_tables, render
from tasks.configs.distill import AUTO_CANDIDATES


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_generated_tables_match_their_raw_records(document):
    tables = readme_tables(document.read_text())
    assert tables, f"{document.name} has no generated table"
    for name, body in tables.items():
        assert body == render(name), f"{document.name}'s {name} table differs from bench/results"


def test_the_readme_is_short_and_every_benchmark_table_is_in_docs():
    """At most 200 lines, one generated table (the summary); every benchmark with a renderer
    that has a record shows its table in docs/benchmarks.md, and every link of the summary
    lands on a heading there."""
    import re

    from bench.tables import RENDERERS

    readme = README.read_text()
    assert len(readme.splitlines()) <= 200
    assert list(readme_tables(readme)) == ["summary"]
    shown = readme_tables(BENCHMARKS.read_text())
    recorded = {name for name in RENDERERS if (RESULTS / f"{name}.jsonl").exists()}
    # (distill_bank: a removed benchmark; its record stays as docs/distill.md's history)
    assert recorded - {"summary", "distill_bank"} <= set(shown)
    headings = {re.sub(r"[^a-z0-9 _-]", "", line.lstrip("# ").lower()).replace(" ", "-")
                for line in BENCHMARKS.read_text().splitlines() if line.startswith("#")}
    for anchor in re.findall(r"docs/benchmarks\.md#([\w-]+)", readme):
        assert anchor in headings, anchor


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.jsonl")), ids=lambda p: p.name)
def test_raw_records_carry_their_provenance(path):
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert len(record["commit"]) == 40 and record["command"].startswith("python -m bench.")
        assert record["benchmark"] == path.stem and "finished" in record


def test_the_sparsify_table_takes_each_tasks_newest_run(tmp_path):
    """Classification re-run alone: its rows come from the new run, detection's still from the
    run that measured it, and both runs are named under the table."""
    from bench.tables import newest_per_task

    def row(task: str, variant: str, score: float) -> dict:
        key = {"classification": "test_accuracy", "detection": "test_map_50"}[task]
        return {"task": task, "variant": variant, key: [score, 0.0], "runs": []}

    first = {"command": "python -m bench.sparsify", "results": [
        row("classification", "none", 0.1), row("detection", "none", 0.2)]}
    second = {"command": "python -m bench.sparsify --tasks classification", "results": [
        row("classification", "none", 0.3)]}
    (tmp_path / "sparsify.jsonl").write_text(f"{json.dumps(first)}\n{json.dumps(second)}\n")
    picked = newest_per_task("sparsify", tmp_path)
    assert [(r["task"], r.get("test_accuracy", r.get("test_map_50"))[0])
            for r in picked["results"]] == [("classification", 0.3), ("detection", 0.2)]
    assert [s["command"] for s in picked["sources"]] == [second["command"], first["command"]]


def test_tables_of_the_defaults_leave_runs_with_overrides_out(tmp_path):
    """A run with `--set` fields tries a variant of a flow: the defaults' tables (small data
    sets, the pipeline, the README's summary) keep the newest run of the defaults, and name
    only the records they took rows from."""
    from bench.tables import newest_of_defaults, newest_per_flow

    runs = [{"commit": "a", "overrides": {}}, {"commit": "b", "overrides": {"x": "1"}}]
    (tmp_path / "pipeline.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in runs))
    assert newest_of_defaults("pipeline", tmp_path)["commit"] == "a"

    def record(commit: str, score: float, overrides: dict) -> dict:
        return {"command": f"python -m bench.small_data {commit}", "commit": commit,
                "overrides": overrides, "results": [
                    {"set": "2500x16", "flow": "pipeline", "holdout_accuracy_mean": score},
                    {"set": "2500x16", "holdout_baselines": []}]}

    lines = [record("a", 0.1, {}), record("b", 0.2, {"targets": "final"})]
    (tmp_path / "small_data.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in lines))
    picked = newest_per_flow("small_data", tmp_path)
    assert [r.get("holdout_accuracy_mean") for r in picked["results"]] == [0.1, None]
    assert [s["commit"] for s in picked["sources"]] == ["a"]


def test_the_descriptions_table_merges_variants_run_apart_and_pairs_them_with_one(tmp_path):
    """`agreement` run after `several` and `one`: each set shows all three, and the paired
    difference to `one` is taken seed by seed across the two records."""
    from bench.tables import newest_per_variant

    def variant(*unread: float) -> dict:
        return {"runs": [{"unread_accuracy": u} for u in unread]}

    first = {"command": "python -m bench.descriptions --variants several one", "results": [
        {"set": "2500x16", "variants": {"several": variant(0.8, 0.7), "one": variant(0.7, 0.7)}}]}
    second = {"command": "python -m bench.descriptions --variants agreement", "results": [
        {"set": "2500x16", "variants": {"agreement": variant(0.9, 0.6)}}]}
    (tmp_path / "descriptions.jsonl").write_text(
        f"{json.dumps(first)}\n{json.dumps(second)}\n")
    picked = newest_per_variant("descriptions", tmp_path)
    variants = picked["results"][0]["variants"]
    assert list(variants) == ["several", "one", "agreement"]
    assert variants["several"]["minus_one_unread"] == pytest.approx((0.05, 0.0707107), rel=1e-4)
    assert variants["agreement"]["minus_one_unread"][0] == pytest.approx(0.05)
    assert variants["one"]["minus_one_unread"] is None
    assert [s["command"] for s in picked["sources"]] == [first["command"], second["command"]]


def test_the_distillation_table_merges_seeds_run_apart_and_pairs_them_by_seed(tmp_path):
    """2500x16 run one seed a record (the set takes about an hour a seed on 2 cores): the
    rows hold every seed, the newest record's where two ran the same seed, the paired
    differences pair by seed, and a row short of three seeds says which it holds."""
    from bench.tables import distill_rows, merged_variants_per_set

    def record(seed: int, alone: float, kd: float, teacher: float = 0.9) -> dict:
        runs = [{"seed": seed, "accuracy": {
            name: {"val": value, "test": value, "unread": value}
            for name, value in (("teacher", teacher), ("alone", alone), ("kd", kd))}}]
        return {"command": f"python -m bench.distill_targets --seeds {seed}",
                "results": [{"set": "2500x16", "runs": runs}]}

    records = [record(0, 0.80, 0.81), record(1, 0.70, 0.74), record(1, 0.72, 0.75),
               record(2, 0.90, 0.92)]
    (tmp_path / "distill_targets.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    picked = merged_variants_per_set("distill_targets", tmp_path)
    [entry] = picked["results"]
    kd = entry["variants"]["kd"]
    assert kd["seeds"] == [0, 1, 2]
    assert kd["unread"][0] == pytest.approx((0.81 + 0.75 + 0.92) / 3)  # seed 1: the newest
    assert kd["minus_alone_unread"][0] == pytest.approx((0.01 + 0.03 + 0.02) / 3)
    assert [s["command"] for s in picked["sources"]] == [records[3]["command"],
                                                        records[2]["command"],
                                                        records[0]["command"]]
    (tmp_path / "distill_targets.jsonl").write_text(json.dumps(records[0]) + "\n")
    one = merged_variants_per_set("distill_targets", tmp_path)["results"]
    assert "| kd (seed 0 only) |" in "\n".join(distill_rows(one, ["alone", "kd"], ()))
    # a row run on other seeds than `alone`'s others: its gap closed on the seeds they share
    fresh = record(3, 0.60, 0.70, teacher=0.80) | {"auto_candidates": list(AUTO_CANDIDATES)}
    fresh["results"][0]["runs"][0]["accuracy"]["auto"] = {"val": 0.7, "test": 0.7,
                                                          "unread": 0.70}
    # the default of an earlier record chose among three candidates: its own row, not merged
    earlier = record(2, 0.90, 0.92)
    earlier["results"][0]["runs"][0]["accuracy"]["auto"] = {"val": 0.9, "test": 0.9,
                                                            "unread": 0.92}
    (tmp_path / "distill_targets.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [*records, earlier, fresh]))
    [entry] = merged_variants_per_set("distill_targets", tmp_path)["results"]
    assert entry["variants"]["auto"]["gap_closed_unread"] == pytest.approx(0.5)
    assert entry["variants"]["auto"]["seeds"] == [3]
    assert entry["variants"]["auto of 3"]["seeds"] == [2]
    assert entry["variants"]["alone"]["seeds"] == [0, 1, 2, 3]
    rows = "\n".join(distill_rows([entry], ["alone", "kd", "auto"], ()))
    assert "| alone (seeds 0, 1, 2, 3) |" in rows and "| auto (seed 3 only) |" in rows


def test_the_pbt_peer_table_merges_seeds_run_apart_and_leaves_smoke_runs_out(tmp_path):
    """`bench.pbt_peer` records one line a seed (35 minutes each): the table holds every seed
    of each tool, the newest where a seed ran twice, and no smoke run."""
    from bench.tables import merged_pbt_peer, pbt_peer

    def record(seed: int, ray: float, mine: float, smoke: bool = False, commit: str = "a" * 40
               ) -> dict:
        def tool(test: float) -> dict:
            return {"runs": [{"seed": seed, "test_accuracy": test, "seconds": 100.0 + seed}]}
        return {"command": f"python -m bench.pbt_peer --seeds {seed}", "commit": commit,
                "smoke": smoke, "work": {"members": 4, "epochs": 8, "model": "lenet",
                                         "width": 64, "train_limit": 20000, "val_limit": 10000,
                                         "batch_size": 128},
                "tools": {"ray": tool(ray), "project": tool(mine)}}

    records = [record(0, 0.80, 0.81), record(1, 0.70, 0.74), record(1, 0.72, 0.76, True),
               record(1, 0.71, 0.75, commit="b" * 40)]
    (tmp_path / "pbt_peer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    picked = merged_pbt_peer("pbt_peer", tmp_path)
    assert [run["seed"] for run in picked["tools"]["project"]["runs"]] == [0, 1]
    assert picked["tools"]["project"]["test_mean"] == pytest.approx((0.81 + 0.75) / 2)
    assert picked["tools"]["ray"]["seconds_mean"] == pytest.approx(100.5)
    table = pbt_peer(picked)
    assert "| 0.8000 / 0.7100 |" in table and "(commit bbbbbbb)" in table
    assert "0.76" not in table  # the smoke run
    # a control recorded on its own (`--tools project-no-explore`) pairs with the seeds it ran
    control = {"command": "python -m bench.pbt_peer --tools project-no-explore --seeds 0 1",
               "commit": "c" * 40, "smoke": False, "work": records[0]["work"],
               "tools": {"project-no-explore": {"runs": [
                   {"seed": 0, "test_accuracy": 0.80, "seconds": 90.0},
                   {"seed": 1, "test_accuracy": 0.76, "seconds": 91.0}]}}}
    with open(tmp_path / "pbt_peer.jsonl", "a") as handle:
        handle.write(json.dumps(control) + "\n")
    table = pbt_peer(merged_pbt_peer("pbt_peer", tmp_path))
    assert "| 0.8000 / 0.7600 |" in table and "(commit ccccccc)" in table
    # 0.81 - 0.80 and 0.75 - 0.76, and each tool's time against Ray's on the same seed
    assert "minus `pbt --no-explore`, paired by seed (test images): +0.0000 ± 0.0141 over 2 " \
           "seed(s), ahead on 1" in table
    assert "| 0.90x ± 0.00 |" in table


def test_small_data_runs_on_other_seeds_make_their_own_rows(tmp_path):
    """A run of `train` and `pipeline` on seeds 3-5 never fills the seeds 0-2 line of a set
    (its splits and models differ): it gets its own line, and the summary pairs the newest
    pipeline with the `train` of its own seeds."""
    from bench.tables import newest_per_flow, small_data

    def row(flow: str, scores: list[float]) -> dict:
        return {"set": "2500x16", "flow": flow, "holdout_accuracy": scores,
                "holdout_accuracy_mean": scores[0],
                "holdout_accuracy_std": 0.0, "test_accuracy_mean": 0.5}

    def record(seeds: list[int], finished: str, *rows: dict) -> dict:
        return {"command": "python -m bench.small_data", "commit": finished, "seeds": seeds,
                "finished": finished, "holdout": "unread", "tuning_sets": ["500x28"],
                "overrides": {}, "results": [*rows, {"set": "2500x16", "holdout_baselines": [
                    {"knn": 0.1, "linear": 0.2}]}]}

    lines = [record([0, 1, 2], "a", row("train", [0.8] * 3), row("distill", [0.7] * 3)),
             record([3, 4, 5], "b", row("train", [0.6] * 3), row("pipeline", [0.9] * 3))]
    (tmp_path / "small_data.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in lines))
    picked = newest_per_flow("small_data", tmp_path)
    by_line = {(r["seeds"][0], r["flow"]): r["holdout_accuracy_mean"]
               for r in picked["results"] if "flow" in r}
    assert by_line == {(0, "train"): 0.8, (0, "distill"): 0.7, (3, "train"): 0.6,
                       (3, "pipeline"): 0.9}
    table = small_data(picked)
    assert "| 2500 x 16 px | 0.8000" in table and "| 2500 x 16 px, seeds 3, 4, 5 | 0.6000" in table


def test_small_data_client_times_are_ratios_seed_by_seed_and_absent_before_they_were_timed():
    """The pipeline's served time over `train`'s is the mean of each seed's ratio (a slow seed
    of both models cancels out), and rows recorded before `bench.small_data` timed the models
    say nothing of time."""
    from bench.tables import served_against

    train = {"client_ms_b1": [4.0, 1.0], "client_ms_b64": [0.4, 0.1],
             "parameters": [177478, 177478]}
    pipeline = {"client_ms_b1": [2.0, 0.25], "client_ms_b64": [0.2, 0.1],
                "parameters": [20490, 20490 + 177478]}
    # b1: (0.5 + 0.25) / 2 (the ratio of the means would be 0.45); b64: (0.5 + 1.0) / 2
    assert served_against(pipeline, train) == (
        "; served 0.38x of `train`'s time per image at batch 1, 0.75x at batch 64, 62% of its "
        "parameters")
    assert served_against({"holdout_accuracy": [0.8]}, train) == ""


def test_the_pipeline_table_counts_the_teacher_only_where_it_was_registered():
    from bench.tables import registered_parameters

    def run(alone: bool | None) -> dict:
        pipeline = {"student_parameters": 20490, "teacher_parameters": 176258}
        return {"pipeline": pipeline | ({} if alone is None else {"student_alone": alone})}

    assert registered_parameters([run(True)] * 3) == "20,490"
    assert registered_parameters([run(True), run(False), run(True)]) == (
        "20,490 + 176,258 (the teacher on 1 of 3 seeds)")
    assert registered_parameters([run(None)]) == "20,490 + 176,258"  # older records
