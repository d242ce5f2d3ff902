"""The `train` flow's config."""

from __future__ import annotations

from typing import Any, ClassVar

from tasks.configs.sections import (
    DataSection,
    ModelSection,
    OptimSection,
    ProfiledConfig,
    RunSection,
)


class TrainConfig(ProfiledConfig, DataSection, ModelSection, OptimSection, RunSection):
    """The `train` flow: one classifier, evaluated, registered and promoted."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"model": "cnn2", "epochs": 1, "train_limit": 512, "test_limit": 256,
                  "val_limit": 1000,
                  "batch_size": 64, "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {},
        "full": {"train_limit": None, "epochs": 60, "width": 32, "batch_size": 256, "lr": 0.1,
                 "warmup_epochs": 1.0},
    }
