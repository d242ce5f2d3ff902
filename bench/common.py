"""Shared by the benchmarks: statistics and the two outputs (a table, then one JSON line).

The JSON line is also appended to `bench/results/<benchmark>.jsonl` with the commit, the
command that made it (as typed: `python -m bench.NAME ARGS`), the time and the tracked files
that differed from that commit (`uncommitted`), so that every README table can be traced to,
and regenerated from, a raw record that anyone can rerun (`COMPACTML_BENCH_RESULTS` moves the
folder; `none` records nothing).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
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


def parse_networks(specs: Sequence[str]) -> list[tuple[str, int | None]]:
    """`--networks` values `MODEL[:WIDTH]` as (name, width or None); exits naming a spec whose
    model is not registered."""
    from models import list_models

    networks = []
    for spec in specs:
        name, _, width = spec.partition(":")
        if name not in list_models():
            raise SystemExit(f"error: --networks {spec!r}: unknown model; registered: "
                             f"{', '.join(list_models())}")
        networks.append((name, int(width) if width else None))
    return networks


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table for people."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


ROOT = Path(__file__).resolve().parents[1]
# `bench.serving --export-checks`: the suffix of a model's name timed with torch.export's
# per-call input checks on (the README summary leaves those rows out)
EXPORT_CHECKS = " (export's input checks)"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """The command that ran this benchmark, as a user would type it from the project root."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    program = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return " ".join([program, *(shlex.quote(arg) for arg in sys.argv[1:])])


def results_folder() -> Path | None:
    """Where raw results go (`bench/results/`), or None when `COMPACTML_BENCH_RESULTS=none`."""
    where = os.environ.get("COMPACTML_BENCH_RESULTS", str(ROOT / "bench" / "results"))
    return None if where == "none" else Path(where)


def record(figures: dict) -> Path | None:
    """Appends `figures` with its provenance (commit, uncommitted files, command, time) as one
    JSON line to `<results folder>/<figures["benchmark"]>.jsonl`; returns that file."""
    folder = results_folder()
    if folder is None or "benchmark" not in figures:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    changed = _git("status", "--porcelain", "--untracked-files=no")  # "XY path" lines
    line = {"commit": _git("rev-parse", "HEAD").strip(),
            "uncommitted": sorted(entry[3:] for entry in changed.splitlines() if entry),
            "command": command_line(),
            "finished": datetime.now(UTC).isoformat(timespec="seconds")} | figures
    target = folder / f"{figures['benchmark']}.jsonl"
    with open(target, "a") as handle:  # one line per write: appends never interleave
        handle.write(json.dumps(line, sort_keys=True) + "\n")
    return target


def print_json(figures: dict) -> None:
    """The machine-readable figures: always the last line of a benchmark's output; recorded
    in `bench/results/` with the command that made them (`record`)."""
    record(figures)
    print(json.dumps(figures, sort_keys=True))
