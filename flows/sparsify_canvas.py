"""The `sparsify` flow's detection and contour runs (`--task detection|contour`).

The data's images (28-pixel gray) are pasted on synthetic layout canvases (a versioned task),
the task's network (SSDlite, or the contour U-Net) trains in rounds with the sparsity term on
its chosen layers, the round with the best validation score is kept (early stopping as in
`train`), its activations are measured on the validation canvases (which chose it) and, with
its score, on the test canvases (which chose nothing: the figures to report). It is registered
as a pyfunc (boxes, labels and scores; or boundary and mask maps) and promoted only if it
beats the champion on the same test canvases through its pyfunc.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from flows.skeleton import BestRound, run_rounds
from flows.steps.sparsify import FLOW_NAME
from tasks.adapters import tracking
from tasks.adapters.registration import Registration
from tasks.adapters.reporting import publish_summary
from tasks.canvas import (
    SCORE,
    CanvasRound,
    LayoutsRef,
    build_layouts,
    canvas_sparsity_report,
    canvas_sparsity_spec,
    register_canvas,
    test_canvas,
)
from tasks.configs.sparsify import SparsifyConfig, SparsitySpec
from tasks.data import prepare_dataset, source_version
from tasks.rounds import RoundResult
from tasks.sparsify import log_sweep, sparsity_figure
from training.sparsify.report import ActivationReport, SparsityReport

# What other flows and the benchmarks may import (tests/test_layering.py): the flow
# and its summary (the `sparsify` flow's canvas tasks); the technique's name is
# `flows.steps.sparsify`'s.
__all__ = ["CanvasSummary", "sparsify_canvas"]


class CanvasSummary(BestRound):
    """What a detection or contour run of `sparsify` gives back."""

    run_id: str
    task: str
    val_score: float
    test: dict[str, float]
    spec: SparsitySpec
    report: SparsityReport  # validation: chose the round
    test_report: ActivationReport  # the test canvases' exact zeros
    sweep: dict[float, SparsityReport]
    registration: Registration


def layouts_of(config: SparsifyConfig, run_id: str) -> LayoutsRef:
    """The run's canvases: the data prepared at 28 gray pixels, pasted on layouts (logged and
    versioned: `dvc.dataset`, `dvc.layouts`)."""
    data = config.dataset.replace(image_size=28, channels=1)
    dataset = prepare_dataset(data, source_version(data))
    layouts = build_layouts(dataset, config.canvas, config.layouts, config.max_objects,
                            config.dataset.split_seed)
    tracking.log_artifact_refs(run_id, {"dataset": dataset.artifact,
                                        "layouts": layouts.artifact})
    tracking.log_dataset(run_id, f"{Path(config.dataset.data).name} canvases", layouts.artifact.md5,
                         layouts.artifact.path, layouts.sizes)
    tracking.set_tags(run_id, {"data.version": dataset.version,
                               "data.classes": ",".join(dataset.classes)})
    tracking.log_metrics(run_id, {f"layouts_{k}_canvases": v for k, v in layouts.sizes.items()}
                         | {f"layouts_{k}_objects": v for k, v in layouts.objects.items()})
    return layouts


def train_sparse_canvas(config: SparsifyConfig, layouts: LayoutsRef, run_id: str
                 ) -> tuple[SparsitySpec, RoundResult, SparsityReport]:
    """The config's sparsity term, the rounds trained with it (the round kept) and the kept
    network's activations on the validation canvases, logged on `run_id`."""
    spec = canvas_sparsity_spec(config, layouts)
    tracking.log_metrics(run_id, {f"lambda_{k.replace('.', '_')}": v
                                  for k, v in spec.lambdas.items()})
    get_run_logger().info("sparsity term %s on %s", spec.build().describe(), ", ".join(
        f"{k} (lambda {v:.3g})" for k, v in spec.lambdas.items()))
    active = any(value > 0 for value in spec.lambdas.values())
    best = run_rounds(config.rounds, lambda index, _previous: CanvasRound(
        config=config, layouts=layouts, round=index, sparsity=spec if active else None),
        run_id, config.patience,
        layouts.sizes["val"], f"val_{SCORE[config.task]}")
    report = canvas_sparsity_report(config, layouts, best.checkpoint, spec)
    tracking.log_metrics(run_id, report.split_metrics())
    return spec, best, report


