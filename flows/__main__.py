"""The command line: `python -m flows --help` lists the flows and tools."""

from __future__ import annotations

import sys

import flows  # noqa: F401  (project environment first)
from flows.cli import exit_on_sigterm, main
from flows.commands import COMMANDS

if __name__ == "__main__":
    exit_on_sigterm()
    main(COMMANDS, sys.argv[1:])
