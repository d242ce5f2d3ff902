"""Registration: the final model as an MLflow pyfunc, promoted only if it beats the champion
by a paired test (`training.promotion`).

Both the new model and the current champion are scored through their pyfunc (raw uint8 images
in, labels out) on the same test images in the same run, so the comparison is paired, image by
image, and also proves that the served model works end to end. Those images (chosen by
`tasks.promotion`, which reads the data sets) are the test split
less any image the champion trained or was chosen on (its recorded data set's training and
validation images, known by path and by content hash): with stable splits
(`training.datasets.stable_split`) that is the whole test split, and a champion trained under
other split settings, or on another folder holding copies of these images, is never scored on
its own training images. The decision says on how many images it was made and gives the
test's statistic. Each model's own network and
preprocessing settings come from its stored files; the Python preprocessing code is the one
installed in this process.

A model identical to a registered version (same exported program) is not registered again, so
a re-run or a retried task never adds a duplicate version. A champion trained on other classes
is not compared (its labels could never match): the new model stays a challenger and the
decision says to choose another `--model-name`.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from pydantic import BaseModel, ConfigDict

from serving.entry import CONFIG_KEY, INPUT, model_class, output_schema
from tasks.adapters import tracking
from tasks.adapters.aliases import CHALLENGER, CHAMPION, crown
from tasks.adapters.checkpoints import torch_save
from tasks.adapters.locks import registry_lock
from tasks.environment import PROJECT_ROOT
from training.promotion import (
    ALPHA,
    Compare,
    Correct,
    Scorer,
    against_champion,
    comparable,
    paired_verdict,
    parameters_of,
    recorded_parameters,
    without_champion,
)

SERVING_PACKAGES = ("torch", "torchvision", "mlflow", "pillow", "pandas", "numpy")


class Registration(BaseModel):
    """The outcome of registering a model version and deciding its alias; a run that may not
    register (`Policy.registry` false) has only its logged model's URI and the decision."""

    model_config = ConfigDict(frozen=True)

    name: str
    model_uri: str  # the pyfunc logged on the run
    version: str | None = None
    alias: str | None = None
    accuracy: float | None = None  # the test score named by `metric`
    champion_version: str | None = None
    champion_accuracy: float | None = None
    decision: str
    metric: str = "test_accuracy"

    @property
    def registered(self) -> bool:
        return self.version is not None

    @property
    def version_uri(self) -> str | None:
        """`models:/NAME/VERSION` of the registered version (what `--init-from` takes)."""
        return f"models:/{self.name}/{self.version}" if self.registered else None

    def describe(self) -> str:
        """`name version V, alias A`, or that nothing was registered."""
        if not self.registered:
            return f"not registered (logged as {self.model_uri})"
        return f"{self.name} version {self.version}, alias `{self.alias}`"


class Policy(BaseModel):
    """What a run may do to the registry: register at all, and the gates a champion passes
    besides beating the current one on the same test images."""

    model_config = ConfigDict(frozen=True)

    registry: bool = True  # may register at all
    max_latency_ms: float | None = None  # the served pyfunc's time per image (batch 1)
    alpha: float = ALPHA  # the level of the paired test (`training.promotion`)

    @classmethod
    def of(cls, run: Any) -> Policy:
        """The policy a flow config's run section sets (`tasks.configs.sections.RunSection`)."""
        return cls(registry=run.registry, max_latency_ms=run.max_latency_ms,
                   alpha=run.promotion_alpha)


NOT_REGISTERED = "not registered (--no-register, or the smoke profile): the registry is untouched"
LATENCY_REPEATS = 30


def pip_requirements() -> list[str]:
    """Exact pins of what the served model imports (torch without its local build tag)."""
    return [f"{name}=={package_version(name).split('+')[0]}" for name in SERVING_PACKAGES]


SERVED_CODE = ("serving", "training", "models")  # all a registered model imports


def log_served_model(run_id: str, kind: str, artifacts: dict[str, str],
                     signature: ModelSignature | None = None, task: str | None = None) -> str:
    """Logs a pyfunc of `kind` (`serving.entry.KINDS`) with its `artifacts`: the one
    models-from-code entry `serving/pyfunc_model.py`, with `serving/`, `training/` and
    `models/` as its code (no Prefect, DVC or `tasks/`); returns its URI. Its signature
    declares the columns it returns (`serving.entry.OUTPUTS`; a canvas model's by its `task`)
    and `signature`'s parameters; its metadata says what it takes (`serving.entry.INPUT`)."""
    model_class(kind)  # an unknown kind fails here, not when someone loads the model
    declared = ModelSignature(outputs=output_schema(kind, task),
                              params=signature.params if signature else None)
    return tracking.log_pyfunc_model(
        run_id, str(PROJECT_ROOT / "serving" / "pyfunc_model.py"), artifacts=artifacts,
        pip_requirements=pip_requirements(),
        code_paths=[str(PROJECT_ROOT / package) for package in SERVED_CODE],
        signature=declared, model_config={CONFIG_KEY: kind}, metadata={"input": INPUT})


