"""Greedy weight soups (Wortsman et al., 2022, "Model soups"): networks trained on from the
same weights are averaged, the best first, each further one added only if the average does not
lose validation accuracy. PBT's last stage is such a population: every member starts it from
the weights the best member was ranked on, with its own hyperparameters.

The soup is scored on the same validation split that chose it, so it is never worse there than
the member it starts from (with one ingredient it is that member, unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from training.device import inference_layout
from training.loops import evaluate
from training.recipe import recompute_batchnorm

Batches = Iterable[tuple[Tensor, Tensor, Tensor]]


def average_states(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The element-wise mean of state dicts with the same keys; tensors that are not floating
    point (BatchNorm's batch counter) are taken from the first."""
    first = states[0]
    if any(state.keys() != first.keys() for state in states):
        raise ValueError("the networks to average have different parameters")
    return {key: (torch.stack([state[key].float() for state in states]).mean(0)
                  .to(value.dtype) if value.is_floating_point() else value.clone())
            for key, value in first.items()}


@dataclass
class Soup:
    """The chosen ingredients (indices into the candidates, the first first), the averaged
    weights (BatchNorm statistics re-estimated for them), and their validation scores."""

    ingredients: list[int]
    state: dict[str, Tensor]
    metrics: dict[str, float]


def greedy_soup(model: nn.Module, states: list[dict[str, Tensor]], scores: list[float],
                val: Batches, train: Batches, device: torch.device, first: int = 0) -> Soup:
    """Starts the soup from candidate `first` (the one already chosen as the best), then adds
    the other candidates `states` best first by their validation accuracies `scores`, each only
    if the soup's validation accuracy stays at least the best so far; `model` is a network of
    their architecture on `device` (its weights are overwritten)."""
    order = [first, *sorted((i for i in range(len(states)) if i != first),
                            key=lambda i: (-scores[i], i))]
    chosen, state = [order[0]], states[order[0]]  # as it is: its score is `scores[first]`
    best = {"accuracy": scores[order[0]]}
    for index in order[1:]:
        model.load_state_dict(average_states([states[i] for i in [*chosen, index]]))
        recompute_batchnorm(model, train)
        with inference_layout(model, device):
            scored = evaluate(model, val, device)
        if scored["accuracy"] >= best["accuracy"]:
            chosen, best = [*chosen, index], scored
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Soup(ingredients=chosen, state=state,
                metrics={"val_accuracy": best["accuracy"], "soup_ingredients": float(len(chosen))}
                | ({"val_loss": best["loss"]} if "loss" in best else {}))
