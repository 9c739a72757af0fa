"""The wall-clock budget of ``distsgd tune``: which step may still start, and how long a long
run may train.

``distsgd tune --budget B`` keeps its wall time within B plus a stated slack:

* a step starts only if its **expected** wall cost fits in the time left to its phase's end
  (:meth:`TuneBudget.may_probe`); the expected cost of a probe is the largest wall cost of
  the probes measured so far (before the first: an estimate from the setup, see
  :func:`first_probe_estimate`), so only a probe slower than every earlier one can
  overrun, by its excess over that expectation;
* a long run trains for :meth:`TuneBudget.long_run_seconds` wall seconds: what is left
  after its build, its evaluations (each timed once in the setup) and the time kept for
  the later phases; a long run with less than one probe's training time left is skipped;
* before the search, a budget that cannot give a plan with a predicted time to accuracy
  is refused (:meth:`TuneBudget.prediction_minimum_s`: the setup, one probe, and a first
  long run that makes the evaluations a prediction needs, with the time the phases keep;
  a figure computed from the measured setup, the wall speed of a short timing probe and
  the probe length, named in the error; :meth:`TuneBudget.minimum_s`, the setup and one probe, is
  the floor below that).

Slack (stated in the decision log and ``tune.json``): at most one step's overrun of its
expected cost, plus writing the plan and the report after the budget.

Phases (shares of B; :class:`distsgd.tuner.session.TuneSession` takes every phase decision
from the methods here; ``long_run_share`` is the setting ``tune.segment_fraction``): the
cold start and joint search end at ``(1 − long_run_share − steady_share)·B``
(:meth:`TuneBudget.may_search_probe`; the first cold-start probe may use the whole budget:
a plan needs one), the first long run gets what is left less a reserve of
``(steady_share + 0.4·long_run_share)·B`` (:meth:`TuneBudget.first_long_run_seconds`),
steady state ``steady_share·B`` from its start (:meth:`TuneBudget.steady_end`), the second
long run the rest. Every phase ends at B at the latest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["TuneBudget", "first_probe_estimate"]


def first_probe_estimate(
    probe_seconds: float, wall_per_clock_second: float, build_s: float
) -> float:
    """Expected wall seconds of the first probe: ``build_s + probe_seconds · wall_per_clock_second``.

    Args:
        probe_seconds: probe length on the runtime's clock (simulated or wall seconds).
        wall_per_clock_second: wall seconds one second of that clock takes here (1 on real
            processes; on the simulated cluster the setup's timing probe's training wall
            seconds over its simulated seconds: the simulator's own wall speed).
        build_s: wall seconds to build a run (data, model), measured in the setup.
    """
    return build_s + probe_seconds * wall_per_clock_second


class TuneBudget:
    """Budget decisions of one tune (pure bookkeeping over a clock, so tests can drive it
    with a fake clock).

    Args:
        total_s: the budget B, wall seconds (> 0).
        long_run_share: share of B for the long run (the setting ``tune.segment_fraction``).
        steady_share: share of B for steady state.
        first_probe_s: expected wall seconds of the first probe.
        eval_s: wall seconds of one evaluation on the test set (measured in the setup).
        clock: seconds, monotonic (default :func:`time.perf_counter`).
        start: the clock's reading when the tune started (default: now).
    """

    def __init__(
        self,
        total_s: float,
        long_run_share: float,
        steady_share: float,
        first_probe_s: float,
        eval_s: float,
        clock: Callable[[], float] = time.perf_counter,
        start: float | None = None,
    ) -> None:
        self.total_s = float(total_s)
        self.long_run_share = long_run_share
        self.steady_share = steady_share
        self.first_probe_s = first_probe_s
        self.eval_s = eval_s
        self.clock = clock
        self.start = clock() if start is None else start
        self.probe_walls: list[float] = []
        self.build_walls: list[float] = []

    # ---- clock -------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Wall seconds since the tune started."""
        return self.clock() - self.start

    def left(self, end_s: float | None = None) -> float:
        """Seconds until ``end_s`` (seconds from the start; default the whole budget)."""
        return (self.total_s if end_s is None else end_s) - self.elapsed()

    @property
    def search_end(self) -> float:
        """End of the cold start and joint search, seconds from the start."""
        return self.total_s * (1 - self.long_run_share - self.steady_share)

    # ---- probes ------------------------------------------------------------------------
    def record_probe(self, wall_s: float, train_wall_s: float) -> None:
        """A finished probe: its whole wall cost and the part of it that was training."""
        self.probe_walls.append(wall_s)
        self.build_walls.append(max(wall_s - train_wall_s, 0.0))

    def expected_probe_s(self) -> float:
        """Expected wall seconds of the next probe: the largest measured so far (the first
        estimate before any)."""
        return max(self.probe_walls) if self.probe_walls else self.first_probe_s

    def expected_build_s(self) -> float:
        """Wall seconds of a run's build and end outside its training (largest measured)."""
        return max(self.build_walls) if self.build_walls else 0.0

    def may_probe(self, end_s: float | None = None) -> bool:
        """True when the next probe is expected to finish before ``end_s`` (default: the
        whole budget)."""
        return self.expected_probe_s() <= self.left(end_s)

    def minimum_s(self) -> float:
        """The least budget that holds what was spent so far (the setup) and one probe."""
        return self.elapsed() + self.first_probe_s

    def long_run_minimum_s(
        self, samples_per_s: float, eval_every_samples: int, evaluations: int, build_s: float
    ) -> float:
        """Wall seconds of the shortest long run that makes ``evaluations`` evaluations after
        its start: its build, ``evaluations · eval_every_samples`` samples of training at
        ``samples_per_s`` and ``evaluations + 2`` evaluations (:meth:`long_run_seconds`'s
        cost)."""
        train_s = evaluations * eval_every_samples / samples_per_s
        return build_s + train_s + (evaluations + 2) * self.eval_s

    def prediction_minimum_s(
        self, samples_per_s: float, eval_every_samples: int, evaluations: int, build_s: float
    ) -> float:
        """The least budget B whose first long run still makes ``evaluations`` evaluations
        (what a predicted time to accuracy needs, :func:`~distsgd.tuner.plan.predict_plan`).

        With S the setup so far (:meth:`elapsed`), P the first probe's expected cost, L
        :meth:`long_run_minimum_s`, ``a`` the search's share of B (:attr:`search_end`) and
        ``r`` the reserve's (:meth:`reserve_s`): the long run starts once the first probe
        is done or the search's share is spent, whichever is later, and gets what is left
        less the reserve, ``min(B(1 − r) − S − P, B(1 − a − r))``; that is >= L for
        ``B >= max((S + P + L)/(1 − r), L/(1 − a − r))``. Conservative: a long run that
        the reserve would leave shorter than a probe's training takes the reserve too.

        Args:
            samples_per_s: the long run's training samples per wall second (estimated
                before any probe, :func:`~distsgd.tuner.tune.estimated_samples_per_s`).
            eval_every_samples: its evaluation interval, samples.
            evaluations: evaluations after its start that a prediction needs.
            build_s: wall seconds of a run's build.
        """
        need = self.long_run_minimum_s(samples_per_s, eval_every_samples, evaluations, build_s)
        search = 1 - self.long_run_share - self.steady_share
        reserve = self.steady_share + 0.4 * self.long_run_share
        after_probe = (self.elapsed() + self.first_probe_s + need) / (1 - reserve)
        after_search = need / (1 - search - reserve) if 1 - search - reserve > 0 else math.inf
        return max(after_probe, after_search, self.minimum_s())

    def may_search_probe(self, probed_any: bool) -> bool:
        """The cold start's and joint search's rule: the first probe may use the whole
        budget (a plan needs one), later ones must be expected to end by
        :attr:`search_end`."""
        return self.may_probe(self.search_end if probed_any else None)

    # ---- phases after the search ---------------------------------------------------------
    def reserve_s(self) -> float:
        """Seconds the first long run leaves for the later phases: steady state's share and
        0.4 of the long run's share (the second long run, from the first one's snapshot)."""
        return self.total_s * (self.steady_share + 0.4 * self.long_run_share)

    def first_long_run_seconds(self, samples_per_s: float, eval_every_samples: int) -> float:
        """Training wall seconds of the first long run: what fits while keeping
        :meth:`reserve_s`; if that leaves less than one probe's training, what fits in the
        whole time left (the later phases need this run); 0: skip it."""
        t = self.long_run_seconds(samples_per_s, eval_every_samples, keep_s=self.reserve_s())
        return t if t > 0 else self.long_run_seconds(samples_per_s, eval_every_samples)

    def steady_end(self) -> float:
        """End of steady state, seconds from the start: its share of B from now, capped at
        B (a first long run that used the reserve leaves steady state only what is left)."""
        return min(self.elapsed() + self.steady_share * self.total_s, self.total_s)

    def second_long_run_seconds(self, samples_per_s: float, eval_every_samples: int) -> float:
        """Training wall seconds of a second long run (or of a run at the lower η from a
        snapshot of the first): what fits in the budget left."""
        return self.long_run_seconds(samples_per_s, eval_every_samples)

    # ---- long runs ---------------------------------------------------------------------
    def long_run_seconds(
        self, samples_per_s: float, eval_every_samples: int, keep_s: float = 0.0
    ) -> float:
        """Training wall seconds t of a long run that fit in the time left minus ``keep_s``.

        The run costs ``build + t + eval_s · (2 + t · samples_per_s / eval_every_samples)``
        (an evaluation at its start, one every ``eval_every_samples`` training samples and
        one at its end); t solves that equal to the time available. Returns 0 when t would
        be shorter than one probe's training (the run is then skipped).

        Args:
            samples_per_s: training throughput of the run's configuration, samples per wall
                second (measured by its probes).
            eval_every_samples: evaluation interval, samples (> 0).
            keep_s: seconds kept for later phases.
        """
        avail = self.left() - keep_s - self.expected_build_s() - 2 * self.eval_s
        per_s = 1.0 + (
            self.eval_s * samples_per_s / eval_every_samples
            if math.isfinite(samples_per_s) and samples_per_s > 0
            else 0.0
        )
        t = avail / per_s
        shortest = min(
            (w - b for w, b in zip(self.probe_walls, self.build_walls, strict=True)),
            default=0.0,
        )
        return t if t > 0 and t >= shortest else 0.0
