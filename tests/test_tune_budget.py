"""The tune's wall-clock budget, decided on a fake clock with a fake prober: the search and
the long runs end within the budget, with at most one probe's overrun of its expected cost;
a budget too small for the setup and one probe is refused with one line."""

import dataclasses

import pytest

from distsgd.cli import main
from distsgd.tuner import perf_model as pm
from distsgd.tuner import tune as tune_module
from distsgd.tuner.budget import RunBudget, TuneBudget, first_probe_estimate
from distsgd.tuner.session import TuneSession

from .conftest import small_config
from .test_tuner import FakeProbe, make_search


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def run_tune_steps(budget_s, probe_costs, setup_s=1.0, eval_s=0.5, build_s=0.4):
    """The tune's phases (cold start, long run, steady state, second long run) in tune()'s
    order, each decided by the same TuneBudget method tune() calls; every probe advances
    the fake clock by its cost. Returns (clock seconds used, probes run, long-run training
    seconds) or None when refused."""
    clock = FakeClock()
    tb = TuneBudget(budget_s, 0.35, 0.15, first_probe_s=probe_costs(0), eval_s=eval_s, clock=clock)
    clock.t += setup_s
    if tb.minimum_s() > budget_s:
        return None
    count = [0]

    def score(cand, snapshot):
        cost = probe_costs(count[0])
        count[0] += 1
        clock.t += cost
        tb.record_probe(cost, cost - build_s)
        return 1.0 + abs(cand.momentum - 0.6) + abs(cand.lr - 0.01)

    probe = FakeProbe(score)
    search = make_search(probe, lam=4)
    search.out_of_budget = lambda: not tb.may_search_probe(bool(search.results))
    best = search.cold_start()
    assert best is not None  # the first probe always fits a budget that was not refused
    rate, every = 2000.0, 500  # samples per wall second, evaluation interval
    trained = []

    def long_run(t):
        if t > 0:  # build, evaluations at start, every `every` samples and at the end
            clock.t += build_s + t + eval_s * (2 + t * rate / every)
            trained.append(t)

    long_run(tb.first_long_run_seconds(rate, every))
    steady_end = tb.steady_end()
    assert steady_end <= budget_s
    search.out_of_budget = lambda: not tb.may_probe(steady_end)
    search.steady_state(best.candidate, "segment")
    long_run(tb.second_long_run_seconds(rate, every))
    return clock.t - tb.start, len(probe.calls), trained


@pytest.mark.parametrize("budget_s", [6.0, 9.0, 20.0, 90.0, 600.0])
def test_steps_at_their_expected_cost_end_within_the_budget(budget_s):
    out = run_tune_steps(budget_s, lambda i: 3.0)
    assert out is not None
    used, probes, trained = out
    assert used <= budget_s + 1e-9
    assert probes >= 1
    if budget_s >= 90:  # room for the search, a long run and steady state
        assert probes > 4 and trained


def test_one_slow_probe_overruns_by_its_excess_only():
    # the 4th probe takes 7 s instead of the 3 s measured so far: later probes expect 7 s
    costs = lambda i: 7.0 if i == 3 else 3.0  # noqa: E731
    for budget_s in (10.0, 15.0, 30.0, 90.0):
        used, _, _ = run_tune_steps(budget_s, costs)
        assert used <= budget_s + (7.0 - 3.0) + 1e-9


def test_budget_below_setup_and_one_probe_is_refused():
    assert run_tune_steps(3.9, lambda i: 3.0) is None  # 1 s setup + 3 s probe > 3.9 s
    assert run_tune_steps(4.0, lambda i: 3.0) is not None


def test_segment_seconds_accounts_for_build_and_evaluations():
    clock = FakeClock()
    tb = TuneBudget(100.0, 0.35, 0.15, first_probe_s=2.0, eval_s=1.0, clock=clock)
    tb.record_probe(2.0, 1.5)  # build 0.5 s, 1.5 s of training
    # 100 − 10 kept − 0.5 build − 2 evaluations = 87.5 = t (1 + 1 s · 1000/s / 1000)
    assert tb.long_run_seconds(1000.0, 1000, keep_s=10.0) == pytest.approx(87.5 / 2)
    clock.t += 97.0  # 3 s left: less than one probe's training after build and evaluations
    assert tb.long_run_seconds(1000.0, 1000) == 0.0
    assert first_probe_estimate(2.0, 1.5, 0.3) == pytest.approx(3.3)


