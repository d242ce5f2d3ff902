"""Result tables generated from the benchmarks' raw records (`bench/results/<name>.jsonl`).

A table in README.md (the summary) or docs/benchmarks.md (every benchmark) between
`<!-- table: NAME -->` and `<!-- /table -->` is exactly what `python -m bench.tables NAME`
prints for the newest record of benchmark NAME (its last line; `PICKERS`: merged from the
records it names); `tests/test_readme_tables.py` checks every such table against the committed
records, so a figure cannot drift from the raw output and the command that made it.

    python -m bench.tables image_text          # print the table
    python -m bench.tables image_text --write  # and replace it where its block is
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from bench.common import EXPORT_CHECKS, ROOT, mean_std
from tasks.configs.distill import AUTO_CANDIDATES

RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCUMENTS = (README, BENCHMARKS)  # where generated tables live
BLOCK = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /table -->", re.S)


def records(name: str, results: Path = RESULTS) -> list[dict]:
    """Every record of benchmark `name`, oldest first."""
    path = results / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no raw results for {name!r}: run `python -m bench.{name}` "
                                f"(it appends to {path.relative_to(ROOT)})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def newest(name: str, results: Path = RESULTS) -> dict:
    """The last record of benchmark `name` (the newest run)."""
    return records(name, results)[-1]


def records_of_defaults(name: str, results: Path = RESULTS) -> list[dict]:
    """`records` of the runs made with the flow's defaults, oldest first: a run with `--set`
    overrides tries a variant (its figures are in the docs that discuss it)."""
    return [record for record in records(name, results) if not record.get("overrides")]


def newest_of_defaults(name: str, results: Path = RESULTS) -> dict:
    """The last record of benchmark `name` run with the flow's defaults."""
    return records_of_defaults(name, results)[-1]


def differences(new: list[float], old: list[float]) -> list[float]:
    """Seed by seed, `new` minus `old` (runs of the same seeds, in the same order)."""
    return [n - o for n, o in zip(new, old, strict=True)]


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


def newest_per_set(name: str, results: Path = RESULTS) -> dict:
    """The newest record of each data set (`data_set`; a record without one: Fashion-MNIST),
    in `bench.two_sets.SETS` order: `{"sets": {set: record}}`."""
    newest_first = records(name, results)[::-1]
    picked = {}
    for data_set in ("fashion-mnist", "2500x16"):
        found = next((r for r in newest_first
                      if r.get("data_set", "fashion-mnist") == data_set), None)
        if found is not None:
            picked[data_set] = found
    return {"sets": picked}


def cascade(picked: dict) -> str:
    """`bench.cascade`'s newest record of each data set (`newest_per_set`), one table each."""
    return "\n".join(f"**{data_set}**\n\n{cascade_set(record)}"
                     for data_set, record in picked["sets"].items())


def cascade_set(record: dict) -> str:
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


def provenance(record: dict) -> str:
    """`Seeds ...; command: `...` (commit ...)`."""
    return (f"Seeds {', '.join(map(str, record['seeds']))}; command: `{record['command']}` "
            f"(commit {record['commit'][:7]}).")


PIPELINE_STEPS = {"teacher": "teacher", "distill": "distilled student", "pbt": "after PBT",
                  "sparsify": "sparse", "cascade": "the registered model"}


def registered_parameters(runs: list[dict]) -> str:
    """The pipeline's registered parameters: the student's, plus the teacher's where it was
    registered with it (on how many seeds, where the record says)."""
    student, teacher = (f"{runs[0]['pipeline'][key]:,}" for key in ("student_parameters",
                                                                     "teacher_parameters"))
    if "student_alone" not in runs[0]["pipeline"]:
        return f"{student} + {teacher}"
    cascades = sum(not run["pipeline"]["student_alone"] for run in runs)
    return student if not cascades else (
        f"{student} + {teacher} (the teacher on {cascades} of {len(runs)} seeds)")


def pipeline(record: dict) -> str:
    """`bench.pipeline`'s two rows (accuracy on the unread report images and on the official
    test images, served ms per image at batch 1, parameters, exact zeros) and each step's
    accuracy on the report images with its change over the step before."""
    runs = record["runs"]

    def pair(model: str, key: str) -> tuple[float, float]:
        return mean_std([run[model][key] for run in runs])

    train_ms, pipe_ms = pair("train", "ms")[0], pair("pipeline", "ms")[0]
    ratios = mean_std([run["pipeline"]["ms"] / run["train"]["ms"] for run in runs])
    batch64 = "ms_b64" in runs[0]["train"]

    def b64(model: str) -> str:
        if not batch64:
            return ""
        ratio = "" if model == "train" else " ({:.2f} ± {:.2f} of `train`'s)".format(*mean_std(
            [run[model]["ms_b64"] / run["train"]["ms_b64"] for run in runs]))
        return f" {pair(model, 'ms_b64')[0]:.3f}{ratio} |"

    lines = ["| model | report accuracy (unread) | test accuracy (official) | ms / image, "
             "batch 1 (served) |" + (" batch 64 |" if batch64 else "") + " parameters | "
             "exact zeros |", "| --- " * (7 if batch64 else 6) + "|",
             f"| `train` (`resnet18`, its defaults) | {spread(*pair('train', 'report_accuracy'))} "
             f"| {spread(*pair('train', 'accuracy'))} | {train_ms:.2f} |{b64('train')} "
             f"{runs[0]['train']['parameters']:,} | {pair('train', 'zeros')[0]:.2f} |",
             f"| `pipeline` | {spread(*pair('pipeline', 'report_accuracy'))} | "
             f"{spread(*pair('pipeline', 'accuracy'))} | {pipe_ms:.2f} ({ratios[0]:.2f} ± "
             f"{ratios[1]:.2f} of `train`'s) |{b64('pipeline')} "
             f"{registered_parameters(runs)} | "
             f"{pair('pipeline', 'zeros')[0]:.2f} (student) |"]
    steps, previous = [], None
    for name, label in PIPELINE_STEPS.items():
        values = [run["report_steps"][name] if name in run["report_steps"]
                  else run["pipeline"]["report_accuracy"] for run in runs]
        mean = mean_std(values)[0]
        change = "" if previous is None or name == "distill" else f" ({mean - previous:+.4f})"
        ms = ("" if "step_ms" not in runs[0] else
              f", {mean_std([run['step_ms'][name] for run in runs])[0]:.2f} ms")
        steps.append(f"{label} {mean:.4f}{change}{ms}")
        previous = mean
    share = mean_std([run["pipeline"]["student_share"] for run in runs])[0]
    minutes = min(run["seconds"] for run in runs) / 60  # the others may have shared the cores
    routing = ""
    if "routing" in runs[0]:
        kept = sum(run["routing"].get("predictors_kept", 0) for run in runs)
        alone = sum(run["routing"].get("student_alone_stands", 0) for run in runs)
        routing = (f" The cascade's fitted predictor was kept on {kept:.0f} of {len(runs)} "
                   "seeds (chosen on validation)." if not alone else
                   f" The student alone was within the tolerance of the teacher alone on "
                   f"validation, and registered without it, on {alone:.0f} of {len(runs)} "
                   f"seeds; the fitted predictor was kept on {kept:.0f}.")
    return "\n".join(lines) + (
        f"\n\nEach step's model on the report images (and its time per image at batch 1, in "
        f"the process, all timed side by side): {'; '.join(steps)}; the student "
        f"answers {share:.0%} of the test images; the fastest run took {minutes:.1f} minutes."
        f"{routing} {provenance(record)}\n")


