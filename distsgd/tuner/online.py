"""``distsgd train CONFIG --tune``: Omnivore's optimizer inside the training run.

Omnivore (Hadjis et al., arXiv:1606.04487, §4 "optimizer"; docs/protocols.md §3) tunes
while it trains; :class:`OnlineTune` does so on the ``sim`` and ``dist`` runtimes, each
probe an ordinary run (``probes/NNN-…``) that ends with a full checkpoint:

1. **Cold start** (:meth:`OnlineTune.cold_start`): Omnivore's grid
   (:class:`~distsgd.tuner.omnivore.OmnivoreSearch`) by successive halving (Jamieson &
   Talwalkar, AISTATS 2016; Li et al., Hyperband, JMLR 2018), then the joint search's best
   ``tune.extra_probes``, a leader confirmed at twice the probe length.
2. **The winner continues as the run**: its checkpoint is resumed exactly, so its samples
   count.
3. **Steady state**: every ``tune.check_epochs`` the run checks
   (:func:`~distsgd.plateau.steady_state_due`) whether the training loss has flattened; at
   a due check it probes :func:`steady_grid` from the segment's checkpoint, scores the
   round's probes by :func:`~distsgd.tuner.omnivore.pair_scores` and continues with the
   best, at most ``tune.steady_rounds`` times.

A probe lasts ``min(tune.probe_seconds, PROBE_SHARE · T / n)`` for a time budget T and
n = :func:`planned_probes`, at least ``MIN_PROBE_FRACTION · tune.probe_seconds``. The time
to the target counts from the run's start, every probe included; on ``dist`` every probe
and segment runs on one :class:`~distsgd.launch.RankPool`. ``distsgd train --resume``
replays the procedure, reading back what completed. What each step does, what it costs
and what ``summary.json`` and ``decisions.jsonl`` hold: docs/tuning.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

from distsgd.config import (
    ConfigError,
    ConfigWarning,
    RunConfig,
    TuneConfig,
)
from distsgd.control import RunObserver, RunOptions
from distsgd.data import keep_loaded
from distsgd.engine import UserCode
from distsgd.metrics import read_metrics, write_json
from distsgd.plateau import FLAT_GAIN, steady_state_due
from distsgd.rundir import RunDirClaim
from distsgd.tuner import perf_model as pm
from distsgd.tuner.chains import Heard, ProbeChains, continuing, run_summary, start_dir
from distsgd.tuner.omnivore import (
    Candidate,
    DecisionLog,
    OmnivoreSearch,
    ProbeResult,
    next_larger_lr,
    pair_scores,
    pick_best,
    probe_joint,
    rank_joint,
)
from distsgd.tuner.probes import (
    ProbeRunner,
    RunClock,
    candidate_config,
    check_optimizer_searchable,
    check_runtime,
    safe_name,
)
from distsgd.tuner.session import cluster_model, fixed_base, tune_layout
from distsgd.tuner.tune import check_tunable

__all__ = [
    "OnlineTune",
    "train_tuned",
    "is_tuning_run",
    "check_online_tunable",
    "TUNED_PROTOCOLS",
    "probe_seconds_for",
    "steady_state_due",
    "steady_grid",
    "effective_rate",
    "PROBE_SHARE",
    "MIN_PROBE_FRACTION",
    "FLAT_GAIN",
]

PROBE_SHARE = 0.2  # share of the run's time budget the cold start's probes may take
MIN_PROBE_FRACTION = 0.25  # shortest probe, as a fraction of tune.probe_seconds
STATE_FILE = "tune_config.toml"  # marks a tuning run directory; holds its base config
CLOCK_FILE = "tune_clock.json"  # the run's wall clock when a session of it ended
# the protocols of the families the search probes (candidate_config): a base config on
# another protocol would be replaced silently, so it is refused
TUNED_PROTOCOLS = ("hardsync", "compute_groups", "parameter_server", "sma")
# what a directory holds once any run wrote to it (--tune's, a plain run's, distsgd tune's)
_HELD = (STATE_FILE, "summary.json", "checkpoint.pt", "decisions.jsonl", "tune.json", "probes")
_FINAL_FILES = ("config.toml", "model.pt", "model.pt.sha256", "checkpoint.pt", "staleness.json")


def effective_rate(lr: float, momentum: float) -> float:
    """SGD's effective learning rate η / (1 − μ): the step a constant gradient takes
    per iteration once the momentum buffer has filled."""
    return lr / (1.0 - momentum)


def steady_grid(
    lr: float,
    momentum: float,
    momenta: list[float],
    rate_ceiling: float,
    one_per_rate: bool = False,
) -> list[tuple[float, float]]:
    """The (η, μ) a steady-state round probes: the incumbent first, then every μ of
    ``momenta`` × {η, η/10} (largest μ first); a step down of the effective rate
    (:func:`effective_rate`) only while the incumbent's is above a tenth of
    ``rate_ceiling``, the highest effective rate among the cold start's probes that did
    not diverge.

    Why the floor: the round ranks its probes by their loss a few seconds on, and a lower
    rate always wins that race (short-horizon bias, Wu et al., ICLR 2018), and a step from
    a rate already a decade below the highest stable one can stall the run short of its
    target (docs/benchmarks.md). Omnivore's η grid is in decades: the floor keeps the run
    in the top two.

    ``one_per_rate`` (synchronous SGD, no implicit momentum): one (η, μ) per effective
    rate, the first in the order above (the incumbent's μ, else the larger μ), and no rate
    more than a decade below the incumbent's. SGD's noise scale at steady state depends on
    η and μ through η / (1 − μ) only (Smith, Kindermans, Ying & Le, ICLR 2018, §3), so a
    second probe of the same rate races noise, not a choice (with ``tune.momenta = [0,
    0.9]`` and μ = 0.9, (η, 0) is (η/10, 0.9)'s rate), and μ's grid adds rates, not
    choices: Omnivore steps η by one decade ({η, η/10}); a step of two (η/10 at a lower μ)
    is the short race's favourite that the floor above guards against, and the next round
    may step again.
    """
    incumbent = effective_rate(lr, momentum)
    may_step_down = incumbent > rate_ceiling / 10 * (1 + 1e-9)  # float noise of 1 − μ
    grid = [(lr, momentum)]
    for mu in sorted(momenta, reverse=True):
        for rate in (lr, lr / 10):
            if (rate, mu) in grid or (
                one_per_rate
                and (
                    any(_same_rate((rate, mu), other) for other in grid)
                    or effective_rate(rate, mu) < incumbent / 10 * (1 - 1e-9)
                )
            ):
                continue
            # the same rate by another (η, μ) is no step down, whatever 1 − μ rounds to
            if may_step_down or effective_rate(rate, mu) >= incumbent * (1 - 1e-9):
                grid.append((rate, mu))
    return grid


def _same_rate(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two (η, μ) have one effective rate (relative 1e-9: float noise of 1 − μ)."""
    ra, rb = effective_rate(*a), effective_rate(*b)
    return abs(ra - rb) <= 1e-9 * max(ra, rb)


def check_online_tunable(config: RunConfig) -> None:
    """Refuse, in one line, settings that ``--tune`` would otherwise override silently.

    Raises:
        ConfigError: ``train.evaluate = false`` (the run evaluates to stop at its target
            and to decide steady state), or a ``protocol.name`` outside
            :data:`TUNED_PROTOCOLS` (the run continues with a tuned family's protocol).
    """
    if not config.train.evaluate:
        raise ConfigError(
            "train.evaluate = false is not allowed with --tune: the tuning run evaluates "
            "to stop at train.target and to decide steady state; drop --tune to train "
            "without evaluations"
        )
    if config.protocol.name not in TUNED_PROTOCOLS:
        raise ConfigError(
            f"protocol.name = {config.protocol.name!r} is not allowed with --tune: the "
            f"tuner chooses among {', '.join(TUNED_PROTOCOLS)} (tune.families "
            f"{', '.join(config.tune.families)}) and would replace it; train it without "
            "--tune"
        )


def is_tuning_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run of ``distsgd train --tune``."""
    return (Path(run_dir) / STATE_FILE).exists()


def probe_seconds_for(
    settings_probe_s: float, budget_s: float, planned: float
) -> tuple[float, int]:
    """The cold start's probe length and how many probes it may run (module docstring).

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


def planned_probes(settings: TuneConfig) -> float:
    """The cold start's planned work in probes of ``tune.probe_seconds``: m = ``len(tune.
    lrs)`` first-rung probes of ``tune.first_rung`` = r of it each, at most ``min(tune.
    promote + 1, m)`` of them (the promoted and the next larger η than the best at g = 1)
    continued by the rest, and ``tune.extra_probes`` = e of full length: m · r +
    min(promote + 1, m) · (1 − r) + e (m + e with no second rung; e counts a joint probe
    that continues the winner's first rung, 1 − r, as a whole one). It leaves out the
    grids of g ≥ 2 (compute groups, where the layout has a parameter server) and a
    confirmation (up to 2 more, where a joint probe leads), so the cold start can take
    more than ``PROBE_SHARE`` of the budget; counting them would shorten every probe of a
    run limited by its budget for work that most runs do not do."""
    m, extra = len(settings.lrs), settings.extra_probes
    r = settings.first_rung
    return m * r + min(settings.promote + 1, m) * (1 - r) + extra if r < 1 else float(m + extra)


class OnlineTune:
    """One ``distsgd train --tune`` run (module docstring: the rules and files).

    Args:
        config: the run's config (model, data, target, λ, batch, ``[tune]`` settings).
        out_dir: the run directory.
        progress: show a progress bar and one line per decision.
        code: the user's objects (simulated runtime only, as for any run).

    Raises (from :meth:`run`):
        ConfigError: what ``distsgd tune`` refuses (a lower-is-better metric, an optimizer
            other than SGD, a torch scheduler, a runtime other than sim/dist, layouts that
            cannot probe ``tune.families``), an ``out_dir`` that holds a run (without
            resume), or a cold start in which every probe diverged.
        TrainingDiverged / DistRunFailed: as for any run.
    """

    def __init__(
        self,
        config: RunConfig,
        out_dir: str | Path,
        progress: bool = True,
        code: UserCode | None = None,
    ) -> None:
        check_runtime(config.runtime)
        check_tunable(config)
        check_online_tunable(config)
        check_optimizer_searchable(config)
        self.num_processes, self.num_learners, self.ps_learners = tune_layout(config)
        self.config = config
        self.out = Path(out_dir)
        self.progress = progress
        self.code = code
        self.simulated = config.runtime == "sim"
        self.clock = RunClock.of(self.simulated)
        self.segments = 0
        self.overhead_clock_s = 0.0  # clock seconds of probes that did not continue
        self.segment_wall_s = 0.0
        self._offset_s = 0.0

    # ---- time ------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Wall seconds since the run's start (continuing across a resume)."""
        return self._offset_s + time.perf_counter() - self._t0

    def _catch_up(self, recorded_end_s: float) -> None:
        """A reused item ended at ``recorded_end_s``: the run's clock is at least there."""
        if recorded_end_s > self.elapsed():
            self._offset_s += recorded_end_s - self.elapsed()

    # ---- setup -----------------------------------------------------------------------
    def _setup(self, resume: bool) -> None:
        """Fix the device profile (every probe on the same simulated cluster), the initial
        weights' size and the training set's size; write the state file."""
        if resume and not is_tuning_run(self.out):
            raise ConfigError(f"cannot resume: {self.out} does not hold a run of --tune")
        held = [f for f in _HELD if (self.out / f).exists()]
        if not resume and held:
            raise ConfigError(
                f"output directory {str(self.out)!r} already holds a run ({held[0]}); choose "
                "another output directory (--out)"
                + (" or continue it with --resume" if is_tuning_run(self.out) else "")
            )
        # the device profile is measured (and cached) at the threads a probe trains with,
        # as a plain run or distsgd tune of this config would; the batch is checked
        # against the data before anything is measured or written
        base = fixed_base(
            self.config, self.num_processes, self.code, lambda c, n: c.protocol.check_fits(n)
        )
        cfg = base.cfg
        self.num_train = base.dataset.num_train
        self.num_parameters = base.engine.num_parameters
        self.cfg = cfg
        self.cluster = cluster_model(cfg, self.num_parameters)
        self.probe_s, self.max_probes = probe_seconds_for(
            cfg.tune.probe_seconds, self._time_budget_s(), planned_probes(cfg.tune)
        )
        # successive halving: first-rung probes of rung_s, the best continue to probe_s
        # (none when the budget is too small: probes of the shortest length, no second rung)
        halving = cfg.tune.first_rung < 1 and not self.max_probes
        self.rung_s = self.probe_s * cfg.tune.first_rung if halving else self.probe_s
        # a budget too small for the cold start has none left for steady-state rounds
        self.steady_rounds = 0 if self.max_probes else cfg.tune.steady_rounds
        self.settings = dataclasses.replace(cfg.tune, probe_seconds=self.rung_s)
        self.out.mkdir(parents=True, exist_ok=True)
        if not resume:
            (self.out / STATE_FILE).write_text(self.config.to_toml())

    def _time_budget_s(self) -> float:
        """The run's time budget T on the runtime's clock (0: none): ``train.
        max_virtual_seconds`` on ``sim``, ``train.max_seconds`` on real processes; also the
        seconds of the run's sample budget (``train.max_epochs`` / ``max_samples``) at
        hardsync's rate on the cluster model of the run's device profile (on real
        processes a prediction of their wall seconds), so the probes cannot use up a run
        limited by samples (a winning probe must not train the whole sample budget and
        leave the run nothing to continue)."""
        t = self.cfg.train
        budget = t.max_virtual_seconds if self.simulated else t.max_seconds
        samples = [int(math.ceil(t.max_epochs * self.num_train))] if t.max_epochs else []
        samples += [t.max_samples] if t.max_samples else []
        if not samples:
            return budget
        layout = Candidate("hardsync", self.num_learners, self.cfg.protocol.batch_size, 0.1, 0.0)
        per_sample_s = pm.seconds_per_iteration(layout.layout(), self.cluster) / (
            pm.samples_per_iteration(layout.layout())
        )
        by_samples = min(samples) * per_sample_s
        return min(budget, by_samples) if budget > 0 else by_samples

    def _budget_source(self) -> str:
        """Where :meth:`_time_budget_s` comes from, for the lines that name it."""
        t = self.cfg.train
        limit = "train.max_virtual_seconds" if self.simulated else "train.max_seconds"
        if (t.max_virtual_seconds if self.simulated else t.max_seconds) == self._time_budget_s():
            return limit
        by_epochs = math.ceil(t.max_epochs * self.num_train) if t.max_epochs else math.inf
        which = (
            f"train.max_epochs = {t.max_epochs:g}"
            if not t.max_samples or by_epochs <= t.max_samples
            else f"train.max_samples = {t.max_samples}"
        )
        return f"{which} at hardsync's predicted rate on this device profile" + (
            "" if self.simulated else f": a prediction; a smaller {limit} takes its place"
        )

    def _log_setup(self) -> None:
        budget = self._time_budget_s()
        rule = (
            f"min(tune.probe_seconds, {PROBE_SHARE:g} · {budget:.4g} s / "
            f"{planned_probes(self.cfg.tune):g} planned probes of full length); the budget: "
            + self._budget_source()
            if budget > 0
            else "tune.probe_seconds (the run has no time budget)"
        )
        if self.max_probes:
            rule += (
                f", below the shortest allowed, so min({MIN_PROBE_FRACTION:g} · "
                f"tune.probe_seconds, {PROBE_SHARE:g} · {budget:g} s)"
            )
        halving = self.rung_s < self.probe_s
        self.log(
            "setup",
            (
                f"probes of {self.rung_s:.4g} {self.clock.name} seconds, the best "
                + ("" if self.cfg.tune.promote == 1 else f"{self.cfg.tune.promote} ")
                + "of the cold start's grid (and the next larger η than the best at g=1) "
                f"continued to {self.probe_s:.4g} s, the joint search's probes "
                f"{self.probe_s:.4g} s (one that leads, and the grid's winner, continue to "
                f"{2 * self.probe_s:.4g} s); "
                + (
                    "the best of a steady-state round continues as the run"
                    if self.cfg.tune.steady_promote == 1
                    else f"the best {self.cfg.tune.steady_promote} of a steady-state round "
                    f"continued to {self.probe_s:.4g} s"
                )
                if halving
                else f"probes of {self.probe_s:.4g} {self.clock.name} seconds each"
            ),
            f"probe length = {rule}"
            + (
                f"; successive halving: a first rung of tune.first_rung = "
                f"{self.cfg.tune.first_rung:g} of it"
                if halving
                else ""
            ),
            run_clock_s=0.0,
        )
        if self.max_probes:
            line = (
                f"the budget {budget:.4g} s ({self._budget_source()}) is too small for the "
                "full cold start: probes of "
                f"{self.probe_s:.4g} s (the shortest allowed: min({MIN_PROBE_FRACTION:g} · "
                f"tune.probe_seconds, {PROBE_SHARE:g} · the budget)), at most "
                f"{self.max_probes}; "
                "the run trains with the best of them to the end, without steady-state "
                "rounds"
            )
            # one line on screen: the warning's (the decision is in decisions.jsonl)
            self.log("setup", "budget too small: fewer probes", line, echo=False, run_clock_s=0.0)
            warnings.warn(line, ConfigWarning, stacklevel=3)

    # ---- probes ----------------------------------------------------------------------
    # ---- the run's segments ------------------------------------------------------------
    def _segment(self, cand: Candidate, start: Path, check_every: int) -> tuple[Path, bool]:
        """Continue ``start`` (a probe that won) as the run with ``cand``, in one launch,
        until the target, the run's limits or the first check where the steady-state rule
        is due (:attr:`RunOptions.steady_check_samples <distsgd.control.RunOptions>` =
        ``check_every``: a check at every multiple of it since the run's start; 0: none). Returns (its directory,
        whether the run ends here)."""
        self.segments += 1
        seg = self.out / "train" / f"{self.segments:02d}-{safe_name(cand.label())}"
        note = seg / "online_segment.json"
        cfg = candidate_config(self.cfg, cand)
        options = RunOptions(steady_check_samples=check_every, continues=True, record=True)
        if note.exists():
            saved = json.loads(note.read_text())
            self._catch_up(saved["end_elapsed_s"])
        else:
            if seg.exists():
                shutil.rmtree(seg)
            continuing(start, seg)
            begin = self.elapsed()
            self._bar(f"train {cand.label()}")
            self.runner.run(cfg, seg, options, RunObserver(), resume=True, progress=self.progress)
            saved = {
                "begin_elapsed_s": begin,
                "end_elapsed_s": self.elapsed(),
                "overhead_clock_s": self.overhead_clock_s,
                "start": str(start),
            }
            write_json(note, saved)
        self.segment_wall_s += saved["end_elapsed_s"] - saved["begin_elapsed_s"]
        self.timeline.append((seg, saved))
        return seg, run_summary(seg).get("stop_reason") != "steady_state"

    @staticmethod
    def _checks(seg: Path) -> list[dict[str, Any]]:
        """The steady-state checks a segment made, in order."""
        return Heard.of(seg).checks

    def _log_check(self, check: dict[str, Any], rounds: int) -> None:
        """One decision per check of the rule, as made at its decision point inside the
        segment: ``run_clock_s`` the run's clock there, its two evaluations; the line is
        written when the segment returns (its ``t_wall_s``)."""
        due = bool(check["due"])
        span = f"{self.cfg.tune.check_epochs:g} epoch"
        used = check["used"]
        losses = [r.get("train_loss") for r in used]
        if len(used) < 2:
            why = f"fewer than two evaluations {span} apart: no comparison yet"
        elif not all(isinstance(x, int | float) and math.isfinite(x) for x in losses) or (
            losses[0] <= 0
        ):
            why = f"training loss {losses[0]} then {losses[1]}: not comparable"
        else:
            fell = 100 * (losses[0] - losses[1]) / losses[0]
            apart = (used[1]["samples"] - used[0]["samples"]) / self.num_train
            why = (
                f"training loss {'fell' if fell >= 0 else 'rose'} by {abs(fell):.3g}% "
                f"over {apart:.3g} epoch ({losses[0]:.4g} at "
                f"{used[0]['samples']} samples to {losses[1]:.4g} at {used[1]['samples']}): "
                + ("at least" if not due else "less than" if fell >= 0 else "not")
                + f" the rule's {100 * FLAT_GAIN:g}% fall between evaluations at least {span} "
                "apart"
            )
        self.log(
            "steady state",
            "re-optimise" if due and rounds < self.steady_rounds else "keep training",
            why
            + (
                f"; the run re-optimised {rounds} times already (tune.steady_rounds = "
                f"{self.cfg.tune.steady_rounds})"
                if due and rounds >= self.steady_rounds
                else ""
            ),
            run_clock_s=float(check.get(self.clock.run_seconds_key) or 0.0),
            measurements=[
                {k: r.get(k) for k in ("samples", "train_loss", self.clock.eval_key)}
                for r in check["used"]
            ],
        )

    # ---- decisions -------------------------------------------------------------------
    def _count_overhead(self, results: list[ProbeResult], winner: ProbeResult) -> None:
        """Clock seconds of the probes that did not continue as the run (the winner and
        the probes its chain continues) count as tuning overhead."""
        kept = {r.run_dir for r in self.chains.chain(winner)}
        for r in results:
            if r.run_dir not in kept and r.virtual_s:
                self.overhead_clock_s += r.virtual_s[-1]

    def _second_rung(
        self, phase: str, results: list[ProbeResult], larger: ProbeResult | None = None
    ) -> list[ProbeResult]:
        """Successive halving's second rung: the ``tune.promote`` (cold start) or
        ``tune.steady_promote`` (steady state) best of a round's first-rung probes (lowest
        score; ties prefer larger η, then μ), and ``larger`` (cold start: the next larger
        η than the best at g = 1, :func:`~distsgd.tuner.omnivore.next_larger_lr`) where
        they leave it out, continue from their own checkpoints until
        ``probe_s`` after the round's start on the runtime's clock (each chain as long as a
        full probe, whatever its first rung overshot), scored over the chain's last
        ``tune.score_window`` losses (steady state: over the iterations every chain of
        the round trained, :func:`~distsgd.tuner.omnivore.pair_scores`), so their scores
        compare. Returns the continued probes
        ([] with no second rung; also for a steady state that promotes one: the best first
        rung then continues as the run)."""
        cold = phase == "cold start"
        promote = self.cfg.tune.promote if cold else self.cfg.tune.steady_promote
        if self.rung_s >= self.probe_s or (not cold and promote == 1):
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
            out.append(self.chains.continue_from(r, round_start + self.probe_s, kind))
        if not cold:
            pair_scores(out)  # one snapshot, one layout: the same minibatches
        for r, cont in zip(firsts, out, strict=True):
            self.log(
                phase,
                f"continue {r.candidate.label()} to {self.probe_s:.4g} s: "
                + ("NaN" if cont.diverged else f"score {cont.score:.4f}"),
                (
                    "successive halving: "
                    + ("the best" if promote == 1 else f"one of the {promote} best")
                    + f" first-rung scores ({r.score:.4f} after {self.rung_s:.4g} "
                    f"{self.clock.name} s)"
                    if r is not larger or not extra
                    else f"the next larger η than the best at g=1 (first rung {r.score:.4f} "
                    f"after {self.rung_s:.4g} {self.clock.name} s): short probes prefer "
                    "smaller η (short-horizon bias), so it gets a second-rung chance"
                )
                + ", continued from its own checkpoint",
                score=None if cont.diverged else cont.score,
            )
        return out

    def _confirm(self, grid: ProbeResult, joint: ProbeResult) -> list[ProbeResult]:
        """A joint probe that beat the grid's winner at the full probe length: both
        continue from their own checkpoints to twice that length (``probes/NNN-cold3-…``),
        scored over their chains' last losses; returns (the joint's, the grid's).

        From the initial model a smaller batch leads short probes (more updates in the
        same time) and the run then pays its lower samples per second (docs/benchmarks.md).
        The grid's chain continues as the run if it wins, so the confirmation costs only
        the loser's extra length."""
        until = 2 * self.probe_s
        out = []
        for r in (joint, grid):
            cont = self.chains.continue_from(r, until, "cold3")
            out.append(cont)
            self.log(
                "cold start",
                f"continue {r.candidate.label()} to {until:.4g} s: "
                + ("NaN" if cont.diverged else f"score {cont.score:.4f}"),
                f"confirmation: the joint probe led at {self.probe_s:.4g} "
                f"{self.clock.name} s ({joint.score:.4f} against {grid.score:.4f}); short "
                "probes favour a smaller batch, so it and the grid's winner continue to "
                "twice that length from their own checkpoints",
                score=None if cont.diverged else cont.score,
            )
        return out

    def cold_start(self) -> ProbeResult:
        """Omnivore's cold start by successive halving (its first rungs, then the second
        rung: the promoted and the next larger η than the best at g = 1), then the joint
        search's best ``tune.extra_probes`` to the full probe length (from the grid
        winner's first rung where :meth:`_branch_point` allows, else from the initial
        model), each against the grid's winner at equal time (a joint probe wins only by
        more than ``tune.tie_buffer``, and with halving only if it still does at twice
        the length: :meth:`_confirm`).

        The joint probes are left out of the halving: from the initial model a smaller
        batch leads a short first rung (more updates in the same time) and loses at the
        full length, and its η comes from the grid's winner after its second rung rather
        than from its noisier first rung."""
        search = OmnivoreSearch(
            self.chains.probe,
            self.settings,
            self.num_learners,
            self.cfg.protocol.batch_size,
            self.log,
            ps_learners=self.ps_learners,
            out_of_budget=lambda: bool(self.max_probes) and self.chains.count >= self.max_probes,
            stop_descending=True,
        )
        best = search.cold_start("initial")
        if best is None:
            raise ConfigError(
                f"tune.lrs = {self.settings.lrs!r} is not allowed: every cold-start probe "
                "diverged; expected smaller learning rates (in a new --out: this run "
                "directory holds only the diverged probes)"
            )
        self._warn_short_probes(search.results)
        g1 = search.best_by_g.get(1)
        larger = next_larger_lr(search.results, g1) if g1 is not None else None
        second = self._second_rung("cold start", search.results, larger)
        for g in {r.candidate.g for r in second}:  # the joint search builds on these
            search.best_by_g[g] = (
                pick_best([r for r in second if r.candidate.g == g], self.settings.tie_buffer)
                or search.best_by_g[g]
            )
        best = pick_best(second, self.settings.tie_buffer) or best
        extra = self._joint(search, best)
        better = pick_best(extra, self.settings.tie_buffer)
        third: list[ProbeResult] = []
        tie = self.settings.tie_buffer
        if better is not None and better.score < best.score * (1 - tie):
            if second and not self.max_probes:  # halving: confirm at twice the length
                third = self._confirm(best, better)
                joint, grid = third
                best = joint if joint.score < grid.score * (1 - tie) else grid
            else:
                best = better
        results = search.results + second + third
        self._count_overhead(results, best)
        # per layout: a rate at another batch is not one at this batch (a losing joint
        # probe at another batch, its η scaled, must not set this run's ceiling)
        self.rate_ceilings: dict[pm.Layout, float] = {}
        for r in (r for r in results if not r.diverged):
            key, rate = r.candidate.layout(), effective_rate(r.candidate.lr, r.candidate.momentum)
            self.rate_ceilings[key] = max(rate, self.rate_ceilings.get(key, 0.0))
        self.log(
            "cold start",
            f"continue with {best.candidate.label()} as the run",
            (
                "lowest equal-time score at twice the probe length"
                if third
                else "lowest equal-time score of the second rung"
                if second
                else "lowest equal-time score of the cold start"
            )
            + f" (ties within {100 * self.settings.tie_buffer:g}% prefer larger η, then μ; "
            "a joint probe wins only by more than that); its probe's whole state "
            "continues, so its samples count towards the run",
            run_clock_s=0.0,
            measurements=self.chains.measurements(results),
        )
        return best

    def _warn_short_probes(self, results: list[ProbeResult], phase: str = "cold start") -> None:
        """A warning (and a decision) when a round's probes trained fewer iterations than
        ``tune.score_window``: their scores then average fewer minibatch losses (none with
        fewer than two such probes: nothing is ranked)."""
        window = self.settings.score_window
        counts = [len(r.losses) for r in results if not r.diverged]
        if len(counts) < 2 or min(counts) >= window:
            return
        line = (
            f"probes of {self.rung_s:.4g} {self.clock.name} s trained as few as "
            f"{min(counts)} iteration(s), fewer than tune.score_window = {window}: their "
            "scores average that many minibatch losses and rank the candidates by noise; "
            "raise tune.probe_seconds (or tune.first_rung) or the time budget"
        )
        warnings.warn(line, ConfigWarning, stacklevel=2)
        self.log(phase, "warning: probes too short to score", line, echo=False)

    def _joint(self, search: OmnivoreSearch, best: ProbeResult) -> list[ProbeResult]:
        """Probe the joint search's best-predicted ``tune.extra_probes`` to the full probe
        length (the clock at which ``best``'s chain ends): from the first rung of that
        chain where :meth:`_branch_point` allows (its ``continues``), else from the
        initial model."""
        s = self.settings
        if s.extra_probes <= 0:
            return []
        ref = best.candidate
        noise = s.noise_scale or float(ref.layout().num_learners * ref.batch_size)
        ranked = rank_joint(
            search, ref, s, self.cluster, noise, self.num_train, self.log, not self.simulated
        )

        def skip() -> str | None:
            spent = self.max_probes and self.chains.count >= self.max_probes
            return "the budget's probes are spent" if spent else None

        def probe(_: float, cand: Candidate) -> tuple[ProbeResult, str, str]:
            root = self._branch_point(best, cand)
            if root is None:
                return self.chains.probe(cand, "initial", self.probe_s), "initial", ""
            # from the grid winner's first rung, to the same clock as its chain
            note = (
                f", from {Path(root.run_dir).name} after its {self.rung_s:.4g} "
                f"{self.clock.name} s (its batch changed there)"
            )
            r = self.chains.continue_from(root, self.probe_s, "joint", cand)
            return r, f"probes/{Path(root.run_dir).name}", note

        return probe_joint(ranked, s.extra_probes, search, best, self.log, probe, skip)

    def _branch_point(self, best: ProbeResult, cand: Candidate) -> ProbeResult | None:
        """The first rung a joint probe of ``cand`` continues from: the grid winner's
        (``best``, a second rung of successive halving), where ``cand`` is hardsync and
        differs from it only in the batch and η (a batch change continues a hardsync
        state: :func:`_set_batch`). None: ``cand`` starts from the initial model.

        From a common snapshot the two compare at the same clock as from the start, and
        the first rung's seconds are not trained again; a smaller batch's lead over the
        first seconds from the initial model (more updates) is also left out of the
        comparison."""
        if best.run_dir not in self.chains.first_rung:
            return None  # no halving: best is a full-length first rung
        root = self.chains.chain(best)[-1]
        ref = root.candidate
        same = dataclasses.replace(cand, batch_size=ref.batch_size, lr=ref.lr) == ref
        if not same or ref.family != "hardsync" or root.snapshot != "initial" or root.diverged:
            return None
        return root

    def _rate_ceiling(self, current: Candidate) -> float:
        """The highest effective rate η/(1 − μ) the cold start probed without diverging in
        ``current``'s layout (family, λ, b, g; at least ``current``'s own): rates at
        another batch do not compare (SGD's noise scale is η/(1 − μ) over the batch, Smith
        et al., ICLR 2018, and the linear scaling that relates them is a rule of thumb)."""
        own = effective_rate(current.lr, current.momentum)
        return max(own, self.rate_ceilings.get(current.layout(), own))

    def _steady_grid(self, current: Candidate) -> list[tuple[float, float]]:
        # hardsync only: compute groups add asynchrony's implicit momentum (docs/protocols.md §3),
        # so one explicit η / (1 − μ) is not one rate there
        return steady_grid(
            current.lr,
            current.momentum,
            self.settings.momenta,
            self._rate_ceiling(current),
            one_per_rate=current.family == "hardsync",
        )

    def _no_round_left(self, current: Candidate) -> None:
        """The decision when steady state has nothing to probe for ``current``: no step
        down from its rate (:func:`steady_grid`) and no higher rate in the grid."""
        self.log(
            "steady state",
            f"train {current.label()} to the end without checks",
            f"its effective rate η/(1 − μ) = {effective_rate(current.lr, current.momentum):.4g}"
            f" is a decade or more below the highest the cold start probed without "
            f"diverging ({self._rate_ceiling(current):.4g} at its batch): a steady-state "
            "round would only probe "
            "lower rates, which stall a run short of its target (its short probes prefer "
            "them), and tune.momenta holds no higher one",
        )

    def _paired(self, span: int) -> str:
        return (
            f"mean training loss over the first {span} iterations, which every probe of the "
            "round trained on the same minibatches (paired: common random numbers)"
            if span
            else f"mean of the last {self.settings.score_window} training losses"
        )

    def steady_state(self, current: Candidate, seg: Path) -> tuple[Candidate, ProbeResult] | None:
        """Probe :func:`steady_grid` (the incumbent, then μ ∈ ``tune.momenta`` × {η, η/10}
        where the rate may step down) from the segment's checkpoint; returns the winner and
        its probe (None: every probe diverged)."""
        grid = self._steady_grid(current)
        results = [
            self.chains.probe(dataclasses.replace(current, lr=lr, momentum=mu), str(seg))
            for lr, mu in grid
        ]
        span = pair_scores(results)
        self._warn_short_probes(results, "steady state")
        for r in results:
            self.log(
                "steady state",
                f"probe {r.candidate.label()}: "
                + ("NaN" if r.diverged else f"score {r.score:.4f}"),
                f"from {seg.name} after {self.rung_s:.4g} {self.clock.name} s; "
                + self._paired(span),
                score=None if r.diverged else r.score,
            )
        second = self._second_rung("steady state", results)
        best = pick_best(second, self.settings.tie_buffer) or pick_best(
            results, self.settings.tie_buffer
        )
        results = results + second
        if best is None:
            return None
        self._count_overhead(results, best)
        clock0, _ = self.chains.start_of(seg)
        self.log(
            "steady state",
            f"continue with {best.candidate.label()}",
            f"best steady-state score {best.score:.4f}; ties within "
            f"{100 * self.settings.tie_buffer:g}% prefer larger η, then μ"
            + (
                "; best μ is 0 with compute groups: Omnivore would try fewer groups, which "
                "cannot continue this run's protocol state, so they are not probed online"
                if best.candidate.momentum == 0 and current.g > 1
                else ""
            ),
            run_clock_s=clock0,
            measurements=self.chains.measurements(results),
        )
        return best.candidate, best

    # ---- the run ---------------------------------------------------------------------
    def _bar(self, what: str) -> None:
        if self.bar is not None:
            self.bar.n = round(self.elapsed())
            self.bar.set_postfix_str(what, refresh=True)

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Tune while training (module docstring); returns the run's summary."""
        self._t0 = time.perf_counter()
        clock = self.out / CLOCK_FILE
        if resume and clock.exists():  # the earlier sessions' wall, lost work included
            self._offset_s = float(json.loads(clock.read_text())["elapsed_s"])
        # every probe and segment; on dist one pool of ranks for all of them
        self.runner = ProbeRunner(self.simulated, code=self.code)
        self.timeline: list[tuple[Path, dict[str, Any]]] = []
        self._setup(resume)
        self.bar = (
            tqdm(desc="tune", unit="s", bar_format="{desc}: {n:.0f} s{postfix}")
            if self.progress
            else None
        )
        self.log = DecisionLog(
            self.out / "decisions.jsonl",
            echo=tqdm.write if self.progress else None,
            clock=self.elapsed,
        )
        self.chains = ProbeChains(
            self.cfg,
            self.out,
            self.runner,
            num_train=self.num_train,
            score_window=self.settings.score_window,
            rung_s=self.rung_s,
            elapsed=self.elapsed,
            catch_up=self._catch_up,
            bar=self._bar,
        )
        try:
            self._log_setup()
            best = self.cold_start()
            cand, start = best.candidate, Path(best.run_dir)
            rounds, every = 0, max(int(self.cfg.tune.check_epochs * self.num_train), 1)
            while True:
                # one launch until the rule is due at a check or the run ends; no
                # re-optimisation left (or none the rate may make): no checks, train to
                # the end at once
                more = rounds < self.steady_rounds
                if more and len(self._steady_grid(cand)) == 1:
                    self._no_round_left(cand)
                    more = False
                elif not more:
                    self.log(
                        "steady state",
                        f"train {cand.label()} to the end without checks",
                        f"the run re-optimised {rounds} times (tune.steady_rounds = "
                        f"{self.steady_rounds})"
                        if rounds
                        else "the budget is too small for steady-state rounds after the cold "
                        "start (the shortest probes were needed)"
                        if self.max_probes
                        else "tune.steady_rounds = 0: no steady-state re-optimisation",
                    )
                seg, ends = self._segment(cand, start, every if more else 0)
                for check in self._checks(seg):
                    self._log_check(check, rounds)
                if ends:
                    break
                start = seg
                rounds += 1
                won = self.steady_state(cand, seg)
                if won is not None:
                    cand, start = won[0], Path(won[1].run_dir)
        finally:
            self.runner.close()
            if self.bar is not None:
                self.bar.close()
            write_json(clock, {"elapsed_s": self.elapsed()})  # also when interrupted
        return self._finish(seg)

    def _finish(self, seg: Path) -> dict[str, Any]:
        """The run directory's records: the last segment's with the whole run's times."""
        total = self.elapsed()
        records = read_metrics(seg / "metrics.jsonl")
        for r in records:
            r.update(self._total_times(r, self.timeline))
        with open(self.out / "metrics.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        for name in _FINAL_FILES:
            if (seg / name).exists():
                shutil.copy2(seg / name, self.out / name)
        if (seg / "checkpoint.pt.sha256").exists():
            shutil.copy2(seg / "checkpoint.pt.sha256", self.out / "checkpoint.pt.sha256")
        s = run_summary(seg)
        chain = {
            "chain_time_to_target_s": s.get("time_to_target_s"),
            "chain_time_to_target_virtual_s": s.get("time_to_target_virtual_s"),
        }
        reached_at = next((r for r in records if r["samples"] == s.get("samples_to_target")), None)
        s.update(chain)
        s["tuned"] = True
        s["total_wall_s"] = total
        # all but the run's own training: every session's setup, every probe, and what an
        # interruption lost (in a run of one session: the setup and the probes)
        s["tuning_wall_s"] = max(total - self.segment_wall_s, 0.0)
        s["tuning_share"] = s["tuning_wall_s"] / total if total > 0 else None
        s["num_probes"] = self.chains.count
        s["time_to_target_s"] = reached_at["total_wall_s"] if reached_at else None
        if self.simulated:
            s["tuning_virtual_s"] = self.overhead_clock_s
            s["time_to_target_virtual_s"] = reached_at["total_virtual_s"] if reached_at else None
        write_json(self.out / "summary.json", s)
        return s

    def _total_times(
        self, record: dict[str, Any], timeline: list[tuple[Path, dict[str, Any]]]
    ) -> dict[str, float]:
        """``total_wall_s`` (and ``total_virtual_s`` on sim) of an evaluation record: the
        segment it belongs to (the first that reached its samples) gives the offset."""
        seg_saved = None
        for seg, saved in timeline:
            if run_summary(seg).get("samples", 0) >= record["samples"]:
                seg_saved = (seg, saved)
                break
        if seg_saved is None:
            seg_saved = timeline[-1]
        seg, saved = seg_saved
        start = Path(saved["start"])
        start_s = run_summary(start)
        wall0 = float(start_s.get("train_wall_s") or 0.0) + float(start_s.get("eval_wall_s") or 0.0)
        inside = float(record["wall_s"]) + float(record.get("eval_wall_s") or 0.0) - wall0
        out = {"total_wall_s": saved["begin_elapsed_s"] + max(inside, 0.0)}
        if self.simulated and record.get("virtual_s") is not None:
            out["total_virtual_s"] = float(record["virtual_s"]) + saved["overhead_clock_s"]
        return out


def train_tuned(
    config: RunConfig | None,
    out_dir: str | Path,
    *,
    progress: bool = False,
    resume: bool = False,
    code: UserCode | None = None,
) -> dict[str, Any]:
    """``distsgd train CONFIG --tune`` (:class:`OnlineTune`); returns the run's summary.

    ``resume``: continue the tuning run in ``out_dir`` (its base config is the one saved
    there; ``config`` is ignored then except for being None-safe); of a run that ended
    (its ``summary.json`` written), its summary unchanged.

    Raises:
        ConfigError: see :class:`OnlineTune`; no ``config`` without ``resume``; ``resume``
            of a directory that holds no run of ``--tune``.
    """
    if resume:
        if not is_tuning_run(out_dir):
            raise ConfigError(f"cannot resume: {out_dir} does not hold a run of --tune")
        done = Path(out_dir) / "summary.json"  # written when the run ended
        if done.exists():  # nothing to resume: its summary as it is (a resume would add
            return json.loads(done.read_text())  # its setup to the walls)
        config = RunConfig.from_toml(Path(out_dir) / STATE_FILE)
    elif config is None:
        raise ConfigError("distsgd train --tune needs a config (or resume=RUN_DIR)")
    with keep_loaded():  # a built-in data set is read once for the setup and sim's probes
        tune = OnlineTune(config, out_dir, progress=progress, code=code)  # checks the settings
        # one writer: the run directory is claimed for the whole tuning run, as a plain
        # run's (a concurrent --resume or second --tune into it is refused, naming this
        # process)
        claim = RunDirClaim.acquire(out_dir)
        try:
            return tune.run(resume=resume)
        finally:
            if claim is not None:
                claim.release()
