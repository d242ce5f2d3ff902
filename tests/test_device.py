"""The process set-up every training task gets from `training.device`."""

import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again():
    """With glibc's defaults a step's large maps are mmapped and returned on every step
    (thousands of page faults a step); after `keep_freed_memory` (which `resolve_device` calls
    for every training task) the same steps fault in little more than the heap's first growth
    (`bench.allocator` times it)."""
    from bench.allocator import child

    # maps of 25 MB a batch: below glibc's largest mmap threshold (32 MB), so the setting
    # applies, and far above what its dynamic threshold and trimming keep (at width 4 the
    # defaults' own adaptation sometimes kept every block: one fault in 4 steps)
    defaults = child("lenet:64", 3, keep=False)
    kept = child("lenet:64", 3, keep=True)
    if kept["page_faults"] >= defaults["page_faults"] / 5:
        # a kept run faults 0 pages alone; beside the other test worker it once faulted 11,760
        # (the kernel reclaiming idle pages under pressure): noise only ever adds faults, so
        # the better of two runs is the allocator's figure
        kept = min(kept, child("lenet:64", 3, keep=True), key=lambda run: run["page_faults"])
    assert kept["applied"] and not defaults["applied"]
    assert defaults["page_faults"] > 1000
    assert kept["page_faults"] < defaults["page_faults"] / 5


def test_scoring_runs_in_the_fast_layout_and_training_goes_on_in_its_own():
    """`inference_layout` scores a plain-layout network in channels_last (what
    `choose_weights` and the soup score PBT members with): the same logits to float rounding,
    the same parameter objects after, back in the plain layout, and the optimizer that holds
    them steps on as it would have."""
    import copy

    import torch

    from models import build_model
    from training.device import inference_layout

    torch.manual_seed(0)
    model = build_model("resnet18", 1, 10, 8)
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin)]
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    for net, optimizer in zip((model, twin), optimizers, strict=True):  # momentum buffers
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    before = list(model.parameters())
    model.eval(), twin.eval()
    with torch.no_grad(), inference_layout(model, torch.device("cpu")) as scored:
        assert scored is model
        multi = [p for p in model.parameters()  # (1-channel and 1x1 kernels: both layouts)
                 if p.dim() == 4 and p.shape[1] > 1 and p.shape[-1] > 1]
        assert multi and all(p.is_contiguous(memory_format=torch.channels_last)
                             and not p.is_contiguous() for p in multi)
        torch.testing.assert_close(model(x), twin(x), rtol=1e-4, atol=1e-5)
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))
    assert all(p.is_contiguous() for p in model.parameters())
    model.train(), twin.train()
    for net, optimizer in zip((model, twin), optimizers, strict=True):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
