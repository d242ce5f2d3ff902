"""What a served model takes: raw images as a person or a server sends them.

- a pandas DataFrame with a column `image` of encoded image bytes (PNG, JPEG, ...), or of their
  base64 text (as JSON requests to `mlflow models serve` carry them);
- a numpy uint8 array N x H x W (gray) or N x H x W x C.

Anything else raises `InputError`, which names what is wrong (MLflow's scoring server returns
it to the client as HTTP 400).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from training.preprocess import (
    array_to_image,
    decode_image,
    encoded_to_array,
    images_to_batch,
)

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


def input_batches(model_input: Any, size: int, channels: int, chunk: int = CHUNK
                  ) -> Iterator[torch.Tensor]:
    """The input as uint8 batches (n, `channels`, `size`, `size`) of at most `chunk` images,
    the same pixels `training.preprocess.image_to_array` gives each image: a uint8 array
    already at that size and channel count is taken as it is (no image objects); encoded
    images are all decoded first (`encoded_to_array`: a plain PNG at the model's size by
    libpng straight into a tensor, anything else through Pillow), then stacked; other arrays
    go through Pillow image by image. InputError as `input_images`."""
    try:
        ready = _ready_array(model_input, size, channels)
        decoded = (_decoded(model_input, size, channels)
                   if isinstance(model_input, pd.DataFrame) else None)
    except ValueError as error:
        raise InputError(str(error)) from None
    if ready is not None:
        for start in range(0, len(ready), chunk):
            yield torch.from_numpy(ready[start:start + chunk])
        return
    if decoded is not None:
        for start in range(0, len(decoded), chunk):
            yield torch.stack(decoded[start:start + chunk])
        return
    images = input_images(model_input)
    for start in range(0, len(images), chunk):
        yield images_to_batch(images[start:start + chunk], size, channels)


def _ready_array(model_input: Any, size: int, channels: int) -> np.ndarray | None:
    """A uint8 array input already at `size` with `channels` (gray N x H x W for 1), as
    N x C x H x W with a plain layout (the strides of a stacked batch: the convolutions then
    take the same path, to the last bit, as for decoded images); None for any other input."""
    if isinstance(model_input, pd.DataFrame):
        return None
    array = _checked_array(model_input)
    gray = array.ndim == 3 or array.shape[3] == 1
    if (array.shape[1:3] != (size, size) or (channels == 1) != gray
            or not (gray or array.shape[3] in (3, 4))):
        return None
    if gray:
        return np.ascontiguousarray(array).reshape(len(array), 1, size, size)
    return np.ascontiguousarray(array[..., :channels].transpose(0, 3, 1, 2))


def _encoded_column(frame: pd.DataFrame) -> pd.Series:
    if IMAGE_COLUMN not in frame.columns:
        raise ValueError(f"expected a column '{IMAGE_COLUMN}' of encoded images, got "
                         f"columns {list(frame.columns)}")
    return frame[IMAGE_COLUMN]


def _decoded(frame: pd.DataFrame, size: int, channels: int) -> list[torch.Tensor]:
    arrays = []
    for row, value in enumerate(_encoded_column(frame)):
        data = _as_bytes(value, row)
        try:
            arrays.append(encoded_to_array(data, size, channels))
        except ValueError as error:
            raise ValueError(f"row {row} of column '{IMAGE_COLUMN}': {error}") from None
    return arrays


def _input_images(model_input: Any) -> list:
    if isinstance(model_input, pd.DataFrame):
        return [decode_image(_as_bytes(v, i))
                for i, v in enumerate(_encoded_column(model_input))]
    return [array_to_image(image) for image in _checked_array(model_input)]


def _checked_array(model_input: Any) -> np.ndarray:
    """A uint8 image array N x H x W (x C); ValueError naming what is wrong."""
    array = np.asarray(model_input)
    if array.size == 0:
        raise ValueError("no images in the input")
    if array.ndim not in (3, 4):
        raise ValueError(f"expected images N x H x W or N x H x W x C, got shape {array.shape}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.integer) or array.min() < 0 or array.max() > 255:
            raise ValueError(f"expected uint8 pixel values 0..255, got {array.dtype}")
        array = array.astype(np.uint8)
    return array
