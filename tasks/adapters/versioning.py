"""The one DVC adapter: every artifact a task writes is added to DVC's cache and pushed.

Artifacts live in the artifact store, a DVC repository of its own (`artifacts/`, ignored by the
project's git, with `core.no_scm`) that pushes to the project's DVC remote. It is separate because
DVC refuses `.dvc` files that git ignores, and run outputs (checkpoints, banks, reports) belong
in DVC, not in git history. Each artifact gets a `<file>.dvc` pointer beside it, as `dvc add`
writes; an `ArtifactRef` (path, md5, size) is enough to rebuild that pointer on another machine
and `dvc pull` the file by its hash.

Writes are atomic: a file is written under a temporary name and renamed into place, so a crash
never leaves a half-written artifact behind.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import yaml
from dvc.exceptions import DvcException
from dvc.lock import LockError, make_lock
from dvc.repo import Repo, lock_repo
from dvc.rwlock import RWLOCK_FILE, RWLOCK_LOCK, RWLockFileCorruptedError
from pydantic import BaseModel, ConfigDict

from tasks.environment import PROJECT_ROOT, artifacts_dir

_LOCK = threading.Lock()
logger = logging.getLogger(__name__)
REMOTE_NAME = "project"
# the name DVC gives its temporary files (dvc_objects.fs.utils.tmp_fname): a link test or a
# copy into place, written beside the target while DVC holds the repository lock
DVC_TEMPORARY = re.compile(r"\.[A-Za-z0-9_-]{22}\.tmp")


class ArtifactRef(BaseModel):
    """A versioned file: its path inside the artifact store and its content hash."""

    model_config = ConfigDict(frozen=True)

    path: str
    md5: str
    size: int

    @property
    def name(self) -> str:
        """The file name, without folders."""
        return Path(self.path).name


def md5_of(path: Path) -> str:
    """The md5 of a file's bytes (DVC's content hash for files)."""
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# a temporary's name says who writes it: `.<stem>.<host tag>-<pid>-<random><suffix>`
HOST_TAG = hashlib.md5(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_temporaries(target: Path) -> list[str]:
    """Deletes the temporaries of `target` whose writer, a process of this host, is gone (a
    kill -9 in the middle of a write); a live writer's, or another host's, stay. Returns the
    names removed."""
    owned = re.compile(rf"\.{re.escape(target.stem)}\.{HOST_TAG}-(\d+)-\w+"
                       rf"{re.escape(target.suffix)}")
    dead = [path for path in target.parent.glob(f".{glob.escape(target.stem)}.*")
            if (found := owned.fullmatch(path.name)) and not _alive(int(found.group(1)))]
    return _remove(dead, f"a killed writer of {target}")


def _remove(paths: list[Path], whose: str) -> list[str]:
    """Deletes `paths` (temporaries a killed process left) with one warning naming `whose`
    they were; returns their names."""
    for path in paths:
        path.unlink(missing_ok=True)
    removed = sorted(path.name for path in paths)
    if removed:
        logger.warning("removed %d temporary file(s) of %s: %s", len(removed), whose,
                       ", ".join(removed))
    return removed


@contextmanager
def atomic_path(target: Path):
    """Yields a temporary path beside `target`; renames it onto `target` only on success.
    A dead writer's temporaries of the same target are deleted first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(target)
    handle, temporary = tempfile.mkstemp(dir=target.parent,
                                         prefix=f".{target.stem}.{HOST_TAG}-{os.getpid()}-",
                                         suffix=target.suffix)  # some writers check suffixes
    os.close(handle)
    try:
        yield Path(temporary)
        with open(temporary, "rb+") as written:  # on disk before it gets the real name
            os.fsync(written.fileno())
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _write_pointer(pointer: Path, md5: str, size: int) -> None:
    """Writes a `.dvc` file for one output, as `dvc add` does (atomically)."""
    name = pointer.name.removesuffix(".dvc")
    content = {"outs": [{"md5": md5, "size": size, "hash": "md5", "path": name}]}
    with atomic_path(pointer) as temporary:
        temporary.write_text(yaml.safe_dump(content, sort_keys=False))


