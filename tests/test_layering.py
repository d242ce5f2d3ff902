"""models/ and training/ stay free of Prefect, MLflow and DVC (DESIGN.md: arrows point down)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "mlflow", "dvc", "tasks", "flows"}


@pytest.mark.parametrize("package", ["models", "training"])
def test_pure_packages_import_no_pipeline_modules(package):
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_pure_packages_loads_no_pipeline_module():
    code = ("import sys, models, training.loops, training.datasets, training.batches, "
            "training.features, training.preprocess; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            f"set({sorted(FORBIDDEN)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"
