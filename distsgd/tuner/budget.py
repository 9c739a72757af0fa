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

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol

from distsgd.config import OnlineTuneSettings, RunConfig
from distsgd.tuner import perf_model as pm

__all__ = [
    "SearchBudget",
    "TuneBudget",
    "RunBudget",
    "first_probe_estimate",
    "probe_seconds_for",
    "planned_probes",
    "run_time_budget",
    "PROBE_SHARE",
    "MIN_PROBE_FRACTION",
]

PROBE_SHARE = 0.2  # share of a --tune run's time budget its cold start's probes may take
MIN_PROBE_FRACTION = 0.25  # shortest --tune probe, as a fraction of tune.probe_seconds


class SearchBudget(Protocol):
    """What the cold start and the joint search ask of a tuner's budget (``distsgd tune``:
    :class:`TuneBudget`; ``distsgd train --tune``: :class:`RunBudget`)."""

    def search_spent(self, probed: int) -> str | None:
        """None while another search probe may start after ``probed`` probes; else why
        not (one line for the decision log)."""


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

    def search_spent(self, probed: int) -> str | None:
        """:class:`SearchBudget`: :meth:`may_search_probe`, with what is spent."""
        if self.may_search_probe(probed > 0):
            return None
        return (
            f"search budget spent: a probe is expected to take {self.expected_probe_s():.1f} "
            f"s, {max(self.left(self.search_end), 0):.1f} s left to the search"
        )

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


