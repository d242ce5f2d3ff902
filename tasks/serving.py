"""The registered model: an MLflow pyfunc that takes raw images, returns label and confidence.

The network travels as a `torch.export` program (no Python class needed to load it) with a JSON
of its preprocessing (size, channels, mean, std) and class names. Inputs, as a person or a
server sends them:
- a pandas DataFrame with a column `image` of encoded image bytes (PNG, JPEG, ...), or of their
  base64 text (as JSON requests to `mlflow models serve` carry them);
- a numpy uint8 array N x H x W (gray) or N x H x W x C.
The output is a DataFrame with `label` (class name) and `confidence` (softmax probability).
The program also returns the network's embedding (`training.features.WithEmbedding`), which
`embed()` gives beside the same table (`python -m flows features`).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from training.batches import Normalize
from training.datasets import DataError
from training.preprocess import array_to_image, decode_image, images_to_batch

IMAGE_COLUMN = "image"
CHUNK = 512


def _as_bytes(value: Any, row: int) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value  # a data: URL
        try:
            return base64.b64decode("".join(text.split()), validate=True)
        except binascii.Error:
            raise ValueError(f"row {row} of column '{IMAGE_COLUMN}' is text but not base64 "
                             "image bytes") from None
    raise ValueError(f"row {row} of column '{IMAGE_COLUMN}' is {type(value).__name__}, expected "
                     "encoded image bytes")


class InputError(MlflowException, ValueError):
    """Input a served model cannot take. An MlflowException, so that MLflow's scoring server
    returns this message (not a bare BAD_REQUEST) to the client; a ValueError for callers."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


def input_images(model_input: Any) -> list:
    """The PIL images in a DataFrame of encoded bytes or a uint8 image array; InputError names
    what is wrong with any other input."""
    try:
        return _input_images(model_input)
    except ValueError as error:
        raise InputError(str(error)) from None


def _input_images(model_input: Any) -> list:
    if isinstance(model_input, pd.DataFrame):
        if IMAGE_COLUMN not in model_input.columns:
            raise ValueError(f"expected a column '{IMAGE_COLUMN}' of encoded images, got "
                             f"columns {list(model_input.columns)}")
        return [decode_image(_as_bytes(v, i)) for i, v in enumerate(model_input[IMAGE_COLUMN])]
    array = np.asarray(model_input)
    if array.size == 0:
        raise ValueError("no images in the input")
    if array.ndim not in (3, 4):
        raise ValueError(f"expected images N x H x W or N x H x W x C, got shape {array.shape}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.integer) or array.min() < 0 or array.max() > 255:
            raise ValueError(f"expected uint8 pixel values 0..255, got {array.dtype}")
        array = array.astype(np.uint8)
    return [array_to_image(image) for image in array]


class ImageClassifierModel(mlflow.pyfunc.PythonModel):
    """Raw images in, `label` and `confidence` out (see the module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        self.read_meta(context)
        self.program = torch.export.load(context.artifacts["program"]).module()

    def read_meta(self, context) -> dict:  # noqa: ANN001
        """The stored preprocessing and class names (set on the instance), and the whole
        meta JSON."""
        meta = json.loads(Path(context.artifacts["meta"]).read_text())
        self.classes: list[str] = meta["classes"]
        self.size: int = meta["image_size"]
        self.channels: int = meta["channels"]
        self.normalize = Normalize(meta["mean"], meta["std"])
        return meta

    def _outputs(self, model_input: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Softmax probabilities and embeddings (None for programs exported without them)."""
        images = input_images(model_input)
        probs, embeddings = [], []
        with torch.no_grad():
            for start in range(0, len(images), CHUNK):
                batch = images_to_batch(images[start:start + CHUNK], self.size, self.channels)
                out = self.program(self.normalize(batch))
                logits, embedding = out if isinstance(out, tuple | list) else (out, None)
                probs.append(torch.softmax(logits.float(), dim=1))
                embeddings.append(embedding)
        has_embedding = all(e is not None for e in embeddings)
        return torch.cat(probs), (torch.cat(embeddings).float() if has_embedding else None)

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
        probs, embeddings = self._outputs(model_input)
        if embeddings is None:
            raise DataError("this model version's program returns no embedding (it was "
                             "exported by an older version); train it again to embed images")
        return self._labelled(probs, self.classes), embeddings.numpy()
