"""One of two processes that promote versions of one registered model at once (see
test_registry_lock.py).

`python -m tests.registry_worker NAME OUT.json Q1 Q2 ...` promotes, one after the other, a
version of known quality Qi (`tests.known_quality`) of registered model NAME on the MLflow
server of MLFLOW_TRACKING_URI, scoring slowly so that the other process's promotions
overlap; writes each promotion's version, alias and decision to OUT.json. It shares nothing
with the other process but that server: its own PREFECT_HOME, no Prefect server.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

from tasks.adapters import tracking
from tasks.adapters.registration import Policy, promote
from tests.known_quality import known


def promote_one(name: str, quality: float, rng: random.Random) -> dict:
    """Logs a stand-in model on a new run and promotes it as a version of quality `quality`."""
    run_id = tracking.start_run("registry-race", f"q{quality}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "MLmodel"
        path.write_text(f"quality {quality}\n")
        tracking.log_file(run_id, path, "model")
    uri = f"runs:/{run_id}/model"

    def score(model_uri: str):
        time.sleep(rng.uniform(0.05, 0.3))  # scoring takes a while: the other one moves on
        if model_uri == uri:
            return known(quality)
        return known(float(tracking.version_tags(name, model_uri.rsplit("/", 1)[1])["quality"]))

    registration = promote(run_id, name, uri, score, ["a", "b"], run_id,
                           {"quality": str(quality)}, Policy(), parameters=lambda _uri: 1000)
    tracking.end_run(run_id)
    return {"quality": quality, "version": registration.version, "alias": registration.alias,
            "decision": registration.decision}


def main(argv: list[str]) -> None:
    name, out, qualities = argv[0], Path(argv[1]), [float(q) for q in argv[2:]]
    rng = random.Random(out.name)
    results = [promote_one(name, quality, rng) for quality in qualities]
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
