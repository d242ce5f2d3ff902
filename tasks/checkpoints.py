"""Checkpoints in the artifact store: written atomically, versioned, loaded by reference."""

from __future__ import annotations

from typing import Any

import torch

from tasks.versioning import ArtifactRef, ArtifactStore


def save_checkpoint(store: ArtifactStore, relpath: str, payload: dict[str, Any]) -> ArtifactRef:
    """Writes `payload` with torch.save under a temporary name, renames it, versions it."""
    return store.write(relpath, lambda path: torch.save(payload, path))


def load_checkpoint(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any]:
    """Loads a checkpoint (pulled by hash if missing) on the CPU, tensors and plain data only."""
    return torch.load(store.fetch(ref), map_location="cpu", weights_only=True)
