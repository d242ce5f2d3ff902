"""The pyfunc model definition of image-text models (MLflow models-from-code)."""

import mlflow.models

from tasks.image_text_serving import ImageTextModel

mlflow.models.set_model(ImageTextModel())
