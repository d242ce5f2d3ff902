"""Networks only (nn.Module): the registry and the families registered in it."""

from models import cnn, resnet  # noqa: F401  (registers the families)
from models.registry import (
    ImageClassifier,
    ModelEntry,
    build_model,
    list_models,
    model_entry,
    register_model,
)

__all__ = [
    "ImageClassifier",
    "ModelEntry",
    "build_model",
    "list_models",
    "model_entry",
    "register_model",
]
