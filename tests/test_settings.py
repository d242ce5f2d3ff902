"""The protocols through which training/ reads a config (`training.settings`) name fields the
configs really have: a renamed field fails here, not in the middle of a flow."""

from __future__ import annotations

from typing import Protocol

import pytest

from tasks.configs.pbt import PBTConfig
from tasks.configs.sections import (
    ClassifierConfig,
    ModelSection,
    OptimSection,
    ProfiledConfig,
    RunSection,
)
from tasks.data import DatasetRef
from tasks.distill import BankConfig, RoleConfig, StudentConfig
from training import settings


def members(protocol: type) -> set[str]:
    """The names a protocol declares, its protocol bases' included."""
    return {name for cls in protocol.__mro__ if Protocol in cls.__bases__ or cls is protocol
            for name in vars(cls) if not name.startswith("_")}


def provided(cls: type) -> set[str]:
    """A config class's fields (pydantic) and its methods and properties."""
    return set(getattr(cls, "model_fields", {})) | {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize(("protocol", "config"), [
    (settings.NetworkSettings, ModelSection), (settings.OptimSettings, OptimSection),
    (settings.RunSettings, RunSection), (settings.RunsSettings, ProfiledConfig),
    (settings.OptimizedSettings, ProfiledConfig), (settings.ClassifierSettings, ClassifierConfig),
    (settings.RoleSettings, RoleConfig), (settings.StudentSettings, StudentConfig),
    (settings.BankSettings, BankConfig), (settings.PopulationSettings, PBTConfig),
    (settings.DatasetShape, DatasetRef)])
def test_every_setting_training_reads_is_a_field_of_the_config_it_is_given(protocol, config):
    assert members(protocol), protocol  # (the protocol declares something to check)
    assert not members(protocol) - provided(config), sorted(members(protocol) - provided(config))
