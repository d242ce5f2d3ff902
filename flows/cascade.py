"""The `cascade` flow: a cascaded early-exit network with super-network modules.

An image goes through K modules and leaves at the first exit that is confident enough; a
super-network module runs, per image, the sub-network its predictor picks (`models.cascade`).
The flow: prepare the data; split the training images into a first and a second training set
and score each image's difficulty; measure every part's time on this device (the latency
table); train the modules input side first, each on the easiest share of the first set that
its position allows (a super-network module with the latency-aware loss), then fit each
super-network module's predictor on the second set (after the last module; with frozen
stage training, right after its own); refit the early exit heads to the last exit (on the
first set, the rest frozen); calibrate the exit thresholds on validation, where the routed
modules' predictors compete with their most frequent choice fixed (and with their most
expensive sub-network); test the real cascade beside the full network, the plain confidence
cascade, both routings (`fixed_...`, `fitted_...`: each with its own thresholds, whichever
won) and the oracle; register the routing validation chose (the tag `cascade.routing`, a
pyfunc that runs the real cascade) and promote it like `train`'s models.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.skeleton import (
    begun_run,
    conclude,
    log_budget,
    publish,
    run_rounds,
)
from tasks.adapters import tracking
from tasks.adapters.registration import Registration
from tasks.adapters.versioning import md5_of
from tasks.cascade.evaluation import (
    ROUTINGS,
    Calibration,
    CascadeTest,
    calibrate_exit_thresholds,
    register_cascade,
    sweep_figure,
    test_cascade,
)
from tasks.cascade.tasks import (
    CascadeSets,
    ModuleRound,
    difficulty_sets,
    fit_predictor,
    measure_latency,
    module_budget,
    read_table,
    refit_exits,
    serving_device,
)
from tasks.configs.cascade import CascadeConfig
from tasks.training import TestResult

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary.
__all__ = ["FLOW_NAME", "CascadeSummary", "cascade"]

FLOW_NAME = "cascade"


class CascadeSummary(BaseModel):
    """What a `cascade` run gives back."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    sets: CascadeSets
    calibration: Calibration
    test: CascadeTest
    baselines: dict[str, float]
    registration: Registration

    @property
    def test_accuracy(self) -> float:
        return self.test.metrics["test_accuracy"]


def predictor_choice(metrics: dict[str, float]) -> str:
    """The summary's line on what the calibration kept of the super-network's routing."""
    if metrics["predictors_kept"]:
        return ("kept: their per-image choice beats their most frequent one fixed and the most "
                "expensive sub-networks, on validation")
    if metrics["most_expensive_fixed"]:
        return ("the most expensive sub-networks fixed (the plain cascade): their most frequent "
                "choice misses the target or costs more, on validation")
    return "fixed to their most frequent choice (no worse on validation, and no predictor to run)"


def routing_line(metrics: dict[str, float], prefix: str) -> str:
    """The summary's line on one routing's test: accuracy, speed-up at batch 1, cost over the
    oracle's (by the latency table and in FLOPs) and each exit's share."""
    shares = sorted((key for key in metrics if key.startswith(f"{prefix}exit_share_")),
                    key=lambda key: int(key.rsplit("_", 1)[1]))
    return (f"accuracy {metrics[f'{prefix}test_accuracy']:.4f}, "
            f"{metrics[f'{prefix}speedup_b1']:.2f}x at batch 1, cost "
            f"{metrics[f'{prefix}cost_over_oracle']:.2f}x the oracle's "
            f"({metrics[f'{prefix}flops_over_oracle']:.2f}x in FLOPs), exits "
            + ", ".join(f"{metrics[key]:.2f}" for key in shares))


@flow(name=FLOW_NAME, description="Train a cascaded early-exit network with super-network "
      "modules module by module on sets of rising difficulty, calibrate its exits, measure it "
      "against the full network, register it and promote it if it beats the champion.")
