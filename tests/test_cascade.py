"""The cascade's pure parts: real per-image exits, routing, difficulty sets, the latency-aware
loss, threshold calibration, the oracle and the latency table (seeded, CPU, hand-worked)."""

from __future__ import annotations

import math

import pytest
import torch

from models.cascade import CascadeSpec, build_cascade, confidence_of
from training.cascade.calibration import best_offsets, share_offsets
from training.cascade.learning import (
    ExitTable,
    StageModel,
    calibrate_for_accuracy,
    calibrate_for_budget,
    curriculum,
    difficulty,
    distill_exits,
    distillation_loss,
    exit_accuracies,
    exit_inputs,
    exit_table,
    module_step,
    oracle,
    oracle_choice,
    oracle_routing_loss,
    oracles,
    routing_loss,
    split_disjoint,
    threshold_grid,
)
from training.latency import check_device, latency_table, part_costs, path_costs


def small_net(seed: int = 0, **spec):
    torch.manual_seed(seed)
    return build_cascade(CascadeSpec(**{"widths": (4, 8, 8), **spec}), 1, 3).eval()


def test_exits_are_real_later_modules_see_only_the_images_still_in_play():
    net = small_net()
    x = torch.randn(64, 1, 28, 28)
    seen = {k: [] for k in range(3)}
    for k in range(3):
        net.exits[k].register_forward_hook(lambda _m, inputs, _o, k=k: seen[k].append(
            len(inputs[0])))
    reference = exit_table(net, [(None, x, torch.zeros(64, dtype=torch.long))],
                           {name: 1.0 for name in ("0.block", "0.exit", "1.predictor", "1.sub0",
                                                   "1.sub1", "1.exit", "2.predictor", "2.sub0",
                                                   "2.sub1", "2.exit")})
    threshold = reference.confidence[:, 0].median().item()
    for k in range(3):
        seen[k].clear()
    out = net.infer(x, torch.tensor([threshold, 1.0]))
    left_first = int((reference.confidence[:, 0] > threshold).sum())
    assert 0 < left_first < 64
    assert seen[0] == [64] and seen[1] == [64 - left_first] and seen[2] == [64 - left_first]
    assert (out.exits == torch.where(reference.confidence[:, 0] > threshold, 0, 2)).all()
    # the images that left at exit 0 never reached a super-network module
    assert (out.choices[out.exits == 0, 1:] == -1).all()
    assert (out.choices[out.exits == 2, 1:] >= 0).all()
    assert (out.choices[:, 0] == -1).all()  # module 0 is plain


def test_each_image_runs_only_its_chosen_sub_network_and_gets_the_same_result():
    net = small_net()
    module = net.blocks[1]
    x = torch.randn(10, 4, 28, 28)
    choice = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 1])
    calls = []
    for s, subnet in enumerate(module.subnets):
        subnet.register_forward_hook(lambda _m, inputs, _o, s=s: calls.append((s, len(inputs[0]))))
    routed = module(x, choice)
    assert sorted(calls) == [(0, 4), (1, 6)]
    for row in range(10):
        alone = module.subnets[int(choice[row])](x[row:row + 1])
        assert torch.allclose(routed[row:row + 1], alone, atol=1e-5)


def test_the_full_network_is_the_last_exit_of_the_most_expensive_path():
    net = small_net()
    x = torch.randn(8, 1, 28, 28)
    out = net.infer(x, torch.ones(2), fixed={1: 1, 2: 1})
    assert (out.exits == 2).all() and (out.choices[:, 1:] == 1).all()
    assert (out.labels == net(x).argmax(1)).all()


def test_confidence_measures_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]])
    top, labels = confidence_of(logits, "max_softmax")
    assert top.tolist() == pytest.approx([1 / 3, 0.5]) and labels.tolist() == [0, 0]
    entropy, _ = confidence_of(logits, "entropy")
    # p = (1/2, 1/4, 1/4): H = 1.5 ln 2; 1 - H / ln 3
    assert entropy.tolist() == pytest.approx([0.0, 1 - 1.5 * math.log(2) / math.log(3)],
                                             abs=1e-6)


def test_difficulty_measures_by_hand():
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([0, 2])
    # p = (1/2, 1/4, 1/4) and (1/3, 1/3, 1/3)
    assert difficulty(logits, labels, "loss").tolist() == pytest.approx([math.log(2),
                                                                         math.log(3)])
    assert difficulty(logits, labels, "margin").tolist() == pytest.approx([0.25 - 0.5, 0.0],
                                                                           abs=1e-6)
    with pytest.raises(ValueError, match="difficulty measure"):
        difficulty(logits, labels, "rank")


