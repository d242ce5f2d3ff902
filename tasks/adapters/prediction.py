"""Inference with any registered model: image files in, labels and confidences out."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from pydantic import Field, field_validator

from serving.image_text import ZERO_SHOT_PARAM
from tasks.adapters import tracking
from tasks.configs.sections import Project, StrictConfig, model_name_of, project_field
from training.datasets import DataError, readable_images


class ModelVersionSection(StrictConfig):
    """Which registered model version: a name, and an alias or a version number."""

    model_name: str | None = Field(None, min_length=1, description="the registered model's "
                                   "name, as the MLflow UI shows it (PROJECT-NAME with "
                                   "--project); none: what `make run` registers, "
                                   "PROJECT-pipeline (compactml-pipeline)")
    alias: str | None = Field("champion", description="the version's alias; ignored when "
                              "--version is given")
    version: int | None = Field(None, ge=1, description="a version number; none: the alias")
    project: Project = project_field()

    def model_uri(self) -> str:
        """`models:/name/version` or `models:/name@alias` (`model_name_of`)."""
        name = model_name_of(self.project, self.model_name, "pipeline")
        if self.version is not None:
            return f"models:/{name}/{self.version}"
        if not self.alias:
            raise ValueError("give --version or --alias")
        return f"models:/{name}@{self.alias}"


class PredictConfig(ModelVersionSection):
    """Which images, and which registered model version."""

    images: str = Field(description="an image file, or a folder searched recursively")
    skip_bad_images: bool = Field(False, description="skip unreadable images instead of "
                                  "stopping with an error")
    classes: str | None = Field(None, description="classify zero-shot among these class "
                                "descriptions instead (an image_text model): texts separated "
                                "by ';', or a text file with one per line; the label is the "
                                "description")

    @field_validator("images")
    @classmethod
    def _exists(cls, value: str) -> str:
        return existing_path(value)

    def class_texts(self) -> str | None:
        """`classes` as texts separated by ';' (a file's lines joined)."""
        if self.classes is None:
            return None
        path = Path(self.classes).expanduser()
        if ";" not in self.classes and path.is_file():
            return ";".join(path.read_text().splitlines())
        return self.classes


def existing_path(value: str) -> str:
    """`value` if it names an existing file or folder, else a ValueError naming it."""
    if not Path(value).expanduser().exists():
        raise ValueError(f"no such image file or folder: {value}")
    return value


def predict_images(config: PredictConfig) -> tuple[pd.DataFrame, list[Path]]:
    """A table of `path`, `label`, `confidence` per image, and the skipped files."""
    kept, blobs, skipped = readable_images(config.images, config.skip_bad_images)
    model = tracking.load_pyfunc(config.model_uri())
    classes = config.class_texts()
    if classes is None:
        out = model.predict(pd.DataFrame({"image": blobs}))
    else:
        schema = model.metadata.get_params_schema()
        if schema is None or ZERO_SHOT_PARAM not in {p.name for p in schema.params}:
            raise DataError(f"{config.model_uri()} cannot classify zero-shot: --classes needs "
                            "a model of the image_text flow")
        try:
            out = model.predict(pd.DataFrame({"image": blobs}),
                                params={ZERO_SHOT_PARAM: classes})
        except ValueError as error:
            raise DataError(str(error)) from None
    out.insert(0, "path", [str(p) for p in kept])
    return out, skipped
