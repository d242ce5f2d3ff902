"""`python -m flows gc`: an old run's artifacts leave the artifact store, its DVC cache and the
DVC remote; a registered version's stay and it still loads; a rerun of the old run's config
recomputes what was freed instead of taking a cached result that names a missing file."""

from __future__ import annotations

import numpy as np
import pytest
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

from flows.cli import main
from flows.commands import COMMANDS
from flows.train import train
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.promotion import seen_by
from tests.conftest import smoke


@pytest.fixture
def own_stores(tmp_path, monkeypatch):
    """An artifact store, DVC remote and MLflow store of the test's own: gc sees only its
    runs, and the session's stay whole."""
    import mlflow

    monkeypatch.setenv("COMPACTML_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("COMPACTML_DVC_REMOTE", str(tmp_path / "remote"))
    previous, uri = mlflow.get_tracking_uri(), f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield
    mlflow.set_tracking_uri(previous)


def _refs(run_id: str) -> dict[str, ArtifactRef]:
    return {name: ArtifactRef(path=ref["path"], md5=ref["md5"], size=0)
            for name, ref in tracking.artifact_refs(run_id).items()}


def test_gc_frees_an_old_run_and_keeps_the_registered_versions(own_stores, capsys):
    tiny = {"rounds": 1, "train_limit": 256}
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):  # files in these stores
        kept = train(smoke(**tiny, seed=11, model_name="gc-kept", registry=True))
        old = train(smoke(**tiny, seed=12, model_name="gc-old"))
    kept_refs, old_refs = _refs(kept.run_id), _refs(old.run_id)
    kept_hashes = {ref.md5 for ref in kept_refs.values()}
    freed = {name: ref for name, ref in old_refs.items() if ref.md5 not in kept_hashes}
    assert "checkpoint.final" in freed and "dataset" not in freed  # the data set is shared

    main(COMMANDS, ["gc", "--keep", "0", "--min-age-hours", "0"])
    out = capsys.readouterr().out
    files = {ref.path for ref in freed.values()}  # the final checkpoint is the last round's
    assert f"freed {len(files)} files" in out and "kept the artifacts of 1 runs" in out
    store = ArtifactStore()
    for ref in freed.values():
        assert not store.path_of(ref).exists(), ref.path
        with pytest.raises(FileNotFoundError, match="neither local nor on the DVC remote"):
            store.fetch(ref)
    for ref in kept_refs.values():
        assert store.path_of(ref).is_file(), ref.path
    served = tracking.load_pyfunc("models:/gc-kept/1")
    assert len(served.predict(np.zeros((2, 28, 28), dtype=np.uint8))) == 2
    # the old config again: its cached results named the freed files, so it trains anew
    again = train(smoke(**tiny, seed=12, model_name="gc-old"))
    assert again.test_accuracy == pytest.approx(old.test_accuracy)


def test_gc_keeps_what_a_registered_versions_lineage_names_after_its_run_was_deleted(
        own_stores):
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        made = train(smoke(rounds=1, train_limit=256, seed=13, model_name="gc-deleted",
                           registry=True))
    refs = _refs(made.run_id)
    tracking.client().delete_run(made.run_id)  # as the MLflow UI's delete does
    main(COMMANDS, ["gc", "--keep", "0", "--min-age-hours", "0"])
    store = ArtifactStore()
    for ref in refs.values():  # the data set a promotion reads back, the checkpoints
        assert store.path_of(ref).is_file(), ref.path
    # the lineage a promotion reads: the version's data set loads
    tags = tracking.version_tags("gc-deleted", "1")
    assert seen_by(tags) is not None
