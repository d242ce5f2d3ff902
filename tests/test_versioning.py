"""The DVC adapter against a real DVC repository and a real local remote."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from dvc_objects.fs.utils import tmp_fname

from tasks.adapters.versioning import (
    HOST_TAG,
    ArtifactStore,
    data_dvc_hash,
    md5_of,
    project_data_status,
)


@pytest.fixture
def store(tmp_path):
    return ArtifactStore(root=tmp_path / "store", remote_url=str(tmp_path / "remote"))


def test_write_versions_and_pushes(store, tmp_path):
    ref = store.write("runs/a.bin", lambda p: p.write_bytes(b"weights" * 100))
    path = store.path_of(ref)
    assert ref.md5 == md5_of(path) and ref.size == 700
    assert (tmp_path / "remote" / "files" / "md5" / ref.md5[:2] / ref.md5[2:]).is_file()
    assert (path.parent / "a.bin.dvc").is_file()


def test_missing_file_is_pulled_by_hash_on_a_fresh_store(store, tmp_path):
    ref = store.write("runs/b.bin", lambda p: p.write_bytes(b"abc" * 10))
    shutil.rmtree(store.root)  # as on another worker: no file, no cache, no pointer
    fresh = ArtifactStore(root=tmp_path / "other", remote_url=str(tmp_path / "remote"))
    assert fresh.fetch(ref).read_bytes() == b"abc" * 10


def test_failed_write_leaves_nothing_behind(store):
    def crash(path):
        path.write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        store.write("runs/c.bin", crash)
    assert list((store.root / "runs").iterdir()) == []


def test_rwlock_truncated_by_a_killed_process_is_repaired(store, caplog):
    store.write("runs/f.bin", lambda p: p.write_bytes(b"f"))
    rwlock = store.root / ".dvc" / "tmp" / "rwlock"
    rwlock.write_text("")  # what DVC leaves when killed between truncate and write
    ref = store.write("runs/g.bin", lambda p: p.write_bytes(b"g"))
    assert store.path_of(ref).read_bytes() == b"g"
    assert not any(json.loads(rwlock.read_text()).values())  # valid JSON, no lock held
    assert "repaired DVC's rwlock file" in caplog.text


def test_dvc_temporaries_of_a_killed_commit_are_removed_by_the_next_one(store, caplog):
    store.write("runs/h.bin", lambda p: p.write_bytes(b"h"))
    folder = store.root / "runs"
    # what DVC's link test leaves when the process is killed during `dvc commit`
    debris = folder / tmp_fname()  # the name DVC itself makes
    debris.write_bytes(b"test")
    ours = folder / ".h.abc123.tmp"  # not DVC's name pattern: never touched
    ours.write_bytes(b"x")
    store.write("runs/i.bin", lambda p: p.write_bytes(b"i"))
    assert not debris.exists() and ours.exists()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [ours.name]
    assert "removed 1 temporary file(s) of a killed DVC command" in caplog.text


def test_a_killed_writers_temporary_is_removed_by_the_next_write_of_its_target(store):
    folder = store.root / "runs"
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)  # a process that has ended, as a kill -9 leaves its writer
    dead = folder / f".k.{HOST_TAG}-{dead_pid}-q1w2e3r4.bin"  # what atomic_path names
    live = folder / f".k.{HOST_TAG}-{os.getpid()}-a1s2d3f4.bin"  # a writer still at work
    elsewhere = folder / f".k.0badc0de-{dead_pid}-z9x8c7v6.bin"  # another host's: unknowable
    other = folder / f".l.{HOST_TAG}-{dead_pid}-p0o9i8u7.bin"  # another target's
    for path in (dead, live, elsewhere, other):
        path.write_bytes(b"half")
    ref = store.write("runs/k.bin", lambda p: p.write_bytes(b"k"))
    assert store.path_of(ref).read_bytes() == b"k"
    assert not dead.exists() and live.exists() and elsewhere.exists() and other.exists()


def test_unknown_hash_is_a_clear_error(store):
    ref = store.write("runs/d.bin", lambda p: p.write_bytes(b"d"))
    bogus = ref.model_copy(update={"md5": "0" * 32, "path": "runs/e.bin"})
    with pytest.raises(FileNotFoundError, match="runs/e.bin"):
        store.fetch(bogus)


def test_project_data_matches_data_dvc():
    assert data_dvc_hash().endswith(".dir")
    assert project_data_status() == {}
