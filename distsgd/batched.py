"""k model replicas as one batched forward/backward ("several learners per device").

Crossbow trains k replicas of a model on one device at once, each on its own small
minibatch (Koliousis et al., VLDB 2019, arXiv:1901.02244, §3–4; docs/protocols.md §4). On a CPU
the gain comes from replacing k small computations by one larger one. This module holds
the batched forms of the zoo's models; :meth:`distsgd.engine.GradientEngine.replica_gradients`
picks one by :func:`choose_path`.

Paths, for replica weights ``W [k, P]`` and inputs ``x [k, b, C, H, W]``:

* ``"grouped"`` — ``cnn``: the k replicas' channels are stacked, ``[b, k·C, H, W]``
  (channels-last in memory), and every convolution is one grouped convolution
  (``groups = k``) whose group j holds replica j's filters; the fully connected layers are batched matrix products
  (``torch.baddbmm``, ``[k, b, in] @ [k, in, out]``).
* ``"bmm"`` — ``mlp``: every layer is one ``torch.baddbmm``.
* ``"vmap"`` — any model without batch-statistics layers (BatchNorm) or random layers
  (Dropout): ``torch.func.vmap`` of ``grad_and_value`` over ``functional_call``.
* ``"loop"`` — one forward/backward per replica. Used for models with BatchNorm (each
  replica's statistics are its own minibatch's, exactly as one-by-one) and with Dropout
  (each replica draws its mask from the global generator in the same order as
  one-by-one), for k = 1, and for b > 32, where the batched form was not measured (see
  :func:`choose_path` and ``BATCHED_MAX_BATCH``).

All paths compute, for each replica j, the gradient of the mean cross-entropy over its
own b samples at its own weights; they differ from the loop only in float32 summation
order (the loss is ``Σ_j mean_b ℓ``, whose gradient with respect to replica j's weights
is replica j's own gradient, since the replicas share nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from distsgd.models import CNN, MLP, LeNet, ResNet20

__all__ = ["PATHS", "choose_path", "batched_logits", "supports"]

PATHS = ("auto", "loop", "grouped", "bmm", "vmap")

# The batched path is faster than k separate learners for the cnn at k = 2…16, b = 4…32
# (docs/benchmarks.md). Above b = 32 one replica's computation is larger and may use the
# cores well on its own, so the rule keeps the one-by-one path there (not measured).
BATCHED_MAX_BATCH = 32


def _has(model: nn.Module, kinds: tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


def supports(model: nn.Module, path: str) -> bool:
    """Whether ``path`` can compute replica gradients of ``model`` (see module docstring)."""
    if path == "loop":
        return True
    if _has(model, (nn.modules.batchnorm._NormBase, nn.Dropout)):
        return False
    if path == "grouped":
        return type(model) is CNN
    if path == "bmm":
        return type(model) is MLP
    return path == "vmap"


def choose_path(model: nn.Module, k: int, b: int) -> str:
    """The path ``replica_gradients`` takes for k replicas × b samples (path ``"auto"``).

    Rule: ``loop`` for k = 1, for b > ``BATCHED_MAX_BATCH`` (32), for models with
    BatchNorm or Dropout and for models outside the built-in zoo (a user's model may hold
    layers ``vmap`` cannot batch, e.g. recurrent ones); otherwise ``grouped`` for ``cnn``, ``bmm`` for ``mlp`` and
    ``vmap`` for any other model. The rule is static (no timing at run time) so that a
    run is reproducible bit for bit. The ``grouped`` path's speed against k separate
    learners (cnn, k in 2…16, b in 4…32) is on docs/benchmarks.md; b > 32 and the ``bmm``
    / ``vmap`` paths are not measured there.
    """
    zoo = type(model) in (MLP, CNN, LeNet, ResNet20)
    if k == 1 or b > BATCHED_MAX_BATCH or not zoo or not supports(model, "vmap"):
        return "loop"
    for path in ("grouped", "bmm"):
        if supports(model, path):
            return path
    return "vmap"


def _split(weights: Tensor, model: nn.Module) -> list[Tensor]:
    """Replica-stacked parameters ``[k, *shape]`` of ``model``'s parameters, in
    ``model.parameters()`` order, as differentiable slices of ``weights [k, P]``."""
    params = [p for p in model.parameters() if p.requires_grad]
    k = weights.shape[0]
    parts = weights.split([p.numel() for p in params], dim=1)
    # views, not copies: each part's rows are contiguous, so [k, n] → [k, *shape] is a
    # view with batch stride P (the fully connected weights are most of P, and copying
    # them would cost as much as the small-batch computation itself)
    return [part.view(k, *p.shape) for part, p in zip(parts, params, strict=True)]


def _linear(h: Tensor, w: Tensor, bias: Tensor) -> Tensor:
    """``h [k, b, in]``, ``w [k, out, in]``, ``bias [k, out]`` → ``[k, b, out]``.

    Computed as ``(w @ hᵀ)ᵀ`` so that the weight gradient ``δᵀ h`` comes out of the
    backward pass as ``[k, out, in]`` in the weights' own layout (no transposing copy).
    """
    return torch.baddbmm(bias.unsqueeze(2), w, h.transpose(1, 2)).transpose(1, 2)


def _grouped_conv(h: Tensor, conv: nn.Conv2d, w: Tensor, bias: Tensor, k: int) -> Tensor:
    """``h [b, k·C_in, H, W]`` (replica-major channels), ``w [k, C_out, C_in, kh, kw]``
    → ``[b, k·C_out, H', W']``: replica j's filters see only replica j's channels."""
    return F.conv2d(
        h,
        w.reshape(k * w.shape[1], *w.shape[2:]),
        bias.reshape(-1),
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=k,
    )


def _cnn_logits(model: CNN, params: list[Tensor], x: Tensor) -> Tensor:
    k, b = x.shape[:2]
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    conv1, pool1, conv2, pool2 = (
        model.features[0],
        model.features[1],
        model.features[3],
        model.features[4],
    )
    # channels-last (NHWC) layout: the CPU's grouped convolutions and max-pooling are
    # faster on it (docs/benchmarks.md); the maths is unchanged
    h = x.transpose(0, 1).reshape(b, k * x.shape[2], *x.shape[3:])
    h = h.contiguous(memory_format=torch.channels_last)
    # max-pool before ReLU, as the module does (models.CNN)
    h = F.relu(F.max_pool2d(_grouped_conv(h, conv1, w1, b1, k), pool1.kernel_size))
    h = F.relu(F.max_pool2d(_grouped_conv(h, conv2, w2, b2, k), pool2.kernel_size))
    h = h.reshape(b, k, -1).transpose(0, 1)  # [k, b, 64·H'·W'], flattened as nn.Flatten
    return _linear(F.relu(_linear(h, w3, b3)), w4, b4)


def _mlp_logits(model: MLP, params: list[Tensor], x: Tensor) -> Tensor:
    k, b = x.shape[:2]
    h = x.reshape(k, b, -1)
    w1, b1, w2, b2, w3, b3 = params
    h = F.relu(_linear(h, w1, b1))
    h = F.relu(_linear(h, w2, b2))
    return _linear(h, w3, b3)


def batched_logits(model: nn.Module, weights: Tensor, x: Tensor, path: str) -> Tensor:
    """Logits of k replicas, each on its own inputs: ``[k, b, num_classes]``.

    Args:
        model: a zoo model (its parameters' shapes and layer settings are read; its own
            parameter values are not used).
        weights: ``[k, P]``, row j replica j's flat weights (in ``model.parameters()``
            order); may require grad.
        x: ``[k, b, C, H, W]``.
        path: ``"grouped"`` (``cnn``) or ``"bmm"`` (``mlp``).

    Raises:
        ValueError: ``path`` does not support ``model``.
    """
    if not supports(model, path) or path not in ("grouped", "bmm"):
        raise ValueError(f"path {path!r} does not support {type(model).__name__}")
    params = _split(weights, model)
    if path == "grouped":
        return _cnn_logits(model, params, x)  # type: ignore[arg-type]
    return _mlp_logits(model, params, x)  # type: ignore[arg-type]


def explicit_replica_gradients(
    model: nn.Module, weights: Tensor, x: Tensor, y: Tensor, path: str
) -> tuple[Tensor, Tensor]:
    """Gradients ``[k, P]`` and mean losses ``[k]`` by the ``grouped`` or ``bmm`` path."""
    w = weights.detach().requires_grad_()
    k, b = y.shape
    logits = batched_logits(model, w, x, path)
    per_sample = F.cross_entropy(logits.reshape(k * b, -1), y.reshape(-1), reduction="none")
    losses = per_sample.view(k, b).mean(1)
    (grad,) = torch.autograd.grad(losses.sum(), w)
    return grad, losses.detach()


def functional_replica_gradients(
    model: nn.Module, weights: Tensor, x: Tensor, y: Tensor, path: str
) -> tuple[Tensor, Tensor]:
    """:func:`explicit_replica_gradients` as a pure function (``torch.func.grad``, no
    ``requires_grad`` state), which ``torch.compile`` captures whole: gradients
    ``[k, P]`` and mean losses ``[k]``."""
    k, b = y.shape

    def total(w: Tensor) -> tuple[Tensor, Tensor]:
        logits = batched_logits(model, w, x, path)
        per = F.cross_entropy(logits.reshape(k * b, -1), y.reshape(-1), reduction="none")
        losses = per.view(k, b).mean(1)
        return losses.sum(), losses

    grad, losses = torch.func.grad(total, has_aux=True)(weights.detach())
    return grad, losses


def vmap_replica_gradients(
    model: nn.Module, weights: Tensor, x: Tensor, y: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients ``[k, P]`` and mean losses ``[k]`` by ``torch.func.vmap`` over replicas."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = dict(model.named_buffers())

    def loss(flat: Tensor, xb: Tensor, yb: Tensor) -> Tensor:
        params = dict(zip(names, _split(flat.unsqueeze(0), model), strict=True))
        params = {n: p.squeeze(0) for n, p in params.items()}
        return F.cross_entropy(functional_call(model, (params, buffers), (xb,)), yb)

    grad, losses = vmap(grad_and_value(loss))(weights.detach(), x, y)
    return grad, losses
