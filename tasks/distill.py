"""Distillation tasks: a teacher stage (`TeacherRound`), a feature-bank snapshot, a student
stage (`StudentRound`); the stages train through `tasks.rounds.round_task`.

Each task loads its inputs by reference, does one coarse unit of work, writes its output
atomically into the artifact store (versioned with DVC) and returns the reference and metrics.
The images of a stage come from a recency queue replayed from the seed, so a task needs no
queue state from another task, and a re-run (or a run resumed after a crash) draws the same
images. Tasks are cached on their inputs and the code's version, like the `train` rounds.
"""

from __future__ import annotations

from typing import Literal

import torch
from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import load_checkpoint, torch_save
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.configs.distill import AUTO_CANDIDATES, DistillConfig
from tasks.configs.sections import ClassifierConfig, ModelSection, StrictConfig, classifier_config
from tasks.data import DatasetRef, load_dataset
from tasks.rounds import RoundPlan
from tasks.training import resume, run_key
from training.batches import RecordedViews
from training.budget import Budget
from training.device import place_model, setup_device
from training.distill.feature_bank import FeatureBank
from training.distill.losses import (
    DistillStep,
    FeatureLossKind,
    LabelsStep,
    TeacherStep,
    layer_shape,
)
from training.distill.stages import (
    initial_bank,
    stage_ids,
    stage_round,
    stage_scores,
    stage_views,
    student_mixup_seed,
    student_network,
    teacher_features,
)
from training.recipe import make_optimizer, optimizer_to, restore
from training.rounds import ClassifyStep, Closed, Opened, Trainee, classifier_network, new_model

Role = Literal["teacher", "student"]


class RoleConfig(ClassifierConfig):
    """One network's part of a `distill` run: what it is, how it learns, how it draws images.

    `rounds` is the number of stages: the learning-rate schedule spans all of them.
    """

    role: Role
    repeats: int = Field(1, ge=1, description="passes over the stage's images per stage")
    pretrain_rounds: int = Field(0, ge=0)
    fraction: float = Field(gt=0.0, lt=1.0)
    front_weight: float = Field(gt=0.0)
    back_weight: float = Field(gt=0.0)
    queue: Literal["recency", "uniform"]


class StudentConfig(RoleConfig):
    """The student's loss: CE plus a feature loss against its targets (the bank, or a teacher
    state run on the student's batch: `targets`) through an adapter."""

    layer: str
    targets: Literal["bank", "states", "final", "labels"] = "bank"
    teacher_layer: str = "pool"
    feature_loss: FeatureLossKind
    feature_weight: float
    ce_weight: float
    temperature: float
    bank_memmap: bool
    mixup: float = 0.0


class BankConfig(StrictConfig):
    """Which teacher features the bank holds and how it is kept."""

    layer: str
    mode: Literal["single", "per-state"]
    dtype: Literal["float16", "bfloat16", "float32"]
    memmap: bool
    initial: Literal["masked", "teacher"]
    views: Literal["clean", "augmented"] = "clean"
    average: Literal["latest", "mean"] = "latest"


class DistillPlan(BaseModel):
    """A `distill` config split into what each task needs (so a task's cache key holds only
    what its result depends on: a changed student loss does not re-train the teacher).

    With `--targets auto`, `candidates` holds one student per `AUTO_CANDIDATES` entry (all of
    one network; `student` is the first, for what they share)."""

    model_config = ConfigDict(frozen=True)

    teacher: RoleConfig
    bank: BankConfig
    student: StudentConfig
    candidates: dict[str, StudentConfig] = {}

    @classmethod
    def of(cls, config: DistillConfig, teacher_budget: Budget | None = None,
           student_budget: Budget | None = None) -> DistillPlan:
        """The plan of `config`; the budgets (fitted to the data set) set each role's batch
        and passes per stage (default: the configured batch, one pass)."""
        def shared(model: str, width: int | None, budget: Budget | None,
                   patience: int = 1) -> dict:
            return {"network": ModelSection(model=model, width=width), "run": config.run,
                    "optim": config.optim.replace(batch_size=budget.batch_size) if budget
                    else config.optim,
                    "repeats": (budget.repeats if budget else 1) * patience,
                    "rounds": config.stages, "front_weight": config.front_weight,
                    "back_weight": config.back_weight}

        teacher = RoleConfig(**shared(config.teacher_model, config.teacher_width,
                                      teacher_budget),
                             role="teacher", pretrain_rounds=config.teacher_pretrain_rounds,
                             fraction=config.teacher_fraction, queue="recency")
        student = StudentConfig(
            **shared(config.student_model, config.student_width, student_budget,
                     config.student_patience),
            role="student", fraction=config.student_fraction, queue=config.student_queue,
            layer=config.student_layer,
            targets="labels" if config.targets == "auto" else config.targets,
            teacher_layer=config.teacher_layer, feature_loss=config.feature_loss,
            feature_weight=config.feature_weight, ce_weight=config.ce_weight,
            temperature=config.temperature, bank_memmap=config.bank_memmap,
            mixup=config.student_mixup)
        candidates = {name: student.replace(**fields)
                      for name, fields in AUTO_CANDIDATES.items()} \
            if config.targets == "auto" else {}
        if config.targets == "labels":  # CE at weight 1, as the `labels` candidate
            student = student.replace(**AUTO_CANDIDATES["labels"])
        bank = BankConfig(layer=config.teacher_layer, mode=config.bank_mode,
                          dtype=config.bank_dtype, memmap=config.bank_memmap,
                          initial=config.initial_bank, views=config.bank_views,
                          average=config.bank_average)
        return cls(teacher=teacher, bank=bank, student=candidates.get("labels", student),
                   candidates=candidates)


