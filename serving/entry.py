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

CONFIG_KEY = "serving"
KINDS = {"classifier": "serving.classifier:ImageClassifierModel",
         "cascade": "serving.cascade:CascadeModel",
         "canvas": "serving.canvas:CanvasModel",
         "fallback": "serving.fallback:FallbackModel",
         "image_text": "serving.image_text:ImageTextModel"}


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
