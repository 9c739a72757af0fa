"""``distsgd train --tune``'s cold start: Omnivore's grid (Hadjis et al., arXiv:1606.04487, §4;
:class:`~distsgd.tuner.omnivore.OmnivoreSearch`) by successive halving, then the joint
search's best ``tune.extra_probes``, a leader confirmed at twice the probe length."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from distsgd.config import ConfigError
from distsgd.tuner import omnivore as om
from distsgd.tuner import perf_model as pm
from distsgd.tuner.chains import ProbeRounds
from distsgd.tuner.omnivore import Candidate, OmnivoreSearch, ProbeResult
from distsgd.tuner.setup import RunLayout
from distsgd.tuner.steady import effective_rate

__all__ = ["ColdStart"]


class ColdStart:
    """The cold start of one ``--tune`` run.

    Args:
        rounds: the run's probe rounds (chains, log, settings, budget).
        layout: the processes and learners the candidates run on.
        batch_size: b of the grid.
        cluster: the cluster's timing model (the joint search's HE).
        num_train: training samples.

    Attributes (after :meth:`run`):
        rate_ceilings: per layout (family, λ, b, g), the highest effective rate η/(1 − μ)
            probed without diverging.
    """

    def __init__(
        self,
        rounds: ProbeRounds,
        layout: RunLayout,
        batch_size: int,
        cluster: pm.ClusterModel,
        num_train: int,
    ) -> None:
        self.rounds, self.chains, self.log = rounds, rounds.chains, rounds.log
        self.settings, self.budget = rounds.settings, rounds.budget
        self.layout, self.batch_size = layout, batch_size
        self.cluster, self.num_train = cluster, num_train
        self.rate_ceilings: dict[pm.Layout, float] = {}

    def run(self) -> ProbeResult:
        """Omnivore's grid by successive halving (first rungs, then the promoted and the
        next larger η than the best at g = 1), then the joint search's best
        ``tune.extra_probes`` to the full probe length (from the grid winner's first rung
        where :meth:`_branch_point` allows, else from the initial model), each against the
        grid's winner at equal time: a joint probe wins only by more than
        ``tune.tie_buffer``, and with halving only if it still does at twice the length
        (:meth:`_confirm`). Returns the probe that continues as the run.

        The joint probes are left out of the halving: from the initial model a smaller
        batch leads a short first rung (more updates in the same time) and loses at the
        full length.

        Raises:
            ConfigError: every probe of the grid diverged.
        """
        s, tie = self.settings, self.settings.tie_buffer
        search = OmnivoreSearch(
            self.chains.probe,
            s,
            self.layout.num_learners,
            self.batch_size,
            self.log,
            ps_learners=self.layout.ps_learners,
            out_of_budget=lambda: self.budget.search_spent(self.chains.count) is not None,
            stop_descending=True,
        )
        best = search.cold_start("initial")
        if best is None:
            raise ConfigError(
                f"tune.lrs = {s.lrs!r} is not allowed: every cold-start probe "
                "diverged; expected smaller learning rates (in a new --out: this run "
                "directory holds only the diverged probes)"
            )
        self.rounds.warn_short_probes(search.results)
        g1 = search.best_by_g.get(1)
        larger = om.next_larger_lr(search.results, g1) if g1 is not None else None
        second = self.rounds.second_rung("cold start", search.results, larger)
        for g in {r.candidate.g for r in second}:  # the joint search builds on these
            search.best_by_g[g] = (
                om.pick_best([r for r in second if r.candidate.g == g], tie) or search.best_by_g[g]
            )
        best = om.pick_best(second, tie) or best
        extra = self._joint(search, best)
        better = om.pick_best(extra, tie)
        third: list[ProbeResult] = []
        if better is not None and better.score < best.score * (1 - tie):
            if second and not self.budget.max_probes:  # halving: confirm at twice the length
                third = self._confirm(best, better)
                joint, grid = third
                best = joint if joint.score < grid.score * (1 - tie) else grid
            else:
                best = better
        results = search.results + second + third
        self.rounds.count_overhead(results, best)
        # per layout: a rate at another batch is not one at this batch
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
            + f" (ties within {100 * tie:g}% prefer larger η, then μ; "
            "a joint probe wins only by more than that); its probe's whole state "
            "continues, so its samples count towards the run",
            run_clock_s=0.0,
            measurements=self.chains.measurements(results),
        )
        return best

    def _confirm(self, grid: ProbeResult, joint: ProbeResult) -> list[ProbeResult]:
        """A joint probe that beat the grid's winner at the full probe length: both
        continue from their own checkpoints to twice that length (``probes/NNN-cold3-…``),
        scored over their chains' last losses; returns (the joint's, the grid's). From the
        initial model a smaller batch leads short probes (more updates in the same time)
        and the run then pays its lower samples per second."""
        probe_s = self.budget.probe_s
        until = 2 * probe_s
        out = []
        for r in (joint, grid):
            cont = self.chains.continue_from(r, until, "cold3")
            out.append(cont)
            self.log(
                "cold start",
                f"continue {r.candidate.label()} to {until:.4g} s: "
                + ("NaN" if cont.diverged else f"score {cont.score:.4f}"),
                f"confirmation: the joint probe led at {probe_s:.4g} "
                f"{self.chains.clock.name} s ({joint.score:.4f} against {grid.score:.4f}); "
                "short probes favour a smaller batch, so it and the grid's winner continue "
                "to twice that length from their own checkpoints",
                score=None if cont.diverged else cont.score,
            )
        return out

    def _joint(self, search: OmnivoreSearch, best: ProbeResult) -> list[ProbeResult]:
        """Probe the joint search's best-predicted ``tune.extra_probes`` to the full probe
        length (B_noise = ``tune.noise_scale``, else λb of ``best``)."""
        s = self.settings
        if s.extra_probes <= 0:
            return []
        ref = best.candidate
        noise = s.noise_scale or float(ref.layout().num_learners * ref.batch_size)
        measured_he = not self.chains.simulated
        ranked = om.rank_joint(
            search, ref, s, self.cluster, noise, self.num_train, self.log, measured_he
        )
        probe = functools.partial(self._probe, best)
        return om.probe_joint(ranked, s.extra_probes, search, best, self.log, probe, self.budget)

    def _probe(self, best: ProbeResult, _: float, cand: Candidate) -> tuple[ProbeResult, str, str]:
        """One joint probe (:data:`~distsgd.tuner.omnivore.JointProbeFn` with ``best``
        bound): from the grid winner's first rung to the same clock as its chain, else
        from the initial model."""
        root = self._branch_point(best, cand)
        if root is None:
            return self.chains.probe(cand, "initial", self.budget.probe_s), "initial", ""
        note = (
            f", from {Path(root.run_dir).name} after its {self.budget.rung_s:.4g} "
            f"{self.chains.clock.name} s (its batch changed there)"
        )
        r = self.chains.continue_from(root, self.budget.probe_s, "joint", cand)
        return r, f"probes/{Path(root.run_dir).name}", note

    def _branch_point(self, best: ProbeResult, cand: Candidate) -> ProbeResult | None:
        """The first rung a joint probe of ``cand`` continues from: the grid winner's
        (``best``, a second rung of successive halving), where ``cand`` is hardsync and
        differs from it only in the batch and η (a batch change continues a hardsync
        state). None: ``cand`` starts from the initial model. From a common snapshot the
        two compare at the same clock, and the first rung's seconds are not trained
        again."""
        if best.run_dir not in self.chains.first_rung:
            return None  # no halving: best is a full-length first rung
        root = self.chains.chain(best)[-1]
        ref = root.candidate
        same = dataclasses.replace(cand, batch_size=ref.batch_size, lr=ref.lr) == ref
        if not same or ref.family != "hardsync" or root.snapshot != "initial" or root.diverged:
            return None
        return root
