"""The `pipeline` flow's pyfunc as code (models-from-code): the fallback cascade
(`tasks.fallback_serving`)."""

import mlflow.models

from tasks.fallback_serving import FallbackModel

mlflow.models.set_model(FallbackModel())
