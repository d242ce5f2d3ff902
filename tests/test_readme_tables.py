"""Every generated README table equals what its committed raw record gives (`bench.tables`),
and every benchmark record names the commit and the command that made it."""

from __future__ import annotations

import json

import pytest

from bench.tables import README, RESULTS, readme_tables, render


def test_readme_tables_match_their_raw_records():
    tables = readme_tables(README.read_text())
    assert tables, "README.md has no generated table"
    for name, body in tables.items():
        assert body == render(name), f"README's {name} table differs from bench/results"


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
