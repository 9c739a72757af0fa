"""The cluster's timing model, in one home: compute, replicas, messages, all-reduce, stragglers.

The simulated runtime (:mod:`distsgd.runtime.sim`) charges its virtual clock with these
formulas, and the tuner's performance model (:mod:`distsgd.tuner.perf_model`) predicts
seconds per iteration with the same ones, so the two cannot drift apart. Pure numerics:
no torch, no communication.

Units: seconds; bandwidth in Gb/s; messages carry P values of ``bytes_per_value`` bytes
(4: float32; 2 with a compressed exchange).

Example::

    from distsgd.runtime.cluster_model import ClusterModel, device_seconds
    c = ClusterModel(t_batch=1e-3, t_sample=1e-4, num_parameters=421642)
    device_seconds(4, 8, c)  # one device computing 4 replicas of 8 samples
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "ClusterModel",
    "allgather_seconds",
    "allreduce_seconds",
    "broadcast_seconds",
    "compute_seconds",
    "core_stretch",
    "device_seconds",
    "host_of",
    "server_busy_fraction",
    "server_core_stretch",
    "server_push_seconds",
    "replica_ratio",
    "straggler_factor",
]


@dataclass(frozen=True)
class ClusterModel:
    """The simulated cluster's timing model (see :mod:`distsgd.runtime.sim`).

    Attributes:
        t_batch: fixed compute seconds per minibatch on one device (``seconds_per_batch``).
        t_sample: compute seconds per sample (``seconds_per_sample``).
        latency_s: one-way message latency, seconds.
        bandwidth_gbps: link bandwidth in Gb/s; 0 means infinite.
        num_parameters: P, values per message.
        jitter: relative spread of compute times (log-normal, mean 1); synchronous steps
            wait for the slowest of m devices (:func:`straggler_factor`).
        t_server: parameter-server seconds of work per pushed gradient
            (``cluster.seconds_per_push``; 0: free, the server never saturates); a
            learner's cycle includes it (the reply leaves when the push is served) and an
            asynchronous protocol cannot apply gradients faster than ``1 / t_server``
            per second (the simulated runtime serves pushes one at a time).
        t_replica: SMA only: seconds each further replica (with its b samples) adds when
            a device computes its k replicas as one batched computation
            (``cluster.seconds_per_replica``); None: ``t_batch + b·t_sample`` (k separate
            minibatches), as the simulated runtime does when it is not set.
        replica_ratios: SMA only: measured t(k)/t(1) for k = 1, 2, …
            (``cluster.replica_ratios``); when given it replaces ``t_replica``
            (:func:`replica_ratio`).
        allreduce_latency_s: the all-reduce's own latency term, seconds
            (``cluster.allreduce_latency_s``); None: ``latency_s``.
        allreduce_bandwidth_gbps: the all-reduce's own bandwidth, Gb/s, 0 infinite
            (``cluster.allreduce_bandwidth_gbps``); None: ``bandwidth_gbps``. gloo's
            all-reduce reduces and copies as it goes, so per byte it is not a send
            (:mod:`distsgd.runtime.netcal` fits the two apart).
        t_iteration: a synchronous device's seconds per iteration beyond its gradients
            (``cluster.seconds_per_iteration``): the protocol's update of the flat weights
            and the runtime loop's own work (DDP wrapper, minibatch draw), added once per
            device iteration by :func:`device_seconds`; 0: free. Parameter-server
            learners are not charged it (the update is the server's, ``t_server``).
        cores: CPU cores the cluster's processes share (``cluster.cores``); 0: every
            process has a core of its own (a real cluster). With more busy processes than
            cores, compute and the server's work stretch (:func:`core_stretch`,
            :func:`server_core_stretch`): one machine running every rank.
        bytes_per_value: bytes of one value on the wire: 4 (float32) or 2
            (``protocol.compression`` bf16 / fp16), for messages and all-reduces alike.
        t_server_contended: the server's wall seconds per push measured on processes
            sharing the cores as the run's do, i.e. while the other learners compute
            (``cluster.seconds_per_push_contended``; 0: not measured). Where set it is
            the server's time per push as charged, not stretched again: the wait for a
            core is already in it (:func:`server_push_seconds`); ``t_server``, the work
            measured alone, stays the server's demand for a core in
            :func:`server_core_stretch`.
    """

    t_batch: float
    t_sample: float
    latency_s: float = 50e-6
    bandwidth_gbps: float = 10.0
    num_parameters: int = 0
    jitter: float = 0.0
    t_server: float = 0.0
    t_replica: float | None = None
    replica_ratios: tuple[float, ...] = ()
    cores: int = 0
    allreduce_latency_s: float | None = None
    allreduce_bandwidth_gbps: float | None = None
    t_iteration: float = 0.0
    t_server_contended: float = 0.0
    bytes_per_value: int = 4

    @property
    def message_seconds(self) -> float:
        """One message of P values: ``latency_s + 8 B P / (bandwidth_gbps · 1e9)``, B bytes
        a value."""
        return self.latency_s + self.transfer_seconds

    @property
    def transfer_seconds(self) -> float:
        bw = self.bandwidth_gbps
        return 0.0 if bw == 0 else 8.0 * self.bytes_per_value * self.num_parameters / (bw * 1e9)


def compute_seconds(batch_size: int | float, cluster: ClusterModel) -> float:
    """Seconds for one device to compute one minibatch of b samples: ``t_batch + b·t_sample``."""
    return cluster.t_batch + batch_size * cluster.t_sample


def replica_ratio(replicas: int, ratios: tuple[float, ...] | list[float]) -> float:
    """t(k)/t(1) of a device computing k = ``replicas`` replicas as one batched
    computation, from measured ratios ``ratios[j] = t(j + 1)/t(1)`` (at least 2 values,
    the first 1): the measured value for k <= len(ratios); beyond, the last measured step
    continues, ``ρ_n + (k − n)·max(ρ_n − ρ_{n−1}, 0)``.

    Raises:
        ValueError: fewer than 2 ratios, or k < 1.
    """
    n = len(ratios)
    if n < 2 or replicas < 1:
        raise ValueError(f"need k >= 1 and >= 2 measured ratios, got k = {replicas}, {ratios!r}")
    if replicas <= n:
        return float(ratios[replicas - 1])
    return float(ratios[-1]) + (replicas - n) * max(float(ratios[-1] - ratios[-2]), 0.0)


def device_seconds(replicas: int, batch_size: int | float, cluster: ClusterModel) -> float:
    """Seconds of one synchronous iteration of a device computing k = ``replicas``
    replicas of b samples as one batched computation, and its work beyond the
    gradients: ``t(1)·replica_ratio(k) + t_iteration`` with measured ``replica_ratios``,
    else ``t(1) + (k − 1)·t_replica + t_iteration``, with
    ``t(1) = t_batch + b·t_sample`` (the simulated runtime's
    :meth:`~distsgd.runtime.sim.DeviceProfile.device_seconds`; Crossbow, docs/protocols.md §4);
    k = 1 is :func:`compute_seconds` plus ``t_iteration``."""
    t1 = compute_seconds(batch_size, cluster)
    if cluster.replica_ratios:
        return t1 * replica_ratio(replicas, cluster.replica_ratios) + cluster.t_iteration
    r = t1 if cluster.t_replica is None else cluster.t_replica
    return t1 + (replicas - 1) * r + cluster.t_iteration


def _collective_link(cluster: ClusterModel) -> tuple[float, float]:
    """(latency in seconds, bandwidth in Gbit/s) of a collective: the all-reduce's own
    ``allreduce_latency_s`` / ``allreduce_bandwidth_gbps`` where they are set, else the
    messages' ``latency_s`` / ``bandwidth_gbps``."""
    lat = cluster.latency_s if cluster.allreduce_latency_s is None else cluster.allreduce_latency_s
    bw = (
        cluster.bandwidth_gbps
        if cluster.allreduce_bandwidth_gbps is None
        else cluster.allreduce_bandwidth_gbps
    )
    return lat, bw


