"""The probes of ``distsgd train --tune`` (:mod:`distsgd.tuner.online`) and their chains.

Every probe is an ordinary run directory (``probes/NNN-<kind>-<label>``) run by the tuning
core's :class:`~distsgd.tuner.probes.ProbeRunner`: from the seeded initial model, or
continuing a run directory's full checkpoint (a segment's, or a first-rung probe's that a
later rung continues) under the candidate's μ and batch (:attr:`RunOptions.continues
<distsgd.control.RunOptions>`), until the runtime's clock reads a given time. It ends with
a full checkpoint; what the run heard (its training losses) is recorded beside it
(:class:`~distsgd.control.RunRecorder`). A completed probe leaves ``online_probe.json``
(its wall and the run's clock at its end) and is read back instead of run again after an
interruption (resume); one cut short is run again. :class:`ProbeRounds`: what a round of
probes shares, successive halving's second rung (Jamieson & Talwalkar, AISTATS 2016; Li et
al., Hyperband, JMLR 2018) among it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distsgd.config import ConfigWarning, OnlineTuneSettings, RunConfig
from distsgd.control import RunObserver, RunOptions, replay
from distsgd.metrics import write_json
from distsgd.tuner import probes as pr
from distsgd.tuner.budget import RunBudget
from distsgd.tuner.omnivore import Candidate, DecisionLog, ProbeResult, pair_scores
from distsgd.tuner.probes import ProbeRunner, ResultLosses, RunClock, run_summary

__all__ = ["ProbeChains", "ProbeRounds", "RunWall", "steady_checks", "start_dir", "continuing"]

_START_FILES = ("checkpoint.pt", "checkpoint.pt.sha256", "metrics.jsonl")


def continuing(start: Path, run_dir: Path) -> None:
    """Make ``run_dir`` (new) hold ``start``'s checkpoint and evaluation records, so that a
    run resuming there continues ``start``."""
    run_dir.mkdir(parents=True)
    for name in _START_FILES:
        if (start / name).exists():
            shutil.copy2(start / name, run_dir / name)


class _Checks(RunObserver):
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []

    def on_steady_check(self, check: dict[str, Any]) -> None:
        self.checks.append(check)


def steady_checks(run_dir: Path) -> list[dict[str, Any]]:
    """The steady-state checks a run made, in order, as its recorder kept them
    (:func:`~distsgd.control.replay`)."""
    heard = _Checks()
    replay(run_dir, heard)
    return heard.checks


class RunWall:
    """The wall clock of one ``--tune`` run, continuing across its sessions (a resume goes
    on from the earlier sessions' wall), and its progress bar.

    Attributes:
        offset_s: wall seconds of the earlier sessions (and of items read back).
        bar: the progress bar (None: none shown).
    """

    def __init__(self) -> None:
        self.offset_s, self.t0 = 0.0, time.perf_counter()
        self.bar: Any = None

    def elapsed(self) -> float:
        """Wall seconds since the run's start (continuing across a resume)."""
        return self.offset_s + time.perf_counter() - self.t0

    def show(self, what: str) -> None:
        """Move the progress bar to :meth:`elapsed` and name what runs now."""
        if self.bar is not None:
            self.bar.n = round(self.elapsed())
            self.bar.set_postfix_str(what, refresh=True)

    def once(
        self, note: Path, what: str, run: Callable[[], dict[str, Any] | None]
    ) -> dict[str, Any]:
        """The record ``note`` of a run that completed in ``note``'s directory before an
        interruption (the clock catches up to its ``end_elapsed_s``); else ``run()`` (its
        directory emptied first, the bar naming ``what``) and its record written:
        ``begin_elapsed_s``, what ``run`` returns, ``end_elapsed_s`` and ``wall_s`` (the
        wall seconds between them)."""
        if note.exists():
            saved = json.loads(note.read_text())
            if saved["end_elapsed_s"] > self.elapsed():
                self.offset_s += saved["end_elapsed_s"] - self.elapsed()
            return saved
        if note.parent.exists():
            shutil.rmtree(note.parent)  # cut short: run it again
        begin = self.elapsed()
        self.show(what)
        saved = {"begin_elapsed_s": begin, **(run() or {}), "end_elapsed_s": self.elapsed()}
        saved["wall_s"] = saved["end_elapsed_s"] - begin
        write_json(note, saved)
        return saved


def start_dir(snapshot: str) -> Path | None:
    """The run directory a probe started from (None: the initial model)."""
    return None if snapshot == "initial" else Path(snapshot)


class ProbeChains:
    """The online tune's probes and the chains of rungs that continue one another.

    Args:
        cfg: the base config (device profile fixed).
        out: the run directory (probes go to ``out/probes``).
        runner: the core's runner of every probe.
        num_train: training samples (a probe's evaluation interval defaults to an epoch).
        score_window: losses averaged by a score (``tune.score_window``).
        rung_s: a first rung's length on the runtime's clock.
        wall: the run's wall clock and progress bar.

    Attributes:
        count: probes so far (their directories are numbered).
        first_rung: a later rung's probe (run directory) → the probe it continues.
        loss0: the initial model's first training loss (the scale of "blew up").
    """

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        runner: ProbeRunner,
        *,
        num_train: int,
        score_window: int,
        rung_s: float,
        wall: RunWall,
    ) -> None:
        self.cfg, self.out, self.runner = cfg, out, runner
        self.simulated = cfg.runtime == "sim"
        self.clock = RunClock.of(self.simulated)
        self.num_train, self.score_window, self.rung_s = num_train, score_window, rung_s
        self.wall = wall
        self.count = 0
        self.first_rung: dict[str, ProbeResult] = {}
        self.loss0: float | None = None

    def _probe_config(self, cand: Candidate, limit_s: float) -> RunConfig:
        limits = pr.run_limits(self.simulated, limit_s, eval_every_samples=self._eval_every())
        return pr.candidate_config(self.cfg, cand, **limits)

    def _eval_every(self) -> int:
        return self.cfg.train.eval_every_samples or self.num_train

    def start_of(self, start: Path | None) -> tuple[float, int]:
        """(clock seconds, iterations) of a start point (0 for the initial model)."""
        if start is None:
            return 0.0, 0
        s = run_summary(start)
        return float(s.get(self.clock.run_seconds_key) or 0.0), int(s.get("iterations") or 0)

    def probe(
        self,
        cand: Candidate,
        snapshot: str,
        until_clock_s: float | None = None,
        kind: str | None = None,
    ) -> ProbeResult:
        """One probe of ``cand`` from ``snapshot`` until the runtime's clock reads
        ``until_clock_s`` (default: a first rung's length from the snapshot's clock):
        ``snapshot`` is ``initial`` (the seeded initial model) or a run directory (a
        segment's, or a first-rung probe's that continues), whose checkpoint it resumes
        with ``cand``'s μ and batch (:attr:`RunOptions.continues
        <distsgd.control.RunOptions>`).
        ``kind`` names it (``cold``, ``steady``, …; default from the snapshot). Reads a
        completed probe back instead of running it again (resume)."""
        start = start_dir(snapshot)
        clock0, iters0 = self.start_of(start)
        self.count += 1
        kind = kind or ("cold" if start is None else "steady")
        until_clock_s = clock0 + self.rung_s if until_clock_s is None else until_clock_s
        run_dir = self.out / "probes" / f"{self.count:03d}-{kind}-{pr.safe_name(cand.label())}"
        result = ProbeResult(cand, snapshot, score_window=self.score_window)
        result.run_dir = str(run_dir)
        saved = self.wall.once(
            run_dir / "online_probe.json",
            f"probe {cand.label()}",
            lambda: self._run_probe(self._probe_config(cand, until_clock_s), run_dir, start),
        )
        result.wall_s = saved["wall_s"]
        s = run_summary(run_dir)
        result.diverged = s.get("status") == "diverged"
        result.train_wall_s = float(s.get("train_wall_s") or 0.0)
        result.samples = int(s.get("samples") or 0)
        replay(run_dir, ResultLosses(result, self.simulated, iters0, clock0))
        if start is None and result.losses and self.loss0 is None:
            self.loss0 = result.losses[0]  # the initial model's loss: the scale of "blew up"
        result.mark_exploded(self.loss0)
        return result

    def _run_probe(self, cfg: RunConfig, run_dir: Path, start: Path | None) -> None:
        if start is not None:
            continuing(start, run_dir)
        options = RunOptions(evaluate=False, continues=start is not None, record=True)
        self.runner.run(cfg, run_dir, options, RunObserver(), resume=start is not None)

    def chain(self, r: ProbeResult) -> list[ProbeResult]:
        """``r`` and the probes it continues (a second or third rung's), latest first."""
        out = [r]
        while out[-1].run_dir in self.first_rung:
            out.append(self.first_rung[out[-1].run_dir])
        return out

    def measurements(self, results: list[ProbeResult]) -> list[dict[str, Any]]:
        """Each probe's score and clock span; ``from_clock_s`` is the decision point it
        started from (a later rung's: its chain's first rung's start)."""
        out = []
        for r in results:
            parent = self.first_rung.get(r.run_dir)
            root = self.chain(r)[-1]
            start_s = self.start_of(start_dir(r.snapshot))[0]
            rec = {
                "label": r.candidate.label(),
                "score": None if math.isnan(r.score) else r.score,
                "seconds_per_iteration": None
                if math.isnan(r.seconds_per_iteration)
                else r.seconds_per_iteration,
                "from_clock_s": self.start_of(start_dir(root.snapshot))[0],
                "measured_until_clock_s": (r.virtual_s[-1] if r.virtual_s else 0.0) + start_s,
                "probe": Path(r.run_dir).name,
            }
            if r.paired_span:
                rec["paired_iterations"] = r.paired_span
            if parent is not None:
                rec["continues"] = Path(parent.run_dir).name
            out.append(rec)
        return out

    def continue_from(
        self, r: ProbeResult, until_clock_s: float, kind: str, cand: Candidate | None = None
    ) -> ProbeResult:
        """``r``'s probe continued from its own checkpoint until ``until_clock_s`` (with
        ``cand``, default ``r``'s candidate), scored over its chain's last
        ``tune.score_window`` losses."""
        cont = self.probe(cand or r.candidate, r.run_dir, until_clock_s, kind)
        cont.earlier_losses = list(r.earlier_losses) + list(r.losses)
        cont.mark_exploded(self.loss0)  # over the whole chain
        self.first_rung[cont.run_dir] = r
        return cont


