"""Faults injected into the ranks of a real-process run, for tests of fault handling.

A :class:`RankFaults` is passed explicitly — ``distsgd.api.train(..., faults=...)`` →
the launcher → each rank (over the launcher's own channel to its ranks, beside the run's
config) → the dist runtime's constructor. Nothing here is read from the environment, and
a run without one behaves exactly as if this module did not exist.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["RankFaults", "describe_exit", "draw_stall"]


def draw_stall(
    generator: torch.Generator, probability: float, seconds: float, distribution: str
) -> float:
    """One minibatch's random stall, seconds: with probability ``probability`` a stall of
    ``seconds`` (``distribution = "fixed"``) or drawn from the exponential distribution of
    mean ``seconds`` (``"exponential"``), else 0. Draws two uniforms from ``generator``
    whenever ``probability`` and ``seconds`` are both > 0 (none otherwise), so that a
    stream's draws do not depend on the outcomes. The simulated cluster's
    ``cluster.stall_*`` settings and :class:`RankFaults`' stalls both use it."""
    if probability == 0 or seconds == 0:
        return 0.0
    u, v = torch.rand(2, generator=generator).tolist()
    if u >= probability:
        return 0.0
    if distribution == "fixed":
        return seconds
    return -seconds * math.log1p(-v)