def log_weights_pyfunc(run_id: str, kind: str, meta: dict,
                       weights: dict[str, Any], signature: ModelSignature | None = None) -> str:
    """Logs a pyfunc of `kind` that rebuilds its network from code and carries `meta` (JSON)
    and the `weights` (a state dict); returns its URI. For networks that no exported program
    can hold (a detector's post-processing, a cascade's per-image exits)."""
    with tempfile.TemporaryDirectory() as folder:
        meta_path, weights_path = Path(folder) / "meta.json", Path(folder) / "weights.pt"
        meta_path.write_text(json.dumps(meta, indent=2))
        torch_save(weights, weights_path)
        return log_served_model(run_id, kind, {"weights": str(weights_path),
                                               "meta": str(meta_path)}, signature,
                                meta.get("task"))


def pyfunc_correct(model_uri: str, images: np.ndarray, labels: list[str]) -> Correct:
    """Whether the pyfunc at `model_uri` labels each of `images` right (`labels`)."""
    predicted = tracking.load_pyfunc(model_uri).predict(images)["label"].tolist()
    return Correct(np.array([p == t for p, t in zip(predicted, labels, strict=True)]))


def pyfunc_accuracy(model_uri: str, images: np.ndarray, labels: list[str]) -> float:
    """Fraction of `images` that the pyfunc at `model_uri` labels correctly."""
    return pyfunc_correct(model_uri, images, labels).score()


def served_parameters(model_uri: str) -> int:
    """The parameters of the networks the pyfunc at `model_uri` serves with
    (`parameters_of`): what "cheaper" means when two models tie."""
    implementation = tracking.load_pyfunc(model_uri).unwrap_python_model()
    return parameters_of(getattr(implementation, "implementation", implementation))


def served_ms_per_image(model_uri: str, images: np.ndarray) -> float:
    """The pyfunc's median time to predict one image (batch 1, after a warm-up), in ms."""
    model = tracking.load_pyfunc(model_uri)
    times = []
    for n in range(LATENCY_REPEATS + 3):
        one = images[n % len(images)][None]
        start = time.perf_counter()
        model.predict(one)
        times.append(time.perf_counter() - start)
    return float(np.median(times[3:]) * 1000)


def transient(state) -> bool:
    """Retry only when the tracking server or the file system failed, not on a logic error."""
    try:
        state.result()
    except (OSError, TimeoutError, ConnectionError):
        return True
    except MlflowException as error:
        return error.error_code in ("TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR")
    except Exception:
        return False
    return False


