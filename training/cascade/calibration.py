"""How a cascade's exit thresholds and routing are chosen on validation, in pure torch.

The thresholds are calibrated for an accuracy goal (the full network's validation accuracy
minus a tolerance: the cheapest thresholds that keep it) or a latency budget (the most accurate
thresholds within it), on the images an early exit loses alone unless gains count too
(`ExitTable.losses_only`). Where fitted predictors route super-network modules, three routings
are calibrated alike and compared: each routed module's most frequent choice fixed for good
(no predictor run), its most expensive sub-network fixed (the plain cascade), and the
predictors. The one that meets the goal and is cheapest (accuracy goal) or most accurate
(budget) wins, the predictors only when strictly better: a predictor must pay for its own time,
and the super-network's choice must not make the cascade worse than the plain one.

The predictors are calibrated at several operating points first: their argmax, and for each of
`route_shares` an offset on each routed module's score of its most expensive sub-network that
sends that share of the validation images there (the predictor ranks the images, the offset
sets how many take the expensive path), each with its own thresholds; the best of them is the
predictors' candidate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from models.cascade import CascadeNet
from training.cascade.learning import ExitTable, ThresholdGrid, threshold_grid
from training.latency import full_network_cost

Routing = Literal["fixed", "fitted", "most_expensive"]
SWEEP = (0.0, 0.002, 0.003, 0.004, 0.005, 0.01, 0.02, 0.05, 0.1)  # accuracy given up on validation
CHOICES: dict[str, Routing] = {"most frequent": "fixed", "most expensive": "most_expensive",
                               "predictors": "fitted"}


@dataclass(frozen=True)
class CalibrationGoal:
    """What the thresholds are calibrated for: `accuracy` (the full network's validation accuracy
    minus `accuracy_tolerance`) or `budget` (`latency_budget`, a share of the full network's
    cost); `count_gains`: calibrate on every image, not on the losses alone; `thresholds`: given
    thresholds, nothing calibrated."""

    calibrate: Literal["accuracy", "budget"] = "accuracy"
    accuracy_tolerance: float = 0.003
    latency_budget: float | None = None
    count_gains: bool = False
    thresholds: tuple[float, ...] | None = None
    route_shares: tuple[float, ...] = ()


@dataclass
class CalibratedCascade:
    """The calibration's outcome: the thresholds in force, the plain cascade's thresholds, the
    accuracy-latency sweep (`SWEEP`: tolerance -> thresholds), the routings compared (`fixed`,
    `fitted`: their fixed choices and thresholds), which one won (None where nothing is routed
    or thresholds were given) and the validation metrics."""

    thresholds: Tensor
    plain_thresholds: Tensor
    sweep: dict[str, Tensor]
    routing: dict[str, dict]
    chosen: Routing | None
    metrics: dict[str, float]


def full_network(net: CascadeNet) -> dict[int, int]:
    """Every super-network module at its most expensive sub-network."""
    return {k: net.most_expensive(k) for k in range(net.modules_count) if net.is_super(k)}


def routed_variant(net: CascadeNet, chosen: dict) -> CascadeNet:
    """`net` as one routing the calibration chose between (`fixed`: the most frequent
    sub-networks fixed for good; `fitted`: the predictors route, fixed -1, at their
    calibrated `route_offset`), with that routing's own thresholds: a copy, `net` unchanged."""
    variant = copy.deepcopy(net)
    for k, choice in chosen["fixed"].items():
        variant.blocks[k].fixed.fill_(choice)
        if choice < 0:
            variant.blocks[k].route_offset.fill_(chosen.get("route_offsets", {}).get(k, 0.0))
    variant.thresholds.copy_(chosen["thresholds"])
    return variant.eval()


def set_route_offsets(net: CascadeNet, offsets: dict[int, float]) -> None:
    """Each module k's `route_offset` to `offsets[k]`."""
    for k, offset in offsets.items():
        net.blocks[k].route_offset.fill_(offset)


def share_offsets(margins: Tensor, routed: list[int], share: float) -> dict[int, float]:
    """Per routed module, the offset on its most expensive sub-network's score that sends
    `share` of the images to it: minus the `1 - share` quantile of the predictor's margins
    (`ExitTable.margins`, taken at offset 0); 0 for `share` 0 (the predictor's argmax)."""
    if share == 0.0:
        return dict.fromkeys(routed, 0.0)
    return {k: -float(torch.quantile(margins[:, k].float(), 1.0 - share)) + 1e-6
            for k in routed}


def best_offsets(net: CascadeNet, routed: list[int], shares: tuple[float, ...],
                 table_for: Callable[[dict[int, int] | None], ExitTable],
                 at_zero: tuple[ExitTable, ThresholdGrid, Tensor],
                 scored: Callable[[ExitTable], ThresholdGrid],
                 calibrate: Callable[[ThresholdGrid], Tensor],
                 rank: Callable[[dict[str, float]], tuple]
                 ) -> tuple[float, dict[int, float], ExitTable, ThresholdGrid, Tensor]:
    """The predictors' operating point: their argmax (`at_zero`: its table, grid and
    thresholds, already made) or, for each of `shares`, the offsets that send that share of
    the validation images to each routed module's most expensive sub-network
    (`share_offsets`); the one whose calibrated cascade ranks best (the argmax among ties),
    with its share (0: the argmax), offsets, table, grid and thresholds. `net`'s routed
    modules are left at its offsets."""
    margins = at_zero[0].margins
    best = (rank(at_zero[0].outcome(at_zero[2])), 0.0, dict.fromkeys(routed, 0.0), *at_zero)
    for share in shares if margins is not None else ():
        offsets = share_offsets(margins, routed, share)
        set_route_offsets(net, offsets)
        table = table_for(None)
        grid = scored(table)
        thresholds = calibrate(grid)
        score = rank(table.outcome(thresholds))
        if score < best[0]:
            best = (score, share, offsets, table, grid, thresholds)
    set_route_offsets(net, best[2])
    return best[1:]


