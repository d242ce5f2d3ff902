"""Data: Fashion-MNIST from disk, ImageFolder reading and its errors, deterministic splits."""

import io

import pytest
import torch
from PIL import Image

from tasks.data import fashion_mnist_root
from training.datasets import (
    DataError,
    channel_stats,
    limit,
    load_fashion_mnist,
    load_image_folder,
)
from training.preprocess import image_to_array


def test_fashion_mnist_is_the_real_data_set():
    train = load_fashion_mnist(fashion_mnist_root(), train=True)
    test = load_fashion_mnist(fashion_mnist_root(), train=False)
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.classes[0] == "T-shirt/top" and len(train.classes) == 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10


def test_image_folder_mixed_formats_sizes_and_modes(fashion_folder):
    gray = load_image_folder(fashion_folder, image_size=28)
    assert gray.images.shape == (120, 3, 28, 28)  # some images are RGB: auto picks 3 channels
    assert gray.classes == sorted(p.name for p in fashion_folder.iterdir())
    assert torch.bincount(gray.labels).tolist() == [40, 40, 40]
    forced = load_image_folder(fashion_folder, image_size=16, channels=1)
    assert forced.images.shape == (120, 1, 16, 16) and forced.images.dtype == torch.uint8


def _folder(tmp_path, counts):
    for name, count in counts.items():
        (tmp_path / name).mkdir()
        for i in range(count):
            Image.new("L", (8, 8), color=i * 10).save(tmp_path / name / f"{i}.png")
    return tmp_path


def test_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    root = _folder(tmp_path, {"a": 3, "b": 3})
    bad = root / "b" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="broken.png"):
        load_image_folder(root, image_size=8)
    loaded = load_image_folder(root, image_size=8, skip_bad_images=True)
    assert loaded.skipped == [str(bad)] and len(loaded.labels) == 6


def test_empty_class_folder_and_missing_path_are_named(tmp_path):
    root = _folder(tmp_path, {"a": 2, "b": 0})
    with pytest.raises(DataError, match=r"class folder .*b has no images"):
        load_image_folder(root, image_size=8)
    with pytest.raises(DataError, match="does not exist"):
        load_image_folder(tmp_path / "nope", image_size=8)


def test_limit_and_channel_stats():
    idx = torch.arange(50)
    assert torch.equal(limit(idx, None, 0), idx)
    sub = limit(idx, 10, 0)
    assert len(sub) == 10 and torch.equal(sub, limit(idx, 10, 0))
    images = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1)
    mean, std = channel_stats(images)
    assert mean == pytest.approx([0.5]) and std == pytest.approx([0.70710678])


def test_wide_grayscale_is_scaled_not_clipped():
    wide = Image.new("I;16", (3, 1))
    for x, value in enumerate((0, 1000, 65535)):
        wide.putpixel((x, 0), value)
    assert image_to_array(wide, 3, 1)[0, 0, :].tolist() == [0, 4, 255]  # 1000/65535*255 = 3.9


def test_exif_orientation_is_applied():
    image = Image.new("L", (4, 8), 0)
    image.paste(255, (0, 0, 4, 1))  # a white top row, stored upside down
    exif = Image.Exif()
    exif[0x0112] = 3  # orientation tag: rotate 180 degrees to show it upright
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif.tobytes())
    upright = image_to_array(Image.open(io.BytesIO(buffer.getvalue())), 8, 1)[0]
    assert upright[-1].mean() > upright[0].mean()
