"""`python -m flows serve NAME`: MLflow's scoring server on the champion, following the alias.

`mlflow models serve -m models:/NAME@champion` resolves the alias once, at start, and serves
that version until it is stopped: the registry can crown a new champion at 03:00 and the
server goes on answering with the old one. This command runs `mlflow models serve` on the
version the alias names (a child process), reads the alias again every `poll_seconds`, and
when it has moved, stops the child and starts one on the new champion on the same port: a gap
of a few seconds (the new server's start) in which requests are refused, no request answered
by a model that is no longer champion after the switch. It prints one line per version it
serves. SIGTERM or Ctrl-C stops the child too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from tasks.adapters import tracking
from tasks.adapters.aliases import CHAMPION
from tasks.configs.sections import Project, StrictConfig, model_name_of, project_field

MLFLOW = Path(sys.executable).with_name("mlflow")


class ServeConfig(StrictConfig):
    """`python -m flows serve NAME`."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("name",)
    name: str = Field(min_length=1, description="the registered model, as the MLflow UI shows "
                      "it (PROJECT-NAME with --project)")
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(5001, ge=1, le=65535, description="the port to listen on")
    poll_seconds: float = Field(30.0, gt=0.0, le=86_400.0, description="how often the "
                                "champion alias is read again")
    project: Project = project_field()

    def registered_name(self) -> str:
        """`name` as given, or PROJECT-NAME with a `project`."""
        return model_name_of(self.project, self.name, self.name)


def _start(name: str, version: str, host: str, port: int) -> subprocess.Popen:
    """`mlflow models serve` on version `version` of `name`, in a process group of its own."""
    return subprocess.Popen(
        [str(MLFLOW), "models", "serve", "-m", f"models:/{name}/{version}", "--env-manager",
         "local", "--host", host, "--port", str(port)],
        env=os.environ | {"PATH": f"{MLFLOW.parent}{os.pathsep}{os.environ['PATH']}"},
        start_new_session=True)


def _stop(server: subprocess.Popen | None) -> None:
    """Stops the server and its workers (SIGTERM, then SIGKILL after 20 s)."""
    if server is None or server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def follow_champion(config: ServeConfig) -> None:
    """Serves the champion of `config`'s model until stopped (the module docstring)."""
    name = config.registered_name()
    served: str | None = None
    server: subprocess.Popen | None = None
    try:
        while True:
            champion = tracking.alias_version(name, CHAMPION)
            if champion is None and served is None:
                raise SystemExit(f"error: {name} has no champion to serve (python -m flows "
                                 f"registry {name} lists its versions)")
            if champion is not None and champion != served:
                _stop(server)
                server = _start(name, champion, config.host, config.port)
                print(f"serving models:/{name}/{champion} (champion"
                      + (f", was version {served}" if served else "")
                      + f") on http://{config.host}:{config.port}", flush=True)
                served = champion
            if server.poll() is not None:
                raise SystemExit(f"error: mlflow models serve for models:/{name}/{served} "
                                 f"exited with status {server.returncode}")
            time.sleep(config.poll_seconds)
    finally:
        _stop(server)
