"""One whole SMA iteration of k replicas on one device, as one captured function.

Crossbow trains k small-batch replicas per device and synchronises them by SMA every
iteration (Koliousis et al., VLDB 2019, arXiv:1901.02244, Algorithm 1; docs/protocols.md
§4). At small b a step's kernels are short and the device waits on their launches and on
Python: :class:`ReplicaStep` runs the batched forward, the backward and the SMA update on
the flat buffers as one function of those buffers, and can hand it to
``torch.compile`` or capture it in a CUDA graph, so that one iteration is one launch.

State (on the engine's device, float32): replicas ``W [k, P]``, their momentum buffers
``M [k, P]`` (zero at the start), the central model ``z [P]`` and its previous value
``z_prev [P]``. One :meth:`ReplicaStep.step` on inputs ``x [k, b, ...]``, labels
``y [k, b]`` at rate γ does, as :class:`distsgd.protocols.SMA`'s ``local_step`` then
``apply_central`` with SGD (momentum μ, no weight decay, no Nesterov)::

    g_j  = ∇ mean_b ℓ(W_j; x_j, y_j)           # the batched path of distsgd.batched
    s    = α (Σ_j W_j − k z)                   # the device's correction sum
    W_j ← W_j + α (z − W_j)                    # the correction c_j, fused first
    M_j ← μ M_j + g_j;  W_j ← W_j − γ M_j      # torch.optim.SGD with momentum
    z   ← z + s + μ_z (z − z_prev);  z_prev ← old z

and, as SMA does, resets every replica to z and its momentum buffer to zero first when γ
is lower than the previous step's (Crossbow's rule for step schedules).

Modes (``mode``):

* ``"eager"``: the function runs op by op (the reference).
* ``"compile"``: ``torch.compile(fn, dynamic=False)`` (inductor; CPU or GPU).
* ``"reduce-overhead"``: ``torch.compile(fn, mode="reduce-overhead", dynamic=False)``:
  inductor's kernels replayed from CUDA graphs on a GPU (on a CPU the same as
  ``"compile"``).
* ``"cuda-graph"``: the eager function captured once in a ``torch.cuda.CUDAGraph`` with
  static input buffers and replayed (CUDA only).

Where a mode cannot run (no CUDA for ``"cuda-graph"``, a compiler failure, a capture
failure), the step warns once with the reason and runs eagerly from then on
(:attr:`ReplicaStep.mode` says what runs). Compiled kernels sum in another float32 order
than the eager ones: the modes agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from distsgd.batched import batched_logits, supports
from distsgd.config import ConfigWarning
from distsgd.engine import GradientEngine, first_line

__all__ = ["STEP_MODES", "ReplicaStep"]

STEP_MODES = ("eager", "compile", "reduce-overhead", "cuda-graph")


def _loss_fn(engine: GradientEngine, path: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(W [k, P], x, y) → per-replica mean losses [k]`` by the batched ``path``
    (``"grouped"`` or ``"bmm"``)."""
    model = engine.model

    def losses(w: Tensor, x: Tensor, y: Tensor) -> Tensor:
        k, b = y.shape
        logits = batched_logits(model, w, x, path)
        per = F.cross_entropy(logits.reshape(k * b, -1), y.reshape(-1), reduction="none")
        return per.view(k, b).mean(1)

    return losses


