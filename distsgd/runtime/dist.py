"""The ``dist`` runtime: every protocol on real processes through torch.distributed (c10d).

The same protocol objects as the simulated cluster run here (docs/real-processes.md); only
the transport differs. Rank layout and rules (docs/protocols.md §1–§5):

* synchronous protocols (:class:`~distsgd.protocols.SynchronousProtocol`) run in lock
  step and carry out the all-reduce each iteration names
  (:meth:`~distsgd.protocols.SynchronousProtocol.exchange_step`, :func:`all_reduce`);
  this module knows no protocol class. Where the learners share weights (hardsync,
  plain: one learner per rank) the model is wrapped in
  :class:`torch.nn.parallel.DistributedDataParallel`, whose backward all-reduces (mean)
  the gradient into the engine's flat gradient buffer, and every rank applies it with its
  own copy of the protocol (:func:`hardsync_step`). Replicated protocols (SMA, local SGD)
  run one rank per device holding its k replicas in a process-local protocol object
  (``num_learners = k``, :func:`device_protocol`): SMA all-reduces the per-device sums of
  its corrections every iteration (Crossbow §4), local SGD the sum of the replicas every
  H iterations. With
  ``replicas_per_device = "auto"`` every rank feeds the auto-tuner the same measurement
  (:meth:`SyncDistRuntime.max_over_ranks` of the interval's wall seconds) and so takes
  the same decision, applied at the same synchronisation point
  (:meth:`SyncDistRuntime.set_replicas_per_device`).
* ``parameter_server`` / ``compute_groups`` — server ranks ``0 … S−1`` run the protocol
  object on real arrivals, learner ranks ``S … S+λ−1`` pull, compute and push over c10d
  point-to-point (:mod:`distsgd.runtime.ps`); a compute group's members all-reduce
  inside their process subgroup and the group's leader talks to the server.

Learner l (global index; ``rank·k + j`` for replica j of a device rank) draws the same
minibatches as learner l of the simulator (:class:`~distsgd.data.ShardedSampler` with the
run's seed), and every rank builds the model under the same seed, so the initial weights
are equal.

Rank 0 (the coordinating server for parameter-server protocols) evaluates, writes the run
directory and decides when to stop; the decision is broadcast, other ranks write nothing.
Before every evaluation of a model with BatchNorm running statistics they are recomputed
for the evaluated weights on a seeded slice of the training set (precise BN,
:meth:`GradientEngine.recalibrate`), by every rank of the synchronous protocols together
or by the coordinator: the simulator's rule, for every protocol.
``virtual_time`` is measured wall time here (there is no virtual clock).

Devices (``train.device``; :func:`collective_backend` for the backend). Each rank's engine
lives on its device; what crosses the host per protocol:

* hardsync / plain: nothing; DDP (``device_ids`` = the rank's GPU) all-reduces the
  gradient buckets where they are (NCCL with distinct GPUs, gloo otherwise).
* SMA / local SGD: nothing; replica stacks, corrections and averages stay on the device
  and are all-reduced there.
* parameter server / compute groups: the server ranks keep the central model and its
  state in host memory; a learner's gradient is mean-all-reduced inside its compute group
  on the device, then staged into one pinned host buffer (:class:`ps.HostStaging`) for the gloo
  push; pulled weights arrive in host memory and the engine copies them onto the device.
* bookkeeping collectives (stop flags, losses, evaluation sums of CPU tensors) go through
  gloo.

Faults for tests and benches (a rank killed or stopped, a slow learner, random stalls)
are injected through the constructor (:class:`~distsgd.runtime.faults.RankFaults`);
nothing is read from the environment for them. A straggler's sleep follows each gradient
of a learner rank (:meth:`~distsgd.runtime.faults.RankFaults.straggle`) and is counted in
that rank's wall seconds of training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
import queue
import re
import socket
import statistics
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel

from distsgd.config import ConfigError, RunConfig, required_processes, resolve_device
from distsgd.data import (
    Dataset,
    ElasticShards,
    LearnerStream,
    ShardedSampler,
    Split,
    reshard_streams,
)
from distsgd.engine import GradientEngine, bn_recalibration_inputs
from distsgd.layout import build_protocol, protocols_with, sma_alpha, spec_for
from distsgd.protocols.base import AllReduce, AsynchronousProtocol, SynchronousProtocol
from distsgd.runtime import ps
from distsgd.runtime.base import (
    Runtime,
    Tick,
    TrainingDiverged,
    check_losses,
    draw_minibatches,
    time_in_turn,
)
from distsgd.runtime.compression import (
    POWERSGD_START,
    all_reduce_compressed,
    exchange_bytes,
    powersgd_values,
    ring_allreduce_bytes,
    wire_dtype,
)
from distsgd.runtime.faults import RankFaults
from distsgd.runtime.launch import (
    ENV_RUN,
    Heartbeats,
    PeerLost,
    arm_exit_deadline,
    end_with_parent,
    heartbeat_silence,
    join_namespace,
    namespace,
    store_namespace,
)
from distsgd.runtime.rendezvous import ENV_SECRET, join_run, post_refusal, run_store

__all__ = [
    "ProcessInfo",
    "PeerLost",
    "Heartbeats",
    "end_with_parent",
    "arm_exit_deadline",
    "check_same_config",
    "process_info",
    "join",
    "process_group_store",
    "refuse_to_join",
    "init_process_group",
    "collective",
    "collective_backend",
    "build_runtime",
    "calibrate_iteration",
    "all_reduce",
    "device_protocol",
    "draw_minibatches",
    "hardsync_step",
    "SyncDistRuntime",
    "PSDistRuntime",
    "elastic_refusal",
    "join_running_run",
    "learner_steps",
]


def _flat_settings(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flat_settings(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def check_same_config(cfg: RunConfig) -> None:
    """Collective: every rank's resolved config must equal rank 0's.

    Raises:
        ConfigError: on every rank, naming each differing setting with its value on rank
            0 and on the first rank where it differs (e.g. torchrun nodes started with
            different ``--set`` values).
    """
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, cfg.to_toml())
    if all(t == texts[0] for t in texts):
        return
    ref = _flat_settings(tomllib.loads(texts[0]))
    diffs = []
    for r, text in enumerate(texts[1:], start=1):
        mine = _flat_settings(tomllib.loads(text))
        for key in sorted(set(ref) | set(mine)):
            if ref.get(key) != mine.get(key) and not any(d[0] == key for d in diffs):
                diffs.append((key, ref.get(key), r, mine.get(key)))
    what = "; ".join(f"{k} = {a!r} on rank 0, {b!r} on rank {r}" for k, a, r, b in diffs)
    raise ConfigError(
        f"the ranks' settings differ: {what}; every node must run the same config (same "
        "file and --set values)"
    )


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run (from the launcher's environment variables).

    Attributes:
        rank: global rank in ``[0, world_size)``.
        world_size: processes in the run.
        local_rank: rank on this machine.
        local_world_size: processes on this machine (shares the CPU cores).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def process_info() -> ProcessInfo | None:
    """The rank layout set by torchrun or :mod:`distsgd.launch`, or None when this
    process was not started by a launcher (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return ProcessInfo(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


# NCCL for CUDA tensors, gloo for CPU ones: the bookkeeping collectives (stop flags, loss
# sums, heartbeats) and the parameter server's point-to-point messages stay on gloo.
NCCL_WITH_GLOO = "cpu:gloo,cuda:nccl"


def collective_backend(cfg: RunConfig, info: ProcessInfo) -> str:
    """The c10d backend string of the run's process group (``dist.backend``).

    ``gloo`` when the model trains on the CPU, when ``dist.backend = "gloo"``, and under
    ``"auto"`` when this machine's ranks outnumber its GPUs (several ranks share a GPU:
    NCCL refuses two ranks on one device); else ``"cpu:gloo,cuda:nccl"``: NCCL carries
    the all-reduces of CUDA tensors (DDP's gradient buckets, SMA's corrections, local
    SGD's averages, a compute group's gradients), gloo the CPU tensors. The choice
    depends only on settings and the machine, so every rank of a machine makes the same.
    """
    device = resolve_device(cfg.train.device, info.local_rank)
    if cfg.dist.backend == "gloo" or device.type != "cuda":
        return "gloo"
    if cfg.dist.backend == "nccl":
        return NCCL_WITH_GLOO
    shared = cfg.train.device.startswith("cuda:") and info.local_world_size > 1
    if shared or info.local_world_size > torch.cuda.device_count():
        return "gloo"
    return NCCL_WITH_GLOO


def init_process_group(cfg: RunConfig, info: ProcessInfo) -> str:
    """Join the run's c10d process group (``env://`` rendezvous, the backend of
    :func:`collective_backend`, logged by rank 0 when it trains on a GPU); returns the
    backend.

    Collectives and point-to-point messages time out after ``dist.timeout_s`` seconds.
    The rank ends when its launcher dies (:func:`end_with_parent`), and every rank's
    resolved config must equal rank 0's (:func:`check_same_config`).

    Raises:
        ConfigError: ``dist.num_processes`` (or the launcher's world size) differs from
            what the protocol needs; the ranks' configs differ; the join refused the run
            (:func:`join`).
    """
    need, why = required_processes(cfg.protocol, cfg.dist)
    if info.world_size != need:
        raise ConfigError(
            f"the launcher started {info.world_size} processes but protocol "
            f"{cfg.protocol.name!r} needs {need} ({why}); set --nproc-per-node × --nnodes "
            f"= {need}, or pass --num-processes {info.world_size} to fit the layout to it"
        )
    backend = collective_backend(cfg, info)
    device = resolve_device(cfg.train.device, info.local_rank)
    if device.type == "cuda":  # NCCL's communicators and DDP use the current device
        torch.cuda.set_device(device)
    if info.rank == 0 and device.type != "cpu":  # on the CPU: gloo, as config.toml says
        print(
            f"dist: backend {backend} (dist.backend = {cfg.dist.backend!r}), rank 0 on "
            f"{device} (train.device = {cfg.train.device!r})",
            file=sys.stderr,
        )
    if not dist.is_initialized():
        end_with_parent(cfg.dist.timeout_s + 5)
        join(cfg.dist.timeout_s, info)
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        # distsgd's ranks join a fresh process group for each run, its keys apart
        dist.init_process_group(
            backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            store=process_group_store(info.rank, timeout),
        )
        try:
            check_same_config(cfg)
        except (RuntimeError, dist.DistError) as e:
            raise _collective_error(e) from e
        except ConfigError:
            dist.destroy_process_group()
            raise
    return backend


def process_group_store(rank: int, timeout: timedelta) -> dist.PrefixStore:
    """The process group's view of the run's store at ``MASTER_ADDR:MASTER_PORT``
    (:func:`~distsgd.runtime.rendezvous.run_store`: hosted by rank 0 where no launcher
    hosts it): its keys under ``<namespace>pg/`` (:func:`store_namespace`), apart from
    the keys of a distsgd rank's earlier runs, of the launcher and torchrun's agents, and,
    with a run secret, of anyone who cannot name the namespace."""
    return dist.PrefixStore(store_namespace() + "pg", run_store(rank, timeout.total_seconds()))


def joins_run() -> bool:
    """Whether this rank passes the join (:func:`join`): ranks started by torchrun or
    ``distsgd.torch.launch``, not by distsgd's own launcher (:data:`ENV_RUN`; one machine,
    its store on ``dist.master_addr`` only)."""
    return not os.environ.get(ENV_RUN)


def join(timeout_s: float, info: ProcessInfo) -> None:
    """The run's join where :func:`joins_run` (the run secret proved to rank 0, every rank
    on time: :func:`~distsgd.runtime.rendezvous.join_run`).

    Raises:
        ConfigError: the join refused the run (one line naming the rank and its host).
    """
    if joins_run():
        join_run(join_namespace(), info.rank, info.world_size, timeout_s)


def refuse_to_join(message: str, timeout_s: float) -> None:
    """Tell rank 0 in the join why this rank ends before it (``message``: one line), so
    that rank 0 names it instead of waiting ``timeout_s`` in vain (best effort)."""
    info = process_info()
    if info is not None and joins_run():
        post_refusal(join_namespace(), info.rank, message, timeout_s)


def _collective_error(e: Exception, heartbeats: Heartbeats | None = None) -> PeerLost:
    """A c10d failure as :class:`PeerLost`, with gloo's source location and advice cut;
    with ``heartbeats``, naming the ranks that stopped making progress (blocks a few
    seconds to tell)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
    silent = heartbeats.silent_ranks() if heartbeats is not None else []
    hung = (
        f"; rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped "
        "making progress (no heartbeat)"
        if silent
        else ""
    )
    return PeerLost(f"lost contact with another rank ({text}){hung}", silent)


def collective(
    heartbeats: Heartbeats | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, a c10d call, with its failure raised as :class:`PeerLost`
    naming the ranks whose ``heartbeats`` stopped (:func:`_collective_error`)."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        raise _collective_error(e, heartbeats) from e


class _DistBase(Runtime):
    """What every dist runtime shares: rank, writer role, timing and the test hooks."""

    clock = "wall"
    failure_types: tuple[type[BaseException], ...] = (PeerLost,)

    def __init__(
        self,
        cfg: RunConfig,
        engine: GradientEngine,
        dataset: Dataset,
        faults: RankFaults | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.dataset = dataset
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.batch_size = cfg.protocol.batch_size
        self.samples = 0
        self.virtual_time = 0.0  # measured wall seconds of training
        self.steps = 0
        self.faults = faults or RankFaults()
        self.faults.start(self.rank)
        self.heartbeats = Heartbeats(self.rank, self.world_size, cfg.dist.timeout_s)

    @property
    def is_writer(self) -> bool:
        """True on the rank that evaluates and writes the run directory (rank 0)."""
        return self.rank == 0

    def _tick_hook(self) -> None:
        self.steps += 1
        self.faults.step(self.rank, self.steps)

    @property
    def clock_s(self) -> float:
        """Measured wall seconds of training on this rank."""
        return self.virtual_time

    def summary_fields(self) -> dict[str, Any]:
        return {"num_processes": self.world_size, "events": list(getattr(self, "events", []))}

    def share_with_all(self, obj: Any) -> Any:
        """Collective over every rank of the run: ``obj`` of rank 0."""
        box = [obj]
        self._collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return collective(self.heartbeats, fn, *args, **kwargs)

    def close(self) -> None:
        """Leave the process group (and stop this rank's heartbeat). What holds the group
        is freed first: a DDP Reducer freed after ``destroy_process_group`` can deadlock
        in ``~ProcessGroupGloo`` (a pooled rank hung there when its previous run's runtime
        was collected during the next run: :class:`~distsgd.launch.RankPool`)."""
        self.heartbeats.close()
        self._free_group_users()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _free_group_users(self) -> None:
        """Drop the references this runtime holds to the process group (subclasses)."""


def ddp_no_forward_buffer_sync(ddp_init: Callable[..., Any]) -> dict[str, bool]:
    """DDP's keyword for "no buffer broadcast before each forward", given its
    ``__init__``: ``forward_sync_buffers`` since torch 2.13 (where ``broadcast_buffers``
    is deprecated), ``broadcast_buffers`` in the releases before."""
    if "forward_sync_buffers" in inspect.signature(ddp_init).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def hardsync_step(
    engine: GradientEngine,
    proto: SynchronousProtocol,
    x: Tensor,
    y: Tensor,
    lr: float,
    module: torch.nn.Module | None,
    check: Callable[[list[float]], None],
) -> list[float]:
    """One iteration of a learner of a protocol whose learners share weights
    (``proto.shares_weights``: hardsync, plain) on its minibatch ``x`` ``[b, ...]``,
    ``y``: the gradient through ``module`` (the DDP wrapper, whose backward all-reduces
    it; None: the bare model), ``check`` of its losses, then the protocol's update of the
    flat weights. Returns the losses."""
    grad, losses = engine.gradient(proto.learner_weights(0), x, y, module=module)
    check(losses)
    proto.apply_mean_gradient(grad, lr)
    return losses


@contextlib.contextmanager
def _solo_process_group() -> Iterator[bool]:
    """A gloo process group of this process alone (world size 1, an in-memory store) for
    the duration; yields False, and makes none, when one exists already or it cannot be
    made (then a DDP wrapper cannot be timed)."""
    made = False
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            made = True
        except (RuntimeError, ValueError, dist.DistError):
            made = False
    try:
        yield made
    finally:
        if made:
            gc.collect()  # a DDP Reducer freed after the group can deadlock (close())
            dist.destroy_process_group()


def calibrate_iteration(
    cfg: RunConfig,
    dataset: Dataset,
    make_engine: Callable[[], GradientEngine],
    repeats: int = 20,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """Seconds a synchronous learner works per iteration beyond its gradient, on this
    machine with this process's threads (``cluster.seconds_per_iteration``).

    Times the real hardsync iteration of :class:`SyncDistRuntime` at world size 1
    (:func:`draw_minibatches`, the gradient through the DDP wrapper of a one-process gloo
    group, the protocol's update of the flat weights: :func:`hardsync_step`) and, in turn
    with it in the same process, the bare gradient of a second engine at the same b;
    returns ``statistic(iteration) − statistic(gradient)``, at least 0. One-process
    all-reduce is a copy, not a network (the simulator charges the all-reduce apart).
    Where a process group exists already, or the wrapper fails to run, it is left out
    (the update and the draw are still timed; not tried on a GPU yet). ``make_engine``
    builds a throwaway engine of the run's model (it is called twice); the protocol is a
    throwaway hardsync of ``cfg``'s optimizer at λ = 1.
    SMA and local SGD are charged this figure too, though their iteration differs (no DDP
    wrapper; k replicas' local steps): an approximation, not a measurement of their path.

    Returns:
        seconds per iteration (>= 0).
    """
    p = cfg.protocol
    solo = cfg.replace(
        protocol=dataclasses.replace(p, name="hardsync", num_learners=1, replicas_per_device=1),
        dist=dataclasses.replace(cfg.dist, num_processes=0),
    )
    plain, stepped = make_engine(), make_engine()
    proto = cast(SynchronousProtocol, build_protocol(solo, stepped.initial_weights()))
    stream = LearnerStream(ShardedSampler(dataset.num_train, 1, p.batch_size, 0), 0)
    x0, y0 = dataset.train.batch(torch.arange(min(p.batch_size, dataset.num_train)))
    w = plain.initial_weights()
    lr = cfg.optimizer.lr
    with _solo_process_group() as grouped:
        ddp = _ddp(stepped) if grouped else None

        def step() -> None:
            x, y = draw_minibatches([stream], dataset)
            hardsync_step(stepped, proto, x[0], y[0], lr, ddp, lambda losses: None)

        fns = [step, lambda: plain.gradient(w, x0, y0)]
        try:
            times = time_in_turn(fns, repeats, plain.device, warmup=2)
        except (RuntimeError, dist.DistError):
            if ddp is None:
                raise
            ddp = None  # the wrapper cannot run here (e.g. gloo on this device): without it
            times = time_in_turn(fns, repeats, plain.device, warmup=2)
        ddp = None  # freed before the group (_solo_process_group)
    return max(statistic(times[0]) - statistic(times[1]), 0.0)


def _cast_hook(dtype: torch.dtype, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: the bucket divided by the world size, cast to ``dtype``, all-reduced
    in it and cast back into the bucket: the rule of torch's ``bf16_compress_hook`` /
    ``fp16_compress_hook`` (ddp_comm_hooks.default_hooks), which DDP registers only on
    NCCL for bfloat16; gloo all-reduces bfloat16 and float16 on the CPU."""
    buffer = bucket.buffer()
    wire = buffer.div(dist.get_world_size()).to(dtype)
    future = dist.all_reduce(wire, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[Any]) -> Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


# DDP checks a hook's annotations as objects; this module's are strings (postponed)
_cast_hook.__annotations__ = {
    "dtype": torch.dtype,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[Tensor],
}


def _ddp(
    engine: GradientEngine, compression: str = "none", powersgd_rank: int = 1
) -> DistributedDataParallel:
    """``engine``'s model in the DDP wrapper :class:`SyncDistRuntime` uses (the process
    group must exist), its gradient buckets all-reduced in ``compression``'s format
    (:func:`_cast_hook`) when it is ``"bf16"`` or ``"fp16"``, or by torch's
    ``powerSGD_hook`` of rank ``powersgd_rank`` when it is ``"powersgd"``."""
    on_gpu = engine.device.type == "cuda"
    ddp = DistributedDataParallel(
        engine.model,
        device_ids=[engine.device] if on_gpu else None,
        **ddp_no_forward_buffer_sync(DistributedDataParallel.__init__),
    )
    if compression == "powersgd":
        state = powerSGD.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=POWERSGD_START,
        )
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    elif compression != "none":
        ddp.register_comm_hook(wire_dtype(compression), _cast_hook)
    return ddp


def device_protocol(cfg: RunConfig, replicas: int, initial: Tensor) -> SynchronousProtocol:
    """The synchronous protocol object of one device (a rank of the dist runtime, a
    drop-in process) holding ``replicas`` of ``cfg``'s learners, starting from ``initial``
    ``[P]``; SMA's α = 0 still means 1 / (all learners of all devices) (docs/protocols.md §4), not
    1 / ``replicas``."""
    p = cfg.protocol
    local = cfg.replace(
        protocol=dataclasses.replace(
            p, num_learners=replicas, alpha=sma_alpha(p.alpha, p.num_learners)
        ),
        dist=dataclasses.replace(cfg.dist, num_processes=0),
    )
    return cast(SynchronousProtocol, build_protocol(local, initial))


def all_reduce(
    exchange: AllReduce, world_size: int, group: Any = None, compression: str = "none"
) -> Tensor:
    """Collective: ``exchange``'s total over the ranks of ``group`` (None: all), each
    holding as many rows: this rank's rows summed, one c10d all-reduce (sum), divided by
    the rows of all ranks for a mean; in the wire format of ``compression`` when it is
    not ``"none"`` (:func:`~distsgd.runtime.compression.all_reduce_compressed`). Returns
    a new tensor ``[P]`` on the payload's device."""
    if compression != "none":
        return all_reduce_compressed(exchange, world_size, compression, group)
    total = exchange.payload.sum(0)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if exchange.mean:
        total.div_(exchange.payload.shape[0] * world_size)
    return total


class SyncDistRuntime(_DistBase):
    """hardsync / plain (DDP), SMA and local SGD on real processes; surface of SimRuntime.

    Every rank runs the training loop in lock step; :meth:`advance` is one iteration of
    all λ learners (``samples`` counts all of them).

    Raises:
        PeerLost: from :meth:`advance` and the collectives, when a rank is gone.
        TrainingDiverged: a local learner's loss is NaN or infinite.
    """

    def __init__(
        self,
        cfg: RunConfig,
        engine: GradientEngine,
        dataset: Dataset,
        initial: Tensor,
        faults: RankFaults | None = None,
    ) -> None:
        super().__init__(cfg, engine, dataset, faults)
        p = cfg.protocol
        self.num_learners = p.num_learners
        self.replicated = spec_for(p).replicated
        self.k = p.initial_replicas_per_device if self.replicated else 1  # "auto": k = 1
        self.protocol = (
            device_protocol(cfg, self.k, initial)
            if self.replicated
            else cast(SynchronousProtocol, build_protocol(cfg, initial))
        )
        self.learners = [self.rank * self.k + j for j in range(self.k)]
        self.replicas_per_device = self.k
        self.sampler = ShardedSampler(
            dataset.num_train, p.num_learners, p.batch_size, cfg.train.seed
        )
        self.streams = [LearnerStream(self.sampler, lrn) for lrn in self.learners]
        self._solo_evals = 0  # evaluations rank 0 ran alone (BatchNorm)
        self.ddp: torch.nn.Module | None = None
        self.compression = p.compression
        if self.protocol.shares_weights:
            # no buffer broadcast: training forwards normalise with their batch's
            # statistics, and evaluation recomputes the running ones (evaluate)
            self.ddp = _ddp(engine, p.compression, p.powersgd_rank)
        self._exchanges = 0  # all-reduces this process ran (PowerSGD's first are float32)

    def _free_group_users(self) -> None:
        self.ddp = None  # its Reducer holds the process group
        gc.collect()  # the wrapper sits in reference cycles

    def set_replicas_per_device(self, replicas_per_device: int) -> None:
        """Change k, this rank's replicas, between synchronous iterations (the auto-tuner;
        every rank at the same iteration): λ becomes world size × k, this rank's learners
        ``rank·k + j`` and the data streams are re-sharded for the new λ exactly as
        :meth:`SimRuntime.set_replicas_per_device` does (the run continues at the first
        step of the new layout at or after the samples already drawn this epoch), so
        learner l draws the simulator's minibatches. The protocol is changed by the
        caller (its ``set_replicas_per_device``).

        Raises:
            ValueError: k < 1.
            RuntimeError: the protocol holds no replicas (hardsync, plain).
        """
        if not self.replicated:
            raise RuntimeError(
                "replicas per device can change only for protocols " + protocols_with("replicated")
            )
        if not isinstance(replicas_per_device, int) or replicas_per_device < 1:
            raise ValueError(
                f"replicas_per_device = {replicas_per_device!r} is not allowed: expected an "
                "integer >= 1"
            )
        k = replicas_per_device
        lam = self.world_size * k
        self.sampler, self.streams = reshard_streams(
            self.streams[0], lam, [self.rank * k + j for j in range(k)]
        )
        self.k = self.replicas_per_device = k
        self.num_learners = lam
        self.learners = [s.learner for s in self.streams]

    def max_over_ranks(self, value: float) -> float:
        """Collective: the largest ``value`` over the ranks (float64), e.g. the wall
        seconds of a synchronisation interval, which the slowest rank sets."""
        t = torch.tensor([value], dtype=torch.float64)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def _minibatches(self) -> tuple[Tensor, Tensor]:
        return draw_minibatches(self.streams, self.dataset)

    def advance(self, lr: float) -> Tick:
        """One synchronous iteration of all λ learners; returns this rank's losses."""
        self._tick_hook()
        t0 = time.perf_counter()
        proto = self.protocol
        x, y = self._minibatches()
        exchange: AllReduce | None = None
        try:
            if proto.shares_weights:  # DDP's backward all-reduces the mean gradient
                losses = hardsync_step(
                    self.engine,
                    proto,
                    x[0],
                    y[0],
                    lr,
                    self.ddp,
                    lambda losses: check_losses(self.learners, losses, lr, self.samples),
                )
            else:
                grads, losses = self.engine.replica_gradients(proto.replicas.clone(), x, y)
                check_losses(self.learners, losses, lr, self.samples)
                exchange = proto.exchange_step(grads, lr)
                if exchange is not None:
                    exchange.apply(
                        all_reduce(exchange, self.world_size, compression=self.compression)
                    )
            if proto.shares_weights or exchange is not None:
                self.bytes_sent += self._exchange_bytes()
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, TrainingDiverged):
                raise
            raise _collective_error(e, self.heartbeats) from e
        n = self.num_learners * self.batch_size
        self.samples += n
        self.faults.straggle(self.rank, time.perf_counter() - t0)  # a straggler's sleep
        seconds = time.perf_counter() - t0
        seconds = self.faults.iteration_seconds(self.rank, self.replicas_per_device, seconds)
        self.virtual_time += seconds
        return Tick(n, losses)

    def _exchange_bytes(self) -> int:
        """Bytes this iteration's exchange sent, all ranks together: the ring's, the int8
        all-gather's, or PowerSGD's factors (float32 for its first iterations)."""
        self._exchanges += 1
        p = self.engine.num_parameters
        if self.compression != "powersgd":
            return exchange_bytes(self.world_size, p, self.compression)
        if self._exchanges > POWERSGD_START:
            shapes = [q.shape for q in self.engine.model.parameters() if q.requires_grad]
            p = powersgd_values(shapes, self.cfg.protocol.powersgd_rank)
        return exchange_bytes(self.world_size, p, "none")

    def eval_weights(self) -> Tensor:
        """The model to evaluate, shape ``[P]`` (collective for local SGD between
        averagings: the mean of all ranks' replicas)."""
        exchange = self.protocol.eval_exchange()
        if exchange is None:
            return self.protocol.eval_weights()
        return exchange.apply(self._collective(all_reduce, exchange, self.world_size))

    def evaluate(self, weights: Tensor, split: Split, batch_size: int) -> tuple[float, float]:
        """Collective: the metric and the mean loss of ``weights`` on ``split``, each rank
        evaluating a contiguous slice; the per-sample sums add up in float64 (accuracy's
        right-prediction counts exactly; the simulator's single-process loss sum may
        differ in its last bits).

        A model with BatchNorm running statistics first gets them recomputed for
        ``weights`` on the recalibration slice of the training set, as on the simulator
        (:meth:`SimRuntime.evaluate`): each rank sums the batch statistics of its share of
        the slice's batches, one all-reduce adds them up (float64), and every rank loads
        the same mean (:meth:`_recalibrate`). Models whose normalisation layers keep no
        running statistics (they normalise with the evaluation batch's) are evaluated on
        rank 0 alone, as one process would cut the test set into batches; the others wait
        for it as long as its heartbeat goes on (:meth:`Heartbeats.wait_for`: the
        evaluation's own length, not ``timeout_s``).
        """
        n = split.num_samples
        if self.engine.has_running_statistics:
            self._recalibrate(weights, batch_size)
        if self.engine.evaluates_with_batch_statistics:
            self._solo_evals += 1
            done = f"evaluated/{self._solo_evals}"
            if not self.is_writer:
                self.heartbeats.wait_for(done, 0)
                return 0.0, 0.0
            metric, loss = self.engine.evaluate(weights, split, batch_size)
            self.heartbeats.post(done)
            return metric, loss
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        t = torch.zeros(2, dtype=torch.float64)
        if hi > lo:
            metric_sum, loss_sum, _ = self.engine.evaluation_sums(
                weights, split, batch_size, lo, hi
            )
            t[0], t[1] = metric_sum, loss_sum
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
        metric_sum, loss_sum = float(t[0]), float(t[1])
        return self.engine.metric.value(metric_sum, loss_sum, n), loss_sum / n

    def _recalibrate(self, weights: Tensor, batch_size: int) -> None:
        """Collective: BatchNorm statistics of ``weights`` ``[P]`` over the recalibration
        slice, shared out by whole batches (rank r takes batches ``⌊m·r/W⌋ …
        ⌊m·(r+1)/W⌋ − 1`` of m), summed in float64 over the ranks and loaded on every
        rank: the simulator's statistics up to float64 summation order."""
        xs, b = bn_recalibration_inputs(
            self.dataset, self.cfg.train.bn_recalibration_samples, batch_size, self.cfg.train.seed
        )
        m, w, r = xs.shape[0] // b, self.world_size, self.rank
        mine = xs[b * (m * r // w) : b * (m * (r + 1) // w)]
        sums = self.engine.batch_statistics_sums(weights, mine, b)
        self._collective(dist.all_reduce, sums, op=dist.ReduceOp.SUM)
        self.engine.load_batch_statistics(sums)

    share = _DistBase.share_with_all  # every rank runs the training loop

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def reduce_losses(self, loss_sum: float, count: int) -> tuple[float, int]:
        t = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
        return float(t[0]), int(t[1])

    def state_dict(self) -> dict[str, Any] | None:
        """Collective: every rank's protocol state and data positions, gathered on rank 0
        (``None`` on the others)."""
        mine = {
            "protocol": self.protocol.state_dict(),
            "streams": [s.state_dict() for s in self.streams],
        }
        out: list[Any] | None = [None] * self.world_size if self.is_writer else None
        self._collective(dist.gather_object, mine, out, dst=0)
        if not self.is_writer:
            return None
        return {
            "world_size": self.world_size,
            "samples": self.samples,
            "virtual_time": self.virtual_time,
            "replicas_per_device": self.k,
            "bytes_sent": self.bytes_sent,
            "ranks": out,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict` (every rank gets the whole)."""
        if state.get("world_size") != self.world_size:
            raise ConfigError(
                f"cannot resume: the checkpoint was written by {state.get('world_size')} "
                f"processes, this run has {self.world_size}"
            )
        mine = state["ranks"][self.rank]
        k = int(state.get("replicas_per_device", self.k))
        if k != self.k:  # the auto-tuner had changed k: rebuild this rank's k streams
            self.set_replicas_per_device(k)
        self.protocol.load_state_dict(mine["protocol"])
        for s, st in zip(self.streams, mine["streams"], strict=True):
            s.load_state_dict(st)
        self.samples = int(state["samples"])
        self.virtual_time = float(state["virtual_time"])
        self.bytes_sent = int(state.get("bytes_sent", 0))


class PSDistRuntime(_DistBase):
    """Parameter server and compute groups on real processes (server ranks + learners).

    On the coordinating server (rank 0) :meth:`advance` hands over one push handled by
    :func:`distsgd.runtime.ps.run_server`, which runs in a background thread and
    waits in its ``on_push`` callback until the training loop has taken the push and
    decided to go on; the loop's ``lr`` is the base rate the server applies. Learner ranks
    and the other server shards do not run the training loop: :meth:`serve` runs their
    side until the coordinator stops the run.

    Raises:
        PeerLost / ps.ServerLost / ps.LearnerLost: a process was lost where the
            protocol cannot go on without it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        engine: GradientEngine,
        dataset: Dataset,
        initial: Tensor,
        faults: RankFaults | None = None,
    ) -> None:
        super().__init__(cfg, engine, dataset, faults)
        self.failure_types = (PeerLost, ps.ServerLost, ps.LearnerLost)
        p = cfg.protocol
        spec = spec_for(p)
        # hardsync with backup learners: one server rank, λ + β learner ranks
        self.num_servers = cfg.dist.num_servers if spec.has_server else 1
        self.num_learners = p.num_learners
        self.num_computing = p.num_learners + p.backup_learners  # learner ranks
        s = self.num_servers
        group_size = spec.group_size(p)
        self.group_size = group_size
        groups = [
            [s + g * group_size + m for m in range(group_size)]
            for g in range(self.num_computing // group_size)
        ]
        self.layout = ps.PSLayout(server_ranks=list(range(s)), worker_groups=groups)
        # every rank creates every subgroup, in the same order (c10d requirement)
        self._subgroups = [dist.new_group(g) if len(g) > 1 else None for g in groups]
        self.is_server = self.rank < s
        # the central model and its state live in host memory: pushes and pulls cross
        # gloo from there (learners stage their gradients, ps.HostStaging), and a learner's
        # engine copies pulled weights onto its device
        initial = initial.cpu()

        def served(weights: Tensor) -> AsynchronousProtocol:
            return cast(AsynchronousProtocol, spec.build_served(p, cfg.optimizer, weights))

        self.full_protocol = served(initial)
        if s > 1 and self.is_server:
            lo, hi = ps.shard_bounds(initial.numel(), s)[self.rank]
            self.protocol = served(initial[lo:hi].clone())
        else:
            self.protocol = self.full_protocol
        self.pushes = [0] * len(groups)  # per worker: pushes handled (= minibatches drawn)
        # learners may join and leave (docs/elastic.md): parameter server without the
        # barrier, one server rank, learners of one rank
        self.elastic = elastic_refusal(cfg) is None
        self.worker_ranks = [list(g) for g in groups]  # joiners: their channel rank
        self.shards: ElasticShards | None = None  # the learners' data positions (elastic)
        if self.elastic:
            sampler = ShardedSampler(
                dataset.num_train, self.num_computing, self.batch_size, cfg.train.seed
            )
            self.shards = ElasticShards(sampler, [0] * self.num_computing)
        self.events: list[str] = []  # what the server logged (lost learners)
        # per worker, its first gradient applied: [version pulled, version applied to, σ]
        self.first_pushes: dict[int, list[int]] = {}
        # the first_pushes of the run's earlier parts, one dict per resume, in order
        self.first_pushes_before: list[dict[str, list[int]]] = []
        self._lost: set[int] = set()  # workers lost (fixed membership: still listed)
        self._closing = False  # interrupted: learners end with it, none is lost
        self._membership: list[dict[str, Any]] = []  # lost workers not yet in a Tick
        self._lr = cfg.optimizer.lr
        self._events: queue.Queue[Any] = queue.Queue()
        self._decisions: queue.Queue[bool] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending = False
        self._last_event: Any = None

    @property
    def runs_training_loop(self) -> bool:
        return self.rank == 0

    def summary_fields(self) -> dict[str, Any]:
        """The base fields, and on the coordinator ``server_seconds_per_push``: the wall
        seconds its server loop worked per push (apply, reply, hand-over to the training
        loop; evaluations included where the run evaluates), ``None`` before two pushes:
        what the simulated cluster's ``cluster.seconds_per_push`` charges; where
        membership is elastic, ``first_pushes``: per worker, its first gradient applied
        since this process started, ``[version pulled, version applied to, σ]``, and after
        a resume ``first_pushes_before_resume``: the ``first_pushes`` of each earlier part
        of the run, in order (worker indices restart at each resume)."""
        fields = super().summary_fields()
        event, before = self._last_event, sum(self.pushes) - 1
        if self.rank == 0:
            per_push = event.busy_s / before if event is not None and before > 0 else None
            fields["server_seconds_per_push"] = per_push
            if self.elastic:
                fields["first_pushes"] = self._first_pushes()
                if self.first_pushes_before:
                    fields["first_pushes_before_resume"] = list(self.first_pushes_before)
        return fields

    def _first_pushes(self) -> dict[str, list[int]]:
        return {str(w): p for w, p in sorted(self.first_pushes.items())}

    def _log(self, message: str) -> None:
        self.events.append(message)
        print(f"distsgd[rank {self.rank}]: {message}", file=sys.stderr)

    def _on_lost(self, worker: int) -> None:
        """The server thread lost ``worker``: a ``membership.jsonl`` record for the next
        tick (seconds of training so far, the server's version then); none once the run
        is interrupted (its learners end with it)."""
        if self._closing:
            return
        self._lost.add(worker)
        self._record("lost", worker)

    def _on_join(self, worker: int, rank: int) -> None:
        """The server thread admitted a joiner (channel rank ``rank``): its record."""
        self.worker_ranks.append([rank])
        self.pushes.append(0)
        self._record("join", worker)

    def _record(self, event: str, worker: int) -> None:
        """A ``membership.jsonl`` record: seconds of training so far, the server's version,
        the active workers (those not lost) and c after the change."""
        active = [w for w in self.protocol.active_workers if w not in self._lost]
        self._membership.append(
            {
                "time_s": self.virtual_time,
                "event": event,
                "worker": worker,
                "ranks": list(self.worker_ranks[worker]),
                "version": self.protocol.version,
                "active_workers": active,
                "gradients_per_update": self._gradients_per_update(),
            }
        )

    def _gradients_per_update(self) -> int:
        """c: the gradients an update takes (λ for hardsync with backup learners)."""
        return int(getattr(self.protocol, "gradients_per_update", self.protocol.workers_needed))

    def join_info(self) -> dict[str, Any] | None:
        """What ``RUN_DIR/join.json`` holds for ``distsgd join`` (docs/elastic.md): the
        run store's address and the run's key namespace without the secret's tag (a
        joiner adds the tag of its own secret); None where learners cannot join."""
        if not self.elastic:
            return None
        return {
            "master_addr": os.environ["MASTER_ADDR"],
            "master_port": int(os.environ["MASTER_PORT"]),
            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            "run": os.environ.get(ENV_RUN, ""),
            "num_learners": self.num_learners,
        }

    def _elastic_server(self) -> dict[str, Any]:
        """run_server's elastic arguments on the coordinator (none where not elastic)."""
        if self.shards is None:
            return {}
        timeout_s = self.cfg.dist.timeout_s
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

        def connect() -> dist.TCPStore:
            return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))

        joins = ps.JoinWatch(connect, store_namespace() + JOIN_KEYS, timeout_s, self._log)
        return {"shards": self.shards, "joins": joins, "on_join": self._on_join}

    # ---- coordinating server ----------------------------------------------------------
    def _on_push(self, event: Any) -> bool:
        self._events.put(event)
        return self._decisions.get()

    def _serve_thread(self, protocol: AsynchronousProtocol, on_push: Any) -> None:
        try:
            result = ps.run_server(
                protocol,
                self.layout,
                on_push=on_push,
                timeout_s=self.cfg.dist.timeout_s,
                log=self._log,
                lr=lambda samples: self._lr,
                on_lost=self._on_lost,
                **self._elastic_server(),
            )
            self._events.put(("finished", result))
        except BaseException as e:  # noqa: BLE001 - handed to the training loop
            self._events.put(("error", e))

    def advance(self, lr: float) -> Tick:
        """Hand over the next push the server handled (blocks until one arrives)."""
        self._tick_hook()
        self._lr = lr
        t0 = time.perf_counter()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve_thread, args=(self.protocol, self._on_push), daemon=True
            )
            self._thread.start()
        elif self._pending:
            self._decisions.put(True)
        item = self._events.get()
        if isinstance(item, tuple):
            kind, payload = item
            self._pending = False
            if kind == "error":
                raise payload
            raise PeerLost(
                f"every learner was lost (ranks {sorted(payload.lost_ranks)}); the server "
                "has nobody left to serve"
            )
        self._pending = True
        event = item
        self._last_event = event
        self.pushes[event.worker] += 1
        if event.update is not None:
            u = event.update
            for (w, v), sigma in zip(u.clock, u.staleness, strict=True):
                self.first_pushes.setdefault(w, [v, u.version - 1, sigma])
        # a backup learner's late push (BackupHardSync) counts no samples and no losses:
        # the step's λ·b samples are those of the gradients it used, as in the simulator
        dropped = getattr(self.protocol, "dropped_gradients", 0) > self.dropped_gradients
        self.dropped_gradients += dropped
        samples, losses = (0, []) if dropped else (event.samples, list(event.losses))
        members = self.worker_ranks[event.worker]
        # the push and its reply (float32) and the group's all-reduce, counted as the
        # simulated cluster counts them; a dropped push crossed the wire too
        p = self.engine.num_parameters
        self.bytes_sent += 2 * p * 4 + ring_allreduce_bytes(len(members), p, "none")
        learners = [r - self.num_servers for r in members]
        if len(losses) == len(learners):
            check_losses(learners, losses, lr, self.samples)
        self.samples += samples
        self.virtual_time += time.perf_counter() - t0
        changes, self._membership = self._membership, []
        return Tick(samples, losses, event.update, changes)

    def evaluate(self, weights: Tensor, split: Split, batch_size: int) -> tuple[float, float]:
        """The metric and the mean loss on the coordinator (the learners go on computing).

        A model with BatchNorm running statistics is evaluated with statistics recomputed
        for ``weights`` (the central model) on the recalibration slice of the training
        set, on the coordinator, exactly as :meth:`SimRuntime.evaluate` does: the server
        never runs a forward, and each learner's own statistics belong to the weights it
        pulled, not to the central model.
        """
        recalibration = None
        if self.engine.has_running_statistics:
            recalibration = bn_recalibration_inputs(
                self.dataset,
                self.cfg.train.bn_recalibration_samples,
                batch_size,
                self.cfg.train.seed,
            )
        return self.engine.evaluate(weights, split, batch_size, recalibration)

    def eval_weights(self) -> Tensor:
        """The central model, shape ``[P]`` (gathered from the server shards when S > 1)."""
        if self.num_servers > 1:
            # the training loop runs while the server thread waits inside on_push, where
            # the event can gather every shard's slice
            if self._last_event is None:
                return self.full_protocol.eval_weights()
            return self._last_event.central_weights()
        return self.protocol.eval_weights()

    def close(self) -> None:
        """Stop the run: the server tells every learner to stop; leave the process group.
        After an interrupt (Ctrl-C, SIGTERM: the learners get it too) learners that end are
        not lost (no ``lost`` record), nor are those lost between the interrupt and this
        call; a learner lost while a run stops on its own (it does not take its STOP) is."""
        self._stop_recording(isinstance(sys.exc_info()[1], KeyboardInterrupt))
        if self._thread is not None:
            if self._pending:
                self._decisions.put(False)
                self._pending = False
            self._thread.join(timeout=self.cfg.dist.timeout_s + 5)
        super().close()

    def _stop_recording(self, interrupted: bool) -> None:
        """``interrupted``: no ``lost`` record from now on, and drop those not yet
        written."""
        if interrupted:
            self._closing = True
            self._membership = [r for r in self._membership if r["event"] != "lost"]

    def late_membership(self) -> list[dict[str, Any]]:
        changes, self._membership = self._membership, []
        return changes

    # ---- learners and other server shards -----------------------------------------------
    def serve(self) -> None:
        """Run this rank's side (learner, or a server shard other than the coordinator)
        until the coordinator stops the run.

        Raises:
            ps.ServerLost: the server went silent for ``dist.timeout_s``.
        """
        if self.is_server:
            ps.run_server(
                self.protocol,
                self.layout,
                on_push=lambda event: True,
                timeout_s=self.cfg.dist.timeout_s,
                log=self._log,
                lr=lambda samples: self._lr,
            )
            return
        learner = self.rank - self.num_servers
        worker = learner // self.group_size
        b, seed = self.batch_size, self.cfg.train.seed
        sampler = ShardedSampler(self.dataset.num_train, self.num_computing, b, seed)
        stream = LearnerStream(sampler, learner)
        done = self.pushes[worker]
        stream.epoch, stream.step = divmod(done, sampler.steps_per_epoch)
        if self.shards is not None:  # where the server has this learner
            lam, slot, epoch, step = self.shards.positions()[worker]
            stream = LearnerStream(ShardedSampler(sampler.num_samples, lam, b, seed), slot)
            stream.epoch, stream.step = epoch, step
        compute, on_position = learner_steps(self.engine, self.dataset, self.cfg, stream)

        def counted(weights: Tensor, version: int) -> tuple[Tensor, list[float]]:
            self._tick_hook()
            t0 = time.perf_counter()
            result = compute(weights, version)
            self.faults.straggle(self.rank, time.perf_counter() - t0)  # a straggler's sleep
            return result

        ps.run_learner(
            self.layout,
            self.rank,
            compute=counted,
            group=self._subgroups[worker],
            num_samples=self.batch_size,
            timeout_s=self.cfg.dist.timeout_s,
            silence_s=self.heartbeats.silence_s,  # the coordinator's evaluation is no silence
            on_position=on_position,
        )

    def state_dict(self) -> dict[str, Any]:
        """Coordinator state: samples, wall time, pushes per worker, dropped gradients,
        bytes sent and, where membership is elastic, each active learner's data position."""
        state = {
            "world_size": self.world_size,
            "samples": self.samples,
            "virtual_time": self.virtual_time,
            "pushes": list(self.pushes),
            "dropped_gradients": self.dropped_gradients,
            "bytes_sent": self.bytes_sent,
        }
        if self.shards is not None:
            positions = self.shards.positions()
            state["data_positions"] = {str(w): list(p) for w, p in positions.items()}
            state["first_pushes"] = [*self.first_pushes_before, self._first_pushes()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (learners start their data streams after the
        minibatches their worker had pushed; gradients in flight are recomputed)."""
        if state.get("world_size") != self.world_size:
            raise ConfigError(
                f"cannot resume: the checkpoint was written by {state.get('world_size')} "
                f"processes, this run has {self.world_size}"
            )
        if self.num_servers > 1:
            raise ConfigError(
                f"cannot resume: dist.num_servers = {self.num_servers}; the checkpoint holds "
                "the coordinating server's shard only (resume works with one server)"
            )
        self.samples = int(state["samples"])
        self.virtual_time = float(state["virtual_time"])
        self.pushes = [int(v) for v in state["pushes"]]
        self.dropped_gradients = int(state.get("dropped_gradients", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        if self.shards is None:
            return
        # the run resumes with the learners it was launched with (joiners join again):
        # after a membership change, re-sharded from where the active learners were;
        # else each starts after the minibatches its worker pushed, as without elasticity
        n, b, seed = self.num_computing, self.batch_size, self.cfg.train.seed
        saved = state.get("data_positions") or {}
        positions = {int(w): (p[0], p[1], p[2], p[3]) for w, p in saved.items()}
        if positions and {w: p[:2] for w, p in positions.items()} != {w: (n, w) for w in range(n)}:
            self.shards = ElasticShards.at(self.dataset.num_train, b, seed, positions)
            self.shards.reshard(list(range(n)))
        else:
            sampler = ShardedSampler(self.dataset.num_train, n, b, seed)
            self.shards = ElasticShards(sampler, self.pushes[:n])
        if self.rank == 0:
            self.protocol.reset_membership(n)
        # worker indices restart at λ: the old ones' pushes and first gradients are kept
        # apart, and a ``resume`` record marks where the indices restart
        joined = len(self.pushes) > n
        self.pushes = self.pushes[:n]
        self.first_pushes_before = [dict(d) for d in state.get("first_pushes", [])]
        if joined and self.rank == 0:
            self._membership.append(
                {
                    "time_s": self.virtual_time,
                    "event": "resume",
                    "version": self.protocol.version,
                    "active_workers": self.protocol.active_workers,
                    "gradients_per_update": self._gradients_per_update(),
                }
            )


JOIN_KEYS = "elastic/"  # the join keys below the run's store namespace


def elastic_refusal(cfg: RunConfig) -> str | None:
    """Why learners cannot join or leave a running dist run of ``cfg`` (one line naming
    the setting), None where they can: the parameter server in mode async or softsync,
    one server rank (compute groups join on the simulated cluster only)."""
    p = cfg.protocol
    if cfg.runtime != "dist":
        return f"runtime = {cfg.runtime!r}: learners join a running run on runtime 'dist'"
    if p.name != "parameter_server":
        return (
            f"protocol.name = {p.name!r}: learners join a running dist run of the "
            "parameter server only (compute groups join on the simulated cluster only)"
        )
    if p.mode == "hardsync" or p.backup_learners:
        return (
            f"protocol.mode = {p.mode!r}: learners join a running parameter server in mode "
            "'async' or 'softsync' only (the hardsync barrier fixes its membership)"
        )
    if cfg.dist.num_servers != 1:
        return (
            f"dist.num_servers = {cfg.dist.num_servers}: learners join a running parameter "
            "server of one server rank only"
        )
    return None


def learner_steps(
    engine: GradientEngine, dataset: Dataset, cfg: RunConfig, stream: LearnerStream | None
) -> tuple[
    Callable[[Tensor, int], tuple[Tensor, list[float]]], Callable[[int, int, int, int], None]
]:
    """A parameter-server learner's ``compute`` (the gradient on its stream's next
    minibatch) and ``on_position`` (the server moved it to ``(λ, slot, epoch, step)``:
    :class:`~distsgd.data.ElasticShards`); ``stream`` None: a joiner, whose first weights
    bring its position."""
    box = [stream]
    train = dataset.train

    def compute(weights: Tensor, version: int) -> tuple[Tensor, list[float]]:
        current = box[0]
        assert current is not None, "a joiner's first weights carry its data position"
        return engine.gradient(weights, *train.batch(current.next_indices()))

    def on_position(lam: int, slot: int, epoch: int, step: int) -> None:
        sampler = ShardedSampler(dataset.num_train, lam, cfg.protocol.batch_size, cfg.train.seed)
        moved = box[0] = LearnerStream(sampler, slot)
        moved.epoch, moved.step = epoch, step

    return compute, on_position


def join_running_run(
    cfg: RunConfig, engine: GradientEngine, dataset: Dataset, info: dict[str, Any]
) -> ps.LearnerResult:
    """Join the running dist run that ``info`` (its ``join.json``) describes as one more
    learner of its parameter server, and learn until the server stops the run
    (docs/elastic.md). The run's store (a c10d TCPStore) is the rendezvous: this process
    takes a joiner id, makes its channel to the coordinating server (a two-rank
    ``ProcessGroupGloo``, :func:`~distsgd.runtime.ps.transport.join_channel`) and runs
    :func:`~distsgd.runtime.ps.run_learner` on it; the server admits it, re-shards the
    data and sends it the weights and its data position.

    Raises:
        ConfigError: the run takes no learners (its settings, :func:`elastic_refusal`),
            cannot be reached, has ended, has another run secret, or refused this joiner
            because λ·b would exceed the training set (one line each).
        ps.ServerLost: the server died or stayed silent for ``dist.timeout_s``.
    """
    why = elastic_refusal(cfg)
    if why is not None:
        raise ConfigError(f"cannot join: {why}")
    addr, port = str(info["master_addr"]), int(info["master_port"])
    timeout_s = cfg.dist.timeout_s
    try:
        socket.create_connection((addr, port), timeout=min(5.0, timeout_s)).close()
    except OSError as e:
        raise ConfigError(
            f"cannot join: the run's store at {addr}:{port} does not answer ({e.strerror or e}); "
            "the run has ended, or this host cannot reach dist.master_addr"
        ) from None
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    run_prefix = namespace(str(info.get("restart", "0")), str(info.get("run", "")) or None)
    prefix = run_prefix + JOIN_KEYS
    deadline = time.monotonic() + timeout_s  # the run may be about to start training
    while not store.check([prefix + "open"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not store.check([prefix + "open"]):
        raise ConfigError(
            f"cannot join: the run at {addr}:{port} took no joiners within dist.timeout_s = "
            f"{timeout_s:g} s (it is ending, or it has another run secret: {ENV_SECRET})"
        )
    joiner = store.add(prefix + "count", 1)
    try:
        link = ps.join_channel(store, f"{prefix}{joiner}/", 1, timeout_s)
    except (RuntimeError, dist.DistError) as e:
        raise ConfigError(
            f"cannot join: the server did not connect within dist.timeout_s = {timeout_s:g} s "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    compute, on_position = learner_steps(engine, dataset, cfg, None)
    try:
        return _learn_as_joiner(cfg, compute, on_position, link, store, run_prefix)
    except ps.JoinRefused as e:
        raise ConfigError(join_refusal(cfg.protocol.batch_size, e)) from None


def join_refusal(batch_size: int, refused: ps.JoinRefused) -> str:
    """The joiner's line for a server's refusal (λ·b would exceed the training set)."""
    lam, n = refused.num_learners, refused.num_samples
    return (
        f"cannot join: protocol.batch_size = {batch_size} × {lam} learners = "
        f"{batch_size * lam} samples per step would exceed the {n} training samples"
    )


def _learn_as_joiner(
    cfg: RunConfig,
    compute: Callable[[Tensor, int], tuple[Tensor, list[float]]],
    on_position: Callable[[int, int, int, int], None],
    link: dist.ProcessGroup,
    store: dist.Store,
    run_prefix: str,
) -> ps.LearnerResult:
    timeout_s = cfg.dist.timeout_s
    return ps.run_learner(
        ps.PSLayout(server_ranks=[0], worker_groups=[[1]]),
        1,
        compute=compute,
        group=None,
        num_samples=cfg.protocol.batch_size,
        timeout_s=timeout_s,
        silence_s=heartbeat_silence(store, run_prefix),  # an evaluation is no silence
        on_position=on_position,
        links={0: link},
    )


def build_runtime(
    cfg: RunConfig,
    engine: GradientEngine,
    dataset: Dataset,
    initial: Tensor,
    faults: RankFaults | None = None,
) -> SyncDistRuntime | PSDistRuntime:
    """The dist runtime for ``cfg.protocol`` (the process group must be initialised);
    ``faults``: injected by tests (:class:`~distsgd.runtime.faults.RankFaults`)."""
    if spec_for(cfg.protocol).served_on_dist(cfg.protocol):
        return PSDistRuntime(cfg, engine, dataset, initial, faults)
    return SyncDistRuntime(cfg, engine, dataset, initial, faults)
