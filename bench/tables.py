"""README tables generated from the benchmarks' raw records (`bench/results/<name>.jsonl`).

A table in README.md between `<!-- table: NAME -->` and `<!-- /table -->` is exactly what
`python -m bench.tables NAME` prints for the newest record of benchmark NAME (its last line);
`tests/test_readme_tables.py` checks every such table against the committed records, so a
README figure cannot drift from the raw output and the command that made it.

    python -m bench.tables image_text          # print the table
    python -m bench.tables image_text --write  # and replace it in README.md
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from bench.common import ROOT, mean_std

RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /table -->", re.S)


def newest(name: str, results: Path = RESULTS) -> dict:
    """The last record of benchmark `name` (the newest run)."""
    path = results / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no raw results for {name!r}: run `python -m bench.{name}` "
                                f"(it appends to {path.relative_to(ROOT)})")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])


def spread(mean: float, std: float) -> str:
    """`mean ± std` at four decimals."""
    return f"{mean:.4f} ± {std:.4f}"


def image_text(record: dict) -> str:
    """The few-label rows of `bench.image_text`: test accuracy and zero-shot accuracy per
    variant (mean ± std over the seeds), the head-mixing alphas chosen on validation, and the
    paired gains; the protocol and the command below the table."""
    few = [r for r in record["results"] if r["labels"] != "all"]
    lines = ["| variant, 10 labels per class | test accuracy | zero-shot (class descriptions) |",
             "| --- | --- | --- |"]
    for row in few:
        mean, std = mean_std(row["zero_shot"])
        alphas = [a for a in row.get("head_mixing_alpha") or [] if a is not None]
        name = row["variant"] + (f" (alpha {', '.join(f'{a:g}' for a in alphas)})"
                                 if alphas else "")
        shown = "-" if row["variant"].startswith("(a)") else spread(mean, std)
        lines.append(f"| {name} | {spread(row['mean'], row['std'])} | {shown} |")
    gains = "; ".join(f"{name}: {g['mean']:+.4f} ± {g['std']:.4f}"
                      for name, g in record.get("gains", {}).items())
    return "\n".join(lines) + (
        f"\n\nSeeds {', '.join(map(str, record['seeds']))}, paired gains: {gains}. "
        f"Protocol: {record['protocol']}. Command: `{record['command']}` "
        f"(commit {record['commit'][:7]}).\n")


CASCADE_ROWS = {"(a) full network": None, "(b) early exits alone": "most_expensive",
                "(c1) exits, fixed sub-networks": "fixed",
                "(c2) exits, fitted predictors": "fitted",
                "(c) registered model (per seed: c1, c2 or b)": "registered"}
CASCADE_SHORT = {"fixed": "c1", "fitted": "c2", "most_expensive": "b"}


def cascade(record: dict) -> str:
    """`bench.cascade`'s rows: test accuracy, speed-up over (a) at batch 1, cost over the
    oracle's (latency table; FLOPs), exit shares, and the seeds whose calibration registered
    the row (mean ± std over the seeds); the oracle's accuracy below."""
    lines = ["| variant | test accuracy | speed-up at batch 1 | cost / oracle's (table) | "
             "cost / oracle's (FLOPs) | exit shares | registered on seeds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    registered = record["registered"]
    for name, routing in CASCADE_ROWS.items():
        figure = record.get(name)
        if figure is None:
            continue
        if routing == "registered":
            cell = ", ".join(f"{seed}: {CASCADE_SHORT.get(chosen, '-')}"
                             for seed, chosen in registered.items())
        elif routing is not None:
            cell = ", ".join(seed for seed, chosen in registered.items()
                             if chosen == routing) or "none"
        else:
            cell = ""
        shares = " / ".join(f"{mean:.2f}" for mean, _ in figure["exit_shares"].values())
        lines.append(f"| {name} | {spread(*figure['accuracy'])} | "
                     f"{figure['speedup_b1'][0]:.2f} ± {figure['speedup_b1'][1]:.2f}x | "
                     f"{figure['cost_over_oracle'][0]:.2f} ± {figure['cost_over_oracle'][1]:.2f}"
                     f" | {figure['flops_over_oracle'][0]:.2f} ± "
                     f"{figure['flops_over_oracle'][1]:.2f} | {shares} | {cell} |")
    oracle = [run["metrics"]["oracle_accuracy"] for run in record["runs"]]
    return "\n".join(lines) + (
        f"\n\n(d) the oracle (each image at the cheapest exit and sub-networks that get it "
        f"right; not runnable): {sum(oracle) / len(oracle):.4f}. Seeds "
        f"{', '.join(registered)}; command: `{record['command']}` "
        f"(commit {record['commit'][:7]}).\n")


RENDERERS: dict[str, Callable[[dict], str]] = {"image_text": image_text, "cascade": cascade}


def render(name: str, results: Path = RESULTS) -> str:
    """The README table of benchmark `name` from its newest record."""
    if name not in RENDERERS:
        raise KeyError(f"no README table for {name!r}; known: {', '.join(RENDERERS)}")
    return RENDERERS[name](newest(name, results))


def readme_tables(text: str) -> dict[str, str]:
    """Each generated table in a README's text, by benchmark name."""
    return {match["name"]: match["body"] for match in BLOCK.finditer(text)}


def write(name: str, readme: Path = README) -> None:
    """Replaces benchmark `name`'s table in the README with the one its newest record gives."""
    text = readme.read_text()
    if name not in readme_tables(text):
        raise KeyError(f"README.md has no `<!-- table: {name} -->` block")
    table = render(name)
    readme.write_text(BLOCK.sub(lambda m: m.group(0) if m["name"] != name else
                                f"<!-- table: {name} -->\n{table}<!-- /table -->", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(RENDERERS))
    parser.add_argument("--write", action="store_true", help="replace it in README.md")
    args = parser.parse_args()
    print(render(args.name), end="")
    if args.write:
        write(args.name)


if __name__ == "__main__":
    main()
