"""The synthetic layouts of real Fashion-MNIST items: deterministic, labels that match the
pixels, boundaries by hand, flips that move boxes and maps together, and a background a
threshold cannot separate from the objects."""

from __future__ import annotations

import pytest
import torch

from tasks.data import fashion_mnist_root
from training.canvas.contours import mask_iou
from training.canvas.layouts import MASK_LEVEL, LayoutBatches, LayoutSpec, boundaries, make_layouts
from training.datasets import load_fashion_mnist


@pytest.fixture(scope="module")
def items():
    test = load_fashion_mnist(fashion_mnist_root(), train=False)
    return test.images[:500, 0], test.labels[:500]


@pytest.fixture(scope="module")
def layouts(items):
    return make_layouts(*items, 40, LayoutSpec(canvas=96, max_objects=3), seed=3)


def test_same_seed_same_canvases_other_seed_others(items, layouts):
    again = make_layouts(*items, 40, LayoutSpec(canvas=96, max_objects=3), seed=3)
    other = make_layouts(*items, 40, LayoutSpec(canvas=96, max_objects=3), seed=4)
    assert torch.equal(again.images, layouts.images)
    assert all(torch.equal(a, b) for a, b in zip(again.boxes, layouts.boxes, strict=True))
    assert not torch.equal(other.images, layouts.images)


def test_boxes_labels_and_masks_match_the_pasted_items(items, layouts):
    images, labels = items
    counts = [len(b) for b in layouts.boxes]
    assert min(counts) >= 1 and max(counts) <= 3 and sum(counts) > 40
    for n in range(len(layouts)):
        for k, (box, label, source) in enumerate(zip(
                layouts.boxes[n], layouts.labels[n], layouts.sources[n], strict=True), 1):
            ys, xs = (layouts.instances[n] == k).nonzero(as_tuple=True)
            assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert label == labels[source]
            # the object's pixels are the item's own bright pixels, pasted over the texture
            assert layouts.images[n, 0][ys, xs].min() >= MASK_LEVEL - 1


def test_a_threshold_cannot_find_the_objects(layouts):
    truth = layouts.instances > 0
    best = max(mask_iou(layouts.images[:, 0] >= level, truth).mean().item()
               for level in range(0, 256, 4))
    assert best < 0.7  # the texture is as bright as the items


def test_boundaries_by_hand():
    instances = torch.zeros(6, 7, dtype=torch.uint8)
    instances[1:4, 1:4] = 1  # a 3 x 3 square: its ring of 8 is the boundary, not its centre
    instances[1:4, 4:6] = 2  # a touching 3 x 2 object: every pixel borders another id
    expected = torch.zeros(6, 7, dtype=torch.bool)
    expected[1:4, 1:6] = True
    expected[2, 2] = False
    assert torch.equal(boundaries(instances), expected)
    assert torch.equal(boundaries(instances[None])[0], expected)  # batched


def test_flipped_batches_flip_boxes_and_maps_together(layouts):
    generator = torch.Generator().manual_seed(0)
    flipped_any = False
    for ids, x, targets in LayoutBatches(layouts, "boxes", 8, torch.device("cpu"), generator):
        for row, image, target in zip(ids.tolist(), x, targets, strict=True):
            flipped = not torch.equal(image[0], layouts.images[row, 0].float() / 255)
            flipped_any |= flipped
            instances = layouts.instances[row].flip(-1) if flipped else layouts.instances[row]
            for k, box in enumerate(target["boxes"], 1):
                ys, xs = (instances == k).nonzero(as_tuple=True)
                assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert torch.equal(target["labels"], layouts.labels[row] + 1)  # 0: background
    assert flipped_any
    _, x, y = next(iter(LayoutBatches(layouts, "contours", 4, torch.device("cpu"))))
    assert y.shape == (4, 2, 96, 96)
    assert torch.equal(y[:, 0].bool(), boundaries(layouts.instances[:4]))
    assert torch.equal(y[:, 1].bool(), layouts.instances[:4] > 0)


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="fit a canvas"):
        LayoutSpec(canvas=32, max_scale=2.0)
    with pytest.raises(ValueError, match="min_objects"):
        LayoutSpec(min_objects=3, max_objects=2)
    with pytest.raises(ValueError, match="items must be N x 28 x 28"):
        make_layouts(torch.zeros(4, 32, 32, dtype=torch.uint8), torch.zeros(4), 1,
                     LayoutSpec(), 0)
