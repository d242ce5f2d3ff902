"""The contour network: a small U-Net that predicts, per pixel, an object's boundary and its
mask (two logit maps, the input's size).

Encoder `enc1` .. `enc3` (conv-BN-ReLU pairs of `width`, 2x and 4x channels, max-pooling
between), decoder `dec2`, `dec1` (upsampling, the encoder map of the same size concatenated,
conv-BN-ReLU pairs), a 1x1 head. At width 8 (the default): 30k parameters; at 16: 118k. The
named blocks are the feature maps a sparsity term reads (all end in ReLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import Conv2dNormActivation

OUTPUTS = ("boundary", "mask")


def _pair(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(Conv2dNormActivation(inputs, outputs, 3),
                         Conv2dNormActivation(outputs, outputs, 3))


class ContourNet(nn.Module):
    """Images (N x C x H x W, H and W multiples of 4) to logits N x 2 x H x W (see module)."""

    feature_layers = ("enc1", "enc2", "enc3", "dec2", "dec1")
    DEFAULT_WIDTH = 8

    def __init__(self, in_channels: int = 1, width: int = DEFAULT_WIDTH) -> None:
        super().__init__()
        self.enc1 = _pair(in_channels, width)
        self.enc2 = _pair(width, 2 * width)
        self.enc3 = _pair(2 * width, 4 * width)
        self.dec2 = _pair(4 * width + 2 * width, 2 * width)
        self.dec1 = _pair(2 * width + width, width)
        self.head = nn.Conv2d(width, len(OUTPUTS), 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(e3, size=e2.shape[-2:]), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, size=e1.shape[-2:]), e1], 1))
        return self.head(d1)
