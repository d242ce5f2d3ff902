"""The registered classifier: an MLflow pyfunc that takes raw images, returns label and
confidence.

The network travels as a `torch.export` program (no Python class needed to load it) with a JSON
of its preprocessing (size, channels, mean, std) and class names. Inputs: `serving.inputs`.
The output is a DataFrame with `label` (class name) and `confidence` (softmax probability).
The program also returns the network's embedding (`training.features.WithEmbedding`), which
`embed()` gives beside the same table (`python -m flows features`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from torch import nn

from serving.inputs import input_batches
from training.batches import Normalize
from training.datasets import DataError
from training.device import fast_layout, keep_freed_memory

CPU = torch.device("cpu")


def for_serving(network: nn.Module) -> nn.Module:
    """A loaded network (in eval mode, or an exported program, which has none) as every served
    model runs it: its weights in the CPU's fast layout (`training.device.fast_layout`), the
    process's allocator set to reuse freed blocks (`training.device.keep_freed_memory`: a
    batch of 64 allocates large maps)."""
    keep_freed_memory()
    return fast_layout(network, CPU)


def load_program(path: str) -> nn.Module:
    """An exported program (`torch.export`) as a module, `for_serving`, without the checks
    `torch.export` runs on every call's input (its guards function and input-constraint hook:
    about 0.05 ms a call, a fifth of a served `lenet`'s forward at batch 1, 4% of its client
    call; `python -m bench.serving --export-checks`): a served model only ever calls its
    programs on the batches `serving.inputs.input_batches` makes, (n, channels, size, size)
    as exported, and bad input is refused there, by name."""
    module = torch.export.load(path).module(check_guards=False)
    module.validate_inputs = False  # torch's switch for callers that check their own input
    return for_serving(module)


class ImageClassifierModel(mlflow.pyfunc.PythonModel):
    """Raw images in, `label` and `confidence` out (see the module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        self.read_meta(context)
        self.program = load_program(context.artifacts["program"])

    def read_meta(self, context) -> dict:  # noqa: ANN001
        """The stored preprocessing and class names (set on the instance), and the whole
        meta JSON."""
        meta = json.loads(Path(context.artifacts["meta"]).read_text())
        self.classes: list[str] = meta["classes"]
        self.size: int = meta["image_size"]
        self.channels: int = meta["channels"]
        self.normalize = Normalize(meta["mean"], meta["std"])
        return meta

    def _outputs(self, model_input: Any, embed: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Softmax probabilities and, where `embed`, the embeddings (None for programs
        exported without them, and where not `embed`)."""
        probs, embeddings = [], []
        with torch.no_grad():
            for batch in input_batches(model_input, self.size, self.channels):
                out = self.program(self.normalize(batch))
                logits, embedding = out if isinstance(out, tuple | list) else (out, None)
                probs.append(torch.softmax(logits.float(), dim=1))
                embeddings.append(embedding)
        probs = probs[0] if len(probs) == 1 else torch.cat(probs)
        if not embed or any(e is None for e in embeddings):
            return probs, None
        return probs, torch.cat(embeddings).float()

    @staticmethod
    def _labelled(probs: torch.Tensor, classes: list[str]) -> pd.DataFrame:
        confidence, index = probs.max(dim=1)
        return pd.DataFrame({"label": [classes[i] for i in index.tolist()],
                             "confidence": confidence.tolist()})

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        probs, _ = self._outputs(model_input)
        return self._labelled(probs, self.classes)

    def embed(self, model_input: Any) -> tuple[pd.DataFrame, np.ndarray]:
        """`predict`'s table and the N x D float32 embeddings of the same images.

        Raises:
            DataError: the model was exported before programs carried an embedding.
        """
        probs, embeddings = self._outputs(model_input, embed=True)
        if embeddings is None:
            raise DataError("this model version's program returns no embedding (it was "
                             "exported by an older version); train it again to embed images")
        return self._labelled(probs, self.classes), embeddings.numpy()
