"""The simulated cluster: a deterministic, event-driven virtual clock in one process.

Every learner has a device profile (seconds per minibatch) and every message crosses a
network with a latency and a bandwidth. Gradients are real: each is computed with the
model on the learner's own minibatch at the weights that learner actually holds, so
staleness arises from timing exactly as it would on a cluster (docs/simulated-cluster.md).

Timing model (all in virtual seconds):

* compute of one minibatch of b samples on learner l:
  ``(seconds_per_batch + b · seconds_per_sample) / speed_l · J`` where J is a seeded
  log-normal factor with mean 1 and relative spread ``jitter``;
* a straggler's random stall (``cluster.stall_probability`` p > 0): with probability p,
  drawn per minibatch from a seeded stream of its own, a stall of ``stall_seconds`` (fixed,
  or exponentially distributed with that mean) is added to that minibatch's compute; a
  slow device is ``cluster.speed_factors`` (e.g. 0.5: twice as slow);
* synchronous protocols with k replicas per device (SMA, local SGD), which a device
  computes as one batched computation: ``t(1) · ρ(k) / speed_d · J`` per device, with
  ``t(1) = seconds_per_batch + b · seconds_per_sample`` and ρ(k) the t(k)/t(1) of the
  batched path measured on this machine at the run's b (``cluster.replica_ratios``,
  :func:`calibrate_replicas`), or ``ρ(k) = 1 + (k − 1) · seconds_per_replica / t(1)``
  without a measurement (speed_d: the slowest of its learners; k = 1 is the line above);
* a synchronous device's work per iteration beyond its gradients (the protocol's update
  of the flat weights, the runtime loop: DDP wrapper, minibatch draw):
  ``seconds_per_iteration / speed_d``, added to its compute above (and stretched and
  jittered with it); parameter-server learners are not charged it (the update is the
  server's ``seconds_per_push``);
* one message of P float32 values: ``latency_s + 32 P / (bandwidth_gbps · 1e9)``;
* ring all-reduce over m participants: ``2(m−1) · latency_s + 2(m−1)/m · 32 P / bw``
  (with ``cluster.allreduce_latency_s`` / ``allreduce_bandwidth_gbps`` where set);
* hosts (``cluster.processes_per_host`` = n > 0): rank r runs on host ``r // n`` (the
  server shards are ranks 0 … S−1 and learner l is rank S + l; a synchronous device d is
  rank d), as the launchers place ranks. A message between a worker (a compute group's
  first learner) and the server is charged with ``local_latency_s`` /
  ``local_bandwidth_gbps`` when every shard shares the worker's host, else with the
  link's terms above; an all-reduce whose participants share one host is the ring
  formula with the local terms, else the link's. With ``cores`` > 0 each host has
  ``cores`` cores, shared by its own processes only (a parameter server's busy
  fraction counted on its host). n = 0: every process is a host of its own;
* a compute group of m > 1 ranks: its leader broadcasts each reply's weights to the
  members before they compute, ``⌈log₂ m⌉ · (2·latency + 8BP/bandwidth)``
  (:func:`~distsgd.runtime.cluster_model.broadcast_seconds`; local terms when the group
  shares one host);
* the parameter server's work on one push (apply the protocol, copy the weights for the
  reply): ``seconds_per_push``; the server serves pushes one at a time, in arrival order;
* processes sharing cores (``cluster.cores`` > 0, every rank on one machine): compute,
  and the server's work, take :func:`~distsgd.runtime.cluster_model.core_stretch` times
  longer when more processes are busy than there are cores (synchronous: the devices;
  parameter server: the learners plus the server's busy fraction,
  :func:`~distsgd.runtime.cluster_model.server_core_stretch`); 0: a core per process.
  With shared cores (``cores`` > 0), a server time measured on processes while the
  other learners compute (``seconds_per_push_contended``) is charged as measured instead
  of the stretched ``seconds_per_push``: the wait for a core is in it already
  (:func:`~distsgd.runtime.cluster_model.server_push_seconds`).

Synchronous protocols advance one iteration per tick (the slowest device plus the
all-reduce). Parameter-server protocols process one push per tick: a worker pulls, its
reply travels, it computes, its push travels, waits while the server serves earlier
pushes, the server works ``seconds_per_push`` on it and replies when done (or, under a
barrier, when the update is applied).

Hardsync with β backup learners runs served, as on runtime ``dist``
(:class:`~distsgd.protocols.BackupHardSync`: one server, λ + β learners, the parameter
server's terms above, ``cores`` shared by the λ + β learners and the server's busy
fraction): the server applies the mean of the first λ pushes computed on version v and
answers those λ learners. A late learner is not interrupted: its stale push arrives,
waits its turn, is served (``seconds_per_push``) and dropped (a tick of no samples and
no gradient computed: its minibatch is spent), and it pulls the new weights only then.
With messages of m seconds, the λ-th fastest compute t and no stale push in the way, an
iteration takes ``2m + t + λ · seconds_per_push``.

Learners that hold the same weights at the same moment (hardsync, the members of one
compute group) compute their mean gradient as one forward/backward over their
concatenated minibatches, which is that mean exactly (and bit-identical to one learner
with the global batch), unless the model has BatchNorm layers, whose statistics are
per learner. Virtual time is still charged per learner at batch b.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from distsgd.checks import fail
from distsgd.config import ClusterConfig, ConfigError, ConfigWarning, TrainConfig
from distsgd.data import Dataset, LearnerStream, ShardedSampler, Split, reshard_streams
from distsgd.engine import GradientEngine, bn_recalibration_inputs, first_line
from distsgd.protocols.base import AsynchronousProtocol, Protocol, SynchronousProtocol
from distsgd.runtime import cluster_model as cm
from distsgd.runtime.base import (
    Runtime,
    Tick,
    TrainingDiverged,
    check_losses,
    draw_minibatches,
    time_in_turn,
)
from distsgd.runtime.compression import (
    bytes_per_value,
    compressed_total,
    exchange_bytes,
    int8_allgather_bytes,
    ring_allreduce_bytes,
    round_to_wire,
)
from distsgd.runtime.faults import draw_stall

__all__ = [
    "DeviceProfile",
    "calibrate",
    "calibrate_replicas",
    "calibrate_server",
    "measure_replica_seconds",
    "replica_ratios",
    "SimRuntime",
    "Tick",
    "TrainingDiverged",
]


@dataclass
class DeviceProfile:
    """Compute time of one minibatch: ``seconds_per_batch + batch · seconds_per_sample``.

    Attributes:
        seconds_per_batch: fixed cost per minibatch, seconds (>= 0).
        seconds_per_sample: marginal cost per sample, seconds (>= 0).
        calibrated: True when measured on this machine by :func:`calibrate`.
        seconds_per_replica: seconds one further replica (with its own b samples) adds to
            a device's batched iteration of k replicas (>= 0); None: one minibatch's
            ``compute_seconds(b)``, i.e. k replicas cost k separate minibatches.
        replica_ratios: measured t(k)/t(1) for k = 1, 2, … (empty: use
            ``seconds_per_replica``); see :func:`distsgd.runtime.cluster_model.replica_ratio`.
        seconds_per_push: the parameter server's seconds of work per pushed gradient
            (>= 0; :func:`calibrate_server`); 0: free.
        seconds_per_iteration: a synchronous device's seconds per iteration beyond its
            gradients (>= 0; :func:`distsgd.runtime.dist.calibrate_iteration`); 0: free.
        seconds_per_push_contended: the server's wall seconds per push measured on
            processes while the run's other learners compute on the same cores (>= 0;
            ``cluster.seconds_per_push_contended``); where > 0 and cores are shared,
            charged per push in place of the stretched ``seconds_per_push`` (not
            stretched again); 0: not measured.
    """

    seconds_per_batch: float
    seconds_per_sample: float
    calibrated: bool = False
    seconds_per_replica: float | None = None
    replica_ratios: tuple[float, ...] = ()
    seconds_per_push: float = 0.0
    seconds_per_iteration: float = 0.0
    seconds_per_push_contended: float = 0.0

    @functools.cached_property
    def model(self) -> cm.ClusterModel:
        """This profile as the cluster timing model's device part (built once: the
        simulator asks for a device's seconds on every tick)."""
        return cm.ClusterModel(
            self.seconds_per_batch,
            self.seconds_per_sample,
            t_replica=self.seconds_per_replica,
            replica_ratios=self.replica_ratios,
            t_server=self.seconds_per_push,
            t_iteration=self.seconds_per_iteration,
            t_server_contended=self.seconds_per_push_contended,
        )

    def compute_seconds(self, batch_size: int) -> float:
        """One minibatch of b samples, seconds (:func:`~distsgd.runtime.cluster_model.compute_seconds`)."""
        return cm.compute_seconds(batch_size, self.model)

    def device_seconds(self, replicas: int, batch_size: int) -> float:
        """One synchronous iteration of k = ``replicas`` replicas × b = ``batch_size``
        samples on one device, as one batched computation, and its work beyond the
        gradients, seconds (:func:`~distsgd.runtime.cluster_model.device_seconds`:
        ``t(1) · replica_ratio(k)`` with measured ``replica_ratios``, else
        ``t(1) + (k − 1) · seconds_per_replica``; plus ``seconds_per_iteration``)."""
        return cm.device_seconds(replicas, batch_size, self.model)


CALIBRATION_MAX_BATCH = 4096  # the largest batch calibrate() grows to
CALIBRATION_GROWTH = 1.25  # t(large) / t(small) that shows the per-sample cost


def calibrate(
    engine: GradientEngine,
    dataset: Dataset,
    batch_sizes: tuple[int, int] = (16, 128),
    repeats: int = 6,
    statistic: Callable[[list[float]], float] = min,
) -> DeviceProfile:
    """Measure forward+backward time of the model on this machine and fit a device profile
    ``t(b) = seconds_per_batch + b · seconds_per_sample``.

    Times ``repeats`` minibatches at each of two batch sizes (after one warm-up each),
    takes the fastest (the least disturbed by other work on the machine, as ``timeit``
    advises; ``statistic`` replaces it, e.g. ``statistics.median`` to predict a loaded
    machine's typical time), and fits the line through the two points. When the larger
    batch is not clearly slower (``t2 < CALIBRATION_GROWTH · t1``: a GPU, whose small
    batches cost their kernel launches, not their samples; or a disturbed CPU timing) the
    larger batch is quadrupled, up to ``CALIBRATION_MAX_BATCH`` and the training set, until
    it is; a profile still flat there is per batch (the slope measured, clamped at 0).
    ``engine.gradient`` returns its loss as a float, so each timing waits for the device.

    Returns:
        DeviceProfile with non-negative coefficients, ``calibrated=True``.

    Raises:
        ConfigError: the first step at a batch size raises (the user's model or loss on
            samples the run's own try-run did not reach).
    """
    w = engine.initial_weights()
    n = dataset.num_train

    def seconds(b: int) -> float:
        x, y = dataset.train.batch(torch.arange(b))
        try:
            engine.gradient(w, x, y)  # warm-up: the first step at this batch size
        except Exception as e:  # noqa: BLE001 - the user's model or loss on these samples
            raise ConfigError(
                f"a training step on the first {b} training samples, while measuring the "
                f"device (cluster.seconds_per_sample = -1), raised {first_line(e)}: the "
                "model or train.loss does "
                "not fit all of the data (the try-run on the first protocol.batch_size "
                "samples passed)"
            ) from None
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.gradient(w, x, y)
            times.append(time.perf_counter() - t0)
        return statistic(times)

    b1, b2 = (min(b, n) for b in batch_sizes)
    t1, t2 = seconds(b1), seconds(b2)
    while t2 < CALIBRATION_GROWTH * t1 and b2 < min(n, CALIBRATION_MAX_BATCH):
        b2 = min(4 * b2, n, CALIBRATION_MAX_BATCH)
        t2 = seconds(b2)
    if b2 == b1:
        return DeviceProfile(0.0, t1 / b1, calibrated=True)
    per_sample = max((t2 - t1) / (b2 - b1), 0.0)
    if t2 < t1:
        warnings.warn(
            f"device calibration is unreliable ({t1 * 1e3:.2f} ms at batch {b1}, "
            f"{t2 * 1e3:.2f} ms at batch {b2}: the larger batch measured faster); using a "
            "per-batch profile. Give cluster.seconds_per_sample / seconds_per_batch to fix "
            "the profile.",
            ConfigWarning,
            stacklevel=2,
        )
    per_batch = max(t1 - b1 * per_sample, 0.0)
    return DeviceProfile(per_batch, per_sample, calibrated=True)