class ProbeRounds:
    """What the cold start's and a steady-state round's probes share.

    Args:
        chains: the run's probes and their chains.
        log: the decision log.
        settings: ``[tune]`` (its ``probe_seconds`` a first rung's length).
        budget: the run's probe lengths.

    Attributes:
        overhead_clock_s: clock seconds of probes that did not continue as the run.
    """

    def __init__(
        self,
        chains: ProbeChains,
        log: DecisionLog,
        settings: OnlineTuneSettings,
        budget: RunBudget,
    ) -> None:
        self.chains, self.log, self.settings, self.budget = chains, log, settings, budget
        self.clock = chains.clock
        self.overhead_clock_s = 0.0

    def count_overhead(self, results: list[ProbeResult], winner: ProbeResult) -> None:
        """Clock seconds of the probes that did not continue as the run (the winner and
        the probes its chain continues) count as tuning overhead."""
        kept = {r.run_dir for r in self.chains.chain(winner)}
        for r in results:
            if r.run_dir not in kept and r.virtual_s:
                self.overhead_clock_s += r.virtual_s[-1]

    def second_rung(
        self, phase: str, results: list[ProbeResult], larger: ProbeResult | None = None
    ) -> list[ProbeResult]:
        """Successive halving's second rung: the ``tune.promote`` (cold start) or
        ``tune.steady_promote`` (steady state) best of a round's first-rung probes (lowest
        score; ties prefer larger η, then μ), and ``larger`` (cold start: the next larger
        η than the best at g = 1, :func:`~distsgd.tuner.omnivore.next_larger_lr`) where
        they leave it out, continue from their own checkpoints until ``probe_s`` after the
        round's start on the runtime's clock, scored over the chain's last
        ``tune.score_window`` losses (steady state: over the iterations every chain of
        the round trained, :func:`~distsgd.tuner.omnivore.pair_scores`). Returns the
        continued probes ([] with no second rung, or a steady state that promotes one)."""
        cold = phase == "cold start"
        promote = self.settings.promote if cold else self.settings.steady_promote
        probe_s, rung_s = self.budget.probe_s, self.budget.rung_s
        if rung_s >= probe_s or (not cold and promote == 1):
            return []
        ok = [r for r in results if not math.isnan(r.score)]
        ok.sort(key=lambda r: (r.score, -r.candidate.lr, -r.candidate.momentum))
        kind = "cold2" if cold else "steady2"
        chosen = ok[:promote]
        extra = larger is not None and cold and all(r is not larger for r in chosen)
        firsts = chosen + ([larger] if extra else [])
        out = []
        for r in firsts:
            round_start = self.chains.start_of(start_dir(r.snapshot))[0]
            out.append(self.chains.continue_from(r, round_start + probe_s, kind))
        if not cold:
            pair_scores(out)  # one snapshot, one layout: the same minibatches
        for r, cont in zip(firsts, out, strict=True):
            self.log(
                phase,
                f"continue {r.candidate.label()} to {probe_s:.4g} s: "
                + ("NaN" if cont.diverged else f"score {cont.score:.4f}"),
                (
                    "successive halving: "
                    + ("the best" if promote == 1 else f"one of the {promote} best")
                    + f" first-rung scores ({r.score:.4f} after {rung_s:.4g} "
                    f"{self.clock.name} s)"
                    if r is not larger or not extra
                    else f"the next larger η than the best at g=1 (first rung {r.score:.4f} "
                    f"after {rung_s:.4g} {self.clock.name} s): short probes prefer "
                    "smaller η (short-horizon bias), so it gets a second-rung chance"
                )
                + ", continued from its own checkpoint",
                score=None if cont.diverged else cont.score,
            )
        return out

    def warn_short_probes(self, results: list[ProbeResult], phase: str = "cold start") -> None:
        """A warning (and a decision) when a round's probes trained fewer iterations than
        ``tune.score_window``: their scores then average fewer minibatch losses (none with
        fewer than two such probes: nothing is ranked)."""
        window = self.settings.score_window
        counts = [len(r.losses) for r in results if not r.diverged]
        if len(counts) < 2 or min(counts) >= window:
            return
        line = (
            f"probes of {self.budget.rung_s:.4g} {self.clock.name} s trained as few as "
            f"{min(counts)} iteration(s), fewer than tune.score_window = {window}: their "
            "scores average that many minibatch losses and rank the candidates by noise; "
            "raise tune.probe_seconds (or tune.first_rung) or the time budget"
        )
        warnings.warn(line, ConfigWarning, stacklevel=3)
        self.log(phase, "warning: probes too short to score", line, echo=False)
