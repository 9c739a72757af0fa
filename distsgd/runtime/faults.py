"""Faults injected into the ranks of a real-process run, for tests of fault handling.

A :class:`RankFaults` is passed explicitly — ``distsgd.api.train(..., faults=...)`` →
the launcher → each rank (over the launcher's own channel to its ranks, beside the run's
config) → the dist runtime's constructor. Nothing here is read from the environment, and
a run without one behaves exactly as if this module did not exist.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RankFaults", "describe_exit"]


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
    """

    pid_dir: str = ""
    kill_at_step: dict[int, int] = field(default_factory=dict)
    stop_at_step: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, tuple[float, float]] = field(default_factory=dict)
    abort_at_exit: int | None = None

    def to_json(self) -> str:
        """The faults as one JSON line (the launcher's channel to its ranks)."""
        return json.dumps(
            {
                "pid_dir": self.pid_dir,
                "kill_at_step": self.kill_at_step,
                "stop_at_step": self.stop_at_step,
                "seconds": {r: list(v) for r, v in self.seconds.items()},
                "abort_at_exit": self.abort_at_exit,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RankFaults:
        """Inverse of :meth:`to_json` ("" gives no faults)."""
        if not text:
            return cls()
        d = json.loads(text)
        return cls(
            pid_dir=d["pid_dir"],
            kill_at_step={int(r): int(n) for r, n in d["kill_at_step"].items()},
            stop_at_step={int(r): int(n) for r, n in d["stop_at_step"].items()},
            seconds={int(r): (float(a), float(p)) for r, (a, p) in d["seconds"].items()},
            abort_at_exit=d["abort_at_exit"],
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
