"""PBT tasks: one member's training round, and the population's lineage log.

A member round loads the checkpoint it starts from by reference (its own, or after a copy the
best member's), starts from the weights of that checkpoint it is told to (`train_member`'s
`weights`: exploit copies the weights the best was ranked on, `exploit_weights`), sets the
member's own hyperparameters on the rebuilt optimizer, trains, scores the validation split, and
writes and versions a checkpoint. Members exchange weights only through these versioned
artifacts, so a member on another machine gets the best's checkpoint by hash.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.sections import ClassifierConfig
from tasks.data import DatasetRef, load_dataset
from tasks.training import (
    eval_batches,
    new_model,
    resume,
    setup_device,
    split_batches,
    train_passes,
)
from training.device import place_model
from training.pbt.scheduler import PBTScheduler, SearchSpace
from training.pbt.soup import greedy_soup
from training.recipe import choose_weights, start_average

HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "augment")


class MemberResult(BaseModel):
    """What a member round returns: its checkpoint, metrics, and which weights it kept
    (`model`, the last weights, or `averaged`, the weight average)."""

    model_config = ConfigDict(frozen=True)

    member: int
    checkpoint: ArtifactRef
    metrics: dict[str, float]
    kept: str = "model"


def search_spaces(config: Any) -> list[SearchSpace]:
    """The searched hyperparameters of a `pbt` config, with their bounds and scales."""
    return [SearchSpace("lr", *config.lr_range, "log"),
            SearchSpace("weight_decay", *config.weight_decay_range, "log"),
            SearchSpace("momentum", *config.momentum_range, "linear"),
            SearchSpace("augment", *config.augment_range, "linear")]


def population_scheduler(config: Any, members: int, base: dict[str, float],
                         val_images: int) -> PBTScheduler:
    """The `pbt` config's scheduler: its search space and perturbations, member 0 at `base`'s
    values, the incumbent kept within `--tie-margin` (none: one standard error on
    `val_images`)."""
    return PBTScheduler(search_spaces(config), members, base, config.seed,
                        *config.explore_factors, linear_step=config.explore_step,
                        margin=config.tie_margin, val_images=val_images, keep_base=True)


# The checkpoint entry a member round scored and that gets tested and exported.
SCORED_WEIGHTS = "kept"
# The checkpoint entry of a member round's last weights (its optimizer state belongs to them).
LAST_WEIGHTS = "model"


def exploit_weights(best: MemberResult) -> str:
    """The checkpoint entry of the stage's best member that exploit copies to every member:
    the weights whose validation score ranked it (`best.kept`).

    `kept` (`SCORED_WEIGHTS`) where the weight average won, `model` (`LAST_WEIGHTS`) where the
    last weights won: then `kept` holds the same tensors, and `model` also brings the optimizer
    state and the average that go with them (`train_member`).
    """
    return SCORED_WEIGHTS if best.kept == "averaged" else LAST_WEIGHTS


def member_config(base: ClassifierConfig, member: int, hyperparameters: dict[str, float]
                  ) -> ClassifierConfig:
    """A member's classifier config: the base with its seed and hyperparameters."""
    return base.model_copy(update={"seed": base.seed * 1000 + member, **{
        name: hyperparameters[name] for name in HYPERPARAMETERS}})


def _member_run_name() -> str:
    p = task_run.parameters
    return f"member-{p['member']}-{p['phase']}-{p['index']}"


@task(cache_key_fn=computation_key, persist_result=True, retries=1,
      task_run_name=_member_run_name)
