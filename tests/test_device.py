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

    defaults = child("lenet", 4, keep=False)
    kept = child("lenet", 4, keep=True)
    assert kept["applied"] and not defaults["applied"]
    assert defaults["page_faults"] > 1000
    assert kept["page_faults"] < defaults["page_faults"] / 5
