"""The pyfunc model definition of cascades (MLflow models-from-code)."""

import mlflow.models

from tasks.cascade_serving import CascadeModel

mlflow.models.set_model(CascadeModel())
