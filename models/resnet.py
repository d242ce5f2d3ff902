"""The teacher family: ResNets adapted to small inputs, built from torchvision's BasicBlock.

Small-input adaptation as in the CIFAR ResNets (He et al., 2016): a 3x3 stride-1 stem and no
max-pool, so a 28x28 image keeps a 7x7 map in the last stage of a 3-stage network.
`resnet{8,14,20}` are the 3-stage 6n+2 networks; `resnet18` has 4 stages of 2 blocks each.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

from models.registry import ImageClassifier, register_model


class SmallInputResNet(ImageClassifier):
    """A ResNet whose stage `i` has `blocks[i]` BasicBlocks of `width * 2**i` channels.

    Features: `stem`, `stage1`..`stageK` and `pool` (the embedding).
    """

    def __init__(self, blocks: list[int], in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        channels = width
        names = []
        for index, count in enumerate(blocks):
            out = width * 2**index
            stride = 1 if index == 0 else 2
            layers = []
            for block in range(count):
                downsample = None
                if block == 0 and (stride != 1 or channels != out):
                    downsample = nn.Sequential(
                        nn.Conv2d(channels, out, 1, stride=stride, bias=False),
                        nn.BatchNorm2d(out),
                    )
                layers.append(BasicBlock(channels, out, stride if block == 0 else 1, downsample))
                channels = out
            name = f"stage{index + 1}"
            self.add_module(name, nn.Sequential(*layers))
            names.append(name)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)
        self.stage_names = tuple(names)
        self.feature_layers = ("stem", *names, "pool")
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(self.fit_input(x))
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return self.fc(self.pool(x))


def _cifar_resnet(n: int):
    def build(in_channels: int, num_classes: int, width: int) -> SmallInputResNet:
        return SmallInputResNet([n, n, n], in_channels, num_classes, width)

    return build


register_model("resnet8", family="resnet", default_width=16)(_cifar_resnet(1))
register_model("resnet14", family="resnet", default_width=16)(_cifar_resnet(2))
register_model("resnet20", family="resnet", default_width=16)(_cifar_resnet(3))


@register_model("resnet18", family="resnet", default_width=8)
def resnet18(in_channels: int, num_classes: int, width: int) -> SmallInputResNet:
    """ResNet-18's 4x2 blocks on a small-input stem; width 64 is the original's channel count."""
    return SmallInputResNet([2, 2, 2, 2], in_channels, num_classes, width)