def test_curriculum_gives_nearer_modules_easier_nested_sets():
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7, 0.2])
    sets = curriculum(scores, (0.5, 0.5, 1.0))
    assert [s.tolist() for s in sets] == [[1, 3, 5], [1, 3, 5], [0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="rise"):
        curriculum(scores, (1.0, 0.5, 1.0))
    with pytest.raises(ValueError, match="must be 1"):
        curriculum(scores, (0.5, 0.75))
    first, second = split_disjoint(10, 0.2, seed=3)
    assert len(second) == 2 and set(first.tolist()).isdisjoint(second.tolist())
    assert sorted(first.tolist() + second.tolist()) == list(range(10))


def test_routing_loss_is_the_expected_error_plus_weighted_time():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # (1/2, 1/2), (3/4, 1/4)
    errors = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    time = torch.tensor([0.25, 1.0])
    # image 0: 0.5 (1 + 0.1 x 0.25) + 0.5 (0 + 0.1) = 0.5625; image 1: 0.75 x 0.025 + 0.25 x 0.1
    expected = (0.5 * 1.025 + 0.5 * 0.1 + 0.75 * 0.025 + 0.25 * 0.1) / 2
    assert routing_loss(logits, errors, time, 0.1).item() == pytest.approx(expected)
    # the gradient moves the predictor toward the cheaper right sub-network on image 1
    logits.requires_grad_(True)
    routing_loss(logits, errors, time, 0.1).backward()
    assert logits.grad[1, 0] < 0 < logits.grad[1, 1]


def test_the_oracle_choice_is_the_cheapest_sub_network_that_is_right():
    errors = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    time = torch.tensor([0.5, 1.0])
    # both right: the cheap one; only the expensive right: it; none right: the cheap one
    assert oracle_choice(errors, time).tolist() == [0, 1, 0, 0]
    logits = torch.zeros(4, 2, requires_grad=True)
    loss = oracle_routing_loss(logits, errors, time)
    assert loss.item() == pytest.approx(math.log(2))  # undecided: -log(1/2) on every image
    loss.backward()
    assert logits.grad[1, 1] < 0 < logits.grad[1, 0]  # image 1 is pushed to the expensive one
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]


def test_a_route_offset_sends_images_to_the_expensive_sub_network_and_old_checkpoints_load():
    net = small_net()
    module = net.blocks[1]
    torch.manual_seed(1)
    with torch.no_grad():
        module.predictor[-1].weight.normal_()
    x = torch.randn(64, 4, 14, 14)
    with torch.no_grad():
        margin = module.predictor(x)[:, 1] - module.predictor(x)[:, 0]
        before = module.route(x)
        module.route_offset.fill_(1.0)
        after = module.route(x)
    assert torch.equal(before, (margin > 0).long())
    assert torch.equal(after, (margin + 1.0 > 0).long())  # the offset adds to the last score
    assert int(after.sum()) > int(before.sum())
    state = net.state_dict()
    assert float(state["blocks.1.route_offset"]) == 1.0
    older = {k: v for k, v in state.items() if not k.endswith("route_offset")}
    fresh = small_net(seed=3)
    fresh.load_state_dict(older)  # a checkpoint written before the offset existed
    assert float(fresh.blocks[1].route_offset) == 0.0


