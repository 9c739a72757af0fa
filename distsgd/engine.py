"""Gradient and evaluation maths on flat parameter vectors.

:class:`GradientEngine` owns one ``nn.Module`` whose parameters are views into a single
contiguous buffer of P float32 values, and whose gradients land in a second buffer of the
same layout. Computing a learner's gradient at weights ``w`` is then one copy into the
buffer, one forward/backward, and one copy out: no per-parameter Python loop on the hot
path (DESIGN.md, performance notes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distsgd.batched import (
    PATHS,
    choose_path,
    explicit_replica_gradients,
    supports,
    vmap_replica_gradients,
)
from distsgd.data import iter_eval_batches

__all__ = ["GradientEngine"]


class GradientEngine:
    """Mean cross-entropy gradients of ``model`` at arbitrary flat weights.

    Args:
        model: any ``nn.Module`` mapping ``[B, C, H, W]`` inputs to ``[B, K]`` logits. Its
            parameters are re-pointed into one flat buffer; buffers (e.g. BatchNorm running
            statistics) stay with the module and are shared by every caller.

    Attributes:
        num_parameters: P.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        with torch.no_grad():
            self._flat = torch.cat([p.detach().reshape(-1) for p in params]).contiguous()
        self._grad = torch.zeros_like(self._flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self._flat[offset : offset + n].view_as(p)
            p.grad = self._grad[offset : offset + n].view_as(p)
            offset += n
        self.num_parameters = offset

    def initial_weights(self) -> Tensor:
        """A copy of the model's initial parameters, shape ``[P]``."""
        return self._flat.clone()

    def gradient(
        self,
        weights: Tensor,
        x: Tensor,
        y: Tensor,
        num_chunks: int = 1,
        module: nn.Module | None = None,
    ) -> tuple[Tensor, list[float]]:
        """Gradient of the mean cross-entropy over the minibatch at ``weights``.

        With ``num_chunks = m`` the minibatch is the concatenation of m learners' equal
        minibatches that share ``weights``: the gradient of the mean over all samples is
        exactly the mean of their m gradients (what an all-reduce of their gradients
        gives), and each learner's own mean loss is returned.

        Args:
            weights: shape ``[P]``.
            x: inputs ``[B, C, H, W]``; y: labels ``[B]`` (int64); B divisible by m.
            num_chunks: m >= 1.
            module: run the forward/backward through this wrapper of the engine's model
                instead (e.g. ``DistributedDataParallel(engine.model)``, whose backward
                all-reduces the gradient into the same buffer).

        Returns:
            (gradient ``[P]`` — a new tensor, the m chunk losses as Python floats).
        """
        self._flat.copy_(weights)
        self._grad.zero_()
        self.model.train()
        per_sample = F.cross_entropy((module or self.model)(x), y, reduction="none")
        per_sample.mean().backward()
        losses = per_sample.detach().view(num_chunks, -1).mean(dim=1).tolist()
        return self._grad.clone(), losses

    def replica_gradients(
        self, weights: Tensor, x: Tensor, y: Tensor, path: str = "auto"
    ) -> tuple[Tensor, list[float]]:
        """Gradients of k replicas, each at its own weights on its own minibatch.

        This is the hot path of "several learners per device" (Crossbow, SPEC.md §4): SMA
        and local SGD replicas call it once per iteration for all replicas they hold, and
        it computes them as one batched forward/backward where that is faster (see
        :mod:`distsgd.batched`: grouped convolutions for ``cnn``, batched matrix products
        for ``mlp``, ``torch.func.vmap`` for other models, one-by-one for models with
        BatchNorm or Dropout).

        Args:
            weights: shape ``[k, P]``; row j is replica j's weights.
            x: inputs ``[k, b, C, H, W]``; y: labels ``[k, b]`` (int64).
            path: ``"auto"`` (:func:`distsgd.batched.choose_path`), ``"loop"``,
                ``"grouped"``, ``"bmm"`` or ``"vmap"``.

        Returns:
            (gradients ``[k, P]`` — a new tensor, row j of the mean cross-entropy over
            replica j's minibatch; the k losses as Python floats). The batched paths equal
            the loop up to float32 summation order.

        Raises:
            ValueError: ``path`` unknown or not applicable to the model.
        """
        k, b = y.shape
        if path == "auto":
            path = choose_path(self.model, k, b)
        elif path not in PATHS or not supports(self.model, path):
            raise ValueError(
                f"path = {path!r} is not allowed for {type(self.model).__name__}: expected "
                + ", ".join(repr(p) for p in PATHS if p == "auto" or supports(self.model, p))
            )
        if path in ("grouped", "bmm"):
            self.model.train()
            grads, loss_t = explicit_replica_gradients(self.model, weights, x, y, path)
            return grads, loss_t.tolist()
        if path == "vmap":
            self.model.train()
            grads, loss_t = vmap_replica_gradients(self.model, weights, x, y)
            return grads, loss_t.tolist()
        grads = torch.empty(k, self.num_parameters, dtype=weights.dtype)
        losses: list[float] = []
        for j in range(k):
            grads[j], loss = self.gradient(weights[j], x[j], y[j])
            losses.extend(loss)
        return grads, losses

    @property
    def has_batch_statistics(self) -> bool:
        """True when the model has layers whose output depends on the whole minibatch
        (BatchNorm): then learners sharing weights cannot be fused into one batch."""
        return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in self.model.modules())

    @torch.inference_mode()
    def evaluate(
        self, weights: Tensor, x: Tensor, y: Tensor, batch_size: int
    ) -> tuple[float, float]:
        """Accuracy (fraction in [0, 1]) and mean cross-entropy of ``weights`` on (x, y).

        Every sample is counted exactly once; batches of ``batch_size`` samples.
        """
        self.model.eval()
        correct = 0
        loss_sum = 0.0
        n = x.shape[0]
        with torch.no_grad():  # no autograd graph for a forward-only pass
            self._flat.copy_(weights)
            for xb, yb in iter_eval_batches(x, y, batch_size):
                logits = self.model(xb)
                loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
                correct += int((logits.argmax(dim=1) == yb).sum())
        return correct / n, loss_sum / n

    def buffers_state(self) -> dict[str, Tensor]:
        """The module's buffers (e.g. BatchNorm statistics), for checkpoints."""
        return {k: v.clone() for k, v in self.model.named_buffers()}

    def load_buffers_state(self, state: dict[str, Tensor]) -> None:
        own = dict(self.model.named_buffers())
        if set(own) != set(state):
            raise ValueError("checkpoint buffers do not match the model")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
