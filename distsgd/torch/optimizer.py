"""``DistributedOptimizer``: the user's optimizer and model under a distsgd protocol."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distsgd.config import ConfigError
from distsgd.layout import sma_alpha
from distsgd.protocols import SMA, LocalSGD
from distsgd.runtime import ps
from distsgd.runtime.dist import _collective_error
from distsgd.torch.context import Context, _parameters
from distsgd.torch.flat import flatten, flatten_grads, write_back, write_grads

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """Wraps the user's ``torch.optim`` optimizer so that ``step()`` runs the protocol.

    Rules per ``ctx.protocol`` (SPEC.md; W learner ranks, γ the optimizer's current
    ``lr`` of its first param group, P the parameters' total size):

    * ``hardsync`` (§1): the gradients are mean-all-reduced, then the user's optimizer
      steps: DDP's and Horovod's rule, with DDP's overlap: buckets of about
      ``bucket_cap_mb`` MiB, in reverse parameter order, start their all-reduce from
      backward as their gradients become ready and are waited for in ``step()``
      (:class:`_GradientBuckets`).
    * ``local_sgd`` (§5): the user's optimizer steps locally; every H = ``average_every``
      steps the parameters are averaged over the ranks. The counter and the averaging
      are :class:`~distsgd.protocols.LocalSGD`'s (λ = 1 per process, its SGD without
      momentum fed the user's step as the gradient ``w_before − w_after`` at rate 1).
    * ``sma`` (§4, Crossbow): ``c = α (w − z)`` from the weights before the step, the
      user's optimizer steps, ``w ← w − c``, ``z ← z + Σ_ranks c + μ_z (z − z_prev)``;
      when γ drops the model is reset to z and the optimizer's state cleared. The replica
      and z are :class:`~distsgd.protocols.SMA`'s (k = 1, fed ``(w_before − w_after)/γ``
      at rate γ), so z is the trainer's central model.
    * ``parameter_server`` / ``compute_groups`` (§2, §3): ``step()`` pushes the gradient
      with γ as the base rate α0 to the server (:meth:`Context.serve`), which applies the
      protocol's rule (staleness, softsync's α0/n, its own momentum) in arrival order,
      and loads the weights pulled back into the model; the user's optimizer is not
      stepped (the server's is the update rule). A compute group all-reduces its
      members' gradients first; its leader talks to the server.

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
        RuntimeError: on a server rank (it calls ``ctx.serve``); from :meth:`step`:
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
        self.optimizer = optimizer
        self.ctx = ctx
        self.params = _parameters(model)
        self.buffers = (
            [b for b in model.buffers() if b.is_floating_point()]
            if isinstance(model, nn.Module)
            else []
        )
        self.num_parameters = sum(p.numel() for p in self.params)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._rule: _Rule = _RULES[ctx.protocol](self)
        ctx.optimizer = self

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (an LR scheduler may change them)."""
        return self.optimizer.param_groups

    @property
    def lr(self) -> float:
        """γ: the wrapped optimizer's current ``lr`` (first param group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def stopped(self) -> bool:
        """True once the parameter server refused a push (it stopped the run)."""
        return getattr(self._rule, "stopped", False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad`` (hardsync: gradient buckets a backward
        launched without a ``step`` after it are waited for and dropped first)."""
        self._rule.zero_grad()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, loss: float | Tensor | None = None) -> None:
        """One protocol step with the gradients in ``param.grad`` (see the class).

        Args:
            loss: this step's training loss (optional): sent with the push to the
                server (``ServeResult.train_loss``); the synchronous protocols ignore it.
        """
        if isinstance(loss, Tensor):
            loss = loss.detach()
        self._rule.step(float("nan") if loss is None else float(loss))

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
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            raise _collective_error(e, self.ctx.heartbeats) from e

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

    def step(self, loss: float) -> None:
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
    from backward as they become ready (:class:`_GradientBuckets`), waited in ``step``,
    then the user's optimizer steps; buffers are averaged once per step."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        super().__init__(owner)
        owner.broadcast_from_rank0()
        self.buckets = _GradientBuckets(owner)

    def step(self, loss: float) -> None:
        o = self.o
        self.buckets.reduce()
        if o.buffers:
            write_back(o.average(flatten(o.buffers)), o.buffers)
        o.optimizer.step()

    def zero_grad(self) -> None:
        self.buckets.discard()

    def close(self) -> None:
        self.buckets.remove()


class _GradientBuckets:
    """Gradient buckets all-reduced while backward runs, as DDP's reducer does.

    The parameters that require a gradient are packed, in reverse order (the order in
    which backward produces them), into buckets, each closed once it holds
    ``bucket_cap_mb`` MiB or more (the first 1 MiB, DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``;
    a parameter is never split). A
    ``register_post_accumulate_grad_hook`` per parameter marks it ready; a bucket whose
    parameters are all ready is flattened, scaled by 1/W (DDP scales before summing) and
    its all-reduce launched with ``async_op=True``. Buckets launch strictly in bucket
    order, so every rank issues the same sequence of collectives whatever the order its
    hooks fire in. :meth:`reduce` (in ``step``) launches what backward did not (unused
    parameters count as zero gradients), waits for every bucket and writes the mean
    gradients into ``param.grad``.

    A parameter whose gradient accumulates twice before ``step`` (several backward
    passes per step) makes the launched results stale: :meth:`reduce` then waits for
    them, drops them and all-reduces the accumulated gradients once more. As under DDP,
    every rank must run the same number of backward passes per step.
    """

    FIRST_BUCKET_BYTES = 1024 * 1024

    def __init__(self, owner: DistributedOptimizer) -> None:
        self.o = owner
        cap = int(owner.bucket_cap_mb * 1024 * 1024)
        self.buckets: list[list[Tensor]] = []
        size, limit = 0, min(cap, self.FIRST_BUCKET_BYTES)
        for p in reversed([p for p in owner.params if p.requires_grad]):
            if not self.buckets or size >= limit:
                if self.buckets:
                    limit = cap
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient) for b in self.buckets for p in b
        ]
        self._reset()

    def _reset(self) -> None:
        self.ready: list[set[int]] = [set() for _ in self.buckets]
        self.works: list[tuple[Tensor, Any]] = []  # (flat bucket, work), bucket order
        self.stale = False

    def _on_gradient(self, param: Tensor) -> None:
        i = self.bucket_of[id(param)]
        if id(param) in self.ready[i]:
            self.stale = True  # a second backward before step()
            return
        self.ready[i].add(id(param))
        while len(self.works) < len(self.buckets):
            nxt = len(self.works)
            if len(self.ready[nxt]) < len(self.buckets[nxt]):
                break
            self._launch(nxt)

    def _launch(self, i: int) -> None:
        o = self.o
        flat = flatten_grads(self.buckets[i]).mul_(1.0 / o.ctx.world_size)
        work = o.collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM, async_op=True)
        self.works.append((flat, work))

    def reduce(self) -> None:
        """Launch the buckets backward left, wait for all and set ``param.grad`` to the
        ranks' mean gradient. Collective."""
        o = self.o
        while len(self.works) < len(self.buckets):
            self._launch(len(self.works))
        for (flat, work), params in zip(self.works, self.buckets, strict=True):
            o.collective(work.wait)
            if not self.stale:
                write_grads(flat, params)
        if self.stale:  # gradients accumulated after their bucket left: reduce them now
            for params in self.buckets:
                flat = flatten_grads(params).mul_(1.0 / o.ctx.world_size)
                o.collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
                write_grads(flat, params)
        self._reset()

    def discard(self) -> None:
        """Wait for the launched buckets and forget them (``zero_grad`` without a
        ``step``): the next backward starts a fresh round. Collective if any launched."""
        if any(self.ready) or self.works:
            for _, work in self.works:
                self.o.collective(work.wait)
            self._reset()

    def remove(self) -> None:
        """Remove the hooks (the optimizer is closed)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _Averaging(_Rule):
    """local SGD through :class:`LocalSGD` (λ = 1 here; the ranks' mean every H)."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        super().__init__(owner)
        owner.broadcast_from_rank0()
        p = owner.ctx.config.protocol
        self.protocol = LocalSGD(flatten(owner.params), 1, average_every=p.average_every)

    def step(self, loss: float) -> None:
        o, proto = self.o, self.protocol
        before = flatten(o.params)
        o.optimizer.step()
        if proto.local_step(before.sub_(flatten(o.params)).unsqueeze(0), 1.0):
            flat = o.average(o.with_buffers(proto.replicas[0].clone()))
            proto.apply_average(flat[: o.num_parameters])
            o.take_buffers(flat)
        write_back(proto.learner_weights(0), o.params)

    def eval_weights(self) -> Tensor:
        proto = self.protocol
        if proto.iteration % proto.average_every == 0:
            return proto.eval_weights()
        return self.o.average(proto.replicas[0].clone())

    def state_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.protocol.load_state_dict(state["protocol"])
        write_back(self.protocol.learner_weights(0), self.o.params)


class _CentralModel(_Rule):
    """SMA through :class:`SMA` (k = 1 here; the corrections summed over the ranks)."""

    def __init__(self, owner: DistributedOptimizer) -> None:
        super().__init__(owner)
        owner.broadcast_from_rank0()
        p = owner.ctx.config.protocol
        self.protocol = SMA(
            flatten(owner.params),
            1,
            replicas_per_device=1,
            alpha=sma_alpha(p.alpha, p.num_learners),
            central_momentum=p.central_momentum,
        )
        self.last_lr = -1.0  # as SMA's: none yet

    def step(self, loss: float) -> None:
        o, proto = self.o, self.protocol
        lr = o.lr
        if lr < self.last_lr:  # Crossbow: back to z, local state cleared (SMA does alike)
            write_back(proto.eval_weights(), o.params)
            o.optimizer.state.clear()
        before = flatten(o.params)
        o.optimizer.step()
        moved = before.sub_(flatten(o.params))
        direction = moved.div_(lr) if lr > 0 else moved.zero_()
        correction = proto.local_step(direction.unsqueeze(0), lr)[0]
        flat = o.with_buffers(correction)
        o.collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
        proto.apply_central(flat[: o.num_parameters])
        flat[o.num_parameters :].div_(o.ctx.world_size)
        o.take_buffers(flat)
        write_back(proto.learner_weights(0), o.params)
        self.last_lr = lr

    def eval_weights(self) -> Tensor:
        return self.protocol.eval_weights()

    def state_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol.state_dict(), "last_lr": self.last_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.protocol.load_state_dict(state["protocol"])
        self.last_lr = float(state["last_lr"])
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

    def step(self, loss: float) -> None:
        if self._closed:
            if self.stopped:
                return
            raise RuntimeError("step() after close()")
        o = self.o
        self._grads.put((flatten_grads(o.params), [o.lr, loss]))
        self._take(self._weights.get())

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


_RULES: dict[str, type[_Rule]] = {
    "hardsync": _AllReduce,
    "local_sgd": _Averaging,
    "sma": _CentralModel,
    "parameter_server": _Pusher,
    "compute_groups": _Pusher,
}
"""The learner-side rule of each protocol the drop-in runs (``DROP_IN_PROTOCOLS``)."""
