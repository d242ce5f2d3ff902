"""Moving the `champion` alias, by a flow or by hand, with a record of every move.

Every move is kept in the registered model's tag `champion.history` (the versions that held the
alias, oldest first), so `rollback` knows the champion before the current one; the version
that gains or loses the alias by hand gets `promoted.*` / `demoted.*` tags (who, when, why).
Pure MLflow (through `tasks.adapters.tracking`): the `promote` and `rollback` commands need no
Prefect.
"""

from __future__ import annotations

import getpass
import json
from datetime import UTC, datetime
from typing import ClassVar

from mlflow.exceptions import MlflowException
from pydantic import Field, field_validator

from tasks.adapters import tracking
from tasks.configs.sections import Project, StrictConfig, project_field, qualified

CHAMPION, CHALLENGER = "champion", "challenger"
HISTORY = "champion.history"
HISTORY_LENGTH = 100  # moves kept (a tag value holds at most 5,000 characters)


class RegistryError(ValueError):
    """A registry move that cannot be made: the message says what to give instead."""


def history(name: str) -> list[str]:
    """The versions of `name` that held `champion`, oldest first (empty when none recorded)."""
    return json.loads(tracking.model_tags(name).get(HISTORY, "[]"))


def crown(name: str, version: str) -> None:
    """Gives `version` the `champion` alias and records the move."""
    tracking.set_alias(name, CHAMPION, version)
    moves = [v for v in history(name) if v != version] + [version]
    tracking.set_model_tag(name, HISTORY, json.dumps(moves[-HISTORY_LENGTH:]))


def _stamp(action: str, by: str, reason: str) -> dict[str, str]:
    return {f"{action}.by": by, f"{action}.reason": reason,
            f"{action}.at": datetime.now(UTC).isoformat(timespec="seconds")}


def _existing_version(name: str, version: str) -> str:
    try:
        return str(tracking.client().get_model_version(name, version).version)
    except MlflowException as error:
        known = tracking.model_versions(name)
        raise RegistryError(f"model {name!r} has no version {version}" + (
            f" (versions: {', '.join(known)})" if known else
            " (no such registered model)")) from error


def promote_by_hand(name: str, version: str, reason: str, by: str) -> str:
    """Makes `version` of `name` champion; returns what happened, in a sentence."""
    version = _existing_version(name, version)
    current = tracking.alias_version(name, CHAMPION)
    if current == version:
        return f"{name} version {version} is already champion: nothing changed"
    crown(name, version)
    tracking.set_version_tags(name, version, _stamp("promoted", by, reason))
    if current is not None:
        tracking.set_version_tags(name, current, _stamp("demoted", by, reason))
    return f"{name} version {version} is champion (was {current or 'none'})"


def rollback(name: str, reason: str, by: str) -> str:
    """Gives `champion` back to the version that held it before the current one."""
    current = tracking.alias_version(name, CHAMPION)
    if current is None:
        raise RegistryError(f"model {name!r} has no champion to roll back")
    known = set(tracking.model_versions(name))
    earlier = [v for v in history(name)[:-1] if v != current and v in known]
    if not earlier:
        raise RegistryError(f"no earlier champion of {name!r} is recorded (current: version "
                            f"{current}); choose one: python -m flows promote {name} VERSION")
    previous = earlier[-1]
    tracking.set_alias(name, CHAMPION, previous)
    tracking.set_model_tag(name, HISTORY, json.dumps(earlier))
    tracking.set_version_tags(name, previous, _stamp("promoted", by, reason))
    tracking.set_version_tags(name, current, _stamp("demoted", by, reason))
    return f"{name} version {previous} is champion again (was version {current})"


class ManualMove(StrictConfig):
    """Who moves the alias and why, recorded on the versions."""

    name: str = Field(min_length=1, description="the registered model's name (in the project: "
                      "PROJECT-NAME)")
    reason: str = Field(min_length=1, description="why, recorded on both versions")
    by: str = Field(default_factory=getpass.getuser, min_length=1,
                    description="who, recorded on both versions")
    project: Project = project_field()

    def registered_name(self) -> str:
        """`name` in the project (`tasks.configs.sections.qualified`)."""
        return qualified(self.project, self.name)


class PromoteConfig(ManualMove):
    """`python -m flows promote NAME VERSION --reason ...`."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("name", "version")
    version: str = Field(description="the version to make champion")

    @field_validator("version")
    @classmethod
    def _number(cls, value: str) -> str:
        if not value.isdigit():
            raise ValueError("a version is a number")
        return value


class RollbackConfig(ManualMove):
    """`python -m flows rollback NAME --reason ...`."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("name",)
