"""`python -m flows`: every flow's config fields as command-line options.

Options are generated from the pydantic config, so the CLI, the Prefect parameter form and the
MLflow params never drift apart. Only options given on the command line are passed on, so a
`--profile` fills the rest. Validation errors name the field and stop before any work.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import signal
import sys
import threading
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

if typing.TYPE_CHECKING:
    from tasks.configs.sections import StrictConfig

NONE_WORDS = {"none", "null", ""}


def _allows_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(choice) for choice in typing.get_args(annotation)]
    return None


def _parse_value(annotation: Any) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if _allows_none(annotation) and text.strip().lower() in NONE_WORDS:
            return None
        return text  # pydantic converts and validates, naming the field on error

    return parse


def add_config_options(parser: argparse.ArgumentParser, config_cls: type[StrictConfig]) -> None:
    """One `--field-name` option per config field, with its description and default; a
    sectioned config's in one group per section; a hidden one per former name of a field
    (`StrictConfig.RENAMED`), which sets the field with a notice naming the new flag."""
    groups = config_cls.field_groups()
    positional = getattr(config_cls, "POSITIONAL", ())
    for name in positional:
        parser.add_argument(name, metavar=name.upper(), help=groups[None][name].description)
    for title, group in groups.items():
        sections = config_cls.sections() if title else {}
        doc = " ".join((sections[title].__doc__ or "").split()) if title else ""
        target = parser.add_argument_group(f"{title} options", doc) if title else parser
        fields = sorted(group.items(), key=lambda item: item[0] != "profile")
        _add_options(target, config_cls, [(n, f) for n, f in fields if n not in positional])
    fields = config_cls.flat_fields()
    for old, new in config_cls.former_names().items():  # hidden from --help
        parser.add_argument(_flag(old), dest=new, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, action=_FormerFlag, new_flag=_flag(new),
                            type=_parse_value(fields[new].annotation))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _FormerFlag(argparse.Action):
    """A field's former flag (`StrictConfig.RENAMED`): sets the field, with a one-line notice
    naming the new flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, new_flag: str,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"notice: {option_string} is now {self.new_flag}; the old name is accepted "
              f"until the next release", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_options(parser: Any, config_cls: type[StrictConfig],
                 fields: list[tuple[str, Any]]) -> None:
    for name, field in fields:
        flag = _flag(name)
        annotation = field.annotation
        shown = "required" if field.is_required() else f"default: {field.default}"
        text = f"{field.description or ''} ({shown})"
        if name == "profile":
            presets = getattr(config_cls, "PROFILES", {})
            text += "; " + "; ".join(
                f"{key}: " + (", ".join(f"{k}={v}" for k, v in values.items()) or "the defaults")
                for key, values in presets.items())
        if annotation is bool:
            aliases = config_cls.flag_aliases().get(name, ())
            parser.add_argument(flag, *aliases, dest=name, default=argparse.SUPPRESS,
                                action=argparse.BooleanOptionalAction, help=text)
            continue
        choices = _literal_choices(annotation)
        parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=text,
                            choices=choices, type=_parse_value(annotation),
                            metavar=None if choices else name.upper())


def format_validation_error(error: ValidationError, config_cls: Any = None) -> str:
    """One line per invalid field, by its command-line name: `field: message (got value)`
    (a section's field by its flat name: `lr`, the pipeline's `pbt_members`)."""
    from tasks.configs.sections import SECTION_NAMES  # imported with the config, not before

    sections = config_cls.sections() if hasattr(config_cls, "sections") else {}
    lines = []
    for item in error.errors():
        loc = item["loc"]
        if len(loc) > 1 and loc[0] in sections:
            loc = (config_cls.flat_name(loc[0], loc[1]), *loc[2:])
        elif loc[:1] and loc[0] in SECTION_NAMES:
            loc = loc[1:]
        field = ".".join(str(part) for part in loc) or "config"
        got = item.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        message = item["msg"].removeprefix("Value error, ")  # a validator's own words
        lines.append(f"  {field}: {message}{shown}")
    return "invalid configuration:\n" + "\n".join(lines)


