"""Run summaries: printed for the person at the terminal and kept as a Prefect artifact."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from tasks.adapters import tracking


def ui_commands() -> str:
    """How to open the UIs (both bound to 127.0.0.1)."""
    return ("make ui   # Prefect UI on http://127.0.0.1:4200, MLflow UI on "
            "http://127.0.0.1:5000")


def summary_markdown(title: str, rows: dict[str, object], table: str = "") -> str:
    """A two-column markdown table with a title, then `table` (more markdown, if any) and the
    commands to open the UIs."""
    lines = [f"# {title}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows.items()]
    lines += ["", table] if table else []
    lines += ["", f"Tracking URI: `{tracking.tracking_uri()}`", "", f"`{ui_commands()}`"]
    return "\n".join(lines)


def publish_summary(key: str, title: str, rows: dict[str, object], table: str = "") -> str:
    """Creates the Prefect markdown artifact of a run and returns the markdown."""
    markdown = summary_markdown(title, rows, table)
    create_markdown_artifact(markdown=markdown, key=key, description=title)
    return markdown


def figure_pyplot():
    """matplotlib's pyplot drawing to files only, never a window (for the runs' figures)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot
