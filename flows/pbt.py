"""The `pbt` flow: population-based training with weight copy and hyperparameter exploration.

N members warm up with the same hyperparameters; then, stage by stage, each trains one round with
its own hyperparameters, all are scored on the validation split, the weights the best member was
ranked on (its weight average where that scored better than its last weights,
`tasks.pbt.exploit_weights`) become every member's starting point, the best keeps its
hyperparameters and the others draw new ones around the best's (`training/pbt/scheduler.py`).
Members of a stage are tasks submitted together: in turn in-process, in parallel on a Dask cluster
(`--runner dask`). A member that still fails after its retry is recorded and left out of the stage.
The final model is the last stage's best member, or a greedy soup of the last stage's members when
averaging them does not lose validation accuracy (`training/pbt/soup.py`): tested, registered and
promoted as in `train`.
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.skeleton import begun_run, finish, publish
from flows.steps.pbt import FLOW_NAME, PopulationResult, population_step
from tasks.adapters import tracking
from tasks.adapters.registration import Registration
from tasks.configs.pbt import PBTConfig
from tasks.features import recognition_test
from tasks.pbt import SCORED_WEIGHTS

# What other flows and the benchmarks may import (tests/test_layering.py): the flow and its
# summary. Its step, which the `pipeline` composes too (the population from given weights),
# is `flows.steps.pbt`'s.
__all__ = ["FLOW_NAME", "PBTSummary", "pbt"]


class PBTSummary(BaseModel):
    """What a `pbt` run gives back."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    population: PopulationResult
    test_accuracy: float
    knn_accuracy: float
    registration: Registration


@flow(name=FLOW_NAME, description="Population-based training: members train in stages, the "
      "best's weights are copied to all and the others explore hyperparameters around its; "
      "the final best is registered and promoted if it beats the champion and the raw-pixel "
      "baselines.")
def pbt(config: PBTConfig) -> PBTSummary:
    """Runs the population, then tests, registers and promotes its best member."""
    run_name = f"{FLOW_NAME}-{config.network.model}-x{config.members}-seed{config.run.seed}"
    with begun_run(config, FLOW_NAME, run_name) as (run_id, name, prepared, config):
        best_config, population, budget = population_step(config, prepared, run_id)
        finished = finish(run_id, name, config.run, best_config, prepared,
                          population.best.checkpoint, population.best.metrics["val_accuracy"],
                          SCORED_WEIGHTS)
        registration = finished.registration
        recognition = recognition_test(registration.model_uri, prepared.dataset, config.knn_k)
        tracking.log_metrics(run_id, {"test_knn_accuracy": recognition["knn_accuracy"]})
        summary = PBTSummary(run_id=run_id, population=population,
                             test_accuracy=finished.test_accuracy,
                             knn_accuracy=recognition["knn_accuracy"],
                             registration=registration)
    publish("pbt-summary",
            f"pbt: {config.members} x {config.network.model} on {config.dataset.data}", run_id,
            finished, {
                f"test accuracy by {config.knn_k}-NN on embeddings":
                    f"{summary.knn_accuracy:.4f}",
                "best member (validation)": f"{population.best_member} "
                                            f"({population.best.metrics['val_accuracy']:.4f}, "
                                            f"{population.best.kept} weights)",
                "hyperparameters": ", ".join(f"{k}={v:.4g}" for k, v in
                                             population.hyperparameters.items()),
                "stages": str(population.stages),
                "budget": f"{budget.repeats} passes per round, batch {budget.batch_size}",
            })
    return summary
