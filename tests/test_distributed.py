"""DDP with torchrun: 2 CPU processes (gloo) follow the one-process loss curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ddp_worker

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_give_the_loss_curve_of_one_with_the_same_global_batch(tmp_path):
    out = tmp_path / "ddp.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "tests.ddp_worker", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads(out.read_text())
    losses, weights, world = ddp_worker.run()
    assert two["world_size"] == 2 and world == 1
    assert two["losses"] == pytest.approx(losses, rel=1e-4)
    assert losses[-1] < losses[0]  # it learns
    assert two["weights"] == pytest.approx(weights, rel=1e-3, abs=1e-4)