def pbt(record: dict) -> str:
    """`bench.pbt`'s three methods: accuracy on the unread report images and on the official
    test images (mean ± std over the seeds), at the same member-epochs, and PBT's paired gain
    over each other method on both sets."""
    lines = ["| method | report accuracy (unread) | test accuracy (official) |",
             "| --- | --- | --- |"]
    for row in record["results"]:
        lines.append(f"| {row['method']} | {spread(row['report_mean'], row['report_std'])} | "
                     f"{spread(row['mean'], row['std'])} |")
    methods = {row["method"][0]: row for row in record["results"]}
    gains = []
    for other in ("a", "b"):
        if "c" not in methods or other not in methods:
            continue
        for key, name in (("report_accuracy", "unread"), ("test_accuracy", "test")):
            pairs = differences(methods["c"][key], methods[other][key])
            mean, std = mean_std(pairs)
            ahead = sum(d > 0 for d in pairs)
            gains.append(f"(c) - ({other}) on {name} {mean:+.4f} ± {std:.4f} (ahead on {ahead} "
                         f"of {len(pairs)} seeds)")
    settings = ", ".join(f"{k}={v}" for k, v in record["overrides"].items()) or "the defaults"
    return "\n".join(lines) + (
        f"\n\nPaired: {'; '.join(gains)}. {record['members']} members x "
        f"{rounds_of(record, 'rounds_per_member')} each ({settings}). {provenance(record)}\n")


def rounds_of(record: dict, key: str) -> str:
    """A record's count of rounds under `key` (a name with `rounds` in it), as "N rounds";
    records written before rounds had their name hold it under `key`'s `epochs` name (the same
    count: what the flow repeats)."""
    return f"{record.get(key, record.get(key.replace('rounds', 'epochs')))} rounds"


def newest_per_flow(name: str, results: Path = RESULTS) -> dict:
    """`bench.small_data`'s newest row of each set, seeds and flow (a later run may add a flow
    on the same sets, seeds and splits; a run on other seeds makes its own rows, never mixed
    with the first seeds' flows), the newest holdout baselines of each set and seeds, and the
    records they came from (`sources`); runs with `--set` overrides left out
    (`records_of_defaults`). Each row carries its record's `seeds`."""
    rows: dict[tuple[str, tuple[int, ...], str], dict] = {}
    held: dict[tuple[str, tuple[int, ...]], dict] = {}
    sources: list[dict] = []
    for record in records_of_defaults(name, results)[::-1]:
        used, seeds = False, tuple(record.get("seeds", (0, 1, 2)))
        for row in record["results"]:
            if "flow" in row and (row["set"], seeds, row["flow"]) not in rows:
                rows[row["set"], seeds, row["flow"]] = row | {
                    "seeds": list(seeds), "finished": record.get("finished", "")}
                used = True
            elif "holdout_baselines" in row and (row["set"], seeds) not in held:
                held[row["set"], seeds] = row | {"seeds": list(seeds)}
        if used:
            sources.append(record)
    order = {flow: n for n, flow in enumerate(("train", "distill", "pbt", "pipeline"))}
    ordered = sorted(rows.values(), key=lambda row: (row["seeds"],
                                                     order.get(row["flow"], len(order))))
    newest = sources[0]
    return newest | {"results": ordered + list(held.values()), "sources": sources[::-1]}


def seeds_suffix(seeds: list[int]) -> str:
    """`, seeds 3, 4, 5` after a result's name, nothing for the default seeds 0, 1, 2."""
    return "" if list(seeds) == [0, 1, 2] else f", seeds {', '.join(map(str, seeds))}"


def set_label(row: dict) -> str:
    """A small-data row's set as the tables name it: `2500 x 16 px`, with its seeds where they
    are not the default 0, 1, 2."""
    return f"{row['set'].replace('x', ' x ')} px" + seeds_suffix(row.get("seeds", [0, 1, 2]))


def served_against(mine: dict, base: dict) -> str:
    """`; served 0.31x of `train`'s time per image at batch 1, 0.29x at batch 64, 11% of its
    parameters`: a small-data pipeline row's client-side time and served parameters over its
    `train` row's, seed by seed (means of the ratios); nothing for rows measured before
    `bench.small_data` timed them."""
    if "client_ms_b1" not in mine or "client_ms_b1" not in base:
        return ""

    def ratio(key: str) -> float:
        return mean_std([a / b for a, b in zip(mine[key], base[key], strict=True)])[0]

    return (f"; served {ratio('client_ms_b1'):.2f}x of `train`'s time per image at batch 1, "
            f"{ratio('client_ms_b64'):.2f}x at batch 64, {ratio('parameters'):.0%} of its "
            "parameters")


def alone_on(row: dict) -> str:
    """`; the student registered alone on 2 of 3 seeds` for a small-data pipeline row that
    recorded its decisions."""
    alone = row.get("student_alone_stands")
    return "" if alone is None else (f"; the student registered alone on {sum(alone):.0f} of "
                                     f"{len(alone)} seeds")


