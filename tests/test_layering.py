"""models/ and training/ stay free of Prefect, MLflow and DVC, and serving/ (what a registered
model ships) of Prefect, DVC, tasks/ and flows/: arrows point down, nothing imports in a circle, no
technique package imports a sibling, and the pipeline composes the techniques through their steps
(flows/steps/), never through a sibling flow (docs/architecture.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "mlflow", "dvc", "tasks", "flows"}
SERVING_FORBIDDEN = FORBIDDEN - {"mlflow"}  # a pyfunc is an MLflow class
PACKAGES = {"models", "training", "tasks", "serving", "flows", "bench"}


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


def import_graph() -> dict[str, set[str]]:
    """Each project module (the benchmarks' too) and the project modules it imports (anywhere in
    the file), without its own enclosing packages (importing `models.registry` from
    `models.cnn` runs `models` first: that is nesting, not a circle)."""
    from tasks.adapters.caching import CODE_PACKAGES, imported_names

    files = {}
    for package in (*CODE_PACKAGES, "bench"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {n for n in imported_names(path) if n in files} - enclosing - {name}
    return graph


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    circles = []
    for start in graph:  # a path from each module back to itself, depth first
        stack, seen = [(start, [start])], set()
        while stack:
            name, path = stack.pop()
            for nxt in graph[name]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert circles == []


TECHNIQUES = ("distill", "pbt", "sparsify", "cascade", "image_text", "canvas")


def test_no_technique_package_imports_a_sibling():
    graph = import_graph()
    crossings = []
    for name, imported in graph.items():
        parts = name.split(".")
        if parts[0] != "training" or len(parts) < 2 or parts[1] not in TECHNIQUES:
            continue
        crossings += [f"{name} -> {other}" for other in imported
                      if other.split(".")[:1] == ["training"] and len(other.split(".")) > 1
                      and other.split(".")[1] in TECHNIQUES and other.split(".")[1] != parts[1]]
    assert crossings == []


SHARED_FLOWS = {"flows.skeleton", "flows.cli", "flows.commands"}  # every flow's common parts


def test_flows_import_from_one_another_only_what_each_flow_offers():
    """A flow, a step (flows/steps/) or a benchmark uses another flow module, or a technique's
    step module, through what it lists in `__all__` (the flow and its summary; the step),
    never through its internals."""
    import importlib

    offenders = []
    for path in [*(ROOT / "flows").rglob("*.py"), *(ROOT / "bench").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("flows.")) or node.module in SHARED_FLOWS:
                continue
            offered = importlib.import_module(node.module).__all__
            offenders += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name not in offered]
    assert offenders == []


STEPS = ("distill", "pbt", "image_text", "sparsify")  # the techniques the pipeline composes


def test_the_pipeline_imports_no_sibling_flow():
    """Each technique's step (`flows.steps.<technique>`) is the one function its own flow and
    the pipeline both call: flows/pipeline.py imports, of flows/, only the steps and the shared
    skeleton, and a step only the skeleton, so the pipeline reaches no sibling flow through
    them either."""
    graph = import_graph()

    def flow_imports(module: str) -> set[str]:
        return {name for name in graph[module] if name.split(".")[0] == "flows"}

    pipeline = flow_imports("flows.pipeline")
    assert {f"flows.steps.{step}" for step in STEPS} <= pipeline
    offenders = [f"flows.pipeline -> {name}" for name in sorted(pipeline)
                 if name not in {"flows.skeleton", "flows.steps"}
                 and not name.startswith("flows.steps.")]
    for step in STEPS:
        assert f"flows.steps.{step}" in flow_imports(f"flows.{step}")  # its own flow's step
        offenders += [f"flows.steps.{step} -> {name}"
                      for name in sorted(flow_imports(f"flows.steps.{step}"))
                      if name != "flows.skeleton"]
    assert offenders == []



def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t)  # `A, B = ...` too
                      if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_name_a_benchmark_imports_from_the_project_exists():
    """The tests do not run the benchmarks, but what they import must exist: a renamed task,
    config or function breaks here, not in a night's run."""
    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module or \
                    node.module.split(".")[0] not in PACKAGES:
                continue
            target = ROOT / Path(*node.module.split("."))
            source = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
            defined = _top_level_names(source) | (
                {p.stem for p in target.iterdir()} if target.is_dir() else set())
            missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                        if a.name not in defined]
    assert not missing


def test_no_public_name_is_defined_on_two_floors():
    """A function or class name means one thing: `train_round` was both the recipe's loop
    (training/) and the Prefect task around it (tasks/). `main` is every entry point's."""
    where: dict[str, set[str]] = {}
    for floor in ("models", "training", "serving", "tasks", "flows"):
        for path in (ROOT / floor).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                        and not node.name.startswith("_") and node.name != "main":
                    where.setdefault(node.name, set()).add(floor)
    assert {name: sorted(floors) for name, floors in where.items() if len(floors) > 1} == {}


def test_inside_tasks_adapters_and_configs_import_only_downwards():
    """tasks/'s lower floors: configs/ import only configs and the environment; adapters/ also
    configs, never a task module (registration read the data sets through tasks.data:
    `tasks.promotion` does that now)."""
    allowed = {"tasks.configs": ("tasks.configs", "tasks.environment"),
               "tasks.adapters": ("tasks.adapters", "tasks.configs", "tasks.environment")}
    upward = [f"{name} -> {other}" for name, imported in import_graph().items()
              for floor, below in allowed.items() if name.startswith(floor + ".")
              for other in imported if other.startswith("tasks.")
              and not other.startswith(below)]
    assert upward == []
