"""The one pyfunc every registered model is: it builds the kind its `model_config` names.

`model_config={"serving": KIND}` is stored in the model's MLmodel file when it is logged
(`tasks.adapters.registration.log_served_model`); loading builds that kind's class and hands it the
context, then every `predict` goes to it. `implementation` is the built model (its `embed`,
its network).
"""

from __future__ import annotations

import importlib

import mlflow.pyfunc
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types.schema import Array, ColSpec, DataType, Schema

CONFIG_KEY = "serving"
KINDS = {"classifier": "serving.classifier:ImageClassifierModel",
         "cascade": "serving.cascade:CascadeModel",
         "canvas": "serving.canvas:CanvasModel",
         "fallback": "serving.fallback:FallbackModel",
         "image_text": "serving.image_text:ImageTextModel"}


# What every kind takes (`serving.inputs`), stated in the model's metadata: MLflow's
# signature holds one input schema, and a column schema would refuse the array input.
INPUT = ("a DataFrame with a column 'image' of encoded image bytes (PNG, JPEG, ...) or their "
         "base64 text, or a uint8 array N x H x W (gray) or N x H x W x C")
_LABELLED = {"label": DataType.string, "confidence": DataType.double}
# What each kind returns, one row per image (its signature's outputs).
OUTPUTS = {
    "classifier": _LABELLED,
    "image_text": _LABELLED,
    "cascade": _LABELLED | {"exit": DataType.long, "subnetworks": DataType.string},
    "fallback": _LABELLED | {"exit": DataType.long},
    "canvas:detection": {"boxes": Array(Array(DataType.double)),
                         "labels": Array(DataType.string), "scores": Array(DataType.double)},
    "canvas:contour": {"boundary": Array(Array(DataType.long)),
                       "mask": Array(Array(DataType.long))},
}


def output_schema(kind: str, task: str | None = None) -> Schema:
    """The columns `kind` (a canvas model: of its `task`) returns, as MLflow's schema."""
    columns = OUTPUTS[f"{kind}:{task}" if kind == "canvas" else kind]
    return Schema([ColSpec(type_, name) for name, type_ in columns.items()])


def model_class(kind: str) -> type[mlflow.pyfunc.PythonModel]:
    """The serving class of `kind` (a key of KINDS).

    Raises:
        MlflowException: an unknown kind, named with the known ones.
    """
    if kind not in KINDS:
        raise MlflowException(f"model_config {CONFIG_KEY!r} is {kind!r}; this runtime serves "
                              f"{', '.join(KINDS)}", error_code=INVALID_PARAMETER_VALUE)
    module, name = KINDS[kind].split(":")
    return getattr(importlib.import_module(module), name)


class ServedModel(mlflow.pyfunc.PythonModel):
    """The kind of model named in the context's `model_config` (module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        kind = (context.model_config or {}).get(CONFIG_KEY)
        self.implementation = model_class(kind)()
        self.implementation.load_context(context)

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        return self.implementation.predict(context, model_input, params)
