"""The two data sets a technique's own idea is measured on against its simpler version, and
the images no choice read that each reports on.

- `fashion-mnist`: the flow's default data (the `quick` profile's training images); reported
  on its official test images and on the `unread` report images (`bench.report_set`: 10,000
  training-file images no choice of the project ever read).
- `2500x16`: `bench.small_data`'s report set, 2,500 Fashion-MNIST images (250 per class) at 16
  pixels as an ImageFolder, as a user's own images come; never tuned on, drawn apart from
  every tuning set. Each seed has its own split (`split_seed` = seed). Reported on its test
  split (500 images) and on its unread holdout (10,000 other training-file images at 16
  pixels, `bench.small_data.Holdout`).
"""

from __future__ import annotations

from bench.report_set import REPORT_IMAGES, ReportSet
from bench.sets import image_folder, set_positions
from bench.small_data import Holdout
from tasks.configs.sections import DataSection

SETS = ("fashion-mnist", "2500x16")


def small_data_fields(name: str, seed: int) -> dict:
    """The config fields of data set `name` on `seed` (none for Fashion-MNIST; an ImageFolder:
    its folder, its size and the seed's own split)."""
    if name not in SETS:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(SETS)}")
    if name == "fashion-mnist":
        return {}
    images, size = (int(part) for part in name.split("x"))
    return {"data": str(image_folder(images, size)), "image_size": size, "split_seed": seed}


class DataSet:
    """One data set of a comparison: its config fields per seed and its unread images
    (`score(model_uri)`: the served model's accuracy there). `default`: the data section of
    the flow's config on Fashion-MNIST (its report images depend on the training images it
    takes); `smoke`: 500 report images instead of 10,000."""

    def __init__(self, name: str, default: DataSection, smoke: bool = False):
        self.name = name
        small_data_fields(name, 0)  # an unknown name fails here
        if name == "fashion-mnist":
            report = ReportSet(default, 500 if smoke else REPORT_IMAGES)
            self.score = report.served_accuracy
        else:
            size = int(name.split("x")[1])
            self.score = Holdout(size, "unread", set_positions(name)).model_accuracy

    def config(self, seed: int) -> dict:
        """The fields of a run on `seed` (an ImageFolder: the seed's own split)."""
        return {**small_data_fields(self.name, seed), "seed": seed}