def promote(run_id: str, name: str, model_uri: str, score: Scorer | None,
            classes: list[str], program_md5: str, tags: dict[str, str],
            policy: Policy, refusal: str | None = None,
            metric: str = "test_accuracy", timer: Callable[[str], float] | None = None,
            compare: Compare | None = None,
            parameters: Callable[[str], int] = served_parameters) -> Registration:
    """Scores the logged model at `model_uri` with `score` (a pyfunc URI to its per-image
    evidence on the test images, `training.promotion.Evidence`), registers it (once per
    `program_md5`) and decides its alias under the model's registry lock
    (`tasks.adapters.locks`), by a paired test at level `policy.alpha`
    (`training.promotion`):

    - with a champion: `champion` only when better than it on the same images, or not worse
      and with fewer served parameters (`parameters`);
    - with no champion: `champion` unless a registered version is better than it;
    - never when something refuses it (`refusal`: why it may not be champion; the policy's
      latency budget, in ms per image by `timer`: a champion over the budget loses to a model
      within it).

    `compare` (a registered version's tags to a scorer on the images both are compared on,
    or None when there are none, and a `Comparison` saying which) replaces `score` for each
    comparison; the version keeps its `score` on the whole test split. Records the decision
    and its statistic as tags (`registry.decision`, `registry.p_better`, ...) and
    `registry_<metric>` (and `champion_<metric>`, `compared_<metric>`) on the run. With
    `policy.registry` false nothing is scored and the registry is not touched."""
    if not policy.registry:
        tracking.set_tags(run_id, {"registry.decision": NOT_REGISTERED,
                                   "registry.model_uri": model_uri})
        return Registration(name=name, model_uri=model_uri, decision=NOT_REGISTERED,
                            metric=metric)
    evidence = score(model_uri)
    new_score = evidence.score()
    budget = policy.max_latency_ms
    if budget is not None:
        if timer is None:
            raise ValueError(f"a latency budget needs a timer for {model_uri}")
        latency = timer(model_uri)
        tracking.log_metrics(run_id, {"registry_ms_per_image": latency})
        if latency > budget:
            refusal = refusal or (f"over the latency budget: {latency:.2f} ms per image > "
                                  f"{budget:g} ms (--max-latency-ms)")
    new_parameters = functools.cache(lambda: parameters(model_uri))
    # one alias move of `name` at a time, on every machine sharing the MLflow server
    with registry_lock(name, f"promotion by run {run_id}") as lease:
        champion_version = tracking.alias_version(name, CHAMPION)
        version = tracking.find_version(name, "program", program_md5)
        verdict = comparison = champion_score = None
        same_model = version is not None and version == champion_version
        if champion_version is not None and not same_model:  # (no need to score itself)
            champion_uri = f"models:/{name}/{champion_version}"
            champion_tags = tracking.version_tags(name, champion_version)
            why_not = comparable(champion_tags, classes, metric)
            if why_not is not None:
                refusal = refusal or f"the champion (version {champion_version}) {why_not}"
            else:
                verdict, comparison, failed = paired_verdict(
                    champion_uri, champion_tags, model_uri, score, evidence, compare,
                    policy.alpha)
                refusal = refusal or failed
        if same_model:
            alias, decision = CHAMPION, f"same model as the champion (version {version})"
        elif refusal:  # never replace a champion on a comparison that did not happen
            alias, decision = CHALLENGER, refusal
        elif budget is not None and champion_version is not None and (champion_latency := (
                timer(champion_uri))) > budget:
            alias, decision = CHAMPION, (f"within the latency budget ({latency:.2f} ms <= "
                                         f"{budget:g} ms per image), the champion (version "
                                         f"{champion_version}, {champion_latency:.2f} ms) is not")
        elif verdict is not None:
            champion_score = verdict.old_score
            outcome = (against_champion(verdict, champion_version) if verdict.better else
                       against_champion(verdict, champion_version, new_parameters(),
                                        recorded_parameters(champion_uri, champion_tags,
                                                            parameters)))
            alias = CHAMPION if outcome.crown else CHALLENGER
            decision = outcome.reason + (f"; {comparison.note}" if comparison else "")
        else:  # no champion: compared with every version already registered
            verdicts = {}
            for other in tracking.model_versions(name):
                other_tags = tracking.version_tags(name, other)
                if other == version or comparable(other_tags, classes, metric) is not None:
                    continue
                found, _, _ = paired_verdict(f"models:/{name}/{other}", other_tags, model_uri,
                                             score, evidence, compare, policy.alpha)
                if found is not None:
                    verdicts[other] = found
            outcome = without_champion(verdicts)
            alias, decision = (CHAMPION if outcome.crown else CHALLENGER), outcome.reason
            verdict = next((v for v in verdicts.values() if v.worse), None)
        if version is None:
            lease.check()
            version = tracking.register_version(model_uri, name, run_id, {
                metric: f"{new_score:.6f}", "metric": metric, "program": program_md5,
                "classes": json.dumps(classes), "parameters": str(new_parameters())} | tags)
        if alias == CHAMPION:
            if version != champion_version:
                crown(name, version, lease, f"run {run_id}", decision)
        else:
            lease.check()
            tracking.set_alias(name, alias, version)
            if champion_version is None:
                decision += (f". No version of {name} is champion yet: the next run whose model "
                             "passes the gates and is not worse than a registered version "
                             "becomes it, or choose one by hand (python -m flows promote "
                             f"{name} VERSION --reason ...)")
        tracking.set_tags(run_id, {"registry.model": name, "registry.version": version,
                                   "registry.alias": alias, "registry.decision": decision,
                                   "registry.champion_version": champion_version or "none"}
                          | ({"registry.compared_images": str(comparison.images),
                              "registry.compared_left_out": str(comparison.left_out)}
                             if comparison is not None else {})
                          | ({"registry.test": verdict.test,
                              "registry.p_better": f"{verdict.p_better:.6g}",
                              "registry.p_worse": f"{verdict.p_worse:.6g}",
                              "registry.alpha": f"{verdict.alpha:g}"}
                             if verdict is not None else {}))
        tracking.log_metrics(run_id, {f"registry_{metric}": new_score}
                             | ({f"champion_{metric}": champion_score,
                                 f"compared_{metric}": verdict.new_score}
                                if champion_score is not None else {}))
    return Registration(name=name, model_uri=model_uri, version=version, alias=alias,
                        accuracy=new_score, champion_version=champion_version,
                        champion_accuracy=champion_score, decision=decision, metric=metric)
