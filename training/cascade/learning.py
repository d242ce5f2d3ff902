"""How a cascade (`models.cascade`) learns and is calibrated, in pure torch.

1. Difficulty: each training image gets a documented difficulty (`difficulty`: a reference
   model's cross-entropy on it, or its softmax margin; `out_of_fold_logits`: a linear model's)
   and module k trains on the easiest `fractions[k]` of the first training set (`curriculum`), so
   a module nearer the input never gets a harder set than one after it. Modules train input side
   first (`StageModel`).
2. A super-network module trains all its sub-networks on the module's exit (their mean
   cross-entropy) and its predictor by a latency-aware loss (`routing_loss`): the expected
   cost, under the predictor's choice, of `error + weight x time`, where error is whether the
   sub-network's predicted class misses the true one and time its measured computation time
   over the most expensive one's. A cheaper sub-network wins where it is right. By default
   (joint) the modules before module k train along on its set, every exit on its own
   cross-entropy, so the early modules end up trained on every image; `frozen` keeps them.
3. The predictor is then fitted again on a second training set, disjoint from the first
   (`predictor_step`: on the first set the sub-networks are right too often to tell them
   apart), or one sub-network is chosen for good on it (`fixed_choice`).
4. Every exit head but the last is refitted on the finished network (`distill_exits`): its
   classifier, on the pooled maps the frozen network gives along the paths inference takes,
   learns the final exit's softened outputs beside the labels (knowledge distillation from
   the network's own last exit, as in self-distillation and SDN). In training each early
   head last learned, by cross-entropy, on the hardest module's set, while the modules under
   it moved on; refitted, it agrees with the last exit more often, so more images can leave
   early for the same accuracy.
5. The exit thresholds are calibrated on validation from an `ExitTable` (every image's
   confidence, correctness and cost at every exit of the path the predictors choose for it;
   by default counting only the images an early exit loses, `ExitTable.losses_only`):
   every combination of candidate thresholds is scored (`threshold_grid`), and the cheapest
   that keeps an accuracy (`calibrate_for_accuracy`) or the most accurate within a cost
   (`calibrate_for_budget`) is taken; which routing wins: `training.cascade.calibration`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.cascade import CascadeNet, CascadeSpec, SuperModule, build_cascade, confidence_of
from training.baselines import fit_linear, flatten_pixels
from training.distributed import Distributed
from training.latency import path_costs
from training.loops import Step
from training.recipe import sgd, train_round
from training.rounds import whole_step

Batches = Iterable[tuple[Tensor, Tensor, Tensor]]
DIFFICULTY = ("loss", "margin")


def difficulty(logits: Tensor, labels: Tensor, measure: str = "loss") -> Tensor:
    """Each image's difficulty under a reference model's `logits` (higher: harder): `loss`,
    its cross-entropy; `margin`, the largest other class's probability minus the true
    class's (in [-1, 1])."""
    if measure == "loss":
        return F.cross_entropy(logits.float(), labels, reduction="none")
    if measure == "margin":
        probs = logits.float().softmax(1)
        true = probs.gather(1, labels[:, None]).squeeze(1)
        other = probs.scatter(1, labels[:, None], -1.0).max(1).values
        return other - true
    raise ValueError(f"difficulty measure must be one of {DIFFICULTY}, got {measure!r}")