def allreduce_seconds(participants: int, cluster: ClusterModel) -> float:
    """Ring all-reduce of P values of B bytes among m participants:
    ``2(m−1)·latency + 2(m−1)/m · 8BP/bandwidth`` (0 for m <= 1), with the all-reduce's
    own ``allreduce_latency_s`` / ``allreduce_bandwidth_gbps`` where they are set, else
    the messages' ``latency_s`` / ``bandwidth_gbps``."""
    m = participants
    if m <= 1:
        return 0.0
    lat, bw = _collective_link(cluster)
    transfer = (
        0.0 if bw == 0 else 8.0 * cluster.bytes_per_value * cluster.num_parameters / (bw * 1e9)
    )
    return 2 * (m - 1) * lat + 2 * (m - 1) / m * transfer


def broadcast_seconds(participants: int, cluster: ClusterModel) -> float:
    """A compute group's leader handing the pulled weights to its m − 1 members, as the
    learners do it: two binomial-tree broadcasts of ⌈log₂ m⌉ rounds each, the reply's
    kind and version (a few values: one ``latency_s`` a round), then the weights (one
    message of P values a round, :attr:`ClusterModel.message_seconds`):
    ``⌈log₂ m⌉ · (2·latency + 8BP/bandwidth)``, seconds; 0 for m <= 1."""
    if participants <= 1:
        return 0.0
    rounds = math.ceil(math.log2(participants))
    return rounds * (cluster.latency_s + cluster.message_seconds)