def sweep(config: SparsifyConfig, layouts: LayoutsRef, report: SparsityReport,
          run_id: str) -> dict[float, SparsityReport]:
    """`--lambda-sweep`: one more network per lambda (nested runs); the score against the
    zeros, logged as `sparsity/sweep.json` and plotted."""
    points = {config.sparsity_lambda: report}
    for lam in config.lambda_sweep or ():
        if lam in points:
            continue
        varied = config.replace(sparsity_lambda=lam, layer_lambdas=None, lambda_sweep=None)
        with tracking.tracked_run(FLOW_NAME, f"lambda-{lam:g}", varied,
                                  parent_run_id=run_id) as child:
            points[lam] = train_sparse_canvas(varied, layouts, child)[2]
            tracking.log_metrics(child, {f"val_{points[lam].score_name}":
                                         points[lam].val_score})
    if len(points) > 1:
        log_sweep(run_id, points, config.network_name())
    return points


def sparsify_canvas(config: SparsifyConfig, name: str, run_id: str) -> CanvasSummary:
    """A detection or contour run inside the flow's MLflow run `run_id`; registers as
    `name`."""
    layouts = layouts_of(config, run_id)
    spec, best, report = train_sparse_canvas(config, layouts, run_id)
    tracking.log_dict(run_id, report.model_dump(), "sparsity/report.json")
    tracking.log_figure(run_id, sparsity_figure(report, f"{config.network_name()}, "
                                                f"{spec.build().describe()}"),
                        "sparsity/layers.png")
    points = sweep(config, layouts, report, run_id)
    tested = test_canvas(config, layouts, best.checkpoint, spec)
    test, test_report = tested.scores, tested.activations
    tracking.log_metrics(run_id, test | test_report.split_metrics()
                         | {f"val_{report.score_name}": report.val_score})
    tracking.log_dict(run_id, test_report.model_dump(), "sparsity/test_report.json")
    tracking.log_artifact_refs(run_id, {"checkpoint.final": best.checkpoint})
    registration = register_canvas(run_id, name, config, layouts, best.checkpoint)
    score = SCORE[config.task]
    publish_summary("sparsify-summary", f"sparsify ({config.task}): {config.network_name()}",
                    {f"test {score}": f"{test[f'test_{score}']:.4f}",
                     "sparsity term": f"{spec.build().describe()}, " + ", ".join(
                         f"{k}: lambda {v:.3g}" for k, v in spec.lambdas.items()),
                     "exact zeros (test)": ", ".join(
                         f"{k} {v.zero_fraction:.3f}" for k, v in test_report.layers.items()),
                     "exact zeros (validation: chose the round)": ", ".join(
                         f"{k} {v.zero_fraction:.3f}" for k, v in report.layers.items()),
                     "stored as bitmap + values (test)":
                         f"{test_report.metrics()['memory_bitmap_ratio']:.3f} of dense",
                     "canvases": "synthetic layouts of real images: " + ", ".join(
                         f"{k} {v}" for k, v in layouts.sizes.items()),
                     "best round (validation)": f"{best.round + 1} ({report.val_score:.4f})",
                     "model": registration.describe(),
                     "decision": registration.decision, "MLflow run": run_id})
    return CanvasSummary(run_id=run_id, task=config.task, best_round=best.round + 1,
                        val_score=report.val_score, test=test, spec=spec, report=report,
                        test_report=test_report, sweep=points, registration=registration)