def out_of_fold_logits(images: torch.Tensor, labels: torch.Tensor, seed: int,
                       l2: float = 1e-3) -> torch.Tensor:
    """A linear classifier's logits on the raw pixels of each image, fitted on the other half
    of the images (two folds), so no image is scored by a model that saw it."""
    x = flatten_pixels(images)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    halves = (order[: len(x) // 2], order[len(x) // 2:])
    logits = torch.zeros(len(x), int(labels.max()) + 1)
    for fit, score in (halves, halves[::-1]):
        mean, std = x[fit].mean(0), x[fit].std(0).clamp_min(1e-3)
        weight, bias = fit_linear((x[fit] - mean) / std, labels[fit], l2, logits.shape[1])
        logits[score] = (x[score] - mean) / std @ weight + bias
    return logits


def curriculum(scores: Tensor, fractions: tuple[float, ...]) -> list[Tensor]:
    """Module k's training set: the positions of the easiest `fractions[k]` of the images by
    `scores` (ascending positions). The fractions must not fall and the last must be 1, so a
    module never gets a harder set than one after it and the last sees every image."""
    if any(not 0.0 < f <= 1.0 for f in fractions) or list(fractions) != sorted(fractions):
        raise ValueError(f"curriculum fractions must rise within (0, 1], got {fractions}")
    if fractions[-1] != 1.0:
        raise ValueError(f"the last module's curriculum fraction must be 1, got {fractions[-1]}")
    order = scores.argsort(stable=True)
    return [order[:max(1, round(f * len(order)))].sort().values for f in fractions]


def split_disjoint(count: int, second_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Positions 0..count-1 split at random into a first and a disjoint second set."""
    if not 0.0 < second_fraction < 1.0:
        raise ValueError(f"the second set's fraction must be in (0, 1), got {second_fraction}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    second = max(1, round(second_fraction * count))
    return order[second:].sort().values, order[:second].sort().values


def relative_costs(net: CascadeNet, costs: dict[str, float], k: int) -> Tensor:
    """Module k's sub-networks' measured times over the most expensive one's."""
    times = torch.tensor([costs[f"{k}.sub{s}"] for s in range(net.sub_count(k))])
    return times / times.max()


def routing_loss(route_logits: Tensor, errors: Tensor, relative_time: Tensor, weight: float
                 ) -> Tensor:
    """The latency-aware loss of a predictor: the expected `error + weight x time` of the
    sub-network it picks, under its softmax.

    Args:
        route_logits: (N, S) the predictor's scores for the S sub-networks.
        errors: (N, S) 1 where sub-network s predicts the wrong class for image n, else 0.
        relative_time: (S,) each sub-network's time over the most expensive one's.
        weight: how many errors the most expensive sub-network's time is worth.
    """
    cost = errors + weight * relative_time.to(errors.device)[None, :]
    return (route_logits.float().softmax(1) * cost).sum(1).mean()


def oracle_choice(errors: Tensor, relative_time: Tensor) -> Tensor:
    """Per image, the oracle's sub-network: the cheapest that gets it right, or the cheapest
    of all where none does (N). `errors` (N, S) as in `routing_loss`, `relative_time` (S,)
    at most 1, so an error outweighs any difference in time."""
    return (2 * errors + relative_time.to(errors.device)[None, :]).argmin(1)


def oracle_routing_loss(route_logits: Tensor, errors: Tensor, relative_time: Tensor) -> Tensor:
    """The predictor's cross-entropy toward `oracle_choice`: it learns which sub-network each
    image needs, and the calibration then sets how readily it sends an image to the expensive
    one (`SuperModule.route_offset`), instead of a latency weight fixed before training."""
    return F.cross_entropy(route_logits.float(), oracle_choice(errors, relative_time))


class StageModel(nn.Module):
    """Module `k` of a cascade for training. `frozen`: the modules before it stay as they are,
    in eval mode (their BatchNorm statistics untouched), and module k's block, exit and
    predictor train; else (joint) the modules before it and their exits train along, on
    module k's set (`module_step`). `predictor_only`: only module k's predictor trains."""

    def __init__(self, net: CascadeNet, k: int, frozen: bool = True,
                 predictor_only: bool = False) -> None:
        super().__init__()
        self.net, self.k, self.frozen, self.predictor_only = net, k, frozen, predictor_only
        if predictor_only and not net.is_super(k):
            raise ValueError(f"module {k} is not a super-network module: it has no predictor")

    def trained(self) -> list[nn.Module]:
        """The sub-modules whose parameters this stage trains."""
        if self.predictor_only:
            return [self.net.blocks[self.k].predictor]
        first = self.k if self.frozen else 0
        return [m for j in range(first, self.k + 1) for m in (self.net.blocks[j],
                                                              self.net.exits[j])]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.trained() for p in m.parameters()]

    def train(self, mode: bool = True) -> StageModel:
        self.training = mode
        self.net.eval()
        for module in self.trained():
            module.train(mode)
        return self

    def forward(self, x: Tensor) -> Tensor:
        """Module k's exit logits (its most expensive sub-network in a super-network module),
        the modules before it routed as in inference."""
        with torch.no_grad():
            features = self.net.prefix(x, self.k)
        choice = self.net.most_expensive(self.k) if self.net.is_super(self.k) else None
        return self.net.exits[self.k](self.net.run_module(self.k, features, choice))


def _joint_prefix(net: CascadeNet, k: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The feature map entering module k with gradients, and the summed cross-entropy of the
    exits before it: a super-network module runs every sub-network on every image (each
    trained on its exit) and passes on, per image, the output of one drawn at random, so the
    modules after it learn from every sub-network's output (the full network's path
    included), not only from those a predictor would pick."""
    features = net.fit_input(x)
    losses = []
    for j in range(k):
        module = net.blocks[j]
        if isinstance(module, SuperModule):
            choice = torch.randint(len(module.subnets), (len(x),), device=x.device)
            outs = torch.stack([subnet(features) for subnet in module.subnets])
            losses += [F.cross_entropy(net.exits[j](out), y) / len(outs) for out in outs]
            features = outs[choice, torch.arange(len(choice), device=choice.device)]
        else:
            features = module(features)
            losses.append(F.cross_entropy(net.exits[j](features), y))
    return features, (torch.stack(losses).sum() if losses else features.new_zeros(()))


def _sub_outputs(net: CascadeNet, k: int, features: Tensor, labels: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """Module k's sub-networks on `features`: per-image cross-entropies and errors, (N, S)."""
    module = net.blocks[k]
    assert isinstance(module, SuperModule)
    losses, errors = [], []
    for subnet in module.subnets:
        logits = net.exits[k](subnet(features))
        losses.append(F.cross_entropy(logits, labels, reduction="none"))
        errors.append((logits.argmax(1) != labels).float())
    return torch.stack(losses, 1), torch.stack(errors, 1)


def module_step(net: CascadeNet, k: int, relative_time: Tensor | None, latency_weight: float,
                label_smoothing: float = 0.0, frozen: bool = True) -> Step:
    """The training step of module k (the model given to the step is its `StageModel`):
    a plain module's exit cross-entropy; a super-network module's mean cross-entropy over its
    sub-networks plus the predictor's `routing_loss` (`loss_route`). Not `frozen`: the exits
    before it add theirs (`_joint_prefix`), and `loss_ce` is the mean over the k + 1 exits."""

    def step(_model: nn.Module, _ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        if frozen:
            with torch.no_grad():
                features = net.prefix(x, k, random_routes=True)
            earlier = features.new_zeros(())
        else:
            features, earlier = _joint_prefix(net, k, x, y)
        route = None
        if not net.is_super(k):
            logits = net.exits[k](net.blocks[k](features))
            own = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
        else:
            losses, errors = _sub_outputs(net, k, features, y)
            own = losses.mean()
            route = routing_loss(net.predictor_scores(k, features.detach()), errors,
                                 relative_time, latency_weight)
        ce = own if frozen else (earlier + own) / (k + 1)
        result = {"loss": ce if route is None else ce + route, "loss_ce": ce}
        return result if route is None else result | {"loss_route": route}

    return step


@dataclass(frozen=True)
class CascadeNetwork:
    """A cascade network's spec (`training.rounds.NetworkSpec`)."""

    spec: CascadeSpec
    channels: int
    classes: int

    def build(self) -> CascadeNet:
        return build_cascade(self.spec, self.channels, self.classes)


@dataclass(frozen=True)
class ModuleStep:
    """The step spec (`training.rounds.StepSpec`) of module k's round: `module_step` on its
    `StageModel`, whose parameters the optimizer holds. In a DDP job the network's other
    parameters need no gradients, and each process draws its own random routes, seeded by
    `route_seed` and its rank."""

    k: int
    frozen: bool
    relative_time: Tensor | None
    latency_weight: float
    label_smoothing: float
    route_seed: int

    def extras(self) -> dict[str, nn.Module]:
        return {}

    def parameters(self, model: nn.Module, extras: dict[str, nn.Module]
                   ) -> list[nn.Parameter]:
        return StageModel(model, self.k, self.frozen).trainable_parameters()

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        stage = StageModel(model, self.k, self.frozen)
        if place.world_size > 1:
            trained = set(stage.trainable_parameters())
            for parameter in model.parameters():
                parameter.requires_grad_(parameter in trained)
            torch.manual_seed(self.route_seed * 1000 + place.rank)
        step = module_step(model, self.k, self.relative_time, self.latency_weight,
                           self.label_smoothing, self.frozen)
        return whole_step(stage, step, device, place)


def predictor_step(net: CascadeNet, k: int, relative_time: Tensor, latency_weight: float,
                   target: str = "cost") -> Step:
    """The step that fits module k's predictor alone (`StageModel(predictor_only=True)`), the
    sub-networks' errors computed with everything else frozen: by `routing_loss` (`target`
    `cost`) or by `oracle_routing_loss` (`oracle`)."""

    def step(_model: nn.Module, _ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            features = net.prefix(x, k)
            _, errors = _sub_outputs(net, k, features, y)
        logits = net.predictor_scores(k, features)
        route = (oracle_routing_loss(logits, errors, relative_time) if target == "oracle"
                 else routing_loss(logits, errors, relative_time, latency_weight))
        return {"loss": route, "loss_route": route}

    return step


@torch.no_grad()
def fixed_choice(net: CascadeNet, k: int, batches: Batches, relative_time: Tensor,
                 latency_weight: float) -> tuple[int, list[float]]:
    """The one sub-network of module k with the lowest `error rate + weight x time` on
    `batches` (a held-out set), and every sub-network's error rate there."""
    net.eval()
    wrong, seen = torch.zeros(net.sub_count(k)), 0
    for _, x, y in batches:
        _, errors = _sub_outputs(net, k, net.prefix(x, k), y)
        wrong += errors.sum(0).cpu()
        seen += len(y)
    rates = wrong / max(seen, 1)
    return int((rates + latency_weight * relative_time).argmin()), rates.tolist()


@torch.no_grad()
def exit_inputs(net: CascadeNet, batches: Batches) -> tuple[list[Tensor], Tensor, Tensor]:
    """What the exit heads see, along the path inference takes (each super-network module
    routed by its predictor or fixed choice): every exit but the last, its pooled map (the
    input of its classifier), (N, C_k x pool x pool); the last exit's logits (N, classes);
    the labels (N,)."""
    net.eval()
    last = net.modules_count - 1
    pooled: list[list[Tensor]] = [[] for _ in range(last)]
    final, labels = [], []
    for _, x, y in batches:
        features = net.fit_input(x)
        for k in range(net.modules_count):
            features = net.run_module(k, features)
            if k < last:
                pooled[k].append(net.exits[k].pool(features).float())
        final.append(net.exits[last](features).float())
        labels.append(y)
    return [torch.cat(p) for p in pooled], torch.cat(final), torch.cat(labels)


def exit_accuracies(net: CascadeNet, batches: Batches) -> list[float]:
    """Each exit's accuracy on `batches`, along the path inference takes."""
    inputs, final, labels = exit_inputs(net, batches)
    with torch.no_grad():
        logits = [net.exits[k].fc(x) for k, x in enumerate(inputs)] + [final]
    return [(out.argmax(1) == labels).float().mean().item() for out in logits]


def distillation_loss(logits: Tensor, teacher: Tensor, labels: Tensor, temperature: float,
                      weight: float) -> Tensor:
    """`weight x T^2 x KL(softmax(teacher / T) || softmax(logits / T)) + (1 - weight) x
    cross-entropy(logits, labels)` (Hinton et al.: T^2 keeps the soft term's gradients on
    the scale of the hard one's)."""
    soft = F.kl_div(F.log_softmax(logits / temperature, 1),
                    F.softmax(teacher / temperature, 1), reduction="batchmean")
    return weight * temperature ** 2 * soft + (1 - weight) * F.cross_entropy(logits, labels)


def distill_exits(net: CascadeNet, batches: Batches, epochs: int, lr: float,
                  temperature: float, weight: float, seed: int, batch_size: int = 256
                  ) -> dict[str, float]:
    """Refits the classifier (`fc`) of every exit head but the last to the last exit's softened
    outputs and the labels (`distillation_loss`), on the maps the frozen network gives for
    `batches` (computed once: the blocks, predictors and the last exit do not change), by the
    recipe's loop (`training.recipe.train_round`: SGD with momentum, a cosine schedule over
    `epochs` passes of `batch_size` maps, shuffled from `seed`). Returns each head's mean
    loss over its last pass (`exit{k}_distill_loss`)."""
    inputs, teacher, labels = exit_inputs(net, batches)
    generator = torch.Generator().manual_seed(seed)
    size = min(batch_size, len(labels))

    def step(model: nn.Module, ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"loss": distillation_loss(model(x), teacher[ids], y, temperature, weight)}

    metrics = {}
    for k, maps in enumerate(inputs):
        head = net.exits[k].fc

        def batches_for(_epoch: int, maps: Tensor = maps) -> list[tuple[Tensor, Tensor, Tensor]]:
            order = torch.randperm(len(labels), generator=generator).to(labels.device)
            return [(rows, maps[rows], labels[rows]) for rows in order.split(size)
                    if len(rows) == size]  # a short last batch is dropped

        losses = train_round(head, sgd(head.parameters(), lr, 0.9, 5e-4), batches_for, step,
                             labels.device, range(epochs), lr, (0, epochs))
        head.eval()
        metrics[f"exit{k}_distill_loss"] = losses.get("loss", 0.0)
    return metrics


@dataclass
class ExitTable:
    """Every image's confidence, correctness and cumulative cost at every exit, (N, K), along
    the path its predictors choose (or the fixed sub-networks); `paths` (N, K) holds those
    sub-network indices, `routed` whether the predictors' time counts (`path_costs`)."""

    confidence: Tensor
    correct: Tensor
    cost: Tensor
    paths: Tensor | None = None
    routed: bool | None = None
    margins: Tensor | None = None  # (N, K): see `exit_table`

    def priced(self, net: CascadeNet, costs: dict[str, float]) -> ExitTable:
        """The same images and paths at other per-part costs (FLOPs instead of time, say)."""
        return replace(self, cost=_cost_table(net, self.paths, costs, self.routed))

    def outcome(self, thresholds: Tensor) -> dict[str, float]:
        """What the cascade does with `thresholds` (K - 1 values; an image leaves at the first
        exit whose confidence is above its threshold, else at the last): `accuracy`,
        `mean_cost` and each exit's share of the images (`exit_share_k`)."""
        exits = self.exits(thresholds)
        rows = torch.arange(len(exits))
        result = {"accuracy": self.correct[rows, exits].float().mean().item(),
                  "mean_cost": self.cost[rows, exits].mean().item()}
        shares = torch.bincount(exits, minlength=self.cost.shape[1]).float() / len(exits)
        return result | {f"exit_share_{k}": v for k, v in enumerate(shares.tolist())}

    def exits(self, thresholds: Tensor) -> Tensor:
        """The exit each image leaves at (0-based)."""
        count, modules = self.confidence.shape
        leave = torch.cat([self.confidence[:, :-1] > thresholds[None, :],
                           torch.ones(count, 1, dtype=torch.bool)], 1)
        return leave.float().argmax(1)  # the first True

    def full_accuracy(self) -> float:
        """The accuracy with no early exits (every image at the last exit)."""
        return self.correct[:, -1].float().mean().item()

    def losses_only(self) -> ExitTable:
        """The same table where an early exit counts as right only where the last exit is
        right too. Its accuracy is the last exit's minus the images an early exit loses
        (right at the last exit, wrong where they left): images an early exit gets right and
        the last misses no longer pay for losses. Thresholds calibrated on it cannot spend
        the validation split's chance gains (on Fashion-MNIST, calibrated on the net
        accuracy, the test split lost twice the tolerance)."""
        return replace(self, correct=self.correct & self.correct[:, -1:])


@torch.no_grad()
def exit_table(net: CascadeNet, batches: Batches, costs: dict[str, float],
               fixed: dict[int, int] | None = None) -> ExitTable:
    """The `ExitTable` of `batches` (every image through every module, for calibration and
    analysis; inference itself is `CascadeNet.infer`). `costs`: each part's cost per image
    (`training.latency.part_costs`); `fixed`: sub-networks given instead of routing.
    `margins` (N, K): where a predictor routes module k, its score of the most expensive
    sub-network minus the best other's (offset included: positive where it is chosen); NaN
    elsewhere."""
    net.eval()
    modules = net.modules_count
    confidence, correct, paths, margins = [], [], [], []
    for _, x, y in batches:
        features = net.fit_input(x)
        path = torch.zeros(len(y), modules, dtype=torch.long)
        margin = torch.full((len(y), modules), float("nan"))
        conf_k, correct_k = [], []
        logits = None  # the last exit's
        for k in range(modules):
            choice = None
            if net.is_super(k) and fixed is not None and k in fixed:
                choice = torch.full((len(y),), fixed[k], device=features.device)
            elif net.is_super(k) and int(net.blocks[k].fixed) >= 0:
                choice = net.route(k, features)
            elif net.is_super(k):
                scores = net.blocks[k].scores(features, net.route_context(k, features, logits))
                choice = scores.argmax(1)
                margin[:, k] = (scores[:, -1] - scores[:, :-1].max(1).values).float().cpu()
            if choice is not None:
                path[:, k] = choice.cpu()
            features = net.run_module(k, features, choice)
            logits = net.exits[k](features)
            conf, pred = confidence_of(logits, net.spec.confidence)
            conf_k.append(conf.cpu())
            correct_k.append((pred == y).cpu())
        confidence.append(torch.stack(conf_k, 1))
        correct.append(torch.stack(correct_k, 1))
        paths.append(path)
        margins.append(margin)
    path = torch.cat(paths)
    routed = None if fixed is None else False
    return ExitTable(torch.cat(confidence), torch.cat(correct),
                     _cost_table(net, path, costs, routed), path, routed, torch.cat(margins))


def _cost_table(net: CascadeNet, paths: Tensor, costs: dict[str, float],
                routed: bool | None) -> Tensor:
    """(N, K): each image's cumulative cost at each exit of its path (`path_costs`)."""
    if not len(paths):
        return torch.zeros(0, net.modules_count)
    return torch.stack([torch.tensor(path_costs(net, costs, tuple(p), routed))
                        for p in paths.tolist()])


@dataclass
class ThresholdGrid:
    """Every combination of candidate thresholds for a table's K - 1 exits, scored at once:
    `thresholds` (C, K - 1), and the cascade's `accuracy` and `mean_cost` (C,) with each."""

    thresholds: Tensor
    accuracy: Tensor
    mean_cost: Tensor

    def cheapest(self, target: float) -> Tensor:
        """The thresholds of least mean cost whose accuracy is at least `target` (the most
        accurate of those on a tie); none leave early if no combination reaches it."""
        feasible = self.accuracy >= target - 1e-9
        if not bool(feasible.any()):
            return torch.ones(self.thresholds.shape[1])
        cost = torch.where(feasible, self.mean_cost, torch.inf)
        ties = feasible & (cost <= cost.min() + 1e-12)
        return self.thresholds[torch.where(ties, self.accuracy, -1.0).argmax()]

    def most_accurate(self, budget: float) -> Tensor:
        """The most accurate thresholds whose mean cost is at most `budget` (the cheaper on a
        tie); the cheapest of all when none is within it (the caller reports the miss)."""
        within = self.mean_cost <= budget + 1e-12
        if not bool(within.any()):
            return self.thresholds[self.mean_cost.argmin()]
        accuracy = torch.where(within, self.accuracy, -1.0)
        ties = within & (accuracy >= accuracy.max() - 1e-12)
        return self.thresholds[torch.where(ties, self.mean_cost, torch.inf).argmin()]


def threshold_grid(table: ExitTable, combinations: int = 40_000) -> ThresholdGrid:
    """Scores every combination of candidate thresholds on the table: for each exit but the
    last, 1e-6 (every image leaves), the quantiles of its confidences (as many as `combinations`
    allows over K - 1 exits: 200 each for K = 3) and 1 (no image leaves). Searching the exits
    jointly finds cascades that a greedy, exit-by-exit order misses: spending all the accuracy
    that may be given up at the first exit can leave none for a later exit that is still far
    cheaper than the last."""
    count, modules = table.confidence.shape
    per_exit = max(2, int(combinations ** (1 / (modules - 1))))
    levels = torch.linspace(0, 1, per_exit)
    candidates = [torch.cat([table.confidence[:, k].float().quantile(levels),
                             torch.tensor([0.0, 1.0])]).clamp(min=1e-6).unique()
                  for k in range(modules - 1)]  # thresholds live in (0, 1]
    grid = torch.cartesian_prod(*candidates).reshape(-1, modules - 1)
    correct, cost = table.correct.float(), table.cost.float()
    accuracy, mean_cost = [], []
    for trial in grid.split(max(1, 2 ** 22 // max(count, 1))):
        # from the last exit back: an image that leaves at exit k takes exit k's outcome
        right = correct[:, -1].expand(len(trial), -1)
        spent = cost[:, -1].expand(len(trial), -1)
        for k in range(modules - 2, -1, -1):
            leave = table.confidence[None, :, k] > trial[:, k, None]
            right = torch.where(leave, correct[None, :, k], right)
            spent = torch.where(leave, cost[None, :, k], spent)
        accuracy.append(right.mean(1))
        mean_cost.append(spent.mean(1))
    return ThresholdGrid(grid, torch.cat(accuracy), torch.cat(mean_cost))


def calibrate_for_accuracy(table: ExitTable, target: float) -> Tensor:
    """The cheapest thresholds on the table whose accuracy is at least `target`."""
    return threshold_grid(table).cheapest(target)


def calibrate_for_budget(table: ExitTable, budget: float) -> Tensor:
    """The most accurate thresholds on the table whose mean cost is at most `budget` (in the
    table's cost unit)."""
    return threshold_grid(table).most_accurate(budget)


def oracle(net: CascadeNet, batches: Batches, costs: dict[str, float]) -> dict[str, float]:
    """Each image leaves at the cheapest (exit, sub-networks) that gets it right, no
    predictor run; an image no path gets right costs the cheapest path's last exit. Returns
    `accuracy` and `mean_cost`."""
    return oracles(net, batches, [costs])[0]


@torch.no_grad()
def oracles(net: CascadeNet, batches: Batches, tables: Sequence[dict[str, float]]
            ) -> list[dict[str, float]]:
    """`oracle` under each of several cost tables (the measured times, the FLOPs, ...), from
    one pass of every path over `batches`: which exits get an image right does not depend on
    the costs, only which of them is cheapest."""
    net.eval()
    right, images = 0, 0
    spent: list[list[Tensor]] = [[] for _ in tables]
    for _, x, y in batches:
        correct = {path: [(exit_logits.argmax(1) == y).cpu() for exit_logits in logits]
                   for path, logits in net.exit_logits_of_paths(x).items()}
        found = torch.stack([c for per_exit in correct.values() for c in per_exit]).any(0)
        right, images = right + int(found.sum()), images + len(y)
        for costs, kept in zip(tables, spent, strict=True):
            best = torch.full((len(y),), float("inf"))
            fallback = float("inf")
            for path, per_exit in correct.items():
                cumulative = path_costs(net, costs, path, routed=False)
                fallback = min(fallback, cumulative[-1])
                for k, hit in enumerate(per_exit):
                    best = torch.where(hit, best.clamp(max=cumulative[k]), best)
            kept.append(torch.where(found, best, torch.full_like(best, fallback)))
    return [{"accuracy": right / max(images, 1), "mean_cost": torch.cat(kept).mean().item()}
            for kept in spent]
