"""The typed round (`training.rounds`): its record survives a `weights_only` file, and names
only the project's training and model classes."""

from __future__ import annotations

import pytest
import torch

from training.cascade.learning import ModuleStep
from training.distill.feature_bank import FeatureBank
from training.distill.losses import DistillStep
from training.rounds import (
    ClassifierNetwork,
    ClassifyStep,
    ImageBatches,
    Round,
    from_record,
    to_record,
)
from training.sparsify.term import SparsityTerm, SparsityTransform


def _round(step) -> Round:
    images = torch.randint(0, 255, (12, 1, 8, 8), dtype=torch.uint8)
    return Round(
        network=ClassifierNetwork("lenet", 1, 3, 4), step=step,
        batches=ImageBatches(images, torch.arange(12) % 3, torch.arange(10), 4, (0.5,), (0.25,),
                             0.0, True, (2, 3), seeds=(7, 8)),
        passes=(2, 3), schedule=(0, 4), lr=0.1, momentum=0.9, weight_decay=5e-4,
        sparsity=SparsityTerm({"block1": 0.3}, SparsityTransform("exp_abs", c=2.0),
                              {"block1": 0.05}))


def test_a_round_comes_back_from_a_weights_only_file(tmp_path):
    bank = FeatureBank(torch.arange(10), (5,), torch.float16)
    bank.update(torch.arange(3), torch.ones(3, 5), 2)
    for step in (ClassifyStep(0.1),
                 DistillStep("fc", ((3,), (5,)), "l2", 4.0, 1.0, 1.0, bank=bank),
                 ModuleStep(1, True, torch.tensor([0.5, 1.0]), 0.1, 0.0, 7)):
        path, original = tmp_path / "round.pt", _round(step)
        torch.save(to_record(original), path)
        back = from_record(torch.load(path, weights_only=True))
        assert back.network == original.network and back.passes == (2, 3)
        assert back.sparsity == original.sparsity and back.schedule == (0, 4)
        assert torch.equal(back.batches.images, original.batches.images)
        assert back.batches.seeds == (7, 8) and back.batches.mean == (0.5,)
        assert type(back.step) is type(step)
        if isinstance(step, DistillStep):
            assert back.step.adapter_shapes == ((3,), (5,))
            assert torch.equal(back.step.bank.lookup(torch.arange(3))[0],
                               bank.lookup(torch.arange(3))[0])
        if isinstance(step, ModuleStep):
            assert torch.equal(back.step.relative_time, step.relative_time)


def test_a_record_may_name_only_training_and_model_classes():
    with pytest.raises(ValueError, match="not 'os:system'"):
        from_record({"__spec__": "os:system", "command": "true"})


def test_image_batches_need_a_seed_per_pass_or_one_stream():
    args = (torch.zeros(4, 1, 2, 2), torch.zeros(4), torch.arange(4), 2, (0.0,), (1.0,), 0.0,
            False, (0, 1))
    with pytest.raises(ValueError, match="either seeds"):
        ImageBatches(*args)
    with pytest.raises(ValueError, match="1 seeds for 2 passes"):
        ImageBatches(*args, seeds=(3,))
