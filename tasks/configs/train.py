"""The `train` flow's config."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from tasks.configs.sections import ModelSection, ProfiledConfig, RoundsFields


class TrainConfig(ProfiledConfig, RoundsFields):
    """The `train` flow: one classifier, evaluated, registered and promoted."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"model": "cnn2", "rounds": 1, "train_limit": 512, "test_limit": 256,
                  "val_limit": 1000,
                  "batch_size": 64, "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {},
        "full": {"train_limit": None, "rounds": 60, "width": 32, "batch_size": 256, "lr": 0.1,
                 "warmup_rounds": 1.0},
    }

    network: ModelSection = Field(default_factory=ModelSection)