def calibrate_cascade(net: CascadeNet, table_for: Callable[[dict[int, int] | None], ExitTable],
                      costs: dict[str, float], goal: CalibrationGoal) -> CalibratedCascade:
    """Calibrates `net`'s thresholds (and, where predictors route, its routing) for `goal` on
    the validation tables `table_for(fixed)` gives (`fixed`: sub-network choices fixed for
    good, None: as `net` routes); `costs`: each part's cost (the latency table). `net` is left
    with the winner's thresholds and fixed choices (module docstring)."""
    full_cost = full_network_cost(net, costs)

    def scored(table: ExitTable) -> ThresholdGrid:
        """The table's grid, on its net accuracy or (by default) its losses alone."""
        return threshold_grid(table if goal.count_gains else table.losses_only())

    set_route_offsets(net, dict.fromkeys(
        [k for k in range(net.modules_count) if net.is_super(k)], 0.0))
    table = table_for(None)  # the predictors' argmax: the calibration sets any offset anew
    full = full_network(net)
    plain = table_for(full)
    full_accuracy = plain.full_accuracy()
    target = full_accuracy - goal.accuracy_tolerance
    budget = None if goal.latency_budget is None else goal.latency_budget * full_cost

    def calibrate(grid: ThresholdGrid) -> Tensor:
        if goal.thresholds is not None:
            return torch.tensor(goal.thresholds)
        if goal.calibrate == "budget":
            return grid.most_accurate(budget)
        return grid.cheapest(target)

    def rank(outcome: dict[str, float]) -> tuple[bool, float]:
        """Lower is better: whether the goal is missed, then the cost (or the accuracy)."""
        if goal.calibrate == "budget":
            return outcome["mean_cost"] > budget + 1e-12, -outcome["accuracy"]
        return outcome["accuracy"] < target - 1e-9, outcome["mean_cost"]

    grid = scored(table)  # scored once, queried for every calibration below
    thresholds = calibrate(grid)
    routed = [k for k in range(net.modules_count) if net.is_super(k)
              and int(net.blocks[k].fixed) < 0]
    predictors: dict[str, float] = {}
    routing: dict[str, dict] = {}  # `fixed`, `fitted`: {"fixed": {k: s}, "thresholds": ...}
    chosen: Routing | None = None
    if routed and goal.thresholds is None:
        # (A most frequent choice can lose more than the tolerance by itself: the target is
        # the most expensive network's accuracy; then no exit at all would be "calibrated".)
        majority = {k: int(table.paths[:, k].mode().values) for k in routed}
        share, offsets, fitted_table, fitted_grid, fitted_thresholds = best_offsets(
            net, routed, goal.route_shares, table_for, (table, grid, thresholds), scored,
            calibrate, rank)
        choices = {"most frequent": (majority, table_for(majority)),
                   "most expensive": ({k: full[k] for k in routed}, plain),
                   "predictors": (None, fitted_table)}
        calibrated = {"predictors": (fitted_grid, fitted_thresholds)}
        for choice, (fixed, candidate) in choices.items():
            if fixed is not None:
                candidate_grid = scored(candidate)
                calibrated[choice] = (candidate_grid, calibrate(candidate_grid))
        outcomes = {choice: choices[choice][1].outcome(calibrated[choice][1])
                    for choice in choices}
        best = min(choices, key=lambda choice: rank(outcomes[choice]))  # first among ties
        chosen = CHOICES[best]
        theirs, fitted = outcomes["most frequent"], outcomes["predictors"]
        predictors = {"predictors_kept": float(best == "predictors"),
                      "most_expensive_fixed": float(best == "most expensive"),
                      "val_accuracy_predictors_fixed": theirs["accuracy"],
                      "val_cost_ratio_predictors_fixed": theirs["mean_cost"] / full_cost,
                      "val_accuracy_predictors_fitted": fitted["accuracy"],
                      "val_cost_ratio_predictors_fitted": fitted["mean_cost"] / full_cost,
                      "route_share": share,
                      **{f"route_offset_{k}": offset for k, offset in offsets.items()}}
        routing = {"fixed": {"fixed": majority, "thresholds": calibrated["most frequent"][1]},
                   "fitted": {"fixed": dict.fromkeys(routed, -1), "route_offsets": offsets,
                              "thresholds": calibrated["predictors"][1]}}
        fixed, table = choices[best]
        grid, thresholds = calibrated[best]
        for k, choice in (fixed or {}).items():
            net.blocks[k].fixed.fill_(choice)
    net.thresholds.copy_(thresholds)
    outcome = table.outcome(thresholds)
    plain_thresholds = scored(plain).cheapest(target)
    metrics = {"val_accuracy": outcome["accuracy"], "val_full_accuracy": full_accuracy,
               "val_routed_accuracy": table.full_accuracy(),
               "val_cost_ratio": outcome["mean_cost"] / full_cost,
               "val_plain_cost_ratio": plain.outcome(plain_thresholds)["mean_cost"] / full_cost,
               **{f"val_{k}": v for k, v in outcome.items() if k.startswith("exit_share")},
               **{f"threshold_{k}": t for k, t in enumerate(thresholds.tolist())}, **predictors}
    return CalibratedCascade(
        thresholds=thresholds, plain_thresholds=plain_thresholds,
        sweep={str(t): grid.cheapest(full_accuracy - t) for t in SWEEP}, routing=routing,
        chosen=chosen, metrics=metrics)
