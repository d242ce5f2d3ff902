"""The registry's decision, pure: which of two models on the same images is better, by a paired
test, and whether a new version takes the `champion` alias.

Evidence is per image, on the images both models are scored on, in the same order:

- `Correct`: one bool per image (a classifier's label is right or wrong). Two of them are
  compared by McNemar's exact test: of the n = b + c images on which the two disagree (b: only
  the new model is right, c: only the old one), b ~ Binomial(n, 1/2) when neither is better,
  so the one-sided p-value that the new model is better is P(X >= b), that it is worse
  P(X <= b). Images both get right or both get wrong say nothing about which is better.
- `Scored`: an aggregate that is no mean of per-image values (a detector's mAP, a boundary F):
  a paired bootstrap resamples the images with replacement, scores both models on the same
  resample, and p is the share of resamples where the difference is not in the new model's
  favour (with the usual +1 in numerator and denominator).

A challenger replaces the champion only when it is better at level `alpha` (0.05 unless the
run says otherwise), or when it is not worse at that level and serves with fewer parameters:
one image of noise never swaps champions. With no champion, a new version takes the alias
unless a version already registered is better than it by the same test (so a chance-level
model never takes the seat from a good one that a gate kept out).

The baseline gate asks the same of a model against the raw-pixel baseline on validation: it
is refused only when it falls below the Wilson score interval of the baseline's accuracy
(95%), whose lower end stays below 1 at a perfect baseline (n / (n + z^2)), unlike a
standard error, which is 0 there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

ALPHA = 0.05  # the default level of every paired decision
WILSON_Z = 1.959963984540054  # two-sided 95%
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # a fixed generator: the same evidence always gives the same decision


@dataclass(frozen=True)
class Correct:
    """Whether a classifier labelled each image right (the score is their mean)."""

    right: np.ndarray  # bool, one per image

    def __post_init__(self) -> None:
        object.__setattr__(self, "right", np.asarray(self.right, dtype=bool).reshape(-1))

    def __len__(self) -> int:
        return len(self.right)

    def score(self, index: np.ndarray | None = None) -> float:
        """Accuracy on all images, or on the images at `index`."""
        right = self.right if index is None else self.right[index]
        return float(right.mean()) if len(right) else 0.0


@dataclass(frozen=True)
class Scored:
    """A model's predictions on n images, scored by an aggregate of a subset of them."""

    images: int
    aggregate: Callable[[np.ndarray], float] = field(compare=False)  # image positions -> score
    resamples: int = BOOTSTRAP_RESAMPLES  # fewer where one aggregate is slow (COCO's mAP)

    def __len__(self) -> int:
        return self.images

    def score(self, index: np.ndarray | None = None) -> float:
        """The aggregate on all images, or on the images at `index` (repeats allowed)."""
        return float(self.aggregate(np.arange(self.images) if index is None else index))


Evidence = Correct | Scored


@dataclass(frozen=True)
class Verdict:
    """A paired comparison of a new model with an old one on the same images."""

    test: str  # "McNemar exact" or "paired bootstrap"
    images: int
    new_score: float
    old_score: float
    p_better: float  # one-sided: the new model is better
    p_worse: float  # one-sided: the new model is worse
    alpha: float
    detail: str  # the counts behind the p-values

    @property
    def better(self) -> bool:
        return self.p_better < self.alpha

    @property
    def worse(self) -> bool:
        return self.p_worse < self.alpha

    def describe(self) -> str:
        """`0.9100 against 0.8800, McNemar exact on 400 images (b = 20, c = 8): one-sided
        p = 0.018 (better), 0.993 (worse), level 0.05`."""
        return (f"{self.new_score:.4f} against {self.old_score:.4f}, {self.test} on "
                f"{self.images} images ({self.detail}): one-sided p = {self.p_better:.3g} "
                f"(better), {self.p_worse:.3g} (worse), level {self.alpha:g}")


def binomial_tail(successes: int, trials: int) -> float:
    """P(X >= successes) for X ~ Binomial(trials, 1/2), exactly."""
    if successes <= 0:
        return 1.0
    if successes > trials:
        return 0.0
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2 ** trials


def discordant(new, old) -> tuple[int, int, float]:  # noqa: ANN001 (bool arrays or tensors)
    """McNemar's counts of two classifiers' per-image rightness (numpy arrays or tensors of
    bool, the same images in order): the images only `new` gets right, those only `old` gets
    right, and the exact one-sided p-value that `new` is better."""
    only_new, only_old = int((new & ~old).sum()), int((old & ~new).sum())
    return only_new, only_old, binomial_tail(only_new, only_new + only_old)


