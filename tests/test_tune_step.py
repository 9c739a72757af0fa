"""Where the plan steps its learning rate: the step points of a long run, the choice of
the soonest step from runs off its snapshots (fake runs, deterministic), and the
snapshots a long run keeps at every evaluation."""

import json
import math
from pathlib import Path

import pytest
import torch

from distsgd.control import RunOptions
from distsgd.trainer import Trainer
from distsgd.tuner.omnivore import Candidate, DecisionLog, ProbeResult
from distsgd.tuner.probes import RunClock
from distsgd.tuner.step_search import (
    choose_step,
    step_points,
    step_pool,
    truncate_run,
    usable_step_points,
)

from .conftest import small_config

ACCS = [0.80, 0.86, 0.87, 0.88, 0.885, 0.89, 0.895, 0.91, 0.92]


def evals(accs=ACCS):
    """Evaluation records every 5000 samples; clock 2 s per evaluation interval."""
    recs = [{"eval": 0, "samples": 0, "epoch": 0.0, "iterations": 0, "eval_metric": 0.1}]
    for i, a in enumerate(accs, 1):
        recs.append(
            {
                "eval": i,
                "samples": 5000 * i,
                "epoch": 5000 * i / 60000,
                "iterations": 40 * i,
                "virtual_s": 2.0 * i,
                "eval_metric": a,
            }
        )
    return recs


def test_step_points_qualify_before_the_target_and_spread_latest_first():
    ev = evals()
    # qualifying: accuracy >= 0.87 and before eval 8 (the first >= 0.9): evals 3..7
    assert [e["eval"] for e in step_points(ev, 0.9, 0.03, 10)] == [7, 6, 5, 4, 3]
    assert [e["eval"] for e in step_points(ev, 0.9, 0.03, 3)] == [7, 5, 3]
    assert [e["eval"] for e in step_points(ev, 0.9, 0.011, 10)] == [7, 6]
    assert step_points(ev, 0.9, 0.03, 0) == []
    # a long run that stopped before the target: its last evaluation is always a point
    short = ev[:5]  # evals 0..4, last accuracy 0.88
    assert [e["eval"] for e in step_points(short, 0.9, 0.03, 3, include_last=True)] == [4, 3]
    assert [e["eval"] for e in step_points(short, 0.9, 0.001, 3, include_last=True)] == [4]
    assert [e["eval"] for e in step_points(ev[:8], 0.9, 0.03, 3, include_last=True)] == [7, 6, 3]
    assert [e["eval"] for e in step_points(short, 0.9, 0.03, 0, include_last=True)] == [4]
    # one point: the last qualifying evaluation, the one nearest the target
    assert [e["eval"] for e in step_points(ev, 0.9, 0.03, 1)] == [7]


class FakeStepRuns:
    """A run from evaluation e reaches the target ``reach[e]`` clock seconds after its
    start (None: never); it is cut at the horizon like the real one."""

    def __init__(self, reach, budget_runs=99):
        self.reach, self.budget_runs = reach, budget_runs
        self.calls = []

    def __call__(self, point, horizon):
        if len(self.calls) >= self.budget_runs:
            return None
        self.calls.append((point["eval"], horizon))
        t = self.reach.get(point["eval"])
        reached = t is not None and t <= horizon
        run = ProbeResult(Candidate("hardsync", 2, 16, 0.01, 0.9), f"eval{point['eval']}")
        run.run_dir = f"run{point['eval']}"
        summary = {"reached": reached, "best_metric": 0.9 if reached else 0.89}
        summary["time_to_target_virtual_s"] = t if reached else None
        return run, summary


def choose(points, long_run_s, runs, reached=True, pool=None):
    return choose_step(
        points,
        long_run_s,
        RunClock.of(simulated=True),
        runs,
        DecisionLog(),
        long_run_reached=reached,
        pool=pool,
    )