class BankSnapshot(BaseModel):
    """A feature-bank snapshot: its artifact and what it holds."""

    model_config = ConfigDict(frozen=True)

    stage: int
    bank: ArtifactRef
    fill_fraction: float
    state_histogram: dict[int, int]
    nbytes: int
    entries: int
    feature_values: int


def pretrain_config(teacher: RoleConfig) -> ClassifierConfig:
    """The teacher's warm start as a plain classifier run of `pretrain_rounds` rounds over all
    training images (trained by the `train` flow's round task)."""
    return classifier_config(teacher).replace(rounds=teacher.pretrain_rounds)


def _stage_name(prefix: str):
    return lambda: f"{prefix}-{task_run.parameters['stage']}"


class TeacherRound(RoundPlan):
    """The teacher at state `stage` trains on its N queued images with CE: state
    `stage + 1`."""

    config: RoleConfig
    dataset: DatasetRef
    stage: int

    @property
    def number(self) -> int:
        return self.stage

    def task_name(self) -> str:
        return f"teacher-{self.stage}"

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        teacher, data = self.config, load_dataset(self.dataset)
        model, optimizer = resume(teacher, self.dataset, ArtifactStore(), previous, device)
        ids = stage_ids(teacher, data.splits["train"], self.stage)
        round_ = stage_round(teacher, self.dataset, data, ids, self.stage,
                             ClassifyStep(teacher.optim.label_smoothing),
                             classifier_network(teacher, self.dataset))
        return Opened(Trainee(model, optimizer), round_, {"data": data, "ids": ids})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        trainee = opened.trainee
        metrics = metrics | stage_scores(opened.round, trainee.model, self.dataset,
                                         opened.context["data"], device)
        payload = {"model": trainee.model.state_dict(),
                   "optimizer": trainee.optimizer.state_dict(), "stage": self.stage,
                   "ids": opened.context["ids"], "metrics": metrics}
        return Closed(metrics, payload)

    def relpath(self) -> str:
        return (f"checkpoints/distill/{run_key(self.config, self.dataset)}/"
                f"teacher-{self.stage:03d}.pt")


def load_bank(store: ArtifactStore, ref: ArtifactRef, memmap: bool = False) -> FeatureBank:
    """A bank from the store; memory-mapped from disk when `memmap` (read on demand)."""
    state = torch.load(store.fetch(ref), map_location="cpu", weights_only=True, mmap=memmap)
    return FeatureBank.from_state_dict(state)


def bank_path(teacher: RoleConfig, bank: BankConfig, dataset: DatasetRef, stage: int) -> str:
    """single: one file rewritten each stage (each version kept by DVC); per-state: one each."""
    key = run_key(BankKey(teacher=teacher, bank=bank), dataset)
    name = "bank.pt" if bank.mode == "single" else f"bank-{stage:03d}.pt"
    return f"banks/{key}/{name}"


class BankKey(BaseModel):
    """What a bank's content depends on (names its folder)."""

    teacher: RoleConfig
    bank: BankConfig


@task(cache_key_fn=computation_key, persist_result=True, task_run_name=_stage_name("bank"))
def bank_snapshot(teacher: RoleConfig, bank: BankConfig, dataset: DatasetRef, stage: int,
                  teacher_checkpoint: ArtifactRef, previous: ArtifactRef | None,
                  initial_teacher: ArtifactRef | None = None) -> BankSnapshot:
    """Bank `stage`: bank `stage - 1` (or the initial bank) with the entries of the images the
    teacher trained on at `stage` replaced by its features for them, marked with `stage`.

    The initial bank's teacher (state 0) is `initial_teacher` (a warm start) or the seeded one.
    """
    device = setup_device(teacher)
    store = ArtifactStore()
    data = load_dataset(dataset)
    checkpoint = load_checkpoint(store, teacher_checkpoint)
    model = new_model(teacher, dataset)
    initial_state = {k: v.clone() for k, v in model.state_dict().items()} \
        if initial_teacher is None else load_checkpoint(store, initial_teacher)["model"]
    restore(model, None, checkpoint)
    model = place_model(model, device)
    if previous is not None:  # a memory-mapped bank is mapped privately: updates stay in RAM
        features = load_bank(store, previous, bank.memmap)
    else:
        features = initial_bank(teacher, bank, dataset, data, model, initial_state, device)
        model.load_state_dict(checkpoint["model"])
    ids = checkpoint["ids"]
    views = stage_views(teacher, dataset, ids, stage) if bank.views == "augmented" else None
    recorded = None if views is None else RecordedViews.of(ids, *views)
    features.update(ids, teacher_features(model, bank.layer, dataset, data, ids, device,
                                          recorded, teacher.optim.augment),
                    stage, bank.average == "mean", views)
    state = features.state_dict()
    ref = store.write(bank_path(teacher, bank, dataset, stage),
                      lambda path: torch_save(state, path))
    return BankSnapshot(stage=stage, bank=ref, fill_fraction=features.fill_fraction(),
                        state_histogram=features.state_histogram(), nbytes=features.nbytes(),
                        entries=len(features), feature_values=features.features[0].numel())


