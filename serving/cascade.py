"""The registered cascade: an MLflow pyfunc that runs the real cascade on raw images.

Inputs as the classifier's (`serving.inputs`). The output has one row per image:
`label` and `confidence` (the exit's confidence measure), `exit` (1-based: the module the image
left at) and `subnetworks` (per super-network module the image reached, `module:sub-network`,
1-based, e.g. `2:1 3:2`). The network is rebuilt from its shape (`models.cascade`) and its
stored weights, which carry the calibrated thresholds and any fixed sub-network choice.
"""

from __future__ import annotations

import pandas as pd
import torch

from models.cascade import CascadeSpec, build_cascade
from serving.classifier import ImageClassifierModel, for_serving
from serving.inputs import input_batches


class CascadeModel(ImageClassifierModel):
    """Raw images in; label, confidence, exit and sub-networks out (module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        spec = self.read_meta(context)["spec"]
        self.network = build_cascade(CascadeSpec(
            widths=tuple(spec["widths"]), super_modules=tuple(spec["super_modules"]),
            sub_widths=tuple(spec["sub_widths"]), confidence=spec["confidence"],
            exit_pool=spec.get("exit_pool", 1),  # models registered before them: 1, 0
            exit_hidden=spec.get("exit_hidden", 0),
            route_context=spec.get("route_context", False)),
            self.channels, len(self.classes))
        self.network.load_state_dict(torch.load(context.artifacts["weights"],
                                                map_location="cpu", weights_only=True))
        self.network = for_serving(self.network.eval())

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        rows = []
        for batch in input_batches(model_input, self.size, self.channels):
            out = self.network.infer(self.normalize(batch))
            for label, confidence, exit_, choices in zip(
                    out.labels.tolist(), out.confidence.tolist(), out.exits.tolist(),
                    out.choices.tolist(), strict=True):
                rows.append({"label": self.classes[label], "confidence": confidence,
                             "exit": exit_ + 1, "subnetworks": " ".join(
                                 f"{k + 1}:{s + 1}" for k, s in enumerate(choices) if s >= 0)})
        return pd.DataFrame(rows)