def remove_dvc_debris(folder: Path) -> list[str]:
    """Deletes DVC's temporary files in `folder`, left by a process killed mid-command.

    Call only under the repository lock: DVC writes such files only while it holds that lock,
    so none of them belongs to a command still running. Returns the names removed.
    """
    debris = [path for path in folder.iterdir()
              if DVC_TEMPORARY.fullmatch(path.name) and path.is_file()] if folder.is_dir() else []
    return _remove(debris, f"a killed DVC command in {folder}")


def repair_rwlock(lock_dir: Path) -> None:
    """Empties DVC's rwlock file if it is not valid JSON.

    DVC rewrites the file in place (truncate, then write) under its `rwlock.lock` guard, so a
    file that is unreadable while this process holds the guard was left by a writer that died
    mid-write. Its entries are lost either way; DVC's repository lock, which every command here
    also takes, still keeps commands apart, and entries of dead processes are dropped by DVC.
    """
    path = lock_dir / RWLOCK_FILE
    with make_lock(str(lock_dir / RWLOCK_LOCK), tmp_dir=str(lock_dir), wait=True):
        try:
            json.loads(path.read_text(encoding="utf-8"))  # valid: another process repaired it
        except FileNotFoundError:
            pass
        except json.JSONDecodeError:
            with atomic_path(path) as temporary:
                temporary.write_text("{}", encoding="utf-8")
            logger.warning("repaired DVC's rwlock file %s, left truncated by a killed process",
                           path)


def data_dvc_hash(path: Path = PROJECT_ROOT / "data.dvc") -> str:
    """The content hash recorded in a `.dvc` file (for data.dvc: the default data's version)."""
    if not path.exists():
        return "missing"
    outs = yaml.safe_load(path.read_text()).get("outs", [])
    return outs[0]["md5"] if outs else "missing"


def track_project_data(target: str = "data", project_root: Path = PROJECT_ROOT) -> ArtifactRef:
    """`dvc add` of the project's data folder (writes `<target>.dvc`), then `dvc push`."""
    repo = Repo(str(project_root))
    repo.scm_context.quiet = True  # the data.dvc in git already says what to commit
    try:
        stage = repo.add(str(project_root / target))[0]
        repo.push(targets=[str(project_root / f"{target}.dvc")])
        out = stage.outs[0]
        return ArtifactRef(path=target, md5=out.hash_info.value, size=int(out.meta.size or 0))
    finally:
        repo.close()


def project_data_status(project_root: Path = PROJECT_ROOT) -> dict:
    """`dvc status` of the project repository: empty when data and data.dvc agree."""
    repo = Repo(str(project_root))
    try:
        return repo.status()
    finally:
        repo.close()


def project_remote_url(project_root: Path = PROJECT_ROOT) -> str:
    """The URL of the project's default DVC remote (`COMPACTML_DVC_REMOTE` overrides it)."""
    if url := os.environ.get("COMPACTML_DVC_REMOTE"):
        return url
    config = Repo(str(project_root)).config
    name = config["core"].get("remote")
    if not name:
        raise RuntimeError(f"the DVC repository in {project_root} has no default remote: "
                           "`dvc remote add -d NAME URL`, or set COMPACTML_DVC_REMOTE")
    return config["remote"][name]["url"]


