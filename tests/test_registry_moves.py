"""The promotion gates (latency budget, --no-register, the baseline), the paired decision,
and moving `champion` by hand (`promote`, `rollback`), on the session's real MLflow registry
with the smoke champion's real pyfunc as every version's logged model; the models' quality is
known: per-image evidence (`tests.known_quality`)."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from flows.cli import main
from flows.commands import COMMANDS
from tasks.adapters import tracking
from tasks.adapters.aliases import history
from tasks.adapters.locks import read_lease
from tasks.adapters.registration import NOT_REGISTERED, Policy, promote
from tests.known_quality import known

CLASSES = ["a", "b"]


def _promote(first_run, name: str, md5: str, policy: Policy, scores: dict[str, float],
             times: dict[str, float] | None = None, refusal: str | None = None,
             parameters: int = 1000):
    """`promote` of the smoke champion's logged pyfunc as a new version (`md5`) of `name`,
    scored by `scores` (URI -> accuracy of a model of known quality; the pyfunc's own URI is
    "new") and timed by `times`."""
    run_id = tracking.start_run("registry-tests", md5)
    uri = first_run.registration.model_uri
    return run_id, promote(run_id, name, uri, lambda u: known(scores["new" if u == uri else u]),
                           CLASSES, md5, {}, policy, refusal, timer=None if times is None else
                           lambda u: times["new" if u == uri else u],
                           parameters=lambda u: parameters)


def test_no_register_touches_nothing(first_run):
    run_id, reg = _promote(first_run, "never-registered", "m0", Policy(registry=False), {})
    assert not reg.registered and reg.decision == NOT_REGISTERED
    assert tracking.model_versions("never-registered") == []
    assert MlflowClient().get_run(run_id).data.tags["registry.model_uri"] == reg.model_uri


def test_the_latency_budget_gates_the_champion(first_run):
    name = "latency-gated"
    _, first = _promote(first_run, name, "m1", Policy(max_latency_ms=5.0), {"new": 0.5},
                        {"new": 2.0})
    assert first.alias == "champion"
    # more accurate but over the budget: a challenger, and the reason is on the run
    run_id, slow = _promote(first_run, name, "m2", Policy(max_latency_ms=5.0),
                            {"new": 0.9, f"models:/{name}/1": 0.5}, {"new": 9.0})
    assert slow.alias == "challenger" and slow.decision.startswith("over the latency budget")
    assert MlflowClient().get_run(run_id).data.metrics["registry_ms_per_image"] == 9.0
    # a tighter budget that the champion itself misses: a model within it wins though less
    # accurate (the trade is the user's, made explicit by the budget)
    _, fast = _promote(first_run, name, "m3", Policy(max_latency_ms=1.5),
                       {"new": 0.4, f"models:/{name}/1": 0.5},
                       {"new": 1.0, f"models:/{name}/1": 2.0})
    assert fast.alias == "champion" and "within the latency budget" in fast.decision
    assert history(name) == ["1", "3"]


def test_the_real_pyfunc_is_timed(first_run):
    import numpy as np

    from tasks.adapters.registration import served_ms_per_image

    images = np.zeros((4, 28, 28), dtype=np.uint8)
    assert 0 < served_ms_per_image(first_run.registration.model_uri, images) < 10_000


def test_promote_and_rollback_by_hand(first_run, capsys):
    name = "moved"
    scores = {f"models:/{name}/1": 0.5, f"models:/{name}/2": 0.6}
    for md5, score in (("v1", 0.5), ("v2", 0.6), ("v3", 0.4)):
        _promote(first_run, name, md5, Policy(), scores | {"new": score})
    assert tracking.alias_version(name, "champion") == "2"  # v3 did not beat v2
    main(COMMANDS, ["promote", name, "3", "--reason", "better on new data", "--by", "ana"])
    assert "version 3 is champion (was 2)" in capsys.readouterr().out
    assert tracking.alias_version(name, "champion") == "3"
    tags = tracking.version_tags(name, "3")
    assert tags["promoted.by"] == "ana" and tags["promoted.reason"] == "better on new data"
    assert tracking.version_tags(name, "2")["demoted.by"] == "ana"
    assert json.loads(tracking.model_tags(name)["champion.history"]) == ["1", "2", "3"]
    main(COMMANDS, ["rollback", name, "--reason", "regression in production", "--by", "bo"])
    assert "version 2 is champion again (was version 3)" in capsys.readouterr().out
    assert tracking.alias_version(name, "champion") == "2"
    assert tracking.version_tags(name, "3")["demoted.reason"] == "regression in production"
    main(COMMANDS, ["rollback", name, "--reason", "again"])
    assert tracking.alias_version(name, "champion") == "1"
    for argv, message in ((["rollback", name, "--reason", "x"], "no earlier champion"),
                          (["promote", name, "9", "--reason", "x"], "has no version 9"),
                          (["promote", "no-such-model", "1", "--reason", "x"], "no such")):
        with pytest.raises(SystemExit) as exit_info:
            main(COMMANDS, argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(COMMANDS, ["promote", name, "1"])  # the reason is required
    assert exit_info.value.code == 2 and "reason" in capsys.readouterr().err


def test_the_baseline_gate_has_a_margin_at_a_perfect_baseline():
    """The digits story: k-NN 121 of 121 on validation, the model 118. One standard error of a
    perfect score is 0, which refused the model; the Wilson interval's lower end is 0.969,
    which lets it through, while a model clearly below the baseline is still refused."""
    from training.promotion import Baseline

    digits = Baseline(name="knn", val_accuracy=1.0, model_val_accuracy=118 / 121,
                      val_images=121)
    assert digits.refusal() is None and digits.lower == pytest.approx(121 / (121 + 1.96 ** 2),
                                                                      abs=1e-4)
    below = Baseline(name="knn", val_accuracy=0.95, model_val_accuracy=0.90, val_images=300)
    assert below.refusal() is not None and "Wilson" in below.refusal()
    assert Baseline(name="knn", val_accuracy=0.95, model_val_accuracy=0.93,
                    val_images=300).refusal() is None  # within the interval (0.919, 0.970)


def test_the_good_model_becomes_champion_and_the_chance_level_one_never_does(first_run):
    """The digits story on the registry: the good model (0.9968 on the test split) was kept
    out by a gate, so there is no champion; a chance-level model (0.1182) with the gate off
    is then compared with every version already registered and stays a challenger; the good
    model's next run takes the seat, and the chance-level one never replaces it."""
    name, scores = "digits", {"models:/digits/1": 0.9968, "models:/digits/2": 0.1182}
    _, good = _promote(first_run, name, "good", Policy(), scores | {"new": 0.9968},
                       refusal="kept out by a gate")
    assert good.alias == "challenger" and tracking.alias_version(name, "champion") is None
    run_id, chance = _promote(first_run, name, "chance", Policy(), scores | {"new": 0.1182})
    assert chance.alias == "challenger"
    assert "version 1 is better" in chance.decision and "McNemar exact" in chance.decision
    tags = MlflowClient().get_run(run_id).data.tags
    assert float(tags["registry.p_worse"]) < 0.05 and tags["registry.test"] == "McNemar exact"
    _, again = _promote(first_run, name, "good-again", Policy(), scores | {"new": 0.9968})
    assert again.alias == "champion"  # ties version 1 and beats version 2: the seat is free
    _, chance_again = _promote(first_run, name, "chance-again", Policy(),
                               scores | {"models:/digits/3": 0.9968, "new": 0.1182})
    assert chance_again.alias == "challenger"
    assert tracking.alias_version(name, "champion") == again.version


