"""`python -m flows`: every flow's config fields as command-line options.

Options are generated from the pydantic config, so the CLI, the Prefect parameter form and the
MLflow params never drift apart. Only options given on the command line are passed on, so a
`--profile` fills the rest. Validation errors name the field and stop before any work.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

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


def add_config_options(parser: argparse.ArgumentParser, config_cls: type[BaseModel]) -> None:
    """One `--field-name` option per config field, with its description and default."""
    defaults = config_cls.model_construct()
    fields = sorted(config_cls.model_fields.items(), key=lambda item: item[0] != "profile")
    for name, field in fields:
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        text = f"{field.description or ''} (default: {getattr(defaults, name, field.default)})"
        if name == "profile":
            presets = getattr(config_cls, "PROFILES", {})
            text += "; " + "; ".join(
                f"{key}: " + (", ".join(f"{k}={v}" for k, v in values.items()) or "the defaults")
                for key, values in presets.items())
        if annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
            continue
        choices = _literal_choices(annotation)
        parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=text,
                            choices=choices, type=_parse_value(annotation),
                            metavar=None if choices else name.upper())


def format_validation_error(error: ValidationError) -> str:
    """One line per invalid field: `field: message (got value)`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        got = item.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {field}: {item['msg']}{shown}")
    return "invalid configuration:\n" + "\n".join(lines)


def build_config(config_cls: type[BaseModel], options: dict[str, Any]) -> BaseModel:
    """The validated config from the options given; exits with code 2 naming bad fields."""
    try:
        return config_cls(**options)
    except ValidationError as error:
        print(f"error: {format_validation_error(error)}", file=sys.stderr)
        raise SystemExit(2) from None


Command = tuple[str, type[BaseModel] | None, Callable[..., Any]]


def make_parser(commands: Sequence[Command]) -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per flow or tool."""
    parser = argparse.ArgumentParser(
        prog="python -m flows",
        description="Train compact image models with Prefect flows; runs tracked in MLflow, "
                    "artifacts versioned in DVC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, config_cls, handler in commands:
        doc = (handler.__doc__ or "").strip().splitlines()[0] if handler.__doc__ else ""
        command = sub.add_parser(name, help=doc, description=doc)
        if config_cls is not None:
            add_config_options(command, config_cls)
        command.set_defaults(_handler=handler, _config=config_cls)
    return parser


def main(commands: Sequence[Command], argv: Sequence[str] | None = None) -> Any:
    """Parses `argv`, validates the config, runs the command."""
    args = vars(make_parser(commands).parse_args(argv))
    handler, config_cls = args.pop("_handler"), args.pop("_config")
    args.pop("command")
    if config_cls is None:
        return handler(**args)
    return handler(build_config(config_cls, args))


__all__ = ["main"]