class ArtifactStore:
    """The DVC-backed store of run artifacts.

    Args:
        root: the store's folder (default `COMPACTML_ARTIFACTS`, else `<project>/artifacts`).
        remote_url: where pushes go (default: the project's DVC remote).
    """

    def __init__(self, root: Path | None = None, remote_url: str | None = None) -> None:
        self.root = Path(root or artifacts_dir()).resolve()
        self._remote_url = remote_url

    def path_of(self, ref: ArtifactRef | str) -> Path:
        """The local path of an artifact."""
        return self.root / (ref.path if isinstance(ref, ArtifactRef) else ref)

    def _repo(self) -> Repo:
        """Opens the store (created on first use) with its remote set to the current URL."""
        if not (self.root / ".dvc").is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            with redirect_stdout(io.StringIO()):  # DVC prints a banner on init
                Repo.init(str(self.root), no_scm=True, force=True)
        url = self._remote_url or project_remote_url()
        if "://" not in url:
            url = str(Path(url).resolve())
        repo = Repo(str(self.root))
        core = repo.config["core"]
        if core.get("remote") != REMOTE_NAME or \
                repo.config["remote"].get(REMOTE_NAME, {}).get("url") != url:
            with repo.config.edit() as config:  # the remote follows the project's setting
                config["core"]["remote"] = REMOTE_NAME
                config["core"]["analytics"] = False
                config["core"]["check_update"] = False
                config["remote"][REMOTE_NAME] = {"url": url}
                config["cache"]["type"] = "reflink,hardlink,copy"
            repo.close()
            repo = Repo(str(self.root))
        return repo

    def _with_repo(self, action: Callable[[Repo], object]) -> object:
        """Runs `action` on a fresh Repo under the store's lock, retrying a busy DVC lock.

        A process killed while DVC rewrote its rwlock file leaves it truncated, and DVC then
        refuses every later command; such a file is repaired once and the action retried.
        """
        repaired = False
        for attempt in range(20):
            try:
                with _LOCK:
                    repo = self._repo()
                    try:
                        return action(repo)
                    finally:
                        repo.close()
            except LockError:
                time.sleep(0.25 * (attempt + 1))
            except RWLockFileCorruptedError:
                if repaired:
                    raise
                repair_rwlock(self.root / ".dvc" / "tmp")
                repaired = True
        raise RuntimeError(f"the DVC repository {self.root} stayed locked by another process")

    def write(self, relpath: str, writer: Callable[[Path], None]) -> ArtifactRef:
        """Writes an artifact atomically with `writer(temporary_path)`, then versions it."""
        target = self.path_of(relpath)
        with atomic_path(target) as temporary:
            writer(temporary)
        return self.version(relpath)

    def version(self, relpath: str) -> ArtifactRef:
        """Adds an existing file of the store to DVC's cache and pushes it to the remote.

        Writes the `<file>.dvc` pointer that `dvc add` would write (atomically), then commits
        that one stage to the cache and runs `dvc push` of it. (`dvc add` itself parses every
        pointer in the store to check for overlapping outputs, which grows with each artifact:
        0.5 s at 90 files.)
        DVC's own temporary files that a killed run left in the target's folder (its link test
        writes one there during every commit) are deleted first, under the same lock.
        """
        target = self.path_of(relpath)
        if not target.is_file():
            raise FileNotFoundError(f"cannot version {target}: no such file")
        pointer = Path(str(target) + ".dvc")
        _write_pointer(pointer, md5_of(target), target.stat().st_size)

        def commit_and_push(repo: Repo) -> ArtifactRef:
            with lock_repo(repo):
                remove_dvc_debris(target.parent)
                # `dvc commit` without its last step: `repo.commit` would rewrite the pointer in
                # place (truncate, then write the same bytes), so a kill there left it empty
                stage = repo.stage.get_target(str(pointer))
                stage.save()
                stage.commit(relink=True)  # into the cache, the file relinked from it
                out = stage.outs[0]
            repo.push(targets=[str(pointer)])
            return ArtifactRef(path=Path(relpath).as_posix(), md5=out.hash_info.value,
                               size=int(out.meta.size))

        return self._with_repo(commit_and_push)

    def delete_objects(self, hashes: set[str]) -> None:
        """Deletes the objects of `hashes` from the store's DVC cache and from the remote
        (`tasks.adapters.retention`: their files are gone and no kept run records them)."""

        def delete(repo: Repo) -> None:
            remote = repo.cloud.get_remote_odb()
            for md5 in sorted(hashes):
                for odb in (repo.cache.local, remote):
                    if odb.exists(md5):
                        odb.delete(md5)

        self._with_repo(delete)

    def fetch(self, ref: ArtifactRef) -> Path:
        """The local path of `ref`, pulled by hash from the remote if missing or different."""
        target = self.path_of(ref)
        if target.is_file() and target.stat().st_size == ref.size and md5_of(target) == ref.md5:
            return target
        pointer = Path(str(target) + ".dvc")

        def pull(repo: Repo) -> None:
            _write_pointer(pointer, ref.md5, ref.size)
            repo.pull(targets=[str(pointer)], force=True)

        try:
            self._with_repo(pull)
        except DvcException as error:
            pointer.unlink(missing_ok=True)
            raise FileNotFoundError(f"artifact {ref.path} (md5 {ref.md5}) is neither local nor "
                                    f"on the DVC remote: {error}") from error
        return target
