"""The registry lock (`tasks.adapters.locks`): a lease held in MLflow itself, so that runs on
machines sharing nothing but the MLflow server take turns; it expires when its holder dies and
can be removed by hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tasks.adapters import tracking
from tasks.adapters.aliases import CHAMPION, moves
from tasks.adapters.locks import Lease, LockBusy, LockLost, RegistryLease, read_lease
from tests.conftest import free_port, start_mlflow_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 with its own SQLite store (the server that
    two machines of a team would share); its URI."""
    server, uri = start_mlflow_server(tmp_path, free_port())
    try:
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_two_processes_sharing_only_the_mlflow_server_leave_the_best_model_champion(
        mlflow_server, tmp_path, monkeypatch):
    """Two processes, each with its own Prefect home and no Prefect server between them,
    make 20 overlapping promotions of versions of known quality (10 each; each process's
    models get better, as nightly retraining's do, so both keep trying to crown at once).
    However they interleave, every crowning beats the champion it replaced, the final
    champion is the best version, and the move history holds every crowning. Without the
    lock, two crownings read the same champion and the worse one may land last, and two
    moves get the same record number."""
    qualities = [round(0.50 + 0.02 * i, 2) for i in range(20)]  # 8 images apart on 400: p<.05
    name = "raced-across-processes"
    outs = [tmp_path / f"worker-{n}.json" for n in range(2)]
    workers = []
    for n, out in enumerate(outs):
        env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server,
               "PREFECT_HOME": str(tmp_path / f"prefect-{n}"),
               "COMPACTML_REGISTRY_SETTLE_SECONDS": "0.1"}  # over HTTP: 20 ms a write
        env.pop("PREFECT_API_URL", None)
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "tests.registry_worker", name, str(out),
             *map(str, qualities[n::2])], cwd=ROOT, env=env, stderr=subprocess.PIPE,
            text=True))
    for worker in workers:
        _, errors = worker.communicate(timeout=400)
        assert worker.returncode == 0, errors[-3000:]
    results = [r for out in outs for r in json.loads(out.read_text())]
    assert len(results) == 20 and len({r["version"] for r in results}) == 20

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    quality = {r["version"]: r["quality"] for r in results}
    assert tracking.alias_version(name, CHAMPION) == max(quality, key=quality.get)
    crowned = [move.version for move in moves(name)]
    assert sorted(crowned) == sorted(r["version"] for r in results if r["alias"] == CHAMPION)
    assert all(quality[a] < quality[b] for a, b in zip(crowned, crowned[1:], strict=False))
    assert read_lease(name) is None


def test_a_lease_is_exclusive_checked_before_writes_and_expires_when_its_holder_dies(tmp_path):
    name = "leased"
    holder = RegistryLease(name, "test holder", lease_seconds=30, settle_seconds=0.05)
    holder.acquire()
    with pytest.raises(LockBusy, match="test holder") as waited:
        RegistryLease(name, "waiter", settle_seconds=0.05).acquire(wait_seconds=1)
    assert "registry unlock" in str(waited.value)
    holder.check()
    tracking.delete_model_tag(name, "registry.lock")  # as `flows registry unlock` does
    with pytest.raises(LockLost):
        holder.check()
    holder.release()

    # a holder killed with -9 on this machine: its lease is taken at once (its process is
    # gone); one held on another machine stops renewing and expires by itself
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from tasks.adapters.locks import RegistryLease\n"
         f"RegistryLease({name!r}, 'doomed', lease_seconds=600, settle_seconds=0.05).acquire()\n"
         "print('held', flush=True)\ntime.sleep(600)"],
        cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    child.kill()
    child.wait()
    assert read_lease(name).purpose == "doomed"
    heir = RegistryLease(name, "heir", settle_seconds=0.05)
    heir.acquire(wait_seconds=5)  # (its lease had 600 s left)
    assert read_lease(name).token == heir.token
    heir.release()
    assert read_lease(name) is None

    elsewhere = Lease(token="t", owner="another-machine:1", purpose="remote", acquired=time.time(),
                      expires=time.time() + 3)
    tracking.set_model_tag(name, "registry.lock", json.dumps(asdict(elsewhere)))
    started = time.monotonic()
    heir = RegistryLease(name, "heir", settle_seconds=0.05)
    heir.acquire(wait_seconds=60)
    assert 1.0 < time.monotonic() - started < 30
    heir.release()


def test_one_run_per_registered_model_at_a_time_from_any_entry_point(monkeypatch):
    """The run slot: a flow run that registers model M holds M's slot for its whole length; a
    second one waits for it (and one that does not register never does); a flow whose slot
    stays taken fails naming the holder, before it opens an MLflow run."""
    import threading

    from flows.skeleton import tracked_flow_run
    from flows.train import train
    from tasks.adapters import locks
    from tests.conftest import smoke

    name = "one-run-at-a-time"
    config = smoke(model_name=name, registry=True)
    held, release, spans = threading.Event(), threading.Event(), {}

    def first() -> None:
        with tracked_flow_run(config, "slot-test", "first", name):
            held.set()
            release.wait(60)
            spans["first_done"] = True  # (still inside: the slot is released after this)

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(30)
    assert read_lease(name, locks.RUN_TAG).purpose.startswith("first")
    with tracked_flow_run(config.replace(registry=False), "slot-test", "unregistered", name):
        # it runs while the first still holds the slot: a run that registers nothing never waits
        assert read_lease(name, locks.RUN_TAG).purpose.startswith("first")
    threading.Timer(0.5, release.set).start()  # the first ends while the second waits
    with tracked_flow_run(config, "slot-test", "second", name):
        assert spans.get("first_done")  # it began only after the first had ended
    thread.join()
    assert read_lease(name, locks.RUN_TAG) is None

    # a real flow whose slot another run holds (its purpose says where it runs)
    holder = RegistryLease(name, "nightly on another machine", lease_seconds=30,
                           settle_seconds=0.05, tag=locks.RUN_TAG)
    holder.acquire()
    monkeypatch.setattr(locks, "RUN_WAIT_SECONDS", 1.0)

    def runs() -> int:
        import mlflow

        return len(mlflow.search_runs(search_all_experiments=True,
                                      filter_string=f"params.model_name = '{name}'"))

    before = runs()
    try:
        with pytest.raises(LockBusy, match=r"run slot .*\(nightly on another machine\)"):
            train(config)
    finally:
        holder.release()
    assert before == 3 and runs() == before  # the three above; the flow opened none


def test_registry_unlock_and_status_from_the_command_line(capsys):
    from flows.cli import main
    from flows.commands import COMMANDS

    name = "stuck"
    stuck = RegistryLease(name, "a crashed run", lease_seconds=3600, settle_seconds=0.05)
    stuck.acquire()
    main(COMMANDS, ["registry", "status", name])
    assert "held by" in capsys.readouterr().out
    main(COMMANDS, ["registry", "unlock", name])
    assert "removed the lock" in capsys.readouterr().out and read_lease(name) is None
    stuck.release()