def small_data(record: dict) -> str:
    """`bench.small_data`'s sets: each flow's accuracy on the holdout and on the set's own
    test split, beside the raw-pixel baselines (mean ± std over the seeds); one line per set
    and seeds."""
    rows = [r for r in record["results"] if "flow" in r]
    held = {set_label(r): r["holdout_baselines"] for r in record["results"]
            if "holdout_baselines" in r}
    flows = list(dict.fromkeys(r["flow"] for r in rows if not r["flow"].startswith("long")))
    lines = ["| set | " + " | ".join(f"`{flow}`" for flow in flows)
             + " | k-NN pixels | linear pixels |", "| --- " * (len(flows) + 3) + "|"]
    by_line = {(set_label(r), r["flow"]): r for r in rows}  # one row per set, seeds and flow
    served = []
    for name in dict.fromkeys(label for label, _ in by_line):
        cells = []
        for flow in flows:
            row = by_line.get((name, flow))
            cells.append("-" if row is None else
                         f"{spread(row['holdout_accuracy_mean'], row['holdout_accuracy_std'])}"
                         f" / {row['test_accuracy_mean']:.3f}")
        for kind in ("knn", "linear"):
            values = [b[kind] for b in held.get(name) or []]
            cells.append(spread(*mean_std(values)) if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if figures := served_against(by_line.get((name, "pipeline"), {}),
                                     by_line.get((name, "train"), {})):
            served.append(f"{name}:{figures.removeprefix(';')}")
    timed = ("" if not served else " The pipeline's registered model against `train`'s, "
             "as a client meets them (`predict` on PNG bytes, one thread, interleaved): "
             + "; ".join(served) + ".")
    return "\n".join(lines) + (
        f"\n\nEach cell: accuracy on the {record['holdout']} holdout (10,000 images) / on "
        f"the set's own test split (20%); baselines on the holdout. Tuning sets, not reported "
        f"here: {', '.join(record['tuning_sets'])}.{timed} "
        f"{' '.join(provenance(source) for source in record.get('sources', [record]))}\n")


def train_accuracy(record: dict) -> str:
    """`bench.train_accuracy`'s networks: the `train` flow's accuracy with each, on the unread
    images and on the official test images (mean ± std over the seeds)."""
    lines = ["| network (its role in `distill`) | report accuracy (unread) | test accuracy "
             "(official) |", "| --- | --- | --- |"]
    for row in record["results"]:
        lines.append(f"| `{row['model']}` ({row['role']}) | "
                     f"{spread(row['report_mean'], row['report_std'])} | "
                     f"{spread(row['mean'], row['std'])} |")
    return "\n".join(lines) + f"\n\n{provenance(record)}\n"


SPARSIFY_TASKS = {"classification": ("test_accuracy", "accuracy"),
                  "detection": ("test_map_50", "mAP@0.5"),
                  "contour": ("test_boundary_f", "boundary F")}


def newest_per_task(name: str, results: Path = RESULTS) -> dict:
    """`bench.sparsify`'s newest rows of each task (classification, detection and contour may
    come from different runs), in task order, and the records they came from (`sources`)."""
    rows, sources, newest_first = [], [], records(name, results)[::-1]
    for task in SPARSIFY_TASKS:
        source = next((r for r in newest_first
                       if any(row["task"] == task for row in r["results"])), None)
        if source is None:
            continue
        rows += [row for row in source["results"] if row["task"] == task]
        if source not in sources:
            sources.append(source)
    return {"results": rows, "sources": sources}


def sparsify(record: dict) -> str:
    """`bench.sparsify`'s rows (its newest run of each task, `newest_per_task`): per task and
    variant, the score on the unread images (classifiers) and on the test split, the exact
    zeros per regularized layer and over all maps, and the bytes of the maps stored as bitmap
    plus values over dense, all on the test split (mean over the seeds); each task's layers
    and lambdas, and each run's command, below."""
    lines = ["| task | variant | report accuracy (unread) | test score | exact zeros per layer "
             "(test) | all maps (test) | bitmap / dense (test) |", "| --- " * 7 + "|"]
    layers, shown = [], None
    for row in record["results"]:
        key, score = SPARSIFY_TASKS[row["task"]]
        report = row.get("report_accuracy")
        zeros = row["test_zero_fraction"]
        lines.append(
            f"| {row['task'] if row['task'] != shown else ''} | {row['variant']} | "
            f"{'-' if report is None else spread(*report)} | {score} {spread(*row[key])} | "
            f"{' / '.join(f'{mean:.3f}' for mean, _ in zeros.values())} | "
            f"{row['total_test_zero_fraction'][0]:.3f} | "
            f"{row['test_memory_bitmap_ratio'][0]:.3f} |")
        if row["task"] != shown:
            lambdas = next((run["lambdas"] for r in record["results"] if r["task"] == row["task"]
                            for run in r["runs"] if any(run["lambdas"].values())), {})
            layers.append(f"{row['task']}: " + ", ".join(
                f"`{name}`" + (f" {lambdas[name]:.3g}" if name in lambdas else "")
                for name in zeros))
        shown = row["task"]
    runs = " ".join(provenance(source) for source in record["sources"])
    return "\n".join(lines) + (
        f"\n\nLayers in the zeros cells, with their lambdas (the term's weight per map): "
        f"{'; '.join(layers)}. {runs}\n")


def area_rule(record: dict) -> str:
    """`bench.area_rule`: per data set, the area rule and the uniform lambda matched to its
    validation zeros, on the unread images and the test split, with their zeros, and the
    rule's paired difference on the unread images."""
    lines = ["| data set | lambda per map | unread accuracy | test accuracy | zeros, all maps "
             "(test) | zeros (validation, matched) |", "| --- " * 6 + "|"]
    paired = []
    for entry in record["results"]:
        for key in ("rule", "uniform"):
            figures = entry[key]
            lambdas = figures["runs"][0]["lambdas"]
            shown = ", ".join(f"`{layer}` {value:.3g}" for layer, value in lambdas.items())
            label = "area rule (gamma 0.5)" if key == "rule" else "one lambda (gamma 0)"
            lines.append(f"| {entry['set'] if key == 'rule' else ''} | {label}: {shown} | "
                         f"{spread(*figures['unread_accuracy'])} | "
                         f"{spread(*figures['test_accuracy'])} | "
                         f"{figures['test_zeros'][0]:.3f} | {figures['val_zeros'][0]:.3f} |")
        gains = [r["unread_accuracy"] - u["unread_accuracy"] for r, u in
                 zip(entry["rule"]["runs"], entry["uniform"]["runs"], strict=True)]
        mean, std = mean_std(gains)
        paired.append(f"{entry['set']} {mean:+.4f} ± {std:.4f} (ahead on "
                      f"{sum(g > 0 for g in gains)} of {len(gains)} seeds)")
    return "\n".join(lines) + (f"\n\nRule minus one lambda, unread, paired: "
                               f"{'; '.join(paired)}. {provenance(record)}\n")


def newest_per_variant(name: str, results: Path = RESULTS) -> dict:
    """`bench.descriptions`' newest runs of each data set and variant (a later record may add
    a variant on the same seeds and splits), the paired difference to `one` recomputed across
    records, and the records they came from (`sources`)."""
    picked: dict[str, dict[str, dict]] = {}
    sources: list[dict] = []
    for record in records(name, results)[::-1]:
        used = False
        for entry in record["results"]:
            for variant, figures in entry["variants"].items():
                if variant not in picked.setdefault(entry["set"], {}):
                    picked[entry["set"]][variant], used = figures, True
        if used:
            sources.append(record)
    order = ("several", "one", "no phrases", "agreement")
    results = []
    for data_set, variants in picked.items():
        ordered = {v: dict(variants[v]) for v in sorted(variants, key=order.index)}
        base = ordered.get("one")
        for variant, figures in ordered.items():
            figures["minus_one_unread"] = None if base is None or variant == "one" else \
                mean_std([r["unread_accuracy"] - b["unread_accuracy"]
                          for r, b in zip(figures["runs"], base["runs"], strict=True)])
        results.append({"set": data_set, "variants": ordered})
    return {"results": results, "sources": sources[::-1]}


def descriptions(record: dict) -> str:
    """`bench.descriptions`: per data set and variant, accuracy on the unread images, the test
    split and the 100 validation images, and the paired difference to one description
    (`newest_per_variant`)."""
    lines = ["| data set | descriptions per image | unread accuracy | test accuracy | "
             "validation (100 images) | unread, minus one description (paired) |",
             "| --- " * 6 + "|"]
    for entry in record["results"]:
        shown = None
        for variant, figures in entry["variants"].items():
            paired = figures["minus_one_unread"]
            lines.append(f"| {entry['set'] if entry['set'] != shown else ''} | {variant} | "
                         f"{spread(*figures['unread_accuracy'])} | "
                         f"{spread(*figures['test_accuracy'])} | "
                         f"{spread(*figures['val_accuracy'])} | "
                         f"{'-' if paired is None else f'{paired[0]:+.4f} ± {paired[1]:.4f}'} |")
            shown = entry["set"]
    runs = " ".join(provenance(source) for source in record["sources"])
    return "\n".join(lines) + f"\n\n{runs}\n"


DISTILL_BANK_ORDER = ["teacher", "alone", "kd", "l2", "dkd", "bank l2", "bank dkd",
                      "mean bank l2", "mean bank dkd"]


def paired_cell(figures: dict, key: str) -> str:
    """A paired difference's `mean ± std`, or `-` where the variant has none."""
    value = figures.get(key)
    return "-" if value is None else f"{value[0]:+.4f} ± {value[1]:.4f}"


def distill_rows(results: list[dict], order: list[str], paired: tuple[str, ...]) -> list[str]:
    """The distillation benchmarks' rows: per data set, each variant (in `order`) with its
    accuracy on the unread images, the test split and validation, its gap closed, and the
    paired differences under `paired`."""
    lines = []
    for entry in results:
        shown = None
        variants = entry["variants"]
        for variant in sorted(variants, key=lambda v: (order + [v]).index(v)):
            figures = variants[variant]
            gap = figures.get("gap_closed_unread")
            seeds = figures.get("seeds", [0, 1, 2])  # (merged rows say which seeds they hold)
            label = variant if seeds == [0, 1, 2] else (
                f"{variant} (seed{'s' if len(seeds) > 1 else ''} "
                f"{', '.join(map(str, seeds))}{' only' if len(seeds) < 3 else ''})")
            lines.append(f"| {entry['set'] if entry['set'] != shown else ''} | {label} | "
                         f"{spread(*figures['unread'])} | {spread(*figures['test'])} | "
                         f"{spread(*figures['val'])} | "
                         f"{'-' if gap is None else f'{gap:+.2f}'} | "
                         + " | ".join(paired_cell(figures, key) for key in paired) + " |")
            shown = entry["set"]
    return lines


def distill_bank(record: dict) -> str:
    """`bench.distill_bank`: per data set, the teacher and every student variant's accuracy on
    the unread images, the test split and the validation split, the gap closed on the unread
    images, and each bank's paired difference to the final-teacher baseline best on
    validation."""
    lines = ["| data set | student learns from | unread accuracy | test accuracy | validation | "
             "gap closed (unread) | unread, minus the best final-teacher loss (paired) |",
             "| --- " * 7 + "|",
             *distill_rows(record["results"], DISTILL_BANK_ORDER, ("minus_best_final_unread",))]
    best = "; ".join(f"{e['set']}: `{e['best_final_on_val']}` (best final-teacher loss), "
                     f"`{e['chosen_on_val']}` (best of all)" for e in record["results"])
    return "\n".join(lines) + f"\n\nChosen on validation: {best}. {provenance(record)}\n"


DISTILL_TARGETS_ORDER = ["teacher", "alone x1", "alone", "kd", "states-T1", "states-T4",
                         "kd-ls", "auto", "auto of 3", "bank",
                         "bank-T1", "bank views-T1", "bank mean-T1", "bank pool cosine",
                         "alone mix", "states mix-T1", "fm-T1", "fm final-T1", "alone x6",
                         "fm-T1 x6", "kd x6", "states-T1 x6"]
BENCH_PATIENCE = 3  # bench.distill_targets' default --patience
DISTILL_DEFAULT = "auto"  # the bench.distill_targets variant that is the flow's default


EARLIER_AUTO = ["labels", "final", "states"]  # `--targets auto`'s candidates before `standardized`


def budget_label(record: dict, variant: str) -> str:
    """A variant's row: its name, with ` xN` where its record trained the students at
    `--patience N` other than the default and the variant sets no budget of its own (`kd` of a
    `--patience 6` record is `kd x6`); `auto` of a record whose default chose among other
    candidates than the flow's now is `auto of N` (never merged with today's default)."""
    candidates = record.get("auto_candidates", EARLIER_AUTO)
    if variant == "auto" and candidates != list(AUTO_CANDIDATES):
        return f"auto of {len(candidates)}"
    patience = record.get("base", {}).get("student_patience", BENCH_PATIENCE)
    own = "student_patience" in record.get("variants", {}).get(variant, {})
    return variant if variant == "teacher" or own or patience == BENCH_PATIENCE \
        else f"{variant} x{patience}"


def reference(variant: str, other: str, variants: dict) -> str:
    """The row `variant` is paired with for `other` (`alone`, `kd`): the one at the same
    budget where there is one (`alone x6` for `kd x6`), else `other`."""
    budget = variant.rpartition(" ")[2]
    same = f"{other} {budget}"
    return same if budget.startswith("x") and budget[1:].isdigit() and same in variants \
        else other


def merged_variants_per_set(name: str, results: Path = RESULTS) -> dict:
    """Per data set (`bench.two_sets.SETS` order), each variant's runs merged by seed, each
    seed's from the newest record that ran that variant on that set with that seed (sets,
    variants and seeds run apart, e.g. one seed a session, shown together):
    `{"results": [entry, ...], "sources": [record, ...]}`; a record run at another
    `--patience` names its rows by their budget (`budget_label`). The gap closed and the paired
    differences to `alone` and `kd` (at the row's budget where they ran at it: `reference`)
    are taken over the merged runs, pairing them by seed (the gap on the seeds the row, `alone`
    and the teacher share): an
    older run whose teacher's figures differ from the newest run's of that seed (the code
    changed in between) is left out, so every row of a seed learned from one teacher."""
    newest_first = records(name, results)[::-1]
    entries, sources = [], []
    for data_set in ("fashion-mnist", "2500x16"):
        by_seed: dict[str, dict[int, dict[str, float]]] = {}
        for record in newest_first:
            entry = next((e for e in record["results"] if e["set"] == data_set), None)
            fresh = False
            for run in (entry or {}).get("runs", []):
                teacher = by_seed.get("teacher", {}).get(run["seed"])
                if teacher is not None and teacher != run["accuracy"]["teacher"]:
                    continue  # another teacher (the code changed since): not paired with it
                for variant, splits in run["accuracy"].items():
                    label = budget_label(record, variant)
                    if run["seed"] not in by_seed.setdefault(label, {}):
                        by_seed[label][run["seed"]] = splits
                        fresh = True
            if fresh and record not in sources:
                sources.append(record)
        variants = {variant: {split: mean_std([runs[seed][split] for seed in sorted(runs)])
                              for split in ("val", "test", "unread")} | {"seeds": sorted(runs)}
                    for variant, runs in by_seed.items()}
        unread = {variant: {seed: splits["unread"] for seed, splits in runs.items()}
                  for variant, runs in by_seed.items()}
        if not variants:
            continue
        for variant, figures in variants.items():
            if variant == "teacher":
                continue
            alone = unread.get(reference(variant, "alone", variants), {})
            seeds = sorted(set(unread[variant]) & set(alone) & set(unread["teacher"]))
            if seeds:  # on the seeds all three ran
                means = [mean_std([runs[s] for s in seeds])[0]
                         for runs in (unread[variant], alone, unread["teacher"])]
                if means[2] > means[1]:
                    figures["gap_closed_unread"] = (means[0] - means[1]) / (means[2] - means[1])
            for other in ("alone", "kd"):
                paired_with = reference(variant, other, variants)
                seeds = sorted(set(unread[variant]) & set(unread.get(paired_with, {})))
                if paired_with != variant and seeds:
                    figures[f"minus_{other}_unread"] = mean_std(
                        [unread[variant][s] - unread[paired_with][s] for s in seeds])
        students = [v for v in variants if v != "teacher"]
        entries.append({"set": data_set, "variants": variants,
                        "chosen_on_val": max(students, key=lambda v: variants[v]["val"][0])})
    return {"results": entries, "sources": sources}


def distill_targets(picked: dict) -> str:
    """`bench.distill_targets`: per data set, the teacher and each student's accuracy on the
    unread images, the test split and the validation split, the gap closed and the paired
    unread differences to the student alone and to KD."""
    lines = ["| data set | student learns from | unread accuracy | test accuracy | validation | "
             "gap closed (unread) | minus alone (unread, paired) | minus KD (unread, paired) |",
             "| --- " * 8 + "|",
             *distill_rows(picked["results"], DISTILL_TARGETS_ORDER,
                           ("minus_alone_unread", "minus_kd_unread"))]
    chosen = "; ".join(f"{e['set']}: `{e['chosen_on_val']}`" for e in picked["results"])
    shown = {v for e in picked["results"] for v in e["variants"]}
    own = {v: config["student_patience"] for r in picked["sources"]  # a variant's own budget
           for v, config in r["variants"].items() if v in shown and "student_patience" in config}
    others = ", ".join(f"`{v}`: {patience}x" for v, patience in sorted(own.items()))
    setups = " ".join(dict.fromkeys(  # one sentence per distinct setting, sources oldest first
        f"Students train {BENCH_PATIENCE}x the fitted budget, a row named `xN` N times"
        f"{f' ({others})' if others else ''}; the teacher is warm-started "
        f"{rounds_of(r['base'], 'teacher_pretrain_rounds')}." for r in picked["sources"]))
    setups += " " + " ".join(provenance(r) for r in picked["sources"][::-1])
    return "\n".join(lines) + f"\n\nBest on validation: {chosen}. {setups}\n"


def inference_batch(record: dict) -> str:
    """`bench.inference_batch`'s networks: images per second of a scoring pass at the device's
    batch and at the baseline batch (median over the rounds), and their paired ratio."""
    batch, baseline = record["batch"], record["baseline_batch"]
    lines = [f"| network | images / s at {batch} | at {baseline} | ratio | accuracy "
             "difference |", "| --- " * 5 + "|"]
    for name, figure in record["networks"].items():
        lines.append(f"| `{name}` | {figure['images_per_second']:,.0f} | "
                     f"{figure['baseline_images_per_second']:,.0f} | "
                     f"{figure['speed_ratio']:.2f}x | {figure['accuracy_difference']:+.4f} |")
    return "\n".join(lines) + (
        f"\n\n{record['device']}, {record['threads']} threads, median paired ratio over the "
        f"rounds; command: `{record['command']}` (commit {record['commit'][:7]}).\n")


def serving(record: dict) -> str:
    """`bench.serving`: each registered model's client-side time per image on PNG bytes at
    batch 1 and 64, its networks' own time in the process, and the ratios."""
    lines = ["| registered model | parameters | client ms / image, batch 1 | batch 64 | "
             "networks alone, batch 1 | batch 64 | client / networks, batch 1 | batch 64 | "
             "client vs baseline, batch 1 | batch 64 |", "| --- " * 10 + "|"]
    models = record["models"]
    for uri in sorted(models, key=lambda uri: uri != record["baseline"]):  # baseline first
        figure = models[uri]
        lines.append(f"| `{uri}` | {figure['parameters']:,} | "
                     + " | ".join(f"{figure[k]:.3f}" for k in (
                         "client_ms_b1", "client_ms_b64", "network_ms_b1", "network_ms_b64"))
                     + " | " + " | ".join(f"{figure[k]:.2f}x" for k in (
                         "client_over_network_b1", "client_over_network_b64",
                         "client_vs_baseline_b1", "client_vs_baseline_b64")) + " |")
    inputs = "; ".join(f"`{uri}` {f['input_ms_b1']:.3f} / {f['input_ms_b64']:.3f}"
                       for uri, f in record["models"].items())
    return "\n".join(lines) + (
        f"\n\n`predict` on a DataFrame of PNG bytes (Fashion-MNIST test images), as `mlflow "
        f"models serve` hands a request to the model; {record['device']}; medians of "
        f"{record['calls']['1']} calls at batch 1 and {record['calls']['64']} at batch 64, the "
        f"models interleaved; baseline `{record['baseline']}`. Input preparation (decode to "
        f"normalized batch), ms per image at batch 1 / 64: {inputs}. Command: "
        f"`{record['command']}` (commit {record['commit'][:7]}).\n")


def inputs(record: dict) -> str:
    """`bench.inputs`: per batch, ms per image of turning PNG bytes into a normalized batch
    through Pillow and through the served path, their median paired ratio, same pixels."""
    lines = ["| batch | Pillow, image by image: ms per image | served (`input_batches`) | "
             "served / Pillow | same pixels |", "| --- " * 5 + "|"]
    for batch, f in record["batches"].items():
        lines.append(f"| {batch.removeprefix('b')} | {f['pillow_ms_per_image']:.4f} | "
                     f"{f['served_ms_per_image']:.4f} | {f['ratio']:.2f}x | "
                     f"{'yes' if f['same_pixels'] else '**no**'} |")
    return "\n".join(lines) + (
        f"\n\n{record['images']}; {record['device']}, {record['threads']} thread, median paired "
        f"ratio over {record['rounds']} calls a batch; command: `{record['command']}` (commit "
        f"{record['commit'][:7]}).\n")


def layout(record: dict) -> str:
    """`bench.layout`: per network, ms per image of a forward pass at batch 1 and 64 in the
    plain layout and in channels_last, their median paired ratio, the logits' difference."""
    lines = ["| network | batch 1: plain / channels_last, ms per image | ratio | batch 64 | ratio "
             "| largest logit difference |", "| --- " * 6 + "|"]
    for name, figure in record["networks"].items():
        cells = []
        for measure in ("forward_b1", "forward_b64"):
            f = figure[measure]
            cells += [f"{f['plain_ms_per_image']:.4f} / {f['channels_last_ms_per_image']:.4f}",
                      f"{f['ratio']:.2f}x"]
        lines.append(f"| `{name}` | " + " | ".join(cells)
                     + f" | {figure['max_logit_difference']:.1e} |")
    return "\n".join(lines) + (
        f"\n\n{record['device']}, {record['threads']} thread(s), untrained networks on random "
        f"28-pixel images, median paired ratio over {record['rounds']} rounds; command: "
        f"`{record['command']}` (commit {record['commit'][:7]}).\n")


def allocator(record: dict) -> str:
    """`bench.allocator`: per network, a training step's wall and system milliseconds and page
    faults with glibc's defaults and with `keep_freed_memory`, and the paired wall ratio."""
    lines = ["| network | glibc defaults: ms a step (system) | page faults a step | "
             "`keep_freed_memory`: ms a step (system) | page faults a step | wall ratio |",
             "| --- " * 6 + "|"]
    for name, figure in record["networks"].items():
        cells = [f"{figure[s]['wall'] * 1000:.1f} ({figure[s]['sys'] * 1000:.1f}) | "
                 f"{figure[s]['page_faults']:,.0f}" for s in ("defaults", "keep_freed_memory")]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} | {figure['ratio']:.2f}x |")
    return "\n".join(lines) + (
        f"\n\nCPU, {record['threads']} thread, batch {record['batch']}, SGD steps; medians of "
        f"{record['rounds']} fresh processes per setting ({record['steps']} steps each, the "
        f"order swapped every round); command: `{record['command']}` (commit "
        f"{record['commit'][:7]}).\n")


