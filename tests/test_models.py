"""Every registered network: forward, backward, a gradient for every parameter, no NaN."""

import pytest
import torch

import models
from models.registry import register_model
from training.features import FeatureHooks


@pytest.mark.parametrize("name", models.list_models())
@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 20)])
def test_forward_backward_every_parameter_gets_a_gradient(name, channels, size):
    torch.manual_seed(0)
    model = models.build_model(name, in_channels=channels, num_classes=7, width=4)
    x = torch.randn(3, channels, size, size)
    logits = model(x)
    assert logits.shape == (3, 7)
    assert torch.isfinite(logits).all()
    logits.logsumexp(1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", models.list_models())
def test_feature_layers_are_hookable_and_last_is_the_embedding(name):
    model = models.build_model(name, in_channels=1, num_classes=10, width=4).eval()
    with FeatureHooks(model, model.feature_layers) as feats:
        model(torch.randn(2, 1, 28, 28))
    assert list(feats.outputs) == list(model.feature_layers)
    embedding = feats[model.feature_layers[-1]]
    assert embedding.shape == (2, model.fc.in_features)


def test_teacher_family_is_deeper_than_student_family():
    depth = {n: models.build_model(n, 1, 10).depth for n in models.list_models()}
    assert depth["resnet18"] == 18 and depth["resnet20"] == 20 and depth["resnet8"] == 8
    assert depth["cnn3"] == 4  # three convolutions and the classifier
    assert max(depth[n] for n in depth if n.startswith("cnn")) < depth["resnet8"]


def test_the_lenet_student_and_the_resnet20_teacher_have_their_reference_sizes():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(models.build_model("lenet", 1, 10)) == 20_490  # 160 + 4,640 + 15,690
    assert models.build_model("lenet", 1, 10).depth == 3
    assert 270_000 < count(models.build_model("resnet20", 1, 10)) < 275_000  # CIFAR ResNet-20
    tiny = models.build_model("lenet", 3, 4)(torch.zeros(2, 3, 8, 8))  # any size: a 7x7 grid
    assert tiny.shape == (2, 4)


def test_width_scales_channels():
    narrow = models.build_model("resnet20", 1, 10, width=8)
    wide = models.build_model("resnet20", 1, 10, width=16)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert 3.5 < count(wide) / count(narrow) < 4.1  # conv weights grow with width squared


def test_registry_rejects_duplicates_and_names_valid_models():
    with pytest.raises(ValueError, match="already registered"):
        register_model("cnn3", family="cnn", default_width=8)(lambda c, k, w: None)
    with pytest.raises(KeyError, match="resnet18"):
        models.build_model("vgg11", 1, 10)
    with pytest.raises(KeyError, match="no layer"):
        FeatureHooks(models.build_model("cnn3", 1, 10), ["nope"])


@pytest.mark.parametrize("name", models.list_models())
def test_small_inputs_are_upsampled_inside_the_network_to_its_input_floor(name):
    model = models.build_model(name, in_channels=1, num_classes=10, width=4).eval()
    small = torch.rand(2, 1, 8, 12)
    with FeatureHooks(model, model.feature_layers[:1]) as feats:
        logits = model(small)
    first = feats[model.feature_layers[0]]
    assert min(first.shape[-2:]) >= model.min_input_size // 2  # not pooled down to 2 pixels
    upsampled = torch.nn.functional.interpolate(small, size=(28, 28), mode="bilinear")
    torch.testing.assert_close(logits, model(upsampled))
    big = torch.rand(2, 1, 32, 32)  # at or above the floor nothing is resized
    assert model.fit_input(big) is big



@pytest.mark.parametrize("name", models.list_models())
def test_every_network_serves_in_the_fast_layout_with_the_plain_layouts_numbers(name, tmp_path):
    """Served programs run in channels_last on the CPU (`fast_layout`, `bench.layout`: faster);
    every registered network's exported program, loaded as serving loads it, is in that
    layout and answers as the plain network does, to float rounding."""
    from serving.classifier import load_program
    from training.features import export_program

    torch.manual_seed(0)
    plain = models.build_model(name, in_channels=1, num_classes=7, width=4).eval()
    export_program(plain, 1, 28, tmp_path / "program.pt2")
    served = load_program(str(tmp_path / "program.pt2"))
    convolution = next(p for p in served.parameters() if p.dim() == 4 and p.shape[1] > 1)
    assert convolution.is_contiguous(memory_format=torch.channels_last)
    assert not convolution.is_contiguous()  # really the other layout
    for batch in (1, 64):
        x = torch.randn(batch, 1, 28, 28)
        with torch.no_grad():
            torch.testing.assert_close(served(x)[0], plain(x), rtol=1e-4, atol=1e-5)
