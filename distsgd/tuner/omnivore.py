"""Omnivore's optimizer and the joint search beyond it (docs/protocols.md §3).

The search of Omnivore's public optimizer (Hadjis, Zhang, Mitliagkas, Iter, Ré,
arXiv:1606.04487, §4 "optimizer"), as docs/protocols.md §3 states it:

* **Cold start** (:meth:`OmnivoreSearch.cold_start`): group counts g = 1, 2, 4, … (g
  divides λ, up to ``tune.max_groups``). At g = 1 probe μ = 0.9 with every η of
  ``tune.lrs``; at each later g probe μ ∈ ``tune.momenta`` × η ∈ {η*_prev, η*_prev/10},
  pruning the configurations that cannot win (:func:`cold_start_grid`): η > η*_prev;
  η = η*_prev with μ > μ*_prev (more groups add implicit momentum); η < η*_prev with
  μ < μ*_prev ("both lower": the step is shrunk twice), and anything at or above an
  (η, μ) that produced NaN (:func:`nan_pruned`; a NaN at fewer groups prunes more groups
  too, since asynchrony only adds momentum).
* **Probes** run for the same time from the same snapshot; the score is the mean of the
  last ``tune.score_window`` (10) training losses, so equal time folds hardware and
  statistical efficiency into one number. Ties within ``tune.tie_buffer`` (1%) of the
  best prefer larger η, then larger μ (:func:`pick_best`).
* **HE rule**: g is accepted only if seconds per iteration improve on the previous g by
  at least ``tune.he_gain`` (10%); otherwise the cold start stops.
* **Steady state** (:meth:`OmnivoreSearch.steady_state`): from the latest snapshot
  re-probe μ ∈ momenta × η ∈ {η_last, η_last/10}; if the best μ is 0 the asynchrony is too
  much: halve g, set μ = 0.6 and search again (at the halved g, from the same snapshot).
  The incumbent (whose long run made the snapshot) is probed first and never pruned; when
  it could not be probed it is kept, since nothing can be compared with it.

Choices where the paper is silent: g = 1 is probed as ``hardsync`` (docs/protocols.md §1;
it equals compute groups with g = 1); across group counts the lowest score wins and ties
within the buffer prefer fewer groups (less asynchrony); the steady state's tie buffer is
the same setting as the cold start's.

**Beyond Omnivore** (:func:`joint_candidates`, :func:`rank_candidates`): the protocol
family (hardsync, compute groups, n-softsync, SMA with k replicas per device, and on
request local SGD and DiLoCo averaging every H iterations) and the
per-learner batch size are searched jointly: the performance model
(:mod:`distsgd.tuner.perf_model`) ranks unprobed configurations by predicted time to
accuracy and the best ``tune.extra_probes`` of them are probed like the rest; a
configuration replaces Omnivore's choice only if its equal-time score beats it by more
than the tie buffer.

Every decision is logged with its reason (:class:`DecisionLog`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd.config import TuneConfig
from distsgd.tuner.perf_model import (
    ClusterModel,
    Layout,
    samples_per_iteration,
    scale_iterations,
    seconds_per_iteration,
)

if TYPE_CHECKING:
    from distsgd.tuner.budget import SearchBudget

__all__ = [
    "Candidate",
    "ProbeResult",
    "ProbeFn",
    "DecisionLog",
    "OmnivoreSearch",
    "cold_start_grid",
    "nan_pruned",
    "nan_applies",
    "pick_best",
    "pair_scores",
    "EXPLODED_FACTOR",
    "next_larger_lr",
    "worse_than_above",
    "joint_candidates",
    "skip_unfit",
    "rank_candidates",
    "he_scales",
]


@dataclass(frozen=True)
class Candidate:
    """One configuration the search can probe.

    Attributes:
        family: ``hardsync``, ``compute_groups``, ``softsync``, ``sma``, ``local_sgd``
            or ``diloco``.
        num_learners: λ (for SMA: devices × k).
        batch_size: b, samples per learner.
        lr: η (α0 / γ). momentum: μ (explicit momentum of the update rule).
        num_groups: g; softsync: n; replicas_per_device: k; average_every: H.
    """

    family: str
    num_learners: int
    batch_size: int
    lr: float
    momentum: float
    num_groups: int = 1
    softsync: int = 1
    replicas_per_device: int = 1
    average_every: int = 1

    def layout(self) -> Layout:
        return Layout(
            self.family,
            self.num_learners,
            self.batch_size,
            num_groups=self.num_groups,
            softsync=self.softsync,
            replicas_per_device=self.replicas_per_device,
            average_every=self.average_every,
        )

    @property
    def g(self) -> int:
        """Compute groups in Omnivore's sense: 1 for hardsync."""
        return self.num_groups if self.family == "compute_groups" else 1

    def shape(self) -> str:
        """The protocol and layout without η and μ, e.g. ``groups g=4 λ=8 b=16``."""
        base = f"λ={self.num_learners} b={self.batch_size}"
        if self.family == "compute_groups":
            return f"groups g={self.num_groups} {base}"
        if self.family == "softsync":
            return f"{self.softsync}-softsync {base}"
        if self.family == "sma":
            return f"sma k={self.replicas_per_device} {base}"
        if self.family in ("local_sgd", "diloco"):
            return f"{self.family} H={self.average_every} {base}"
        return f"hardsync {base}"

    def label(self) -> str:
        return f"{self.shape()} η={self.lr:g} μ={self.momentum:g}"


