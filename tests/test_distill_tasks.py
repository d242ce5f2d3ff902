"""The distill tasks through `.fn()`: queue draws, the teacher stage, bank snapshots, students."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.adapters.checkpoints import load_checkpoint
from tasks.adapters.versioning import ArtifactStore
from tasks.configs.distill import DistillConfig
from tasks.data import load_dataset, prepare_dataset, source_version
from tasks.distill import (
    DistillPlan,
    StudentRound,
    TeacherRound,
    bank_snapshot,
    load_bank,
    pretrain_config,
)
from tasks.rounds import round_task
from tasks.training import ClassifierRound
from training.batches import Normalize, shift_flip
from training.distill.feature_bank import UNFILLED
from training.distill.stages import stage_ids, teacher_features
from training.distributed import Distributed
from training.features import FeatureHooks
from training.rounds import new_model


def teacher_stage(teacher, dataset, stage, previous):
    """The round task on a teacher stage."""
    return round_task.fn(TeacherRound(config=teacher, dataset=dataset, stage=stage), previous)


def student_stage(student, dataset, stage, previous, bank):
    """The round task on a student stage against `bank`."""
    return round_task.fn(StudentRound(config=student, dataset=dataset, stage=stage,
                                       bank=bank), previous)


@pytest.fixture(scope="module")
def setup():
    config = DistillConfig(profile="smoke", train_limit=400, stages=3, seed=4, threads=2,
                           targets="bank", teacher_layer="pool", student_layer="pool",
                           feature_loss="cosine", feature_weight=1.0, ce_weight=1.0)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    return config, DistillPlan.of(config), dataset


def test_teacher_and_student_queues_are_seeded_separately_and_prefer_the_front(setup):
    _, plan, dataset = setup
    train_ids = load_dataset(dataset).splits["train"]
    first, second = (stage_ids(plan.teacher, train_ids, s) for s in (1, 2))
    assert len(first) == round(0.8 * len(train_ids)) and len(set(first.tolist())) == len(first)
    assert torch.equal(first, stage_ids(plan.teacher, train_ids, 1))  # replayed, same draws
    not_first = set(train_ids.tolist()) - set(first.tolist())
    # stage 2 draws 320 of 400: the 80 images left out at stage 1 (weight 2) are nearly all in
    assert len(not_first & set(second.tolist())) > 0.9 * len(not_first)
    assert not torch.equal(first, stage_ids(plan.student, train_ids, 1))


def test_stages_fill_the_bank_with_state_ids_and_resume_with_the_configured_lr(setup):
    config, plan, dataset = setup
    store = ArtifactStore()
    t1 = teacher_stage(plan.teacher, dataset, 1, None)
    b1 = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None)
    assert b1.state_histogram == {UNFILLED: 80, 1: 320} and b1.fill_fraction == 0.8
    assert b1.entries == 400 and b1.feature_values == 64  # resnet8's pooled feature
    assert b1.nbytes == 400 * 64 * 2 + 400 * 8
    t2 = teacher_stage(plan.teacher, dataset, 2, t1.checkpoint)
    b2 = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 2, t2.checkpoint, b1.bank)
    assert b2.bank.path == b1.bank.path and b2.bank.md5 != b1.bank.md5  # single mode: one file
    assert set(b2.state_histogram) <= {UNFILLED, 1, 2} and b2.state_histogram[2] == 320
    bank1 = load_bank(store, b1.bank)  # the older version comes back by hash
    assert bank1.state_histogram() == b1.state_histogram
    # the student of stage 2, resumed with a different configured learning rate
    s1 = student_stage(plan.student, dataset, 1, None, b1.bank)
    assert s1.metrics["bank_filled_fraction_drawn"] < 1.0
    faster = plan.student.replace(lr=0.3, momentum=0.5)
    s2 = student_stage(faster, dataset, 2, s1.checkpoint, b2.bank)
    # 320 images in batches of 64: 5 steps a stage, 15 in all; stage 2 ends at step 9
    assert s2.metrics["lr"] == pytest.approx(0.3 * 0.5 * (1 + math.cos(math.pi * 9 / 15)))
    groups = torch.load(store.fetch(s2.checkpoint), weights_only=True)["optimizer"][
        "param_groups"]
    assert groups[0]["momentum"] == 0.5  # the configured value, not the stored 0.9
    assert {"loss", "loss_ce", "loss_feat", "val_accuracy"} <= set(s2.metrics)


def test_a_patient_student_trains_on_a_teacher_state_run_on_its_own_batches(setup):
    config, plan, dataset = setup
    t1 = teacher_stage(plan.teacher, dataset, 1, None)
    patient = DistillPlan.of(config.replace(targets="states", teacher_layer="fc",
                                            student_layer="fc", feature_loss="kl",
                                            student_patience=2))
    assert patient.student.repeats == 2 * plan.student.repeats

    def state_round(teacher) -> StudentRound:
        return StudentRound(config=patient.student, dataset=dataset, stage=1, teacher=teacher,
                            teacher_config=patient.teacher)

    first = round_task.fn(state_round(t1.checkpoint))
    # 320 images a pass at batch 64 (5 steps), two passes: twice one pass's 320
    assert first.metrics["images"] == 640
    assert first.metrics["loss_feat"] > 0 and "bank_filled_fraction_drawn" not in first.metrics
    # another teacher state, another target: its student is kept apart on disk
    other = t1.checkpoint.model_copy(update={"md5": "0" * 32})
    assert first.checkpoint.path == state_round(t1.checkpoint).relpath() \
        != state_round(other).relpath()
    with pytest.raises(ValueError, match="need the teacher state's checkpoint"):
        round_task.fn(StudentRound(config=patient.student, dataset=dataset, stage=1))
    # function matching: the same stage on mixed batches, a function of the seed
    mixing = DistillPlan.of(config.replace(targets="states", teacher_layer="fc",
                                           student_layer="fc", feature_loss="kl",
                                           student_patience=2, student_mixup=1.0))
    mixed = [round_task.fn(StudentRound(config=mixing.student, dataset=dataset, stage=1,
                                        teacher=t1.checkpoint, teacher_config=mixing.teacher))
             for _ in range(2)]
    assert mixed[0].checkpoint.md5 == mixed[1].checkpoint.md5 != first.checkpoint.md5
    assert mixed[0].metrics["images"] == 640
    assert mixed[0].metrics["loss_feat"] != first.metrics["loss_feat"]


def test_memory_mapped_and_per_state_banks_hold_the_same_entries(setup):
    config, plan, dataset = setup
    t1 = teacher_stage(plan.teacher, dataset, 1, None)
    in_memory = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None)
    mapped_plan = DistillPlan.of(config.replace(bank_memmap=True,
                                                          bank_mode="per-state"))
    mapped = bank_snapshot.fn(mapped_plan.teacher, mapped_plan.bank, dataset, 1, t1.checkpoint,
                              None)
    assert mapped.bank.path.endswith("bank-001.pt") and mapped.bank.md5 == in_memory.bank.md5
    t2 = teacher_stage(plan.teacher, dataset, 2, t1.checkpoint)
    again = bank_snapshot.fn(mapped_plan.teacher, mapped_plan.bank, dataset, 2, t2.checkpoint,
                             mapped.bank)
    assert again.bank.path.endswith("bank-002.pt")
    bank = load_bank(ArtifactStore(), mapped.bank, memmap=True)
    assert bank.state_histogram() == mapped.state_histogram  # stage 2 left bank 1 unchanged


def test_initial_bank_from_the_untrained_teacher_is_state_zero(setup):
    config, _, dataset = setup
    plan = DistillPlan.of(config.replace(initial_bank="teacher"))
    t1 = teacher_stage(plan.teacher, dataset, 1, None)
    bank = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None)
    assert bank.state_histogram == {0: 80, 1: 320} and bank.fill_fraction == 1.0


def test_a_warm_started_teacher_is_state_zero_of_the_bank_and_of_stage_one(setup):
    config, _, dataset = setup
    plan = DistillPlan.of(config.replace(initial_bank="teacher",
                                                    teacher_pretrain_rounds=1))
    pretrain = pretrain_config(plan.teacher)
    assert pretrain.rounds == 1 and pretrain.network.model == plan.teacher.network.model
    warm = round_task.fn(ClassifierRound(config=pretrain, dataset=dataset, round=0,
                                          run_name="distill-pretrain"))
    t1 = teacher_stage(plan.teacher, dataset, 1, warm.checkpoint)
    cold = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None)
    bank = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None,
                            warm.checkpoint)
    store = ArtifactStore()
    entries, cold_entries = load_bank(store, bank.bank), load_bank(store, cold.bank)
    state_zero = entries.state == 0
    assert int(state_zero.sum()) == 80 and bank.state_histogram == cold.state_histogram
    # state 0 holds the warm teacher's features, computed here from its checkpoint
    model = new_model(plan.teacher, dataset)
    model.load_state_dict(load_checkpoint(store, warm.checkpoint)["model"])
    ids = entries.ids[state_zero]
    expected = teacher_features(model, plan.bank.layer, dataset, load_dataset(dataset), ids,
                                torch.device("cpu"))
    assert torch.allclose(entries.lookup(ids)[0], expected, atol=1e-2, rtol=1e-2)
    assert not torch.allclose(cold_entries.lookup(ids)[0], expected, atol=1e-2, rtol=1e-2)
    # stage 1 continued from the warm start: its loss starts where the warm-up's ended
    t1_cold = teacher_stage(plan.teacher, dataset, 1, None)
    assert t1.metrics["loss"] < t1_cold.metrics["loss"]


def test_a_consistent_bank_holds_each_entrys_view_and_shows_the_student_that_view(setup):
    config, _, dataset = setup
    plan = DistillPlan.of(config.replace(bank_views="augmented"))
    store, cpu = ArtifactStore(), torch.device("cpu")
    t1 = teacher_stage(plan.teacher, dataset, 1, None)
    snapshot = bank_snapshot.fn(plan.teacher, plan.bank, dataset, 1, t1.checkpoint, None)
    bank = load_bank(store, snapshot.bank)
    views = bank.recorded_views()
    ids = bank.ids[bank.state == 1][:16].long()
    rows = torch.searchsorted(views.ids, ids)
    flips, moves = views.flips[rows], views.moves[rows].long()  # 28 pixels: whole-pixel shifts
    assert flips.any() and moves.abs().sum() > 0  # the views moved and flipped images
    # the teacher's feature of each entry is of its recorded view, computed here by hand
    data = load_dataset(dataset)
    model = new_model(plan.teacher, dataset)
    model.load_state_dict(load_checkpoint(store, t1.checkpoint)["model"])
    viewed = Normalize(dataset.mean, dataset.std)(shift_flip(data.images[ids], flips, moves))
    with FeatureHooks(model.eval(), [plan.bank.layer], detach=True) as hooks, torch.no_grad():
        model(viewed)
        expected = hooks[plan.bank.layer].flatten(1)
    assert torch.allclose(bank.lookup(ids)[0], expected, atol=1e-2, rtol=1e-2)
    clean = teacher_features(model, plan.bank.layer, dataset, data, ids, cpu)
    assert not torch.allclose(bank.lookup(ids)[0], clean, atol=1e-2, rtol=1e-2)
    # the student's batches show each image with an entry in that same view
    opened = StudentRound(config=plan.student, dataset=dataset, stage=1,
                          bank=snapshot.bank).open(None, cpu)
    batches = opened.round.batches.for_passes(cpu, Distributed())(0)
    seen = {}
    for batch_ids, x, _ in batches:
        seen |= dict(zip(batch_ids.tolist(), x, strict=True))
    shown = [n for n, i in enumerate(ids.tolist()) if i in seen]
    assert len(shown) > 8
    assert torch.allclose(torch.stack([seen[ids[n].item()] for n in shown]), viewed[shown])
