"""The `cascade` flow's training tasks: difficulty sets, the latency table, module rounds,
predictor fitting and the exit heads' refit (calibration, test and registration:
`tasks.cascade.evaluation`). Each loads its inputs by reference, calls `training.cascade.learning` /
`training.latency`, writes and versions its output, and returns the reference with its
metrics; each is cached on its inputs, so a killed run resumes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from models.cascade import CascadeNet, build_cascade
from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, save_checkpoint
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.cascade import CascadeConfig
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import RoundPlan, RoundResult
from tasks.training import run_key
from training.batches import Batches, Normalize, eval_batches
from training.budget import Budget, fit_optim
from training.cascade.learning import (
    CascadeNetwork,
    ModuleStep,
    StageModel,
    curriculum,
    difficulty,
    distill_exits,
    exit_accuracies,
    fixed_choice,
    out_of_fold_logits,
    predictor_step,
    relative_costs,
    split_disjoint,
)
from training.device import inference_batch, place_model, resolve_device, setup_device
from training.latency import (
    check_device,
    device_name,
    latency_table,
    part_costs,
)
from training.loops import evaluate
from training.recipe import optimizer_to, sgd, train_round
from training.rounds import SINGLE, Closed, Opened, Trainee, configured_round, image_batches


class CascadeSets(BaseModel):
    """The training sets: the first (module k's easiest share), the second (predictors)."""

    model_config = ConfigDict(frozen=True)

    artifact: ArtifactRef
    module_images: list[int]
    second_images: int
    mean_difficulty: list[float]


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="difficulty-sets")
def difficulty_sets(config: CascadeConfig, dataset: DatasetRef) -> CascadeSets:
    """Splits the training images into the first and the second training set, scores every
    image's difficulty (`CascadeConfig.difficulty`) and gives module k the easiest
    `fractions()[k]` of the first set; versioned as one file of dataset rows."""
    torch.manual_seed(config.run.seed)
    data = load_dataset(dataset)
    train = data.splits["train"]
    labels = data.labels[train].long()
    scores = difficulty(out_of_fold_logits(data.images[train], labels, config.run.seed), labels,
                        config.difficulty)
    first, second = split_disjoint(len(train), config.predictor_fraction, config.run.seed)
    modules = [first[positions] for positions in curriculum(scores[first], config.fractions())]
    payload = {"difficulty": scores, "rows": train, "first": train[first],
               "second": train[second], "modules": [train[m] for m in modules]}
    relpath = f"cascade/{run_key(config, dataset)}/difficulty-sets.pt"
    artifact = save_checkpoint(ArtifactStore(), relpath, payload)
    return CascadeSets(artifact=artifact, module_images=[len(m) for m in modules],
                       second_images=len(second),
                       mean_difficulty=[float(scores[m].mean()) for m in modules])


def new_cascade(config: CascadeConfig, dataset: DatasetRef) -> CascadeNet:
    """The config's cascade for the data set, initialised from the seed."""
    torch.manual_seed(config.run.seed)
    return build_cascade(config.spec(), dataset.channels, len(dataset.classes))


def trained_cascade(config: CascadeConfig, dataset: DatasetRef, checkpoint: ArtifactRef
                    ) -> CascadeNet:
    """The cascade with the checkpoint's weights (and thresholds, fixed choices), in eval mode
    on the CPU."""
    net = new_cascade(config, dataset)
    net.load_state_dict(load_checkpoint(ArtifactStore(), checkpoint)["model"])
    return net.eval()


def serving_device(config: CascadeConfig) -> str:
    """The name of the device the latency table is for (`training.latency.device_name`), with
    the thread count the tasks will set (`--threads`), not the one of the calling process."""
    return device_name(resolve_device(config.run.device), config.run.threads)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="latency-table")
def measure_latency(config: CascadeConfig, dataset: DatasetRef, device: str,
                    given_md5: str | None = None) -> ArtifactRef:
    """Every part's measured time on the serving device `device` (`training.latency`),
    versioned; or the table given as `--latency-table` (checked to come from this device).
    The device's name and the given table's content hash are inputs, so a cached table is
    never reused on another device or after the file changed."""
    torch_device = setup_device(config)
    if config.latency_table is not None:
        table = json.loads(Path(config.latency_table).expanduser().read_text())
        check_device(table, torch_device)
    else:
        net = new_cascade(config, dataset).to(torch_device)
        table = latency_table(net, (dataset.channels, dataset.image_size, dataset.image_size),
                              torch_device, (1, config.serving_batch), config.latency_repeats)
    if table["device"] != device:
        raise ValueError(f"latency_table: measured on {table['device']!r}, expected {device!r}")
    tag = hashlib.md5(device.encode()).hexdigest()[:8]
    relpath = f"cascade/{run_key(config, dataset)}/latency-{tag}.json"
    return ArtifactStore().write(relpath, lambda path: path.write_text(json.dumps(table,
                                                                                  indent=1)))


