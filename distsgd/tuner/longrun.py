"""``distsgd tune``'s phases after the search (Omnivore, Hadjis et al., arXiv:1606.04487, §4):
the long run of the chosen configuration, steady state from its snapshot, where to step η
(:mod:`~distsgd.tuner.step_search`) or a second long run, and the plan with its predicted
time to accuracy HE · SE (:mod:`~distsgd.tuner.plan`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from distsgd.tuner.omnivore import ProbeResult
from distsgd.tuner.plan import (
    PLAN_EVAL_EVERY,
    extrapolate_plan,
    plan_config,
    plan_switch,
    predict_plan,
)
from distsgd.tuner.step_search import choose_step, truncate_run, usable_step_points

if TYPE_CHECKING:
    from distsgd.tuner.session import TuneSession

__all__ = ["LongRuns"]

_LONG_RUN = "long_run"  # the snapshot of the first long run's final model
_SECOND_LONG_RUN = "long_run_2"  # the snapshot of the second long run's final model
_DEFAULT_MAX_EPOCHS = 10.0  # the plan's and the runs' limit when train.max_epochs is 0


class LongRuns:
    """The phases of a :class:`~distsgd.tuner.session.TuneSession` after its search, one
    method each, called in order: :meth:`long_run`, :meth:`steady_state`,
    :meth:`learning_rate_step`, :meth:`plan`; what they find goes into the session's
    :class:`~distsgd.tuner.session.TuneState`."""

    def __init__(self, session: TuneSession) -> None:
        self.tick = session.tick
        self.state, self.costs, self.prober = session.state, session.costs, session.prober
        self.log, self.clock, self.search = session.log, session.clock, session.search
        self.cfg, self.settings = session.cfg, session.settings
        self.fixed, self.out = session.fixed, session.out

    def _skip(self, phase: str, decision: str, more: str = "") -> None:
        """Log ``decision``: a run skipped, the budget left being less than a run of one
        probe's training plus its build and evaluations."""
        left = max(self.costs.left(), 0)
        self.log(
            phase,
            decision,
            f"{left:.1f} s of the budget left, less than a run of one probe's training plus "
            "its build and evaluations" + more,
        )

    def _max_epochs(self) -> float:
        """Epochs a plan (and a run from a long run's snapshot) may train in all."""
        return self.cfg.train.max_epochs or _DEFAULT_MAX_EPOCHS

    def _long_run_rate(self) -> float:
        """Training samples per wall second of the long run (the chosen probe's without
        training time)."""
        run = self.state.long_run
        assert run is not None
        r = run.result
        return r.samples / r.train_wall_s if r.train_wall_s > 0 else self.state.samples_per_s

    def long_run(self) -> None:
        """Omnivore's long run of the chosen configuration from the initial weights until
        the target accuracy or what the budget leaves it (after its evaluations and the
        later phases), keeping the model of every evaluation for the step search; skipped
        when that is less than one probe's training."""
        st, cfg = self.state, self.cfg
        chosen = st.chosen
        assert chosen is not None
        cand = chosen.candidate
        st.eval_every_samples = min(
            cfg.train.eval_every_samples or PLAN_EVAL_EVERY, PLAN_EVAL_EVERY
        )
        st.samples_per_s = (
            chosen.samples / chosen.train_wall_s if chosen.train_wall_s > 0 else math.nan
        )
        wall = self.costs.first_long_run_seconds(st.samples_per_s, st.eval_every_samples)
        if wall <= 0:
            self._skip(
                "long run",
                "skipped the long run",
                "; the plan is the cold start's choice without a predicted time to accuracy",
            )
            return
        self.log(
            "long run",
            f"train {cand.label()} from the initial weights",
            f"until {100 * cfg.train.target:g}% test accuracy or {wall:.1f} wall "
            f"seconds of training, evaluating every {st.eval_every_samples} samples (Omnivore's "
            "long run; it gives the steady-state snapshot and the loss curve for the SE fit; "
            "its length is what the budget leaves after its evaluations and the later phases)",
        )
        self.tick("long run", cand.label())
        run = self.prober.long_run(
            cand, wall, st.eval_every_samples, _LONG_RUN, save_eval_weights=True
        )
        self.tick("long run")
        summary = run.summary
        self.log(
            "long run",
            "reached the target" if run.reached else "stopped before the target",
            f"best accuracy {summary.get('best_metric', 0):.4f} after {run.epochs:.3f} "
            f"epochs, {summary.get(self.clock.run_seconds_key) or 0:.2f} {self.clock.name} s, "
            f"{summary.get('train_wall_s', 0):.1f} wall s of training",
        )
        st.long_run = run
        st.plan_runs = [run.result]

    def steady_state(self) -> None:
        """What the plan continues with after the long run. Reached the target: η/10 (the
        lower η of Omnivore's steady-state grid), tried from earlier snapshots. Stopped
        before it: Omnivore's steady state from the long run's snapshot within its share
        of the budget; a recommendation of another μ or layout becomes the better of η and
        η/10 at the plan's own (:func:`~distsgd.tuner.plan.plan_switch`)."""
        st, run = self.state, self.state.long_run
        if run is None:
            self.log("steady state", "skipped", "no long run; no snapshot")
            return
        if run.result.diverged:
            self.log("steady state", "skipped", "the long run diverged; no snapshot")
            return
        chosen = st.chosen_candidate
        if run.reached:
            st.long_run_s = float(run.summary.get(self.clock.time_to_target_key) or math.inf)
            st.tuner_measured_s = st.long_run_s
            st.switch = dataclasses.replace(chosen, lr=chosen.lr / 10)
            self.log(
                "steady state",
                f"skipped; try {st.switch.label()} from earlier snapshots",
                f"the long run reached the target after {st.long_run_s:.2f} {self.clock.name} s; "
                "a step to η/10 (the lower η of Omnivore's steady-state grid) at an earlier "
                "evaluation may reach it sooner",
            )
            return
        steady_end = self.costs.steady_end()
        self.search.out_of_budget = lambda: not self.costs.may_probe(steady_end)
        st.steady = self.search.steady_state(chosen, _LONG_RUN)
        st.switch = st.steady
        if dataclasses.replace(st.steady, lr=chosen.lr) != chosen:
            st.switch = plan_switch(self.search.results, chosen, _LONG_RUN, self.settings)
            self.log(
                "steady state",
                f"continue with {st.switch.label()}",
                f"steady state recommends {st.steady.label()}; a run config can change only η "
                "mid-run (a step of the schedule), so the family, layout and μ stay and η is "
                f"the better of η and η/10 at μ = {chosen.momentum:g} from the same snapshot",
            )

    def learning_rate_step(self) -> None:
        """With a lower η to continue with: where to step to it (the step search). With
        the same η and a long run that stopped before the target: a second long run from
        its snapshot until the target, which measures the time to accuracy."""
        st = self.state
        if st.switch is None:  # no usable long run
            return
        assert st.long_run is not None
        if st.switch.lr < st.chosen_candidate.lr:
            self._step_search()
        elif not st.long_run.reached:
            self._second_long_run()

    def _step_search(self) -> None:
        """Runs at the lower η from the long run's evaluations; the plan steps where the
        target came soonest (:func:`~distsgd.tuner.step_search.choose_step`)."""
        st, run = self.state, self.state.long_run
        assert run is not None
        points, pool = usable_step_points(
            run.result.evals,
            self.cfg.train.target,
            self.settings,
            self._max_epochs(),
            include_last=not run.reached,
            log=self.log,
        )
        choice = choose_step(
            points,
            st.long_run_s,
            self.clock,
            self._run_step,
            self.log,
            long_run_reached=run.reached,
            pool=pool,
            tie_buffer=self.settings.tie_buffer,
        )
        st.step_runs = choice.runs
        if choice.point is not None:
            assert choice.run is not None
            st.step_at = choice.point
            st.plan_runs = [truncate_run(run.result, int(choice.point["iterations"])), choice.run]
            st.tuner_measured_s = choice.seconds if math.isfinite(choice.seconds) else None

    def _run_step(
        self, point: dict[str, Any], horizon: float
    ) -> tuple[ProbeResult, dict[str, Any]] | None:
        """Train the lower η from ``point``'s snapshot until the target, ``horizon``
        seconds on the runtime's clock (inf: none) or what the budget leaves (the
        :data:`~distsgd.tuner.step_search.StepRunFn` of the step search); None when the
        budget leaves less than one probe's training."""
        st, run, switch = self.state, self.state.long_run, self.state.switch
        assert run is not None and switch is not None
        at = f"epoch {point['epoch']:.3f} (accuracy {point['eval_metric']:.4f})"
        wall = self.costs.second_long_run_seconds(self._long_run_rate(), st.eval_every_samples)
        if wall <= 0:
            self._skip("step", f"skip the step at {at}")
            return None
        name = f"eval{point['eval']}"
        self.prober.eval_snapshot(run.result, int(point["eval"]), name)
        limit = (
            f"within {horizon:.4g} {self.clock.name} s (to beat the soonest so far)"
            if math.isfinite(horizon)
            else f"within {wall:.1f} wall s of training"
        )
        self.log(
            "step",
            f"train {switch.label()} from the long run's {at}",
            f"until the target {limit}: the time to accuracy of a plan stepping η "
            f"{st.chosen_candidate.lr:g} → {switch.lr:g} there",
        )
        self.tick("step", f"epoch {point['epoch']:.2f}")
        step_run = self.prober.long_run(
            switch,
            wall,
            st.eval_every_samples,
            f"step-{name}",
            snapshot=name,
            max_epochs=self._max_epochs() - float(point["epoch"]),
            max_clock_s=horizon if math.isfinite(horizon) else 0.0,
        )
        self.tick("step")
        return step_run.result, step_run.summary

    def _second_long_run(self) -> None:
        """The plan keeps η: continue from the long run's snapshot until the target, the
        epochs left or what the budget leaves."""
        st, run, switch = self.state, self.state.long_run, self.state.switch
        assert run is not None and switch is not None
        wall = self.costs.second_long_run_seconds(self._long_run_rate(), st.eval_every_samples)
        epochs_left = max(self._max_epochs() - run.epochs, 0.01)
        if wall <= 0:
            self._skip(
                "long run", f"skipped the run of {switch.label()} from the long run's snapshot"
            )
            return
        self.log(
            "long run",
            f"train {switch.label()} from the long run's snapshot",
            f"until the target, {epochs_left:.2f} more epochs or {wall:.1f} wall seconds of "
            "training (steady state keeps η; it measures the time to accuracy)",
        )
        self.tick("long run 2", switch.label())
        second = self.prober.long_run(
            switch,
            wall,
            st.eval_every_samples,
            _SECOND_LONG_RUN,
            snapshot=_LONG_RUN,
            max_epochs=epochs_left,
        )
        self.tick("long run 2")
        st.plan_runs = [run.result, second.result]
        self.log(
            "long run",
            "reached the target" if second.reached else "stopped before the target",
            f"best accuracy {second.summary.get('best_metric', 0):.4f} after "
            f"{run.epochs:.3f} + {second.epochs:.3f} epochs",
        )
        if second.reached:
            first_s = run.summary.get(self.clock.run_seconds_key)
            st.tuner_measured_s = float(first_s or 0) + float(
                second.summary[self.clock.time_to_target_key]
            )

    def plan(self) -> None:
        """Write ``plan.toml`` (the chosen configuration, stepping η where the step search
        found the target soonest) and predict its time to accuracy HE · SE from the long
        runs; on the simulated runtime also on clusters of 1–8× the learners."""
        st, chosen = self.state, self.state.chosen_candidate
        step_epoch = float(st.step_at["epoch"]) if st.step_at is not None else 0.0
        steady = st.switch if st.step_at is not None else None
        st.plan = plan_config(self.cfg, chosen, steady, step_epoch, self.log)
        (self.out / "plan.toml").write_text(st.plan.to_toml(applicable_only=True))
        prediction = predict_plan(
            st.plan_runs, self.cfg.train.target, reached=st.tuner_measured_s is not None
        )
        prediction["tuner_measured_s"] = st.tuner_measured_s
        st.prediction = prediction
        if math.isfinite(prediction["predicted_s"]):
            self.log(
                "plan",
                f"plan {st.plan.name}: predicted time to accuracy "
                f"{prediction['predicted_s']:.2f} {self.clock.name} s",
                f"HE {prediction['seconds_per_iteration'] * 1e3:.3f} ms per iteration (measured "
                f"in the long runs) × SE {prediction['iterations_to_target']:.0f} iterations "
                f"(fitted loss curve reaching the target loss {prediction['target_loss']:.4f})",
            )
        else:
            self.log(
                "plan",
                f"plan {st.plan.name}: no prediction of the time to accuracy",
                prediction.get("reason", "too few training losses or evaluations to fit")
                + (
                    f"; the long run(s) reached the target in {st.tuner_measured_s:.4g} "
                    f"{self.clock.name} s (measured)"
                    if st.tuner_measured_s is not None
                    else ""
                ),
            )
        se = prediction["iterations_to_target"]
        if math.isfinite(se) and self.prober.simulated:  # larger simulated clusters
            st.extrapolation = extrapolate_plan(
                chosen, self.cfg.protocol.num_learners, se, self.fixed.cluster, st.noise_scale
            )
