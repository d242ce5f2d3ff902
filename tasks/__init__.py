"""Prefect tasks: the only layer that does I/O, tracking (MLflow) and versioning (DVC).

The project environment is applied on import, before any module here imports Prefect or MLflow,
so that their settings (offline, state inside the project) are in force from the start.
"""

from tasks.environment import apply_project_env

apply_project_env()
