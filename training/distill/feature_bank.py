"""The multi-state teacher feature bank: one stored feature per image, with the state that wrote it.

Entries are indexed by dataset id. Each entry holds the feature a teacher gave for that image
and the teacher state (stage number) that wrote it; state -1 marks an entry no teacher has
written yet. Unfilled entries are masked in every lookup, so a loss never mistakes the zeros
they hold for a real feature. Everything lives in buffers: `bank.to(device)` moves it, and its
`state_dict()` is the whole bank. Features are stored in float16 by default (half the memory of
float32); a lookup returns float32.

Two options keep more per entry:
- `average=True` in `update`: the entry becomes the running mean of every state's feature for
  that image (a mean bank) instead of the last state's; `writes` counts the states averaged.
- `views=k` at construction: each entry also records the augmented view its teacher saw (a
  flip and k move values, `training.batches.draw_shift_flip`), and `recorded_views()` hands
  them to the student's batches, which then show the student that same view (a consistent
  bank: the target belongs to the image the student sees).

Memory is `M * D * bytes_per_value` for M entries of D values, plus 8 bytes per entry (an int32
id, an int16 state and an int16 write count), plus `1 + 4 k` bytes with views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from training.batches import RecordedViews

UNFILLED = -1
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class FeatureBank(nn.Module):
    """Features of a teacher for a fixed set of dataset ids (see the module docstring).

    Args:
        ids: the dataset ids the bank covers (any order, no repeats).
        feature_shape: the shape of one feature (a vector `(D,)` or a map `(C, H, W)`).
        dtype: how features are stored.
        views: move values per recorded view (2: whole-pixel shifts, 4: warps); 0 records none.
    """

    def __init__(self, ids: Tensor, feature_shape: Sequence[int],
                 dtype: torch.dtype = torch.float16, views: int = 0) -> None:
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
        self.register_buffer("writes", torch.zeros(len(ordered), dtype=torch.int16))
        if views:
            self.register_buffer("view_flips", torch.zeros(len(ordered), dtype=torch.bool))
            self.register_buffer("view_moves", torch.zeros(len(ordered), views))

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> FeatureBank:
        """A bank holding exactly the tensors of `state` (which may be memory-mapped)."""
        bank = cls.__new__(cls)
        nn.Module.__init__(bank)
        for name in ("ids", "features", "state"):
            if name not in state:
                raise KeyError(f"feature bank state has no {name!r} tensor")
            bank.register_buffer(name, state[name])
        # a bank written before write counts were kept: one write per filled entry
        bank.register_buffer("writes", state.get("writes", (bank.state != UNFILLED)
                                                 .to(torch.int16)))
        if ("view_flips" in state) != ("view_moves" in state):
            raise KeyError("feature bank state has one of view_flips and view_moves alone")
        for name in ("view_flips", "view_moves"):
            if name in state:
                bank.register_buffer(name, state[name])
        lengths = {name: len(tensor) for name, tensor in bank.named_buffers()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"feature bank tensors disagree in length: {lengths}")
        return bank

    @property
    def has_views(self) -> bool:
        """Whether each entry records the augmented view its teacher saw."""
        return hasattr(self, "view_flips")

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
    def update(self, ids: Tensor, features: Tensor, state: int, average: bool = False,
               views: tuple[Tensor, Tensor] | None = None) -> None:
        """Writes `features` (one per id) as teacher state `state`'s entries for `ids`: in
        place of what the entries held, or (`average`) into the running mean of every state's
        feature for them. `views`: the flips and moves of the views the features were taken on
        (required exactly when the bank records views)."""
        if state < 0 or state >= 2**15:
            raise ValueError(f"teacher state must be in [0, 32767], got {state}")
        if tuple(features.shape[1:]) != self.feature_shape or len(features) != len(ids):
            raise ValueError(f"features of shape {tuple(features.shape)} do not fit "
                             f"{len(ids)} entries of shape {self.feature_shape}")
        if (views is not None) != self.has_views:
            raise ValueError("this bank records views: pass the views the features were taken "
                             "on" if self.has_views else "this bank records no views")
        if average and self.has_views:
            raise ValueError("a bank that records views keeps each entry's last view: a mean "
                             "over states would mix features of different views")
        rows = self.rows(ids)
        features = features.to(self.features.device, torch.float32)
        if average:
            writes = self.writes[rows].float().view(-1, *[1] * (features.dim() - 1))
            features = (self.features[rows].float() * writes + features) / (writes + 1)
            self.writes[rows] += 1
        else:
            self.writes[rows] = 1
        self.features[rows] = features.to(self.features.dtype)
        self.state[rows] = state
        if views is not None:
            flips, moves = views
            self.view_flips[rows] = flips.to(self.view_flips.device)
            self.view_moves[rows] = moves.to(self.view_moves.device, torch.float32)

    def recorded_views(self) -> RecordedViews | None:
        """The views the filled entries were taken on (a copy in memory), or None without
        views."""
        if not self.has_views:
            return None
        return RecordedViews(self.ids.long().clone(), self.view_flips.clone(),
                             self.view_moves.clone(), self.state != UNFILLED)

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
        return sum(t.numel() * t.element_size() for t in self.buffers())