def test_the_predictors_operating_point_is_the_share_whose_calibrated_cascade_is_cheapest():
    # one early exit, four images; module 1's predictor margins (expensive minus cheap) are
    # -4, -3, -2, -1: its argmax sends none to the expensive sub-network, an offset sending a
    # quarter sends the last image, half the last two
    confidence = torch.tensor([[0.9, 1.0], [0.8, 1.0], [0.7, 1.0], [0.6, 1.0]])
    right = torch.tensor([[True, True], [False, True], [True, True], [True, True]])
    margins = torch.tensor([[float("nan"), -4.0], [float("nan"), -3.0],
                            [float("nan"), -2.0], [float("nan"), -1.0]])
    tables = {0: ExitTable(confidence, right & torch.tensor([True, False]),
                           torch.tensor([[1.0, 2.0]] * 4), margins=margins),  # misses
              1: ExitTable(confidence, right, torch.tensor([[1.0, 3.0]] * 4)),
              2: ExitTable(confidence, right, torch.tensor([[1.0, 5.0]] * 4))}
    net = small_net(super_modules=(1,))
    target = 1.0

    def table_for(fixed):
        assert fixed is None
        return tables[int((margins[:, 1] + net.blocks[1].route_offset > 0).sum())]

    def calibrate(grid):
        return grid.cheapest(target)

    def rank(outcome):
        return outcome["accuracy"] < target - 1e-9, outcome["mean_cost"]

    assert share_offsets(margins, [1], 0.25)[1] == pytest.approx(1.75)  # -quantile(m, 0.75)
    zero = tables[0], threshold_grid(tables[0]), calibrate(threshold_grid(tables[0]))
    share, offsets, table, _, thresholds = best_offsets(
        net, [1], (0.5, 0.25), table_for, zero, threshold_grid, calibrate, rank)
    assert share == 0.25 and table is tables[1]
    assert float(net.blocks[1].route_offset) == pytest.approx(offsets[1])  # left there
    assert table.outcome(thresholds)["accuracy"] == pytest.approx(1.0)
    # no share given: the argmax, offsets 0
    assert best_offsets(net, [1], (), table_for, zero, threshold_grid, calibrate, rank)[:2] \
        == (0.0, {1: 0.0})


def hand_table() -> ExitTable:
    # four images, three exits; costs 1, 3, 6 at the exits
    confidence = torch.tensor([[0.9, 0.9, 0.9], [0.6, 0.95, 0.9], [0.7, 0.5, 0.9],
                               [0.4, 0.8, 0.9]])
    correct = torch.tensor([[True, True, True], [False, True, True], [False, False, True],
                            [True, False, False]])
    return ExitTable(confidence, correct, torch.tensor([[1.0, 3.0, 6.0]] * 4))


def test_outcome_and_calibration_by_hand():
    table = hand_table()
    outcome = table.outcome(torch.tensor([0.8, 0.9]))
    # exits: image 0 at 0 (0.9 > 0.8), image 1 at 1 (0.95 > 0.9), images 2, 3 at 2
    assert table.exits(torch.tensor([0.8, 0.9])).tolist() == [0, 1, 2, 2]
    assert outcome["accuracy"] == pytest.approx(0.75)
    assert outcome["mean_cost"] == pytest.approx((1 + 3 + 6 + 6) / 4)
    assert [outcome[f"exit_share_{k}"] for k in range(3)] == [0.25, 0.25, 0.5]
    assert table.full_accuracy() == pytest.approx(0.75)
    thresholds = calibrate_for_accuracy(table, 0.75)
    # exit 0 may take image 0 (0.9) but not image 2 (0.7, wrong there): t0 in [0.7, 0.9)
    assert 0.7 <= thresholds[0] < 0.9
    # exit 1 then takes image 1 (0.95, right) and may take image 3 (0.8: wrong there, but
    # wrong at the last exit too), not image 2 (0.5): the lowest candidate, 0.5, is kept
    assert thresholds[1] == pytest.approx(0.5)
    assert table.outcome(thresholds)["accuracy"] == pytest.approx(0.75)
    assert table.outcome(thresholds)["mean_cost"] == pytest.approx((1 + 3 + 6 + 3) / 4)
    # a budget met only by giving up accuracy
    cheap = calibrate_for_budget(table, 3.0)
    assert table.outcome(cheap)["mean_cost"] <= 3.0
    assert table.outcome(cheap)["accuracy"] < 0.75


def test_counting_losses_only_keeps_chance_gains_from_paying_for_losses():
    # one early exit; image 1 is lost there (right at the last exit), image 2 gained
    confidence = torch.tensor([[0.9, 1.0], [0.8, 1.0], [0.7, 1.0], [0.6, 1.0]])
    correct = torch.tensor([[True, True], [False, True], [True, False], [True, True]])
    table = ExitTable(confidence, correct, torch.tensor([[1.0, 3.0]] * 4))
    strict = table.losses_only()
    assert strict.correct[:, 0].tolist() == [True, False, False, True]
    assert strict.full_accuracy() == table.full_accuracy() == pytest.approx(0.75)
    everyone = torch.tensor([0.5])  # all four leave at exit 0
    assert table.outcome(everyone)["accuracy"] == pytest.approx(0.75)  # the gain pays
    assert strict.outcome(everyone)["accuracy"] == pytest.approx(0.5)  # the loss counts
    # for the full network's accuracy: the net count sends everyone out at exit 0; counting
    # losses only, exit 0 may take image 0 alone (image 1, at 0.8, would be lost)
    assert calibrate_for_accuracy(table, 0.75)[0] < 0.6
    assert 0.8 <= calibrate_for_accuracy(strict, 0.75)[0] < 0.9


