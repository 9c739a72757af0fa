"""``distsgd train CONFIG --tune``: Omnivore's optimizer inside the training run (Hadjis et
al., arXiv:1606.04487, §4; docs/tuning.md): a cold start of probes
(:class:`~distsgd.tuner.cold_start.ColdStart`), its winner continued as the run
(:class:`RunSegments`), steady-state rounds at due checks
(:class:`~distsgd.tuner.steady.SteadyState`), within the run's budget
(:class:`~distsgd.tuner.budget.RunBudget`). Every probe and segment is an ordinary run;
``--resume`` replays the procedure, reading back what completed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

from distsgd.config import ConfigError, ConfigWarning, RunConfig
from distsgd.control import RunObserver, RunOptions
from distsgd.data import keep_loaded
from distsgd.engine import UserCode
from distsgd.metrics import read_metrics, write_json
from distsgd.rundir import RunDirClaim
from distsgd.tuner.budget import RunBudget, run_time_budget
from distsgd.tuner.chains import ProbeChains, ProbeRounds, RunWall, continuing, steady_checks
from distsgd.tuner.cold_start import ColdStart
from distsgd.tuner.omnivore import Candidate, DecisionLog, ProbeResult
from distsgd.tuner.probes import (
    ProbeRunner,
    RunClock,
    candidate_config,
    check_tunable,
    run_summary,
    safe_name,
)
from distsgd.tuner.setup import cluster_model, fixed_base, tune_layout
from distsgd.tuner.steady import SteadyState

__all__ = [
    "OnlineTune",
    "train_tuned",
    "is_tuning_run",
    "check_online_tunable",
    "TUNED_PROTOCOLS",
]

STATE_FILE = "tune_config.toml"  # marks a tuning run directory; holds its base config
CLOCK_FILE = "tune_clock.json"  # the run's wall clock when a session of it ended
# the protocols of the families the search probes (candidate_config): a base config on
# another protocol would be replaced silently, so it is refused
TUNED_PROTOCOLS = ("hardsync", "compute_groups", "parameter_server", "sma")
# what a directory holds once any run wrote to it (--tune's, a plain run's, distsgd tune's)
_HELD = (STATE_FILE, "summary.json", "checkpoint.pt", "decisions.jsonl", "tune.json", "probes")


_FINAL_FILES = (
    "config.toml",
    "model.pt",
    "model.pt.sha256",
    "checkpoint.pt",
    "checkpoint.pt.sha256",
    "staleness.json",
)


class RunSegments:
    """The run of one ``--tune`` as segments: each continues a probe that won (or the
    segment before) in one launch until the target, the run's limits or a due
    steady-state check (``train/NN-<label>``).

    Args:
        cfg: the base config (device profile fixed).
        out: the run directory.
        runner: the tuner's runner of every run.
        wall: the run's wall clock and progress bar.
        progress: show the segments' own progress.

    Attributes:
        wall_s: wall seconds the segments trained (this session's and those read back).
        timeline: each segment's directory and its record (``online_segment.json``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        runner: ProbeRunner,
        *,
        wall: RunWall,
        progress: bool,
    ) -> None:
        self.cfg, self.out, self.runner = cfg, out, runner
        self.wall, self.elapsed, self.progress = wall, wall.elapsed, progress
        self.simulated = cfg.runtime == "sim"
        self.count = 0
        self.wall_s = 0.0
        self.timeline: list[tuple[Path, dict[str, Any]]] = []

    def train(
        self, cand: Candidate, start: Path, check_every: int, overhead_clock_s: float
    ) -> tuple[Path, bool]:
        """Continue ``start`` (a probe that won) as the run with ``cand``, in one launch,
        until the target, the run's limits or the first check where the steady-state rule
        is due (:attr:`RunOptions.steady_check_samples <distsgd.control.RunOptions>` =
        ``check_every``: a check at every multiple of it since the run's start; 0: none).
        ``overhead_clock_s``: the tuning's clock seconds so far (the segment's offset).
        Returns (its directory, whether the run ends here)."""
        self.count += 1
        seg = self.out / "train" / f"{self.count:02d}-{safe_name(cand.label())}"
        note = seg / "online_segment.json"
        cfg = candidate_config(self.cfg, cand)
        options = RunOptions(steady_check_samples=check_every, continues=True, record=True)

        def run() -> dict[str, Any]:
            continuing(start, seg)
            self.runner.run(cfg, seg, options, RunObserver(), resume=True, progress=self.progress)
            return {"overhead_clock_s": overhead_clock_s, "start": str(start)}

        saved = self.wall.once(note, f"train {cand.label()}", run)
        self.wall_s += saved["end_elapsed_s"] - saved["begin_elapsed_s"]
        self.timeline.append((seg, saved))
        return seg, run_summary(seg).get("stop_reason") != "steady_state"

    def finish(
        self, seg: Path, total: float, num_probes: int, overhead_clock_s: float
    ) -> dict[str, Any]:
        """Write the run directory's records (the last segment ``seg``'s with the whole
        run's times: ``total`` wall seconds, ``num_probes`` probes, ``overhead_clock_s``
        clock seconds of probes that did not continue) and return its summary."""
        records = read_metrics(seg / "metrics.jsonl")
        for r in records:
            r.update(self._total_times(r))
        with open(self.out / "metrics.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        for name in _FINAL_FILES:
            if (seg / name).exists():
                shutil.copy2(seg / name, self.out / name)
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
        s["tuning_wall_s"] = max(total - self.wall_s, 0.0)
        s["tuning_share"] = s["tuning_wall_s"] / total if total > 0 else None
        s["num_probes"] = num_probes
        s["time_to_target_s"] = reached_at["total_wall_s"] if reached_at else None
        if self.simulated:
            s["tuning_virtual_s"] = overhead_clock_s
            s["time_to_target_virtual_s"] = reached_at["total_virtual_s"] if reached_at else None
        write_json(self.out / "summary.json", s)
        return s

    def _total_times(self, record: dict[str, Any]) -> dict[str, float]:
        """``total_wall_s`` (and ``total_virtual_s`` on sim) of an evaluation record: the
        segment it belongs to (the first that reached its samples) gives the offset."""
        seg_saved = None
        for seg, saved in self.timeline:
            if run_summary(seg).get("samples", 0) >= record["samples"]:
                seg_saved = (seg, saved)
                break
        if seg_saved is None:
            seg_saved = self.timeline[-1]
        seg, saved = seg_saved
        start = Path(saved["start"])
        start_s = run_summary(start)
        wall0 = float(start_s.get("train_wall_s") or 0.0) + float(start_s.get("eval_wall_s") or 0.0)
        inside = float(record["wall_s"]) + float(record.get("eval_wall_s") or 0.0) - wall0
        out = {"total_wall_s": saved["begin_elapsed_s"] + max(inside, 0.0)}
        if self.simulated and record.get("virtual_s") is not None:
            out["total_virtual_s"] = float(record["virtual_s"]) + saved["overhead_clock_s"]
        return out


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


class OnlineTune:
    """One ``distsgd train --tune`` run (module docstring; docs/tuning.md: the rules and
    files).

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
        check_tunable(config)
        check_online_tunable(config)
        self.layout = tune_layout(config)
        self.config = config
        self.out = Path(out_dir)
        self.progress = progress
        self.code = code
        self.simulated = config.runtime == "sim"
        self.clock = RunClock.of(self.simulated)
        self.wall = RunWall()
        self.elapsed = self.wall.elapsed

    def _setup(self, resume: bool) -> None:
        """Refuse a directory that holds a run (or, to resume, none of ``--tune``); fix
        the device profile (every probe on the same simulated cluster), the initial
        weights' size and the training set's size; the budget; write the state file."""
        if resume and not is_tuning_run(self.out):
            raise ConfigError(f"cannot resume: {self.out} does not hold a run of --tune")
        held = [f for f in _HELD if (self.out / f).exists()]
        if not resume and held:
            raise ConfigError(
                f"output directory {str(self.out)!r} already holds a run ({held[0]}); choose "
                "another output directory (--out)"
                + (" or continue it with --resume" if is_tuning_run(self.out) else "")
            )
        # the device profile is measured (and cached) at the threads a probe trains with;
        # the batch is checked against the data before anything is measured or written
        base = fixed_base(
            self.config,
            self.layout.num_processes,
            self.code,
            lambda c, n: c.protocol.check_fits(n),
        )
        self.cfg, self.num_train = base.cfg, base.dataset.num_train
        self.cluster = cluster_model(self.cfg, base.engine.num_parameters)
        budget_s, source = run_time_budget(
            self.cfg, self.num_train, self.layout.num_learners, self.cluster
        )
        self.budget = RunBudget.of(self.cfg.tune, budget_s, source)
        self.settings = dataclasses.replace(self.cfg.tune, probe_seconds=self.budget.rung_s)
        self.out.mkdir(parents=True, exist_ok=True)
        if not resume:
            (self.out / STATE_FILE).write_text(self.config.to_toml())

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Tune while training (module docstring); returns the run's summary."""
        self.wall.t0 = time.perf_counter()
        clock = self.out / CLOCK_FILE
        if resume and clock.exists():  # the earlier sessions' wall, lost work included
            self.wall.offset_s = float(json.loads(clock.read_text())["elapsed_s"])
        # every probe and segment; on dist one pool of ranks for all of them
        runner = ProbeRunner(
            self.simulated, num_processes=self.layout.num_processes, code=self.code
        )
        self._setup(resume)
        if self.progress:
            self.wall.bar = tqdm(desc="tune", unit="s", bar_format="{desc}: {n:.0f} s{postfix}")
        echo = tqdm.write if self.progress else None
        self.log = DecisionLog(self.out / "decisions.jsonl", echo=echo, clock=self.elapsed)
        self.chains = ProbeChains(
            self.cfg,
            self.out,
            runner,
            num_train=self.num_train,
            score_window=self.settings.score_window,
            rung_s=self.budget.rung_s,
            wall=self.wall,
        )
        rounds = ProbeRounds(self.chains, self.log, self.settings, self.budget)
        segments = RunSegments(self.cfg, self.out, runner, wall=self.wall, progress=self.progress)
        try:
            self._log_setup()
            cold = ColdStart(
                rounds, self.layout, self.cfg.protocol.batch_size, self.cluster, self.num_train
            )
            best = cold.run()
            self.steady = SteadyState(rounds, cold.rate_ceilings, self.num_train)
            seg = self._train(best, segments, rounds)
        finally:
            runner.close()
            if self.wall.bar is not None:
                self.wall.bar.close()
            write_json(clock, {"elapsed_s": self.elapsed()})  # also when interrupted
        return segments.finish(seg, self.elapsed(), self.chains.count, rounds.overhead_clock_s)

    def _train(self, best: ProbeResult, segments: RunSegments, rounds: ProbeRounds) -> Path:
        """The cold start's winner ``best`` continued as the run: one segment until the
        steady-state rule is due at a check or the run ends, a steady-state round there,
        the round's winner the next segment; no round left (or none the rate may make):
        no checks, train to the end at once. Returns the last segment's directory."""
        cand, start = best.candidate, Path(best.run_dir)
        steady_rounds = self.budget.steady_rounds
        rounds_done, every = 0, max(int(self.cfg.tune.check_epochs * self.num_train), 1)
        while True:
            more = rounds_done < steady_rounds
            if more and len(self.steady.grid(cand)) == 1:
                self.steady.no_round_left(cand)
                more = False
            elif not more:
                self.log(
                    "steady state",
                    f"train {cand.label()} to the end without checks",
                    f"the run re-optimised {rounds_done} times (tune.steady_rounds = "
                    f"{steady_rounds})"
                    if rounds_done
                    else "the budget is too small for steady-state rounds after the cold "
                    "start (the shortest probes were needed)"
                    if self.budget.max_probes
                    else "tune.steady_rounds = 0: no steady-state re-optimisation",
                )
            seg, ends = segments.train(cand, start, every if more else 0, rounds.overhead_clock_s)
            for check in steady_checks(seg):
                self.steady.log_check(check, rounds_done)
            if ends:
                return seg
            start = seg
            rounds_done += 1
            won = self.steady.round(cand, seg)
            if won is not None:
                cand, start = won[0], Path(won[1].run_dir)

    def _log_setup(self) -> None:
        b, s = self.budget, self.cfg.tune
        halving = b.rung_s < b.probe_s
        self.log(
            "setup",
            (
                f"probes of {b.rung_s:.4g} {self.clock.name} seconds, the best "
                + ("" if s.promote == 1 else f"{s.promote} ")
                + "of the cold start's grid (and the next larger η than the best at g=1) "
                f"continued to {b.probe_s:.4g} s, the joint search's probes "
                f"{b.probe_s:.4g} s (one that leads, and the grid's winner, continue to "
                f"{2 * b.probe_s:.4g} s); "
                + (
                    "the best of a steady-state round continues as the run"
                    if s.steady_promote == 1
                    else f"the best {s.steady_promote} of a steady-state round "
                    f"continued to {b.probe_s:.4g} s"
                )
                if halving
                else f"probes of {b.probe_s:.4g} {self.clock.name} seconds each"
            ),
            f"probe length = {b.rule()}"
            + (
                f"; successive halving: a first rung of tune.first_rung = {s.first_rung:g} of it"
                if halving
                else ""
            ),
            run_clock_s=0.0,
        )
        if b.max_probes:
            line = b.too_small()
            # one line on screen: the warning's (the decision is in decisions.jsonl)
            self.log("setup", "budget too small: fewer probes", line, echo=False, run_clock_s=0.0)
            warnings.warn(line, ConfigWarning, stacklevel=3)


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
