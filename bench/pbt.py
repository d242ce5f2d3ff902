"""PBT against the default hyperparameters and random search, at the same member-epochs.

For each seed, N members (the `pbt` config's `members`) each train E = burn_in_rounds + stages x
stage_rounds rounds of the flow's budget (`repeats` passes each, the same for every method), so
every method spends the same member-epochs:

(a) default: N members with the default hyperparameters (different seeds), the best on the
    validation split kept;
(b) random search: N independent members, each with its own hyperparameters drawn from the
    `pbt` config's search space (stratified, as PBT's stage 1 draws them), the best kept;
(c) PBT: the `pbt` flow itself.

Each method's final model is scored on Fashion-MNIST's official test images (some PBT variants
were chosen on them in earlier sessions) and on 10,000 report images no choice ever read
(`bench.report_set`), side by side.

(a) and (b) train through the flow's own member round (`MemberRound`: the same data, batches,
augmentation, cosine schedule over E rounds, gradient clipping, divergence check and weight
average, the budget fitted to the data) and are tested by the flow's `test_and_export`, on the
weights PBT exports (the better of the last weights and the average on validation); a member
that diverges is reported as failed.

Also measured, in one run: the wall time of one PBT stage of 2 members on a Dask LocalCluster
of 2 worker processes against 1 worker, 1 thread per member in both (a worker holds one core,
as it would hold one GPU), after a first stage that warms each cluster up (imports, data).

    python -m bench.pbt                      # quick profile (lenet), seeds 0-2: about 35 min
    python -m bench.pbt --no-timing --set train_limit=10000     # docs/pbt.md's setting (cnn3 then)
    python -m bench.pbt --no-timing --methods c --seeds 0          # one PBT run
    python -m bench.pbt --no-accuracy        # the stage timing only: 3 min
"""

from __future__ import annotations

import argparse
import os
import random
import time

from prefect import flow
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from bench.common import mean_std, print_json, print_table
from bench.report_set import REPORT_IMAGES, ReportSet
from flows.pbt import pbt
from flows.skeleton import prepare
from tasks.adapters import tracking
from tasks.adapters.runners import task_runner
from tasks.configs.pbt import PBTConfig
from tasks.configs.sections import classifier_config
from tasks.data import DatasetRef
from tasks.pbt import (
    HYPERPARAMETERS,
    SCORED_WEIGHTS,
    MemberRound,
    member_config,
    member_round,
)
from tasks.training import run_key, test_and_export
from training.budget import fit_to_data
from training.pbt.scheduler import best_member, initial_hyperparameters, search_spaces

METHODS = ("a: default", "b: random search", "c: PBT")


@flow(name="bench-pbt-search")
def independent_members(config: PBTConfig, method: str) -> tuple[float | str, dict, tuple]:
    """(a) or (b): N members trained E rounds each with fixed hyperparameters; the best on
    validation is tested. Returns its test accuracy (or why all failed), its values and what
    scores it elsewhere (its classifier config, data set and checkpoint; empty if none)."""
    with tracking.tracked_run("bench-pbt", f"{method}-seed{config.run.seed}", config, {}) as run_id:
        dataset = prepare(config, run_id).dataset
    rounds = config.burn_in_rounds + config.stages * config.stage_rounds
    budget = fit_to_data(config, dataset, rounds)  # the flow's budget: same batch and passes
    base = classifier_config(config).replace(batch_size=budget.batch_size)
    epochs = rounds * budget.repeats
    defaults = {name: getattr(base.optim, name) for name in HYPERPARAMETERS}
    if method == METHODS[0]:
        drawn = [defaults] * config.members
    else:
        drawn = [defaults | values for values in initial_hyperparameters(
            search_spaces(config), config.members, random.Random(config.run.seed))]
    population = f"{run_key(config, dataset)}-{method[0]}"
    results = []
    for member, values in enumerate(drawn):
        try:
            results.append(member_round(MemberRound(
                config=member_config(base, member, values), dataset=dataset,
                population=population, member=member, phase="search", index=1,
                first_epoch=0, epochs=epochs, cycle=(0, epochs),
                average_decay=config.average_decay)))
        except Exception as error:  # a diverged member: reported, the others go on
            print(f"{method} seed {config.run.seed} member {member} failed: {error}", flush=True)
            results.append(None)
    scores = [r.metrics["val_accuracy"] if r else None for r in results]
    if all(s is None for s in scores):
        return "FAILED", {}, ()
    best = best_member(scores)
    chosen = member_config(base, best, drawn[best])
    test = test_and_export(chosen, dataset, results[best].checkpoint, SCORED_WEIGHTS)
    print(f"{method} seed {config.run.seed}: best member {best}, validation {scores[best]:.4f}, "
          f"test {test.metrics['test_accuracy']:.4f}", flush=True)
    return test.metrics["test_accuracy"], drawn[best], (chosen, dataset,
                                                         results[best].checkpoint)


