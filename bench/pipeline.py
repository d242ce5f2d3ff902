"""The `pipeline` flow's final model beside the `train` flow's, and what each step adds.

Per seed, in one process: the real `pipeline` flow (`quick`: Fashion-MNIST, 20,000 training
images) and the real `train` flow with its defaults (`resnet18` width 8, what `make run`
trained before the pipeline), neither registering. Accuracy on two sets of images, side by
side: Fashion-MNIST's official 10,000 test images (some defaults were chosen on them in earlier
sessions) and 10,000 report images that no choice ever read (`bench.report_set`: training-file
images the runs leave unused, apart from every earlier validation and tuning set); on the test
images also milliseconds per image of the served pyfuncs at batch 1 (the two models' calls
interleaved, median) and at batch 64, parameters, and the share of exact zeros in the feature
maps the sparsity term regularizes (the train model's feature maps alike; measured on the test
images). Then each step's model (teacher, distilled student, PBT's best, sparse student, the
fallback cascade) with its accuracy on both sets, its change over the step before and its time
per image at batch 1 in the process (the run's `time-steps`), and whether the cascade's fitted
predictor was kept (chosen on validation).

    python -m bench.pipeline                  # 3 seeds, about 10 minutes a seed on 2 cores
    python -m bench.pipeline --seeds 0 --set pbt_stages=3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# Every run trains anew (a benchmark must not be served from Prefect's cache).
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"

from bench.common import mean_std, parse_overrides, print_json, print_table  # noqa: E402
from bench.report_set import ReportSet  # noqa: E402
from flows.pipeline import pipeline  # noqa: E402
from flows.train import train  # noqa: E402
from tasks.adapters import tracking  # noqa: E402
from tasks.adapters.versioning import ArtifactRef, ArtifactStore  # noqa: E402
from tasks.configs.pipeline import PipelineConfig  # noqa: E402
from tasks.configs.sections import classifier_config  # noqa: E402
from tasks.configs.train import TrainConfig  # noqa: E402
from tasks.data import load_dataset, prepare_dataset, source_version  # noqa: E402
from tasks.promotion import test_images  # noqa: E402
from tasks.training import trained_model  # noqa: E402
from training.batches import eval_batches  # noqa: E402
from training.sparsify.pruning import parameter_count  # noqa: E402
from training.sparsify.term import activation_stats  # noqa: E402

STEPS = ("teacher", "distill", "pbt", "sparsify")
LATENCY_IMAGES = 300


def zeros_and_parameters(classifier, dataset, checkpoint: ArtifactRef, weights: str = "model"
                         ) -> tuple[float, int]:
    """The exact-zero share of the network's feature maps but the embedding (the layers
    `sparsify` regularizes by default), over the test images, and its parameter count."""
    import torch

    model = trained_model(classifier, dataset, checkpoint, weights)
    layers = list(model.feature_layers[:-1])
    cpu = torch.device("cpu")
    stats = activation_stats(model, layers, eval_batches(load_dataset(dataset), dataset, "test",
                                                         cpu), cpu)
    return statistics.fmean(stats.zero_fraction.values()), parameter_count(model)


def served_ms(uris: dict[str, str], images, batch: int = 1) -> dict[str, float]:
    """Each pyfunc's median milliseconds per image at `batch` images a call, calls
    interleaved (`LATENCY_IMAGES` images in all after a warm-up call)."""
    models = {name: tracking.load_pyfunc(uri) for name, uri in uris.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    calls = max(LATENCY_IMAGES // batch, 10)
    for n in range(calls + 1):
        start = (n * batch) % max(len(images) - batch, 1)
        for name, model in models.items():
            started = time.perf_counter()
            model.predict(images[start:start + batch])
            if n:
                times[name].append((time.perf_counter() - started) * 1e3 / batch)
    return {name: statistics.median(values) for name, values in times.items()}


def run(seed: int, overrides: dict[str, str], report: ReportSet) -> dict:
    """One pipeline run and one train run on the same data; their figures (`report`: the
    never-read images)."""
    started = time.perf_counter()
    summary = pipeline(PipelineConfig(**{"seed": seed, "progress": False, "registry": False,
                                         "skip_unchanged": False, **overrides}))
    seconds = time.perf_counter() - started
    baseline = TrainConfig(seed=seed, progress=False, registry=False)
    trained = train(baseline)
    data = baseline.dataset
    dataset = prepare_dataset(data, source_version(data))
    ref = tracking.artifact_refs(trained.run_id)["checkpoint.final"]
    size = ArtifactStore().path_of(ref["path"]).stat().st_size
    train_zeros, train_parameters = zeros_and_parameters(
        classifier_config(baseline), dataset, ArtifactRef(path=ref["path"], md5=ref["md5"],
                                                          size=size))
    steps = {step.name: step for step in summary.steps}
    sparse = steps["sparsify"]
    student_zeros, student_parameters = zeros_and_parameters(sparse.classifier, dataset,
                                                             sparse.checkpoint, sparse.weights)
    teacher_parameters = steps["teacher"].parameters  # counted by the run's `time-steps`
    images, _ = test_images(dataset)
    uris = {"pipeline": summary.registration.model_uri, "train": trained.registration.model_uri}
    ms, ms64 = served_ms(uris, images), served_ms(uris, images, 64)
    metrics = summary.fallback.metrics
    return {"seconds": seconds,
            "steps": {name: step.test_accuracy for name, step in steps.items()},
            "report_steps": {name: report.checkpoint_accuracy(step.classifier, dataset,
                                                              step.checkpoint, step.weights)
                             for name, step in steps.items()},
            "step_ms": {name: step.ms_per_image_b1 for name, step in steps.items()}
            | {"cascade": metrics["steps_ms_per_image_b1"]},
            "routing": {key: value for key, value in metrics.items()
                        if key.startswith(("fixed_", "fitted_", "val_fixed", "val_fitted"))
                        or key in ("predictors_kept", "student_alone_stands",
                                   "val_student_accuracy", "val_teacher_accuracy")},
            "pipeline": {"accuracy": summary.test_accuracy, "ms": ms["pipeline"],
                         "ms_b64": ms64["pipeline"],
                         "report_accuracy": report.served_accuracy(
                             summary.registration.model_uri),
                         "zeros": student_zeros, "student_parameters": student_parameters,
                         "teacher_parameters": teacher_parameters,
                         "student_share": metrics["test_student_share"],
                         "student_alone": summary.student_alone},
            "train": {"accuracy": trained.test_accuracy, "ms": ms["train"],
                      "ms_b64": ms64["train"],
                      "report_accuracy": report.served_accuracy(trained.registration.model_uri),
                      "zeros": train_zeros, "parameters": train_parameters}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="pipeline config fields for every run (e.g. pbt_stages=3)")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    report = ReportSet(PipelineConfig(**{"progress": False, **overrides}).dataset)
    runs = [run(seed, overrides, report) for seed in args.seeds]

    def stat(path: tuple[str, str]) -> tuple[float, float]:
        return mean_std([r[path[0]][path[1]] for r in runs])

    def cell(path: tuple[str, str]) -> str:
        return "{:.4f} ± {:.4f}".format(*stat(path))

    pipe_acc, train_acc = stat(("pipeline", "accuracy")), stat(("train", "accuracy"))
    pipe_ms, train_ms = stat(("pipeline", "ms")), stat(("train", "ms"))
    print_table(["model", "report accuracy (never read)", "test accuracy (official)",
                 "ms / image, batch 1 (served)", "batch 64", "parameters",
                 "exact zeros (feature maps)"], [
        ["`train` (resnet18, defaults)", cell(("train", "report_accuracy")),
         cell(("train", "accuracy")), f"{train_ms[0]:.3f}", f"{stat(('train', 'ms_b64'))[0]:.3f}",
         f"{runs[0]['train']['parameters']:,}", f"{stat(('train', 'zeros'))[0]:.3f}"],
        ["`pipeline` (sparse student, teacher fallback)", cell(("pipeline", "report_accuracy")),
         cell(("pipeline", "accuracy")), f"{pipe_ms[0]:.3f}",
         f"{stat(('pipeline', 'ms_b64'))[0]:.3f}",
         f"{runs[0]['pipeline']['student_parameters']:,} + "
         f"{runs[0]['pipeline']['teacher_parameters']:,}",
         f"{stat(('pipeline', 'zeros'))[0]:.3f} (student)"]])
    share = stat(("pipeline", "student_share"))
    print(f"\nthe student answers {share[0]:.0%} of the test images; pipeline over train: "
          f"test accuracy {pipe_acc[0] - train_acc[0]:+.4f}, time {pipe_ms[0] / train_ms[0]:.2f}x;"
          f" a pipeline run {mean_std([r['seconds'] for r in runs])[0] / 60:.1f} minutes\n")
    rows, previous = [], None
    for name in (*STEPS, "cascade"):
        figures = []
        for key, final in (("report_steps", "report_accuracy"), ("steps", "accuracy")):
            values = [r[key][name] if name in r[key] else r["pipeline"][final] for r in runs]
            figures.append(mean_std(values))
        change = ("" if previous is None or name == "distill"
                  else f"{figures[0][0] - previous:+.4f}")
        ms = mean_std([r["step_ms"][name] for r in runs])[0]
        rows.append([name, *("{:.4f} ± {:.4f}".format(*f) for f in figures), change,
                     f"{ms:.3f}"])
        previous = figures[0][0]
    print_table(["step", "report accuracy", "test accuracy", "change (report) over the step "
                 "before", "ms / image, batch 1 (in process)"], rows)
    kept = sum(r["routing"].get("predictors_kept", 0) for r in runs)
    print(f"\nthe fitted predictor was kept on {kept:.0f} of {len(runs)} seeds (validation)")
    print_json({"benchmark": "pipeline", "seeds": args.seeds, "overrides": overrides,
                "report_images": len(report), "runs": runs})


if __name__ == "__main__":
    main()