class ReplicaStep:
    """k SMA replicas on one device, stepped as one function (module docstring).

    Args:
        engine: the model's :class:`GradientEngine` (its model's shapes; its device).
        initial: ``[P]``, every replica and z start here (copied).
        k: replicas (>= 1).
        batch_size: b, samples per replica per iteration (>= 1).
        alpha: α in [0, 1] (literal; Crossbow's default 1/k is the caller's choice).
        momentum: μ in [0, 1), the replicas' local SGD momentum.
        central_momentum: μ_z in [0, 1), Polyak momentum on z.
        mode: one of :data:`STEP_MODES`.

    The step runs in float32 (the engine's ``precision`` is not applied).

    Raises:
        ValueError: an argument outside the allowed values, or a model other than the
            zoo's ``cnn`` and ``mlp`` (the models :mod:`distsgd.batched` batches
            explicitly, as grouped convolutions and batched matrix products).
    """

    def __init__(
        self,
        engine: GradientEngine,
        initial: Tensor,
        k: int,
        batch_size: int,
        alpha: float,
        momentum: float = 0.9,
        central_momentum: float = 0.9,
        mode: str = "eager",
    ) -> None:
        if mode not in STEP_MODES:
            raise ValueError(f"mode = {mode!r} is not allowed: expected one of {STEP_MODES}")
        if k < 1 or batch_size < 1:
            raise ValueError(f"k = {k}, batch_size = {batch_size}: expected integers >= 1")
        for name, v, closed in (
            ("alpha", alpha, True),
            ("momentum", momentum, False),
            ("central_momentum", central_momentum, False),
        ):
            if not (0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0):
                allowed = f"0 <= {name} <= 1" if closed else f"0 <= {name} < 1"
                raise ValueError(f"{name} = {v!r} is not allowed: expected {allowed}")
        path = next((p for p in ("grouped", "bmm") if supports(engine.model, p)), None)
        if path is None:
            raise ValueError(
                f"{type(engine.model).__name__} has no batched replica path "
                "(expected the zoo's cnn or mlp, which distsgd.batched batches explicitly)"
            )
        self.engine, self.k, self.batch_size, self.path = engine, k, batch_size, path
        dev = engine.device
        z = initial.detach().to(dev, torch.float32).clone()
        self.z, self.z_prev = z, z.clone()
        self.replicas = z.expand(k, -1).clone()
        self.momentum_buffers = torch.zeros_like(self.replicas)
        self.lr = torch.zeros((), device=dev)
        self._last_lr = -1.0  # none yet
        self._consts = (float(alpha), float(momentum), float(central_momentum))
        self._pure = self._make_pure(_loss_fn(engine, path))
        self.requested_mode = mode
        self.mode = mode
        self.fallback_reason: str | None = None
        self._fn: Callable[..., tuple[Tensor, ...]] = self._pure
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: tuple[Tensor, ...] = ()
        if mode == "cuda-graph" and dev.type != "cuda":
            self._fall_back(f"the engine's device is {dev.type}, not cuda")
        elif mode in ("compile", "reduce-overhead"):
            options = {"mode": "reduce-overhead"} if mode == "reduce-overhead" else {}
            self._fn = torch.compile(self._pure, dynamic=False, **options)

    def _make_pure(self, losses: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable:
        alpha, mu, mu_z = self._consts
        k = self.k

        def total(w: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
            per = losses(w, x, y)
            return per.sum(), per

        grad_fn = torch.func.grad(total, has_aux=True)

        def step(w, m, z, z_prev, x, y, lr):  # noqa: ANN001, ANN202 - tensors only
            g, per = grad_fn(w, x, y)
            sums = (w.sum(0) - k * z) * alpha
            w = torch.lerp(w, z.expand_as(w), alpha)
            m = m * mu + g
            w = w - lr * m
            z_new = z + sums + (z - z_prev) * mu_z
            return w, m, z_new, z, per

        return step

    def _fall_back(self, reason: str) -> None:
        self.mode, self.fallback_reason = "eager", reason
        self._fn, self._graph = self._pure, None
        warnings.warn(
            f"replica step mode {self.requested_mode!r} cannot run ({reason}); "
            "running the step eagerly instead",
            ConfigWarning,
            stacklevel=3,
        )

    def _state(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.replicas, self.momentum_buffers, self.z, self.z_prev

    def _write(self, out: tuple[Tensor, ...]) -> Tensor:
        # out[3] is the old z, which may be z itself: z_prev first
        w, m, z, z_prev = self._state()
        for dst, src in ((z_prev, out[3]), (w, out[0]), (m, out[1]), (z, out[2])):
            dst.copy_(src)
        return out[4]

    def _capture(self, x: Tensor, y: Tensor) -> None:
        """Warm up on copies of the state on a side stream, then capture one step that
        reads the static inputs and writes the state buffers in place."""
        self._static = (x.clone(), y.clone())
        copies = [t.clone() for t in self._state()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._pure(*copies, *self._static, self.lr)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._pure(*self._state(), *self._static, self.lr)
            self._graph_losses = self._write(out)
        self._graph = graph

    def warm_up(self, x: Tensor, y: Tensor, calls: int = 3) -> None:
        """Compile or capture the step now, on copies of the state (the state is left as
        it was), so that the first :meth:`step` does not pay for it. ``x``, ``y`` as in
        :meth:`step`; ``calls`` runs of a compiled function (``reduce-overhead`` records
        its CUDA graphs on the second and later calls). Falls back as :meth:`step` does."""
        x, y = self.engine.to_device(x, y)
        try:
            if self.mode == "cuda-graph" and self._graph is None:
                self._capture(x, y)
            elif self.mode in ("compile", "reduce-overhead"):
                copies = [t.clone() for t in self._state()]
                for _ in range(calls):
                    self._fn(*copies, x, y, self.lr)
        except Exception as e:  # noqa: BLE001 - any failure of torch.compile or capture
            self._fall_back(
                f"{'capture' if self.mode == 'cuda-graph' else 'compiling'} failed: {first_line(e)}"
            )

    def step(self, x: Tensor, y: Tensor, lr: float) -> Tensor:
        """One SMA iteration: ``x [k, b, ...]``, ``y [k, b]`` (moved to the device), rate
        ``lr`` >= 0. Returns the k mean losses ``[k]`` (a tensor on the device; reading it
        synchronises)."""
        x, y = self.engine.to_device(x, y)
        if lr < self._last_lr:  # Crossbow's reset on a drop of γ (SMA.begin_iteration)
            self.replicas.copy_(self.z.expand_as(self.replicas))
            self.momentum_buffers.zero_()
        self._last_lr = lr
        self.lr.fill_(lr)
        if self.mode == "cuda-graph":
            try:
                if self._graph is None:
                    self._capture(x, y)
                self._static[0].copy_(x)
                self._static[1].copy_(y)
                self._graph.replay()
                return self._graph_losses.clone()
            except Exception as e:  # noqa: BLE001 - any failure of the capture
                self._fall_back(f"capture failed: {first_line(e)}")
        if self.mode != "eager":
            try:
                return self._write(self._fn(*self._state(), x, y, self.lr)).clone()
            except Exception as e:  # noqa: BLE001 - any failure of torch.compile's stack
                self._fall_back(f"compiling failed: {first_line(e)}")
        return self._write(self._pure(*self._state(), x, y, self.lr)).clone()
