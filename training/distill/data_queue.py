"""A recency data queue: images not used recently are more likely to be drawn.

The M dataset ids stand in a queue. A draw of N ids (N < M) picks without replacement, each pick
with probability proportional to a weight: `front_weight` for the M - N ids at the front (not
drawn last time) and `back_weight` for the N at the back (drawn last time). The drawn ids then
move to the back, in the order drawn. So the ratio `front_weight / back_weight` is, per pick,
how much more likely a given front image is than a given back image; `uniform()` is ratio 1.
All randomness comes from an explicit generator: the same seed gives the same draws.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RecencyQueue:
    """The queue of dataset ids and its weighted draw (see the module docstring).

    Args:
        ids: the dataset ids, in their initial queue order (front first).
        front_weight: weight of an id among the M - N not drawn last time.
        back_weight: weight of an id among the N drawn last time.
    """

    def __init__(self, ids: Tensor, front_weight: float = 2.0, back_weight: float = 1.0) -> None:
        if front_weight <= 0 or back_weight <= 0:
            raise ValueError(f"weights must be positive, got front {front_weight}, "
                             f"back {back_weight}")
        if ids.ndim != 1 or len(ids) < 2:
            raise ValueError(f"need a 1-D tensor of at least 2 ids, got shape {tuple(ids.shape)}")
        self.order = ids.clone().long()
        self.front_weight = front_weight
        self.back_weight = back_weight
        self.back_size = 0  # nothing has been drawn yet: the whole queue is the front

    @classmethod
    def uniform(cls, ids: Tensor) -> RecencyQueue:
        """A queue that draws every id with the same probability."""
        return cls(ids, 1.0, 1.0)

    def weights(self) -> Tensor:
        """The current weight of each queue position (front first)."""
        weights = torch.full((len(self.order),), self.front_weight, dtype=torch.float64)
        if self.back_size:
            weights[-self.back_size:] = self.back_weight
        return weights

    def draw(self, count: int, generator: torch.Generator) -> Tensor:
        """Draws `count` distinct ids (0 < count < M) and moves them to the back."""
        if not 0 < count < len(self.order):
            raise ValueError(f"draw count must be between 1 and {len(self.order) - 1}, "
                             f"got {count}")
        picked = torch.multinomial(self.weights(), count, replacement=False,
                                   generator=generator)
        kept = torch.ones(len(self.order), dtype=torch.bool)
        kept[picked] = False
        drawn = self.order[picked]
        self.order = torch.cat([self.order[kept], drawn])
        self.back_size = count
        return drawn

    def state_dict(self) -> dict[str, Tensor | float | int]:
        """The queue's state, to checkpoint and restore with `load_state_dict`."""
        return {"order": self.order.clone(), "back_size": self.back_size,
                "front_weight": self.front_weight, "back_weight": self.back_weight}

    def load_state_dict(self, state: dict) -> None:
        """Restores a state written by `state_dict`."""
        self.order = state["order"].clone().long()
        self.back_size = int(state["back_size"])
        self.front_weight = float(state["front_weight"])
        self.back_weight = float(state["back_weight"])