def read_table(ref: ArtifactRef) -> dict:
    return json.loads(ArtifactStore().fetch(ref).read_text())


def module_budget(config: CascadeConfig, images: int) -> Budget:
    """Module training's budget on its set of `images` (`training.budget.fit_optim`)."""
    return fit_optim(config.optim, images, config.rounds)


class ModuleRound(RoundPlan):
    """Round `round` (0-based) of `config.rounds` of module k on its curriculum set
    (`--stage-training`: the modules before it train along, or stay frozen;
    `training.cascade.learning.ModuleStep`), from `start` (the cascade as module k - 1 left it)
    or the previous round of this module; then module k's exit scored on validation
    (`module{k}_val_accuracy`: its most expensive sub-network)."""

    config: CascadeConfig
    dataset: DatasetRef
    sets: CascadeSets
    latency: ArtifactRef
    k: int
    round: int
    start: ArtifactRef | None = None

    @property
    def number(self) -> int:
        return self.round

    def task_name(self) -> str:
        return f"module-{self.k}-round-{self.round + 1}"

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        config, k, store = self.config, self.k, ArtifactStore()
        data = load_dataset(self.dataset)
        rows = load_checkpoint(store, self.sets.artifact)["modules"][k]
        budget = module_budget(config, len(rows))
        net = new_cascade(config, self.dataset)
        frozen = config.stage_training == "frozen"
        optimizer = sgd(StageModel(net, k, frozen).trainable_parameters(), config.optim.lr,
                        config.optim.momentum, config.optim.weight_decay)
        source = previous or self.start
        if source is not None:
            payload = load_checkpoint(store, source)
            net.load_state_dict(payload["model"])
            if previous is not None:
                optimizer.load_state_dict(payload["optimizer"])
        net = place_model(net, device)
        optimizer_to(optimizer, device)
        relative = (relative_costs(net, part_costs(read_table(self.latency)), k)
                    if net.is_super(k) else None)
        passes = range(self.round * budget.repeats, (self.round + 1) * budget.repeats)
        seeds = tuple(config.run.seed * 1000 + n + 100 * k for n in passes)  # each pass's shuffle
        step = ModuleStep(k, frozen, None if relative is None else relative.cpu(),
                          config.latency_weight, config.optim.label_smoothing, seeds[0])
        round_ = configured_round(
            config, CascadeNetwork(config.spec(), self.dataset.channels,
                                   len(self.dataset.classes)), step,
            image_batches(config, self.dataset, data, rows, budget.batch_size, passes,
                          seeds=seeds),
            passes, (0, budget.epochs), config.optim.warmup_rounds * budget.repeats)
        return Opened(Trainee(net, optimizer), round_, {"data": data, "frozen": frozen})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        k, net = self.k, opened.trainee.model
        stage = StageModel(net, k, opened.context["frozen"])
        val = evaluate(stage, eval_batches(opened.context["data"], self.dataset, "val", device),
                       device)
        metrics = {f"module{k}_{name}": value for name, value in metrics.items()} | {
            f"module{k}_val_accuracy": val["accuracy"], f"module{k}_train_seconds": seconds}
        payload = {"model": net.state_dict(), "optimizer": opened.trainee.optimizer.state_dict(),
                   "module": k, "round": self.round}
        return Closed(metrics, payload)

    def relpath(self) -> str:
        return (f"checkpoints/cascade/{run_key(self.config, self.dataset)}/"
                f"module-{self.k}-round-{self.round + 1:03d}.pt")


@task(cache_key_fn=computation_key, persist_result=True,
      task_run_name=lambda: f"fit-predictor-{task_run.parameters['k']}")
