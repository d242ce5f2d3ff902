"""The CUDA path through the real flows, where a GPU is at hand (`make gpu-check`).

Every flow's smoke profile on CUDA (bf16 autocast, channels_last: what `--device cuda` turns
on), `pipeline` included, each registered under the project `gpu-check` and checked for a
registered version that scores above chance on the test split; `train --ddp-procs 2` with nccl
(where two or more GPUs are present: nccl runs one rank per GPU); `pbt --runner dask` with one
Dask worker per GPU; then `bench.throughput --full` on the GPU (the flow's training step
against a bare loop in the same process). Each flow runs as a user would run it, in its own
process. Without a GPU it prints one line and exits 0.

    make gpu-check                  # or: python -m bench.gpu_check [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from bench.common import ROOT, print_json, print_table

PROJECT = "gpu-check"
SMOKE = ("--profile", "smoke", "--register", "--no-progress", "--project", PROJECT)
FLOWS = ("train", "distill", "pbt", "sparsify", "cascade", "image-text", "pipeline")


def checks(gpus: int, device: str, only: list[str] | None) -> list[tuple[str, list[str]]]:
    """(what, the flow's command-line arguments) of every check this machine can run
    (`only`: those whose name starts with one of these)."""
    smoke = [*SMOKE, "--device", device]
    runs = [(flow, [flow, *smoke, "--model-name", flow]) for flow in FLOWS]
    runs.append(("pbt on Dask, a worker per GPU",
                 ["pbt", *smoke, "--runner", "dask", "--model-name", "pbt-dask"]))
    if gpus >= 2:
        runs.append(("train, DDP on 2 GPUs (nccl)",
                     ["train", *smoke, "--ddp-procs", "2", "--model-name", "train-ddp"]))
    return [run for run in runs if only is None or run[0].startswith(tuple(only))]


def versions(name: str) -> dict[str, tuple[str, str]]:
    """The registered versions of `name` in the project: version -> (model URI, run id)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.configs.sections import qualified

    full = qualified(PROJECT, name)
    try:
        found = MlflowClient().search_model_versions(f"name='{full}'")
    except MlflowException:
        return {}
    return {v.version: (f"models:/{full}/{v.version}", v.run_id) for v in found}


def registered_accuracy(name: str, before: set[str]) -> tuple[str, float] | None:
    """The newest version of `name` that was not there `before`, and its run's test
    accuracy; None when the check registered nothing."""
    from mlflow import MlflowClient

    new = {v: found for v, found in versions(name).items() if v not in before}
    if not new:
        return None
    uri, run_id = new[max(new, key=int)]
    return uri, MlflowClient().get_run(run_id).data.metrics.get("test_accuracy", float("nan"))


def run_check(what: str, args: list[str], chance: float) -> dict:
    """One flow in its own process; passes when it exits 0 and registers a version above
    chance."""
    name = args[args.index("--model-name") + 1]
    before = set(versions(name))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows", *args], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    found = registered_accuracy(name, before) if done.returncode == 0 else None
    result = {"check": what, "command": "python -m flows " + " ".join(args),
              "exit_code": done.returncode, "seconds": seconds,
              "model": None if found is None else found[0],
              "test_accuracy": None if found is None else found[1]}
    result["passed"] = found is not None and found[1] > chance
    if not result["passed"]:
        result["output_tail"] = (done.stdout + done.stderr)[-3000:]
    return result


def throughput() -> dict:
    """`bench.throughput --full` in its own process; its JSON line."""
    done = subprocess.run([sys.executable, "-m", "bench.throughput", "--full", "--rounds", "3"],
                          cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"passed": False, "output_tail": (done.stdout + done.stderr)[-3000:]}
    return {"passed": True, **json.loads(lines[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="the checks whose name "
                        "starts with one of these (train, pbt, ...)")
    parser.add_argument("--device", default="cuda", help="cpu: try the checks' plumbing here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: skipped, no CUDA GPU on this machine (torch.cuda.is_available() is "
              "False)")
        return
    gpus = torch.cuda.device_count()
    chance = 1 / 10  # Fashion-MNIST, what the smoke profiles train on
    results = [run_check(what, flow_args, chance)
               for what, flow_args in checks(gpus, args.device, args.only)]
    print_table(["check", "exit", "registered", "test accuracy", "seconds", "passed"], [
        [r["check"], r["exit_code"], r["model"] or "-",
         "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}",
         f"{r['seconds']:.0f}", "yes" if r["passed"] else "NO"] for r in results])
    for r in results:
        if not r["passed"]:
            print(f"\n--- {r['check']} failed: {r['command']}\n{r['output_tail']}")
    if gpus < 2 and args.device == "cuda":
        print("\nDDP with nccl: skipped, one GPU here (nccl runs one rank per GPU)")
    bench = None if args.skip_throughput else throughput()
    if bench is not None:
        print("\nbench.throughput --full:", json.dumps(bench.get("results", bench))[:2000])
    print_json({"benchmark": "gpu_check", "device": torch.cuda.get_device_name(0) if gpus
                else args.device,
                "gpus": gpus, "checks": results, "throughput": bench,
                "passed": all(r["passed"] for r in results)
                and (bench is None or bench["passed"])})
    if not all(r["passed"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
