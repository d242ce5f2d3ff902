"""The recency queue: drawn ids move to the back, and the front is favoured by the set ratio."""

import pytest
import torch

from training.distill.data_queue import RecencyQueue


def test_draw_is_distinct_and_moves_drawn_ids_to_the_back():
    queue = RecencyQueue(torch.arange(10), front_weight=3.0, back_weight=1.0)
    drawn = queue.draw(4, torch.Generator().manual_seed(0))
    assert len(set(drawn.tolist())) == 4
    assert queue.order[-4:].tolist() == drawn.tolist()
    assert sorted(queue.order.tolist()) == list(range(10))
    assert queue.weights().tolist() == [3.0] * 6 + [1.0] * 4


def test_front_is_picked_more_often_by_the_configured_ratio():
    # One pick per draw: a given front id is chosen front/back times as often as a back id.
    generator = torch.Generator().manual_seed(1)
    front_hits = back_hits = 0
    draws = 20000
    for _ in range(draws):
        queue = RecencyQueue(torch.arange(4), front_weight=3.0, back_weight=1.0)
        queue.back_size = 2  # ids 2 and 3 were drawn last time
        picked = queue.draw(1, generator).item()
        front_hits += picked < 2
        back_hits += picked >= 2
    # P(front) = 2*3 / (2*3 + 2*1) = 0.75
    assert front_hits / draws == pytest.approx(0.75, abs=0.01)
    assert (front_hits / 2) / (back_hits / 2) == pytest.approx(3.0, rel=0.06)


def test_uniform_queue_and_seeded_reproducibility():
    a, b = RecencyQueue.uniform(torch.arange(50)), RecencyQueue.uniform(torch.arange(50))
    for _ in range(3):
        assert torch.equal(a.draw(10, torch.Generator().manual_seed(7)),
                           b.draw(10, torch.Generator().manual_seed(7)))
    restored = RecencyQueue.uniform(torch.arange(50))
    restored.load_state_dict(a.state_dict())
    assert torch.equal(restored.order, a.order) and restored.back_size == 10


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="weights must be positive"):
        RecencyQueue(torch.arange(5), front_weight=0.0)
    with pytest.raises(ValueError, match="draw count"):
        RecencyQueue(torch.arange(5)).draw(5, torch.Generator())