def test_tune_refuses_a_budget_below_its_computed_minimum(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_config(protocol={"num_learners": 2, "batch_size": 16}).to_toml())
    assert main(["tune", str(cfg), "--budget", "0.001", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--budget 0.001s is not allowed for this config: expected at least" in err


def test_steady_state_ends_at_the_budget_when_the_long_run_used_the_reserve():
    clock = FakeClock()
    tb = TuneBudget(60.0, 0.35, 0.15, first_probe_s=2.0, eval_s=0.1, clock=clock)
    tb.record_probe(2.0, 1.5)
    clock.t += 41.0  # 19 s left: the reserve (17.4 s) leaves less than one probe's training
    assert tb.long_run_seconds(1000.0, 1000, keep_s=tb.reserve_s()) == 0.0
    t = tb.first_long_run_seconds(1000.0, 1000)
    assert 0 < t <= 19.0  # so it takes what is left of the budget
    clock.t += 0.5 + t + 0.1 * (2 + t)
    # steady state ends at the budget, not 0.15·B after the long run (the overrun seen as
    # a 60 s tune ending at 61-63 s)
    assert tb.steady_end() == pytest.approx(60.0)
    assert not tb.may_probe(tb.steady_end())
    clock.t = tb.start + 10.0
    assert tb.steady_end() == pytest.approx(10.0 + 0.15 * 60.0)  # its share from now


@pytest.mark.parametrize("probe_s", [2.0, 5.0, 11.0])
def test_every_phase_ends_within_the_budget_when_the_long_run_takes_the_reserve(probe_s):
    for budget_s in (12.0, 25.0, 40.0, 60.0):
        out = run_tune_steps(budget_s, lambda i: probe_s)
        if out is not None:
            assert out[0] <= budget_s + 1e-9


def test_a_budget_below_the_prediction_minimum_is_one_line_without_a_progress_bar(
    tmp_path, capsys, monkeypatch
):
    # issue 18: the bar ("tune:   0%| | 0/4 s budget") was printed before the error line; a
    # throughput of 1 sample/s makes any budget too small for a long run with evaluations
    monkeypatch.setattr(tune_module, "estimated_samples_per_s", lambda fixed: 1.0)
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_config(protocol={"num_learners": 2, "batch_size": 16}).to_toml())
    assert main(["tune", str(cfg), "--budget", "30", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distsgd: error: --budget 30s is not allowed for this config")
    assert len(err.splitlines()) == 1
    assert "tune:" not in err and not (tmp_path / "t").exists()


def test_first_probe_estimate_counts_the_simulators_wall_time_not_the_profiles(tmp_path):
    # issue 18: a fast device profile (here 1 µs/batch) made the first probe "expected to take
    # 0.4 s wall" while it took 95 s: the simulator computes every learner in this process,
    # with per-iteration work far above the profile's compute time. Lower bound only
    # (load can only raise it): no CPU runs one simulated iteration of two learners' forward,
    # backward and update in under 10 µs of Python.
    cluster = {"seconds_per_batch": 1e-6, "seconds_per_sample": 1e-9, "jitter": 0.0}
    cfg = small_config(protocol={"num_learners": 2, "batch_size": 16}, cluster=cluster)
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=0.01))
    session = TuneSession.setup(cfg, tmp_path / "t", budget_s=1e4, progress=False)
    layout = pm.Layout("hardsync", 2, 16)
    iterations = 0.01 / pm.seconds_per_iteration(layout, session.fixed.cluster)
    train_s = session.costs.first_probe_s - session.fixed.timings["build_s"]
    assert train_s >= iterations * 10e-6
    assert session.fixed.timings["train_samples_per_s"] > 0
    session.bar.close()


def test_both_tuners_answer_the_search_budget_through_one_interface():
    # distsgd tune: the first probe may use the whole budget, later ones must end by the
    # search's share (0.5 of 100 s here); the reason names what is spent
    clock = FakeClock()
    costs = TuneBudget(100.0, 0.35, 0.15, first_probe_s=60.0, eval_s=0.0, clock=clock)
    assert costs.search_spent(0) is None
    spent = costs.search_spent(1)
    assert (
        spent
        == "search budget spent: a probe is expected to take 60.0 s, 50.0 s left to the search"
    )
    # train --tune: a budget too small for the full cold start caps the probes' count
    settings = small_config(tune={"lrs": [0.1, 0.01], "probe_seconds": 1.0}).tune
    run = RunBudget.of(settings, 0.1, "train.max_virtual_seconds")
    assert run.max_probes == 1 and run.steady_rounds == 0 and run.rung_s == run.probe_s
    assert run.search_spent(0) is None and run.search_spent(1) == "the budget's probes are spent"
    unlimited = RunBudget.of(settings, 0.0, "train.max_virtual_seconds")
    assert unlimited.max_probes == 0 and unlimited.search_spent(10**6) is None
    assert unlimited.rung_s == 0.5 * unlimited.probe_s == 0.5  # tune.first_rung's default