def calibrate_server(
    protocol: AsynchronousProtocol,
    lr: float,
    repeats: int = 20,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """Seconds the parameter server works on one push on this machine: the protocol's
    :meth:`~AsynchronousProtocol.push` (buffer or apply it, docs/protocols.md §2–3) and the
    copy of the weights for the reply (:meth:`~AsynchronousProtocol.pull`), as the server
    process does between receiving a gradient and sending the weights back (the messages
    themselves are charged by the network model). Workers push in turn, so a barrier or
    softsync's c pushes per update are exercised as in a run; ``protocol`` is a throwaway
    (its weights change). One warm-up round, then ``repeats`` pushes; ``statistic`` of
    their wall seconds (median: robust to one disturbed push).

    Returns:
        seconds per push (``cluster.seconds_per_push``).
    """
    nw = protocol.num_workers
    versions = [protocol.pull(w)[1] for w in range(nw)]
    weights, _ = protocol.pull(0)
    grad = torch.full_like(weights, 1e-6)
    times: list[float] = []
    i = 0
    while len(times) < repeats:
        w = i % nw
        i += 1
        t0 = time.perf_counter()
        protocol.push(w, grad, versions[w], lr)
        if protocol.can_pull(w):
            versions[w] = protocol.pull(w)[1]
        if i > nw:  # the first round warms up
            times.append(time.perf_counter() - t0)
        for v in range(nw):  # a barrier released by this push: the others pull now
            if v != w and versions[v] < protocol.version and protocol.can_pull(v):
                versions[v] = protocol.pull(v)[1]
    return float(statistic(times))


REPLICA_CALIBRATION_MAX_K = 8


def measure_replica_seconds(
    engine: GradientEngine,
    dataset: Dataset,
    batch_size: int,
    replicas: tuple[int, ...],
    repeats: int = 5,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[int, float]:
    """Seconds of one iteration of k replicas × b samples on this machine, for each k.

    Times :meth:`GradientEngine.replica_gradients` (the path SMA and local SGD take, so
    for ``cnn`` at b <= 32 the batched ``grouped`` path) at ``batch_size`` b, after one
    warm-up per k. The k are timed in turn in each of ``repeats`` rounds (so a change of
    the machine's load during the measurement reaches every k alike) and each k's median
    is kept (one disturbed round cannot move it; ``statistic`` replaces it, e.g. ``min``).
    k with k·b above the training set are left out.

    Returns:
        ``{k: median seconds}``, wall seconds.
    """
    w = engine.initial_weights()
    n = dataset.num_train
    inputs = {}
    for k in replicas:
        if k * batch_size > n:
            continue
        x, y = dataset.train.batch(torch.arange(k * batch_size).view(k, batch_size))
        inputs[k] = (w.expand(k, -1).clone(), x, y)
    fns = [functools.partial(engine.replica_gradients, *args) for args in inputs.values()]
    # one warm-up round: one-off costs of a new shape
    times = time_in_turn(fns, repeats, engine.device, warmup=1)
    return {k: statistic(t) for k, t in zip(inputs, times, strict=True)}


def replica_ratios(measured: dict[int, float]) -> list[float]:
    """``[t(1)/t(1), t(2)/t(1), …, t(n)/t(1)]`` from measured ``{k: seconds}`` of k = 1 … n.

    The replicas auto-tuner decides on T(k)/T(k−1) = k·t(k−1) / ((k−1)·t(k)) (Crossbow,
    arXiv:1901.02244, §4.3), so the simulated device must reproduce the measured shape
    t(k)/t(1) of the batched computation at the run's b, not only its absolute seconds
    (the simulated t(1) comes from the large-batch profile, :func:`calibrate`). The ratios
    are kept as measured, k by k: t(k)/t(1) on a CPU is far from linear in k (e.g. cnn,
    b = 8: a second replica costs little, later ones cost about a full one), so no one
    per-replica cost fits them.

    Raises:
        ValueError: a k in 1 … max k missing, fewer than 2 values, or a time <= 0.
    """
    n = max(measured, default=0)
    if n < 2 or sorted(measured) != list(range(1, n + 1)) or min(measured.values()) <= 0:
        raise ValueError(f"need positive seconds for k = 1 … n (n >= 2), got {measured!r}")
    return [measured[k] / measured[1] for k in range(1, n + 1)]


def calibrate_replicas(
    engine: GradientEngine,
    dataset: Dataset,
    batch_size: int,
    max_replicas: int = REPLICA_CALIBRATION_MAX_K,
    repeats: int = 5,
) -> tuple[list[float], dict[int, float]]:
    """Measure k replicas as one computation on this machine at b = ``batch_size`` for
    k = 1 … ``max_replicas`` (those whose k·b fit the training set;
    :func:`measure_replica_seconds`) and return their ratios (:func:`replica_ratios`),
    the simulated device's ``cluster.replica_ratios``.

    Returns:
        (t(k)/t(1) for k = 1 … n, the measured ``{k: median seconds}``); the ratios are
        empty when fewer than 2 k fit.
    """
    ks = tuple(range(1, max(max_replicas, 2) + 1))
    measured = measure_replica_seconds(engine, dataset, batch_size, ks, repeats)
    if len(measured) < 2:
        return [], measured
    return replica_ratios(measured), measured


class SimRuntime(Runtime):
    """Drives a protocol over simulated learners on a virtual clock.

    Args:
        protocol: a :class:`SynchronousProtocol` (hardsync, SMA, local SGD) or an
            :class:`AsynchronousProtocol` (parameter server, compute groups).
        engine: computes gradients with the real model.
        dataset: training data; learner l draws minibatches from shard l of
            :class:`ShardedSampler` (a fresh seeded order every epoch).
        batch_size: b, per learner, in samples.
        num_learners: λ.
        profile: base device profile; learner l runs at ``cluster.speed_factors[l]`` times it.
        cluster: network and jitter settings.
        replicas_per_device: k learners that share one device (their compute adds up).
        seed: seeds data order, timing jitter and the BatchNorm recalibration slice.
        bn_recalibration_samples: ``train.bn_recalibration_samples``, samples over which
            :meth:`evaluate` recomputes BatchNorm statistics.
        num_servers: S server shards (ranks 0 … S−1) of a parameter-server protocol,
            for placing ranks on hosts (``cluster.processes_per_host``); >= 1.
        compression: ``protocol.compression``: the wire format of the exchanges
            (:mod:`~distsgd.runtime.compression`): the values are rounded to it, the
            network charges its bytes, and :attr:`bytes_sent` counts them.
        backup_learners: β backup learners of hardsync (``protocol.backup_learners``;
            ``protocol`` is then the served :class:`~distsgd.protocols.BackupHardSync`
            of λ + β workers): λ + β learner processes share ``cluster.cores`` with the
            server, and :attr:`dropped_gradients` counts the pushes it dropped.

    Raises:
        TrainingDiverged: from :meth:`advance`, when a loss is NaN or infinite.
    """

    clock = "simulated"

    def __init__(
        self,
        protocol: Protocol,
        engine: GradientEngine,
        dataset: Dataset,
        *,
        batch_size: int,
        num_learners: int,
        profile: DeviceProfile,
        cluster: ClusterConfig,
        replicas_per_device: int = 1,
        seed: int = 0,
        bn_recalibration_samples: int = TrainConfig.bn_recalibration_samples,
        num_servers: int = 1,
        compression: str = "none",
        backup_learners: int = 0,
    ) -> None:
        self.protocol = protocol
        self.backup_learners = backup_learners
        self.dropped_gradients = 0
        computing = num_learners + backup_learners
        self.num_servers = num_servers
        self.compression = compression
        self.bytes_sent = 0
        self.engine = engine
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_learners = num_learners
        self.profile = profile
        self.cluster = cluster
        self.replicas_per_device = replicas_per_device
        self.seed = seed
        self.bn_recalibration_samples = bn_recalibration_samples
        self.sampler = ShardedSampler(dataset.num_train, computing, batch_size, seed)
        self.streams: list[LearnerStream | None] = [
            LearnerStream(self.sampler, i) for i in range(computing)
        ]
        self.speeds = list(cluster.speed_factors) or [1.0] * computing
        self._rng = torch.Generator().manual_seed(seed * 7919 + 17)
        self._stall_rng = torch.Generator().manual_seed(seed * 7919 + 29)
        self.virtual_time = 0.0
        self.samples = 0
        self.is_async = protocol.served
        self._push_order: deque[tuple[int, int]] | None = None  # replay_push_order
        self._fuse = not engine.has_batch_statistics
        self._network = cm.ClusterModel(
            profile.seconds_per_batch,
            profile.seconds_per_sample,
            latency_s=cluster.latency_s,
            bandwidth_gbps=cluster.bandwidth_gbps,
            num_parameters=engine.num_parameters,
            allreduce_latency_s=cluster.allreduce_network[0],
            allreduce_bandwidth_gbps=cluster.allreduce_network[1],
            bytes_per_value=bytes_per_value(compression),
        )
        self._local = dataclasses.replace(
            self._network,
            latency_s=cluster.local_latency_s,
            bandwidth_gbps=cluster.local_bandwidth_gbps,
            allreduce_latency_s=None,
            allreduce_bandwidth_gbps=None,
        )
        self.message_s = self._network.message_seconds
        self._worker_message_s: list[float] = []
        if self.is_async:
            self._worker_message_s = [
                self._message_seconds(w)
                for w in range(protocol.num_workers)  # type: ignore[union-attr]
            ]
        self._set_stretch()
        self._membership = list(cluster.membership) if self.is_async else []
        self._next_change = 0
        if self._membership:
            self._check_schedule_fits()
        if self.is_async:
            self._init_async()

    # ---- timing ------------------------------------------------------------------------
    def host(self, rank: int) -> int:
        """The host of ``rank`` (:func:`~distsgd.runtime.cluster_model.host_of` with
        ``cluster.processes_per_host``)."""
        return cm.host_of(rank, self.cluster.processes_per_host)

    def _learner_rank(self, learner: int) -> int:
        """The rank of ``learner`` (a parameter-server learner: after the S shards) or,
        synchronous, of its device."""
        if self.is_async:
            return self.num_servers + learner
        return learner // self.replicas_per_device

    def _message_seconds(self, worker: int) -> float:
        """One message between ``worker`` (its first learner) and the server: local when
        every shard shares its host, else the link's."""
        here = self.host(self._learner_rank(self._members(worker)[0]))
        if all(self.host(s) == here for s in range(self.num_servers)):
            return self._local.message_seconds
        return self.message_s

    def _allreduce_among(self, learners: list[int]) -> float:
        """Ring all-reduce among the ranks of ``learners`` (distinct ranks): with the
        local terms when they share one host, else the link's; an int8 exchange is an
        all-gather of its bytes (:mod:`~distsgd.runtime.compression`)."""
        ranks = sorted({self._learner_rank(m) for m in learners})
        one_host = len({self.host(r) for r in ranks}) == 1
        model = self._local if one_host and len(ranks) > 1 else self._network
        if self.compression == "int8":
            each = int8_allgather_bytes(2, self.engine.num_parameters) // 2
            return cm.allgather_seconds(len(ranks), each, model)
        return cm.allreduce_seconds(len(ranks), model)

    def _broadcast_among(self, learners: list[int]) -> float:
        """A compute group's leader handing its pulled weights to the other ranks of
        ``learners`` (:func:`~distsgd.runtime.cluster_model.broadcast_seconds`): with the
        local terms when they share one host, else the link's."""
        ranks = sorted({self._learner_rank(m) for m in learners})
        one_host = len({self.host(r) for r in ranks}) == 1
        return cm.broadcast_seconds(len(ranks), self._local if one_host else self._network)

    def _set_stretch(self) -> None:
        """The stretch of compute when the cluster's processes share ``cluster.cores``
        cores (wall over CPU time; 1 with ``cores = 0``) and the server's seconds per
        push as charged (:func:`~distsgd.runtime.cluster_model.server_push_seconds`)."""
        self._stretch = 1.0
        model = dataclasses.replace(
            self._network,
            t_server=self.profile.seconds_per_push,
            t_server_contended=self.profile.seconds_per_push_contended,
            cores=self.cluster.cores,
        )
        computing = self.num_learners + self.backup_learners  # learner processes
        pushers = computing
        if self.is_async:
            pushers = self.protocol.num_workers  # type: ignore[union-attr]
        if self.cluster.cores > 0:
            if not self.is_async:
                k = self.replicas_per_device
                self._stretch = cm.core_stretch(computing // k, self.cluster.cores)
            else:
                self._stretch = cm.server_core_stretch(computing, self.batch_size, model, pushers)
        self._push_s = cm.server_push_seconds(
            self._stretch, model, each_learner_pushes=pushers == computing
        )
        units = computing // (1 if self.is_async else self.replicas_per_device)
        self._stretches = [self._stretch] * units
        if self.cluster.cores > 0 and self.cluster.processes_per_host > 0:
            self._set_host_stretch(model, pushers, units)

    def _set_host_stretch(self, model: cm.ClusterModel, pushers: int, units: int) -> None:
        """Each host's ``cluster.cores`` shared by its own processes: a learner's (or
        device's) stretch from the busy processes on its host, the server's busy fraction
        counted on the shards' hosts, the server's push stretched as on its host."""
        cores = self.cluster.cores
        # units: parameter-server learners (rank S + l) or synchronous devices (rank d)
        hosts = [self.host(self._learner_rank(u) if self.is_async else u) for u in range(units)]
        busy = {h: float(hosts.count(h)) for h in hosts}
        if self.is_async:
            each = pushers == self.num_learners + self.backup_learners
            mean_message = statistics.fmean(self._worker_message_s)
            u = cm.server_busy_fraction(pushers, self.batch_size, model, each, mean_message)
            for s in range(self.num_servers):
                h = self.host(s)
                busy[h] = busy.get(h, 0.0) + u / self.num_servers
            server_stretch = cm.core_stretch(busy[self.host(0)], cores)
            self._push_s = cm.server_push_seconds(server_stretch, model, each)
        self._stretches = [cm.core_stretch(busy[h], cores) for h in hosts]

    def _jitter(self) -> float:
        s = self.cluster.jitter
        if s == 0:
            return 1.0
        sigma = math.sqrt(math.log1p(s * s))
        z = float(torch.randn((), generator=self._rng))
        return math.exp(sigma * z - 0.5 * sigma * sigma)

    def _stall(self) -> float:
        """A random stall's virtual seconds (0 unless ``cluster.stall_probability`` > 0):
        with probability p a stall of ``stall_seconds`` (``"fixed"``) or drawn from the
        exponential distribution of that mean; seeded, its own stream (the jitter's draws
        do not depend on it)."""
        c = self.cluster
        return draw_stall(
            self._stall_rng, c.stall_probability, c.stall_seconds, c.stall_distribution
        )

    def compute_seconds(self, learner: int) -> float:
        """Virtual seconds for ``learner`` to compute one minibatch (draws jitter and a
        stall)."""
        base = self.profile.compute_seconds(self.batch_size) / self.speeds[learner]
        return base * self._stretches[learner] * self._jitter() + self._stall()

    def device_compute_seconds(self, device: int) -> float:
        """Virtual seconds for ``device`` to compute one synchronous iteration of its k
        replicas, with its work beyond the gradients
        (:meth:`DeviceProfile.device_seconds`; draws jitter)."""
        k = self.replicas_per_device
        speed = min(self.speeds[device * k : (device + 1) * k])
        base = self.profile.device_seconds(k, self.batch_size) / speed
        return base * self._stretches[device] * self._jitter() + self._stall()

    def set_replicas_per_device(self, replicas_per_device: int) -> None:
        """Change k between synchronous iterations (the auto-tuner): λ becomes
        devices × k and the data streams are re-sharded for the new λ. The epoch
        permutation does not depend on λ, so the run continues at the first step of the
        new layout that starts at or after the samples already drawn this epoch (at most
        λ·b − 1 samples are skipped; none is drawn twice).

        Raises:
            ValueError: k < 1, or λ·b exceeds the training set.
            RuntimeError: the protocol is asynchronous, or speed factors are set.
        """
        if self.is_async or self.cluster.speed_factors or self.backup_learners:
            raise RuntimeError(
                "replicas per device can change only for synchronous protocols without "
                "cluster.speed_factors or backup learners"
            )
        if not isinstance(replicas_per_device, int) or replicas_per_device < 1:
            raise ValueError(
                f"replicas_per_device = {replicas_per_device!r} is not allowed: expected an "
                "integer >= 1"
            )
        devices = self.num_learners // self.replicas_per_device
        lam = devices * replicas_per_device
        self.sampler, self.streams = reshard_streams(self.streams[0], lam, list(range(lam)))
        self.num_learners = lam
        self.replicas_per_device = replicas_per_device
        self.speeds = [1.0] * lam
        self._set_stretch()

    def allreduce_seconds(self, participants: int) -> float:
        """Ring all-reduce of P float32 values among ``participants``
        (:func:`~distsgd.runtime.cluster_model.allreduce_seconds`)."""
        return cm.allreduce_seconds(participants, self._network)

    # ---- gradients ---------------------------------------------------------------------
    def _gradient(
        self, learner: int, weights: Tensor, lr: float, step: int
    ) -> tuple[Tensor, float]:
        """One learner's gradient ``[P]`` and loss on its next minibatch at ``weights``."""
        stream = self.streams[learner]
        assert stream is not None, f"learner {learner} has left"
        idx = stream.next_indices()
        grad, losses = self.engine.gradient(weights, *self.dataset.train.batch(idx))
        check_losses([learner], losses, lr, self.samples, step)
        return grad, losses[0]

    def _mean_gradient(
        self, learners: list[int], weights: Tensor, lr: float, step: int
    ) -> tuple[Tensor, list[float]]:
        """Mean gradient ``[P]`` of several learners that hold the same ``weights``.

        Without batch-statistics layers this is one forward/backward over their
        concatenated minibatches (the mean of their gradients, computed as one batch);
        otherwise each learner computes separately and the gradients are averaged.
        """
        if len(learners) > 1 and self._fuse:
            idx = torch.cat([self.streams[m].next_indices() for m in learners])  # type: ignore[union-attr]
            grad, losses = self.engine.gradient(
                weights, *self.dataset.train.batch(idx), num_chunks=len(learners)
            )
            check_losses(learners, losses, lr, self.samples, step)
            return grad, losses
        grad_sum: Tensor | None = None
        losses = []
        for m in learners:
            g, loss = self._gradient(m, weights, lr, step)
            losses.append(loss)
            grad_sum = g if grad_sum is None else grad_sum.add_(g)
        assert grad_sum is not None
        if len(learners) > 1:
            grad_sum.div_(len(learners))
        return grad_sum, losses

    # ---- synchronous -------------------------------------------------------------------
    def _advance_sync(self, lr: float) -> Tick:
        """One iteration: every device computes, then the protocol's all-reduce over all
        of them (one process holds every learner: :meth:`AllReduce.reduce_here`), charged
        as a ring all-reduce among the devices."""
        proto = cast(SynchronousProtocol, self.protocol)
        lam, k = self.num_learners, self.replicas_per_device
        step = proto.iteration
        device_s = [self.device_compute_seconds(d) for d in range(lam // k)]
        if proto.shares_weights:  # the mean gradient as one computation (_mean_gradient)
            grad, losses = self._mean_gradient(list(range(lam)), proto.learner_weights(0), lr, step)
            proto.apply_mean_gradient(round_to_wire(grad, self.compression), lr)
            exchanged = True
        else:
            x, y = draw_minibatches(self.streams, self.dataset)
            grads, losses = self.engine.replica_gradients(proto.replicas, x, y)
            check_losses(list(range(lam)), losses, lr, self.samples, step)
            exchange = proto.exchange_step(grads, lr)
            if exchange is not None:
                exchange.apply(compressed_total(exchange, lam // k, self.compression))
            exchanged = exchange is not None
        comm = 0.0
        if exchanged:
            comm = self._allreduce_among(list(range(0, lam, k)))
            self.bytes_sent += exchange_bytes(
                lam // k, self.engine.num_parameters, self.compression
            )
        self.virtual_time += max(device_s) + comm
        n = lam * self.batch_size
        self.samples += n
        return Tick(n, losses)

    # ---- asynchronous (parameter server) ------------------------------------------------
    def _members(self, worker: int) -> list[int]:
        return self.protocol.members(worker)  # type: ignore[union-attr]

    def _init_async(self) -> None:
        proto = cast(AsynchronousProtocol, self.protocol)
        nw = proto.num_workers
        self._pulled = torch.empty(nw, self.engine.num_parameters, device=self.engine.device)
        self._pulled_version = [0] * nw
        self._events: list[tuple[float, int, int]] = []
        self._seq = 0
        self._waiting: list[int] = []
        for w in range(nw):
            self._pull_and_schedule(w, 0.0)

    def _pull_and_schedule(self, worker: int, now: float) -> None:
        proto = self.protocol
        weights, version = proto.pull(worker)  # type: ignore[union-attr]
        self._pulled[worker] = round_to_wire(weights, self.compression)
        self._pulled_version[worker] = version
        members = self._members(worker)
        compute = max(self.compute_seconds(m) for m in members)
        compute += self._broadcast_among(members) + self._allreduce_among(members)
        message_s = self._worker_message_s[worker]
        arrive = now + message_s + compute + message_s
        heapq.heappush(self._events, (arrive, self._seq, worker))
        self._seq += 1

    # ---- membership (cluster.membership) ------------------------------------------------
    def _check_schedule_fits(self) -> None:
        """The most learners ``cluster.membership`` has active at once, times b, fits in
        the training set (the re-sharded data of each change needs a full step per epoch).

        Raises:
            ConfigError: it does not; the message names ``cluster.membership``.
        """
        proto = cast(AsynchronousProtocol, self.protocol)
        size = len(proto.members(0))
        active = peak = len(proto.active_workers)
        for change in self._membership:
            active += change["join"] if "join" in change else -len(change["leave"])
            peak = max(peak, active)
        b, n = self.batch_size, self.dataset.num_train
        if peak * size * b > n:
            fail(
                "cluster.membership",
                self._membership,
                f"a schedule of at most {n // b} learners at once: it reaches {peak * size} "
                f"learners × protocol.batch_size = {b} = {peak * size * b} samples per step, "
                f"over the {n} training samples",
            )

    def _due_changes(self) -> list[dict[str, Any]]:
        """Apply every membership change scheduled before the next push arrives; their
        records (docs/elastic.md)."""
        records: list[dict[str, Any]] = []
        while self._next_change < len(self._membership):
            change = self._membership[self._next_change]
            if self._events and change["at_s"] > self._events[0][0]:
                break
            self._next_change += 1
            records += self._change(change)
        return records

    def _change(self, change: dict[str, Any]) -> list[dict[str, Any]]:
        """One ``{at_s, join}`` / ``{at_s, leave}`` change: the protocol admits or retires
        the workers, the active learners' data is re-sharded (:func:`reshard_streams`), a
        joiner pulls at ``max(at_s, server free)``; a leaver's pending push is dropped."""
        proto = cast(AsynchronousProtocol, self.protocol)
        now = max(float(change["at_s"]), self.virtual_time)
        old = [s for s in self.streams if s is not None]
        if "join" in change:
            workers = [proto.admit() for _ in range(change["join"])]
            for w in workers:
                self._add_worker(w)
        else:
            workers = list(change["leave"])
            for w in workers:
                proto.retire(w)
                self._events = [e for e in self._events if e[2] != w]
                self._waiting = [x for x in self._waiting if x != w]
                for m in self._members(w):
                    self.streams[m] = None
            heapq.heapify(self._events)
        active = [m for w in proto.active_workers for m in self._members(w)]
        self.sampler, streams = reshard_streams(old, len(active), list(range(len(active))))
        for m, st in zip(active, streams, strict=True):
            self.streams[m] = st
        event = "join" if "join" in change else "leave"
        records = []
        for w in workers:
            if event == "join":
                self._pull_and_schedule(w, now)
            learners = self._members(w)
            records.append(
                {
                    "time_s": float(change["at_s"]),
                    "event": event,
                    "worker": w,
                    "learners": learners,
                    "ranks": [self._learner_rank(m) for m in learners],
                    "version": proto.version,
                    "active_workers": proto.active_workers,
                }
            )
        return records

    def _add_worker(self, worker: int) -> None:
        """Room for a joining worker: its pulled weights, message time, and its learners'
        speed (1), compute stretch (the starting membership's) and data stream (set by the
        re-sharding)."""
        p = self.engine.num_parameters
        extra = torch.empty(1, p, device=self._pulled.device, dtype=self._pulled.dtype)
        self._pulled = torch.cat([self._pulled, extra])
        self._pulled_version.append(0)
        for m in self._members(worker):
            while len(self.speeds) <= m:
                self.speeds.append(1.0)
                self._stretches.append(self._stretch)
                self.streams.append(None)
        self._worker_message_s.append(self._message_seconds(worker))

    def _advance_async(self, lr: float) -> Tick:
        proto = cast(AsynchronousProtocol, self.protocol)
        changes = self._due_changes() if self._membership else []
        arrived, _, worker = self._next_push()
        # the server takes pushes in arrival order, one at a time: it is free from the
        # moment it finished the previous one (the clock's reading)
        now = max(arrived, self.virtual_time) + self._push_s
        self.virtual_time = now
        members = self._members(worker)
        late = self.backup_learners > 0 and self._pulled_version[worker] < proto.version
        if late:  # a backup learner's stale push: its minibatch is spent, the server drops it
            for m in members:
                self.streams[m].next_indices()  # type: ignore[union-attr]
            grad, losses = torch.zeros_like(self._pulled[worker]), []
        else:
            grad, losses = self._mean_gradient(members, self._pulled[worker], lr, proto.version)
            grad = round_to_wire(grad, self.compression)
        update = proto.push(worker, grad, self._pulled_version[worker], lr)
        self.dropped_gradients = getattr(proto, "dropped_gradients", 0)
        p = self.engine.num_parameters  # a push and a pull, and the group's all-reduce
        self.bytes_sent += 2 * p * bytes_per_value(self.compression)
        self.bytes_sent += ring_allreduce_bytes(len(members), p, self.compression)
        if proto.can_pull(worker):
            self._pull_and_schedule(worker, now)
        else:
            self._waiting.append(worker)
        if update is not None and self._waiting:
            released = [w for w in sorted(self._waiting) if proto.can_pull(w)]
            self._waiting = [w for w in self._waiting if w not in released]
            for w in released:
                self._pull_and_schedule(w, now)
        n = 0 if late else len(members) * self.batch_size  # a dropped push counts none
        self.samples += n
        return Tick(n, losses, update, changes)

    def replay_push_order(self, order: Iterable[tuple[int, int]]) -> None:
        """Apply pushes in a recorded arrival order instead of the event queue's.

        A test hook: a run on real processes (e.g. ``distsgd.torch``'s server,
        ``ServeResult.push_order``) records the ``(worker, pulled version)`` of every
        push it applied; from here on the next push is the next recorded one, so the
        protocol sees the same sequence as that run. The virtual clock still advances
        (never backwards) but is no longer the time model's.

        Args:
            order: ``(worker, pulled version)`` pairs, in arrival order.

        Raises:
            ValueError: from :meth:`advance`, when the recorded push does not fit this
                run (the worker has no push pending, it pulled another version, or the
                record has no push left).
        """
        self._push_order = deque(order)

    def _next_push(self) -> tuple[float, int, int]:
        """The next ``(time, seq, worker)`` event: the queue's earliest, or the next
        recorded push (:meth:`replay_push_order`)."""
        order = self._push_order
        if order is None:
            return heapq.heappop(self._events)
        if not order:
            raise ValueError("the recorded push order has no push left")
        worker, pulled = order.popleft()
        pending = [i for i, e in enumerate(self._events) if e[2] == worker]
        if not pending or self._pulled_version[worker] != pulled:
            raise ValueError(
                f"recorded push (worker {worker}, pulled version {pulled}) does not fit: "
                f"the worker has {len(pending)} push(es) pending at pulled version "
                f"{self._pulled_version[worker]}"
            )
        t, seq, _ = self._events.pop(pending[0])
        heapq.heapify(self._events)
        return max(t, self.virtual_time), seq, worker

    # ---- public ------------------------------------------------------------------------
    def advance(self, lr: float) -> Tick:
        """Run one tick: one synchronous iteration, or one push at the parameter server.

        Args:
            lr: base learning rate (from the schedule) for this tick.
        """
        return self._advance_async(lr) if self.is_async else self._advance_sync(lr)

    @property
    def clock_s(self) -> float:
        """Simulated seconds on the virtual clock."""
        return self.virtual_time

    def eval_weights(self) -> Tensor:
        return self.protocol.eval_weights()

    def evaluate(self, weights: Tensor, split: Split, batch_size: int) -> tuple[float, float]:
        """The metric and the mean loss of ``weights`` ``[P]`` on ``split``.

        A model with BatchNorm running statistics is evaluated with statistics recomputed
        for ``weights`` on the recalibration slice of the training set
        (:meth:`GradientEngine.recalibrate`, :func:`~distsgd.engine.bn_recalibration_indices`
        with this runtime's seed, batches of ``batch_size``), whatever the protocol: the
        rule of the dist runtime too, so both report the same evaluation of the same
        weights.
        """
        recalibration = None
        if self.engine.has_running_statistics:  # the slice costs ms beside its forwards
            recalibration = bn_recalibration_inputs(
                self.dataset, self.bn_recalibration_samples, batch_size, self.seed
            )
        return self.engine.evaluate(weights, split, batch_size, recalibration)

    def _load_membership(self, state: dict[str, Any]) -> None:
        """The membership a checkpoint was taken with: the protocol's (loaded first) active
        workers, each joiner's room, the re-sharded streams."""
        proto = cast(AsynchronousProtocol, self.protocol)
        self._next_change = int(state["next_change"])
        for w in range(len(self._pulled_version), proto.num_workers):
            self._add_worker(w)
        active = [m for w in proto.active_workers for m in self._members(w)]
        self.streams = [None] * len(state["streams"])
        self.sampler = ShardedSampler(
            self.sampler.num_samples, len(active), self.batch_size, self.sampler.seed
        )
        for i, m in enumerate(active):
            self.streams[m] = LearnerStream(self.sampler, i)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "virtual_time": self.virtual_time,
            "samples": self.samples,
            "rng": self._rng.get_state(),
            "streams": [s.state_dict() if s is not None else None for s in self.streams],
            "replicas_per_device": self.replicas_per_device,
            "bytes_sent": self.bytes_sent,
            "stall_rng": self._stall_rng.get_state(),
            "dropped_gradients": self.dropped_gradients,
        }
        if self.is_async:
            state.update(
                pulled=self._pulled.clone(),
                pulled_version=list(self._pulled_version),
                events=[list(e) for e in self._events],
                seq=self._seq,
                waiting=list(self._waiting),
            )
        if self._membership:
            state["next_change"] = self._next_change
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.virtual_time = float(state["virtual_time"])
        self.samples = int(state["samples"])
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self._rng.set_state(state["rng"])
        if "stall_rng" in state:
            self._stall_rng.set_state(state["stall_rng"])
        self.dropped_gradients = int(state.get("dropped_gradients", 0))
        k = int(state.get("replicas_per_device", self.replicas_per_device))
        if k != self.replicas_per_device:
            self.set_replicas_per_device(k)
        if state.get("next_change", 0):
            self._load_membership(state)
        for s, st in zip(self.streams, state["streams"], strict=True):
            if s is not None:
                s.load_state_dict(st)
        if self.is_async:
            self._pulled.copy_(state["pulled"])
            self._pulled_version = [int(v) for v in state["pulled_version"]]
            self._events = [(float(t), int(s), int(w)) for t, s, w in state["events"]]
            heapq.heapify(self._events)
            self._seq = int(state["seq"])
            self._waiting = [int(w) for w in state["waiting"]]
