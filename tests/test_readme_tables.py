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
