"""The project's environment: offline settings and the paths every part agrees on.

`project.env` at the project root is the single source of the settings that keep Prefect,
MLflow and DVC from calling home and keep their state inside the project. The Makefile includes
the same file, so the command line, the flows and the tests see the same values. A variable
already present in the environment always wins.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = PROJECT_ROOT / "project.env"


def read_env_file(path: Path = ENV_FILE, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """Parses `KEY ?= VALUE` lines (comments and blanks skipped), expanding `${ROOT}`."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("?=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{path}:{number}: expected KEY ?= VALUE, got {raw!r}")
        values[key.strip()] = value.strip().replace("${ROOT}", str(root))
    return values


def apply_project_env() -> None:
    """Sets every variable of `project.env` that the environment does not set already."""
    if ENV_FILE.exists():
        for key, value in read_env_file().items():
            os.environ.setdefault(key, value)


# What an MLflow name made here may hold (registered models, experiments, their prefix).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def safe_name(text: str) -> str:
    """`text` with every character a name may not hold replaced by `-` (`NAME`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text).lstrip("-_.")


DEFAULT_PROJECT = "compactml"  # when neither the environment nor project.env names one


def default_project() -> str:
    """The prefix of MLflow experiment names and of the flows' default model names when a
    config gives none: `COMPACTML_PROJECT`, committed in project.env (empty: no prefix). Never
    the folder's name: every clone of the project writes to the same names."""
    return os.environ.get("COMPACTML_PROJECT", DEFAULT_PROJECT)


def data_dir() -> Path:
    """Where the default data sets live (`COMPACTML_DATA_DIR`, default `<root>/data`)."""
    return Path(os.environ.get("COMPACTML_DATA_DIR", PROJECT_ROOT / "data"))


def artifacts_dir() -> Path:
    """The artifact store (`COMPACTML_ARTIFACTS`, default `<root>/artifacts`)."""
    return Path(os.environ.get("COMPACTML_ARTIFACTS", PROJECT_ROOT / "artifacts"))


def seconds_setting(name: str, default: float) -> float:
    """The positive number of seconds the environment variable `name` holds (`default` where
    it is unset); a ValueError names the variable and its value where it is not one."""
    value = os.environ.get(name)
    if value is None:
        return float(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds
