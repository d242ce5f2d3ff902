"""The `train` flow: one classifier trained, tested, registered, and promoted if it wins."""

from __future__ import annotations

from prefect import flow

from flows.skeleton import (
    ClassifierSummary,
    begun_run,
    budgeted_classifier,
    finish,
    publish,
    train_classifier_rounds,
)
from tasks.configs.train import TrainConfig

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary.
__all__ = ["FLOW_NAME", "TrainSummary", "train"]

FLOW_NAME = "train"


class TrainSummary(ClassifierSummary):
    """What a `train` run gives back: where everything is and how good it is."""

    repeats: int


@flow(name=FLOW_NAME, description="Train one classifier, test it, register it in MLflow and "
      "promote it to champion only if it beats the current one and the raw-pixel baselines.")
def train(config: TrainConfig) -> TrainSummary:
    """Trains `config.network.model` on `config.dataset.data`; registers it as
    `config.run.model_name`."""
    run_name = f"{FLOW_NAME}-{config.network.model}-seed{config.run.seed}"
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        classifier, budget = budgeted_classifier(config, prepared, run_id, config.rounds)
        best = train_classifier_rounds(classifier, prepared, budget, run_id, config.patience)
        finished = finish(run_id, name, config.run, classifier, prepared, best.checkpoint,
                          best.metrics["val_accuracy"])
        summary = TrainSummary(run_id=run_id, best_round=best.round + 1,
                               val_accuracy=best.metrics["val_accuracy"],
                               test_accuracy=finished.test_accuracy,
                               baselines=prepared.baselines, repeats=budget.repeats,
                               registration=finished.registration)
    publish("train-summary", f"train: {config.network.model} on {config.dataset.data}", run_id,
            finished, {
        "best round (validation)": f"{summary.best_round} ({summary.val_accuracy:.4f})",
        "budget": f"{budget.rounds} rounds x {budget.repeats} passes, batch "
                  f"{budget.batch_size}: {budget.steps} steps",
    })
    return summary