def build_config(config_cls: type[StrictConfig], options: dict[str, Any]) -> BaseModel:
    """The validated config from the options given; exits with code 2 naming bad fields."""
    try:
        return config_cls(**options)
    except ValidationError as error:
        print(f"error: {format_validation_error(error, config_cls)}", file=sys.stderr)
        raise SystemExit(2) from None


class Command(NamedTuple):
    """A sub-command: its name, its config class as `module:Class` (imported only when the
    command is chosen, so `--help` stays fast) or None, and the function that runs it."""

    name: str
    config: str | None
    handler: Callable[..., Any]

    def config_class(self) -> type[StrictConfig] | None:
        if self.config is None:
            return None
        module, _, attribute = self.config.partition(":")
        return getattr(importlib.import_module(module), attribute)


def _summary(handler: Callable[..., Any]) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join((handler.__doc__ or "").strip().split("\n\n")[0].split())


def _suggestion(word: str, candidates: Sequence[str],
                current: dict[str, str] | None = None) -> str:
    """The names that `word` abbreviates, else the closest one; a former name as its
    `current` one."""
    close = [name for name in candidates if name.startswith(word)][:3] or \
        difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    close = list(dict.fromkeys((current or {}).get(name, name) for name in close))
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _chosen(argv: Sequence[str]) -> str | None:
    """The sub-command's name: the first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


def make_parser(commands: Sequence[Command], chosen: str | None = None
                ) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser with one sub-command per flow or tool; only the `chosen` one gets
    its options (its config imported). Abbreviated options are refused: `--round` is not
    silently `--rounds`."""
    parser = argparse.ArgumentParser(
        prog="python -m flows", allow_abbrev=False,
        description="Train compact image models with Prefect flows; runs tracked in MLflow, "
                    "artifacts versioned in DVC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers = {}
    for command in commands:
        doc = _summary(command.handler)
        subparsers[command.name] = sub.add_parser(
            command.name, help=doc, description=doc, allow_abbrev=False,
            usage=f"python -m flows {command.name} [options]")
        config_cls = command.config_class() if command.name == chosen else None
        if config_cls is not None:
            add_config_options(subparsers[command.name], config_cls)
            words = " ".join(name.upper() for name in getattr(config_cls, "POSITIONAL", ()))
            subparsers[command.name].usage = f"python -m flows {command.name} {words} [options]"
        subparsers[command.name].set_defaults(_command=command)
    return parser, subparsers


def exit_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl-C does, by an exception (SystemExit, status 143) in
    the main thread, instead of Python's default, which kills the process on the spot: the run
    is then marked KILLED, its training loops stop (`training.stopping`), and the exit handlers
    run, which stop the temporary Prefect server the command started. During a flow Prefect's
    own handler raises first and hands the signal on to this one when the flow has ended."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def main(commands: Sequence[Command], argv: Sequence[str] | None = None) -> Any:
    """Parses `argv`, validates the config, runs the command. An unknown command or option
    exits with code 2 and the closest name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(argv)
    names = [command.name for command in commands]
    parser, subparsers = make_parser(commands, chosen)
    if chosen is not None and chosen not in names:
        parser.error(f"unknown command {chosen!r}{_suggestion(chosen, names)}; "
                     f"choose from {', '.join(names)}")
    args, extras = parser.parse_known_args(argv)
    args = vars(args)
    command = args.pop("_command")
    if extras:
        actions = subparsers[command.name]._actions
        flags = [flag for action in actions for flag in action.option_strings]
        current = {flag: action.new_flag for action in actions
                   if isinstance(action, _FormerFlag) for flag in action.option_strings}
        unknown = next((word for word in extras if word.startswith("-")), extras[0])
        subparsers[command.name].error(
            f"unrecognized arguments: {' '.join(extras)}"
            f"{_suggestion(unknown.split('=')[0], flags, current)}")
    args.pop("command")
    config_cls = command.config_class()
    try:
        if config_cls is None:
            return command.handler(**args)
        return command.handler(build_config(config_cls, args))
    except Exception as error:
        from tasks.adapters.tracking import unanswered

        if (reason := unanswered(error)) is None:
            raise
        print(f"error: {reason} ({type(error).__name__})", file=sys.stderr)
        raise SystemExit(1) from None


__all__ = ["main"]