def test_calibration_finds_the_cheapest_thresholds_of_an_exhaustive_search():
    # small random tables, every threshold that changes an exit tried: 0, each confidence, 1
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        confidence = torch.rand(8, 3, generator=generator)
        correct = torch.rand(8, 3, generator=generator) < torch.tensor([0.5, 0.7, 0.9])
        table = ExitTable(confidence, correct, torch.tensor([[1.0, 2.5, 6.0]] * 8))
        target = table.full_accuracy() - 0.125  # one image of eight may be lost
        options = [[0.0, *confidence[:, k].tolist(), 1.0] for k in range(2)]
        outcomes = [table.outcome(torch.tensor([t0, t1])) for t0 in options[0]
                    for t1 in options[1]]
        best = min(o["mean_cost"] for o in outcomes if o["accuracy"] >= target - 1e-9)
        found = table.outcome(calibrate_for_accuracy(table, target))
        assert found["accuracy"] >= target - 1e-9
        assert found["mean_cost"] == pytest.approx(best)
        richest = max(o["accuracy"] for o in outcomes if o["mean_cost"] <= 3.0 + 1e-9)
        assert table.outcome(calibrate_for_budget(table, 3.0))["accuracy"] == pytest.approx(
            richest)


def test_oracle_is_never_worse_than_any_path_and_exit():
    net = small_net(seed=1)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 3, (32,))
    costs = {name: 1.0 for name in ("0.block", "0.exit", "1.predictor", "1.sub0", "1.sub1",
                                    "1.exit", "2.predictor", "2.sub0", "2.sub1", "2.exit")}
    costs |= {"1.sub1": 4.0, "2.sub1": 4.0}
    best = oracle(net, [(None, x, y)], costs)
    for logits in net.exit_logits_of_paths(x).values():
        for exit_logits in logits:
            assert best["accuracy"] >= (exit_logits.argmax(1) == y).float().mean().item()
    full = path_costs(net, costs, (0, 1, 1), routed=False)
    assert full == [2.0, 2.0 + 5.0, 2.0 + 5.0 + 5.0]
    assert best["mean_cost"] <= full[-1]
    routed = path_costs(net, costs, (0, 0, 1))
    assert routed == [2.0, 2.0 + 1 + 1 + 1, 5.0 + 1 + 4 + 1]  # predictors counted
    # several cost tables in one pass: each the same as the oracle under that table alone
    flat = dict.fromkeys(costs, 1.0)
    both = oracles(net, [(None, x, y)], [costs, flat])
    assert both == [best, oracle(net, [(None, x, y)], flat)]


def test_stage_training_leaves_the_frozen_modules_untouched():
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    stage = StageModel(net, 1)
    optimizer = torch.optim.SGD(stage.trainable_parameters(), lr=0.1)
    stage.train()
    assert not net.blocks[0].training and net.blocks[1].training
    step = module_step(net, 1, torch.tensor([0.5, 1.0]), 0.1)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 3, (16,))
    losses = step(stage, None, x, y)
    assert set(losses) == {"loss", "loss_ce", "loss_route"}
    losses["loss"].backward()
    optimizer.step()
    after = net.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("blocks.1.", "exits.1.")) for k in changed)
    assert any(k.startswith("blocks.1.predictor") for k in changed)  # the routing loss trains it
    with pytest.raises(ValueError, match="not a super-network module"):
        StageModel(net, 0, predictor_only=True)


