"""The registered `pipeline` model: an MLflow pyfunc that runs the fallback cascade on raw images.

Two `torch.export` programs travel with it, the sparse student (`program`) and the teacher
(`fallback`), with the calibrated threshold in its meta JSON, and the fitted predictor's
weights (`router`) where validation kept it. Inputs as the classifier's (`serving.inputs`).
The student answers every image; only those whose confidence (or the predictor's score) is
at most the threshold run through the teacher (`training.cascade.fallback.fallback_infer`). The
output has one row per image: `label`, `confidence` and `exit` (1: the student, 2: the
teacher). `embed` (`python -m flows features`) gives the student's embeddings.
"""

from __future__ import annotations

import pandas as pd
import torch

from serving.classifier import ImageClassifierModel, load_program
from serving.inputs import input_batches
from training.cascade.fallback import fallback_infer
from training.cascade.routing import Router


def logits_of(program):
    """The program's logits (exported programs also return the embedding)."""
    def call(images: torch.Tensor) -> torch.Tensor:
        out = program(images)
        return out[0] if isinstance(out, tuple | list) else out
    return call


class FallbackModel(ImageClassifierModel):
    """Raw images in; label, confidence and exit out (module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        meta = self.read_meta(context)
        self.threshold = float(meta["threshold"])
        state = meta.get("router")
        self.router = None if state is None else Router.from_json(state)
        self.program = load_program(context.artifacts["program"])
        self.student = logits_of(self.program)  # `embed` gives the student's embeddings
        self.fallback = load_program(context.artifacts["fallback"])
        self.teacher = logits_of(self.fallback)

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        rows = []
        for batch in input_batches(model_input, self.size, self.channels):
            out = fallback_infer(self.student, self.teacher, self.normalize(batch),
                                 self.threshold, self.router)
            rows += [{"label": self.classes[label], "confidence": confidence, "exit": exit_ + 1}
                     for label, confidence, exit_ in zip(out.labels.tolist(),
                                                         out.confidence.tolist(),
                                                         out.exits.tolist(), strict=True)]
        return pd.DataFrame(rows)
