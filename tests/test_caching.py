"""Cache keys cover exactly the code that decides a task's result (`tasks.adapters.caching`)."""

from __future__ import annotations

from pathlib import Path

import torch

from tasks.adapters.caching import code_closure, code_version, library_versions
from tasks.environment import PROJECT_ROOT


def write(root: Path, name: str, text: str = "") -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def tree(root: Path) -> None:
    """tasks/a.py imports training.x inside a function and models at the top; training/y.py
    is imported by nothing tasks/a.py reaches."""
    for package in ("tasks", "training", "models", "flows"):
        write(root, f"{package}/__init__.py")
    write(root, "tasks/a.py", "import models.net\n\ndef f():\n    from training.x import g\n")
    write(root, "training/x.py", "import torch\nfrom training import y_not_here\n")
    write(root, "training/y.py", "VALUE = 1\n")
    write(root, "models/net.py", "from models import layers\n")
    write(root, "models/layers.py", "")
    write(root, "flows/f.py", "from tasks.a import f\n")


def test_the_closure_follows_imports_into_functions_and_packages(tmp_path):
    tree(tmp_path)
    files = {str(p.relative_to(tmp_path)) for p in code_closure("tasks.a", tmp_path)}
    assert files == {"tasks/__init__.py", "tasks/a.py", "training/__init__.py", "training/x.py",
                     "models/__init__.py", "models/net.py", "models/layers.py"}
    flows = {str(p.relative_to(tmp_path)) for p in code_closure("flows.f", tmp_path)}
    assert flows == files | {"flows/__init__.py", "flows/f.py"}


def test_an_edit_changes_the_keys_of_the_modules_that_reach_it_only(tmp_path):
    tree(tmp_path)
    before = code_version("tasks.a", tmp_path), code_version("training.y", tmp_path)
    write(tmp_path, "training/x.py", "import torch  # edited\n")
    code_closure.cache_clear()
    code_version.cache_clear()
    after = code_version("tasks.a", tmp_path), code_version("training.y", tmp_path)
    assert after[0] != before[0] and after[1] == before[1]


def test_one_techniques_module_is_not_in_anothers_key():
    distill = {str(p.relative_to(PROJECT_ROOT)) for p in code_closure("tasks.distill")}
    assert "tasks/distill.py" in distill and "training/distill/feature_bank.py" in distill
    assert not {"tasks/adapters/wordnet.py", "tasks/pbt.py", "tasks/image_text/tasks.py"} & distill
    pipeline = {str(p.relative_to(PROJECT_ROOT)) for p in code_closure("flows.pipeline")}
    assert "flows/pipeline.py" in pipeline and distill <= pipeline


def test_a_new_torch_changes_every_key(tmp_path, monkeypatch):
    import tasks.adapters.caching

    tree(tmp_path)
    assert library_versions()["torch"] == torch.__version__.split("+")[0]
    before = code_version("tasks.a", tmp_path)
    installed = tasks.adapters.caching.version
    monkeypatch.setattr(tasks.adapters.caching, "version",
                        lambda name: "9.9.9" if name == "torch" else installed(name))
    code_version.cache_clear()
    assert code_version("tasks.a", tmp_path) != before
    code_version.cache_clear()


def test_a_rounds_key_leaves_out_the_fields_marked_run_only_at_any_depth():
    """The same round under another device, thread count, name or gate is the same work; a
    changed learning rate is not. The fields say which they are (`RUN_ONLY`)."""
    from tasks.adapters.caching import result_fields
    from tasks.adapters.versioning import ArtifactRef
    from tasks.configs.sections import ClassifierConfig
    from tasks.data import DatasetRef
    from tasks.training import ClassifierRound

    config = ClassifierConfig(model="lenet", lr=0.05)
    dataset = DatasetRef(artifact=ArtifactRef(path="data.pt", md5="0" * 32, size=1),
                         source="fashion-mnist", version="v", skipped=[],
                         classes=["a", "b"], channels=1, image_size=28,
                         sizes={"train": 1, "val": 1, "test": 1}, mean=[0.5], std=[0.25])

    def key(**changes) -> dict:
        return result_fields(ClassifierRound(config=config.replace(**changes),
                                             dataset=dataset, round=0))

    elsewhere = key(device="cpu", threads=3, model_name="other", progress=False, patience=9,
                    baseline_gate=False, registry=False, max_latency_ms=5.0)
    assert elsewhere == key() and "device" not in key()["config"]["run"]
    assert key()["config"]["run"]["seed"] == 0 and "patience" not in key()["config"]
    assert key(lr=0.1) != key() and key(ddp_procs=2) != key()  # these change the weights
