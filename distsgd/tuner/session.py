"""One ``distsgd tune`` as a session of phases (docs/tuning.md): the set-up
(:mod:`~distsgd.tuner.setup`), Omnivore's cold start from the initial weights (Hadjis et
al., arXiv:1606.04487, §4; :class:`~distsgd.tuner.omnivore.OmnivoreSearch`), the joint
search beyond Omnivore, then :class:`~distsgd.tuner.longrun.LongRuns` (long run, steady
state, learning-rate step, plan) and the report. Every decision goes to
``decisions.jsonl`` with its reason; what a phase finds goes into :class:`TuneState`.

Budget B = ``tune.budget_s``: every phase decision is a method of
:class:`~distsgd.tuner.budget.TuneBudget`. ``sim``: probes are equal in simulated time and
every time is simulated seconds; ``dist``: probes are wall seconds of training on N
processes (:func:`~distsgd.tuner.setup.tune_layout`) and HE is measured in wall seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from distsgd.config import ConfigError, OfflineTuneSettings, RunConfig
from distsgd.rundir import check_out_path, enclosing_tuner_dir
from distsgd.tuner import omnivore as om
from distsgd.tuner import perf_model as pm
from distsgd.tuner.omnivore import Candidate, DecisionLog, OmnivoreSearch, ProbeResult
from distsgd.tuner.plan import PLAN_EVAL_EVERY
from distsgd.tuner.probes import LongRun, Prober, check_tunable
from distsgd.tuner.report import clean_state, tune_json, write_report, write_tune_json
from distsgd.tuner.setup import TuneSetup, fix_setup, log_setup

__all__ = ["TuneSession", "TuneState"]

_RUN_FILES = ("summary.json", "checkpoint.pt")  # what a training run leaves


@dataclasses.dataclass
class TuneState:
    """What the phases found, in the order they find it.

    Attributes:
        chosen: the best probe of the cold start, then of the joint search.
        noise_scale: B_noise of the batch-size law, samples (``tune.noise_scale``, or the
            cold start's samples per iteration).
        ranked: the joint search's unprobed candidates by predicted time to accuracy
            (seconds, candidate), soonest first.
        eval_every_samples: the long runs' evaluation interval, samples.
        samples_per_s: the chosen probe's training throughput, samples per wall second.
        long_run: the first long run (None: skipped for lack of budget).
        long_run_s: its time to accuracy on the runtime's clock (inf: not reached).
        steady: steady state's recommendation (None: steady state did not search).
        switch: the configuration the plan continues with after the long run (η/10 when
            the long run reached the target; None without a usable long run).
        step_at: the long run's evaluation record the plan steps η at (None: no step).
        step_runs: the runs at the lower η tried (:attr:`StepChoice.runs`).
        plan_runs: the runs the prediction fits, in order (the long run, up to the step,
            then the run from there or the second long run).
        tuner_measured_s: the time to accuracy of the plan's chain as the tuner measured
            it, on the runtime's clock (None: not seen reaching the target).
        plan: the plan's run config.
        prediction: :func:`~distsgd.tuner.plan.predict_plan` with ``tuner_measured_s``.
        extrapolation: :func:`~distsgd.tuner.plan.extrapolate_plan` (sim only).
    """

    chosen: ProbeResult | None = None
    noise_scale: float = math.nan
    ranked: list[tuple[float, Candidate]] = dataclasses.field(default_factory=list)
    eval_every_samples: int = PLAN_EVAL_EVERY
    samples_per_s: float = math.nan
    long_run: LongRun | None = None
    long_run_s: float = math.inf
    steady: Candidate | None = None
    switch: Candidate | None = None
    step_at: dict[str, Any] | None = None
    step_runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    plan_runs: list[ProbeResult] = dataclasses.field(default_factory=list)
    tuner_measured_s: float | None = None
    plan: RunConfig | None = None
    prediction: dict[str, Any] = dataclasses.field(default_factory=dict)
    extrapolation: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def chosen_candidate(self) -> Candidate:
        """The chosen configuration (after the cold start)."""
        assert self.chosen is not None, "the cold start comes first"
        return self.chosen.candidate


class TuneSession:
    """One tune: the setup's fixed measurements, the machinery every phase shares (decision
    log, progress bar, prober, Omnivore's search) and :class:`TuneState`; one method per
    phase, called in order by :func:`distsgd.tuner.tune.tune`.

    Args:
        fixed: what the setup measured (:meth:`setup` makes it; its ``out`` exists).
        progress: show a progress bar over the budget and one line per decision.

    Create it with :meth:`setup`. Example (the whole tune)::

        session = TuneSession.setup(config, "runs/tune", budget_s=600)
        # then, in order: cold_start, joint_search, LongRuns(session)'s phases;
        # report() returns what tune.json holds;
        # session.prober.close() ends the ranks of a dist tune (distsgd.tuner.tune.tune)
    """

    def __init__(self, fixed: TuneSetup, progress: bool = True) -> None:
        self.fixed = fixed
        self.cfg = fixed.cfg
        self.settings: OfflineTuneSettings = fixed.cfg.tune
        self.costs = fixed.costs
        self.out = fixed.out
        self.bar = tqdm(
            total=round(self.settings.budget_s),
            unit="s",
            desc="tune",
            disable=not progress,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s budget {postfix}",
        )
        self.log = DecisionLog(self.out / "decisions.jsonl", echo=tqdm.write if progress else None)
        self.prober = Prober(
            self.cfg,
            self.out,
            self.settings.probe_seconds,
            self.settings.score_window,
            fixed.initial,
            keep_ranks=True,  # dist: one pool of ranks for every probe and long run
            num_processes=fixed.layout.num_processes,
        )
        self.clock = self.prober.clock
        self.search = OmnivoreSearch(
            self._probe,
            self.settings,
            fixed.layout.num_learners,
            self.cfg.protocol.batch_size,
            self.log,
            ps_learners=fixed.layout.ps_learners,
            out_of_budget=lambda: self.costs.search_spent(len(self.search.results)) is not None,
        )
        self.state = TuneState()

    # ---- shared machinery ----------------------------------------------------------------
    def tick(self, phase: str, extra: str = "") -> None:
        """Move the progress bar to the elapsed seconds and name what runs now."""
        self.bar.n = min(round(self.costs.elapsed()), self.bar.total)
        self.bar.set_postfix_str(f"{phase} {extra}".strip(), refresh=True)

    def _probe(self, cand: Candidate, snapshot: str) -> ProbeResult:
        """One equal-time probe, its wall cost recorded in the budget."""
        self.tick("probe", cand.label())
        r = self.prober(cand, snapshot)
        self.costs.record_probe(r.wall_s, r.train_wall_s)
        for note in r.notes:
            self.log("probe", f"note on {cand.label()}", note)
        self.tick("probe", cand.label())
        return r

    # ---- 1. setup ------------------------------------------------------------------------
    @classmethod
    def setup(
        cls,
        config: RunConfig,
        out_dir: str | Path,
        *,
        budget_s: float | None = None,
        progress: bool = True,
        check: Callable[[TuneSetup], None] | None = None,
    ) -> TuneSession:
        """Check the settings, fix the device profile (and on ``dist`` the network), time a
        run's build and one evaluation, then create ``out_dir`` and log the setup.

        Args:
            config: the base config (see :func:`distsgd.tuner.tune.tune`).
            out_dir: the tune directory (created; must not hold a tune already).
            budget_s: overrides ``tune.budget_s`` (wall seconds).
            progress: show a progress bar over the budget and one line per decision.
            check: called with the setup's measurements before anything is written or
                shown (the progress bar opens after it); may raise ConfigError.

        Raises:
            ConfigError: what the tuner cannot tune
                (:func:`~distsgd.tuner.probes.check_tunable`), an
                ``out_dir`` that is a file or holds a tune, the layout errors of
                :func:`tune_layout`, a budget below the setup and one probe (nothing is
                written then).
        """
        check_tunable(config)
        if budget_s is not None:
            config = config.replace(tune=dataclasses.replace(config.tune, budget_s=budget_s))
        out = Path(out_dir)
        check_out_path(out)  # a path the OS takes, not a file, writable
        # a tune must not write over a tune, nor beside a run's checkpoint
        held = {"a tune": ("plan.toml", "decisions.jsonl"), "a training run": _RUN_FILES}
        for what, files in held.items():
            if any((out / f).exists() for f in files):
                raise ConfigError(
                    f"output directory {str(out)!r} already holds {what}; choose another --out"
                )
        inside = enclosing_tuner_dir(out)
        if inside is not None:  # nor into another tuner's probes/
            raise ConfigError(
                f"--out {str(out)!r} is not allowed: it is inside the tuner's directory "
                f"{str(inside)!r} (its probes and segments); choose another --out"
            )
        fixed = fix_setup(config, out)
        if check is not None:
            check(fixed)
        out.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no directory
        session = cls(fixed, progress)
        log_setup(session.log, fixed, session.clock.name)
        return session

    # ---- 2. cold start -------------------------------------------------------------------
    def cold_start(self) -> None:
        """Omnivore's cold start from the initial weights; its best probe is chosen.

        Raises:
            ConfigError: every cold-start probe diverged or none ran.
        """
        best = self.search.cold_start("initial")
        if best is None:
            raise ConfigError(
                "tune.lrs = "
                f"{self.settings.lrs!r} is not allowed: every cold-start probe diverged or none "
                "ran; expected smaller learning rates or a larger budget"
            )
        self.state.chosen = best

    # ---- 3. joint search -----------------------------------------------------------------
    def joint_search(self) -> None:
        """Beyond Omnivore: rank the unprobed families, layouts and batch sizes by predicted
        time to accuracy (HE from the cluster model, scaled by measured / predicted on real
        processes, × SE carried with the batch-size law), probe the best
        ``tune.extra_probes`` and choose one that beats the cold start's score by more than
        the tie buffer."""
        s, st, cluster = self.settings, self.state, self.fixed.cluster
        chosen = st.chosen
        assert chosen is not None
        ref = chosen.candidate
        st.noise_scale = s.noise_scale or float(pm.samples_per_iteration(ref.layout()))
        if s.extra_probes <= 0:
            return
        st.ranked = om.rank_joint(
            self.search,
            ref,
            s,
            cluster,
            st.noise_scale,
            self.fixed.num_train,
            self.log,
            measured_he=not self.prober.simulated,
        )
        ref_time = pm.seconds_per_iteration(ref.layout(), cluster)
        self.log(
            "joint",
            f"ranked {len(st.ranked)} unprobed configurations by predicted time to accuracy",
            f"HE from the cluster model × SE carried from {ref.shape()} with the batch-size "
            f"law, B_noise = {st.noise_scale:g} samples"
            + (" (tune.noise_scale)" if s.noise_scale else " (= its samples per iteration)"),
            ranking=[
                {"label": c.label(), "relative_time": t / ref_time} for t, c in st.ranked[:10]
            ],
        )
        probe = functools.partial(self._joint_probe, ref, ref_time)
        n = s.extra_probes
        extra = om.probe_joint(st.ranked, n, self.search, chosen, self.log, probe, self.costs)
        better = om.pick_best(extra, s.tie_buffer)
        if better is not None and better.score < chosen.score * (1 - s.tie_buffer):
            self.log(
                "joint",
                f"choose {better.candidate.label()}",
                f"its score {better.score:.4f} beats {chosen.score:.4f} by more than "
                f"{100 * s.tie_buffer:g}%",
            )
            st.chosen = better
        else:
            self.log(
                "joint",
                f"keep {chosen.candidate.label()}",
                "no configuration of the joint search beat its equal-time score by more than "
                f"{100 * s.tie_buffer:g}%",
            )

    def _joint_probe(
        self, ref: Candidate, ref_time: float, t_pred: float, cand: Candidate
    ) -> tuple[ProbeResult, str, str]:
        """One joint probe from the initial weights (:data:`~distsgd.tuner.omnivore.
        JointProbeFn` with the reference ``ref`` and its HE ``ref_time`` bound)."""
        self.log(
            "joint",
            f"probe {cand.label()}",
            f"predicted {t_pred / ref_time:.2f}× the time of {ref.shape()}",
        )
        r = self._probe(cand, "initial")
        return r, r.snapshot, ""

    # ---- 8. report -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Close the progress bar, write ``tune.json`` (NaN/inf as null) and ``report.md``
        with its figures; returns what ``tune.json`` holds."""
        self.bar.n = min(round(self.costs.elapsed()), self.bar.total)
        self.bar.close()
        saved = clean_state(tune_json(self))
        write_tune_json(self.out, saved)
        write_report(self.out, saved)
        return saved
