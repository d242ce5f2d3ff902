"""Checkpoints in the artifact store: written atomically, versioned, loaded by reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tasks.adapters.versioning import ArtifactRef, ArtifactStore


def torch_save(payload: Any, path: Path) -> None:
    """torch.save through a file object: the archive's inner folder name is then fixed, so the
    same tensors give the same bytes (and DVC hash) whatever the (temporary) file name."""
    with open(path, "wb") as handle:
        torch.save(payload, handle)


def save_checkpoint(store: ArtifactStore, relpath: str, payload: dict[str, Any]) -> ArtifactRef:
    """Writes `payload` under a temporary name, renames it, versions it."""
    return store.write(relpath, lambda path: torch_save(payload, path))


def load_checkpoint(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any]:
    """Loads a checkpoint (pulled by hash if missing) on the CPU, tensors and plain data only."""
    return torch.load(store.fetch(ref), map_location="cpu", weights_only=True)
