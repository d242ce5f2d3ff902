"""Moving the `champion` alias, by a flow or by hand, with a record of every move.

Every move holds the model's registry lock (`tasks.adapters.locks`), so moves from any machine
sharing the MLflow server take turns. Each is recorded as its own registered-model tag,
`champion.move.NNNNNN` (the version, what moved it, who, when, why): a record is added, never
rewritten, so the history never loses an entry. `champion.history` is derived from it after
each move: the versions a `rollback` steps back through, oldest first. The version that gains
or loses the alias by hand also gets `promoted.*` / `demoted.*` tags (who, when, why). Pure
MLflow (through `tasks.adapters.tracking`): the `promote` and `rollback` commands need no
Prefect.
"""

from __future__ import annotations

import getpass
import json
from datetime import UTC, datetime
from typing import ClassVar, Literal

from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.adapters import tracking
from tasks.adapters.locks import (
    LOCK_TAG,
    RUN_TAG,
    RegistryLease,
    read_lease,
    registry_lock,
    unlock,
)
from tasks.configs.sections import Project, StrictConfig, model_name_of, project_field

CHAMPION, CHALLENGER = "champion", "challenger"
HISTORY = "champion.history"
MOVE_PREFIX = "champion.move."
HISTORY_LENGTH = 100  # versions kept in `champion.history` (the moves themselves are all kept)


class RegistryError(ValueError):
    """A registry move that cannot be made: the message says what to give instead."""


class Move(BaseModel):
    """One move of `champion`: a crowning (a flow's promotion or `promote`) or a `rollback`."""

    model_config = ConfigDict(frozen=True)

    number: int
    version: str
    action: Literal["crown", "rollback"]
    at: str
    by: str = ""
    reason: str = ""


def moves(name: str) -> list[Move]:
    """Every recorded move of `name`'s champion, oldest first (a model that recorded only the
    older `champion.history` list reads as one crowning per version in it)."""
    tags = tracking.model_tags(name)
    recorded = sorted((Move.model_validate_json(value) for key, value in tags.items()
                       if key.startswith(MOVE_PREFIX)), key=lambda move: move.number)
    if recorded or HISTORY not in tags:
        return recorded
    return [Move(number=n, version=v, action="crown", at="") for n, v in
            enumerate(json.loads(tags[HISTORY]), start=1)]


def champion_stack(recorded: list[Move]) -> list[str]:
    """The versions a rollback steps back through, oldest first: each crowning puts its
    version on top (out of any earlier place), each rollback takes versions off the top down
    to the one it restored."""
    stack: list[str] = []
    for move in recorded:
        if move.action == "rollback" and move.version in stack:
            del stack[stack.index(move.version) + 1:]
        else:
            stack = [v for v in stack if v != move.version] + [move.version]
    return stack


def history(name: str) -> list[str]:
    """The versions of `name` a rollback steps back through, oldest first (empty when none
    recorded)."""
    return champion_stack(moves(name))


def record_move(name: str, version: str, action: Literal["crown", "rollback"],
                lease: RegistryLease, by: str = "", reason: str = "") -> None:
    """Points `champion` at `version` and records the move (under `lease`, checked first)."""
    recorded = moves(name)
    move = Move(number=max((m.number for m in recorded), default=0) + 1, version=version,
                action=action, at=datetime.now(UTC).isoformat(timespec="seconds"), by=by,
                reason=reason)
    lease.check()
    tracking.set_alias(name, CHAMPION, version)
    tracking.set_model_tag(name, f"{MOVE_PREFIX}{move.number:06d}", move.model_dump_json())
    stack = champion_stack([*recorded, move])
    tracking.set_model_tag(name, HISTORY, json.dumps(stack[-HISTORY_LENGTH:]))