def merged_pbt_peer(name: str, results: Path = RESULTS) -> dict:
    """`bench.pbt_peer`'s records of the full work (smoke runs left out) merged by tool and seed,
    the newest run of each winning (a seed runs for about 35 minutes, so the seeds may come from
    several sessions); each tool's mean and standard deviation over its seeds, and the commands
    and commits of the records the kept runs came from."""
    kept = [r for r in records(name, results) if not r.get("smoke")]
    if not kept:
        raise ValueError(f"no full-work record in {name}.jsonl")
    by_tool: dict[str, dict[int, dict]] = {}
    source: dict[tuple[str, int], tuple[str, str]] = {}  # the record each run came from
    for record in kept:  # oldest first: a newer run of a seed replaces the older
        for tool, figure in record["tools"].items():
            for run in figure["runs"]:
                by_tool.setdefault(tool, {})[run["seed"]] = run
                source[tool, run["seed"]] = (record["command"], record["commit"][:7])
    tools = {}
    for tool, seeds in by_tool.items():
        runs = [seeds[seed] for seed in sorted(seeds)]
        test = mean_std([run["test_accuracy"] for run in runs])
        seconds = mean_std([run["seconds"] for run in runs])
        tools[tool] = {"runs": runs, "test_mean": test[0], "test_std": test[1],
                       "seconds_mean": seconds[0], "seconds_std": seconds[1]}
    sources = list(dict.fromkeys(source[key] for key in sorted(source)))
    return {"work": kept[-1]["work"], "tools": tools,
            "sources": [f"`{command}` (commit {commit})" for command, commit in sources]}


