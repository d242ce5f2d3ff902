"""The detector: torchvision's SSDlite (MobileNetV3-Large backbone), untrained.

Built with `weights=None, weights_backbone=None` (its default would download ImageNet weights,
which this project never fetches) and its input transform fixed to the canvas size instead of
320 (the anchors follow the feature maps, so nothing else changes; a 128-pixel canvas costs
about a sixth of 320). It takes 3-channel images in [0, 1]; gray canvases are repeated.
"""

from __future__ import annotations

from torchvision.models.detection import ssdlite320_mobilenet_v3_large
from torchvision.models.detection.ssd import SSD
from torchvision.models.detection.transform import GeneralizedRCNNTransform

SSDLITE = "ssdlite320_mobilenet_v3_large"
# post-ReLU expansion maps of MobileNetV3's blocks 2, 4 and 6 (strides 2, 4 and 8)
SSDLITE_SPARSE_LAYERS = ("backbone.features.0.2.block.0", "backbone.features.0.4.block.0",
                         "backbone.features.0.6.block.0")


def build_ssdlite(num_classes: int, canvas: int) -> SSD:
    """SSDlite for `num_classes` object classes (+ the background, label 0), taking
    `canvas`-pixel square images."""
    model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                          num_classes=num_classes + 1)
    model.transform = GeneralizedRCNNTransform(canvas, canvas, [0.5] * 3, [0.5] * 3,
                                               size_divisible=1, fixed_size=(canvas, canvas))
    return model
