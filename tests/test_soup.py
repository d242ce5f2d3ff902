"""Greedy weight soups (`training.pbt.soup`), on hand-made networks where the answer is known."""

import pytest
import torch
from torch import nn

from training.pbt.soup import average_states, greedy_soup


def test_states_are_averaged_element_wise_and_counters_kept():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(7)}
    mean = average_states([a, b])
    assert torch.equal(mean["w"], torch.tensor([2.0, 4.0]))
    assert mean["n"].item() == 3 and mean["n"].dtype == torch.int64  # from the first
    with pytest.raises(ValueError, match="different parameters"):
        average_states([a, {"w": a["w"]}])


def _batches(x: torch.Tensor, y: torch.Tensor):
    return [(torch.arange(len(y)), x, y)]


def _classifier(sign: float) -> dict[str, torch.Tensor]:
    """A 1-D two-class linear classifier: class 1 where sign * x > 0."""
    return {"weight": torch.tensor([[-sign], [sign]]), "bias": torch.zeros(2)}


def test_the_soup_takes_what_helps_and_leaves_what_hurts():
    x = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]])
    y = torch.tensor([0, 0, 1, 1])
    model = nn.Linear(1, 2)
    right, wrong = _classifier(1.0), _classifier(-3.0)
    half = _classifier(0.5)  # right, less confident: averaging it in keeps every image right
    soup = greedy_soup(model, [wrong, right, half], [0.0, 1.0, 1.0], _batches(x, y),
                       _batches(x, y), torch.device("cpu"), first=1)
    assert soup.ingredients == [1, 2]  # `wrong` would flip every image: left out
    assert soup.metrics["val_accuracy"] == 1.0 and soup.metrics["soup_ingredients"] == 2
    assert torch.allclose(soup.state["weight"], torch.tensor([[-0.75], [0.75]]))
    alone = greedy_soup(model, [right, wrong], [1.0, 0.0], _batches(x, y), _batches(x, y),
                        torch.device("cpu"))
    assert alone.ingredients == [0] and alone.state is right  # the member as it was
    assert alone.metrics == {"val_accuracy": 1.0, "soup_ingredients": 1.0}