def longer_project_tools(tools: dict) -> list[tuple[str, int]]:
    """`bench.pbt_peer`'s tools that run the flow at more epochs a member than the work's
    (`project-N`) among `tools`, with N, fewest epochs first."""
    longer = [(tool, int(tool.removeprefix("project-"))) for tool in tools
              if tool.removeprefix("project-").isdigit()]
    return sorted(longer, key=lambda pair: pair[1])


def pbt_peer(record: dict) -> str:
    """`bench.pbt_peer`: Ray Tune's PBT and the project's `pbt` on one work, per seed: the
    chosen model's accuracy on the test images and the wall time of a run."""
    tools = record["tools"]
    names = {"ray": "Ray Tune 2.60 `PopulationBasedTraining`", "project": "the project's `pbt`",
             "project-no-explore": "`pbt --no-explore` (the control)"} | {
        tool: f"the project's `pbt`, {epochs} epochs a member"
        for tool, epochs in longer_project_tools(tools)}
    lines = ["| tool | test accuracy (official) | per seed | seconds per run | per seed | "
             "time / Ray's, paired |", "| --- " * 6 + "|"]
    ray = {run["seed"]: run for run in tools.get("ray", {}).get("runs", [])}  # Ray's runs
    for tool, figure in tools.items():
        accuracies = " / ".join(f"{run['test_accuracy']:.4f}" for run in figure["runs"])
        seconds = " / ".join(f"{run['seconds']:.0f}" for run in figure["runs"])
        accuracy = spread(figure["test_mean"], figure["test_std"])
        ratios = [run["seconds"] / ray[run["seed"]]["seconds"] for run in figure["runs"]
                  if run["seed"] in ray]
        mean, std = mean_std(ratios) if ratios and tool != "ray" else (None, None)
        ratio = "" if mean is None else f"{mean:.2f}x ± {std:.2f}"
        lines.append(f"| {names.get(tool, tool)} | {accuracy} | {accuracies} | "
                     f"{figure['seconds_mean']:.0f} ± {figure['seconds_std']:.0f} | {seconds} | "
                     f"{ratio} |")
    for tool, figure in tools.items():
        ahead = [run["test_accuracy"] - ray[run["seed"]]["test_accuracy"]
                 for run in figure["runs"] if tool != "ray" and run["seed"] in ray]
        if ahead:
            mean, std = mean_std(ahead)
            lines.append(f"\n{names.get(tool, tool)} minus Ray, paired by seed (test images): "
                         f"{mean:+.4f} ± {std:.4f} over {len(ahead)} seed(s), ahead on "
                         f"{sum(d > 0 for d in ahead)}.")
    work = record["work"]
    wins = [f"seed {run['seed']}: {run['explorer_wins']} of {len(run['stage_winners'])}"
            for run in tools.get("project", {}).get("runs", []) if "explorer_wins" in run]
    if wins:
        lines.append(f"\nStages won by a member that had explored (not the incumbent), "
                     f"`pbt`: {'; '.join(wins)}.")
    control = {run["seed"]: run["test_accuracy"]
               for run in tools.get("project-no-explore", {}).get("runs", [])}
    paired = [run["test_accuracy"] - control[run["seed"]]
              for run in tools.get("project", {}).get("runs", []) if run["seed"] in control]
    if paired:
        mean, std = mean_std(paired)
        lines.append(f"\n`pbt` minus `pbt --no-explore`, paired by seed (test images): "
                     f"{mean:+.4f} ± {std:.4f} over {len(paired)} seed(s), ahead on "
                     f"{sum(d > 0 for d in paired)}.")
    return "\n".join(lines) + (
        f"\n\n{work['members']} members x {work['epochs']} epochs of `{work['model']}` at width "
        f"{work['width']} on {work['train_limit']:,} training images, {work['val_limit']:,} "
        f"validation images, batch {work['batch_size']}; two members at a time, one thread "
        f"each; seeds {', '.join(str(r['seed']) for r in next(iter(tools.values()))['runs'])}; "
        f"{'; '.join(record['sources'])}.\n")


