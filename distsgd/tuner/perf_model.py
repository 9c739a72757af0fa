"""The tuner's performance model: time to accuracy = HE × SE (pure numerics, numpy only).

Omnivore (Hadjis, Zhang, Mitliagkas, Iter, Ré, arXiv:1606.04487, docs/protocols.md §3) splits the
time a configuration needs to reach a target accuracy into

* **hardware efficiency** HE — seconds per iteration (one update of the central model),
  measured by a probe or predicted from the simulated cluster's device profile and network
  model (:func:`seconds_per_iteration`), which extrapolates to clusters larger than the
  machine at hand; and
* **statistical efficiency** SE — iterations to the target, fitted from the probes' loss
  curves (:func:`fit_loss_curve`, :func:`iterations_to_loss`) with the target accuracy
  mapped to a target training loss through the probes' evaluation points
  (:func:`fit_error_vs_loss`), and carried to unprobed batch sizes with the
  gradient-noise-scale law (:func:`scale_iterations`),

so that ``time_to_accuracy = HE · SE`` (:func:`time_to_accuracy`).

Units: seconds are virtual seconds on the simulated runtime and wall seconds on real
processes; an iteration is an update of the central model (a synchronous step, or a
parameter-server version); losses are mean cross-entropy in nats.

Example::

    from distsgd.tuner.perf_model import ClusterModel, Layout, seconds_per_iteration
    c = ClusterModel(t_batch=0.9e-3, t_sample=486e-6, latency_s=50e-6,
                     bandwidth_gbps=10.0, num_parameters=421642)
    seconds_per_iteration(Layout("compute_groups", num_learners=8, batch_size=16,
                                 num_groups=4), c)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distsgd.runtime.cluster_model import (
    ClusterModel,
    allreduce_seconds,
    broadcast_seconds,
    compute_seconds,
    core_stretch,
    device_seconds,
    replica_ratio,
    server_core_stretch,
    server_push_seconds,
    straggler_factor,
)

__all__ = [
    "FAMILIES",
    "ClusterModel",
    "Layout",
    "LossCurve",
    "ErrorVsLoss",
    "allreduce_seconds",
    "compute_seconds",
    "device_seconds",
    "replica_ratio",
    "fit_error_vs_loss",
    "fit_loss_curve",
    "iterations_to_loss",
    "estimate_noise_scale",
    "samples_per_iteration",
    "scale_iterations",
    "seconds_per_iteration",
    "straggler_factor",
    "time_to_accuracy",
]

FAMILIES = ("hardsync", "compute_groups", "softsync", "sma", "local_sgd", "diloco")
_AVERAGING = ("local_sgd", "diloco")


@dataclass(frozen=True)
class Layout:
    """A protocol family and its layout (docs/protocols.md notation).

    Attributes:
        family: ``hardsync`` (§1), ``compute_groups`` (§3, g groups), ``softsync`` (§2,
            Rudra n-softsync on a parameter server), ``sma`` (§4, k replicas per device),
            ``local_sgd`` (§5) or ``diloco`` (§6), averaging every H iterations.
        num_learners: λ.
        batch_size: b, samples per learner per gradient.
        num_groups: g (compute groups only), divides λ.
        softsync: n (softsync only), divides λ.
        replicas_per_device: k (SMA only), divides λ; the cluster has λ/k devices.
        average_every: H >= 1 (local SGD and DiLoCo only), iterations per all-reduce.

    Raises:
        ValueError: unknown family or a count that does not divide λ.
    """

    family: str
    num_learners: int
    batch_size: int
    num_groups: int = 1
    softsync: int = 1
    replicas_per_device: int = 1
    average_every: int = 1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family = {self.family!r} is not one of {FAMILIES}")
        lam = self.num_learners
        if lam < 1 or self.batch_size < 1:
            raise ValueError(
                f"num_learners = {lam} and batch_size = {self.batch_size} must be >= 1"
            )
        for name in ("num_groups", "softsync", "replicas_per_device"):
            v = getattr(self, name)
            if v < 1 or lam % v:
                raise ValueError(f"{name} = {v} must divide num_learners = {lam}")
        if self.average_every < 1:
            raise ValueError(f"average_every = {self.average_every} must be >= 1")


def samples_per_iteration(layout: Layout) -> int:
    """Samples whose gradients go into one update: λb (hardsync, SMA), (λ/g)b (compute
    groups: one group's step) or (λ/n)b (n-softsync: c = λ/n gradients per update)."""
    lam, b = layout.num_learners, layout.batch_size
    if layout.family == "compute_groups":
        return lam // layout.num_groups * b
    if layout.family == "softsync":
        return lam // layout.softsync * b
    return lam * b


def seconds_per_iteration(layout: Layout, cluster: ClusterModel) -> float:
    """Hardware efficiency HE: seconds per update of the central model.

    With t_c = ``compute_seconds(b)``, m the message time, AR(m) the ring all-reduce and
    J(m) the straggler factor:

    * hardsync: ``J(λ)·(t_c + t_iteration) + AR(λ)`` (every learner, then one
      all-reduce; docs/protocols.md §1; ``t_iteration``: its update of the weights and loop work);
    * SMA, k replicas per device: ``J(λ/k)·D(k) + AR(λ/k)`` with the device time
      ``D(k)`` of :func:`device_seconds` (t(1) times the measured t(k)/t(1), or
      ``t_batch + b·t_sample + (k − 1)·t_replica``, plus ``t_iteration``; a
      device computes its k learners as one batched computation; devices all-reduce
      their corrections; Crossbow, docs/protocols.md §4);
    * local SGD and DiLoCo, averaging every H iterations: ``J(λ)·(t_c + t_iteration) +
      AR(λ)/H`` (hardsync's, with one all-reduce per H iterations; docs/protocols.md §5–6);
    * compute groups: a group's cycle is ``2m + BC(λ/g) + J(λ/g)·t_c + AR(λ/g) +
      t_server`` (BC: the leader's broadcast of the weights to its members,
      :func:`~distsgd.runtime.cluster_model.broadcast_seconds`; t_server: the server's
      work on its push before the reply) and the g groups run
      concurrently, so ``max(cycle / g, t_server)``: HE falls about as ``1/g`` until the
      parameter server saturates at ``t_server`` per push (Omnivore, docs/protocols.md §3);
    * n-softsync: every learner cycles in ``2m + t_c + t_server``; λ pushes per cycle and c = λ/n
      pushes per update give ``max(cycle / n, c·t_server)`` (Rudra, docs/protocols.md §2).

    With ``cluster.cores`` > 0 (every process on one machine) t_c, D(k) and t_server are
    stretched by :func:`~distsgd.runtime.cluster_model.core_stretch` of the busy
    processes (synchronous: the devices; parameter server and compute groups:
    :func:`~distsgd.runtime.cluster_model.server_core_stretch`), as the simulator does;
    a ``t_server_contended`` (measured while the other learners compute) replaces
    t_server and is not stretched
    (:func:`~distsgd.runtime.cluster_model.server_push_seconds`).

    Returns:
        seconds (> 0 whenever t_batch + b·t_sample > 0).
    """
    lam, b = layout.num_learners, layout.batch_size
    tc = compute_seconds(b, cluster)
    s = cluster.jitter
    cores = cluster.cores
    if layout.family in ("hardsync", "sma") or layout.family in _AVERAGING:
        k = layout.replicas_per_device if layout.family == "sma" else 1  # hardsync: one
        h = layout.average_every if layout.family in _AVERAGING else 1
        devices = lam // k
        d = device_seconds(k, b, cluster) * core_stretch(devices, cores)
        return straggler_factor(devices, s) * d + allreduce_seconds(devices, cluster) / h
    m = cluster.message_seconds
    if layout.family == "compute_groups":
        g = layout.num_groups
        size = lam // g
        x = server_core_stretch(lam, b, cluster, pushers=g)
        ts = server_push_seconds(x, cluster, each_learner_pushes=g == lam)
        cycle = 2 * m + straggler_factor(size, s) * tc * x + allreduce_seconds(size, cluster)
        cycle += broadcast_seconds(size, cluster) + ts
        return max(cycle / g, ts)
    n = layout.softsync
    x = server_core_stretch(lam, b, cluster)
    ts = server_push_seconds(x, cluster)
    cycle = 2 * m + tc * x + ts
    return max(cycle / n, (lam // n) * ts)


@dataclass(frozen=True)
class LossCurve:
    """Training loss against iterations: ``L(i) = L_inf + A · (i + 1)^(−β)``.

    A power-law decay to a floor, the shape SGD loss curves take over the range a tuner
    sees (e.g. Hestness et al. 2017, "Deep learning scaling is predictable"); i counts
    iterations (updates) from the start of training.

    Attributes:
        L_inf: asymptotic loss (>= 0). A: amplitude (>= 0). beta: decay exponent (> 0).
        rmse: root-mean-square residual of the fit, in nats.
    """

    L_inf: float
    A: float
    beta: float
    rmse: float = 0.0

    def __call__(self, iterations: np.ndarray | float) -> np.ndarray | float:
        return self.L_inf + self.A * np.power(np.asarray(iterations, dtype=float) + 1.0, -self.beta)


def _fit_given_beta(x: np.ndarray, y: np.ndarray, beta: float) -> tuple[float, float, float]:
    """Least squares of y ≈ L_inf + A·(x+1)^(−β) for fixed β with L_inf, A >= 0."""
    z = np.power(x + 1.0, -beta)
    zm, ym = z.mean(), y.mean()
    var = ((z - zm) ** 2).sum()
    a = ((z - zm) * (y - ym)).sum() / var if var > 0 else 0.0
    a = max(a, 0.0)
    c = ym - a * zm
    if c < 0:  # floor at 0: refit A through the origin
        c = 0.0
        zz = (z * z).sum()
        a = max((z * y).sum() / zz, 0.0) if zz > 0 else 0.0
    sse = float(((c + a * z - y) ** 2).sum())
    return c, a, sse


def fit_loss_curve(iterations: np.ndarray, losses: np.ndarray) -> LossCurve:
    """Fit :class:`LossCurve` to ``(iterations, losses)`` (both shape ``[N]``, N >= 3).

    For every β on a log grid in [0.01, 4] (then a finer grid around the best) L_inf and
    A follow by linear least squares (clamped at 0); the β with the least squared error
    wins. Non-finite losses are dropped.

    Raises:
        ValueError: fewer than 3 finite points, or shapes differ.
    """
    x = np.asarray(iterations, dtype=float)
    y = np.asarray(losses, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"iterations {x.shape} and losses {y.shape} differ in shape")
    ok = np.isfinite(x) & np.isfinite(y) & (x >= 0)
    x, y = x[ok], y[ok]
    if x.size < 3:
        raise ValueError(f"need at least 3 finite loss points to fit a curve, got {x.size}")
    betas = np.logspace(-2, np.log10(4.0), 120)
    best = min(((_fit_given_beta(x, y, b), b) for b in betas), key=lambda t: t[0][2])
    b0 = best[1]
    fine = b0 * np.logspace(-0.05, 0.05, 41)
    (c, a, sse), beta = min(((_fit_given_beta(x, y, b), b) for b in fine), key=lambda t: t[0][2])
    return LossCurve(float(c), float(a), float(beta), math.sqrt(sse / x.size))


def iterations_to_loss(curve: LossCurve, target_loss: float) -> float:
    """Statistical efficiency SE: iterations until ``curve`` reaches ``target_loss``.

    Solves ``L_inf + A (i+1)^(−β) = L*``: ``i = (A / (L* − L_inf))^(1/β) − 1``, at least 0;
    ``inf`` when ``L* <= L_inf`` (the curve never gets there). Non-increasing in ``L*``.
    """
    if target_loss <= curve.L_inf:
        return math.inf
    if curve.A <= 0:
        return 0.0
    ratio = curve.A / (target_loss - curve.L_inf)
    return max(ratio ** (1.0 / curve.beta) - 1.0, 0.0)


@dataclass(frozen=True)
class ErrorVsLoss:
    """Test error against training loss: ``1 − accuracy = e0 + s · loss`` (s > 0).

    Maps a target accuracy to the training loss a loss curve must reach
    (:meth:`target_loss`). Fitted over the evaluation points nearest the target, where the
    relation is close to linear on classification tasks.
    """

    e0: float
    s: float

    def target_loss(self, target: float) -> float:
        """Training loss (nats) at which test accuracy reaches ``target``."""
        return (1.0 - target - self.e0) / self.s


def fit_error_vs_loss(
    train_losses: np.ndarray, accuracies: np.ndarray, keep: int = 6
) -> ErrorVsLoss:
    """Fit :class:`ErrorVsLoss` on the ``keep`` points with the highest accuracy.

    Args:
        train_losses: mean training loss of each evaluation interval, shape ``[N]``.
        accuracies: test accuracy at the end of that interval, in [0, 1], shape ``[N]``.
        keep: points used (those nearest a high target).

    Raises:
        ValueError: fewer than 2 finite points, or all losses equal.
    """
    x = np.asarray(train_losses, dtype=float)
    e = 1.0 - np.asarray(accuracies, dtype=float)
    ok = np.isfinite(x) & np.isfinite(e)
    x, e = x[ok], e[ok]
    if x.size < 2:
        raise ValueError(f"need at least 2 evaluation points, got {x.size}")
    order = np.argsort(e)[:keep]
    x, e = x[order], e[order]
    if np.ptp(x) <= 0:
        raise ValueError("all training losses are equal; cannot relate loss to accuracy")
    s, e0 = np.polyfit(x, e, 1)
    if s <= 0:  # noise made the slope non-positive: use the ratio through the origin
        s, e0 = float((e / np.maximum(x, 1e-9)).mean()), 0.0
    return ErrorVsLoss(float(e0), float(s))


def scale_iterations(
    iterations_ref: float, batch_ref: float, batch: float, noise_scale: float
) -> float:
    """Iterations to the same loss at another samples-per-iteration B.

    The empirical model of large-batch training (McCandlish, Kaplan, Amodei, OpenAI 2018):
    ``S(B) = S_min · (1 + B_noise / B)``, so ``S(B) = S(B_ref) · (1 + B_noise/B) /
    (1 + B_noise/B_ref)``. Non-increasing in B, bounded below by ``S_min``; samples
    ``B·S(B)`` are non-decreasing in B.

    Args:
        iterations_ref: S at ``batch_ref`` samples per iteration.
        batch_ref, batch: B_ref and B, samples per iteration (> 0).
        noise_scale: B_noise, samples (>= 0).
    """
    return iterations_ref * (1.0 + noise_scale / batch) / (1.0 + noise_scale / batch_ref)


def estimate_noise_scale(b1: float, s1: float, b2: float, s2: float) -> float:
    """B_noise from iterations S1, S2 at two batch sizes B1 != B2 (inverting
    :func:`scale_iterations`), clamped to ``[0, 1e6]``; ``nan`` when undetermined."""
    # S1 (1 + Bn/B2) = S2 (1 + Bn/B1)  =>  Bn = (S2 − S1) / (S1/B2 − S2/B1)
    den = s1 / b2 - s2 / b1
    if b1 == b2 or den == 0 or not all(map(math.isfinite, (s1, s2))):
        return math.nan
    return float(min(max((s2 - s1) / den, 0.0), 1e6))


def time_to_accuracy(seconds_per_iter: float, iterations: float) -> float:
    """Predicted time to accuracy: ``HE · SE`` seconds (``inf`` if SE is)."""
    return seconds_per_iter * iterations