def mcnemar(new: Correct, old: Correct, alpha: float = ALPHA) -> Verdict:
    """McNemar's exact test of `new` against `old` on the same images (module docstring)."""
    _same_images(new, old)
    b, c, p_better = discordant(new.right, old.right)
    return Verdict(test="McNemar exact", images=len(new), new_score=new.score(),
                   old_score=old.score(), p_better=p_better,
                   p_worse=binomial_tail(c, b + c), alpha=alpha,
                   detail=f"only the new one right on {b}, only the old one on {c}")


def paired_bootstrap(new: Evidence, old: Evidence, alpha: float = ALPHA,
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                     ) -> Verdict:
    """The paired bootstrap of `new` against `old` on the same images (module docstring)."""
    n = _same_images(new, old)
    rng = np.random.default_rng(seed)
    differences = np.array([new.score(index) - old.score(index)
                            for index in (rng.integers(0, n, n) for _ in range(resamples))])
    not_better, not_worse = int(np.sum(differences <= 0)), int(np.sum(differences >= 0))
    return Verdict(test="paired bootstrap", images=n, new_score=new.score(),
                   old_score=old.score(), p_better=(1 + not_better) / (1 + resamples),
                   p_worse=(1 + not_worse) / (1 + resamples), alpha=alpha,
                   detail=f"{resamples} resamples, the new one ahead in "
                          f"{resamples - not_better}")


def paired_test(new: Evidence, old: Evidence, alpha: float = ALPHA) -> Verdict:
    """McNemar's exact test for two classifiers' `Correct`, else the paired bootstrap (with
    the fewer `resamples` of the two)."""
    if isinstance(new, Correct) and isinstance(old, Correct):
        return mcnemar(new, old, alpha)
    resamples = min(getattr(e, "resamples", BOOTSTRAP_RESAMPLES) for e in (new, old))
    return paired_bootstrap(new, old, alpha, resamples)


def _same_images(new: Evidence, old: Evidence) -> int:
    if len(new) != len(old):
        raise ValueError(f"a paired test needs both models on the same images: {len(new)} "
                         f"against {len(old)}")
    if len(new) == 0:
        raise ValueError("a paired test needs at least one image")
    return len(new)


@dataclass(frozen=True)
class Decision:
    """Whether the new version takes `champion`, and why, in a sentence."""

    crown: bool
    reason: str


def against_champion(verdict: Verdict, champion: str, new_parameters: int | None = None,
                     champion_parameters: int | None = None) -> Decision:
    """A challenger replaces `champion` (its version) only when better by the paired
    `verdict`, or not worse and cheaper (fewer served parameters, when both are known)."""
    if verdict.better:
        return Decision(True, f"beats the champion (version {champion}): {verdict.describe()}")
    cheaper = (new_parameters is not None and champion_parameters is not None
               and new_parameters < champion_parameters)
    if not verdict.worse and cheaper:
        return Decision(True, f"ties the champion (version {champion}) and is cheaper "
                              f"({new_parameters:,} against {champion_parameters:,} "
                              f"parameters): {verdict.describe()}")
    how = "is worse than" if verdict.worse else "does not beat"
    return Decision(False, f"{how} the champion (version {champion}): {verdict.describe()}")


def without_champion(verdicts: dict[str, Verdict]) -> Decision:
    """With no champion, the new version takes the alias unless a registered version (by
    number, its paired verdict against the new one's) is better than it."""
    if not verdicts:
        return Decision(True, "no champion yet and no other version of this model")
    better = {v: verdict for v, verdict in verdicts.items() if verdict.worse}
    if better:
        version, verdict = min(better.items(), key=lambda item: item[1].p_worse)
        return Decision(False, f"no champion yet, but version {version} is better: "
                               f"{verdict.describe()}")
    return Decision(True, f"no champion yet, and none of the {len(verdicts)} registered "
                          f"versions ({', '.join(verdicts)}) is better by a paired test")


