"""models/ and training/ stay free of Prefect, MLflow and DVC, and serving/ (what a registered
model ships) of Prefect, DVC, tasks/ and flows/: arrows point down (DESIGN.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "mlflow", "dvc", "tasks", "flows"}
SERVING_FORBIDDEN = FORBIDDEN - {"mlflow"}  # a pyfunc is an MLflow class


@pytest.mark.parametrize(("package", "forbidden"), [("models", FORBIDDEN),
                                                    ("training", FORBIDDEN),
                                                    ("serving", SERVING_FORBIDDEN)])
def test_pure_packages_import_no_pipeline_modules(package, forbidden):
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in forbidden]
    assert offenders == []


def test_importing_pure_packages_loads_no_pipeline_module():
    code = ("import sys, models, training.loops, training.datasets, training.batches, "
            "training.features, training.preprocess; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            f"set({sorted(FORBIDDEN)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"
