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


def _encoded(array: np.ndarray, fmt: str, exif_orientation: int | None = None,
             mode: str | None = None, **options) -> bytes:
    image = Image.fromarray(array)
    if mode is not None:
        image = image.convert(mode)
    buffer = io.BytesIO()
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        options["exif"] = exif.tobytes()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _with_chunk(png: bytes, name: bytes, payload: bytes) -> bytes:
    """`png` with one more chunk after its header (IHDR ends at byte 33)."""
    import struct
    import zlib

    chunk = (struct.pack(">I", len(payload)) + name + payload
             + struct.pack(">I", zlib.crc32(name + payload)))
    return png[:33] + chunk + png[33:]


def _pngs(arrays, chunk: tuple[bytes, bytes] | None = None, **options) -> pd.DataFrame:
    encoded = [_encoded(a, "PNG", **options) for a in arrays]
    return pd.DataFrame({"image": encoded if chunk is None else
                         [_with_chunk(png, *chunk) for png in encoded]})


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
    (_pngs(GRAY), 28, 1),  # libpng straight into a tensor (`png_as_it_is`)
    (_pngs(RGB), 28, 3),  # the same
    (_pngs(RGB), 28, 1),  # the rest through Pillow: converted to gray,
    (_pngs(GRAY), 28, 3),
    (_pngs(GRAY), 32, 1),  # resized,
    (_pngs(RGB, mode="RGBA"), 28, 3),  # alpha dropped,
    (_pngs(RGB, mode="P"), 28, 3),  # a palette,
    (_pngs(GRAY, mode="LA"), 28, 1),
    (_pngs(GRAY.astype(np.uint16) * 257, mode="I;16"), 28, 1),  # 16 bits scaled to 8
    (_pngs(GRAY, transparency=0), 28, 1),  # tRNS: Pillow keeps the gray as it is
    (_pngs(RGB, transparency=(0, 0, 0)), 28, 3),
    (_pngs(GRAY, exif_orientation=3), 28, 1),  # EXIF in a PNG: turned upright
    (_pngs(GRAY, chunk=(b"gAMA", bytes([0, 1, 134, 160]))), 28, 1),  # colour chunks: no
    (_pngs(RGB, chunk=(b"sBIT", bytes([4, 4, 4]))), 28, 3),  # change, on the fast path too
    (pd.DataFrame({"image": [_encoded(a, "JPEG") for a in RGB]}), 28, 3),
    (pd.DataFrame({"image": [_encoded(a, "JPEG") for a in RGB]}), 28, 1),
    (pd.DataFrame({"image": [_encoded(a[:, :20], "JPEG", 6) for a in RGB]}), 28, 3),  # EXIF
    (pd.DataFrame({"image": [_encoded(a, "JPEG", 3) for a in RGB]}), 28, 3),  # upside down
])
def test_batches_hold_the_pixels_of_the_image_by_image_path(model_input, size, channels):
    batched = _batched(model_input, size, channels)
    assert batched.dtype == torch.uint8 and batched.shape == (7, channels, size, size)
    assert torch.equal(batched, _reference(model_input, size, channels))


def test_only_plain_pngs_at_the_models_size_skip_pillow():
    """The cases above that must come out of libpng's fast path, and those that must not."""
    from training.preprocess import png_as_it_is

    assert png_as_it_is(_encoded(GRAY[0], "PNG"), 28, 1)
    assert png_as_it_is(_encoded(RGB[0], "PNG"), 28, 3)
    assert png_as_it_is(_with_chunk(_encoded(GRAY[0], "PNG"), b"gAMA", bytes(4)), 28, 1)
    interlaced = _encoded(GRAY[0], "PNG")
    for data, size, channels in [
            (_encoded(GRAY[0], "PNG"), 32, 1), (_encoded(GRAY[0], "PNG"), 28, 3),
            (_encoded(RGB[0], "PNG"), 28, 1), (_encoded(RGB[0], "PNG", mode="RGBA"), 28, 3),
            (_encoded(RGB[0], "PNG", mode="P"), 28, 3),
            (_encoded(GRAY[0].astype(np.uint16) * 257, "PNG", mode="I;16"), 28, 1),
            (_encoded(GRAY[0], "PNG", transparency=0), 28, 1),
            (_encoded(GRAY[0], "PNG", exif_orientation=3), 28, 1),
            (_encoded(RGB[0], "JPEG"), 28, 3), (b"\x89PNG", 28, 1),
            (interlaced[:28] + b"\x01" + interlaced[29:], 28, 1)]:  # Adam7
        assert not png_as_it_is(data, size, channels)


def test_a_broken_png_is_named_by_its_row():
    good = _encoded(GRAY[0], "PNG")
    broken = good[:40] + bytes(len(good) - 52) + good[-12:]  # its compressed data zeroed
    with pytest.raises(InputError, match="row 1 of column 'image': cannot decode"):
        list(input_batches(pd.DataFrame({"image": [good, broken]}), 28, 1))


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

    from training.promotion import parameters_of

    student, teacher = torch.nn.Linear(4, 2), torch.nn.Linear(8, 2)
    served = SimpleNamespace(program=student, fallback=teacher, again=student,
                             teacher=lambda x: teacher(x))
    assert parameters_of(served) == (4 * 2 + 2) + (8 * 2 + 2)


@pytest.mark.parametrize("batch", [1, 64])
def test_a_served_program_runs_without_input_checks_to_the_same_numbers(tmp_path, batch):
    """`load_program` drops the checks `torch.export` runs on every call (the served model's
    input is checked before, `input_batches`); the outputs are the checked program's."""
    from models import build_model
    from serving.classifier import load_program
    from training.features import export_program

    torch.manual_seed(0)
    path = tmp_path / "lenet.pt2"
    export_program(build_model("lenet", 1, 10, None), 1, 28, path)
    served, checked = load_program(str(path)), torch.export.load(str(path)).module()
    assert not hasattr(served, "_guards_fn") and hasattr(checked, "_guards_fn")
    images = torch.randn(batch, 1, 28, 28)
    with torch.no_grad():
        for got, want in zip(served(images), checked(images), strict=True):
            torch.testing.assert_close(got, want)
