"""``DistributedOptimizer``: the user's optimizer and model under a distsgd protocol."""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable

from distsgd.config import ConfigError, OptimizerConfig
from distsgd.layout import spec_for
from distsgd.protocols.base import AllReduce, SynchronousProtocol
from distsgd.runtime import ps
from distsgd.runtime.base import TrainingDiverged, check_losses
from distsgd.runtime.compression import wire_dtype
from distsgd.runtime.dist import all_reduce, collective, device_protocol
from distsgd.torch import server_optimizer
from distsgd.torch.context import DIVERGED_KEY, Context, _parameters
from distsgd.torch.flat import flatten, flatten_grads, write_back

__all__ = ["DistributedOptimizer"]

LOSS, GRADIENT = 1, 2  # what the divergence guard checked: the loss given, or the gradient
WHAT = {LOSS: "training loss", GRADIENT: "training gradient"}


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps the user's ``torch.optim`` optimizer so that ``step()`` runs the protocol.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``defaults`` and ``state``
    are the wrapped optimizer's, so an LR scheduler (``StepLR(opt, …)``) or a
    ``GradScaler`` takes it as it takes the optimizer: the rate a scheduler sets is the
    rate of the next step, on every protocol (the server's update under the parameter
    server: each push carries it).

    Rules per ``ctx.protocol`` (docs/protocols.md; W learner ranks, γ the optimizer's current
    ``lr`` of its first param group, P the parameters' total size):

    * ``hardsync`` (§1): the gradients are mean-all-reduced, then the user's optimizer
      steps: DDP's and Horovod's rule, with DDP's overlap: buckets of about
      ``bucket_cap_mb`` MiB, in reverse parameter order, start their all-reduce from
      backward as their gradients become ready and are waited for when backward ends,
      so after ``backward()`` ``param.grad`` is the mean, a view into its bucket
      (:class:`_GradientBuckets`).
    * ``local_sgd`` (§5) and ``sma`` (§4, Crossbow): the user's optimizer steps locally
      and the protocol object (one learner per process) exchanges what its rule says:
      local SGD averages the parameters over the ranks every H = ``average_every`` steps;
      SMA takes ``c = α (w − z)`` from the weights before the step, ``w ← w − c``,
      ``z ← z + Σ_ranks c + μ_z (z − z_prev)``, and when γ drops resets the model to z
      and clears the optimizer's state. ``diloco`` (§6) is local SGD whose mean
      pseudo-gradient θ − w over the ranks, every H steps, is applied to θ by the outer
      optimizer of ``protocol.outer_*``; the model then takes θ (the user's optimizer is
      the inner one). The user's step is fed to the protocol as the
      gradient ``(w_before − w_after)/γ`` at rate γ of its plain SGD, so its replica and
      z are the trainer's (:class:`_Exchanging`).
    * ``parameter_server`` / ``compute_groups`` (§2, §3): ``step()`` pushes the gradient
      with γ as the base rate α0 to the server (:meth:`Context.serve`), which applies the
      protocol's rule (staleness, softsync's α0/n) in arrival order with an optimizer of
      the user's optimizer's class and hyperparameters over the central weights
      (:mod:`distsgd.torch.server_optimizer`; construction refuses, on every rank, one
      it cannot run), and loads the weights pulled back into the model; the user's
      optimizer is not stepped here. A compute group all-reduces its members' gradients
      first; its leader talks to the server.

    Divergence: the loss passed to ``step(loss)`` (or returned by its closure) is the
    trainer's divergence guard's input (:func:`~distsgd.runtime.base.check_losses`, the
    message of ``distsgd train``): a NaN or infinite loss on any learner raises
    :class:`~distsgd.runtime.base.TrainingDiverged` from ``step`` on every rank, the same
    step under hardsync and SMA (the losses ride on that step's all-reduce), at the next
    averaging under local SGD, and under the parameter server once the server has the
    push (the server's ``serve`` raises it too). A ``step()`` without a loss checks the
    sum of the gradients instead (after the all-reduce under hardsync), and the message
    then names the ``training gradient``.

    Dropout: once the initial weights are shared (below), each learner of a run of
    several reseeds torch's generators (``torch.manual_seed``) with
    ``torch.initial_seed() + 7919·(l + 1)``, so ranks draw different dropout masks
    from equal weights.

    Compression (``protocol.compression = "bf16"`` or ``"fp16"``): hardsync's buckets and
    the exchanges of local SGD, DiLoCo and SMA (buffers included) are all-reduced in that
    format, scaled before the cast (:mod:`distsgd.runtime.compression`); the parameters
    and the optimizer's state stay float32. Refused with a parameter server.

    Buffers (BatchNorm running statistics): floating-point buffers are averaged over
    the ranks wherever the protocol synchronises (every step for hardsync and SMA, every
    H steps for local SGD); integer buffers (``num_batches_tracked``) stay local, they
    are equal on all ranks. Under the parameter server and compute groups buffers stay
    with each learner (the server holds parameters only): ``ctx.serve(model, bn_data=…)``
    recomputes them for the central model. At construction every synchronous rank takes
    rank 0's parameters and buffers (as DDP does); parameter-server learners take the
    server's.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the same parameters.
        model: the ``nn.Module`` or any iterable of its parameter tensors (a generator
            is read once); its parameters, in order, are the flat vector ``[P]``.
        ctx: this rank's :class:`Context` (a learner rank).
        bucket_cap_mb: hardsync's gradient bucket size in MiB (DDP's ``bucket_cap_mb``,
            default 25); the other protocols ignore it.

    Raises:
        ConfigError: ``bucket_cap_mb`` is not a positive number.
        RuntimeError: on a server rank (it calls ``ctx.serve``); from :meth:`step` (and
            under hardsync from ``backward()``, which waits for the all-reduces):
            ``PeerLost`` naming the lost rank (synchronous protocols), ``ps.ServerLost``,
            ``ps.LearnerLost``.
        ValueError: ``model`` holds no tensors.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[Tensor],
        ctx: Context,
        *,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if not (isinstance(bucket_cap_mb, int | float) and bucket_cap_mb > 0):
            raise ConfigError(
                f"bucket_cap_mb = {bucket_cap_mb!r} is not allowed: expected a positive "
                "number of MiB (DDP's default 25)"
            )
        if ctx.is_server:
            raise RuntimeError(
                f"rank {ctx.rank} is a server rank: call ctx.serve(model) there, not "
                "DistributedOptimizer"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}: expected a torch.optim.Optimizer"
            )
        self.optimizer = optimizer
        self.ctx = ctx
        self._steps = 0  # step() calls (the divergence guard names the step)
        self.params = _parameters(model)
        self.buffers = (
            [b for b in model.buffers() if b.is_floating_point()]
            if isinstance(model, nn.Module)
            else []
        )
        self.num_parameters = sum(p.numel() for p in self.params)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._rule = _rule_for(self)
        ctx.optimizer = self
        if ctx.num_learners > 1 and ctx.learner is not None:  # weights shared by now
            torch.manual_seed(torch.initial_seed() + 7919 * (ctx.learner + 1))

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (an LR scheduler may change them)."""
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.ctx.protocol}, {self.optimizer!r})"

    @property
    def lr(self) -> float:
        """γ: the wrapped optimizer's current ``lr`` (first param group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def stopped(self) -> bool:
        """True once the parameter server refused a push (it stopped the run)."""
        return getattr(self._rule, "stopped", False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``. Under hardsync ``.grad`` are views into
        the gradient buckets; ``set_to_none=True`` (torch's default) drops them and the
        next backward points them back (as ``model.zero_grad()`` or the wrapped
        optimizer's would), ``False`` zeroes the buckets through them."""
        self._rule.zero_grad()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(  # type: ignore[override]
        self,
        loss: float | Tensor | Callable[[], Any] | None = None,
        *,
        closure: Callable[[], Any] | None = None,
    ) -> Any:
        """One protocol step with the gradients in ``param.grad`` (see the class).

        Args:
            loss: this step's training loss (optional; a callable is taken as
                ``closure``): the divergence guard's input, and sent with the push to the
                server (``ServeResult.train_loss``).
            closure: torch's optimizer closure: called (with grad enabled) before the
                step; the loss it returns is this step's loss.

        Returns:
            The loss (the closure's, or the one given), as ``torch.optim`` returns it.

        Raises:
            TrainingDiverged: a learner's loss (or, without one, its gradient) is NaN or
                infinite (see the class).
        """
        if callable(loss):
            closure, loss = loss, None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        given = loss
        value = None if loss is None else float(loss.detach() if isinstance(loss, Tensor) else loss)
        self._steps += 1
        self._rule.step(value)
        return given

    def guard(self, loss: float | None) -> tuple[float, int]:
        """The divergence guard's input: ``(loss, LOSS)`` when the loop gave one, else
        ``(sum of the gradients, GRADIENT)`` (non-finite when any gradient is)."""
        if loss is not None:
            return loss, LOSS
        total = sum((p.grad.sum() for p in self.params if p.grad is not None), torch.zeros(()))
        return float(total), GRADIENT

    def check_losses(self, flags: Tensor) -> None:
        """Raise the divergence of the first learner ``flags`` names: ``[3·W]``, learner
        l's non-finite value at ``3l`` (0 when finite), its step at ``3l + 1`` and what
        it is (:data:`LOSS`, :data:`GRADIENT`) at ``3l + 2``."""
        values = flags.tolist()
        for learner in range(len(values) // 3):
            value, step, kind = values[3 * learner : 3 * learner + 3]
            if not math.isfinite(value):
                check_losses([learner], [value], self.lr, None, int(step), WHAT[int(kind)])

    def loss_flags(self, loss: float | None) -> Tensor:
        """This learner's part of :meth:`check_losses`' ``[3·W]`` (zeros elsewhere)."""
        flags = torch.zeros(3 * self.ctx.world_size, dtype=torch.float64)
        value, kind = self.guard(loss)
        if not math.isfinite(value):
            r = self.ctx.rank
            flags[3 * r : 3 * r + 3] = torch.tensor([value, self._steps, kind])
        return flags

    @contextlib.contextmanager
    def evaluation_weights(
        self, model: nn.Module | Iterable[Tensor] | None = None
    ) -> Iterator[None]:
        """Within the block the model holds the protocol's model (:meth:`eval_weights`:
        the central model z under SMA, the ranks' mean under local SGD, the server's
        weights last pulled under the parameter server, the shared weights under
        hardsync); on leaving, its own weights again. Collective under local SGD
        between averagings (every rank enters it). ``model``: the parameters (default:
        those the optimizer wraps)."""
        params = self.params if model is None else _parameters(model)
        own = flatten(params)
        write_back(self.eval_weights(), params)
        try:
            yield
        finally:
            write_back(own, params)

    def eval_weights(self) -> Tensor:
        """The model the protocol evaluates, shape ``[P]``: the central model z (SMA),
        the ranks' mean (local SGD; collective between averagings), the weights last
        pulled (parameter server), the shared weights (hardsync)."""
        return self._rule.eval_weights()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and the protocol object's (iteration counter,
        replica, central model z and z_prev, last γ)."""
        return {"optimizer": self.optimizer.state_dict(), "rule": self._rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's parameters are the protocol's again)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self._rule.load_state_dict(state["rule"])

    def close(self) -> None:
        """End this learner's part (parameter server: BYE to the server). Idempotent."""
        self._rule.close()

    # ---- helpers shared by the rules ----------------------------------------------------
    def collective(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` with a lost peer as ``PeerLost`` naming the silent rank."""
        return collective(self.ctx.heartbeats, fn, *args, **kwargs)

    def average(self, vector: Tensor) -> Tensor:
        """Collective: ``vector`` averaged over the ranks, in place."""
        self.collective(dist.all_reduce, vector, op=dist.ReduceOp.SUM)
        return vector.div_(self.ctx.world_size)

    def with_buffers(self, vector: Tensor) -> Tensor:
        return torch.cat([vector, flatten(self.buffers)]) if self.buffers else vector

    def take_buffers(self, vector: Tensor) -> None:
        if self.buffers:
            write_back(vector[self.num_parameters :], self.buffers)

    def broadcast_from_rank0(self) -> None:
        """Collective: every rank takes rank 0's parameters and buffers."""
        flat = self.with_buffers(flatten(self.params))
        self.collective(dist.broadcast, flat, src=0)
        write_back(flat[: self.num_parameters], self.params)
        self.take_buffers(flat)


class _Rule:
    """One protocol's ``step`` (small classes, one per rule)."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        self.o = owner

    def step(self, loss: float | None) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        pass

    def eval_weights(self) -> Tensor:
        return flatten(self.o.params)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class _AllReduce(_Rule):
    """hardsync: DDP's reduction. The gradients are mean-all-reduced in buckets launched
    from backward as they become ready and waited for when backward ends
    (:class:`_GradientBuckets`), then ``step`` averages the buffers and the user's
    optimizer steps."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        super().__init__(owner)
        self.buckets = _GradientBuckets(owner)

    def step(self, loss: float | None) -> None:
        o = self.o
        self.buckets.reduce_if_not_reduced()
        self.buckets.reduced = False
        if o.buffers:
            write_back(o.average(flatten(o.buffers)), o.buffers)
        flags = o.loss_flags(loss)  # the ranks' losses meet while the optimizer steps
        work = o.collective(dist.all_reduce, flags, op=dist.ReduceOp.SUM, async_op=True)
        o.optimizer.step()
        o.collective(work.wait)
        o.check_losses(flags)

    def close(self) -> None:
        self.buckets.remove()


class _GradientBuckets:
    """Gradient buckets all-reduced while backward runs, as DDP's reducer does, with the
    gradients as views into the buckets (DDP's ``gradient_as_bucket_view``).

    The parameters that require a gradient are packed, in reverse order (the order in
    which backward produces them), into buckets, each closed once it holds
    ``bucket_cap_mb`` MiB or more (the first 1 MiB, DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``;
    a parameter is never split; a change of dtype or device also closes one). Each bucket
    is one persistent flat tensor ``[Σ numel]``; each parameter's ``.grad`` is a view of
    its slice, so the optimizer reads the all-reduced gradients where the collective
    wrote them: no flatten, no copy back, no allocation per step.

    A ``register_post_accumulate_grad_hook`` per parameter puts its gradient in the
    bucket scaled by 1/W (DDP scales before summing, with the same ``mul``): when
    ``.grad`` is the view (``zero_grad(set_to_none=False)``, or a second backward) autograd
    accumulated into the bucket and the view is scaled in place; otherwise (``.grad`` was
    ``None``, torch's default ``zero_grad``, and autograd made a new tensor) the scaled
    gradient is written into the view in one pass and ``.grad`` pointed back at the view.
    A bucket whose parameters are all in launches its all-reduce with
    ``async_op=True``; buckets launch strictly in bucket order, so every rank issues the
    same collectives whatever the order its hooks fire in. When backward ends (a callback
    queued on autograd's engine, as DDP's ``finalize_backward``) the buckets backward left
    (parameters without a gradient count as zero) are launched and all are waited for:
    after ``backward()`` the ``.grad`` are the ranks' mean, so clipping between backward
    and ``step`` sees what DDP's would. Several backward passes before one ``step``
    (gradient accumulation) each reduce again, as DDP without ``no_sync``: the mean of
    the earlier passes plus this rank's new gradient, scaled by 1/W and summed, is the
    sum of the passes' means. As under DDP, every rank must run the same number of
    backward passes per step.
    """

    FIRST_BUCKET_BYTES = 1024 * 1024

    def __init__(self, owner: DistributedOptimizer) -> None:
        self.o = owner
        self.scale = 1.0 / owner.ctx.world_size
        self.buckets = _pack_buckets(
            [p for p in owner.params if p.requires_grad],
            int(owner.bucket_cap_mb * 1024 * 1024),
            self.FIRST_BUCKET_BYTES,
        )
        self.flats: list[Tensor] = []  # bucket i: its gradients, [Σ numel], p.dtype
        self.views: list[list[Tensor]] = []  # bucket i: one view per parameter
        self.hooks = []
        k = 0  # the parameter's place over all buckets (its entry in ``passes``)
        for i, params in enumerate(self.buckets):
            flat = torch.zeros(
                sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
            )
            sizes = [p.numel() for p in params]
            views = [v.view_as(p) for v, p in zip(flat.split(sizes), params, strict=True)]
            self.flats.append(flat)
            self.views.append(views)
            for p, view in zip(params, views, strict=True):
                hook = functools.partial(self._on_gradient, i, k, view)
                self.hooks.append(p.register_post_accumulate_grad_hook(hook))
                k += 1
        self.num_passes = 0  # backward passes reduced since construction
        self.passes = [0] * k  # per parameter: the last pass that gave it a gradient
        self.works: list[Any] = []  # this pass's launched all-reduces, bucket order
        self.sent: list[Tensor] = []  # what each launched all-reduce reduces (a bucket,
        # or its cast to the wire format)
        compression = owner.ctx.config.protocol.compression
        self.wire = wire_dtype(compression) if compression != "none" else None
        self.missing = [len(b) for b in self.buckets]  # per bucket: gradients not in yet
        self.in_backward = False  # a backward pass is putting gradients in (end queued)
        self.reduced = False  # the .grad are the ranks' mean (cleared by step)

    def _take(self, param: Tensor, view: Tensor) -> None:
        """Put ``param``'s gradient, scaled by 1/W, into its bucket ``view``; point
        ``param.grad`` at it (zeros for a missing gradient)."""
        grad = param.grad
        if grad is view:
            if self.scale != 1.0:
                view.mul_(self.scale)
            return
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self.scale != 1.0:
                torch.mul(grad, self.scale, out=view)
            else:
                view.copy_(grad)
        param.grad = view

    def _on_gradient(self, i: int, k: int, view: Tensor, param: Tensor) -> None:
        if not self.in_backward:  # this pass's first gradient
            self.in_backward = True
            self.num_passes += 1
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._take(param, view)
        self.passes[k] = self.num_passes
        missing, works = self.missing, self.works
        missing[i] -= 1
        while len(works) < len(missing) and missing[len(works)] == 0:
            self._launch(len(works))

    def _launch(self, i: int) -> None:
        flat = self.flats[i]
        if self.wire is not None and flat.dtype != self.wire:  # compressed: a cast copy
            flat = self.flats[i].to(self.wire)
        self.sent.append(flat)
        self.works.append(
            self.o.collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM, async_op=True)
        )

    def _end_of_backward(self) -> None:
        """Launch what backward left, wait for every bucket: ``.grad`` is the mean."""
        k = sum(len(b) for b in self.buckets[: len(self.works)])
        for i in range(len(self.works), len(self.buckets)):
            for p, view in zip(self.buckets[i], self.views[i], strict=True):
                if self.passes[k] != self.num_passes:  # none this pass: adds zero
                    self._take(p, view)
                k += 1
            self._launch(i)
        for i, work in enumerate(self.works):
            self.o.collective(work.wait)
            if self.sent[i] is not self.flats[i]:
                self.flats[i].copy_(self.sent[i])
        self.works = []
        self.sent = []
        self.missing = [len(b) for b in self.buckets]
        self.in_backward = False
        self.reduced = True

    def reduce_if_not_reduced(self) -> None:
        """``step`` without a backward since the last one (gradients set by hand): reduce
        the ``.grad`` there are, as one pass. Collective (every rank must agree)."""
        if not self.reduced:
            self.num_passes += 1
            self._end_of_backward()

    def remove(self) -> None:
        """Remove the hooks (the optimizer is closed)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _pack_buckets(params: list[Tensor], cap_bytes: int, first_bytes: int) -> list[list[Tensor]]:
    """DDP's bucket assignment: ``params`` in reverse order, a bucket closed once it holds
    ``cap_bytes`` or more (the first ``min(cap_bytes, first_bytes)``), or when the dtype
    or device changes; a parameter is never split."""
    buckets: list[list[Tensor]] = []
    size, limit = 0, min(cap_bytes, first_bytes)
    for p in reversed(params):
        last = buckets[-1][-1] if buckets else None
        if last is None or size >= limit or (p.dtype, p.device) != (last.dtype, last.device):
            if buckets:
                limit = cap_bytes
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class _Exchanging(_Rule):
    """A synchronous protocol whose learners hold their own weights (local SGD, SMA),
    through its protocol object (one learner here, :func:`~distsgd.runtime.dist.
    device_protocol` with plain SGD): the user's optimizer steps, its step is fed to the
    protocol as the gradient ``(w_before − w_after)/γ`` at rate γ, and the all-reduce the
    protocol names (:meth:`~distsgd.protocols.SynchronousProtocol.exchange_step`) runs
    over the ranks with the floating-point buffers averaged alongside. When the protocol
    resets its learners (:meth:`~distsgd.protocols.SynchronousProtocol.begin_iteration`)
    the model takes its weights and the user's optimizer state is cleared. Local SGD and
    DiLoCo take the user's step as it is: the replica becomes the stepped parameters
    (:meth:`~distsgd.protocols.LocalSGD.local_step_to`, one flatten), and the model is
    written only when an exchange changed the replica."""

    def __init__(self, owner: DistributedOptimizer, protocol: SynchronousProtocol) -> None:
        super().__init__(owner)
        self.protocol = protocol
        self.pending: Tensor | None = None  # a divergence not yet exchanged (local SGD)

    def step(self, loss: float | None) -> None:
        o, proto = self.o, self.protocol
        flags = self.pending if self.pending is not None else o.loss_flags(loss)
        lr = o.lr
        if proto.steps_outside:  # the user's step is the replica's: no replay
            o.optimizer.step()
            if not proto.local_step_to(flatten(o.params)):
                if flags.any():
                    self.pending = flags
                return
            self._exchange(proto.period_exchange(), flags)
            return
        if proto.begin_iteration(lr):
            write_back(proto.learner_weights(0), o.params)
            o.optimizer.state.clear()
        before = flatten(o.params)
        o.optimizer.step()
        moved = before.sub_(flatten(o.params))
        direction = moved.div_(lr) if lr > 0 else moved.zero_()
        exchange = proto.exchange_step(direction.unsqueeze(0), lr)
        if exchange is not None:
            self._exchange(exchange, flags)
            return
        if flags.any():
            self.pending = flags
        write_back(proto.learner_weights(0), o.params)

    def _exchange(self, exchange: AllReduce, flags: Tensor) -> None:
        """Run ``exchange`` over the ranks, check the learners' losses, and give the
        model the protocol's weights."""
        exchange.apply(self._all_reduce(exchange, flags))
        self.pending = None
        self.o.check_losses(flags)
        write_back(self.protocol.learner_weights(0), self.o.params)

    def _all_reduce(self, exchange: AllReduce, flags: Tensor) -> Tensor:
        """:func:`~distsgd.runtime.dist.all_reduce` of ``exchange`` with the model's
        floating-point buffers appended and averaged (they are taken here), and the
        learners' divergence ``flags`` summed (in place)."""
        o = self.o
        flat = o.with_buffers(exchange.payload.sum(0))
        compression = o.ctx.config.protocol.compression
        if compression != "none":  # scaled before the cast, as DDP's compress hooks do
            p, world, n = o.num_parameters, o.ctx.world_size, flags.numel()
            flat[:p].div_(exchange.payload.shape[0] * world if exchange.mean else 1)
            flat[p:].div_(world)
            wire = torch.cat([flat, flags.to(flat.dtype)]).to(wire_dtype(compression))
            o.collective(dist.all_reduce, wire, op=dist.ReduceOp.SUM)
            flags.copy_(wire[-n:])  # counts of learners: exact in 16 bits
            flat.copy_(wire[:-n])
            o.take_buffers(flat)
            return flat[:p]
        flat = torch.cat([flat, flags.to(flat.dtype)])
        o.collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
        flags.copy_(flat[-flags.numel() :])
        flat = flat[: -flags.numel()]
        if exchange.mean:
            flat.div_(exchange.payload.shape[0] * o.ctx.world_size)
        else:
            flat[o.num_parameters :].div_(o.ctx.world_size)
        o.take_buffers(flat)
        return flat[: o.num_parameters]

    def eval_weights(self) -> Tensor:
        exchange = self.protocol.eval_exchange()
        if exchange is None:
            return self.protocol.eval_weights()
        return exchange.apply(self.o.collective(all_reduce, exchange, self.o.ctx.world_size))

    def state_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.protocol.load_state_dict(state["protocol"])
        write_back(self.protocol.learner_weights(0), self.o.params)


class _Pusher(_Rule):
    """Parameter server / compute groups: :func:`ps.run_learner` runs in a thread whose
    ``compute`` hands the pulled weights to the user's loop and takes its gradient back."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        super().__init__(owner)
        ctx = owner.ctx
        assert ctx.layout is not None
        self.stopped = False
        self._closed = False
        self._weights: queue.Queue[Any] = queue.Queue()  # thread -> loop
        self._grads: queue.Queue[Any] = queue.Queue()  # loop -> thread
        self._pulled: Tensor = flatten(owner.params)
        worker = ctx.layout.worker_of(ctx.rank)
        self._thread = threading.Thread(
            target=self._learn,
            args=(ctx.layout, ctx.subgroups[worker]),
            daemon=True,
            name="distsgd-learner",
        )
        self._thread.start()
        self._take(self._weights.get())  # the first pull

    def _learn(self, layout: ps.PSLayout, group: Any) -> None:
        ctx = self.o.ctx

        def compute(weights: Tensor, version: int) -> tuple[Tensor, list[float]] | None:
            self._weights.put(("weights", weights))
            return self._grads.get()

        try:
            ps.run_learner(
                layout,
                ctx.rank,
                compute=compute,
                group=group,
                num_samples=ctx.config.protocol.batch_size,
                timeout_s=ctx.config.dist.timeout_s,
                silence_s=ctx.heartbeats.silence_s if ctx.heartbeats is not None else None,
            )
            self._weights.put(("stopped", None))
        except BaseException as e:  # noqa: BLE001 - raised in the user's loop
            self._weights.put(("error", e))

    def _take(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "error":
            self._closed = True
            raise payload
        if kind == "stopped":
            self.stopped = self._closed = True
            return
        self._pulled = payload
        write_back(payload, self.o.params)

    def step(self, loss: float | None) -> None:
        if self._closed:
            if self.stopped:
                self._raise_divergence()
                return
            raise RuntimeError("step() after close()")
        o = self.o
        value, kind = o.guard(loss)
        if kind == GRADIENT and math.isfinite(value):
            value, kind = math.nan, 0  # no loss given, nothing to report
        floats = [o.lr, value, float(kind)]
        self._grads.put((flatten_grads(o.params), floats))
        self._take(self._weights.get())
        if self.stopped:
            self._raise_divergence()

    def _raise_divergence(self) -> None:
        """The server stopped the run: raise the divergence it posted, if that is why."""
        heartbeats = self.o.ctx.heartbeats
        message = heartbeats.posted(DIVERGED_KEY) if heartbeats is not None else None
        if message is not None:
            raise TrainingDiverged(message)

    def eval_weights(self) -> Tensor:
        return self._pulled.clone()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._grads.put(None)  # compute returns None: BYE to the server
            item = self._weights.get()
            if item[0] == "error":
                raise item[1]
        self._thread.join(self.o.ctx.config.dist.timeout_s + 5)


def _rule_for(owner: DistributedOptimizer) -> _Rule:
    """The learner-side rule of ``owner.ctx``'s protocol: pushes to a server, DDP's
    gradient buckets where the learners share weights, else the protocol's exchange."""
    ctx = owner.ctx
    if ctx.config.protocol.compression not in ("none", "bf16", "fp16"):
        raise ConfigError(
            f"protocol.compression = {ctx.config.protocol.compression!r} is not allowed in "
            "the drop-in: expected 'none', 'bf16' or 'fp16' (the runtimes 'sim' and 'dist' "
            "run it)"
        )
    if spec_for(ctx.config.protocol).has_server:
        if ctx.config.protocol.compression != "none":
            raise ConfigError(
                f"protocol.compression = {ctx.config.protocol.compression!r} is not allowed "
                "with a parameter server in the drop-in: expected 'none' (pushes and pulls "
                "travel in float32)"
            )
        # every rank agrees on the server's optimizer, or every rank refuses
        built = server_optimizer.gather(ctx, server_optimizer.describe(owner.optimizer))
        server_optimizer.server_config(ctx.config, ctx.optimizer_settings, built)
        return _Pusher(owner)
    owner.broadcast_from_rank0()  # every rank's protocol starts from rank 0's weights
    sgd = OptimizerConfig(momentum=0.0, weight_decay=0.0, nesterov=False)
    cfg = ctx.config.replace(optimizer=sgd)  # the user's optimizer makes the local step
    protocol = device_protocol(cfg, 1, flatten(owner.params))
    if protocol.shares_weights:
        return _AllReduce(owner)
    return _Exchanging(owner, protocol)
