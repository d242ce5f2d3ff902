"""Prefect flows that chain tasks; `python -m flows` is the command line.

Importing `tasks` first applies the project environment (project.env) before Prefect loads.
"""

import tasks  # noqa: F401  (applies project.env before Prefect is imported)
