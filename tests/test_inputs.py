"""The served models' input preparation (`serving.inputs.input_batches`): a fast path for
inputs already at the model's size and channels, the same pixels as the image-by-image path
(`training.preprocess.image_to_array`) for every kind of input."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from serving.inputs import InputError, input_batches, input_images
from training.preprocess import images_to_batch


def _encoded(array: np.ndarray, fmt: str, exif_orientation: int | None = None) -> bytes:
    image = Image.fromarray(array)
    buffer = io.BytesIO()
    if exif_orientation is None:
        image.save(buffer, fmt)
    else:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        image.save(buffer, fmt, exif=exif.tobytes())
    return buffer.getvalue()


def _reference(model_input, size: int, channels: int) -> torch.Tensor:
    """Image by image, through PIL: what every model trained on."""
    return images_to_batch(input_images(model_input), size, channels)


def _batched(model_input, size: int, channels: int, chunk: int = 3) -> torch.Tensor:
    batches = list(input_batches(model_input, size, channels, chunk))
    # the plain layout of a stacked batch: a size-1 channel with other strides would send
    # the convolutions down another path and change the last bits of the answers
    assert all(b.stride() == torch.empty(b.shape).stride() for b in batches)
    return torch.cat(batches)


rng = np.random.default_rng(0)
GRAY = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
RGB = rng.integers(0, 256, (7, 28, 28, 3), dtype=np.uint8)


@pytest.mark.parametrize(("model_input", "size", "channels"), [
    (GRAY, 28, 1),  # the fast path: taken as it is
    (GRAY[..., None], 28, 1),
    (RGB, 28, 3),
    (np.concatenate([RGB, RGB[..., :1]], axis=3), 28, 3),  # RGBA: alpha dropped
    (GRAY, 32, 1),  # resized through PIL
    (GRAY, 28, 3),  # gray to RGB through PIL
    (RGB, 28, 1),  # RGB to gray through PIL
    (pd.DataFrame({"image": [_encoded(a, "PNG") for a in GRAY]}), 28, 1),
    (pd.DataFrame({"image": [_encoded(a, "JPEG") for a in RGB]}), 28, 3),
    (pd.DataFrame({"image": [_encoded(a, "JPEG") for a in RGB]}), 28, 1),
    (pd.DataFrame({"image": [_encoded(a[:, :20], "JPEG", 6) for a in RGB]}), 28, 3),  # EXIF
    (pd.DataFrame({"image": [_encoded(a, "JPEG", 3) for a in RGB]}), 28, 3),  # upside down
])
def test_batches_hold_the_pixels_of_the_image_by_image_path(model_input, size, channels):
    batched = _batched(model_input, size, channels)
    assert batched.dtype == torch.uint8 and batched.shape == (7, channels, size, size)
    assert torch.equal(batched, _reference(model_input, size, channels))


def test_an_upside_down_photo_at_the_models_size_is_turned_upright():
    photo = pd.DataFrame({"image": [_encoded(RGB[0], "JPEG", 3)]})
    plain = pd.DataFrame({"image": [_encoded(RGB[0], "JPEG")]})
    turned, as_stored = _batched(photo, 28, 3), _batched(plain, 28, 3)
    assert torch.equal(turned, as_stored.flip(2, 3))


def test_bad_input_is_named_on_the_fast_path_too():
    with pytest.raises(InputError, match="uint8 pixel values"):
        list(input_batches(GRAY.astype(np.float32) / 255, 28, 1))
    with pytest.raises(InputError, match="column 'image'"):
        list(input_batches(pd.DataFrame({"x": [b""]}), 28, 1))


def test_a_served_models_parameters_count_every_network_it_holds_once():
    """What "cheaper" means when two models tie (`parameters_of`): a fallback pyfunc serves
    with its student and its teacher; a network held twice counts once; a function is no
    network."""
    from types import SimpleNamespace

    from tasks.adapters.registration import parameters_of

    student, teacher = torch.nn.Linear(4, 2), torch.nn.Linear(8, 2)
    served = SimpleNamespace(program=student, fallback=teacher, again=student,
                             teacher=lambda x: teacher(x))
    assert parameters_of(served) == (4 * 2 + 2) + (8 * 2 + 2)