def test_choose_step_takes_the_soonest_and_cuts_runs_that_cannot_beat_it():
    ev = evals()
    points = step_points(ev, 0.9, 0.03, 3)  # evals 7, 5, 3 at 14, 10, 6 s
    # the long run reached at 16 s (eval 8); a step at eval 7 reaches 1 s later (15 s),
    # at eval 5 after 3 s (13 s), at eval 3 never
    runs = FakeStepRuns({7: 1.0, 5: 3.0, 3: None})
    c = choose(points, 16.0, runs)
    assert c.point["eval"] == 5 and c.seconds == 13.0 and c.run.run_dir == "run5"
    # horizons: what is left to beat the soonest so far
    assert runs.calls == [(7, 2.0), (5, 5.0), (3, 7.0)]
    assert [r["time_to_target_s"] for r in c.runs] == [15.0, 13.0, None]
    # no step beats the long run: no step
    c = choose(points, 16.0, FakeStepRuns({7: 5.0, 5: 9.0, 3: None}))
    assert c.point is None and c.seconds == 16.0 and c.run is None
    # a point at or after the soonest time is skipped without a run
    runs = FakeStepRuns({7: 1.0, 5: 3.0})
    c = choose(points, 13.0, runs)
    assert [e for e, _ in runs.calls] == [5, 3] and c.point is None
    # the budget ends the search; the best so far stands
    c = choose(points, 16.0, FakeStepRuns({7: 1.0, 5: 3.0}, budget_runs=1))
    assert c.point["eval"] == 7 and c.seconds == 15.0


def test_no_step_unless_a_run_was_seen_reaching_the_target():
    ev = evals()[:6]  # stopped at eval 5 (0.885) before the target
    points = step_points(ev, 0.9, 0.03, 3, include_last=True)
    assert [p["eval"] for p in points] == [5, 4, 3]
    runs = FakeStepRuns({})
    c = choose(points, math.inf, runs, reached=False)
    assert c.point is None and c.run is None and c.seconds == math.inf
    assert len(c.runs) == 3 and not any(r["reached"] for r in c.runs)
    assert all(h == math.inf for _, h in runs.calls)  # nothing to beat yet: no cut
    # the end's run reaches at 10 + 4 = 14 s; eval 3 (6 s) gets 8 s and does it in 5
    c = choose(points, math.inf, FakeStepRuns({5: 4.0, 4: None, 3: 5.0}), reached=False)
    assert c.point["eval"] == 3 and c.seconds == 11.0


def test_a_step_must_beat_the_soonest_by_more_than_the_tie_buffer():
    points = step_points(evals(), 0.9, 0.03, 3)  # evals 7, 5, 3 at 14, 10, 6 s
    # eval 7 reaches at 15.9 s against the long run's 16 s: within 1%, no step
    c = choose(points, 16.0, FakeStepRuns({7: 1.9, 5: 5.95, 3: None}))
    assert c.point is None and c.seconds == 16.0
    # eval 5 at 15.8 s is more than 1% sooner
    c = choose(points, 16.0, FakeStepRuns({7: 1.9, 5: 5.8, 3: None}))
    assert c.point["eval"] == 5 and c.seconds == 15.8


def test_long_run_keeps_the_model_of_every_evaluation(tmp_path):
    cfg = small_config(
        train={
            "max_epochs": 1.0,
            "eval_every_samples": 256,
            "save_eval_weights": True,
        }
    )
    trainer = Trainer(cfg, tmp_path / "a", progress=False, options=RunOptions(record=True))
    trainer.run()
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    files = sorted((tmp_path / "a" / "eval_weights").glob("*.pt"))  # not the .sha256 sidecars
    assert [f.name for f in files] == [f"{r['eval']:04d}.pt" for r in recs]
    assert len(files) == 5  # at 0, 256, 512, 768 and the end (1024 samples)
    first = torch.load(files[0], weights_only=True)
    last = torch.load(files[-1], weights_only=True)
    assert torch.equal(last, torch.load(tmp_path / "a" / "final_weights.pt", weights_only=True))
    assert not torch.equal(first, last)
    # a run from an evaluation's weights starts at that evaluation's accuracy
    mid = recs[2]
    cont = small_config(
        train={"max_epochs": 0.25, "initial_weights": str(files[2])},
    )
    Trainer(cont, tmp_path / "b", progress=False).run()
    start = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["eval_metric"] == mid["eval_metric"]