@dataclass(frozen=True)
class RankFaults:
    """What to do to which rank.

    Attributes:
        pid_dir: every rank writes its pid to ``<pid_dir>/rank<r>.pid`` at start ("" none),
            so that a test can signal it.
        kill_at_step: ``{rank: n}``: that rank sends itself SIGKILL when it is about to do
            its n-th step (an iteration, a push handled by the coordinating server or a
            gradient computed by a learner).
        stop_at_step: ``{rank: n}``: that rank sends itself SIGSTOP there instead (as
            ``kill -STOP``: the process stays, its heartbeat stops).
        seconds: ``{rank: (a, p)}``: on the synchronous runtime that rank counts
            ``a · k^p`` seconds for each iteration at k replicas instead of its measured
            wall seconds (so that ranks' own measurements would lead the replicas
            auto-tuner to different decisions).
        abort_at_exit: this rank ends by SIGABRT after it has finished its part of the run
            (as a C++ destructor aborting at interpreter shutdown would), or None.
        slow: ``{rank: f}`` (f >= 1): a straggler. After each gradient that learner rank
            computes it sleeps (f − 1) × the wall seconds that computation took, so that it
            is f times slower without using a core: on a hardsync rank (DDP) the
            computation is its whole iteration (draw, forward, backward with DDP's
            all-reduce, update: the all-reduce runs inside the backward), on a parameter
            server's learner or a backup learner the gradient of one pulled minibatch.
            The simulated cluster's ``cluster.speed_factors`` 1/f.
        stall_probability, stall_seconds, stall_distribution: random stalls on every
            learner rank (``stall_ranks`` empty) or on ``stall_ranks``: after each
            gradient, with probability ``stall_probability``, the rank sleeps
            ``stall_seconds`` (``"fixed"``) or an exponentially distributed time of that
            mean (``"exponential"``), drawn from a stream of its own seeded by
            ``stall_seed`` and the rank (:func:`draw_stall`), as the simulated cluster's
            ``cluster.stall_*`` settings charge them. Slept after the slow-down's sleep.
        stall_ranks: the ranks that stall (empty: every learner rank).
        stall_seed: the seed of the stall streams.

    Server ranks never sleep: the runtimes apply :meth:`straggle` on learner ranks only
    (hardsync ranks, parameter-server learners, backup learners).
    """

    pid_dir: str = ""
    kill_at_step: dict[int, int] = field(default_factory=dict)
    stop_at_step: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, tuple[float, float]] = field(default_factory=dict)
    abort_at_exit: int | None = None
    slow: dict[int, float] = field(default_factory=dict)
    stall_probability: float = 0.0
    stall_seconds: float = 0.0
    stall_distribution: str = "exponential"
    stall_ranks: tuple[int, ...] = ()
    stall_seed: int = 0
    _streams: dict[int, torch.Generator] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Raises ValueError for a slow-down factor below 1, a stall probability outside
        [0, 1], negative stall seconds or an unknown stall distribution."""
        if any(not f >= 1 for f in self.slow.values()):
            raise ValueError(f"RankFaults.slow = {self.slow}: expected factors >= 1")
        if not 0 <= self.stall_probability <= 1 or not self.stall_seconds >= 0:
            raise ValueError(
                f"RankFaults stall_probability = {self.stall_probability}, stall_seconds = "
                f"{self.stall_seconds}: expected a probability in [0, 1] and seconds >= 0"
            )
        if self.stall_distribution not in ("exponential", "fixed"):
            raise ValueError(
                f"RankFaults.stall_distribution = {self.stall_distribution!r}: expected "
                "'exponential' or 'fixed'"
            )

    def to_json(self) -> str:
        """The faults as one JSON line (the launcher's channel to its ranks)."""
        return json.dumps(
            {
                "pid_dir": self.pid_dir,
                "kill_at_step": self.kill_at_step,
                "stop_at_step": self.stop_at_step,
                "seconds": {r: list(v) for r, v in self.seconds.items()},
                "abort_at_exit": self.abort_at_exit,
                "slow": self.slow,
                "stall": [self.stall_probability, self.stall_seconds, self.stall_distribution],
                "stall_ranks": list(self.stall_ranks),
                "stall_seed": self.stall_seed,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RankFaults:
        """Inverse of :meth:`to_json` ("" gives no faults)."""
        if not text:
            return cls()
        d = json.loads(text)
        stall = d.get("stall", [0.0, 0.0, "exponential"])
        return cls(
            pid_dir=d["pid_dir"],
            kill_at_step={int(r): int(n) for r, n in d["kill_at_step"].items()},
            stop_at_step={int(r): int(n) for r, n in d["stop_at_step"].items()},
            seconds={int(r): (float(a), float(p)) for r, (a, p) in d["seconds"].items()},
            abort_at_exit=d["abort_at_exit"],
            slow={int(r): float(f) for r, f in d.get("slow", {}).items()},
            stall_probability=float(stall[0]),
            stall_seconds=float(stall[1]),
            stall_distribution=str(stall[2]),
            stall_ranks=tuple(int(r) for r in d.get("stall_ranks", [])),
            stall_seed=int(d.get("stall_seed", 0)),
        )

    def start(self, rank: int) -> None:
        """At a rank's start: write its pid file (with ``pid_dir``)."""
        if self.pid_dir:
            Path(self.pid_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.pid_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))

    def step(self, rank: int, steps: int) -> None:
        """Before ``rank``'s ``steps``-th step: SIGKILL or SIGSTOP itself if asked to."""
        for at, sig in (
            (self.kill_at_step.get(rank), signal.SIGKILL),
            (self.stop_at_step.get(rank), signal.SIGSTOP),
        ):
            if at is not None and steps >= at:
                os.kill(os.getpid(), sig)

    def straggle(
        self, rank: int, compute_s: float, sleep: Callable[[float], None] = time.sleep
    ) -> float:
        """After a learner rank's gradient that took ``compute_s`` wall seconds: sleep
        (f − 1) · ``compute_s`` where ``slow`` gives ``rank`` the factor f, then the
        rank's random stall (:func:`draw_stall`, a stream per rank seeded by
        ``stall_seed`` and ``rank``); returns the seconds slept (0 for a rank with
        neither). ``sleep``: the sleeping function (tests)."""
        seconds = (self.slow.get(rank, 1.0) - 1.0) * max(0.0, compute_s)
        if self.stall_probability > 0 and (not self.stall_ranks or rank in self.stall_ranks):
            stream = self._streams.get(rank)
            if stream is None:
                stream = torch.Generator().manual_seed(self.stall_seed * 7919 + 29 + rank)
                self._streams[rank] = stream
            seconds += draw_stall(
                stream, self.stall_probability, self.stall_seconds, self.stall_distribution
            )
        if seconds > 0:
            sleep(seconds)
        return seconds

    def iteration_seconds(self, rank: int, replicas: int, measured_s: float) -> float:
        """The seconds ``rank`` counts for an iteration at k = ``replicas``."""
        if rank not in self.seconds:
            return measured_s
        a, power = self.seconds[rank]
        return a * replicas**power


def describe_exit(code: int) -> str:
    """A rank's exit status in words: ``"exited with status 1"``, or for a negative
    status (a ``subprocess``/``multiprocessing`` process ended by a signal) ``"was killed by
    SIGKILL"``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