def probe_seconds_for(
    settings_probe_s: float, budget_s: float, planned: float
) -> tuple[float, int]:
    """``--tune``'s cold-start probe length: ``min(settings_probe_s, PROBE_SHARE ·
    budget_s / planned)``, at least ``MIN_PROBE_FRACTION · settings_probe_s``.

    Args:
        settings_probe_s: ``tune.probe_seconds``, seconds on the runtime's clock.
        budget_s: the run's time budget T on the same clock (0: none).
        planned: n, the cold start's planned probes in probes of full length
            (:func:`planned_probes`).

    Returns:
        ``(probe_seconds, max_probes)``; ``max_probes`` 0 means no limit.
    """
    if budget_s <= 0:
        return settings_probe_s, 0
    share = PROBE_SHARE * budget_s
    length = min(settings_probe_s, share / max(planned, 1))
    floor = MIN_PROBE_FRACTION * settings_probe_s
    if length >= floor:
        return length, 0
    floor = min(floor, share)  # one probe never takes more than the probes' share of T
    return floor, max(1, int(share // floor))


def planned_probes(settings: OnlineTuneSettings) -> float:
    """``--tune``'s planned cold-start work in probes of ``tune.probe_seconds``: m =
    ``len(tune.lrs)`` first-rung probes of ``tune.first_rung`` = r of it each, at most
    ``min(tune.promote + 1, m)`` of them (the promoted and the next larger η than the best
    at g = 1) continued by the rest, and ``tune.extra_probes`` = e of full length: m · r +
    min(promote + 1, m) · (1 − r) + e (m + e with no second rung). The grids of g ≥ 2 and
    a confirmation (up to 2 more probes) are left out, so the cold start can take more
    than ``PROBE_SHARE`` of the budget."""
    m, extra = len(settings.lrs), settings.extra_probes
    r = settings.first_rung
    return m * r + min(settings.promote + 1, m) * (1 - r) + extra if r < 1 else float(m + extra)


def run_time_budget(
    cfg: RunConfig, num_train: int, num_learners: int, cluster: pm.ClusterModel
) -> tuple[float, str]:
    """A ``--tune`` run's time budget T on the runtime's clock (0: none) and where it comes
    from: ``train.max_virtual_seconds`` on ``sim``, ``train.max_seconds`` on real
    processes, or less: the seconds of the run's sample budget (``train.max_epochs`` /
    ``max_samples``) at hardsync's rate on λ = ``num_learners`` on ``cluster`` (on real
    processes a prediction of their wall seconds), so the probes cannot use up a run
    limited by samples."""
    t, simulated = cfg.train, cfg.runtime == "sim"
    limit = "train.max_virtual_seconds" if simulated else "train.max_seconds"
    budget = t.max_virtual_seconds if simulated else t.max_seconds
    by_epochs = int(math.ceil(t.max_epochs * num_train)) if t.max_epochs else 0
    samples = [n for n in (by_epochs, t.max_samples) if n]
    if not samples:
        return budget, limit
    layout = pm.Layout("hardsync", num_learners, cfg.protocol.batch_size)
    per_sample_s = pm.seconds_per_iteration(layout, cluster) / pm.samples_per_iteration(layout)
    by_samples = min(samples) * per_sample_s
    if budget > 0 and budget <= by_samples:
        return budget, limit
    which = (
        f"train.max_epochs = {t.max_epochs:g}"
        if not t.max_samples or (by_epochs and by_epochs <= t.max_samples)
        else f"train.max_samples = {t.max_samples}"
    )
    return by_samples, f"{which} at hardsync's predicted rate on this device profile" + (
        "" if simulated else f": a prediction; a smaller {limit} takes its place"
    )


@dataclasses.dataclass(frozen=True)
class RunBudget:
    """The probes a ``distsgd train --tune`` run may spend (:class:`SearchBudget`): a probe
    lasts ``min(tune.probe_seconds, PROBE_SHARE · T / n)`` for a time budget T and n =
    :func:`planned_probes`, at least ``MIN_PROBE_FRACTION · tune.probe_seconds``; below
    that the cold start runs at most ``max_probes`` probes, without second rungs or
    steady-state rounds.

    Attributes:
        time_budget_s: T on the runtime's clock (0: none; :func:`run_time_budget`).
        source: where T comes from, for the decisions that name it.
        planned: n, in probes of full length.
        probe_s: a full probe's length on the runtime's clock.
        max_probes: the most probes (0: no limit).
        rung_s: a first rung's length (``tune.first_rung`` of ``probe_s``; ``probe_s``
            without successive halving).
        steady_rounds: steady-state rounds at most.
    """

    time_budget_s: float
    source: str
    planned: float
    probe_s: float
    max_probes: int
    rung_s: float
    steady_rounds: int

    @classmethod
    def of(cls, settings: OnlineTuneSettings, time_budget_s: float, source: str) -> RunBudget:
        """The budget of a run with time budget ``time_budget_s`` (0: none)."""
        planned = planned_probes(settings)
        probe_s, max_probes = probe_seconds_for(settings.probe_seconds, time_budget_s, planned)
        halving = settings.first_rung < 1 and not max_probes
        rung_s = probe_s * settings.first_rung if halving else probe_s
        steady_rounds = 0 if max_probes else settings.steady_rounds
        return cls(time_budget_s, source, planned, probe_s, max_probes, rung_s, steady_rounds)

    def rule(self) -> str:
        """How the probe length was chosen, for the set-up's decision."""
        budget = self.time_budget_s
        if budget <= 0:
            return "tune.probe_seconds (the run has no time budget)"
        rule = (
            f"min(tune.probe_seconds, {PROBE_SHARE:g} · {budget:.4g} s / "
            f"{self.planned:g} planned probes of full length); the budget: " + self.source
        )
        if self.max_probes:
            rule += (
                f", below the shortest allowed, so min({MIN_PROBE_FRACTION:g} · "
                f"tune.probe_seconds, {PROBE_SHARE:g} · {budget:g} s)"
            )
        return rule

    def too_small(self) -> str:
        """The line that says the budget is too small for the full cold start."""
        return (
            f"the budget {self.time_budget_s:.4g} s ({self.source}) is too small for the full "
            f"cold start: probes of {self.probe_s:.4g} s (the shortest allowed: "
            f"min({MIN_PROBE_FRACTION:g} · tune.probe_seconds, {PROBE_SHARE:g} · the "
            f"budget)), at most {self.max_probes}; the run trains with the best of them to "
            "the end, without steady-state rounds"
        )

    def search_spent(self, probed: int) -> str | None:
        """:class:`SearchBudget`: at most ``max_probes`` probes (0: no limit)."""
        if self.max_probes and probed >= self.max_probes:
            return "the budget's probes are spent"
        return None