def test_latency_table_times_every_part_and_counts_flops():
    net = small_net()
    table = latency_table(net, (1, 28, 28), torch.device("cpu"), (1, 4), repeats=2)
    assert set(table["parts"]) == {"0.block", "0.exit", "1.predictor", "1.sub0", "1.sub1",
                                   "1.exit", "2.predictor", "2.sub0", "2.sub1", "2.exit"}
    assert all(entry["ms"]["1"] > 0 and entry["ms"]["4"] > 0
               for entry in table["parts"].values())
    # exit 0: the 4 channels pooled to 4 x 4 cells, 64 -> 64 hidden -> 3 classes; the last
    # exit is linear: 8 channels x 16 cells -> 3 (a multiply-add is 2 FLOPs)
    assert table["parts"]["0.exit"]["flops"] == 2 * 64 * 64 + 2 * 64 * 3
    assert table["parts"]["2.exit"]["flops"] == 2 * 128 * 3
    assert table["parts"]["1.sub1"]["flops"] > table["parts"]["1.sub0"]["flops"]
    assert part_costs(table, 4)["0.block"] == pytest.approx(table["parts"]["0.block"]["ms"]["4"]
                                                            / 4)
    check_device(table, torch.device("cpu"))
    with pytest.raises(ValueError, match="measured on 'cuda: H200'"):
        check_device(table | {"device": "cuda: H200"}, torch.device("cpu"))


def test_joint_stage_training_trains_the_earlier_modules_on_every_exit():
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    stage = StageModel(net, 1, frozen=False)
    stage.train()
    assert net.blocks[0].training and net.exits[0].training and not net.blocks[2].training
    optimizer = torch.optim.SGD(stage.trainable_parameters(), lr=0.1)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 3, (16,))
    losses = module_step(net, 1, torch.tensor([0.5, 1.0]), 0.1, frozen=False)(stage, None, x, y)
    frozen = module_step(net, 1, torch.tensor([0.5, 1.0]), 0.1)(stage, None, x, y)
    # loss_ce: the mean of exit 0's cross-entropy and module 1's (over its sub-networks)
    exit0 = torch.nn.functional.cross_entropy(net.exits[0](net.blocks[0](x)), y)
    assert losses["loss_ce"].item() == pytest.approx((exit0.item() + frozen["loss_ce"].item()) / 2,
                                                     rel=1e-5)
    losses["loss"].backward()
    optimizer.step()
    changed = {k for k, v in net.state_dict().items() if not torch.equal(before[k], v)}
    assert any(k.startswith("blocks.0.") for k in changed)
    assert any(k.startswith("exits.0.") for k in changed)
    assert not any(k.startswith(("blocks.2.", "exits.2.")) for k in changed)


def test_a_fresh_predictor_is_undecided_so_its_choice_can_learn():
    """Random last-layer weights on unnormalized feature maps saturate the softmax (its
    gradient vanishes); a reset predictor scores every sub-network alike."""
    module = small_net().blocks[1]
    x = torch.randn(8, 4, 14, 14) * 50
    with torch.no_grad():
        module.predictor[-1].weight.normal_()
        module.reset_predictor()
        scores = module.predictor(x)
    assert torch.equal(scores, torch.zeros_like(scores))
    # sub-network 1 is right, 0 wrong: the step lowers the score of 0, raises that of 1
    routing_loss(module.predictor(x), torch.tensor([[1.0, 0.0]] * 8), torch.tensor([0.5, 1.0]),
                 0.0).backward()
    bias = module.predictor[-1].bias.grad
    assert bias[0] > 0 > bias[1]


def test_an_exit_table_is_priced_again_per_part():
    net = small_net()
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 3, (8,))
    names = ("0.block", "0.exit", "1.predictor", "1.sub0", "1.sub1", "1.exit", "2.predictor",
             "2.sub0", "2.sub1", "2.exit")
    timed = exit_table(net, [(None, x, y)], dict.fromkeys(names, 1.0))
    priced = timed.priced(net, {name: 2.0 for name in names} | {"1.sub1": 10.0})
    assert torch.equal(priced.confidence, timed.confidence)
    for row, path in enumerate(timed.paths.tolist()):
        assert timed.cost[row].tolist() == [2.0, 5.0, 8.0]  # predictors counted
        second = 4.0 + 2.0 + (10.0 if path[1] == 1 else 2.0) + 2.0  # predictor, sub, exit
        assert priced.cost[row].tolist() == [4.0, second, second + 6.0]


