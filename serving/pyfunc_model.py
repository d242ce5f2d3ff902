"""The pyfunc model definition that MLflow stores as code (models-from-code) for every
registered model: MLflow runs this file when it loads the model, and `set_model` names the
instance to serve (`serving.entry.ServedModel`, which builds the kind its config names)."""

import mlflow.models

from serving.entry import ServedModel

mlflow.models.set_model(ServedModel())