@dataclass
class ProbeResult:
    """What one probe measured.

    Attributes:
        candidate: the configuration probed. snapshot: name of the starting state.
        iterations: iterations (central-model updates) after each tick, from the probe's
            start, shape ``[T]``.
        virtual_s: seconds on the runtime's clock after each tick, ``[T]`` (simulated
            seconds on ``sim``, wall seconds on real processes).
        losses: mean training loss of each tick, ``[T]`` (nats).
        diverged: a loss became NaN/inf, or blew up (:meth:`mark_exploded`).
        wall_s: wall seconds the probe took (training and evaluation).
        evals: the probe's evaluation records (``samples``, ``eval_metric``,
            ``train_loss``, …).
        score_window: losses averaged by :attr:`score`.
        run_dir: where the probe's run directory is, if it has one.
        train_wall_s: wall seconds of training (``wall_s`` less build and evaluations).
        samples: training samples the probe processed.
        notes: what else happened (e.g. a rank lost after the run completed).
        earlier_losses: for a probe that continues another from its checkpoint
            (successive halving's second rung), that probe's losses, which :attr:`score`
            counts before this probe's own: the score of the whole span.
        paired_span: when > 0, :attr:`score` is the mean of the chain's first
            ``paired_span`` losses instead (:func:`pair_scores`: every probe of a round
            from one snapshot with one layout trained them, on the same minibatches).
    """

    candidate: Candidate
    snapshot: str
    iterations: list[int] = field(default_factory=list)
    virtual_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    diverged: bool = False
    wall_s: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)
    score_window: int = 10
    run_dir: str = ""
    train_wall_s: float = 0.0
    samples: int = 0
    notes: list[str] = field(default_factory=list)
    earlier_losses: list[float] = field(default_factory=list)
    paired_span: int = 0

    @property
    def score(self) -> float:
        """Mean of the last ``score_window`` training losses (``earlier_losses``, those of
        the probe this one continues, first: a second rung that trained no iteration of
        its own scores its chain), or of the chain's first ``paired_span`` where that is
        set; NaN if diverged or empty."""
        chain = self.earlier_losses + self.losses
        tail = chain[: self.paired_span] if self.paired_span else chain[-self.score_window :]
        if self.diverged or not tail:
            return math.nan
        s = sum(tail) / len(tail)
        return s if math.isfinite(s) else math.nan

    def mark_exploded(self, reference: float | None = None) -> bool:
        """Mark the probe diverged when its loss blew up without becoming NaN: the mean of
        its chain's last ``score_window`` losses (``earlier_losses`` first) is infinite
        or more than :data:`EXPLODED_FACTOR` times ``reference`` (nats; default the
        chain's first loss, the loss at the snapshot it started from; ``distsgd train
        --tune`` gives the initial model's, so that a probe from a well-trained snapshot
        is not judged against its tiny loss). Such a probe is pruned as a NaN is: a loss
        of 1e26 must not count as stable, win a cold start and set the rate ceiling of the
        steady state. Returns whether the probe is diverged now."""
        chain = self.earlier_losses + self.losses
        if self.diverged or not chain:
            return self.diverged
        tail = chain[-self.score_window :]
        mean = sum(tail) / len(tail)
        first = chain[0] if reference is None else reference
        if math.isinf(mean) or (first > 0 and mean > EXPLODED_FACTOR * first):
            self.diverged = True
            self.notes.append(
                f"diverged: its loss rose from {first:.4g} to a mean of {mean:.4g} over its "
                f"last {len(tail)} iterations (more than {EXPLODED_FACTOR:g}x)"
            )
        return self.diverged

    @property
    def seconds_per_iteration(self) -> float:
        """Measured hardware efficiency HE, seconds per iteration (NaN without data)."""
        if not self.iterations or self.iterations[-1] <= 0:
            return math.nan
        return self.virtual_s[-1] / self.iterations[-1]

    def speed_note(self) -> str:
        """``"; X ms per iteration"`` for a decision's reason ("" without data)."""
        he = self.seconds_per_iteration
        return "" if math.isnan(he) else f"; {he * 1e3:.3f} ms per iteration"

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": asdict(self.candidate),
            "label": self.candidate.label(),
            "snapshot": self.snapshot,
            "score": None if math.isnan(self.score) else self.score,
            "seconds_per_iteration": (
                None if math.isnan(self.seconds_per_iteration) else self.seconds_per_iteration
            ),
            "diverged": self.diverged,
            "wall_s": self.wall_s,
            "train_wall_s": self.train_wall_s,
            "samples": self.samples,
            "notes": self.notes,
            "iterations": self.iterations,
            "virtual_s": self.virtual_s,
            "losses": self.losses,
            "evals": self.evals,
            "run_dir": self.run_dir,
        }


