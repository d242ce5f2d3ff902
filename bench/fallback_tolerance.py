"""The pipeline cascade's tolerance: what each `--fallback-tolerance` sends to the teacher and
what it keeps, on one `pipeline` run (docs/pipeline.md, "The fallback's tolerance").

Runs the `pipeline` flow (no registry; `--run` reads a finished run instead), takes its sparse
student's and teacher's logits on the validation and test splits, and for each tolerance
calibrates the confidence threshold on validation as the flow does
(`training.cascade.fallback.calibrate_fallback`). Per tolerance: the threshold, the cascade's
validation accuracy (net, and counting only the images the student loses, which the
calibration reads), the share of images sent to the teacher on each split, and the test
accuracy. The default is chosen on the validation columns; the test split is shown beside
them (read here, so in-sample for a choice made with it) and the report of the chosen default
is `bench.pipeline`'s, on images no run reads.

    python -m bench.fallback_tolerance --seed 0
    python -m bench.fallback_tolerance --run RUN_ID      # a finished pipeline run
"""

from __future__ import annotations

import argparse

import torch

from bench.common import print_json, print_table
from bench.pipeline_routing import logits_of
from flows.pipeline import pipeline
from tasks.adapters import tracking
from tasks.configs.pipeline import PipelineConfig
from training.cascade.fallback import calibrate_fallback, fallback_table

TOLERANCES = (0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03)


def sweep(run_id: str, tolerances: tuple[float, ...]) -> dict:
    """The run's networks alone per split, and each tolerance's cascade (module docstring)."""
    metrics = tracking.client().get_run(run_id).data.metrics
    costs = (metrics["fallback_student_ms_per_image_b1"],
             metrics["fallback_teacher_ms_per_image_b1"])
    d = logits_of(run_id)
    tables = {split: fallback_table(d["sparsify", split], d["teacher", split],
                                    d["labels", split], *costs) for split in ("val", "test")}
    # exit 0: the student's answer, exit 1: the teacher's (`fallback_table`)
    alone = {split: {"student": table.correct[:, 0].float().mean().item(),
                     "teacher": table.full_accuracy(), "images": len(table.correct)}
             for split, table in tables.items()}
    losses_only = tables["val"].losses_only()
    rows = []
    for tolerance in tolerances:
        threshold = calibrate_fallback(tables["val"], tolerance)
        at = torch.tensor([threshold])
        val, test = tables["val"].outcome(at), tables["test"].outcome(at)
        rows.append({"tolerance": tolerance, "threshold": threshold,
                     "val_accuracy": val["accuracy"],
                     "val_losses_only_accuracy": losses_only.outcome(at)["accuracy"],
                     "val_teacher_share": val["exit_share_1"],
                     "test_accuracy": test["accuracy"], "test_teacher_share": test["exit_share_1"]})
    return {"run": run_id, "alone": alone, "tolerances": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the pipeline run's seed")
    parser.add_argument("--run", help="a finished pipeline run's MLflow id (no new run)")
    parser.add_argument("--tolerances", type=float, nargs="+", default=list(TOLERANCES))
    args = parser.parse_args()
    run_id = args.run or pipeline(PipelineConfig(seed=args.seed, progress=False,
                                                 registry=False)).run_id
    figures = sweep(run_id, tuple(args.tolerances))
    alone = figures["alone"]
    print(f"alone, validation / test: student {alone['val']['student']:.4f} / "
          f"{alone['test']['student']:.4f}, teacher {alone['val']['teacher']:.4f} / "
          f"{alone['test']['teacher']:.4f}")
    print_table(["tolerance", "threshold", "val accuracy (losses only)", "val to the teacher",
                 "test accuracy", "test to the teacher"],
                [[f"{r['tolerance']:g}", f"{r['threshold']:.3f}",
                  f"{r['val_accuracy']:.4f} ({r['val_losses_only_accuracy']:.4f})",
                  f"{r['val_teacher_share']:.3f}", f"{r['test_accuracy']:.4f}",
                  f"{r['test_teacher_share']:.3f}"] for r in figures["tolerances"]])
    print_json({"benchmark": "fallback_tolerance", "seed": None if args.run else args.seed,
                "default": PipelineConfig.flat_fields()["fallback_tolerance"].default,
                **figures})


if __name__ == "__main__":
    main()