def allgather_seconds(participants: int, bytes_each: int, cluster: ClusterModel) -> float:
    """Ring all-gather among m participants, each contributing ``bytes_each`` bytes:
    ``(m−1)·latency + (m−1) · 8·bytes_each/bandwidth`` (0 for m <= 1), with the
    all-reduce's own latency and bandwidth where they are set (:func:`allreduce_seconds`)."""
    m = participants
    if m <= 1:
        return 0.0
    lat, bw = _collective_link(cluster)
    return (m - 1) * lat + (0.0 if bw == 0 else (m - 1) * 8.0 * bytes_each / (bw * 1e9))


def host_of(rank: int, processes_per_host: int) -> int:
    """The host of ``rank`` when the launchers place ``processes_per_host`` ranks on each
    host in rank order (``torchrun --nproc-per-node``: node rank ``r // n``); with
    ``processes_per_host <= 0`` every rank is a host of its own."""
    return rank if processes_per_host <= 0 else rank // processes_per_host


def straggler_factor(m: int, jitter: float) -> float:
    """Expected slowest of m compute times relative to the mean: ``1 + s · z_m``.

    z_m is Blom's approximation of the expected maximum of m standard normal draws,
    ``Φ⁻¹((m − 0.375) / (m + 0.25))`` (Blom 1958), and s the relative spread
    (``jitter``); 1 for m = 1 or s = 0. Non-decreasing in m and s.
    """
    if m <= 1 or jitter <= 0:
        return 1.0
    return 1.0 + jitter * NormalDist().inv_cdf((m - 0.375) / (m + 0.25))


def core_stretch(busy: float, cores: int) -> float:
    """Wall over CPU seconds of a busy process when ``busy`` processes (on average) want
    a core at once and ``cores`` are there, shared fairly: ``max(1, busy / cores)``;
    1 when ``cores <= 0`` (each process has its own core). Non-decreasing in ``busy``,
    non-increasing in ``cores``."""
    if cores <= 0:
        return 1.0
    return max(1.0, busy / cores)


def server_core_stretch(
    learners: int, batch_size: int | float, cluster: ClusterModel, pushers: int | None = None
) -> float:
    """How much compute and the server's work stretch in a parameter-server run whose
    ``learners`` learner processes and one server process share ``cluster.cores`` cores.

    Steady state, first order: each of the ``pushers`` workers (learners, or compute
    groups; default ``learners``) cycles in ``c = 2m + t_c + t_s`` (two messages, its
    compute, the server's time on its push: ``t_server_contended`` where measured, else
    ``t_server``), so the server wants a core a fraction
    ``u = min(1, pushers · t_server / c)`` of the time (``t_server``, its work measured
    alone, is its demand for a core; a contended time also holds its waits for one), and
    on average ``learners + u`` processes want a core (a learner's busy fraction is
    counted as 1, the conservative side). Returns :func:`core_stretch` of that: 1 when
    they fit (``cores = 0``, or ``learners + u <= cores``); e.g. 2 learners + a server
    busy 20% of the time on 2 cores: 1.1.
    """
    if cluster.cores <= 0 or learners < 1:
        return 1.0
    n = learners if pushers is None else pushers
    u = server_busy_fraction(n, batch_size, cluster, each_learner_pushes=n == learners)
    return core_stretch(learners + u, cluster.cores)


def server_busy_fraction(
    pushers: int,
    batch_size: int | float,
    cluster: ClusterModel,
    each_learner_pushes: bool = True,
    message_s: float | None = None,
) -> float:
    """The fraction of the time a parameter server wants a core (first order, steady
    state): ``min(1, pushers · t_server / c)`` with each worker's cycle
    ``c = 2m + t_c + t_s`` (``m``: ``message_s``, default the cluster's
    ``message_seconds``; ``t_s``: :func:`server_push_seconds` unstretched); 0 when the
    cycle is 0 (see :func:`server_core_stretch`)."""
    m = cluster.message_seconds if message_s is None else message_s
    waited = server_push_seconds(1.0, cluster, each_learner_pushes=each_learner_pushes)
    cycle = 2 * m + compute_seconds(batch_size, cluster) + waited
    return min(1.0, pushers * cluster.t_server / cycle) if cycle > 0 else 0.0


def server_push_seconds(
    stretch: float, cluster: ClusterModel, each_learner_pushes: bool = True
) -> float:
    """The server's seconds per push as charged: ``t_server_contended`` where it was
    measured and the run is the layout it was measured in: processes that share cores
    (``cores`` > 0) and ``each_learner_pushes`` (asynchronous or n-softsync learners, each
    waiting for its own reply while the other λ − 1 compute; a wall time with the wait for
    a core in it, so not stretched again). Else ``t_server · stretch`` (its work measured
    alone, stretched by the run's :func:`server_core_stretch` ``stretch``): with a core
    per process, as on a real cluster, nothing waits for one; compute groups push less
    often than λ learners would, with other processes computing meanwhile."""
    if cluster.t_server_contended > 0 and cluster.cores > 0 and each_learner_pushes:
        return cluster.t_server_contended
    return cluster.t_server * stretch