def fit_predictor(config: CascadeConfig, dataset: DatasetRef, sets: CascadeSets,
                  latency: ArtifactRef, k: int, checkpoint: ArtifactRef) -> RoundResult:
    """Super-network module k's predictor, fitted on the second training set by the
    latency-aware loss (`--predictor fitted`), or one sub-network chosen for good there
    (`--predictor fixed`). Metrics: `predictor{k}_share_{s}`, the share of validation images
    routed to sub-network s, and (fixed) each sub-network's error rate on the second set."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    second = load_checkpoint(store, sets.artifact)["second"]
    net = new_cascade(config, dataset)
    net.load_state_dict(load_checkpoint(store, checkpoint)["model"])
    net = place_model(net, device)
    relative = relative_costs(net, part_costs(read_table(latency)), k)
    metrics: dict[str, float] = {}
    if config.predictor == "fixed":
        held_out = Batches(data.images, data.labels, second, inference_batch(device),
                           Normalize(dataset.mean, dataset.std), device=device)
        choice, rates = fixed_choice(net, k, held_out, relative, config.latency_weight)
        net.blocks[k].fixed.fill_(choice)
        metrics |= {f"predictor{k}_error_rate_{s}": r for s, r in enumerate(rates)}
    else:
        net.blocks[k].reset_predictor()  # fitted on this set alone, from the start
        stage = StageModel(net, k, predictor_only=True)
        optimizer = sgd(stage.trainable_parameters(), config.optim.lr, config.optim.momentum, 0.0)
        batch = min(config.optim.batch_size, max(16, len(second) // 8))
        passes = range(config.predictor_epochs)
        batches = image_batches(config, dataset, data, second, batch, passes,
                                seeds=[config.run.seed * 1000 + 7 * n + 1 for n in passes])
        losses = train_round(stage, optimizer, batches.for_passes(device, SINGLE),
                             predictor_step(net, k, relative, config.latency_weight,
                                            config.routing_target), device,
                             passes, config.optim.lr, (0, config.predictor_epochs))
        metrics |= {f"predictor{k}_{name}": value for name, value in losses.items()}
    net.eval()
    routed = []
    with torch.no_grad():
        for _, x, _ in eval_batches(data, dataset, "val", device):
            routed.append(net.route(k, net.prefix(x, k)).cpu())
    shares = torch.bincount(torch.cat(routed), minlength=net.sub_count(k)).float()
    metrics |= {f"predictor{k}_share_{s}": v for s, v in enumerate(
        (shares / shares.sum()).tolist())}
    relpath = f"checkpoints/cascade/{run_key(config, dataset)}/module-{k}-predictor.pt"
    payload = {"model": net.state_dict(), "module": k}
    return RoundResult(round=0, checkpoint=save_checkpoint(store, relpath, payload),
                       metrics=metrics)


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="distill-exits")
def refit_exits(config: CascadeConfig, dataset: DatasetRef, sets: CascadeSets,
                checkpoint: ArtifactRef) -> RoundResult:
    """Every exit head but the last refitted to the last exit on the first training set (the
    images the modules trained on; `training.cascade.learning.distill_exits`), the rest of the
    network unchanged. Metrics: each exit's validation accuracy before
    (`exit{k}_val_accuracy_before_refit`) and after (`exit{k}_val_accuracy`), and the
    refit's last loss."""
    device = setup_device(config)
    store = ArtifactStore()
    data = load_dataset(dataset)
    first = load_checkpoint(store, sets.artifact)["modules"][-1]  # the last module's: all
    net = new_cascade(config, dataset)
    net.load_state_dict(load_checkpoint(store, checkpoint)["model"])
    net = place_model(net, device)

    def val() -> list[float]:
        return exit_accuracies(net, eval_batches(data, dataset, "val", device))

    before = val()
    metrics = distill_exits(net, Batches(data.images, data.labels, first, 1024, Normalize(
        dataset.mean, dataset.std), device=device), config.exit_distill_epochs, config.optim.lr,
        config.exit_distill_temperature, config.exit_distill_weight, config.run.seed)
    after = val()
    metrics |= {f"exit{k}_val_accuracy_before_refit": v for k, v in enumerate(before)} | {
        f"exit{k}_val_accuracy": v for k, v in enumerate(after)}
    relpath = f"checkpoints/cascade/{run_key(config, dataset)}/exits-refit.pt"
    return RoundResult(round=0, checkpoint=save_checkpoint(store, relpath,
                                                           {"model": net.state_dict()}),
                       metrics=metrics)
