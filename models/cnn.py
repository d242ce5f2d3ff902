"""The student family: plain convolutional networks, conv-BN-ReLU blocks with max-pooling.

`cnn{N}` has N blocks of widths `width * 2**i` (pooling after every block but the last), then
global average pooling and a linear classifier: 24k parameters at N=3, width 16.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.ops import Conv2dNormActivation

from models.registry import ImageClassifier, register_model


class PlainCNN(ImageClassifier):
    """`blocks` conv-BN-ReLU blocks; features `block1`..`blockN` and `pool` (the embedding)."""

    def __init__(self, blocks: int, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        channels = in_channels
        names = []
        for index in range(blocks):
            out = width * 2**index
            layers: list[nn.Module] = [Conv2dNormActivation(channels, out, kernel_size=3)]
            if index < blocks - 1:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            name = f"block{index + 1}"
            self.add_module(name, nn.Sequential(*layers))
            names.append(name)
            channels = out
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)
        self.block_names = tuple(names)
        self.feature_layers = (*names, "pool")

    def forward(self, x: Tensor) -> Tensor:
        x = self.fit_input(x)
        for name in self.block_names:
            x = getattr(self, name)(x)
        return self.fc(self.pool(x))


def _plain_cnn(blocks: int):
    def build(in_channels: int, num_classes: int, width: int) -> PlainCNN:
        return PlainCNN(blocks, in_channels, num_classes, width)

    return build


register_model("cnn2", family="cnn", default_width=16)(_plain_cnn(2))
register_model("cnn3", family="cnn", default_width=16)(_plain_cnn(3))
register_model("cnn4", family="cnn", default_width=16)(_plain_cnn(4))


class LeNetStyle(ImageClassifier):
    """Two conv-ReLU-max-pool blocks (3x3 convolutions of `width` and `2 * width` channels, no
    BatchNorm) and a linear classifier on the flattened map, pooled to 7 x 7 (the map of a
    28-pixel image; other sizes are pooled to the same grid).

    At width 16 on 28-pixel gray images it has 20,490 parameters: 160 + 4,640 in the
    convolutions and 15,690 in the classifier on 32 x 7 x 7 values. Features `block1`,
    `block2` and `pool` (the flattened map, the embedding).
    """

    GRID = 7

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1),
                                    nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True))
        self.block2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1),
                                    nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True))
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(self.GRID), nn.Flatten())
        self.fc = nn.Linear(2 * width * self.GRID**2, num_classes)
        self.feature_layers = ("block1", "block2", "pool")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.block2(self.block1(self.fit_input(x)))))


@register_model("lenet", family="lenet", default_width=16)
def lenet(in_channels: int, num_classes: int, width: int) -> LeNetStyle:
    """The LeNet-style student: conv-pool, conv-pool, linear (see `LeNetStyle`)."""
    return LeNetStyle(in_channels, num_classes, width)
