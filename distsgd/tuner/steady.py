"""``distsgd train --tune``'s steady state (Omnivore, Hadjis et al., arXiv:1606.04487, §4): the
run checks every ``tune.check_epochs`` whether its training loss has flattened
(:func:`~distsgd.plateau.steady_state_due`); at a due check it probes :func:`steady_grid`
from the segment's checkpoint, scores the round by
:func:`~distsgd.tuner.omnivore.pair_scores` and continues with the best."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from distsgd.plateau import FLAT_GAIN
from distsgd.tuner import perf_model as pm
from distsgd.tuner.chains import ProbeRounds
from distsgd.tuner.omnivore import Candidate, ProbeResult, pair_scores, pick_best

__all__ = ["SteadyState", "steady_grid", "effective_rate"]


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


class SteadyState:
    """The steady-state rounds of one ``--tune`` run.

    Args:
        rounds: the run's probe rounds (chains, log, settings, budget).
        rate_ceilings: per layout, the highest effective rate the cold start probed
            without diverging (:attr:`ColdStart.rate_ceilings
            <distsgd.tuner.cold_start.ColdStart>`).
        num_train: training samples (a check's span in epochs).
    """

    def __init__(
        self, rounds: ProbeRounds, rate_ceilings: dict[pm.Layout, float], num_train: int
    ) -> None:
        self.rounds, self.chains, self.log = rounds, rounds.chains, rounds.log
        self.settings, self.budget = rounds.settings, rounds.budget
        self.rate_ceilings, self.num_train = rate_ceilings, num_train

    def rate_ceiling(self, current: Candidate) -> float:
        """The highest effective rate η/(1 − μ) the cold start probed without diverging in
        ``current``'s layout (family, λ, b, g; at least ``current``'s own): rates at
        another batch do not compare (SGD's noise scale is η/(1 − μ) over the batch, Smith
        et al., ICLR 2018, and the linear scaling that relates them is a rule of thumb)."""
        own = effective_rate(current.lr, current.momentum)
        return max(own, self.rate_ceilings.get(current.layout(), own))

    def grid(self, current: Candidate) -> list[tuple[float, float]]:
        # hardsync only: compute groups add asynchrony's implicit momentum (docs/protocols.md §3),
        # so one explicit η / (1 − μ) is not one rate there
        return steady_grid(
            current.lr,
            current.momentum,
            self.settings.momenta,
            self.rate_ceiling(current),
            one_per_rate=current.family == "hardsync",
        )

    def no_round_left(self, current: Candidate) -> None:
        """The decision when steady state has nothing to probe for ``current``: no step
        down from its rate (:func:`steady_grid`) and no higher rate in the grid."""
        self.log(
            "steady state",
            f"train {current.label()} to the end without checks",
            f"its effective rate η/(1 − μ) = {effective_rate(current.lr, current.momentum):.4g}"
            f" is a decade or more below the highest the cold start probed without "
            f"diverging ({self.rate_ceiling(current):.4g} at its batch): a steady-state "
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

    def round(self, current: Candidate, seg: Path) -> tuple[Candidate, ProbeResult] | None:
        """Probe :func:`steady_grid` (the incumbent, then μ ∈ ``tune.momenta`` × {η, η/10}
        where the rate may step down) from the segment's checkpoint; returns the winner and
        its probe (None: every probe diverged)."""
        grid = self.grid(current)
        results = [
            self.chains.probe(dataclasses.replace(current, lr=lr, momentum=mu), str(seg))
            for lr, mu in grid
        ]
        span = pair_scores(results)
        self.rounds.warn_short_probes(results, "steady state")
        for r in results:
            self.log(
                "steady state",
                f"probe {r.candidate.label()}: "
                + ("NaN" if r.diverged else f"score {r.score:.4f}"),
                f"from {seg.name} after {self.budget.rung_s:.4g} {self.chains.clock.name} s; "
                + self._paired(span),
                score=None if r.diverged else r.score,
            )
        second = self.rounds.second_rung("steady state", results)
        best = pick_best(second, self.settings.tie_buffer) or pick_best(
            results, self.settings.tie_buffer
        )
        results = results + second
        if best is None:
            return None
        self.rounds.count_overhead(results, best)
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

    def log_check(self, check: dict[str, Any], rounds: int) -> None:
        """One decision per check of the rule, as made at its decision point inside the
        segment: ``run_clock_s`` the run's clock there, its two evaluations; the line is
        written when the segment returns (its ``t_wall_s``)."""
        due = bool(check["due"])
        span = f"{self.settings.check_epochs:g} epoch"
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
            "re-optimise" if due and rounds < self.budget.steady_rounds else "keep training",
            why
            + (
                f"; the run re-optimised {rounds} times already (tune.steady_rounds = "
                f"{self.settings.steady_rounds})"
                if due and rounds >= self.budget.steady_rounds
                else ""
            ),
            run_clock_s=float(check.get(self.chains.clock.run_seconds_key) or 0.0),
            measurements=[
                {k: r.get(k) for k in ("samples", "train_loss", self.chains.clock.eval_key)}
                for r in check["used"]
            ],
        )
