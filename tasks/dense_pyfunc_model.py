"""The pyfunc model definition of detection and contour models (MLflow models-from-code)."""

import mlflow.models

from tasks.dense_serving import DenseModel

mlflow.models.set_model(DenseModel())
