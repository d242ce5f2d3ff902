"""The cascade: K modules in a row, each with its own exit; an image leaves at the first exit
that is confident enough.

A module is a block of two 3x3 conv-BN-ReLU layers (`hidden` channels, then the module's
`out` channels; the first has stride 2, so each module halves the map: 28, 14, 7, 4 pixels)
followed by an exit head (average pooling to a grid, then a classifier: one hidden layer for
the early exits, linear for the last). A super-network module holds two or more such blocks
with the same input and output shapes but different hidden widths (cost), and a predictor, a
small network on the incoming feature map, that picks one per image.

`CascadeNet.infer` runs the real cascade: the images still in play are regrouped after every
exit and only they run the next module; inside a super-network module each image runs only
the sub-network chosen for it. Nothing is computed for an image after it has left.
`forward` is the full network (every super-network module at its most expensive sub-network,
no exits), the reference the cascade is measured against.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torchvision.ops import Conv2dNormActivation

from models.registry import ImageClassifier

CONFIDENCE = ("max_softmax", "entropy")


@dataclass(frozen=True)
class CascadeSpec:
    """The cascade's shape.

    Attributes:
        widths: each module's output channels; K = len(widths).
        super_modules: the 0-based indices of the super-network modules.
        sub_widths: each sub-network's hidden width as a multiple of its module's output
            width, cheapest first (two or more).
        confidence: `max_softmax` (the largest class probability) or `entropy` (1 minus the
            prediction's entropy over log C); both in [0, 1].
        exit_pool: each exit head pools its map to `exit_pool` x `exit_pool` cells before
            its classifier (1: global average pooling, which throws away where things are).
        exit_hidden: the early exits' classifier is a hidden layer of `exit_hidden` units
            (ReLU) and a linear layer; 0: a linear layer. The last exit's is always linear,
            so the full network is the same whatever the early exits are.
        route_context: a super-network module's predictor also reads the class
            probabilities of the exit before it (computed anyway where the cascade runs; a
            module at the input has none), not only its pooled incoming map.
    """

    widths: tuple[int, ...] = (16, 64, 128)
    super_modules: tuple[int, ...] = (1, 2)
    sub_widths: tuple[float, ...] = (0.5, 2.0)
    confidence: str = "max_softmax"
    exit_pool: int = 4
    exit_hidden: int = 64
    route_context: bool = False

    def __post_init__(self) -> None:
        if len(self.widths) < 2:
            raise ValueError(f"a cascade needs at least 2 modules, got widths {self.widths}")
        if not self.super_modules:
            raise ValueError("a cascade needs at least one super-network module")
        bad = [k for k in self.super_modules if not 0 <= k < len(self.widths)]
        if bad:
            raise ValueError(f"super_modules {bad} are not module indices "
                             f"0..{len(self.widths) - 1}")
        if len(self.sub_widths) < 2:
            raise ValueError(f"a super-network module needs two or more sub-networks, got "
                             f"sub_widths {self.sub_widths}")
        if self.confidence not in CONFIDENCE:
            raise ValueError(f"confidence must be one of {CONFIDENCE}, got {self.confidence!r}")
        if self.exit_pool < 1:
            raise ValueError(f"exit_pool must be at least 1, got {self.exit_pool}")
        if self.exit_hidden < 0:
            raise ValueError(f"exit_hidden must be 0 or more, got {self.exit_hidden}")


def block(in_channels: int, hidden: int, out_channels: int, stride: int) -> nn.Sequential:
    """Two 3x3 conv-BN-ReLU layers, the first with `stride`."""
    return nn.Sequential(Conv2dNormActivation(in_channels, hidden, 3, stride=stride),
                         Conv2dNormActivation(hidden, out_channels, 3))


class ExitHead(nn.Module):
    """An exit: average pooling to `pool` x `pool` cells and a classifier `fc`, linear or
    (`hidden` > 0) one hidden ReLU layer and a linear layer. A coarse grid keeps the layout
    that global pooling loses (on Fashion-MNIST a linear model of the raw pixels reaches 0.84;
    of 16 globally pooled channels far less) for a few thousand multiply-adds more, and the
    hidden layer lets an early exit agree with the last one on more images (refitted to it,
    the first exit's accuracy rose 1.3 points for 15k more multiply-adds), so more images leave
    early at the same accuracy."""

    def __init__(self, channels: int, num_classes: int, pool: int = 1, hidden: int = 0) -> None:
        super().__init__()
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(pool), nn.Flatten())
        inputs = channels * pool * pool
        self.fc = nn.Linear(inputs, num_classes) if not hidden else nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(x))


class RoutePredictor(nn.Sequential):
    """A super-network module's predictor: the incoming map averaged over 2 x 2 cells, with
    `context` more values appended (the previous exit's class probabilities; zeros where none
    are given), a hidden layer of 32 (ReLU) and one score per sub-network. Its layers are
    numbered as the plain sequence before `context` existed, so older checkpoints load."""

    def __init__(self, in_channels: int, outputs: int, context: int = 0) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * in_channels + context, 32), nn.ReLU(inplace=True),
                         nn.Linear(32, outputs))
        self.context = context

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        pooled = self[1](self[0](x))
        if self.context:
            if context is None:
                context = pooled.new_zeros(len(pooled), self.context)
            pooled = torch.cat([pooled, context.to(pooled.dtype)], 1)
        return self[4](self[3](self[2](pooled)))


class SuperModule(nn.Module):
    """Interchangeable sub-networks (same input and output shapes, different cost, cheapest
    first) and a predictor that picks one per image from the incoming feature map.

    `fixed` (a buffer, so checkpoints carry it) is -1 while the predictor chooses; a
    sub-network's index when one was chosen for good (`training.cascade.learning.fixed_choice`).
    `route_offset` (a buffer too) is added to the predictor's score of the most expensive
    sub-network before the choice: the predictor's operating point, set by the calibration on
    validation (`training.cascade.calibration`); 0 until then, and in checkpoints written
    before it existed.
    """

    def __init__(self, subnets: list[nn.Module], in_channels: int, context: int = 0) -> None:
        super().__init__()
        self.subnets = nn.ModuleList(subnets)
        self.predictor = RoutePredictor(in_channels, len(subnets), context)
        self.reset_predictor()
        self.register_buffer("fixed", torch.tensor(-1))
        self.register_buffer("route_offset", torch.tensor(0.0))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "route_offset", torch.tensor(0.0))  # older checkpoints
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def reset_predictor(self) -> None:
        """A fresh predictor whose last layer is zero: every sub-network equally likely, so
        its softmax starts unsaturated (random weights on unnormalized feature maps give
        scores so far apart that the gradient of the choice vanishes)."""
        for layer in self.predictor:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        nn.init.zeros_(self.predictor[-1].weight)
        nn.init.zeros_(self.predictor[-1].bias)

    def route(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """The sub-network index for each image (the fixed one, or the predictor's choice;
        `context`: what `RoutePredictor` appends, where it reads any)."""
        if int(self.fixed) >= 0:
            return torch.full((len(x),), int(self.fixed), dtype=torch.long, device=x.device)
        return self.scores(x, context).argmax(1)

    def scores(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """The predictor's score per sub-network (N x S), `route_offset` added to the most
        expensive one's (the last: cheapest first)."""
        scores = self.predictor(x, context)
        return torch.cat([scores[:, :-1], scores[:, -1:] + self.route_offset.to(scores.dtype)],
                         1)

    def forward(self, x: Tensor, choice: Tensor | int) -> Tensor:
        """Each image through its chosen sub-network only (`choice`: one index for all, or
        one per image)."""
        if isinstance(choice, int):
            return self.subnets[choice](x)
        picked = choice.unique().tolist()
        if len(picked) == 1:  # one sub-network for the whole batch: nothing to regroup
            return self.subnets[picked[0]](x)
        out: Tensor | None = None
        for index in picked:
            rows = (choice == index).nonzero().squeeze(1)
            part = self.subnets[index](x.index_select(0, rows))
            if out is None:
                out = part.new_empty((len(x), *part.shape[1:]))
            out.index_copy_(0, rows, part)
        assert out is not None, "an empty batch has no sub-network to run"
        return out


@dataclass
class CascadeOutput:
    """Per image: the predicted class, its confidence, the exit it left at (0-based) and the
    sub-network chosen in each module (-1: a plain module, or one the image never reached)."""

    labels: Tensor
    confidence: Tensor
    exits: Tensor
    choices: Tensor


def confidence_of(logits: Tensor, measure: str = "max_softmax") -> tuple[Tensor, Tensor]:
    """The confidence in [0, 1] and the predicted class of each row of `logits`."""
    probs = logits.float().softmax(1)
    top, labels = probs.max(1)
    if measure == "max_softmax":
        return top, labels
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(1)
    return 1.0 - entropy / math.log(logits.shape[1]), labels


class CascadeNet(ImageClassifier):
    """K modules with exits (see the module docstring); `thresholds` (a buffer of K - 1
    values in (0, 1]) holds each exit's calibrated threshold: an image leaves at exit k when
    its confidence is above it (1: the exit is never taken); the last exit takes every image
    still in play."""

    def __init__(self, spec: CascadeSpec, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.spec = spec
        blocks, exits = [], []
        channels = in_channels
        for k, out in enumerate(spec.widths):
            if k in spec.super_modules:
                subnets = [block(channels, max(1, round(out * m)), out, 2)
                           for m in spec.sub_widths]
                context = num_classes if spec.route_context and k > 0 else 0
                blocks.append(SuperModule(subnets, channels, context))
            else:
                blocks.append(block(channels, out, out, 2))
            last = k == len(spec.widths) - 1
            exits.append(ExitHead(out, num_classes, spec.exit_pool,
                                  0 if last else spec.exit_hidden))
            channels = out
        self.blocks = nn.ModuleList(blocks)
        self.exits = nn.ModuleList(exits)
        self.register_buffer("thresholds", torch.ones(len(spec.widths) - 1))
        self.feature_layers = tuple(f"blocks.{k}" for k in range(len(blocks)))

    @property
    def modules_count(self) -> int:
        return len(self.blocks)

    def is_super(self, k: int) -> bool:
        return isinstance(self.blocks[k], SuperModule)

    def sub_count(self, k: int) -> int:
        """The number of sub-networks of module k (1 for a plain module)."""
        module = self.blocks[k]
        return len(module.subnets) if isinstance(module, SuperModule) else 1

    def run_module(self, k: int, x: Tensor, choice: Tensor | int | None = None) -> Tensor:
        """Module k's block on `x`: a super-network module runs `choice` (None: its own
        route)."""
        module = self.blocks[k]
        if not isinstance(module, SuperModule):
            return module(x)
        return module(x, self.route(k, x) if choice is None else choice)

    def route_context(self, k: int, x: Tensor, previous: Tensor | None = None) -> Tensor | None:
        """What module k's predictor reads beside its map `x`: the class probabilities of exit
        k - 1 (its logits `previous` where already computed, else computed here, without
        gradient), or None where it reads none."""
        module = self.blocks[k]
        if not isinstance(module, SuperModule) or not module.predictor.context:
            return None
        with torch.no_grad():
            logits = self.exits[k - 1](x) if previous is None else previous
            return logits.float().softmax(1)

    def predictor_scores(self, k: int, x: Tensor, previous: Tensor | None = None) -> Tensor:
        """Module k's predictor's raw scores on its map `x` (no offset: what it is trained
        on)."""
        module = self.blocks[k]
        assert isinstance(module, SuperModule)
        return module.predictor(x, self.route_context(k, x, previous))

    def route(self, k: int, x: Tensor, previous: Tensor | None = None) -> Tensor:
        """Module k's sub-network for each image of its map `x` (`previous`: exit k - 1's
        logits, where already computed)."""
        module = self.blocks[k]
        assert isinstance(module, SuperModule)
        if int(module.fixed) >= 0:
            return module.route(x)
        return module.route(x, self.route_context(k, x, previous))

    def most_expensive(self, k: int) -> int:
        return self.sub_count(k) - 1

    def forward(self, x: Tensor) -> Tensor:
        """The full network: every module, each super-network module at its most expensive
        sub-network; the last exit's logits."""
        x = self.fit_input(x)
        for k in range(self.modules_count):
            x = self.run_module(k, x, self.most_expensive(k) if self.is_super(k) else None)
        return self.exits[-1](x)

    def prefix(self, x: Tensor, upto: int, random_routes: bool = False) -> Tensor:
        """The feature map entering module `upto`: the modules before it, routed as in
        inference, or (`random_routes`, for training the modules after a super-network
        module on every sub-network's output) each image through a sub-network drawn at
        random (torch's global generator)."""
        x = self.fit_input(x)
        for k in range(upto):
            choice = None
            if random_routes and self.is_super(k):
                choice = torch.randint(self.sub_count(k), (len(x),), device=x.device)
            x = self.run_module(k, x, choice)
        return x

    @torch.no_grad()
    def infer(self, x: Tensor, thresholds: Tensor | None = None,
              fixed: dict[int, int] | None = None) -> CascadeOutput:
        """The real cascade on a batch (see the module docstring). `thresholds` overrides the
        calibrated ones; `fixed` runs sub-network `fixed[k]` in super-network module k
        instead of routing (the benchmark's full network and plain cascade).

        The bookkeeping is kept to what the exits need: when every image of the batch stays
        (or leaves) at an exit, nothing is regrouped, so a batch of one image costs the
        modules it runs, their exit heads and one comparison per exit."""
        limits = (self.thresholds if thresholds is None else thresholds).tolist()
        count, device = len(x), x.device
        alive: Tensor | None = None  # rows of the batch still in play; None: all, in order
        left: list[tuple[Tensor | None, Tensor, Tensor, int]] = []  # rows, label, conf, exit
        routed: list[tuple[Tensor | None, int | Tensor, int]] = []  # rows, choice, module
        x = self.fit_input(x)
        last = self.modules_count - 1
        logits: Tensor | None = None  # the last exit's, for a predictor that reads them
        for k in range(self.modules_count):
            module = self.blocks[k]
            if isinstance(module, SuperModule):
                if fixed is not None and k in fixed:
                    choice: int | Tensor = fixed[k]
                elif int(module.fixed) >= 0:  # chosen for good: no predictor to run
                    choice = int(module.fixed)
                else:
                    choice = self.route(k, x, logits)
                routed.append((alive, choice, k))
                x = module(x, choice)
            else:
                x = module(x)
            logits = self.exits[k](x)
            conf, pred = confidence_of(logits, self.spec.confidence)
            leave = None if k == last else conf > limits[k]
            leaving = len(conf) if leave is None else int(leave.sum())
            if leaving == len(conf):
                left.append((alive, pred, conf, k))
                break
            if leaving:
                rows, stay = leave.nonzero().squeeze(1), (~leave).nonzero().squeeze(1)
                left.append((rows if alive is None else alive[rows], pred[rows], conf[rows], k))
                alive, x = (stay if alive is None else alive[stay]), x.index_select(0, stay)
                logits = logits.index_select(0, stay)
        return self._gather(count, device, left, routed)

    def _gather(self, count: int, device: torch.device,
                left: list[tuple[Tensor | None, Tensor, Tensor, int]],
                routed: list[tuple[Tensor | None, int | Tensor, int]]) -> CascadeOutput:
        """`infer`'s per-exit pieces put back in the batch's order."""
        choices = torch.full((count, self.modules_count), -1, dtype=torch.long, device=device)
        for rows, choice, k in routed:
            choices[slice(None) if rows is None else rows, k] = choice
        if len(left) == 1 and left[0][0] is None:  # every image left at the same exit
            _, labels, confidence, k = left[0]
            return CascadeOutput(labels, confidence, torch.full((count,), k, device=device),
                                 choices)
        labels = torch.zeros(count, dtype=torch.long, device=device)
        confidence = torch.zeros(count, device=device)
        exits = torch.full((count,), -1, dtype=torch.long, device=device)
        for rows, pred, conf, k in left:
            labels[rows], confidence[rows], exits[rows] = pred, conf, k
        return CascadeOutput(labels, confidence, exits, choices)

    def paths(self) -> list[tuple[int, ...]]:
        """Every combination of sub-networks, one index per module (0 for a plain one)."""
        return list(itertools.product(*(range(self.sub_count(k))
                                         for k in range(self.modules_count))))

    @torch.no_grad()
    def exit_logits_of_paths(self, x: Tensor) -> dict[tuple[int, ...], list[Tensor]]:
        """For analysis, not inference: every path's logits at every exit, the whole batch
        through every sub-network (shared prefixes computed once)."""
        x = self.fit_input(x)
        frontier: dict[tuple[int, ...], Tensor] = {(): x}
        logits: dict[tuple[int, ...], list[Tensor]] = {}
        for k in range(self.modules_count):
            nxt = {}
            for prefix, feats in frontier.items():
                for s in range(self.sub_count(k)):
                    out = self.run_module(k, feats, s if self.is_super(k) else None)
                    nxt[(*prefix, s)] = out
                    logits[(*prefix, s)] = [*logits.get(prefix, []), self.exits[k](out)]
            frontier = nxt
        return {path: logits[path] for path in frontier}


def build_cascade(spec: CascadeSpec, in_channels: int, num_classes: int) -> CascadeNet:
    """The cascade of `spec` for images of `in_channels` channels and `num_classes` classes."""
    if in_channels < 1 or num_classes < 2:
        raise ValueError(f"need in_channels >= 1 and num_classes >= 2, got {in_channels}, "
                         f"{num_classes}")
    return CascadeNet(spec, in_channels, num_classes)
