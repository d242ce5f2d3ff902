"""Raw images to model input: one conversion for training data and for the served model.

Training (ImageFolder) and inference (the registered pyfunc) both go through `image_to_array`,
so a served model sees exactly the pixels it was trained on.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor
from torchvision.io import ImageReadMode, decode_png

GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})


WIDE_GRAY_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "F"})


def to_8bit(image: Image.Image) -> Image.Image:
    """16-bit, 32-bit and float grayscale scaled to 0..255 (PIL's convert would clip them)."""
    if image.mode not in WIDE_GRAY_MODES:
        return image
    array = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") else max(float(array.max()), 255.0)
    return Image.fromarray(np.clip(array * (255.0 / top), 0, 255).round().astype(np.uint8), "L")


EXIF_ORIENTATION = 0x0112


def image_to_array(image: Image.Image, size: int, channels: int) -> np.ndarray:
    """A PIL image as uint8 (channels, size, size).

    Turned upright by its EXIF orientation, wide grayscale scaled to 8 bits, converted to L or
    RGB, resized bilinearly. An image already upright, in the mode and at the size asked for
    is read as it is (the same pixels, without the copies each step would make).
    """
    mode = "L" if channels == 1 else "RGB"
    if (image.mode == mode and image.size == (size, size)
            and image.getexif().get(EXIF_ORIENTATION, 1) == 1):
        array = np.asarray(image, dtype=np.uint8)
        return array[None] if channels == 1 else array.transpose(2, 0, 1)
    converted = to_8bit(ImageOps.exif_transpose(image)).convert("L" if channels == 1 else "RGB")
    if converted.size != (size, size):
        converted = converted.resize((size, size), Image.Resampling.BILINEAR)
    array = np.asarray(converted, dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG colour types read as they are: 8-bit gray (0) as L, 8-bit truecolour (2) as RGB
PLAIN_PNG = {1: 0, 3: 2}


def png_as_it_is(data: bytes, size: int, channels: int) -> bool:
    """Whether `data` is a PNG that `image_to_array` reads as it is: 8 bits, gray for 1
    channel or RGB for 3, `size` x `size`, not interlaced, no transparency chunk (tRNS: Pillow
    keeps it aside, libpng would add an alpha channel) and no EXIF (which may turn the image).
    Reads the header and searches the bytes for the two chunk names (a chance match inside the
    compressed data only sends the image the long way). Colour chunks (gAMA, sBIT, cHRM, sRGB)
    change neither decoder's pixels."""
    if len(data) < 33 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        return False
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    return (width == height == size and depth == 8 and colour == PLAIN_PNG.get(channels)
            and interlace == 0 and b"tRNS" not in data and b"eXIf" not in data)


def encoded_to_array(data: bytes, size: int, channels: int) -> Tensor:
    """Encoded image bytes as uint8 (channels, size, size), the pixels of
    `image_to_array(decode_image(data), ...)`. A PNG that is read as it is (`png_as_it_is`:
    what a client sends to a model of its own size) is decoded by libpng straight into a
    tensor (torchvision's `decode_png`: 0.5x Pillow's time for a 28-pixel gray PNG, no image
    object); anything else, or a PNG that libpng refuses, goes through Pillow. Raises
    ValueError as `decode_image`."""
    if png_as_it_is(data, size, channels):
        try:
            return decode_png(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                              ImageReadMode.UNCHANGED)
        except RuntimeError:  # a broken stream: Pillow says what is wrong with it
            pass
    return torch.from_numpy(np.ascontiguousarray(image_to_array(decode_image(data), size,
                                                                channels)))


def decode_image(data: bytes) -> Image.Image:
    """Decodes encoded image bytes (PNG, JPEG, anything Pillow reads); raises ValueError."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as error:  # Pillow raises several unrelated types for bad bytes
        raise ValueError(f"cannot decode image bytes ({len(data)} bytes): {error}") from None
    return image


def array_to_image(array: np.ndarray) -> Image.Image:
    """A uint8 H x W, H x W x 1 or H x W x 3 array as a PIL image."""
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(array, mode="L")
    if array.ndim == 3 and array.shape[2] in (3, 4):
        return Image.fromarray(array[:, :, :3], mode="RGB")
    raise ValueError(f"expected an image of shape HxW or HxWxC (C in 1, 3, 4), got {array.shape}")


def images_to_batch(images: Sequence[Image.Image], size: int, channels: int) -> Tensor:
    """PIL images as one uint8 tensor (N, channels, size, size) in the plain layout (numpy
    stacks transposed RGB arrays channels-last, which sends convolutions down another path)."""
    return torch.from_numpy(np.stack([image_to_array(im, size, channels) for im in images])
                            ).contiguous()