def cascade(config: CascadeConfig) -> CascadeSummary:
    """Trains the config's cascade on `config.dataset.data`; registers it as
    `config.run.model_name`."""
    logger = get_run_logger()
    run_name = f"{FLOW_NAME}-{'-'.join(map(str, config.widths))}-seed{config.run.seed}"
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        dataset = prepared.dataset
        sets = difficulty_sets(config, dataset)
        tracking.log_artifact_refs(run_id, {"difficulty_sets": sets.artifact})
        tracking.log_metrics(run_id, {"second_set_images": sets.second_images} | {
            f"module{k}_images": n for k, n in enumerate(sets.module_images)} | {
            f"module{k}_mean_difficulty": d for k, d in enumerate(sets.mean_difficulty)})
        given = config.latency_table
        latency = measure_latency(config, dataset, serving_device(config), None if given is None
                                  else md5_of(Path(given).expanduser()))
        tracking.log_artifact_refs(run_id, {"latency_table": latency})
        tracking.log_dict(run_id, read_table(latency), "cascade/latency.json")
        checkpoint = None
        frozen = config.stage_training == "frozen"
        modules = range(len(config.widths))
        for k in modules:
            log_budget(run_id, module_budget(config, sets.module_images[k]), f"module{k}_")
            best = run_rounds(
                config.rounds, lambda index, _previous, k=k, start=checkpoint: ModuleRound(
                    config=config, dataset=dataset, sets=sets, latency=latency, k=k,
                    round=index, start=start),
                run_id, config.patience, dataset.sizes["val"], key=f"module{k}_val_accuracy",
                name=f"checkpoint.module-{k}")
            checkpoint = best.checkpoint
            # frozen: a module is final once trained; joint: once the last one is
            for j in [k] if frozen else ([] if k < modules[-1] else modules):
                if j in config.super_modules:
                    fitted = fit_predictor(config, dataset, sets, latency, j, checkpoint)
                    tracking.log_metrics(run_id, fitted.metrics)
                    tracking.log_artifact_refs(run_id, {f"checkpoint.module-{j}.predictor":
                                                        fitted.checkpoint})
                    checkpoint = fitted.checkpoint
                    logger.info("module %d predictor (%s): %s", j, config.predictor,
                                ", ".join(f"{key}={value:.3f}"
                                          for key, value in fitted.metrics.items()))
        if config.exit_distill_epochs:
            refit = refit_exits(config, dataset, sets, checkpoint)
            tracking.log_metrics(run_id, refit.metrics)
            tracking.log_artifact_refs(run_id, {"checkpoint.exits-refit": refit.checkpoint})
            checkpoint = refit.checkpoint
            logger.info("exit heads refitted to the last exit: validation %s", ", ".join(
                f"{refit.metrics[f'exit{k}_val_accuracy_before_refit']:.4f} -> "
                f"{refit.metrics[f'exit{k}_val_accuracy']:.4f}"
                for k in range(len(config.widths) - 1)))
        calibration = calibrate_exit_thresholds(config, dataset, latency, checkpoint)
        tracking.log_metrics(run_id, calibration.metrics)
        tracking.log_artifact_refs(run_id, {"checkpoint.calibrated": calibration.checkpoint})
        if calibration.routing is not None:  # what the registered model runs
            tracking.set_tags(run_id, {"cascade.routing": calibration.routing})
        test = test_cascade(config, dataset, latency, calibration.checkpoint)
        tracking.log_metrics(run_id, test.metrics)
        tracking.log_dict(run_id, {"sweep": test.sweep}, "cascade/sweep.json")
        tracking.log_figure(run_id, sweep_figure(
            test.sweep, test.metrics["full_test_accuracy"],
            f"cascade {config.widths} on {config.dataset.data}"),
                            "cascade/accuracy_latency.png")
        finished = conclude(
            run_id, config.run, prepared, calibration.metrics["val_accuracy"],
            TestResult(metrics=test.metrics, program=calibration.checkpoint),
            lambda refusal: register_cascade(run_id, name, config, dataset,
                                             calibration.checkpoint, refusal))
        summary = CascadeSummary(run_id=run_id, sets=sets, calibration=calibration, test=test,
                                 baselines=prepared.baselines,
                                 registration=finished.registration)
    metrics = test.metrics
    publish("cascade-summary", f"cascade: {config.widths} on {config.dataset.data}", run_id,
            finished, {
        "full network (no exits)": f"test {metrics['full_test_accuracy']:.4f}",
        "measured time per image": f"batch 1: {metrics['ms_per_image_b1']:.3f} ms, "
                                   f"{metrics['speedup_b1']:.2f}x faster than the full "
                                   f"network; batch {config.serving_batch}: "
                                   f"{metrics['speedup_serving']:.2f}x",
        "plain confidence cascade": f"test {metrics['plain_test_accuracy']:.4f}, "
                                    f"{metrics['plain_speedup_b1']:.2f}x at batch 1",
        "share of test images leaving at each exit": ", ".join(
            f"{metrics[f'exit_share_{k}']:.2f}" for k in range(len(config.widths))),
        "thresholds": ", ".join(f"{t:.3f}" for t in calibration.thresholds),
        **({"predictors": predictor_choice(calibration.metrics)}
           if "predictors_kept" in calibration.metrics else {}),
        **{f"{ROUTINGS[name]}, test": routing_line(metrics, f"{name}_")
           for name in ("fixed", "fitted") if f"{name}_test_accuracy" in metrics},
        **({"registered": f"{ROUTINGS[calibration.routing]} (chosen on validation)"}
           if calibration.routing is not None else {}),
        "oracle": f"accuracy {metrics['oracle_accuracy']:.4f}, the cascade's cost "
                  f"{metrics['cost_over_oracle']:.2f}x the oracle's",
    })
    return summary
