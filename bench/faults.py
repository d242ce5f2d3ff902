"""Kill -9 at a random moment, then the same command again: every flow survives.

Each trial runs one of the seven flows from the command line as a user does (`python -m flows
FLOW --profile smoke --register`, its own temporary Prefect server), kills its whole process
group with SIGKILL at a moment drawn uniformly over the flow's clean run time (measured once
per flow first, on a seed of its own), and runs the same command again. A trial passes when
the rerun ends with status 0 and leaves: exactly one registered version of its model; no
temporary file of ours and no half-written artifact in the artifact store (every `.dvc`
pointer's file has the bytes its pointer records); the registry lock and the model's run slot
free. Everything lives in stores of the campaign's own (a temporary folder: artifacts, DVC
remote, MLflow, Prefect), so the user's are untouched.

    python -m bench.faults                    # 20 trials over the seven flows, about 40 minutes
    python -m bench.faults --trials 7 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_json, print_table

ROOT = Path(__file__).resolve().parents[1]
FLOWS = ("train", "distill", "pbt", "sparsify", "cascade", "image-text", "pipeline")
LEASE_SECONDS = 10  # a killed holder's lease expires this long after its last heartbeat


def command(flow: str, seed: int) -> list[str]:
    """The command line of a trial: the flow's smoke profile, registering its model."""
    return [sys.executable, "-m", "flows", flow, "--profile", "smoke", "--register",
            "--seed", str(seed), "--model-name", f"faults-{flow}-{seed}"]


def run(args: list[str], env: dict[str, str], kill_after: float | None = None
        ) -> tuple[int | None, float]:
    """Runs `args`; with `kill_after`, SIGKILLs its process group that many seconds in (None
    as the status where it was killed). Returns the status and the seconds it ran."""
    started = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, time.perf_counter() - started
    return proc.returncode, time.perf_counter() - started


def leftovers(artifacts: Path) -> list[str]:
    """Temporary files of ours and artifacts whose bytes differ from their pointer's record."""
    from tasks.adapters.versioning import data_dvc_hash, md5_of

    found = [str(p.relative_to(artifacts)) for p in artifacts.rglob(".*")
             if p.is_file() and ".dvc" not in p.relative_to(artifacts).parts
             and p.name not in (".gitignore", ".dvcignore")]
    for pointer in artifacts.rglob("*.dvc"):
        if ".dvc" in pointer.relative_to(artifacts).parts[:-1] or not pointer.is_file():
            continue
        file = pointer.with_suffix("")
        if file.is_file() and md5_of(file) != data_dvc_hash(pointer):
            found.append(f"{file.relative_to(artifacts)} (bytes differ from its pointer)")
    return found


def checked(flow: str, seed: int) -> dict:
    """What a trial's rerun left in the registry: its versions, the lock and the run slot."""
    from tasks.adapters import tracking
    from tasks.adapters.locks import RUN_TAG, read_lease

    name = f"faults-{flow}-{seed}"
    return {"versions": len(tracking.model_versions(name)),
            "lock_free": read_lease(name) is None and read_lease(name, RUN_TAG) is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="of the kill moments and flows")
    parser.add_argument("--flows", nargs="+", default=list(FLOWS), choices=FLOWS)
    args = parser.parse_args()
    draw = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="compactml-faults-"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "COMPACTML_ARTIFACTS": str(home / "artifacts"),
        "COMPACTML_DVC_REMOTE": str(home / "dvc-remote"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db",
        "PREFECT_HOME": str(home / "prefect"),
        "COMPACTML_REGISTRY_LEASE_SECONDS": str(LEASE_SECONDS),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    os.environ.update(env)  # this process reads the same stores
    # every flow once, whole: how long a clean run takes (the kill moments' range)
    clean = {}
    for flow in args.flows:
        status, seconds = run(command(flow, 1000), env)
        if status != 0:
            raise SystemExit(f"the clean {flow} run failed with status {status}: "
                             f"{' '.join(command(flow, 1000))}")
        clean[flow] = seconds
        print(f"clean {flow}: {seconds:.0f} s", flush=True)
    order = [args.flows[n % len(args.flows)] for n in range(args.trials)]
    draw.shuffle(order)
    trials, rows = [], []
    for n, flow in enumerate(order, 1):
        seed = n
        moment = draw.uniform(0.05, 0.95) * clean[flow]
        before = set(leftovers(home / "artifacts"))  # an earlier trial's are not this one's
        killed, _ = run(command(flow, seed), env, kill_after=moment)
        status, seconds = run(command(flow, seed), env)
        trial = {"flow": flow, "seed": seed, "kill_after_s": round(moment, 1),
                 "killed": killed is None, "rerun_status": status,
                 "rerun_seconds": round(seconds, 1), **checked(flow, seed),
                 "leftovers": sorted(set(leftovers(home / "artifacts")) - before)}
        trial["passed"] = (status == 0 and trial["versions"] == 1 and trial["lock_free"]
                           and not trial["leftovers"])
        trials.append(trial)
        rows.append([n, flow, f"{moment:.1f} s of {clean[flow]:.0f}",
                     "killed" if trial["killed"] else "had ended", status,
                     trial["versions"], "free" if trial["lock_free"] else "HELD",
                     len(trial["leftovers"]), "pass" if trial["passed"] else "FAIL"])
        print(f"trial {n} {flow}: {trial}", flush=True)
    print_table(["trial", "flow", "killed at", "kill", "rerun status", "versions", "lock",
                 "leftovers", "result"], rows)
    passed = sum(t["passed"] for t in trials)
    print(f"\n{passed} of {len(trials)} trials passed; "
          f"{sum(t['killed'] for t in trials)} were killed mid-run")
    print_json({"benchmark": "faults", "seed": args.seed, "clean_seconds": clean,
                "trials": trials, "passed": passed})


if __name__ == "__main__":
    main()