def test_one_image_of_noise_never_swaps_champions(first_run):
    """One more image right is no evidence (McNemar: p = 0.5); a clear gain is; a tie with
    fewer served parameters also takes the seat, a tie with more does not."""
    name = "noise"
    scores = {f"models:/{name}/{v}": q for v, q in (("1", 0.9), ("2", 0.9025), ("3", 0.95))}
    _promote(first_run, name, "n1", Policy(), scores | {"new": 0.9})
    _, one_more = _promote(first_run, name, "n2", Policy(), scores | {"new": 0.9025})
    assert one_more.alias == "challenger" and "does not beat" in one_more.decision
    _, clear = _promote(first_run, name, "n3", Policy(), scores | {"new": 0.95})
    assert clear.alias == "champion" and "beats the champion (version 1)" in clear.decision
    _, bigger_tie = _promote(first_run, name, "n4", Policy(), scores | {"new": 0.95},
                             parameters=2000)
    assert bigger_tie.alias == "challenger"
    _, smaller_tie = _promote(first_run, name, "n5", Policy(), scores | {"new": 0.95},
                              parameters=10)
    assert smaller_tie.alias == "champion" and "is cheaper" in smaller_tie.decision


def test_champion_and_challenger_are_compared_on_images_neither_saw(first_run, fashion_folder):
    """A champion prepared under another split seed trained on part of this run's test split:
    those images are left out of the comparison, counted from each version's recorded data
    set (its keys), and the decision says on how many images it was made."""
    from tasks.configs.sections import DataSection
    from tasks.data import load_dataset, prepare_dataset, source_version
    from tasks.promotion import promote_on_test_images

    name, uri = "unseen-comparison", first_run.registration.model_uri
    prepared = {}
    for seed in (0, 1):
        data = DataSection(data=str(fashion_folder), split_seed=seed, test_fraction=0.3)
        prepared[seed] = prepare_dataset.fn(data, source_version(data))
    first_run_id = tracking.start_run("registry-tests", "unseen-1")
    first = promote_on_test_images(first_run_id, name, uri, prepared[0], "u1", Policy(), None)
    assert first.alias == "champion"
    run_id = tracking.start_run("registry-tests", "unseen-2")
    second = promote_on_test_images(run_id, name, uri, prepared[1], "u2", Policy(), None)
    old, new = load_dataset(prepared[0]), load_dataset(prepared[1])
    seen = ({old.keys[i] for s in ("train", "val") for i in old.splits[s].tolist()}
            | {new.keys[i] for s in ("train", "val") for i in new.splits[s].tolist()})
    unseen = [new.keys[i] for i in new.splits["test"].tolist() if new.keys[i] not in seen]
    left_out = len(new.splits["test"]) - len(unseen)
    assert left_out > 0 and unseen
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["registry.compared_images"] == str(len(unseen))
    assert tags["registry.compared_left_out"] == str(left_out)
    assert f"on the {len(unseen)} test images neither model trained" in second.decision
    # the same model on the same images: a tie, so the champion stays
    assert second.champion_version == first.version and second.alias == "challenger"


