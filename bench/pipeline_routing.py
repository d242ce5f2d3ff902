"""The pipeline cascade's routing on one finished `pipeline` run: the confidence rule against
fitted predictors of several fits (docs/pipeline.md, "The cascade's routing").

Reads the run's exported sparse student and teacher (`program.sparsify`, `program.teacher`),
their logits on the validation and official test splits, and for each of three splits of the
validation set (seeds 0-2) fits each predictor on one half and lets `choose_routing` compare
it with the rule on the other half, as `fit-fallback` does; then scores both on the test split
with the thresholds validation chose. Costs: the milliseconds per image given (defaults: the
run's own measured figures). The test images are read here: a figure on them is in-sample for
the fit chosen.

    python -m bench.pipeline_routing --run RUN_ID
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from bench.common import print_json, print_table
from tasks.adapters import tracking
from tasks.adapters.versioning import ArtifactStore
from tasks.configs.pipeline import PipelineConfig
from tasks.data import load_dataset, prepare_dataset, source_version
from training.batches import eval_batches
from training.cascade.fallback import calibrate_fallback, fallback_table
from training.cascade.learning import split_disjoint
from training.cascade.routing import Router, choose_routing, stands, train_router

FITS = {  # name: (steps, lr, weight decay, hidden units (0: linear), outcomes weighted equally)
    "400 steps, wd 1e-3, balanced": (400, 0.01, 1e-3, 32, True),
    "200 steps, wd 1e-2, balanced": (200, 0.01, 1e-2, 32, True),
    "200 steps, wd 1e-2 (default)": (200, 0.01, 1e-2, 32, False),
    "linear, 300 steps, wd 1e-2": (300, 0.05, 1e-2, 0, False),
}


def fitted(logits: torch.Tensor, target: torch.Tensor, seed: int, steps: int, lr: float,
           decay: float, hidden: int, balanced: bool) -> Router:
    """A router fitted as `training.cascade.routing.fit_router` does, with the fit's knobs
    exposed (a linear one for `hidden` 0, the two outcomes weighted equally if `balanced`)."""
    torch.manual_seed(seed)
    router = Router(logits.shape[1], max(hidden, 1))
    if not hidden:
        router.net = nn.Sequential(nn.Linear(logits.shape[1] + 3, 1))
    y = target.float()
    weight = None
    if balanced:
        weight = torch.where(y > 0.5, len(y) / (2 * y.sum()), len(y) / (2 * (len(y) - y.sum())))
    return train_router(router, logits, target, steps, lr, decay, weight)


def auc(score: torch.Tensor, needs: torch.Tensor) -> float:
    """How often an image that needs the teacher scores below one that does not."""
    return (score[needs][:, None] < score[~needs][None, :]).float().mean().item()


def logits_of(run_id: str) -> dict:
    """The run's sparse student's and teacher's logits and the labels, per split."""
    refs = tracking.artifact_refs(run_id)
    store = ArtifactStore()
    config = PipelineConfig()
    dataset = prepare_dataset(config.dataset, source_version(config.dataset))
    data = load_dataset(dataset)
    out: dict = {}
    for step in ("sparsify", "teacher"):
        program = torch.export.load(store.path_of(refs[f"program.{step}"]["path"])).module()
        for split in ("val", "test"):
            logits, labels = [], []
            with torch.no_grad():
                for _, x, y in eval_batches(data, dataset, split, torch.device("cpu")):
                    result = program(x)
                    logits.append(result[0] if isinstance(result, tuple | list) else result)
                    labels.append(y)
            out[step, split], out["labels", split] = torch.cat(logits), torch.cat(labels)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a finished pipeline run's MLflow id")
    parser.add_argument("--costs", type=float, nargs=3, metavar=("STUDENT", "PREDICTOR",
                                                                 "TEACHER"),
                        help="ms per image; default: the run's latency table")
    args = parser.parse_args()
    if args.costs is None:
        metrics = tracking.client().get_run(args.run).data.metrics
        student, teacher = (metrics["fallback_student_ms_per_image_b1"],
                            metrics["fallback_teacher_ms_per_image_b1"])
        costs = (student, student + 0.03, teacher)
    else:
        costs = (args.costs[0], args.costs[0] + args.costs[1], args.costs[2])
    d = logits_of(args.run)
    sv, tv, yv = d["sparsify", "val"], d["teacher", "val"], d["labels", "val"]
    st, tt, yt = d["sparsify", "test"], d["teacher", "test"], d["labels", "test"]
    tolerance = PipelineConfig.flat_fields()["fallback_tolerance"].default
    rule = fallback_table(st, tt, yt, costs[0], costs[2]).outcome(torch.tensor(
        [calibrate_fallback(fallback_table(sv, tv, yv, costs[0], costs[2]), tolerance)]))
    needs = ~stands(st, tt, yt)
    rows = [["the confidence rule (whole validation split)", "-",
             f"{rule['accuracy']:.4f}", f"{rule['mean_cost']:.3f}",
             f"{rule['exit_share_1']:.3f}", f"{auc(st.softmax(1).amax(1), needs):.3f}"]]
    results = {"rule": rule, "fits": {}}
    for name, fit in FITS.items():
        outcomes = []
        for seed in (0, 1, 2):
            first, rows_compared = split_disjoint(len(yv), 0.5, seed)
            router = fitted(sv[first], stands(sv[first], tv[first], yv[first]), seed, *fit)
            with torch.no_grad():
                scores_val, scores_test = router(sv), router(st)
            choice = choose_routing(
                fallback_table(sv[rows_compared], tv[rows_compared], yv[rows_compared],
                               costs[0], costs[2]),
                fallback_table(sv[rows_compared], tv[rows_compared], yv[rows_compared],
                               costs[1], costs[2], scores_val[rows_compared]), tolerance)
            test = fallback_table(st, tt, yt, costs[1], costs[2], scores_test).outcome(
                torch.tensor([choice.fitted_threshold]))
            outcomes.append({"kept": choice.fitted_kept, "test": test,
                             "auc": auc(scores_test, needs)})
        results["fits"][name] = outcomes
        rows.append([name, sum(o["kept"] for o in outcomes),
                     " / ".join(f"{o['test']['accuracy']:.4f}" for o in outcomes),
                     " / ".join(f"{o['test']['mean_cost']:.3f}" for o in outcomes),
                     " / ".join(f"{o['test']['exit_share_1']:.3f}" for o in outcomes),
                     " / ".join(f"{o['auc']:.3f}" for o in outcomes)])
    print_table(["routing", "kept on validation (of 3 splits)", "test accuracy (splits 0/1/2)",
                 "mean ms", "sent to the teacher", "AUC (needs the teacher)"], rows)
    print_json({"benchmark": "pipeline_routing", "run": args.run, "costs_ms": costs,
                "needs_teacher_val": int((~stands(sv, tv, yv)).sum()),
                "val_images": len(yv), "results": results,
                "seeds": [0, 1, 2], "auc_confidence": auc(st.softmax(1).amax(1), needs),
                "tolerance": tolerance})


if __name__ == "__main__":
    main()