def wilson_interval(accuracy: float, images: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion `accuracy` measured on `images` trials."""
    if images <= 0:
        raise ValueError(f"an interval needs at least one image, got {images}")
    z2 = z * z
    centre = (accuracy + z2 / (2 * images)) / (1 + z2 / images)
    half = z / (1 + z2 / images) * math.sqrt(accuracy * (1 - accuracy) / images
                                             + z2 / (4 * images * images))
    return max(0.0, centre - half), min(1.0, centre + half)


class Comparison(BaseModel):
    """The images a challenger and the champion are compared on: how many, and why those."""

    model_config = ConfigDict(frozen=True)

    images: int
    left_out: int  # test images the champion trained or was chosen on
    note: str


def parameters_of(served: object) -> int:
    """The parameters and buffers of every network a served model holds as an attribute
    (a fallback pyfunc: its student and its teacher), each tensor once."""
    import torch

    seen, total = set(), 0
    for value in vars(served).values():
        if isinstance(value, torch.nn.Module):
            for tensor in (*value.parameters(), *value.buffers()):
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel()
    return total


class Baseline(BaseModel):
    """A reference a model must not fall below on validation to become champion: the stronger
    raw-pixel baseline (`training.baselines`), the model's own validation accuracy, and the
    number of validation images both were measured on.

    The gate refuses a model only when it is below the Wilson score interval (95%) of the
    baseline's accuracy b on n images (`training.promotion.wilson_interval`): a model that
    ties the baseline within that interval passes, and at a perfect baseline the interval's
    lower end is n / (n + 1.96^2) (0.969 on 121 images), not 1."""

    model_config = ConfigDict(frozen=True)

    name: str
    val_accuracy: float
    model_val_accuracy: float
    val_images: int = Field(ge=1)

    @property
    def lower(self) -> float:
        """The lower end of the baseline's Wilson interval."""
        return wilson_interval(self.val_accuracy, self.val_images)[0]

    @property
    def passed(self) -> bool:
        """Not below the baseline's interval (the gate lets the model through)."""
        return self.model_val_accuracy >= self.lower

    @property
    def beaten(self) -> bool:
        """Strictly above the baseline (shown in the summary; the gate asks `passed`)."""
        return self.model_val_accuracy > self.val_accuracy

    def refusal(self) -> str | None:
        """Why the gate refuses the model (None when it `passed`)."""
        if self.passed:
            return None
        return (f"below the raw-pixel {self.name} baseline on validation: "
                f"{self.model_val_accuracy:.4f} < {self.lower:.4f}, the lower end of the "
                f"baseline's 95% Wilson interval ({self.val_accuracy:.4f} on "
                f"{self.val_images} images): registered, never champion; train longer "
                "(--min-steps) or pick another model")


Scorer = Callable[[str], Evidence]  # a pyfunc URI -> its per-image evidence


Compare = Callable[[dict[str, str]], tuple[Scorer | None, Comparison]]


def comparable(tags: dict[str, str], classes: list[str], metric: str) -> str | None:
    """Why a registered version (its `tags`) cannot be compared with a model of `classes`
    scored by `metric` (None: it can)."""
    recorded = tags.get("classes")
    if recorded is not None and recorded != json.dumps(classes):
        return "was trained on other classes; register this data set's models under another " \
               "--model-name"
    if tags.get("metric", "test_accuracy") != metric:
        return f"is scored by {tags.get('metric')}, not {metric}: register under another " \
               "--model-name"
    return None


def recorded_parameters(uri: str, tags: dict[str, str],
                        parameters: Callable[[str], int]) -> int | None:
    """A registered version's served parameters: its `parameters` tag, else counted (None
    when its pyfunc no longer loads)."""
    if tags.get("parameters", "").isdigit():
        return int(tags["parameters"])
    try:
        return parameters(uri)
    except Exception:  # noqa: BLE001 (an old version that no longer loads: no cost to compare)
        return None


def paired_verdict(version_uri: str, tags: dict[str, str], model_uri: str, score: Scorer,
                   new_evidence: Evidence, compare: Compare | None, alpha: float
                   ) -> tuple[Verdict | None, Comparison | None, str | None]:
    """The new model against the registered version at `version_uri` on the images neither
    saw (`compare`, else `score`'s): the paired verdict, the comparison, or why there is
    none."""
    scorer, comparison = (score, None) if compare is None else compare(tags)
    if scorer is None:
        return None, comparison, (f"no test image is left that {version_uri} did not train "
                                  "on: no fair comparison; move the alias by hand (python -m "
                                  "flows promote) or keep the split settings between runs")
    try:
        old = scorer(version_uri)
    except Exception as error:  # an old version that no longer loads or predicts
        return None, comparison, f"{version_uri} could not be scored: {error}"
    new = new_evidence if scorer is score else scorer(model_uri)
    return paired_test(new, old, alpha), comparison, None


class Seen(BaseModel):
    """The images a model trained or was chosen on: their keys and their content hashes."""

    model_config = ConfigDict(frozen=True)

    keys: frozenset[str]
    contents: frozenset[str] = frozenset()

    @classmethod
    def of(cls, data: Any) -> Seen:
        """The images `data` (a `training.datasets.LoadedDataset`) trained or was chosen on."""
        return cls(keys=frozenset(data.seen_keys()), contents=frozenset(data.seen_contents()))

    def __or__(self, other: Seen) -> Seen:
        return Seen(keys=self.keys | other.keys, contents=self.contents | other.contents)

    def saw(self, key: str, content: str | None) -> bool:
        """Whether the image of `key` (and `content`, when known) is among these, by either."""
        return key in self.keys or (content is not None and content in self.contents)