class StudentRound(RoundPlan):
    """The student at state `stage` learns from its P queued images with CE plus the feature
    loss against its targets: the feature bank `bank` (`training.distill.losses.DistillStep`),
    or the teacher state `teacher` (a checkpoint of the `teacher_config` network) run on the
    student's own augmented batch (`TeacherStep`), or none (`labels`: `LabelsStep`, CE only):
    state `stage + 1`."""

    config: StudentConfig
    dataset: DatasetRef
    stage: int
    bank: ArtifactRef | None = None
    teacher: ArtifactRef | None = None
    teacher_config: RoleConfig | None = None

    @property
    def number(self) -> int:
        return self.stage

    def task_name(self) -> str:
        return f"student-{self.stage}"

    def targets(self, store: ArtifactStore, device: torch.device
                ) -> tuple[FeatureBank | None, nn.Module | None, tuple[int, ...] | None]:
        """The bank, or the teacher state's network (evaluated, frozen), and the shape of one
        image's target (all None for `labels`: no targets)."""
        student = self.config
        if student.targets == "labels":
            return None, None, None
        if student.targets == "bank":
            if self.bank is None:
                raise ValueError(f"student stage {self.stage}: targets 'bank' needs a bank")
            features = load_bank(store, self.bank, student.bank_memmap)
            if not student.bank_memmap:
                features = features.to(device)
            return features, None, features.feature_shape
        if self.teacher is None or self.teacher_config is None:
            raise ValueError(f"student stage {self.stage}: targets {student.targets!r} need the "
                             "teacher state's checkpoint and config")
        teacher = new_model(self.teacher_config, self.dataset)
        restore(teacher, None, load_checkpoint(store, self.teacher))
        teacher = place_model(teacher, device).eval()
        example = torch.zeros(1, self.dataset.channels, self.dataset.image_size,
                              self.dataset.image_size, device=device)
        return None, teacher, layer_shape(teacher, student.teacher_layer, example)

    def open(self, previous: ArtifactRef | None, device: torch.device) -> Opened:
        student, store, data = self.config, ArtifactStore(), load_dataset(self.dataset)
        features, teacher, target_shape = self.targets(store, device)
        model, adapter = student_network(student, self.dataset, target_shape, device)
        optimizer = make_optimizer(nn.ModuleList([model, adapter]), student)
        if previous is not None:
            checkpoint = load_checkpoint(store, previous)
            restore(model, optimizer, checkpoint, student)
            adapter.load_state_dict(checkpoint["adapter"])
            optimizer_to(optimizer, device)
        ids = stage_ids(student, data.splits["train"], self.stage)
        loss = (student.layer, (adapter.student_shape, adapter.teacher_shape),
                student.feature_loss, student.temperature, student.ce_weight,
                student.feature_weight, student.optim.label_smoothing)
        mixup = (student.mixup, student_mixup_seed(student, self.stage))
        step = LabelsStep(*loss, *mixup) if student.targets == "labels" else \
            DistillStep(*loss, bank=features) if teacher is None else \
            TeacherStep(*loss, *mixup, teacher=teacher, teacher_layer=student.teacher_layer)
        round_ = stage_round(student, self.dataset, data, ids, self.stage, step,
                             classifier_network(student, self.dataset),
                             None if features is None else features.recorded_views())
        return Opened(Trainee(model, optimizer, {"adapter": adapter}), round_,
                      {"data": data, "ids": ids, "bank": features})

    def close(self, opened: Opened, device: torch.device, metrics: dict[str, float],
              seconds: float) -> Closed:
        trainee, ids = opened.trainee, opened.context["ids"]
        metrics = metrics | stage_scores(opened.round, trainee.model, self.dataset,
                                         opened.context["data"], device)
        if opened.context["bank"] is not None:
            filled = opened.context["bank"].lookup(ids)[1].float().mean().item()
            metrics |= {"bank_filled_fraction_drawn": filled}
        payload = {"model": trainee.model.state_dict(),
                   "adapter": trainee.extras["adapter"].state_dict(),
                   "optimizer": trainee.optimizer.state_dict(), "stage": self.stage,
                   "ids": ids, "metrics": metrics}
        return Closed(metrics, payload)

    def relpath(self) -> str:
        # the student's result depends on its targets': the bank's folder, the teacher's hash
        targets = self.bank.path.split("/")[1] if self.bank is not None else \
            self.teacher.md5[:16] if self.teacher is not None else "none"
        return (f"checkpoints/distill/{run_key(self.config, self.dataset)}-{targets}/"
                f"student-{self.stage:03d}.pt")
