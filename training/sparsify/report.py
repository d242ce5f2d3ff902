"""What a trained network's regularized activations look like on one split, layer by layer:
exact zeros, |x| < 1e-3, dead channels and the bytes each map takes stored dense, as a bitmap
plus values, and as CSR (`training.sparsify.term.activation_memory`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from training.sparsify.term import ActivationStats, activation_memory

DEAD = 0.99  # a channel all zero on at least this share of the images is dead


class LayerReport(BaseModel):
    """One regularized layer of the trained network, over the images of one split."""

    model_config = ConfigDict(frozen=True)

    shape: tuple[int, ...]
    zero_fraction: float
    near_zero_fraction: float
    dead_channels: int
    dead_channel_ids: list[int]
    bytes_dense: float
    bytes_bitmap: float
    bytes_csr: float


class ActivationReport(BaseModel):
    """The trained network's regularized layers on one split: `val`, where the round, the
    thresholds (`--zero-threshold-tolerance`, `--zero-target`) and the dead channels are
    chosen, or `test`, images none of those choices looked at (the figures to report)."""

    model_config = ConfigDict(frozen=True)

    split: Literal["val", "test"] = "val"
    layers: dict[str, LayerReport]

    def metrics(self) -> dict[str, float]:
        """The layers' figures: `zero_fraction_<layer>`, `near_zero_fraction_<layer>`,
        `dead_channels_<layer>`, `memory_bitmap_ratio_<layer>` (sparse / dense bytes), ... and
        over the layers `zero_fraction` and `near_zero_fraction` (their mean) and
        `memory_bitmap_ratio`, `memory_csr_ratio` (sum of sparse / sum of dense bytes).
        Unnamed by split: MLflow gets `split_metrics`."""
        out: dict[str, float] = {}
        for name, layer in self.layers.items():
            key = name.replace(".", "_")
            out |= {f"zero_fraction_{key}": layer.zero_fraction,
                    f"near_zero_fraction_{key}": layer.near_zero_fraction,
                    f"dead_channels_{key}": float(layer.dead_channels),
                    f"memory_bitmap_ratio_{key}": layer.bytes_bitmap / layer.bytes_dense,
                    f"memory_csr_ratio_{key}": layer.bytes_csr / layer.bytes_dense}
        count = max(len(self.layers), 1)
        dense = sum(layer.bytes_dense for layer in self.layers.values())
        return out | {
            "zero_fraction": sum(v.zero_fraction for v in self.layers.values()) / count,
            "near_zero_fraction": sum(v.near_zero_fraction for v in self.layers.values()) / count,
            "memory_bitmap_ratio": sum(v.bytes_bitmap for v in self.layers.values()) / dense,
            "memory_csr_ratio": sum(v.bytes_csr for v in self.layers.values()) / dense}

    def split_metrics(self) -> dict[str, float]:
        """`metrics` named by the split they were measured on, as MLflow logs them:
        `val_zero_fraction_<layer>`, `test_zero_fraction_<layer>`, `test_memory_bitmap_ratio`,
        ..."""
        return {f"{self.split}_{key}": value for key, value in self.metrics().items()}

    def all_maps_zero_fraction(self) -> float:
        """The share of exact zeros over every regularized map together: `sum_l z_l n_l /
        sum_l n_l`, with z_l a layer's share and n_l its values per image (a larger map
        weighs more, unlike the mean `zero_fraction`)."""
        sizes = {name: math.prod(layer.shape) for name, layer in self.layers.items()}
        return sum(self.layers[name].zero_fraction * size for name, size in sizes.items()
                   ) / max(sum(sizes.values()), 1)


class SparsityReport(ActivationReport):
    """The trained network's activations on the validation split, layer by layer, with its
    validation score and the thresholds calibrated there."""

    score_name: str = "accuracy"  # the task's score: accuracy, map_50, boundary_f
    val_score: float
    thresholds: dict[str, float] = {}  # the calibrated activation thresholds, if any


def measured_report(stats: ActivationStats, layers: Iterable[str], score_name: str,
                    score: float) -> SparsityReport:
    """The validation report of `layers` from their activation statistics
    (`measured_layers`) and the score."""
    return SparsityReport(score_name=score_name, val_score=score,
                          layers=measured_layers(stats, layers))


def measured_layers(stats: ActivationStats, layers: Iterable[str]) -> dict[str, LayerReport]:
    """`layers` (a `SparsitySpec`'s: the names of its `lambdas`) from their activation
    statistics: zeros, dead channels (all zero on at least `DEAD` of the images) and bytes
    stored three ways (`training.sparsify.term.activation_memory`)."""
    reports = {}
    for name in layers:
        memory = activation_memory(stats.shapes[name], stats.zero_fraction[name])
        dead = stats.dead_channels(name, DEAD).tolist() \
            if name in stats.dead_channel_fraction else []
        reports[name] = LayerReport(
            shape=stats.shapes[name], zero_fraction=stats.zero_fraction[name],
            near_zero_fraction=stats.near_zero_fraction[name], dead_channels=len(dead),
            dead_channel_ids=dead,
            bytes_dense=memory["dense"], bytes_bitmap=memory["bitmap"], bytes_csr=memory["csr"])
    return reports
