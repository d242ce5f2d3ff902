"""PBT's population loop (`training.pbt.population`) over a trainer whose scores are set by
hand: who starts from what, what the lineage records, what a failing member costs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from training.pbt.population import PopulationSettings, run_population
from training.pbt.scheduler import PBTScheduler, PopulationFailed, SearchSpace

BASE = {"lr": 0.1}


@dataclass
class Result:
    checkpoint: str
    metrics: dict[str, float]
    kept: str = "model"


@dataclass
class Trainer:
    """Member m scores `scores[(phase, index)][m]` (None: it fails); records every start."""

    scores: dict[tuple[str, int], list[float | None]]
    starts: list = field(default_factory=list)

    def __call__(self, round_, starts):
        self.starts.append((round_, list(starts)))

        def waiter(m: int):
            def wait() -> Result:
                score = self.scores[(round_.phase, round_.index)][m]
                if score is None:
                    raise RuntimeError(f"member {m} diverged")
                return Result(f"{round_.phase}-{round_.index}-{m}", {"val_accuracy": score},
                              kept="averaged" if m == 2 else "model")
            return wait

        return [waiter(s.member) for s in starts]


def settings(**changes) -> PopulationSettings:
    return PopulationSettings(**{"members": 3, "burn_in_rounds": 1, "burn_in_patience": None,
                                 "stages": 2, "stage_rounds": 1, "repeats": 2,
                                 "average_decay": 0.9, "target_accuracy": None,
                                 "stage_patience": None, "soup": False, **changes})


def scheduler() -> PBTScheduler:
    return PBTScheduler([SearchSpace("lr", 0.01, 1.0)], 3, BASE, seed=0, keep_base=True)


def exploit(best: Result) -> str:
    return "kept" if best.kept == "averaged" else "model"


def test_every_member_starts_the_next_stage_from_the_best_and_the_lineage_says_so():
    trainer = Trainer({("burn-in", 1): [0.5, 0.6, 0.4], ("stage", 1): [0.6, 0.7, 0.8],
                       ("stage", 2): [0.9, 0.7, 0.6]})
    population = run_population(settings(), scheduler, BASE, "start", trainer, exploit,
                                "model")
    (burn_in, burn_starts), (stage1, stage1_starts), (stage2, stage2_starts) = trainer.starts
    assert [s.checkpoint for s in burn_starts] == ["start"] * 3
    assert burn_in.cycle == (0, 6) and burn_in.average_decay is None  # passes: (1 + 2) x 2
    assert [s.checkpoint for s in stage1_starts] == [f"burn-in-1-{m}" for m in range(3)]
    assert stage1.first == 2 and stage1.cycle == (2, 6) and stage1.average_decay == 0.9
    # member 2 won stage 1 on its average: every member starts stage 2 from its `kept` weights
    assert {(s.checkpoint, s.weights) for s in stage2_starts} == {("stage-1-2", "kept")}
    assert stage2.first == 4
    assert stage2_starts[2].hyperparameters == stage1_starts[2].hyperparameters  # it keeps
    assert (population.best_member, population.best.checkpoint, population.stages) == (
        0, "stage-2-0", 2)
    assert [(r["phase"], r["stage"], r["member"], r["parent"]) for r in population.lineage] == [
        ("burn-in", 1, 0, None), ("burn-in", 1, 1, None), ("burn-in", 1, 2, None),
        ("stage", 1, 0, None), ("stage", 1, 1, None), ("stage", 1, 2, None),
        ("stage", 2, 0, 2), ("stage", 2, 1, 2), ("stage", 2, 2, 2)]
    assert population.lineage[-1]["copied"] == "averaged"


def test_a_failing_member_is_recorded_and_a_stage_where_all_fail_ends_the_run():
    trainer = Trainer({("burn-in", 1): [0.5, None, 0.4], ("stage", 1): [0.6, 0.7, None],
                       ("stage", 2): [0.9, 0.7, 0.6]})
    population = run_population(settings(), scheduler, BASE, None, trainer, exploit, "model")
    failed = [r for r in population.lineage if r["score"] is None]
    assert [(r["phase"], r["member"]) for r in failed] == [("burn-in", 1), ("stage", 2)]
    assert "diverged" in failed[0]["error"]
    # the failed member goes on from where it started (its start), the others from their round
    stage1_starts = trainer.starts[1][1]
    assert [s.checkpoint for s in stage1_starts] == ["burn-in-1-0", None, "burn-in-1-2"]
    with pytest.raises(PopulationFailed, match="every member failed in stage 1"):
        run_population(settings(), scheduler, BASE, None, Trainer(
            {("burn-in", 1): [0.5, 0.6, 0.4], ("stage", 1): [None, None, None]}), exploit,
            "model")


def test_the_soup_is_kept_only_when_it_holds_more_than_one_member():
    scores = {("burn-in", 1): [0.5, 0.6, 0.4], ("stage", 1): [0.6, 0.7, 0.8],
              ("stage", 2): [0.9, 0.7, 0.6]}
    calls = []

    def soup(trained, members, first):
        calls.append((members, first))
        return Result("soup", {"val_accuracy": 0.95, "soup_ingredients": len(calls)},
                      kept="soup")

    one = run_population(settings(soup=True), scheduler, BASE, None, Trainer(scores), exploit,
                         "model", soup=soup)
    assert calls == [([0, 1, 2], 0)] and one.best.checkpoint == "stage-2-0"
    assert one.lineage[-1] | {"hyperparameters": None} == {
        "phase": "soup", "stage": 2, "member": 0, "parent": None, "copied": None,
        "hyperparameters": None, "score": 0.95, "ingredients": 1}
    two = run_population(settings(soup=True), scheduler, BASE, None, Trainer(scores), exploit,
                         "model", soup=soup)
    assert two.best.checkpoint == "soup" and two.best_member == 0


@pytest.mark.parametrize("single_bank", [True, False], ids=["single-bank", "per-state"])
def test_the_teachers_next_stage_starts_before_the_student_stage_is_awaited(single_bank):
    """`training.distill.stages.run_stages`: the order of starts, snapshots and waits."""
    from training.distill.stages import run_stages

    events: list[str] = []

    def teacher(stage, previous):
        events.append(f"start teacher {stage} from {previous}")
        return lambda: (events.append(f"wait teacher {stage}"), f"T{stage}")[1]

    def snapshot(stage, teacher_done, previous):
        events.append(f"bank {stage} from {teacher_done}, {previous}")
        return f"B{stage}"

    def student(stage, previous, bank):
        events.append(f"start student {stage} from {previous} on {bank}")
        return lambda: (events.append(f"wait student {stage}"), f"S{stage}")[1]

    stages = []
    run_stages(2, single_bank, teacher, snapshot, student, lambda *s: stages.append(s))
    assert stages == [("T1", "B1", "S1"), ("T2", "B2", "S2")]
    common = ["start teacher 1 from None", "wait teacher 1", "bank 1 from T1, None",
              "start teacher 2 from T1", "start student 1 from None on B1", "wait teacher 2"]
    if single_bank:  # bank 2 rewrites the file student 1 reads: wait for it first
        rest = ["wait student 1", "bank 2 from T2, B1", "start student 2 from S1 on B2"]
    else:
        rest = ["bank 2 from T2, B1", "wait student 1", "start student 2 from S1 on B2"]
    assert events == common + rest + ["wait student 2"]