def faults(record: dict) -> str:
    """`bench.faults`: per flow, the trials, how many were killed mid-run, how many reruns
    passed every check, and the reruns' seconds; the checks and the command below."""
    lines = ["| flow | clean run | trials | killed mid-run | rerun passed | rerun seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for flow, clean in record["clean_seconds"].items():
        trials = [t for t in record["trials"] if t["flow"] == flow]
        if not trials:
            continue
        seconds = ", ".join(f"{t['rerun_seconds']:.0f}" for t in trials)
        lines.append(f"| {flow} | {clean:.0f} s | {len(trials)} | "
                     f"{sum(t['killed'] for t in trials)} | "
                     f"{sum(t['passed'] for t in trials)} of {len(trials)} | {seconds} |")
    failed = [f"{t['flow']} (seed {t['seed']}): status {t['rerun_status']}, {t['versions']} "
              f"versions, lock {'free' if t['lock_free'] else 'held'}, leftovers "
              f"{', '.join(t['leftovers']) or 'none'}" for t in record["trials"] if not t["passed"]]
    return "\n".join(lines) + (
        f"\n\n{record['passed']} of {len(record['trials'])} trials passed: the rerun ended with "
        "status 0, one registered version, the registry lock and run slot free, no temporary or "
        "half-written artifact left"
        + (f"; failed: {'; '.join(failed)}" if failed else "")
        + f". Kill moments drawn uniformly over each flow's clean run (seed {record['seed']}); "
        f"command: `{record['command']}` (commit {record['commit'][:7]}).\n")


def summary(results: Path) -> dict:
    """The README's summary: the picked records of the benchmarks it quotes."""
    return {"pipeline": newest_of_defaults("pipeline", results),
            "distill": merged_variants_per_set("distill_targets", results),
            "pbt": newest("pbt", results), "small_data": newest_per_flow("small_data", results),
            "faults": newest("faults", results) if (results / "faults.jsonl").exists() else None,
            "pbt_peer": merged_pbt_peer("pbt_peer", results)
            if (results / "pbt_peer.jsonl").exists() else None,
            "serving": newest("serving", results)
            if (results / "serving.jsonl").exists() else None}


def served_row(record: dict) -> tuple[str, str, str]:
    """The summary's row of `bench.serving`: each registered model against the baseline as a
    client meets it (PNG bytes), and what the path around its networks costs at batch 64."""
    baseline = record["baseline"]
    shown = [uri for uri in record["models"]
             if uri != baseline and not uri.endswith(EXPORT_CHECKS)]
    return ("the registered models as a client meets them (`predict` on PNG bytes), "
            "Fashion-MNIST", "; ".join(
                f"`{uri.removeprefix('models:/')}` {f['client_vs_baseline_b1']:.2f}x of "
                f"`{baseline.removeprefix('models:/')}`'s time per image at batch 1, "
                f"{f['client_vs_baseline_b64']:.2f}x at batch 64; the path around its network "
                f"{f['client_over_network_b64']:.2f}x the network's own time at batch 64"
                for uri in shown for f in [record["models"][uri]]), "the-pipeline")


def summary_table(picked: dict) -> str:
    """One row per headline result (unread images: never read by a choice; 3 seeds), each
    linking its table in docs/benchmarks.md."""
    runs = picked["pipeline"]["runs"]

    def mean_of(model: str, key: str) -> float:
        return mean_std([run[model][key] for run in runs])[0]

    def ratio(key: str) -> float:
        return mean_std([run["pipeline"][key] / run["train"][key] for run in runs])[0]

    share = runs[0]["pipeline"]["student_parameters"] / runs[0]["train"]["parameters"]
    seeds = picked["pipeline"]["seeds"]
    alone = sum(run["pipeline"].get("student_alone", False) for run in runs)
    rows = [("the pipeline (`make run`) against `train`, Fashion-MNIST" + seeds_suffix(seeds),
             f"{mean_of('pipeline', 'report_accuracy'):.4f} against "
             f"{mean_of('train', 'report_accuracy'):.4f}; on uint8 arrays {ratio('ms'):.2f}x "
             f"of `train`'s time per image at batch 1, {ratio('ms_b64'):.2f}x at batch 64; common "
             f"path {share:.0%} of its parameters"
             + (f", the student registered alone on {alone} of {len(runs)} seeds" if alone
                else ""), "the-pipeline")]
    if picked.get("serving") is not None:
        rows.append(served_row(picked["serving"]))
    small = {(set_label(r), r["flow"]): r for r in picked["small_data"]["results"]
             if "flow" in r}
    for data_set in ("2500x16", "1000x28"):
        paired_runs = [(small[label, "pipeline"], small[label, "train"])
                       for label, flow in small if flow == "pipeline"
                       and small[label, flow]["set"] == data_set and (label, "train") in small]
        if paired_runs:  # the newest pipeline run with its `train` on the same seeds
            mine, base = max(paired_runs, key=lambda pair: pair[0]["finished"])
            paired = mean_std(differences(mine["holdout_accuracy"], base["holdout_accuracy"]))
            rows.append((f"the pipeline against `train`, {set_label(mine)} (never tuned on)",
                         f"{mine['holdout_accuracy_mean']:.4f} against "
                         f"{base['holdout_accuracy_mean']:.4f}: {paired[0]:+.4f} ± "
                         f"{paired[1]:.4f} (paired)" + served_against(mine, base)
                         + alone_on(mine),
                         "defaults-on-data-no-default-was-tuned-on"))
    for entry in picked["distill"]["results"]:
        variants = entry["variants"]
        # today's default, else an earlier one (`auto of 3`), labelled as such
        shown = DISTILL_DEFAULT if DISTILL_DEFAULT in variants else next(
            (v for v in sorted(variants) if v.startswith(f"{DISTILL_DEFAULT} of ")), None)
        if shown is not None and "kd" in variants:
            default = variants[shown]
            what = "default (`--targets auto`)" if shown == DISTILL_DEFAULT else \
                f"earlier default (`--targets auto` {shown.partition(' ')[2]} candidates)"
            rows.append((f"`distill`'s {what}, {entry['set']}"
                         + seeds_suffix(default.get("seeds", [0, 1, 2])),
                         f"{default['unread'][0]:.4f}: {default['minus_alone_unread'][0]:+.4f} "
                         f"against the student alone, {default['minus_kd_unread'][0]:+.4f} "
                         "against KD (paired)", "distillation-what-the-student-learns-from"))
    methods = {row["method"][0]: row for row in picked["pbt"]["results"]}
    gain = mean_std(differences(methods["c"]["report_accuracy"],
                                methods["a"]["report_accuracy"]))[0]
    rows.append(("`pbt` against the default hyperparameters, same member-epochs",
                 f"{methods['c']['report_mean']:.4f}: {gain:+.4f} (paired)",
                 "pbt-against-the-default-and-random-search"))
    peer = picked.get("pbt_peer")
    longer = [] if peer is None else longer_project_tools(peer["tools"])
    for tool, result in (("project", "`pbt` against Ray Tune's PBT, the same work on 2 cores "
                          "(test images)"), *((tool, f"`pbt` at {epochs} epochs a member against "
                                               "Ray's 8 (test images)")
                                              for tool, epochs in longer)):
        if peer is None or not {"ray", tool} <= set(peer["tools"]):
            continue
        mine, ray = peer["tools"][tool], peer["tools"]["ray"]
        seeds = [run["seed"] for run in mine["runs"]]
        short = f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} only)" \
            if len(seeds) < 3 else ""
        rows.append((result, f"{mine['test_mean']:.4f} against {ray['test_mean']:.4f}; "
                     f"{mine['seconds_mean']:.0f} s against {ray['seconds_mean']:.0f} s a run"
                     + short, "pbt-against-ray-tune"))
    flows = [r for r in picked["small_data"]["results"] if "flow" in r]
    held = {set_label(r): r["holdout_baselines"] for r in picked["small_data"]["results"]
            if "holdout_baselines" in r}
    margin = min(r["holdout_accuracy_mean"] - max(mean_std([b[k] for b in held[set_label(r)]])[0]
                                                  for k in ("knn", "linear"))
                 for r in flows if set_label(r) in held)
    rows.append(("every flow's defaults on two sets no default was tuned on",
                 f"above both raw-pixel baselines by at least {margin:.4f}",
                 "defaults-on-data-no-default-was-tuned-on"))
    if picked["faults"] is not None:
        trials = picked["faults"]["trials"]
        rows.append((f"kill -9 at random moments, {len(trials)} trials over "
                     f"{len({t['flow'] for t in trials})} flows, then the same command",
                     f"{picked['faults']['passed']} of {len(trials)} reruns whole: one "
                     "version each, no half-written file, locks free", "faults-kill--9-then-rerun"))
    lines = ["| result | measured (accuracy: on the unread images) | table |",
             "| --- | --- | --- |"]
    lines += [f"| {what} | {figure} | [table](docs/benchmarks.md#{anchor}) |"
              for what, figure, anchor in rows]
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[dict], str]] = {"image_text": image_text, "cascade": cascade,
                                               "pipeline": pipeline, "pbt": pbt,
                                               "small_data": small_data,
                                               "train_accuracy": train_accuracy,
                                               "sparsify": sparsify,
                                               "inference_batch": inference_batch,
                                               "area_rule": area_rule,
                                               "descriptions": descriptions,
                                               "distill_bank": distill_bank,
                                               "distill_targets": distill_targets,
                                               "serving": serving, "faults": faults,
                                               "layout": layout, "pbt_peer": pbt_peer,
                                               "inputs": inputs,
                                               "allocator": allocator,
                                               "summary": summary_table}


