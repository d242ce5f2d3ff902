"""PBT tasks: one member's training round (`MemberRound`, trained by `tasks.rounds.round_task`),
the greedy soup, and the population's lineage log.

A member round loads the checkpoint it starts from by reference (its own, or after a copy the
best member's), starts from the weights of that checkpoint it is told to (`MemberRound`'s
`weights`: exploit copies the weights the best was ranked on, `exploit_weights`), sets the
member's own hyperparameters on the rebuilt optimizer, trains, scores the validation split, and
writes and versions a checkpoint. Members exchange weights only through these versioned
artifacts, so a member on another machine gets the best's checkpoint by hash.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from prefect import task

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import RoundPlan, RoundResult, round_task
from tasks.training import resume
from training.batches import eval_batches, split_batches
from training.device import place_model, setup_device
from training.pbt.soup import greedy_soup
from training.recipe import choose_weights, start_average
from training.rounds import Closed, Opened, Trainee, classifier_round, new_model

HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "augment")


# The checkpoint entry a member round scored and that gets tested and exported.
SCORED_WEIGHTS = "kept"
# The checkpoint entry of a member round's last weights (its optimizer state belongs to them).
LAST_WEIGHTS = "model"


def exploit_weights(best: RoundResult) -> str:
    """The checkpoint entry of the stage's best member that exploit copies to every member:
    the weights whose validation score ranked it (`best.kept`).

    `kept` (`SCORED_WEIGHTS`) where the weight average won, `model` (`LAST_WEIGHTS`) where the
    last weights won: then `kept` holds the same tensors, and `model` also brings the optimizer
    state and the average that go with them (`MemberRound`).
    """
    return SCORED_WEIGHTS if best.kept == "averaged" else LAST_WEIGHTS


def member_config(base: ClassifierConfig, member: int, hyperparameters: dict[str, float]
                  ) -> ClassifierConfig:
    """A member's classifier config: the base with its seed and hyperparameters. These are
    bounded by the search space (`PBTConfig`'s `*_range`, validated there), not by the single
    run's field bounds, so a range may explore past `--lr`'s 10."""
    optim = base.optim.model_copy(update={name: float(hyperparameters[name])
                                          for name in HYPERPARAMETERS})
    return base.replace(seed=base.run.seed * 1000 + member, optim=optim)


class MemberRound(RoundPlan):
    """Passes `first_epoch` .. `first_epoch + epochs - 1` of one member with `config`'s
    hyperparameters, from the checkpoint the round is given.

    The learning rate is the member's `lr` times a cosine decay from pass `cycle[0]` (the
    peak) to pass `cycle[1]` (zero), so members of a stage share one schedule shape.

    With `average_decay`, an exponential moving average of the weights follows every step,
    carried in the checkpoint under `averaged` (it starts from the weights this round starts
    from when the previous checkpoint has none). Both the last weights and the average are
    scored on the validation split and the better one is kept (`training.recipe.choose_weights`)
    under `kept`: a member with a large learning rate is not ranked on its noisiest weights,
    and an average is never worse than the weights it follows. Within the round the optimizer
    steps the last weights; the average only follows them.

    `weights` names the entry of the previous checkpoint the round starts from:

    - `model` (`LAST_WEIGHTS`): its last weights, with its optimizer's momentum buffers and its
      weight average, which go on as if the round that wrote it had gone on;
    - another entry, e.g. `kept` after exploit chose a member whose average won
      (`exploit_weights`): those weights, with an empty optimizer (the stored momentum buffers
      were gathered along the last weights' path, not at these weights) and, with
      `average_decay`, an average that starts at them (the average `a` and the weights `w`
      begin equal, then `a <- decay * a + (1 - decay) * w` after every step).

    Either way the optimizer takes `config`'s momentum and weight decay
    (`tasks.training.resume`); the learning rate is set at every step.

    Raises (from `open`):
        ValueError: `weights` is not `model` and the previous checkpoint is missing or has no
            such entry.
    """

    config: ClassifierConfig
    dataset: DatasetRef
    population: str
    member: int
    phase: str
    index: int
    first_epoch: int
    epochs: int
    cycle: tuple[int, int]
    average_decay: float | None = None
    weights: str = LAST_WEIGHTS

    @property
    def number(self) -> int:
        return self.index

    def task_name(self) -> str:
        return f"member-{self.member}-{self.phase}-{self.index}"

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        config, store = self.config, ArtifactStore()
        data = load_dataset(self.dataset)
        before = load_checkpoint(store, previous) if previous is not None else {}
        average_state = before.get("averaged")
        if self.weights != LAST_WEIGHTS:  # copied weights: no momentum or average of another path
            if self.weights not in before:
                raise ValueError(f"member {self.member} cannot start from the "
                                 f"{self.weights!r} weights of "
                                 f"{previous.path if previous else 'no checkpoint'}")
            before, average_state = {"model": before[self.weights]}, None
        model, optimizer = resume(config, self.dataset, store, previous, device, before)
        averaged = None
        if self.average_decay is not None:
            averaged = start_average(model, self.average_decay, average_state)
        passes = range(self.first_epoch, self.first_epoch + self.epochs)
        round_ = classifier_round(config, self.dataset, data, passes, self.cycle,
                                  average_decay=self.average_decay)
        return Opened(Trainee(model, optimizer, averaged=averaged), round_, {"data": data})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        data, trainee = opened.context["data"], opened.trainee
        choice = choose_weights(trainee.model, trainee.averaged,
                                eval_batches(data, self.dataset, "val", device),
                                split_batches(data, self.dataset, "train", 256, device), device)
        metrics = metrics | choice.metrics | {"train_seconds": seconds}
        payload = {"model": trainee.model.state_dict(),
                   "optimizer": trainee.optimizer.state_dict(),
                   SCORED_WEIGHTS: choice.module.state_dict(), "kept_source": choice.source,
                   "member": self.member, "phase": self.phase, "index": self.index,
                   "hyperparameters": {name: getattr(self.config.optim, name)
                                       for name in HYPERPARAMETERS}}
        if trainee.averaged is not None:
            payload["averaged"] = trainee.averaged.module.state_dict()
        return Closed(metrics, payload, kept=choice.source)

    def relpath(self) -> str:
        return (f"checkpoints/pbt/{self.population}/member-{self.member:02d}-{self.phase}-"
                f"{self.index:03d}.pt")


# The round task for members, retried once: a member that fails again is recorded in the
# lineage and the population goes on without it.
member_round = round_task.with_options(retries=1)


def write_lineage(population: str, records: list[dict[str, Any]]) -> ArtifactRef:
    """The lineage log (JSON lines, one record per member and stage, in order), written whole
    and atomically after each stage: earlier lines never change, new ones are added."""
    text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
    return ArtifactStore().write(f"pbt/{population}/lineage.jsonl",
                                 lambda path: Path(path).write_text(text))


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="soup")
def soup_members(config: ClassifierConfig, dataset: DatasetRef, population: str,
                 results: list[RoundResult], members: list[int], first: int) -> RoundResult:
    """The greedy soup (`training.pbt.soup`) of one stage's members (`results`, of the members
    numbered `members`), all trained on from the same checkpoint, starting from
    `results[first]` (the stage's best): a round result whose `kept` weights are the soup,
    with `soup_ingredients` among its metrics. With one ingredient it is that member's
    weights, unchanged."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    states = [load_checkpoint(store, r.checkpoint)[SCORED_WEIGHTS] for r in results]
    model = place_model(new_model(config, dataset), device)
    soup = greedy_soup(model, states, [r.metrics["val_accuracy"] for r in results],
                       eval_batches(data, dataset, "val", device),
                       split_batches(data, dataset, "train", 256, device), device, first)
    best = results[first]
    payload = {SCORED_WEIGHTS: soup.state, "kept_source": "soup",
               "ingredients": [members[i] for i in soup.ingredients]}
    relpath = f"checkpoints/pbt/{population}/soup.pt"
    return RoundResult(round=best.round, checkpoint=save_checkpoint(store, relpath, payload),
                       metrics=best.metrics | soup.metrics, kept="soup")
