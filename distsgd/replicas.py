"""Crossbow's auto-tuner of learners (replicas) per device.

Rule (docs/protocols.md §4; Koliousis et al., "Crossbow: Scaling Deep Learning with Small Batch
Sizes on Multi-GPU Servers", VLDB 2019, arXiv:1901.02244, §4.3): start with one learner
per device; at every measurement interval compare the throughput with the previous one;
if it improved by more than a threshold (10%), add one learner per device (a copy of an
existing replica), otherwise remove the last one added and stop.

Two stopping rules (``rule``):

* ``"crossbow"`` (default, docs/protocols.md §4): continue while the total throughput improves by
  more than ``threshold``: T(k) / T(k−1) − 1 > threshold.
* ``"marginal"``: continue while the replica just added contributes more than
  ``threshold`` of what an average replica contributed before it:
  (T(k) − T(k−1)) / (T(k−1) / (k−1)) > threshold, i.e. (k−1) × gain > threshold. At
  k = 2 both rules are the same. Crossbow's rule asks for a fixed *total* gain per added
  replica, which even a device that scales perfectly (T ∝ k) cannot give past k = 10
  (gain 1/k), so on a throughput curve that rises slowly (a CPU, where k = 2 already
  fills the cores) it stops at small k although more replicas still help; the marginal
  rule asks the same of every replica and follows such a curve to its maximum.

Measurement: the throughput of an interval is ``samples / (median seconds per
iteration × iterations)``, so one slow iteration (an OS hiccup, a page fault, another
process taking the core) does not decide; with equal iterations it is the plain
``samples / seconds``. The rule itself is Crossbow's, unchanged.

The tuner is pure numerics: it is fed (samples, seconds) per iteration and answers with
decisions; it never reads a clock, so it runs unchanged on the simulated cluster (virtual
seconds from the device profile, which models throughput as a function of k) and on real
processes (wall seconds). A multi-process runtime must feed every process the same
measurement so that every process takes the same decision: the dist runtime feeds the
all-reduced maximum of each synchronisation interval's wall seconds
(``SyncDistRuntime.max_over_ranks``, called by ``Trainer._autotune``) and applies the
decision to the protocol (``set_replicas_per_device``) and to its data streams
(``SyncDistRuntime.set_replicas_per_device``) at the same synchronisation point.

Example::

    >>> from distsgd.replicas import ReplicaAutoTuner
    >>> tuner = ReplicaAutoTuner(threshold=0.1, interval=2, warmup=0)
    >>> seconds = {1: 1.0, 2: 1.2, 3: 1.75}          # one iteration of k replicas × b
    >>> decisions = []
    >>> while not tuner.done:
    ...     d = tuner.observe(samples=8 * tuner.k, seconds=seconds[tuner.k])
    ...     if d is not None:
    ...         decisions.append((d.k_before, d.action, d.k_after))
    >>> decisions
    [(1, 'add', 2), (2, 'add', 3), (3, 'remove', 2)]
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Decision", "ReplicaAutoTuner", "RULES"]

RULES = ("crossbow", "marginal")


def _percent(fraction: float) -> str:
    """A fraction as a percentage with its significant digits: 0.1 → "10%", 0.105 →
    "10.5%", 0.005 → "0.5%"."""
    return f"{fraction * 100:.6g}%"


@dataclass
class Decision:
    """One decision of the tuner.

    Attributes:
        iteration: the tuner's count of observed iterations when it decided.
        k_before: replicas per device during the measurement.
        k_after: replicas per device from the next iteration on.
        throughput: measured samples per second at ``k_before`` (all devices together):
            samples of the interval / (median seconds per iteration × iterations).
        previous_throughput: the same at the previous k (None for the first measurement).
        gain: ``throughput / previous_throughput − 1`` (None for the first measurement).
        criterion: what the rule compared with the threshold: the gain (``"crossbow"``)
            or (k_before − 1) × gain (``"marginal"``); None for the first measurement.
        action: ``"add"``, ``"remove"`` or ``"keep"`` (``k_after = k_before``: stopped).
        reason: one sentence.
    """

    iteration: int
    k_before: int
    k_after: int
    throughput: float
    previous_throughput: float | None
    gain: float | None
    action: str
    reason: str
    criterion: float | None = None

    def line(self) -> str:
        """The decision as one log line."""
        vs = "" if self.gain is None else f", {self.gain:+.1%} vs k={self.k_before - 1}"
        return (
            f"autotune: k={self.k_before}: {self.throughput:.1f} samples/s{vs} → "
            f"{self.action}, k={self.k_after} ({self.reason})"
        )


class ReplicaAutoTuner:
    """Chooses k, the replicas per device, from measured throughput (Crossbow §4.3).

    Args:
        threshold: add a replica while throughput improves by more than this fraction
            (> 0; Crossbow: 0.1).
        interval: observations per measurement (>= 1). One observation is one
            synchronisation interval: an iteration for SMA, an averaging period of H
            iterations for local SGD (so there ``interval`` counts averaging periods).
        max_replicas: the largest k tried (>= 1); at it the tuner keeps k and stops.
        warmup: observations after each change that are not counted (>= 0; iterations for
            SMA, averaging periods for local SGD; the first iteration of a new shape pays
            one-off costs on real hardware).
        rule: ``"crossbow"`` (total gain > threshold) or ``"marginal"`` (the added
            replica's share, (k − 1) × gain, > threshold); see the module docstring.

    Raises:
        ValueError: an argument outside the allowed values.
    """

    def __init__(
        self,
        threshold: float = 0.10,
        interval: int = 50,
        max_replicas: int = 16,
        warmup: int = 1,
        rule: str = "crossbow",
    ) -> None:
        if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold = {threshold!r} is not allowed: expected a number > 0")
        for name, value, lo in (
            ("interval", interval, 1),
            ("max_replicas", max_replicas, 1),
            ("warmup", warmup, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name} = {value!r} is not allowed: expected an integer >= {lo}")
        if rule not in RULES:
            raise ValueError(f"rule = {rule!r} is not allowed: expected one of {RULES}")
        self.rule = rule
        self.threshold = float(threshold)
        self.interval = interval
        self.max_replicas = max_replicas
        self.warmup = warmup
        self.k = 1
        self.done = False
        self.decisions: list[Decision] = []
        self._iteration = 0
        self._skip = warmup
        self._count = 0
        self._samples = 0
        self._seconds: list[float] = []  # per counted iteration of this interval
        self._previous: float | None = None

    def observe(self, samples: int, seconds: float) -> Decision | None:
        """Count one iteration: ``samples`` processed by all devices in ``seconds``
        (wall or virtual seconds of the synchronisation interval, >= 0).

        Returns:
            The decision taken at the end of a measurement interval, else None (also
            always None once :attr:`done`). Apply ``k_after`` before the next iteration.
        """
        if self.done:
            return None
        self._iteration += 1
        if self._skip > 0:
            self._skip -= 1
            return None
        self._count += 1
        self._samples += samples
        self._seconds.append(float(seconds))
        if self._count < self.interval:
            return None
        # the median iteration stands for every iteration of the interval: one outlier
        # cannot move it (samples are the same every iteration at a fixed k)
        typical = statistics.median(self._seconds) * self._count
        throughput = self._samples / typical if typical > 0 else math.inf
        prev = self._previous
        k = self.k
        gain = None if prev is None else throughput / prev - 1.0
        crit = None
        if gain is not None:
            # marginal: the k-th replica's gain over an average replica at k − 1
            crit = gain * (k - 1) if self.rule == "marginal" else gain
        what = "gain"
        if crit is not None and self.rule == "marginal":
            what = f"(k−1)·gain = {k - 1} × {gain:+.1%} ="
        if crit is not None and not crit > self.threshold:
            action, k_after, self.done = "remove", k - 1, True
            reason = f"{what} {crit:+.1%} is not above the threshold {_percent(self.threshold)}"
        elif k >= self.max_replicas:
            action, k_after, self.done = "keep", k, True
            reason = f"k = {k} is autotune_max_replicas"
        else:
            action, k_after = "add", k + 1
            reason = (
                "first measurement"
                if crit is None
                else f"{what} {crit:+.1%} is above the threshold {_percent(self.threshold)}"
            )
        decision = Decision(
            self._iteration, k, k_after, throughput, prev, gain, action, reason, crit
        )
        self.decisions.append(decision)
        self.k = k_after
        self._previous = throughput
        self._count, self._samples, self._seconds = 0, 0, []
        self._skip = self.warmup
        return decision

    def to_json(self) -> dict[str, Any]:
        """``{"k": final or current k, "done": bool, "threshold", "rule", "interval",
        "max_replicas", "decisions": [Decision as dict, ...]}`` (the run directory's
        ``autotune.json``)."""
        return {
            "k": self.k,
            "done": self.done,
            "threshold": self.threshold,
            "rule": self.rule,
            "interval": self.interval,
            "max_replicas": self.max_replicas,
            "decisions": [asdict(d) for d in self.decisions],
        }

    def state_dict(self) -> dict[str, Any]:
        """All state, for checkpoints (plain Python values)."""
        return {
            **self.to_json(),
            "iteration": self._iteration,
            "skip": self._skip,
            "count": self._count,
            "samples": self._samples,
            "seconds": list(self._seconds),
            "previous": self._previous,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the settings stay this tuner's own)."""
        self.k = int(state["k"])
        self.done = bool(state["done"])
        self.decisions = [Decision(**d) for d in state["decisions"]]
        self._iteration = int(state["iteration"])
        self._skip = int(state["skip"])
        self._count = int(state["count"])
        self._samples = int(state["samples"])
        seconds = state["seconds"]  # a sum (older checkpoints): restart the interval
        if isinstance(seconds, list):
            self._seconds = [float(v) for v in seconds]
        else:
            self._count, self._samples, self._seconds = 0, 0, []
        prev = state["previous"]
        self._previous = None if prev is None else float(prev)