PICKERS: dict[str, Callable[[str, Path], dict]] = {"pipeline": newest_of_defaults,
                                                   "sparsify": newest_per_task,
                                                   "distill_targets": merged_variants_per_set,
                                                   "pbt_peer": merged_pbt_peer,
                                                   "cascade": newest_per_set,
                                                   "descriptions": newest_per_variant,
                                                   "small_data": newest_per_flow,
                                                   "summary": lambda _name, results: summary(
                                                       results)}


def render(name: str, results: Path = RESULTS) -> str:
    """The README table of benchmark `name` from its newest record (`PICKERS`: or from the
    records it names)."""
    if name not in RENDERERS:
        raise KeyError(f"no README table for {name!r}; known: {', '.join(RENDERERS)}")
    return RENDERERS[name](PICKERS.get(name, newest)(name, results))


def readme_tables(text: str) -> dict[str, str]:
    """Each generated table in a README's text, by benchmark name."""
    return {match["name"]: match["body"] for match in BLOCK.finditer(text)}


def document_of(name: str, documents: tuple[Path, ...] = DOCUMENTS) -> Path:
    """The document (README.md or docs/benchmarks.md) holding benchmark `name`'s block."""
    for document in documents:
        if name in readme_tables(document.read_text()):
            return document
    raise KeyError(f"no `<!-- table: {name} -->` block in "
                   f"{', '.join(str(d.relative_to(ROOT)) for d in documents)}")


def write(name: str) -> Path:
    """Replaces benchmark `name`'s table in its document with the one its records give."""
    document = document_of(name)
    text, table = document.read_text(), render(name)
    document.write_text(BLOCK.sub(lambda m: m.group(0) if m["name"] != name else
                                  f"<!-- table: {name} -->\n{table}<!-- /table -->", text))
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(RENDERERS))
    parser.add_argument("--write", action="store_true",
                        help="replace it in README.md or docs/benchmarks.md, where its block is")
    args = parser.parse_args()
    print(render(args.name), end="")
    if args.write:
        print(f"(written to {write(args.name).relative_to(ROOT)})")


if __name__ == "__main__":
    main()