def test_plan_keeps_its_momentum_and_takes_the_better_lr_at_it():
    # steady state's best is η = 0.025 at μ = 0.3 (a tie within 1% with η/10 at μ = 0.9);
    # the plan keeps μ = 0.9, where η/10 scored clearly better than η
    from distsgd.config import TuneConfig
    from distsgd.tuner.plan import plan_switch

    cur = Candidate("hardsync", 2, 16, 0.025, 0.9)
    scores = {(0.025, 0.9): 0.2729, (0.0025, 0.9): 0.2475, (0.025, 0.3): 0.2490}
    results = []
    for (lr, mu), score in scores.items():
        r = ProbeResult(Candidate("hardsync", 2, 16, lr, mu), "segment")
        r.losses = [score] * 10
        results.append(r)
    other = ProbeResult(Candidate("hardsync", 2, 16, 0.0025, 0.9), "initial")
    other.losses = [0.1] * 10  # another snapshot does not count
    assert plan_switch(results + [other], cur, "segment", TuneConfig()).lr == 0.0025
    # within the tie buffer the larger η stays; nothing probed: keep
    results[1].losses = [0.2720] * 10
    assert plan_switch(results, cur, "segment", TuneConfig()) == cur
    assert plan_switch([], cur, "segment", TuneConfig()) == cur


def test_refinement_bisects_around_the_soonest_step_while_the_budget_lasts():
    ev = evals()
    pool = step_pool(ev, 0.9)
    assert [e["eval"] for e in pool] == [1, 2, 3, 4, 5, 6, 7]
    assert [e["eval"] for e in step_pool(ev[:4], 0.9)] == [1, 2, 3]  # none reached: all
    points = step_points(ev, 0.9, 0.03, 3)  # 7, 5, 3
    # chains (point's 2e s + reach): 7 → 15, 6 → 13.5, 5 → 13, 4 → 11.5, earlier never
    reach = {7: 1.0, 6: 1.5, 5: 3.0, 4: 3.5}
    runs = FakeStepRuns(reach)
    c = choose(points, 16.0, runs, pool=pool)
    # after 7, 5, 3: midway to the right of 5 (eval 6, cut at 13 s: 1 s left, needs 1.5)
    # and to the left (eval 4: 11.5 s, the soonest); then 4 has tried neighbours 3 and 5
    assert [e for e, _ in runs.calls] == [7, 5, 3, 6, 4]
    assert runs.calls[3] == (6, 1.0)
    assert c.point["eval"] == 4 and c.seconds == 11.5
    # the soonest at the pool's start edge: bisection toward the start
    runs = FakeStepRuns({7: 1.0, 5: 3.0, 3: 2.0, 2: 2.0, 1: 9.0})
    c = choose(points, 16.0, runs, pool=pool)
    # (eval 4 at 8 s is not before the soonest, 8 s: skipped without a run)
    assert [e for e, _ in runs.calls] == [7, 5, 3, 2, 1]
    assert c.point["eval"] == 2 and c.seconds == 6.0
    # the budget stops the refinement; the soonest so far stands
    runs = FakeStepRuns(reach, budget_runs=4)
    c = choose(points, 16.0, runs, pool=pool)
    assert [e for e, _ in runs.calls] == [7, 5, 3, 6] and c.point["eval"] == 5