def middle(values: torch.Tensor) -> float:
    """A threshold halfway between two middle values: no image sits on it (there a batch's
    and a single image's float rounding could send it different ways)."""
    ordered = values.sort().values
    return ((ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2).item()


@pytest.mark.parametrize("route_context", [False, True])
def test_a_batch_and_its_images_one_by_one_get_the_same_cascade(route_context):
    # one image at a time takes the no-regrouping path (all stay or all leave at each exit);
    # a batch regroups: both must give every image the same exit, class and sub-networks
    # (with `route_context` the predictor also reads exit 0's probabilities, kept for the
    # images still in play)
    net = small_net(seed=3, route_context=route_context)
    x = torch.randn(48, 1, 28, 28)
    predictor = net.blocks[1].predictor  # made to split the batch between its sub-networks
    assert predictor[2].in_features == 4 * 4 + (3 if route_context else 0)
    torch.nn.init.normal_(predictor[-1].weight)
    with torch.no_grad():
        scores = net.predictor_scores(1, net.blocks[0](x))
        predictor[-1].bias[1] -= middle(scores[:, 1] - scores[:, 0])
    first, _ = confidence_of(net.exits[0](net.blocks[0](x)))
    second = net.infer(x, torch.tensor([middle(first), 0.0]))
    stayed = second.confidence[second.exits == 1]
    thresholds = torch.tensor([middle(first), middle(stayed)])
    batch = net.infer(x, thresholds)
    assert len(batch.exits.unique()) == 3
    assert set(batch.choices[batch.exits > 0, 1].tolist()) == {0, 1}  # both sub-networks ran
    alone = [net.infer(x[i:i + 1], thresholds) for i in range(len(x))]
    assert batch.exits.tolist() == [int(a.exits) for a in alone]
    assert batch.labels.tolist() == [int(a.labels) for a in alone]
    assert batch.choices.tolist() == [a.choices[0].tolist() for a in alone]
    assert torch.allclose(batch.confidence, torch.cat([a.confidence for a in alone]), atol=1e-5)
    with torch.no_grad():  # the choices are the predictor's on the whole batch, where it ran
        routed = batch.exits > 0
        assert torch.equal(batch.choices[routed, 1], net.route(1, net.blocks[0](x))[routed])


def test_the_distillation_loss_by_hand():
    logits, labels = torch.zeros(1, 2), torch.tensor([0])
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # softmax (0.75, 0.25); the logits' (0.5, 0.5)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert distillation_loss(logits, teacher, labels, 1.0, 1.0).item() == pytest.approx(kl)
    # at T = 2 the same softened distributions (teacher doubled), the term times T^2 = 4
    assert distillation_loss(logits, 2 * teacher, labels, 2.0, 1.0).item() == pytest.approx(4 * kl)
    assert distillation_loss(logits, teacher, labels, 1.0, 0.0).item() == pytest.approx(
        math.log(2.0))  # weight 0: the cross-entropy alone
    same = distillation_loss(teacher, teacher, labels, 3.0, 1.0).item()
    assert same == pytest.approx(0.0, abs=1e-5)


def test_refitting_the_exits_makes_them_agree_with_the_last_and_changes_nothing_else():
    net = small_net(exit_pool=2)
    x = torch.randn(256, 1, 28, 28)
    with torch.no_grad():  # labels the last exit gets right: the refit's two targets agree
        y = net.infer(x, torch.tensor([1.0, 1.0])).labels
    batches = [(None, x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]
    before = exit_accuracies(net, batches)
    assert before[2] == 1.0 and max(before[:2]) < 0.8
    state = {k: v.clone() for k, v in net.state_dict().items()}
    metrics = distill_exits(net, batches, epochs=40, lr=0.1, temperature=2.0, weight=0.5, seed=0)
    after = exit_accuracies(net, batches)
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.1 and after[2] == 1.0
    assert set(metrics) == {"exit0_distill_loss", "exit1_distill_loss"}
    changed = {k for k, v in net.state_dict().items() if not torch.equal(v, state[k])}
    # the early exits' classifiers (a hidden layer and a linear one), nothing else
    assert changed == {f"exits.{k}.fc.{layer}.{p}" for k in (0, 1) for layer in (0, 2)
                       for p in ("weight", "bias")}
    inputs, final, labels = exit_inputs(net, batches)
    assert [tuple(i.shape) for i in inputs] == [(256, 4 * 4), (256, 8 * 4)]  # C x 2 x 2
    assert (final.argmax(1) == labels).all()


def test_early_exits_have_a_hidden_layer_the_last_exit_stays_linear():
    net = small_net(exit_hidden=5)
    assert [type(e.fc).__name__ for e in net.exits] == ["Sequential", "Sequential", "Linear"]
    assert net.exits[0].fc[0].out_features == 5
    assert all(isinstance(e.fc, torch.nn.Linear) for e in small_net(exit_hidden=0).exits)
    with pytest.raises(ValueError, match="exit_hidden must be 0 or more, got -1"):
        small_net(exit_hidden=-1)
