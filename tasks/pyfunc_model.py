"""The pyfunc model definition that MLflow stores as code (models-from-code).

MLflow runs this file when it loads the model; `set_model` names the instance to serve.
"""

import mlflow.models

from tasks.serving import ImageClassifierModel

mlflow.models.set_model(ImageClassifierModel())
