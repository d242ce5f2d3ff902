"""DDP with torchrun: 2 CPU processes (gloo) follow the one-process loss curve, in the
pure loop and inside the train, PBT member, distill and cascade module tasks (`--ddp-procs`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ddp_worker

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_give_the_loss_curve_of_one_with_the_same_global_batch(tmp_path):
    out = tmp_path / "ddp.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "tests.ddp_worker", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads(out.read_text())
    losses, weights, world = ddp_worker.run()
    assert two["world_size"] == 2 and world == 1
    assert two["losses"] == pytest.approx(losses, rel=1e-4)
    assert losses[-1] < losses[0]  # it learns
    assert two["weights"] == pytest.approx(weights, rel=1e-3, abs=1e-4)


def _lenet_smoke():
    from tasks.configs.sections import classifier_config
    from tasks.configs.train import TrainConfig
    from tasks.data import prepare_dataset, source_version

    config = TrainConfig(profile="smoke", model="lenet", rounds=2, train_limit=512,
                         batch_size=64, threads=1)
    data = config.dataset
    return classifier_config(config), prepare_dataset.fn(data, source_version(data))


def _weights(ref, entry="model"):
    import torch

    from tasks.adapters.versioning import ArtifactStore

    return torch.load(ArtifactStore().fetch(ref), weights_only=True)[entry]


def test_the_train_task_on_two_processes_follows_one_with_the_same_global_batch():
    from tasks.rounds import round_task
    from tasks.training import ClassifierRound

    classifier, dataset = _lenet_smoke()
    one, two = (round_task.fn(ClassifierRound(
        config=classifier.replace(ddp_procs=procs), dataset=dataset, round=0,
        run_name="ddp-test", repeats=2)) for procs in (1, 2))
    assert two.checkpoint.path != one.checkpoint.path  # a setting of the result: its own key
    assert two.metrics["ddp_processes"] == 2 and "ddp_processes" not in one.metrics
    assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], rel=1e-4)
    assert two.metrics["val_accuracy"] == pytest.approx(one.metrics["val_accuracy"], abs=0.01)
    single, double = _weights(one.checkpoint), _weights(two.checkpoint)
    for name, tensor in single.items():
        assert double[name].allclose(tensor, rtol=1e-3, atol=1e-5), name


def test_a_pbt_member_trains_data_parallel_with_its_weight_average():
    from tasks.pbt import MemberRound
    from tasks.rounds import round_task

    classifier, dataset = _lenet_smoke()
    runs = [round_task.fn(MemberRound(
        config=classifier.replace(ddp_procs=procs), dataset=dataset,
        population=f"ddp-{procs}", member=0, phase="stage", index=1, first_epoch=0, epochs=2,
        cycle=(0, 2), average_decay=0.9)) for procs in (1, 2)]
    assert runs[1].metrics["ddp_processes"] == 2
    assert runs[1].metrics["loss"] == pytest.approx(runs[0].metrics["loss"], rel=1e-4)
    single, double = (_weights(r.checkpoint, "averaged") for r in runs)
    for name, tensor in single.items():
        assert double[name].allclose(tensor, rtol=1e-3, atol=1e-5), name


def test_distill_teacher_and_student_stages_train_data_parallel_like_one_process():
    from tasks.configs.distill import DistillConfig
    from tasks.data import prepare_dataset, source_version
    from tasks.distill import DistillPlan, StudentRound, TeacherRound, bank_snapshot
    from tasks.rounds import round_task

    # No BatchNorm in either network (on CPUs each process would normalise its own share), so
    # the teacher is a wider lenet (a copy of the role: the config wants a deeper teacher). The
    # student's width 8 gives a learned linear adapter from its 784 features to the bank's 1568.
    config = DistillConfig(profile="smoke", student_model="lenet", student_width=8, stages=2,
                           train_limit=512, batch_size=64, threads=1, targets="bank",
                           teacher_layer="pool", student_layer="pool", feature_loss="cosine",
                           feature_weight=1.0, ce_weight=1.0)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    plans = [DistillPlan.of(config.replace(ddp_procs=procs)) for procs in (1, 2)]
    plans = [plan.model_copy(update={"teacher": plan.teacher.replace(model="lenet", width=16)})
             for plan in plans]
    teachers = [round_task.fn(TeacherRound(config=plan.teacher, dataset=dataset, stage=1))
                for plan in plans]
    assert teachers[1].metrics["ddp_processes"] == 2
    assert teachers[1].metrics["loss"] == pytest.approx(teachers[0].metrics["loss"], rel=1e-4)
    for name, tensor in _weights(teachers[0].checkpoint).items():
        assert _weights(teachers[1].checkpoint)[name].allclose(tensor, rtol=1e-3, atol=1e-5)
    bank = bank_snapshot.fn(plans[0].teacher, plans[0].bank, dataset, 1,
                            teachers[0].checkpoint, None)
    students = [round_task.fn(StudentRound(config=plan.student, dataset=dataset, stage=1,
                                            bank=bank.bank)) for plan in plans]
    assert students[1].metrics["ddp_processes"] == 2
    for key in ("loss", "loss_ce", "loss_feat"):
        assert students[1].metrics[key] == pytest.approx(students[0].metrics[key], rel=1e-4)
    assert students[0].metrics["loss_feat"] > 0  # the bank's targets are in the loss
    for entry in ("model", "adapter"):
        single, double = (_weights(s.checkpoint, entry) for s in students)
        assert set(single) == set(double) and single  # the adapter is learned, not identity
        for name, tensor in single.items():
            assert double[name].allclose(tensor, rtol=1e-3, atol=1e-5), (entry, name)


def test_the_sparsity_term_and_thresholds_train_data_parallel_like_one_process():
    from tasks.configs.sparsify import SparsitySpec
    from tasks.rounds import round_task
    from tasks.training import ClassifierRound

    classifier, dataset = _lenet_smoke()
    # with a threshold cycle's activation thresholds in place while training
    spec = SparsitySpec(lambdas={"block1": 0.3, "block2": 0.6}, transform="exp_abs", power=2,
                        abs_power=1, base=2.0, thresholds={"block1": 0.05})
    runs = [round_task.fn(ClassifierRound(
        config=classifier.replace(ddp_procs=procs), dataset=dataset, round=0,
        run_name="ddp-sparse", sparsity=spec)) for procs in (1, 2)]
    assert runs[1].metrics["ddp_processes"] == 2
    for key in ("loss", "loss_ce", "loss_sparsity", "sparsity_block1", "sparsity_block2"):
        assert runs[1].metrics[key] == pytest.approx(runs[0].metrics[key], rel=1e-4), key
    assert runs[0].metrics["loss"] > runs[0].metrics["loss_ce"]  # the term is in the loss
    single, double = (_weights(r.checkpoint) for r in runs)
    for name, tensor in single.items():
        assert double[name].allclose(tensor, rtol=1e-3, atol=1e-5), name


@pytest.fixture(scope="module")
def tiny_cascade():
    """A tiny cascade's settings, data, training sets and latency table: module 0 plain,
    module 1 a super-network module (joint stage training: module 1's round trains module 0
    along; no super-network module before it, whose random routes each process draws for
    its own share)."""
    from tasks.cascade.tasks import difficulty_sets, measure_latency, serving_device
    from tasks.data import prepare_dataset, source_version
    from tests.test_cascade_flow import smoke_cascade

    settings = {"super_modules": (1,), "train_limit": 512, "min_steps": None, "rounds": 1,
                "threads": 1, "latency_repeats": 1}
    config = smoke_cascade(**settings)
    data = config.dataset
    dataset = prepare_dataset.fn(data, source_version(data))
    return (settings, dataset, difficulty_sets.fn(config, dataset),
            measure_latency.fn(config, dataset, serving_device(config)))


@pytest.mark.parametrize("k", [0, 1], ids=["plain-module", "super-network-module"])
def test_a_cascade_module_round_trains_data_parallel_like_one_process(k, tiny_cascade):
    import torch

    from tasks.cascade.tasks import ModuleRound, new_cascade
    from tasks.rounds import round_task
    from tests.test_cascade_flow import smoke_cascade

    settings, dataset, sets, latency = tiny_cascade
    configs = [smoke_cascade(**settings, ddp_procs=procs) for procs in (1, 2)]  # accepted
    runs = [round_task.fn(ModuleRound(config=config, dataset=dataset, sets=sets,
                                       latency=latency, k=k, round=0)) for config in configs]
    one, two = ({key[len(f"module{k}_"):]: value for key, value in r.metrics.items()}
                for r in runs)
    assert two["ddp_processes"] == 2 and "ddp_processes" not in one
    assert two["loss_ce"] == pytest.approx(one["loss_ce"], rel=2e-3)
    if k == 1:  # whether each sub-network is right (argmax) flips where logits are close
        assert two["loss_route"] == pytest.approx(one["loss_route"], abs=0.05)
    # Each process normalises its own share in BatchNorm (CPUs), so the weights are not
    # equal: the gap between the two must be small beside how far the round moved them.
    start = new_cascade(configs[0], dataset)
    names = [name for name, _ in start.named_parameters()]
    single, double = (_weights(r.checkpoint) for r in runs)
    moved = torch.cat([(single[n] - start.state_dict()[n]).flatten() for n in names]).norm()
    gap = torch.cat([(double[n] - single[n]).flatten() for n in names]).norm()
    assert moved > 0 and gap < 0.2 * moved
    assert _weights(runs[1].checkpoint, "optimizer")["state"]  # the momentum came back


def test_a_cascade_round_under_torchrun_in_one_process_is_the_in_process_round(
        tiny_cascade, monkeypatch):
    """BatchNorm aside, the job carries everything: the same batches, schedule, step and
    optimizer state (both ways, over two rounds) give the same weights bit for bit."""
    import torch

    import tasks.rounds
    from tasks.adapters.torchrun import train_data_parallel
    from tasks.cascade.tasks import ModuleRound
    from tasks.rounds import round_task
    from tests.test_cascade_flow import smoke_cascade

    settings, dataset, sets, latency = tiny_cascade
    settings = settings | {"rounds": 2}

    def rounds(procs: int):
        config = smoke_cascade(**settings, ddp_procs=procs)

        def plan(index: int) -> ModuleRound:
            return ModuleRound(config=config, dataset=dataset, sets=sets, latency=latency, k=1,
                               round=index)

        return round_task.fn(plan(1), round_task.fn(plan(0)).checkpoint)

    one = rounds(1)
    monkeypatch.setattr(tasks.rounds, "train_data_parallel",
                        lambda _procs, *args, **kwargs: train_data_parallel(1, *args, **kwargs))
    torchrun = rounds(2)
    assert torchrun.metrics["module1_ddp_processes"] == 1
    assert torchrun.metrics["module1_loss"] == one.metrics["module1_loss"]
    for name, tensor in _weights(one.checkpoint).items():
        assert torch.equal(_weights(torchrun.checkpoint)[name], tensor), name
    optimizers = [_weights(r.checkpoint, "optimizer") for r in (one, torchrun)]
    assert optimizers[0]["param_groups"] == optimizers[1]["param_groups"]
    for index, state in optimizers[0]["state"].items():
        assert torch.equal(optimizers[1]["state"][index]["momentum_buffer"],
                           state["momentum_buffer"]), index