def crown(name: str, version: str, lease: RegistryLease, by: str = "promotion",
          reason: str = "") -> None:
    """Gives `version` the `champion` alias and records the move (the caller holds
    `lease`)."""
    record_move(name, version, "crown", lease, by, reason)


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
    """Makes `version` of `name` champion (holding the registry lock); returns what happened,
    in a sentence."""
    version = _existing_version(name, version)
    with registry_lock(name, f"promote by {by}") as lease:
        current = tracking.alias_version(name, CHAMPION)
        if current == version:
            return f"{name} version {version} is already champion: nothing changed"
        crown(name, version, lease, by, reason)
        tracking.set_version_tags(name, version, _stamp("promoted", by, reason))
        if current is not None:
            tracking.set_version_tags(name, current, _stamp("demoted", by, reason))
    return f"{name} version {version} is champion (was {current or 'none'})"


def rollback(name: str, reason: str, by: str) -> str:
    """Gives `champion` back to the version that held it before the current one (holding the
    registry lock)."""
    if tracking.alias_version(name, CHAMPION) is None:
        raise RegistryError(f"model {name!r} has no champion to roll back")
    with registry_lock(name, f"rollback by {by}") as lease:
        current = tracking.alias_version(name, CHAMPION)
        known = set(tracking.model_versions(name))
        earlier = [v for v in history(name)[:-1] if v != current and v in known]
        if current is None or not earlier:
            raise RegistryError(f"no earlier champion of {name!r} is recorded (current: "
                                f"version {current}); choose one: python -m flows promote "
                                f"{name} VERSION")
        previous = earlier[-1]
        record_move(name, previous, "rollback", lease, by, reason)
        tracking.set_version_tags(name, previous, _stamp("promoted", by, reason))
        tracking.set_version_tags(name, current, _stamp("demoted", by, reason))
    return f"{name} version {previous} is champion again (was version {current})"


class ManualMove(StrictConfig):
    """Who moves the alias and why, recorded on the versions."""

    name: str = Field(min_length=1, description="the registered model's name, as the MLflow "
                      "UI shows it (PROJECT-NAME with --project)")
    reason: str = Field(min_length=1, description="why, recorded on both versions")
    by: str = Field(default_factory=getpass.getuser, min_length=1,
                    description="who, recorded on both versions")
    project: Project = project_field()

    def registered_name(self) -> str:
        """`name` as given, or PROJECT-NAME with a `project`."""
        return model_name_of(self.project, self.name, self.name)


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


class RegistryConfig(StrictConfig):
    """`python -m flows registry status|unlock NAME`: the registry lock of a model."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("action", "name")
    action: Literal["status", "unlock"] = Field(description="status: who holds the lock and "
                                                "the champion's last moves; unlock: remove a "
                                                "lease whose holder is gone")
    name: str = Field(min_length=1, description="the registered model's name, as the MLflow "
                      "UI shows it (PROJECT-NAME with --project)")
    project: Project = project_field()

    def registered_name(self) -> str:
        """`name` as given, or PROJECT-NAME with a `project`."""
        return model_name_of(self.project, self.name, self.name)


def registry_status(name: str) -> str:
    """Who holds `name`'s registry lock, the champion and its last moves, in lines."""
    if not tracking.model_versions(name) and read_lease(name) is None:
        raise RegistryError(f"no registered model {name!r} has versions")
    lease, slot = read_lease(name), read_lease(name, RUN_TAG)
    lines = [f"{name}: lock {'free' if lease is None else lease.describe()}",
             f"run slot: {'free' if slot is None else slot.describe()}",
             f"champion: version {tracking.alias_version(name, CHAMPION) or 'none'}"]
    lines += [f"  move {m.number}: {m.action} version {m.version} at {m.at or '?'}"
              + (f" by {m.by}" if m.by else "") + (f": {m.reason}" if m.reason else "")
              for m in moves(name)[-10:]]
    return "\n".join(lines)


def unlock_by_hand(name: str) -> str:
    """Removes `name`'s registry lock and run slot (`tasks.adapters.locks.unlock`); says what
    it removed."""
    removed = [(what, unlock(name, tag)) for what, tag in (("lock", LOCK_TAG),
                                                          ("run slot", RUN_TAG))]
    said = [f"removed the {what} {lease.describe()}" for what, lease in removed if lease]
    return f"{name}: " + ("; ".join(said) if said else "no lock was held")