@pytest.mark.slow
def test_tune_steps_where_its_runs_from_the_snapshots_reached_the_target_soonest(tmp_path):
    """End to end on the simulator (deterministic clock): the step runs start from the
    long run's evaluation snapshots, are cut at their horizons, and the plan steps at the
    chosen evaluation's epoch."""
    import tomllib

    from distsgd.config import RunConfig
    from distsgd.tuner.tune import tune

    base = small_config(
        protocol={"num_learners": 2, "batch_size": 16},
        train={"target": 0.845, "max_epochs": 6, "eval_every_samples": 128},
        tune={
            "probe_seconds": 0.03,
            "lrs": [0.1],
            "momenta": [0.9],
            "batch_sizes": [16],
            "extra_probes": 0,
            "step_margin": 0.3,
            "max_groups": 1,
            "families": ["hardsync"],
        },
    )
    out = tmp_path / "tune"
    state = tune(base, out, budget_s=120, progress=False)
    long_run = state["long_run"]
    assert long_run["summary"]["reached"]
    runs = state["step_runs"]
    assert len(runs) >= 3 and state["step_at"] is not None
    clock = long_run["virtual_s"]
    tick = max(clock[i + 1] - clock[i] for i in range(len(clock) - 1))  # one iteration
    best = long_run["summary"]["time_to_target_virtual_s"]
    for r in runs:
        recs = [
            json.loads(x) for x in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        ]
        # started from the evaluation's snapshot: same model, same test accuracy
        assert recs[0]["samples"] == 0 and recs[0]["eval_metric"] == r["accuracy"]
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["virtual_s"] <= best - r["clock_s"] + tick + 1e-9  # cut at its horizon
        if r["reached"] and r["time_to_target_s"] < best * 0.99:
            best = r["time_to_target_s"]
    chosen = min((r for r in runs if r["reached"]), key=lambda r: r["time_to_target_s"])
    assert state["step_at"]["eval"] == chosen["eval"]
    # the bisection ran after the spread points (the plan's step comes from it here)
    assert any(r["why"].startswith("midway") for r in runs)
    assert chosen["why"].startswith("midway")
    # the prediction fits the long run up to the step, then the run from there
    first, second = state["segments"]
    assert first["iterations"][-1] <= state["step_at"]["iterations"] < long_run["iterations"][-1]
    assert second["run_dir"] == chosen["run_dir"]
    assert state["prediction"]["tuner_measured_s"] == pytest.approx(best)
    plan = tomllib.loads((out / "plan.toml").read_text())
    assert plan["schedule"]["kind"] == "step"
    assert plan["schedule"]["decay_epochs"] == [round(state["step_at"]["epoch"], 4)]
    assert plan["schedule"]["decay_factor"] == 0.1
    assert RunConfig.from_toml(out / "plan.toml").optimizer.lr == 0.1
    assert "## Learning-rate step" in (out / "report.md").read_text()
    assert (out / "steps.png").exists()


def test_usable_step_points_leave_out_evaluations_without_epochs_to_train():
    from distsgd.config import TuneConfig

    ev = evals()
    settings = TuneConfig(step_points=3, step_margin=0.03)
    log = DecisionLog()
    # train.max_epochs ends at eval 7: no epochs left after it, for the points and the pool
    points, pool = usable_step_points(ev, 0.9, settings, ev[7]["epoch"], False, log)
    assert [p["eval"] for p in points] == [5, 3]
    assert [p["eval"] for p in pool] == [1, 2, 3, 4, 5, 6]
    assert log.entries[0]["decision"] == f"skip the step at epoch {ev[7]['epoch']:.3f}"
    # no point: the log says why
    log = DecisionLog()
    none = TuneConfig(step_points=0)
    assert usable_step_points(ev, 0.9, none, 10.0, False, log) == ([], step_pool(ev, 0.9))
    assert log.entries[-1]["reason"] == "tune.step_points = 0"
    log = DecisionLog()
    tight = TuneConfig(step_points=3, step_margin=0.001)
    assert usable_step_points(ev, 0.9, tight, 10.0, False, log)[0] == []
    assert log.entries[-1]["decision"] == "no evaluation of the long run qualifies as a step point"


def test_truncate_run_keeps_the_ticks_and_evaluations_up_to_the_step():
    run = ProbeResult(
        Candidate("hardsync", 2, 16, 0.1, 0.9),
        "initial",
        iterations=[1, 2, 3, 4],
        virtual_s=[0.1, 0.2, 0.3, 0.4],
        losses=[4.0, 3.0, 2.0, 1.0],
    )
    run.evals = [{"iterations": 0}, {"iterations": 2}, {"iterations": 4}]
    head = truncate_run(run, 2)
    assert (head.iterations, head.virtual_s, head.losses) == ([1, 2], [0.1, 0.2], [4.0, 3.0])
    assert [e["iterations"] for e in head.evals] == [0, 2]
    assert run.iterations == [1, 2, 3, 4] and len(run.evals) == 3  # the long run unchanged


def test_run_clock_names_the_keys_a_run_writes(tmp_path):
    """The keys the step search and the plan read exist in a real run's records."""
    cfg = small_config(train={"max_epochs": 0.5, "target": 0.2})
    summary = Trainer(cfg, tmp_path / "a", progress=False).run()
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert summary["reached"]
    for clock in (RunClock.of(simulated=True), RunClock.of(simulated=False)):
        assert clock.at(recs[-1]) == recs[-1][clock.eval_key] > 0
        assert summary[clock.time_to_target_key] > 0
        assert summary[clock.run_seconds_key] > 0
    assert RunClock.of(simulated=True).name == "simulated"
    assert RunClock.of(simulated=False).name == "wall"
