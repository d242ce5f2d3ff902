"""The multi-state teacher feature bank: one stored feature per image, with the state that wrote it.

Entries are indexed by dataset id. Each entry holds the feature a teacher gave for that image
and the teacher state (stage number) that wrote it; state -1 marks an entry no teacher has
written yet. Unfilled entries are masked in every lookup, so a loss never mistakes the zeros
they hold for a real feature. Everything lives in buffers: `bank.to(device)` moves it, and its
`state_dict()` is the whole bank. Features are stored in float16 by default (half the memory of
float32); a lookup returns float32.

Memory is `M * D * bytes_per_value` for M entries of D values, plus 6 bytes per entry (an int32
id and an int16 state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

UNFILLED = -1
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class FeatureBank(nn.Module):
    """Features of a teacher for a fixed set of dataset ids (see the module docstring).

    Args:
        ids: the dataset ids the bank covers (any order, no repeats).
        feature_shape: the shape of one feature (a vector `(D,)` or a map `(C, H, W)`).
        dtype: how features are stored.
    """

    def __init__(self, ids: Tensor, feature_shape: Sequence[int],
                 dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        ids = torch.as_tensor(ids).flatten()
        if len(ids) == 0:
            raise ValueError("a feature bank needs at least one dataset id")
        ordered = ids.sort().values
        if len(ordered) > 1 and bool((ordered[1:] == ordered[:-1]).any()):
            raise ValueError("feature bank ids must be distinct")
        if ordered[-1] >= 2**31 or ordered[0] < 0:
            raise ValueError("feature bank ids must lie in [0, 2**31)")
        self.register_buffer("ids", ordered.to(torch.int32))
        self.register_buffer("features", torch.zeros(len(ordered), *feature_shape, dtype=dtype))
        self.register_buffer("state", torch.full((len(ordered),), UNFILLED, dtype=torch.int16))

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> FeatureBank:
        """A bank holding exactly the tensors of `state` (which may be memory-mapped)."""
        bank = cls.__new__(cls)
        nn.Module.__init__(bank)
        for name in ("ids", "features", "state"):
            if name not in state:
                raise KeyError(f"feature bank state has no {name!r} tensor")
            bank.register_buffer(name, state[name])
        if len(bank.ids) != len(bank.features) or len(bank.ids) != len(bank.state):
            raise ValueError(f"feature bank tensors disagree in length: ids {len(bank.ids)}, "
                             f"features {len(bank.features)}, state {len(bank.state)}")
        return bank

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """The shape of one entry's feature."""
        return tuple(self.features.shape[1:])

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, ids: Tensor) -> Tensor:
        """The bank rows of dataset `ids`.

        Raises:
            KeyError: an id is not in the bank (names the first few).
        """
        ids = torch.as_tensor(ids, device=self.ids.device).flatten().to(torch.int32)
        rows = torch.searchsorted(self.ids, ids).clamp_(max=len(self.ids) - 1)
        missing = self.ids[rows] != ids
        if bool(missing.any()):
            raise KeyError(f"dataset ids not in the feature bank: {ids[missing][:5].tolist()}")
        return rows

    @torch.no_grad()
    def update(self, ids: Tensor, features: Tensor, state: int) -> None:
        """Writes `features` (one per id) as teacher state `state`'s entries for `ids`."""
        if state < 0 or state >= 2**15:
            raise ValueError(f"teacher state must be in [0, 32767], got {state}")
        if tuple(features.shape[1:]) != self.feature_shape or len(features) != len(ids):
            raise ValueError(f"features of shape {tuple(features.shape)} do not fit "
                             f"{len(ids)} entries of shape {self.feature_shape}")
        rows = self.rows(ids)
        self.features[rows] = features.to(self.features.device, self.features.dtype)
        self.state[rows] = state

    def lookup(self, ids: Tensor, device: torch.device | str | None = None
               ) -> tuple[Tensor, Tensor]:
        """Features (float32) of `ids` and a mask, True where an entry has been written."""
        rows = self.rows(ids)
        features = self.features[rows].float()
        filled = self.state[rows] != UNFILLED
        if device is not None:
            features, filled = features.to(device), filled.to(device)
        return features, filled

    def fill_fraction(self) -> float:
        """The fraction of entries a teacher has written."""
        return int((self.state != UNFILLED).sum()) / len(self.state)

    def state_histogram(self) -> dict[int, int]:
        """How many entries each teacher state wrote (unfilled entries under -1)."""
        values, counts = torch.unique(self.state, return_counts=True)
        return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}

    def nbytes(self) -> int:
        """Bytes held by the bank's tensors."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.features, self.state))