@flow(name="bench-pbt-stage")
def timed_stages(config: PBTConfig, dataset: DatasetRef, rounds: int) -> list[float]:
    """Wall time of `rounds` stages of all members submitted together to the flow's runner."""
    base = classifier_config(config.replace(threads=1))
    population = f"timing-{config.cluster.dask_workers}"
    values = {name: getattr(base.optim, name) for name in HYPERPARAMETERS}
    seconds, previous = [], [None] * config.members
    for index in range(rounds):
        started = time.perf_counter()
        futures = [member_round.submit(MemberRound(
            config=member_config(base, m, values), dataset=dataset, population=population,
            member=m, phase="timing", index=index, first_epoch=index, epochs=1,
            cycle=(0, rounds), average_decay=config.average_decay), previous[m])
            for m in range(config.members)]
        previous = [f.result().checkpoint for f in futures]
        seconds.append(time.perf_counter() - started)
    return seconds


def stage_speedup(config: PBTConfig) -> dict:
    """One stage of 2 members on 2 Dask workers against 1 worker (second stage of each)."""
    config = config.replace(members=2, runner="dask", threads=1)
    with tracking.tracked_run("bench-pbt", "timing", config, {}) as run_id:
        dataset = prepare(config, run_id).dataset
    seconds = {}
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        for workers in (1, 2):
            cluster = config.replace(dask_workers=workers)
            runner = task_runner(cluster.cluster, cluster.run.device)
            stages = timed_stages.with_options(task_runner=runner)(cluster, dataset, 2)
            seconds[workers] = stages[-1]
    return {"one_worker_s": seconds[1], "two_workers_s": seconds[2],
            "speedup": seconds[1] / seconds[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=["smoke", "quick", "full"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"],
                        help="which of the three methods to run")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="compare the three methods (the long part)")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                        help="time a 2-member stage on 2 Dask workers against 1")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="pbt config overrides for every run, e.g. members=8")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)

    def config_for(seed: int) -> PBTConfig:
        return PBTConfig(**{"profile": args.profile, "seed": seed, "progress": False,
                            "model_name": "bench-pbt", **overrides})

    accuracy: dict[str, list] = {method: [] for method in METHODS}
    reported: dict[str, list] = {method: [] for method in METHODS}
    chosen: dict[str, list] = {method: [] for method in METHODS}
    config = config_for(args.seeds[0])
    report = ReportSet(config.dataset, 500 if args.profile == "smoke" else
                       REPORT_IMAGES) if args.accuracy else None
    for seed in args.seeds if args.accuracy else []:
        config = config_for(seed)
        for method in [m for m in METHODS[:2] if m[0] in args.methods]:
            score, values, scorable = independent_members(config, method)
            accuracy[method].append(score)
            chosen[method].append(values)
            reported[method].append(report.checkpoint_accuracy(*scorable, SCORED_WEIGHTS)
                                    if report and scorable else None)
        if "c" in args.methods:
            summary = pbt(config)
            accuracy[METHODS[2]].append(summary.test_accuracy)
            chosen[METHODS[2]].append(summary.population.hyperparameters)
            reported[METHODS[2]].append(report.served_accuracy(summary.registration.model_uri)
                                        if report else None)
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]}" for k, v in accuracy.items() if v),
              flush=True)
    rows, results = [], []
    for method, values in accuracy.items() if args.accuracy else []:
        if not values:
            continue
        ok = [v for v in values if isinstance(v, float)]
        mean, std = mean_std(ok) if ok else (float("nan"), 0.0)
        rows.append([method, f"{mean:.4f} ± {std:.4f}", " / ".join(
            f"{v:.4f}" if isinstance(v, float) else "FAILED" for v in values),
            len(values) - len(ok)])
        scored = [v for v in reported[method] if v is not None]
        report_mean, report_std = mean_std(scored) if scored else (None, None)
        rows[-1].insert(1, "-" if report_mean is None else f"{report_mean:.4f} ± {report_std:.4f}")
        results.append({"method": method, "test_accuracy": values, "mean": mean, "std": std,
                        "report_accuracy": reported[method], "report_mean": report_mean,
                        "report_std": report_std, "hyperparameters": chosen[method]})
    rounds = config.burn_in_rounds + config.stages * config.stage_rounds
    if rows:
        print(f"\n{config.members} members x {rounds} rounds of {config.network.model} on "
              f"{config.dataset.train_limit or 'all'} training images, per method and seed")
        print_table(["method", "report accuracy (never read)", "test accuracy (official)",
                     "per seed (test)", "failed"], rows)
    timing = None
    if args.timing:
        timing = stage_speedup(config)
        print("\none stage, 2 members x 1 epoch, 1 thread each: "
              f"1 Dask worker {timing['one_worker_s']:.1f} s, 2 workers "
              f"{timing['two_workers_s']:.1f} s: speed-up {timing['speedup']:.2f}x "
              f"({os.cpu_count()} cores)")
    print_json({"benchmark": "pbt", "profile": args.profile, "seeds": args.seeds,
                "report_images": len(report) if report else 0,
                "overrides": overrides, "members": config.members, "rounds_per_member": rounds,
                "results": results, "timing": timing})


if __name__ == "__main__":
    main()
