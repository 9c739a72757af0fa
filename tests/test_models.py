"""Model zoo: shapes, parameter counts, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distsgd.models import build_model, num_parameters

SHAPES = [(1, 28, 28), (3, 32, 32)]
NAMES = ["mlp", "cnn", "lenet", "resnet20"]


@pytest.mark.parametrize("shape", SHAPES, ids=["1x28x28", "3x32x32"])
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_and_gradients(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes=7)
    x = torch.randn(4, *shape)
    logits = model(x)
    assert logits.shape == (4, 7) and logits.dtype == torch.float32
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 6])).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_cnn_parameter_count() -> None:
    model = build_model("cnn", (1, 28, 28), 10)
    # conv 1→32 3×3: 320; conv 32→64 3×3: 18,496; fc 3136→128: 401,536; fc 128→10: 1,290.
    assert num_parameters(model) == 421_642
    assert 400_000 <= num_parameters(model) <= 440_000


def test_mlp_parameter_count() -> None:
    model = build_model("mlp", (1, 28, 28), 10)
    assert num_parameters(model) == (784 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)


def test_flatten_size_follows_input_shape() -> None:
    # 64 channels × 8 × 8 after two poolings of 32×32 (not the 7 × 7 of 28×28).
    model = build_model("cnn", (3, 32, 32), 10)
    fc = [m for m in model.modules() if isinstance(m, nn.Linear)][0]
    assert fc.in_features == 64 * 8 * 8
    lenet = build_model("lenet", (1, 20, 24), 10)
    assert lenet(torch.zeros(2, 1, 20, 24)).shape == (2, 10)


def test_resnet20_option_a() -> None:
    model = build_model("resnet20", (3, 32, 32), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # 1 stem conv + 3 stages × 3 blocks × 2 convs, all 3×3: option-A shortcuts add no conv.
    assert len(convs) == 19 and all(c.kernel_size == (3, 3) for c in convs)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 1
    # He et al. 2016, Table 6: 0.27M parameters.
    assert 260_000 <= num_parameters(model) <= 280_000


def test_lenet_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    x = torch.randn(2, 1, 28, 28)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_same_seed_same_initialisation() -> None:
    torch.manual_seed(1)
    a = build_model("cnn", (1, 28, 28), 10)
    torch.manual_seed(1)
    b = build_model("cnn", (1, 28, 28), 10)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="model.name = 'vgg16'") as info:
        build_model("vgg16", (1, 28, 28), 10)
    assert "'resnet20'" in str(info.value)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("cnn", (1, 28)), ("mlp", (0, 28, 28)), ("mlp", (1, 28.0, 28)), ("mlp", ())],
)
def test_bad_input_shape(name: str, shape: tuple) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        build_model(name, shape, 10)


def test_mlp_takes_features_of_any_shape() -> None:
    assert build_model("mlp", (12,), 3)(torch.zeros(5, 12)).shape == (5, 3)


def test_too_small_images_and_bad_classes() -> None:
    with pytest.raises(ValueError, match="at least 4×4"):
        build_model("cnn", (1, 3, 28), 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (1, 28, 28), 0)


@pytest.mark.parametrize("name", ["cnn", "lenet"])
def test_pool_before_relu_is_the_textbook_order_bit_for_bit(name: str) -> None:
    """cnn and lenet max-pool before their ReLU (faster); the outputs and gradients equal
    those of the textbook order (ReLU, then max-pool) exactly: both orders select the same
    values and route the gradient to the same elements. Inputs include windows whose
    maximum is negative or exactly zero, where the two orders differ in which argmax they
    pick."""
    torch.manual_seed(0)
    model = build_model(name, (1, 12, 12), num_classes=5).eval()  # eval: no dropout
    f = model.features
    assert isinstance(f[1], nn.MaxPool2d) and isinstance(f[2], nn.ReLU)
    textbook = nn.Sequential(f[0], f[2], f[1], f[3], f[5], f[4])
    x = torch.randn(6, 1, 12, 12)
    x[0] = -1.0  # constant images: whole channels of equal, often negative, values
    x[1] = 0.0
    grads = []
    for features in (f, textbook):
        model.zero_grad(set_to_none=True)
        out = model.classifier(features(x))
        F.cross_entropy(out, torch.arange(6) % 5).backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_a, g_a), (out_b, g_b) = grads
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b, strict=True))
