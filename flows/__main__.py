"""The command line: `python -m flows --help` lists the flows and tools."""

from __future__ import annotations

import sys

import flows  # noqa: F401  (project environment first)
from flows.cli import main
from flows.commands import COMMANDS

if __name__ == "__main__":
    main(COMMANDS, sys.argv[1:])
