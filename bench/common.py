"""Shared by the benchmarks: statistics and the two outputs (a table, then one JSON line)."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tasks  # noqa: E402,F401  (project environment before Prefect and MLflow load)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`name=value` pairs for the config (the command line's spelling of values)."""
    overrides = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not value:
            raise SystemExit(f"error: --set {pair!r}: expected name=value")
        overrides[name.replace("-", "_")] = value
    return overrides


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table for people."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def print_json(figures: dict) -> None:
    """The machine-readable figures: always the last line of a benchmark's output."""
    print(json.dumps(figures, sort_keys=True))