def test_two_promotions_started_together_leave_the_better_model_champion(first_run):
    """Two runs promote versions of one model at once, as two pipeline runs on a shared server
    would, each slow to score. Without the registry lock both would beat the old champion and
    the later one would take the alias; with it the second compares with the first's result,
    so the better model ends champion and each run records its decision."""
    import threading
    import time

    name, uri = "raced", first_run.registration.model_uri
    accuracy = {"old": 0.5, "better": 0.7, "worse": 0.6}  # by the version's program (md5)
    run_ids, registrations = {}, {}

    def promote_as(program: str) -> None:
        def score(model_uri: str):
            time.sleep(0.5)
            if model_uri == uri:
                return known(accuracy[program])
            tags = tracking.version_tags(name, model_uri.rsplit("/", 1)[1])
            return known(accuracy[tags["program"]])

        run_ids[program] = tracking.start_run("registry-tests", program)
        registrations[program] = promote(run_ids[program], name, uri, score, CLASSES, program,
                                         {}, Policy(), parameters=lambda u: 1000)

    promote_as("old")  # the champion both runs find
    threads = [threading.Thread(target=promote_as, args=(program,))
               for program in ("better", "worse")]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # the better one starts first, so without the lock it would lose
    for thread in threads:
        thread.join()
    better, worse = registrations["better"], registrations["worse"]
    assert tracking.alias_version(name, "champion") == better.version
    assert better.champion_version == registrations["old"].version
    assert worse.alias == "challenger" and worse.champion_version == better.version
    for program in accuracy:
        assert MlflowClient().get_run(run_ids[program]).data.tags["registry.decision"]
    assert read_lease(name) is None  # the lock is free again


def test_a_champion_that_trained_on_copies_under_other_names_is_not_scored_on_them(
        first_run, fashion_folder, tmp_path):
    """The champion trained on one folder; the new model's folder holds the same images under
    other names. By path none was seen; by content, the test images the champion trained or
    was chosen on are left out of the comparison."""
    import shutil

    from tasks.configs.sections import DataSection
    from tasks.data import load_dataset, prepare_dataset, source_version
    from tasks.promotion import promote_on_test_images

    renamed = tmp_path / "renamed"
    for path in fashion_folder.rglob("*.*"):
        target = renamed / path.parent.name / f"copy-{path.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    prepared = []
    for folder in (fashion_folder, renamed):
        data = DataSection(data=str(folder), test_fraction=0.3)
        prepared.append(prepare_dataset.fn(data, source_version(data)))
    name, uri = "copies-comparison", first_run.registration.model_uri
    first = promote_on_test_images(tracking.start_run("registry-tests", "copies-1"), name, uri,
                                   prepared[0], "c1", Policy(), None)
    assert first.alias == "champion"
    run_id = tracking.start_run("registry-tests", "copies-2")
    promote_on_test_images(run_id, name, uri, prepared[1], "c2", Policy(), None)
    old, new = load_dataset(prepared[0]), load_dataset(prepared[1])
    assert not old.seen_keys() & set(new.keys)  # no name in common
    seen = old.seen_contents()
    left_out = sum(new.contents[i] in seen for i in new.splits["test"].tolist())
    assert left_out > 0
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["registry.compared_left_out"] == str(left_out)
    assert tags["registry.compared_images"] == str(len(new.splits["test"]) - left_out)