def train_member(config: ClassifierConfig, dataset: DatasetRef, population: str, member: int,
                 phase: str, index: int, first_epoch: int, epochs: int,
                 cycle: tuple[int, int], previous: ArtifactRef | None,
                 average_decay: float | None = None, weights: str = LAST_WEIGHTS
                 ) -> MemberResult:
    """Trains passes `first_epoch` .. `first_epoch + epochs - 1` of one member from `previous`
    with `config`'s hyperparameters (`training.recipe.train_round`).

    The learning rate is the member's `lr` times a cosine decay from pass `cycle[0]` (the
    peak) to pass `cycle[1]` (zero), so members of a stage share one schedule shape.

    With `average_decay`, an exponential moving average of the weights follows every step,
    carried in the checkpoint under `averaged` (it starts from the weights this round starts
    from when `previous` has none). Both the last weights and the average are scored on the
    validation split and the better one is kept (`training.recipe.choose_weights`) under
    `kept`: a member with a large learning rate is not ranked on its noisiest weights, and an
    average is never worse than the weights it follows. Within the round the optimizer steps
    the last weights; the average only follows them.

    `weights` names the entry of `previous` the round starts from:

    - `model` (`LAST_WEIGHTS`): its last weights, with its optimizer's momentum buffers and its
      weight average, which go on as if the round that wrote `previous` had gone on;
    - another entry, e.g. `kept` after exploit chose a member whose average won
      (`exploit_weights`): those weights, with an empty optimizer (the stored momentum buffers
      were gathered along the last weights' path, not at these weights) and, with
      `average_decay`, an average that starts at them (the average `a` and the weights `w`
      begin equal, then `a <- decay * a + (1 - decay) * w` after every step).

    Either way the optimizer takes `config`'s momentum and weight decay
    (`tasks.training.resume`); the learning rate is set at every step.

    Raises:
        ValueError: `weights` is not `model` and `previous` is missing or has no such entry.
    """
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    before = load_checkpoint(store, previous) if previous is not None else {}
    average_state = before.get("averaged")
    if weights != LAST_WEIGHTS:  # copied weights: no momentum buffers or average of another path
        if weights not in before:
            raise ValueError(f"member {member} cannot start from the {weights!r} weights of "
                             f"{previous.path if previous else 'no checkpoint'}")
        before, average_state = {"model": before[weights]}, None
    model, optimizer = resume(config, dataset, store, previous, device, before)  # own values
    averaged = None
    if average_decay is not None:
        averaged = start_average(model, average_decay, average_state)

    started = time.perf_counter()
    metrics = train_passes(config, dataset, data, model, optimizer, device,
                           range(first_epoch, first_epoch + epochs), cycle, averaged=averaged,
                           average_decay=average_decay)
    choice = choose_weights(model, averaged, eval_batches(data, dataset, "val", device),
                            split_batches(data, dataset, "train", 256, device), device)
    metrics |= choice.metrics | {"train_seconds": time.perf_counter() - started}
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
               SCORED_WEIGHTS: choice.module.state_dict(), "kept_source": choice.source,
               "member": member, "phase": phase, "index": index,
               "hyperparameters": {name: getattr(config, name) for name in HYPERPARAMETERS}}
    if averaged is not None:
        payload["averaged"] = averaged.module.state_dict()
    relpath = f"checkpoints/pbt/{population}/member-{member:02d}-{phase}-{index:03d}.pt"
    return MemberResult(member=member, checkpoint=save_checkpoint(store, relpath, payload),
                        metrics=metrics, kept=choice.source)


def write_lineage(population: str, records: list[dict[str, Any]]) -> ArtifactRef:
    """The lineage log (JSON lines, one record per member and stage, in order), written whole
    and atomically after each stage: earlier lines never change, new ones are added."""
    text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
    return ArtifactStore().write(f"pbt/{population}/lineage.jsonl",
                                 lambda path: Path(path).write_text(text))


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="soup")
def soup_members(config: ClassifierConfig, dataset: DatasetRef, population: str,
                 results: list[MemberResult], first: int) -> MemberResult:
    """The greedy soup (`training.pbt.soup`) of one stage's members, all trained on from the same
    checkpoint, starting from `results[first]` (the stage's best): a member result whose `kept`
    weights are the soup, named after that member, with `soup_ingredients` among its metrics.
    With one ingredient it is that member's weights, unchanged."""
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
               "ingredients": [results[i].member for i in soup.ingredients]}
    relpath = f"checkpoints/pbt/{population}/soup.pt"
    return MemberResult(member=best.member, checkpoint=save_checkpoint(store, relpath, payload),
                        metrics=best.metrics | soup.metrics, kept="soup")
