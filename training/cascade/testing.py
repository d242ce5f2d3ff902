"""The calibrated cascade measured on test images beside its alternatives, in pure PyTorch.

`measure_cascade` scores and times the calibrated cascade (the registered model: no prefix)
beside the full network (`full_`: no exits, every super-network module at its most expensive
sub-network), the plain confidence cascade (`plain_`: those sub-networks, exits calibrated
alike) and, where the calibration chose between them, both routings of the super-network
modules, each with the thresholds calibrated for it on validation: `fixed_` (each routed
module's most frequent sub-network fixed, no predictor run) and `fitted_` (the fitted
predictors route). For each: accuracy of the real cascade, each exit's share, milliseconds per
image at batch 1 (the first `timing_images` images) and at the serving batch (interleaved
passes), the speed-up over the full network (`speedup_b1` = full ms / its ms), the latency
table's predicted cost and FLOPs per image, and the cost over the oracle's
(`cost_over_oracle` = mean table cost / the oracle's; `flops_over_oracle` likewise). The
oracle (`oracle_`: its cost by the table and, cheapest in FLOPs, its FLOPs). Then the
accuracy-latency sweep: per tolerance, accuracy, time at batch 1 (on at most 300 of the images)
and cost by the table (over the full network's and over the oracle's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.cascade import CascadeNet
from training.cascade.calibration import full_network, routed_variant
from training.cascade.learning import ExitTable, exit_table, oracles
from training.latency import full_network_cost, interleaved_ms_per_image


@dataclass(frozen=True)
class Measured:
    """What `measure_cascade` gives: the flat metrics and one row per sweep tolerance."""

    metrics: dict[str, float]
    sweep: list[dict[str, float]]


@dataclass(frozen=True)
class ScoredImages:
    """The normalized test images and labels (on the device), and `batches()`: the same
    images as the exit tables read them (`(ids, x, y)` batches)."""

    images: Tensor
    labels: Tensor
    batches: Callable[[], Iterable]


def measure_cascade(net: CascadeNet, test: ScoredImages, calibration: dict,
                    costs: dict, flops: dict, step: int, serving_batch: int,
                    timing_images: int) -> Measured:
    """The module docstring's measurements of `net` (its calibrated thresholds in place);
    `calibration` is the calibration checkpoint's payload (`plain_thresholds`, `routing`,
    `sweep`), `costs` and `flops` the latency table's part costs, `step` the scoring batch."""
    images, labels = test.images, test.labels
    full = full_network(net)
    never = torch.ones_like(net.thresholds)
    variants = {"": {}, "full_": {"thresholds": never, "fixed": full},
                "plain_": {"thresholds": calibration["plain_thresholds"].to(images.device),
                           "fixed": full}}
    nets = dict.fromkeys(variants, net)
    for name, chosen in calibration.get("routing", {}).items():
        nets[f"{name}_"], variants[f"{name}_"] = routed_variant(net, chosen), {}
    full_cost, full_flops = full_network_cost(net, costs), full_network_cost(net, flops)
    metrics: dict[str, float] = {}
    tables: dict[str, ExitTable] = {}
    for prefix, kwargs in variants.items():
        variant = nets[prefix]
        out = [variant.infer(images[i:i + step], **kwargs) for i in range(0, len(images), step)]
        predicted, exits = torch.cat([o.labels for o in out]), torch.cat([o.exits for o in out])
        shares = torch.bincount(exits.cpu(), minlength=net.modules_count).float() / len(exits)
        paths = tables[prefix] = exit_table(variant, test.batches(), costs, kwargs.get("fixed"))
        thresholds = kwargs.get("thresholds", variant.thresholds).cpu()
        spent = paths.outcome(thresholds)
        spent_flops = paths.priced(variant, flops).outcome(thresholds)
        metrics |= {f"{prefix}test_accuracy": (predicted == labels).float().mean().item(),
                    f"{prefix}table_cost_ratio": spent["mean_cost"] / full_cost,
                    f"{prefix}flops_per_image": spent_flops["mean_cost"],
                    **{f"{prefix}exit_share_{k}": v for k, v in enumerate(shares.tolist())}}
    # (a) is timed as what it is, the plain forward pass (no exit heads but the last, no
    # bookkeeping); its accuracy above came from the cascade's code with no exit taken
    calls = {prefix: lambda x, n=nets[prefix], kw=kwargs: n.infer(x, **kw)
             for prefix, kwargs in variants.items() if prefix != "full_"} | {"full_": net}
    for batch, suffix in ((1, "b1"), (serving_batch, "serving")):
        sample = images[:timing_images] if batch == 1 else images
        measured = interleaved_ms_per_image(calls, sample, batch)
        metrics |= {f"{prefix}ms_per_image_{suffix}": ms for prefix, ms in measured.items()}
        metrics |= {f"{prefix}speedup_{suffix}": measured["full_"] / ms
                    for prefix, ms in measured.items() if prefix != "full_"}
    best, best_flops = oracles(net, test.batches(), [costs, flops])
    metrics |= {"oracle_accuracy": best["accuracy"],
                "oracle_table_cost_ratio": best["mean_cost"] / full_cost,
                "oracle_flops_per_image": best_flops["mean_cost"], "full_flops": full_flops}
    for prefix in variants.keys() - {"full_"}:
        metrics |= {f"{prefix}cost_over_oracle":
                    metrics[f"{prefix}table_cost_ratio"] * full_cost / best["mean_cost"],
                    f"{prefix}flops_over_oracle":
                    metrics[f"{prefix}flops_per_image"] / best_flops["mean_cost"]}
    return Measured(metrics, accuracy_latency_sweep(
        net, test, calibration["sweep"], tables[""], step, timing_images, full_cost,
        best["mean_cost"]))


def accuracy_latency_sweep(net: CascadeNet, test: ScoredImages, sweep: dict[float, Tensor],
                           table: ExitTable, step: int, timing_images: int, full_cost: float,
                           oracle_cost: float) -> list[dict[str, float]]:
    """Per calibrated tolerance of the sweep: accuracy, ms at batch 1 beside the full network,
    cost by the table over the full network's and the oracle's, and the thresholds."""
    images, labels = test.images, test.labels
    rows = []
    sample = images[:min(timing_images, 300)]
    for tolerance, thresholds in sweep.items():
        priced = table.outcome(thresholds.cpu())["mean_cost"]
        thresholds = thresholds.to(images.device)
        predicted = torch.cat([net.infer(images[i:i + step], thresholds).labels
                               for i in range(0, len(images), step)])
        measured = interleaved_ms_per_image({"cascade": lambda x, t=thresholds: net.infer(x, t),
                                             "full": net}, sample, 1)
        rows.append({"tolerance": float(tolerance),
                     "test_accuracy": (predicted == labels).float().mean().item(),
                     "ms_per_image_b1": measured["cascade"],
                     "speedup_b1": measured["full"] / measured["cascade"],
                     "table_cost_ratio": priced / full_cost,
                     "cost_over_oracle": priced / oracle_cost,
                     **{f"threshold_{k}": t for k, t in enumerate(thresholds.tolist())}})
    return rows