ProbeFn = Callable[[Candidate, str], ProbeResult]
"""Runs one probe of a candidate from the named snapshot and returns its result."""


class DecisionLog:
    """Every decision of the search, one line each, with its reason.

    Args:
        path: ``decisions.jsonl`` to append to (None: keep in memory only).
        echo: called with each one-line text (e.g. ``tqdm.write``); None: silent.
        clock: wall seconds of the run for an entry's ``t_wall_s`` (a resumed run's clock
            goes on from its earlier sessions); None: seconds since this log was made.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        echo: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.echo = echo
        self.entries: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        self._clock = clock or (lambda: time.perf_counter() - t0)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(
        self, phase: str, decision: str, reason: str, *, echo: bool = True, **data: Any
    ) -> None:
        """Record one decision (``data``: further fields of its line); ``echo`` False:
        written to the file only (its text reaches the user otherwise, e.g. as a
        warning)."""
        entry = {
            "t_wall_s": round(self._clock(), 3),
            "phase": phase,
            "decision": decision,
            "reason": reason,
            **data,
        }
        self.entries.append(entry)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry, default=str, ensure_ascii=False) + "\n")
        if self.echo is not None and echo:
            self.echo(f"[{phase}] {decision} — {reason}")


def nan_pruned(lr: float, momentum: float, nan_points: list[tuple[float, float]]) -> tuple | None:
    """The (η, μ) that produced NaN at or below ``(lr, momentum)``, or None.

    Omnivore prunes every configuration at or above a diverged (η, μ): a larger step or
    more momentum cannot converge where a smaller one diverged.
    """
    for lr_n, mu_n in nan_points:
        if lr >= lr_n * (1 - 1e-12) and momentum >= mu_n - 1e-12:
            return (lr_n, mu_n)
    return None


def nan_applies(diverged: Candidate, cand: Candidate) -> bool:
    """Whether the NaN of the ``diverged`` probe may prune ``cand`` (before comparing η, μ).

    Omnivore prunes within one group count; asynchrony only adds implicit momentum
    (Mitliagkas et al., arXiv:1605.09774), so a NaN also prunes more groups, never fewer.
    Here: the same per-learner batch, and either both hardsync / compute groups with
    ``cand.g >= diverged.g``, or the same family and layout (n-softsync's n, SMA's k, λ).
    """
    if diverged.batch_size != cand.batch_size:
        return False
    groups = ("hardsync", "compute_groups")
    if diverged.family in groups and cand.family in groups:
        return cand.g >= diverged.g
    return replace(diverged, lr=0.0, momentum=0.0) == replace(cand, lr=0.0, momentum=0.0)


def cold_start_grid(
    g: int, prev: tuple[float, float] | None, settings: TuneConfig
) -> tuple[list[tuple[float, float]], list[tuple[tuple[float, float], str]]]:
    """The (η, μ) grid to probe at ``g`` groups, largest η then largest μ first.

    Args:
        g: number of compute groups.
        prev: (η*, μ*) best at the previous group count (None at g = 1).
        settings: ``lrs``, ``momenta``, ``cold_momentum``.

    Returns:
        (grid, pruned) where pruned lists ((η, μ), reason) for the structural pruning
        rules of docs/protocols.md §3 (NaN pruning happens while probing).
    """
    if g == 1 or prev is None:
        grid = [(lr, settings.cold_momentum) for lr in sorted(settings.lrs, reverse=True)]
        return grid, []
    lr_p, mu_p = prev
    grid, pruned = [], []
    for lr in (lr_p, lr_p / 10):
        for mu in sorted(settings.momenta, reverse=True):
            if lr == lr_p and mu > mu_p:
                pruned.append(((lr, mu), f"η = η*_prev and μ > μ*_prev = {mu_p:g}"))
            elif lr < lr_p and mu < mu_p:
                pruned.append(((lr, mu), f"both lower than (η*, μ*)_prev = ({lr_p:g}, {mu_p:g})"))
            else:
                grid.append((lr, mu))
    return grid, pruned


def worse_than_above(results: list[ProbeResult], tie_buffer: float) -> bool:
    """Whether the last of ``results`` (a descending η grid at one μ) scored worse than
    the last one before it that did not diverge, by more than ``tie_buffer`` (relative)."""
    if len(results) < 2 or results[-1].diverged:
        return False
    above = [r for r in results[:-1] if not r.diverged]
    if not above:
        return False
    return results[-1].score > above[-1].score * (1 + tie_buffer)


#: a probe whose loss rose to more than this many times its first loss diverged
#: (:meth:`ProbeResult.mark_exploded`): an exploding loss grows by orders of magnitude
EXPLODED_FACTOR = 10.0


def next_larger_lr(results: list[ProbeResult], best: ProbeResult) -> ProbeResult | None:
    """The probe of ``results`` at the next larger η than ``best``'s with ``best``'s
    layout, batch and μ (the cold start's descending grid) that did not diverge; None
    when ``best`` has the largest such η.

    Short probes prefer smaller learning rates (short-horizon bias: Wu et al., "Understanding
    Short-Horizon Bias in Stochastic Meta-Optimization", ICLR 2018): a larger η's early
    transient (a loss spike at momentum 0.9) can rank it below a smaller one after a
    second of training, though it trains faster over the run. ``distsgd train --tune``
    gives it a second-rung chance (:meth:`distsgd.tuner.online.OnlineTune.cold_start`).
    """
    ref = best.candidate
    larger = [
        r
        for r in results
        if not r.diverged and r.candidate.lr > ref.lr and replace(r.candidate, lr=ref.lr) == ref
    ]
    return min(larger, key=lambda r: r.candidate.lr, default=None)


def pair_scores(results: list[ProbeResult]) -> int:
    """Score the probes of one round from one snapshot, all of one layout (they differ in
    η and μ only), on the iterations every one of them trained: each probe's
    :attr:`ProbeResult.paired_span` is set to the fewest losses among their chains
    (diverged ones left out). From one data position with one batch they draw the same
    minibatches in the same order, so the mean over those iterations compares them on
    the same data (common random numbers) and at the same iteration count, whatever the
    wall clock did; each probe's own last ``score_window`` losses fall on different
    minibatches and carry their difficulty as noise. Returns the span (0: not paired,
    the layouts differ or no probe trained)."""
    ok = [r for r in results if not r.diverged and (r.earlier_losses or r.losses)]
    if not ok or len({r.candidate.layout() for r in ok}) > 1:
        return 0
    span = min(len(r.earlier_losses) + len(r.losses) for r in ok)
    for r in ok:
        r.paired_span = span
    return span


def pick_best(results: list[ProbeResult], tie_buffer: float) -> ProbeResult | None:
    """The lowest score; scores within ``tie_buffer`` (relative) of it tie, and ties
    prefer larger η, then larger μ (docs/protocols.md §3). None if every probe diverged."""
    ok = [r for r in results if not math.isnan(r.score)]
    if not ok:
        return None
    best = min(r.score for r in ok)
    ties = [r for r in ok if r.score <= best + tie_buffer * abs(best)]
    return max(ties, key=lambda r: (r.candidate.lr, r.candidate.momentum))


class OmnivoreSearch:
    """Omnivore's cold start and steady state over a probe function.

    Args:
        probe: runs a candidate from a snapshot (real training on a runtime, or a fake in
            tests).
        settings: the ``[tune]`` settings.
        num_learners: λ.
        batch_size: b of the cold start.
        log: the decision log.
        out_of_budget: returns True when the search budget is spent (checked before every
            probe).
        ps_learners: learners of the parameter-server layouts (compute groups g > 1,
            n-softsync); default λ. On real processes a server rank takes one of the
            processes, so N processes hold λ = N learners in hardsync but N − S with S
            server ranks.
        stop_descending: at g = 1, stop going down the η grid once a probe scores worse
            than the larger η before it by more than ``tie_buffer`` (the score taken as
            unimodal in log η; :func:`worse_than_above`). For ``--tune``, whose probes
            are paid by the run; the offline search probes the whole grid (docs/protocols.md §3).
    """

    def __init__(
        self,
        probe: ProbeFn,
        settings: TuneConfig,
        num_learners: int,
        batch_size: int,
        log: DecisionLog,
        out_of_budget: Callable[[], bool] = lambda: False,
        ps_learners: int | None = None,
        stop_descending: bool = False,
    ) -> None:
        self.probe = probe
        self.stop_descending = stop_descending
        self.ps_learners = ps_learners or num_learners
        self.settings = settings
        self.num_learners = num_learners
        self.batch_size = batch_size
        self.log = log
        self.out_of_budget = out_of_budget
        self.results: list[ProbeResult] = []
        self.diverged: list[Candidate] = []  # probes that produced NaN
        self.best_by_g: dict[int, ProbeResult] = {}
        self.he_by_g: dict[int, float] = {}

    def group_counts(self) -> list[int]:
        """g = 1, 2, 4, … (g > 1 dividing the parameter-server layouts' λ), up to
        ``max_groups`` (0: λ); g = 1 only where ``tune.families`` leaves out
        ``compute_groups`` (g = 1, hardsync, is always probed: the search's reference)."""
        lam = self.ps_learners
        top = self.settings.max_groups or lam
        if "compute_groups" not in self.settings.families:
            top = 1
        gs, g = [1], 2
        while g <= min(top, lam):
            if lam % g == 0:
                gs.append(g)
            g *= 2
        return gs

    def candidate(self, g: int, lr: float, momentum: float, batch: int | None = None) -> Candidate:
        b = batch or self.batch_size
        if g == 1:
            return Candidate("hardsync", self.num_learners, b, lr, momentum)
        return Candidate("compute_groups", self.ps_learners, b, lr, momentum, num_groups=g)

    def nan_hit(self, cand: Candidate) -> tuple[float, float] | None:
        """The (η, μ) of a NaN that prunes ``cand`` (:func:`nan_applies`,
        :func:`nan_pruned`), or None."""
        pts = [(d.lr, d.momentum) for d in self.diverged if nan_applies(d, cand)]
        return nan_pruned(cand.lr, cand.momentum, pts)

    def _run(
        self, phase: str, cand: Candidate, snapshot: str, prunable: bool = True
    ) -> ProbeResult | None:
        hit = self.nan_hit(cand) if prunable else None
        if hit is not None:
            self.log(
                phase,
                f"skip {cand.label()}",
                f"pruned: at or above (η, μ) = ({hit[0]:g}, {hit[1]:g}), which produced NaN",
            )
            return None
        if self.out_of_budget():
            self.log(phase, f"skip {cand.label()}", "search budget spent")
            return None
        r = self.probe(cand, snapshot)
        self.results.append(r)
        if r.diverged:
            self.diverged.append(cand)
            self.log(
                phase,
                f"probe {cand.label()}: NaN",
                "the loss diverged; every (η, μ) at or above it is pruned at this batch and "
                + (
                    "the same or more groups"
                    if cand.family in ("hardsync", "compute_groups")
                    else "layout"
                ),
                snapshot=snapshot,
            )
        else:
            self.log(
                phase,
                f"probe {cand.label()}: score {r.score:.4f}",
                f"mean of the last {min(self.settings.score_window, len(r.losses))} "
                "training losses after "
                f"{self.settings.probe_seconds:g} s from snapshot {snapshot!r}; "
                f"{r.seconds_per_iteration * 1e3:.3f} ms per iteration",
                snapshot=snapshot,
                score=r.score,
                seconds_per_iteration=r.seconds_per_iteration,
            )
        return r

    def cold_start(self, snapshot: str = "initial") -> ProbeResult | None:
        """Omnivore's cold start; returns the best probe over the accepted g (None if every
        probe diverged or the budget allowed none)."""
        s = self.settings
        prev: tuple[float, float] | None = None
        he_prev = math.nan
        for g in self.group_counts():
            grid, pruned = cold_start_grid(g, prev, s)
            for (lr, mu), why in pruned:
                self.log("cold start", f"skip g={g} η={lr:g} μ={mu:g}", f"pruned: {why}")
            results: list[ProbeResult] = []
            he_checked = g == 1
            rejected = False
            for lr, mu in grid:
                r = self._run("cold start", self.candidate(g, lr, mu), snapshot)
                if r is None:
                    continue
                results.append(r)
                if g == 1 and self.stop_descending and worse_than_above(results, s.tie_buffer):
                    left = [f"{lr_:g}" for lr_, _ in grid[grid.index((lr, mu)) + 1 :]]
                    if left:
                        self.log(
                            "cold start",
                            f"skip g=1 η ∈ {{{', '.join(left)}}}",
                            f"pruned: η={lr:g} scored {r.score:.4f}, worse than the larger "
                            f"η before it by more than {100 * s.tie_buffer:g}%; the score "
                            "is taken as unimodal in log η, so a smaller η cannot win",
                        )
                    break
                if not he_checked and not r.diverged:
                    he_checked = True
                    he = r.seconds_per_iteration
                    gain = 1 - he / he_prev if he_prev > 0 else math.inf
                    if gain < s.he_gain:
                        self.log(
                            "cold start",
                            f"reject g={g}; stop adding groups",
                            f"HE rule: {he * 1e3:.3f} ms per iteration vs {he_prev * 1e3:.3f} "
                            f"at g={g // 2} improves by {100 * gain:.1f}% < "
                            f"{100 * s.he_gain:.0f}%",
                        )
                        rejected = True
                        break
                    self.log(
                        "cold start",
                        f"accept g={g} on hardware efficiency",
                        f"HE rule: {he * 1e3:.3f} ms per iteration improves on g={g // 2} "
                        f"by {100 * gain:.1f}% >= {100 * s.he_gain:.0f}%",
                    )
            if rejected:
                break
            best = pick_best(results, s.tie_buffer)
            if best is None:
                self.log(
                    "cold start",
                    f"stop at g={g}",
                    "every probe at this group count diverged or was skipped",
                )
                break
            self.best_by_g[g] = best
            self.he_by_g[g] = best.seconds_per_iteration
            he_prev = best.seconds_per_iteration
            prev = (best.candidate.lr, best.candidate.momentum)
            self.log(
                "cold start",
                f"best at g={g}: η={prev[0]:g} μ={prev[1]:g} (score {best.score:.4f})",
                f"lowest score; ties within {100 * s.tie_buffer:g}% prefer larger η, then μ",
            )
            if self.out_of_budget():
                self.log("cold start", f"stop after g={g}", "search budget spent")
                break
        if not self.best_by_g:
            return None
        low = min(r.score for r in self.best_by_g.values())
        ties = [
            (g, r) for g, r in self.best_by_g.items() if r.score <= low + s.tie_buffer * abs(low)
        ]
        g, chosen = min(ties, key=lambda t: t[0])
        self.log(
            "cold start",
            f"choose {chosen.candidate.label()}",
            f"lowest equal-time score over g ∈ {sorted(self.best_by_g)} "
            f"({chosen.score:.4f}); ties prefer fewer groups",
        )
        return chosen

    def steady_state(self, current: Candidate, snapshot: str) -> Candidate:
        """Omnivore's steady state from ``snapshot``: re-probe μ × {η, η/10}; halve g while
        the best μ is 0 (then μ = 0.6). Returns the configuration to continue with.

        ``current`` (the incumbent, whose long run made the snapshot) is probed first and
        never pruned by a NaN; if it was not probed (budget spent), no other probe can be
        compared with it and ``current`` is kept."""
        s = self.settings
        cand = current
        while True:
            results = []
            # the incumbent first, then μ from large to small, both η at each μ: a budget
            # cut short still compares η with η/10
            grid = [(cand.lr, cand.momentum)] if cand == current else []
            for mu in sorted(s.momenta, reverse=True):
                for lr in (cand.lr, cand.lr / 10):
                    if (lr, mu) not in grid:
                        grid.append((lr, mu))
            incumbent = None
            for lr, mu in grid:
                c = replace(cand, lr=lr, momentum=mu)
                r = self._run("steady state", c, snapshot, prunable=c != current)
                if r is not None:
                    results.append(r)
                    if c == current:
                        incumbent = r
            if cand == current and incumbent is None:
                self.log(
                    "steady state",
                    f"keep {cand.label()}",
                    "the incumbent was not probed from the snapshot (budget spent), so no "
                    "other probe can be compared with it",
                )
                return cand
            best = pick_best(results, s.tie_buffer)
            if best is None:
                self.log(
                    "steady state",
                    f"keep {cand.label()}",
                    "no steady-state probe finished (diverged or budget spent)",
                )
                return cand
            if best.candidate.momentum == 0 and cand.family == "compute_groups" and cand.g > 1:
                g2 = cand.g // 2
                new = self.candidate(g2, best.candidate.lr, 0.6, cand.batch_size)
                self.log(
                    "steady state",
                    f"halve groups g={cand.g} → {g2}, μ = 0.6, search again",
                    f"best μ is 0 ({best.candidate.label()}, score {best.score:.4f}): "
                    "the asynchrony already gives too much momentum",
                )
                cand = new
                continue
            self.log(
                "steady state",
                f"continue with {best.candidate.label()}",
                f"best steady-state score {best.score:.4f} from snapshot {snapshot!r}; "
                f"ties within {100 * s.tie_buffer:g}% prefer larger η, then μ",
            )
            return best.candidate


def skip_unfit(cands: list[Candidate], num_train: int, log: DecisionLog) -> list[Candidate]:
    """``cands`` whose iteration fits in ``num_train`` training samples: λ·b samples (λ the
    candidate's learners, for SMA devices × k), which a run refuses above the training
    set's size; the others are left out with one ``joint`` decision (rather than ending
    the search with that error, which ``--resume`` would replay)."""
    too_big = [c for c in cands if c.num_learners * c.batch_size > num_train]
    if too_big:
        log(
            "joint",
            f"skip {', '.join(c.label() for c in too_big)}",
            f"λ·b samples per iteration above the training set's {num_train}: a run refuses "
            "that (tune.batch_sizes, or the replicas per device of SMA)",
        )
    return [c for c in cands if c not in too_big]


def joint_candidates(
    search: OmnivoreSearch, chosen: Candidate, settings: TuneConfig
) -> list[Candidate]:
    """Configurations of the joint search beyond Omnivore's groups (not yet probed).

    * hardsync and compute groups (each g the cold start accepted, with its best η, μ)
      at every batch size of ``tune.batch_sizes``, η scaled linearly with b (Goyal et
      al. 2017, the linear scaling rule);
    * n-softsync on the parameter server for n ∈ {1, 2, 4} dividing λ with n < λ
      (n = λ is compute groups with g = λ), with the chosen η and μ and Rudra's α0/n rule;
    * SMA with k ∈ {2, 4} replicas per device on the same λ devices (λ·k learners), at
      batch sizes <= b, with η of g = 1, no replica momentum and the central model's
      Polyak momentum μ_z (Crossbow, docs/protocols.md §4);
    * local SGD and DiLoCo (where ``tune.families`` lists them, λ >= 2) averaging every
      H ∈ {4, 16} iterations, with the chosen η and μ as the replicas' local rate and
      momentum (docs/protocols.md §5–6).

    Asynchronous candidates (compute groups, n-softsync) at or above an (η, μ) that gave
    NaN at the same kind (:func:`nan_applies`) are left out, as in the cold start.
    """
    lam = search.num_learners
    ps_lam = search.ps_learners
    b0 = search.batch_size
    probed = {r.candidate for r in search.results}
    out: list[Candidate] = []
    fams = settings.families
    bests = dict(search.best_by_g) or {chosen.g: None}
    for g, r in bests.items():
        c = r.candidate if r is not None else chosen
        fam = "hardsync" if g == 1 else "compute_groups"
        if fam not in fams:
            continue
        for b in settings.batch_sizes:
            out.append(replace(c, batch_size=b, lr=c.lr * b / b0))
    if "softsync" in fams:
        for n in (1, 2, 4):
            if ps_lam % n == 0 and n < ps_lam:
                out.append(
                    Candidate("softsync", ps_lam, b0, chosen.lr, chosen.momentum, softsync=n)
                )
    if "sma" in fams:
        g1 = search.best_by_g.get(1)
        lr1 = g1.candidate.lr if g1 is not None else chosen.lr
        for k in (2, 4):
            for b in settings.batch_sizes:
                if b <= b0:
                    out.append(Candidate("sma", lam * k, b, lr1, 0.0, replicas_per_device=k))
    for fam in ("local_sgd", "diloco"):
        if fam in fams and lam >= 2:
            for h in (4, 16):
                out.append(Candidate(fam, lam, b0, chosen.lr, chosen.momentum, average_every=h))
    seen: set[Candidate] = set()
    uniq = []
    for c in out:
        if c.family in ("compute_groups", "softsync") and search.nan_hit(c):
            continue
        if c not in probed and c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def he_scales(results: list[ProbeResult], cluster: ClusterModel) -> dict[str, float]:
    """Measured over predicted hardware efficiency of the probed configurations.

    For each protocol family probed (and ``"*"`` over all), the geometric mean of
    ``measured seconds per iteration / seconds_per_iteration(layout, cluster)``; on real
    processes it carries what the cluster model misses (the runtime's own overheads) to
    the unprobed configurations of the family. Probes without a measurement are left out.
    """
    logs: dict[str, list[float]] = {}
    for r in results:
        he = r.seconds_per_iteration
        pred = seconds_per_iteration(r.candidate.layout(), cluster)
        if math.isfinite(he) and he > 0 and pred > 0:
            ratio = math.log(he / pred)
            logs.setdefault(r.candidate.family, []).append(ratio)
            logs.setdefault("*", []).append(ratio)
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}


def rank_candidates(
    candidates: list[Candidate],
    reference: Candidate,
    reference_iterations: float,
    cluster: ClusterModel,
    noise_scale: float,
    he_scale: dict[str, float] | None = None,
) -> list[tuple[float, Candidate]]:
    """Predicted time to accuracy ``HE · SE`` of each candidate, fastest first.

    HE comes from the cluster's timing model (:func:`seconds_per_iteration`); SE carries
    the reference's iterations to the target to the candidate's samples per iteration
    with the batch-size law (:func:`scale_iterations`, ``noise_scale`` = B_noise). With
    momentum retuned per g, Omnivore finds statistical efficiency nearly independent of
    asynchrony, so no staleness term is added; an SMA device computing k replicas counts
    its devices' samples per iteration. ``he_scale`` (from :func:`he_scales`) multiplies
    the model's HE of a family by its measured/predicted ratio (the family's own, else
    ``"*"``, else 1).
    """
    b_ref = samples_per_iteration(reference.layout())
    ranked = []
    for c in candidates:
        b = samples_per_iteration(c.layout())
        se = scale_iterations(reference_iterations, b_ref, b, noise_scale)
        scale = 1.0
        if he_scale:
            scale = he_scale.get(c.family, he_scale.get("*", 1.0))
        ranked.append((seconds_per_iteration(c.layout(), cluster) * scale * se, c))
    ranked.sort(key=lambda t: t[0])
    return ranked


def rank_joint(
    search: OmnivoreSearch,
    reference: Candidate,
    settings: TuneConfig,
    cluster: ClusterModel,
    noise_scale: float,
    num_train: int,
    log: DecisionLog,
    measured_he: bool,
) -> list[tuple[float, Candidate]]:
    """The joint search's unprobed configurations (:func:`joint_candidates`, those whose
    iteration fits the training set: :func:`skip_unfit`) by predicted time to accuracy
    (:func:`rank_candidates` against ``reference``, B_noise = ``noise_scale`` samples;
    ``measured_he``: HE scaled by measured / predicted of the probed ones,
    :func:`he_scales`), soonest first."""
    cands = skip_unfit(joint_candidates(search, reference, settings), num_train, log)
    scales = he_scales(search.results, cluster) if measured_he else None
    return rank_candidates(cands, reference, 1.0, cluster, noise_scale, he_scale=scales)


# a joint probe: (predicted time, candidate) -> (its result, where it started for the
# decision: its snapshot's name, a note after the score)
JointProbeFn = Callable[[float, Candidate], tuple[ProbeResult, str, str]]


def probe_joint(
    ranked: list[tuple[float, Candidate]],
    count: int,
    search: OmnivoreSearch,
    against: ProbeResult,
    log: DecisionLog,
    probe: JointProbeFn,
    budget: SearchBudget,
) -> list[ProbeResult]:
    """Probe the ``count`` best of ``ranked`` (each added to ``search.results``), each
    compared at equal time with ``against`` in its decision; a candidate is left out where
    ``budget.search_spent`` gives a reason. Returns the probes run."""
    extra = []
    ref = against.candidate
    for t_pred, cand in ranked[:count]:
        why = budget.search_spent(len(search.results))
        if why is not None:
            log("joint", f"skip {cand.label()}", why)
            continue
        r, snapshot, note = probe(t_pred, cand)
        search.results.append(r)
        extra.append(r)
        log(
            "joint",
            f"probed {cand.label()}: " + ("NaN" if r.diverged else f"score {r.score:.4f}"),
            f"equal-time score against {against.score:.4f} for {ref.label()}"
            + note
            + r.speed_note(),
            score=None if r.diverged else r.score,
            snapshot=snapshot,
            seconds_per_iteration=r.to_json()["seconds_per_iteration"],
        )
    return extra
