"""The tuner: Omnivore's search on a fake probe function (deterministic), the probes'
Trainer hooks, and one tiny end-to-end ``distsgd tune`` whose plan ``distsgd train``
accepts as is."""

import json
import math
import tomllib
from dataclasses import replace

import pytest
import torch

from distsgd.cli import main
from distsgd.config import ConfigError, RunConfig, TuneConfig
from distsgd.trainer import Trainer
from distsgd.tuner.omnivore import (
    Candidate,
    DecisionLog,
    OmnivoreSearch,
    ProbeResult,
    cold_start_grid,
    joint_candidates,
    nan_pruned,
    next_larger_lr,
    pick_best,
    rank_candidates,
    worse_than_above,
)
from distsgd.tuner.perf_model import ClusterModel
from distsgd.tuner.tune import parse_budget

from .conftest import small_config


def fake_result(cand, snapshot, score, he=1.0, diverged=False):
    n = 20
    return ProbeResult(
        cand,
        snapshot,
        iterations=list(range(1, n + 1)),
        virtual_s=[he * i for i in range(1, n + 1)],
        losses=[score + 1.0] * (n - 10) + [score] * 10,  # only the last 10 count
        diverged=diverged,
    )


class FakeProbe:
    """Scores from a table: score(g, η, μ, snapshot); HE per g; NaN where told."""

    def __init__(self, score, he=lambda g: 1.0 / g, nan=lambda c: False):
        self.score, self.he, self.nan = score, he, nan
        self.calls = []

    def __call__(self, cand, snapshot):
        self.calls.append((cand.g, cand.lr, cand.momentum, snapshot))
        return fake_result(
            cand, snapshot, self.score(cand, snapshot), self.he(cand.g), diverged=self.nan(cand)
        )


def make_search(probe, lam=8, **settings):
    s = TuneConfig(**{"lrs": [0.1, 0.01, 0.001, 0.0001], **settings})
    return OmnivoreSearch(probe, s, lam, 16, DecisionLog())


def test_cold_start_grid_follows_omnivore():
    s = TuneConfig()
    grid, pruned = cold_start_grid(1, None, s)
    assert grid == [(0.1, 0.9), (0.01, 0.9), (0.001, 0.9), (0.0001, 0.9)]
    assert pruned == []
    grid, pruned = cold_start_grid(2, (0.01, 0.6), s)
    # η*_prev with μ <= μ*_prev, then η*_prev/10 with μ >= μ*_prev, largest first
    assert grid == [(0.01, 0.6), (0.01, 0.3), (0.01, 0.0), (0.001, 0.9), (0.001, 0.6)]
    assert [p for p, _ in pruned] == [(0.01, 0.9), (0.001, 0.3), (0.001, 0.0)]
    assert "μ > μ*_prev" in pruned[0][1] and "both lower" in pruned[1][1]


def test_families_without_compute_groups_limit_the_grid_to_one_group():
    # a fresh-user review: tune.families = [hardsync] ended as compute_groups (g = 2)
    probe = FakeProbe(lambda c, snap: 1.0 / c.g)  # more groups would win
    assert make_search(probe).group_counts() == [1, 2, 4, 8]
    search = make_search(probe, families=["hardsync", "sma"])
    assert search.group_counts() == [1]
    best = search.cold_start()
    assert {g for g, *_ in probe.calls} == {1} and best.candidate.family == "hardsync"


def test_nan_pruning_covers_everything_at_or_above():
    pts = [(0.01, 0.6)]
    assert nan_pruned(0.01, 0.6, pts) == (0.01, 0.6)
    assert nan_pruned(0.1, 0.9, pts) == (0.01, 0.6)
    assert nan_pruned(0.01, 0.3, pts) is None
    assert nan_pruned(0.001, 0.9, pts) is None


def test_tie_rule_prefers_larger_lr_then_larger_momentum():
    c = Candidate("hardsync", 4, 16, 0.01, 0.6)
    rs = [
        fake_result(c, "s", 1.000),
        fake_result(Candidate("hardsync", 4, 16, 0.1, 0.3), "s", 1.009),  # within 1%
        fake_result(Candidate("hardsync", 4, 16, 0.1, 0.6), "s", 1.0099),  # within 1%
        fake_result(Candidate("hardsync", 4, 16, 1.0, 0.9), "s", 1.02),  # outside
        fake_result(Candidate("hardsync", 4, 16, 2.0, 0.9), "s", 0.5, diverged=True),
    ]
    best = pick_best(rs, 0.01)
    assert (best.candidate.lr, best.candidate.momentum) == (0.1, 0.6)
    assert pick_best(rs, 0.0).candidate.lr == 0.01  # no buffer: the lowest score
    assert pick_best(rs[-1:], 0.01) is None  # all diverged


def test_next_larger_lr_is_the_grid_neighbour_above_that_did_not_diverge():
    at = lambda lr, b=16, mu=0.9, score=1.0, nan=False: fake_result(  # noqa: E731
        Candidate("hardsync", 2, b, lr, mu), "s", score, diverged=nan
    )
    best = at(0.01, score=0.9)
    rs = [at(1.0, nan=True), at(0.3), at(0.1, score=1.3), best, at(0.001, score=2.0)]
    rs += [at(0.05, b=8, score=0.5), at(0.05, mu=0.6, score=0.5)]  # other batch, other μ
    assert next_larger_lr(rs, best).candidate.lr == 0.1
    assert next_larger_lr(rs, rs[2]).candidate.lr == 0.3  # 1.0 diverged: not a chance
    assert next_larger_lr(rs, rs[1]) is None


def test_a_loss_that_blows_up_without_nan_marks_the_probe_diverged():
    c = Candidate("hardsync", 2, 16, 10.0, 0.9)
    up = ProbeResult(c, "s", losses=[2.3] + [30.0] * 10)  # 13x its first loss
    assert up.mark_exploded() and up.diverged and math.isnan(up.score)
    assert "rose from 2.3" in up.notes[0]
    assert ProbeResult(c, "s", losses=[2.3, float("inf")]).mark_exploded()
    flat = ProbeResult(c, "s", losses=[2.3] + [20.0] * 10)  # 8.7x: not blown up
    assert not flat.mark_exploded() and not math.isnan(flat.score)
    # from a well-trained snapshot: 0.001 -> 0.02 is 20x its own first loss, but far
    # below the initial model's loss (the reference --tune gives)
    tiny = [0.001] + [0.02] * 10
    assert not ProbeResult(c, "s", losses=list(tiny)).mark_exploded(reference=2.3)
    assert ProbeResult(c, "s", losses=list(tiny)).mark_exploded()
    # a second rung counts its chain: the first rung's first loss is the chain's
    chained = ProbeResult(c, "s", losses=[25.0] * 10, earlier_losses=[2.3, 3.0])
    assert chained.mark_exploded()


def test_score_is_the_mean_of_the_last_ten_losses():
    r = fake_result(Candidate("hardsync", 1, 8, 0.1, 0.9), "s", 0.25)
    assert r.score == pytest.approx(0.25)
    r.losses = [1.0] * 5 + [0.1 * i for i in range(10)]
    assert r.score == pytest.approx(0.45)


@pytest.mark.parametrize("stop", [True, False], ids=["online", "offline"])
def test_stop_descending_skips_the_smaller_lrs_once_the_score_rises(stop):
    # η 0.1 scores 1.0, η 0.01 1.5: online (stop_descending) η 0.001 and 0.0001 are not
    # probed and a decision says why; offline the whole grid is (SPEC.md §3)
    scores = {0.1: 1.0, 0.01: 1.5, 0.001: 0.9, 0.0001: 2.0}
    probe = FakeProbe(lambda c, s: scores[c.lr])
    s = TuneConfig(lrs=[0.1, 0.01, 0.001, 0.0001])
    log = DecisionLog()
    search = OmnivoreSearch(probe, s, 1, 16, log, stop_descending=stop)
    best = search.cold_start()
    probed = [lr for _, lr, _, _ in probe.calls]
    if stop:
        assert probed == [0.1, 0.01] and best.candidate.lr == 0.1
        skip = [d for d in log.entries if d["decision"].startswith("skip g=1")]
        assert skip and "0.001, 0.0001" in skip[0]["decision"]
    else:
        assert probed == [0.1, 0.01, 0.001, 0.0001] and best.candidate.lr == 0.001


def test_stop_descending_goes_on_past_a_tie_and_a_diverged_larger_lr():
    # 0.1 diverges (NaN), 0.01 scores 1.0, 0.001 1.005 (within the 1% tie buffer), 0.0001
    # 2.0: the descent stops only at 0.0001
    scores = {0.1: 0.1, 0.01: 1.0, 0.001: 1.005, 0.0001: 2.0}
    probe = FakeProbe(lambda c, s: scores[c.lr], nan=lambda c: c.lr == 0.1)
    s = TuneConfig(lrs=[0.1, 0.01, 0.001, 0.0001], tie_buffer=0.01)
    search = OmnivoreSearch(probe, s, 1, 16, DecisionLog(), stop_descending=True)
    search.cold_start()
    assert [lr for _, lr, _, _ in probe.calls] == [0.1, 0.01, 0.001, 0.0001]
    rs = [fake_result(Candidate("hardsync", 1, 16, 0.1, 0.9), "s", 1.0)]
    assert not worse_than_above(rs, 0.01)  # nothing above the first
    rs.append(fake_result(Candidate("hardsync", 1, 16, 0.01, 0.9), "s", 1.02))
    assert worse_than_above(rs, 0.01) and not worse_than_above(rs, 0.05)


def test_cold_start_probes_in_order_prunes_nan_and_picks_per_g():
    # the best η is 0.01 at every g; the best μ falls with g (Omnivore's finding)
    best_mu = {1: 0.9, 2: 0.6, 4: 0.3, 8: 0.0}

    def score(c, snap):
        return 1.0 + abs(math.log10(c.lr) + 2) + abs(c.momentum - best_mu[c.g])

    probe = FakeProbe(score, nan=lambda c: c.lr >= 0.1 and c.momentum >= 0.9)
    search = make_search(probe)
    chosen = search.cold_start()
    assert probe.calls[:4] == [(1, lr, 0.9, "initial") for lr in (0.1, 0.01, 0.001, 0.0001)]
    # g = 2 probes η*=0.01 with μ <= 0.9, then η*/10 with μ >= 0.9
    assert probe.calls[4:9] == [
        (2, 0.01, 0.9, "initial"),
        (2, 0.01, 0.6, "initial"),
        (2, 0.01, 0.3, "initial"),
        (2, 0.01, 0.0, "initial"),
        (2, 0.001, 0.9, "initial"),
    ]
    assert {g: (r.candidate.lr, r.candidate.momentum) for g, r in search.best_by_g.items()} == {
        1: (0.01, 0.9),
        2: (0.01, 0.6),
        4: (0.01, 0.3),
        8: (0.01, 0.0),
    }
    assert [(d.g, d.lr, d.momentum) for d in search.diverged] == [(1, 0.1, 0.9)]
    # every g scores 1.0 at its best: the tie prefers fewer groups
    assert chosen.candidate.g == 1
    assert chosen.candidate.family == "hardsync"


def test_nan_at_fewer_groups_prunes_more_groups():
    probe = FakeProbe(
        lambda c, s: 1.0 + c.momentum * 0.01 - c.lr,  # larger η better while it converges
        nan=lambda c: c.lr >= 0.1 and c.momentum >= 0.6,
    )
    search = make_search(probe, max_groups=2)
    search.cold_start()
    # g=1: 0.1@0.9 diverges; best is 0.01@0.9; g=2 never probes (0.1, ≥0.6)
    assert (2, 0.1, 0.6, "initial") not in probe.calls
    assert not [c for c in probe.calls if c[0] == 2 and c[1] >= 0.1 and c[2] >= 0.6]


def test_nan_at_two_groups_leaves_one_group_and_the_steady_state_incumbent_alone():
    # hardsync is best at (0.1, 0.9); compute groups g=2 diverge at (0.1, 0.9)
    probe = FakeProbe(
        lambda c, s: 1.0 + abs(c.momentum - 0.9) + abs(math.log10(c.lr) + 1),
        he=lambda g: 1.0 / g,
        nan=lambda c: c.g == 2 and c.lr >= 0.1 and c.momentum >= 0.9,
    )
    search = make_search(probe, lam=4, max_groups=2)
    search.cold_start()
    assert (2, 0.1, 0.9, "initial") in probe.calls  # diverged
    assert [(d.g, d.lr, d.momentum) for d in search.diverged] == [(2, 0.1, 0.9)]
    hs = Candidate("hardsync", 4, 16, 0.1, 0.9)
    assert search.nan_hit(hs) is None  # g=1 is not pruned by a NaN at g=2
    assert search.nan_hit(Candidate("compute_groups", 4, 16, 0.1, 0.9, num_groups=2))
    assert search.nan_hit(replace(hs, batch_size=32)) is None  # another batch
    # steady state of the hardsync incumbent probes it (first) and keeps it: no η/10 step
    n = len(probe.calls)
    steady = search.steady_state(hs, "segment")
    assert probe.calls[n] == (1, 0.1, 0.9, "segment")
    assert steady == hs
    # the incumbent itself is never pruned, even by a NaN at its own (η, μ) and g
    search.diverged.append(hs)
    n = len(probe.calls)
    assert search.steady_state(hs, "segment") == hs
    assert probe.calls[n] == (1, 0.1, 0.9, "segment")


def test_steady_state_without_the_incumbent_probe_keeps_the_incumbent():
    probe = FakeProbe(lambda c, s: 1.0 + c.lr)  # η/10 would win if compared with nothing
    search = make_search(probe, lam=4)
    calls = iter([True])  # the budget refuses the first probe (the incumbent) only
    search.out_of_budget = lambda: next(calls, False)
    inc = Candidate("hardsync", 4, 16, 0.1, 0.9)
    assert search.steady_state(inc, "segment") == inc
    assert "not probed" in search.log.entries[-1]["reason"]


def test_he_rule_rejects_groups_that_do_not_speed_up_iterations_by_ten_percent():
    he = {1: 1.0, 2: 0.5, 4: 0.46, 8: 0.2}  # g=4 improves by 8% only
    probe = FakeProbe(lambda c, s: 1.0 + c.momentum, he=lambda g: he[g])
    search = make_search(probe)
    search.cold_start()
    assert sorted(search.best_by_g) == [1, 2]
    assert [c for c in probe.calls if c[0] == 4] == [probe.calls[-1]]  # one probe, then stop
    assert not [c for c in probe.calls if c[0] == 8]
    reasons = [e["reason"] for e in search.log.entries if "reject g=4" in e["decision"]]
    assert reasons and "8.0% < 10%" in reasons[0]


def test_lowest_score_across_groups_wins():
    probe = FakeProbe(lambda c, s: {1: 1.0, 2: 0.8, 4: 0.9, 8: 2.0}[c.g] + 0.001 * c.momentum)
    search = make_search(probe)
    chosen = search.cold_start()
    assert chosen.candidate.g == 2


def test_steady_state_halves_groups_while_best_momentum_is_zero():
    # at g=8 and g=4 the best μ is 0; at g=2 it is 0.3
    best_mu = {8: 0.0, 4: 0.0, 2: 0.3}
    probe = FakeProbe(lambda c, s: 1.0 + abs(c.momentum - best_mu[c.g]) + (c.lr < 0.01))
    search = make_search(probe)
    cur = Candidate("compute_groups", 8, 16, 0.01, 0.3, num_groups=8)
    final = search.steady_state(cur, "segment")
    assert (final.g, final.lr, final.momentum) == (2, 0.01, 0.3)
    assert all(s == "segment" for *_, s in probe.calls)
    # each round probes μ × {η, η/10}, the incumbent first
    grid = [(8, lr, mu) for mu in (0.9, 0.6, 0.3, 0.0) for lr in (0.01, 0.001)]
    assert [c[:3] for c in probe.calls[:8]] == [(8, 0.01, 0.3)] + [
        c for c in grid if c != (8, 0.01, 0.3)
    ]
    halvings = [e["decision"] for e in search.log.entries if "halve" in e["decision"]]
    assert halvings == [
        "halve groups g=8 → 4, μ = 0.6, search again",
        "halve groups g=4 → 2, μ = 0.6, search again",
    ]


def test_steady_state_stops_halving_at_one_group():
    probe = FakeProbe(lambda c, s: 1.0 + c.momentum)  # μ = 0 always best
    search = make_search(probe)
    final = search.steady_state(Candidate("compute_groups", 8, 16, 0.01, 0.3, num_groups=2), "s")
    assert final.family == "hardsync" and final.momentum == 0.0


def test_budget_stops_the_search_before_probing():
    probe = FakeProbe(lambda c, s: 1.0)
    search = make_search(probe)
    search.out_of_budget = lambda: True
    assert search.cold_start() is None
    assert probe.calls == []


def test_joint_search_ranks_unprobed_configurations_with_the_model():
    probe = FakeProbe(lambda c, s: 1.0 + abs(c.momentum - 0.6))
    search = make_search(probe, lam=4, max_groups=2)
    chosen = search.cold_start().candidate
    cands = joint_candidates(search, chosen, TuneConfig())
    probed = {r.candidate for r in search.results}
    assert cands and not probed & set(cands)
    fams = {c.family for c in cands}
    assert fams == {"hardsync", "compute_groups", "softsync", "sma"}  # the default families
    asked = TuneConfig(families=["hardsync", "diloco"])
    averaging = [c for c in joint_candidates(search, chosen, asked) if c.family == "diloco"]
    assert sorted(c.average_every for c in averaging) == [4, 16]
    # linear scaling of η with b
    hs = [c for c in cands if c.family == "hardsync" and c.batch_size == 32]
    assert hs and hs[0].lr == pytest.approx(chosen.lr * 2)
    cluster = ClusterModel(1e-3, 1e-4, num_parameters=1000)
    ranked = rank_candidates(cands, chosen, 100.0, cluster, noise_scale=64)
    times = [t for t, _ in ranked]
    assert times == sorted(times) and all(t > 0 for t in times)
    # a NaN of hardsync at the smallest (η, μ) prunes compute groups at its batch only; a
    # NaN of n-softsync prunes that n-softsync layout only
    search.diverged.append(Candidate("hardsync", 4, 16, 1e-9, 0.0))
    left = joint_candidates(search, chosen, TuneConfig())
    assert not [c for c in left if c.family == "compute_groups" and c.batch_size == 16]
    assert [c for c in left if c.family == "compute_groups" and c.batch_size == 32]
    soft = [c for c in left if c.family == "softsync"]
    search.diverged.append(replace(soft[0], lr=1e-9, momentum=0.0))
    left2 = joint_candidates(search, chosen, TuneConfig())
    assert [c for c in left2 if c.family == "softsync"] == soft[1:]


def test_parse_budget():
    assert parse_budget("90s") == 90
    assert parse_budget("10m") == 600
    assert parse_budget("1h") == 3600
    assert parse_budget("45") == 45
    for bad in ("abc", "-5m", "0s", "10x", "", "1e99", "200h"):
        with pytest.raises(ConfigError, match="--budget"):
            parse_budget(bad)


def test_tune_settings_are_validated():
    with pytest.raises(ConfigError, match="tune.probe_seconds = 0"):
        RunConfig.from_dict({"tune": {"probe_seconds": 0}})
    with pytest.raises(ConfigError, match="tune.families"):
        RunConfig.from_dict({"tune": {"families": ["ddp"]}})
    with pytest.raises(ConfigError, match="tune.momenta"):
        RunConfig.from_dict({"tune": {"momenta": [1.5]}})


def test_trainer_stops_at_virtual_time_and_starts_from_given_weights(tmp_path):
    cfg = small_config(
        train={"max_epochs": 0, "max_virtual_seconds": 0.05}, cluster={"jitter": 0.0}
    )
    ticks = []
    tr = Trainer(cfg, tmp_path / "a", progress=False, on_tick=lambda t, trainer: ticks.append(t))
    s = tr.run()
    assert s["stop_reason"] == "max_virtual_seconds"
    # the first tick at or past the budget stops it: at most one tick (1 ms + 32 · 0.1 ms,
    # no jitter) over
    assert 0.05 <= s["virtual_s"] < 0.05 + 0.0042 + 1e-9
    assert len(ticks) == s["iterations"]
    w = tr.protocol.eval_weights().clone()
    tr2 = Trainer(cfg, tmp_path / "b", progress=False, initial_weights=w)
    tr2.run()
    first = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    last = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert first["eval_metric"] == last["eval_metric"]  # evaluated at the same weights
    with pytest.raises(ConfigError, match="initial weights"):
        Trainer(cfg, tmp_path / "c", progress=False, initial_weights=torch.zeros(3)).run()


def test_unknown_runtime_and_bad_budget_are_one_line_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_config().to_toml())
    assert main(["tune", str(cfg), "--runtime", "gpu", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "runtime = 'gpu'" in err
    assert main(["tune", str(cfg), "--budget", "ten minutes"]) == 2
    assert "--budget 'ten minutes'" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_end_to_end_writes_a_plan_that_train_accepts(tmp_path, capsys):
    base = small_config(
        protocol={"num_learners": 2, "batch_size": 16},
        train={"target": 0.7, "max_epochs": 2, "eval_every_samples": 256},
        tune={
            "probe_seconds": 0.03,
            "lrs": [0.1, 0.01],
            "momenta": [0.0, 0.9],
            "batch_sizes": [16, 1024],
            "extra_probes": 1,
        },
    )
    cfg = tmp_path / "base.toml"
    cfg.write_text(base.to_toml())
    out = tmp_path / "tune"
    assert main(["tune", str(cfg), "--budget", "40s", "--out", str(out), "--quiet"]) == 0
    for f in ("plan.toml", "report.md", "decisions.jsonl", "tune.json", "probes.png"):
        assert (out / f).exists(), f
    decisions = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    assert all(d["reason"] for d in decisions)
    # b = 1024 on 2 learners needs 2048 of the 1024 training samples: skipped, said so (a
    # user's review: the run refused it mid-search and the tune ended with that error)
    skip = [d for d in decisions if d["decision"].startswith("skip ") and "b=1024" in d["decision"]]
    assert len(skip) == 1 and "training set's 1024" in skip[0]["reason"]
    # a joint probe's line carries its start and speed, as the grid's do (a user's review)
    joint = [d for d in decisions if d["phase"] == "joint" and d["decision"].startswith("probed")]
    assert joint and all(d["snapshot"] == "initial" and d["seconds_per_iteration"] for d in joint)
    only = base.replace(tune=replace(base.tune, families=["hardsync"], max_groups=1))
    cfg.write_text(only.to_toml())  # the joint search's one candidate is b = 1024
    argv = ["tune", str(cfg), "--budget", "40s", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "t2")]) == 0
    assert any(d["phase"] == "cold start" for d in decisions)
    state = json.loads((out / "tune.json").read_text())
    assert state["probes"] and state["clock"] == "simulated"
    # the plan runs as is
    capsys.readouterr()
    assert main(["train", str(out / "plan.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["protocol"] == RunConfig.from_toml(out / "plan.toml").protocol.name
    assert summary["reached"]
    # the follow-up command adds the measured point to the report
    assert main(["tune", "--verify-only", str(out), "--quiet"]) == 0
    state = json.loads((out / "tune.json").read_text())
    assert state["verify"]["reached"] and state["verify"]["measured_s"] > 0
    assert "Predicted vs measured" in (out / "report.md").read_text()


def test_prediction_recovers_the_time_of_a_known_run():
    """Two long runs whose losses follow known curves and whose accuracies follow
    1 − acc = 0.02 + 0.25 · loss: HE · SE must give the time the second run reaches 90%."""
    from distsgd.tuner.perf_model import LossCurve
    from distsgd.tuner.tune import predict_plan

    c1, c2 = LossCurve(0.3, 2.0, 0.5), LossCurve(0.25, 1.5, 0.5)
    he = 0.02  # seconds per iteration

    def run(curve, n):
        it = list(range(1, n + 1))
        r = ProbeResult(
            Candidate("hardsync", 2, 64, 0.1, 0.9),
            "s",
            iterations=it,
            virtual_s=[he * i for i in it],
            losses=[float(curve(i)) for i in it],
        )
        r.evals = [
            {"iterations": i, "eval_metric": 1 - (0.02 + 0.25 * float(curve(i)))}
            for i in range(50, n + 1, 50)
        ]
        return r

    first, second = run(c1, 400), run(c2, 600)
    pred = predict_plan([first, second], 0.9)
    target_loss = (0.1 - 0.02) / 0.25
    # the evaluation points enter as fitted-curve losses (binned ticks, β on a 0.25% grid),
    # which moves the error-vs-loss line slightly: 1% on the target loss
    assert pred["target_loss"] == pytest.approx(target_loss, rel=0.01)
    expected_it = 400 + ((1.5 / (target_loss - 0.25)) ** (1 / 0.5) - 1)  # 400 + 458
    # SE = (A / (L* − L_inf))^(1/β) amplifies that 1% about (L*/(L* − L_inf))/β ≈ 9×
    assert pred["iterations_to_target"] == pytest.approx(expected_it, rel=0.1)
    assert pred["predicted_s"] == pytest.approx(he * pred["iterations_to_target"])


def _known_run(curve, n, eval_every, he=0.02):
    """A long run whose losses follow ``curve`` and whose accuracies follow
    1 − acc = 0.02 + 0.25 · loss, evaluated every ``eval_every`` iterations."""
    it = list(range(1, n + 1))
    r = ProbeResult(
        Candidate("hardsync", 2, 64, 0.1, 0.9),
        "s",
        iterations=it,
        virtual_s=[he * i for i in it],
        losses=[float(curve(i)) for i in it],
    )
    r.evals = [
        {"iterations": i, "eval_metric": 1 - (0.02 + 0.25 * float(curve(i)))}
        for i in range(eval_every, n + 1, eval_every)
    ]
    return r


def test_no_prediction_from_too_few_evaluations_or_too_far_an_extrapolation():
    from distsgd.tuner.perf_model import LossCurve
    from distsgd.tuner.tune import predict_plan

    curve = LossCurve(0.25, 1.5, 0.5)  # reaches the 90% loss 0.32 at ~458 iterations
    assert math.isfinite(predict_plan([_known_run(curve, 600, 150)], 0.9)["predicted_s"])
    pred = predict_plan([_known_run(curve, 600, 200)], 0.9)  # 3 evaluations
    assert math.isnan(pred["predicted_s"])
    assert "3 evaluation(s), fewer than 4" in pred["reason"]
    # L_inf 0.3: the loss 0.32 comes after (2 / 0.02)² = 10⁴ iterations, 250× the 40 measured
    pred = predict_plan([_known_run(LossCurve(0.3, 2.0, 0.5), 40, 10)], 0.9)
    assert math.isnan(pred["predicted_s"]) and math.isnan(pred["iterations_to_target"])
    assert "more than 10× the 0.8 s the long run(s) measured" in pred["reason"]
    assert pred["extrapolated_s"] > 10 * 0.8


def test_candidate_config_maps_every_family_to_a_valid_run_config():
    from distsgd.tuner.probes import candidate_config

    base = small_config(
        protocol={"num_learners": 4}, schedule={"kind": "step", "decay_epochs": [1.0]}
    )
    cases = {
        Candidate("hardsync", 4, 8, 0.1, 0.9): ("hardsync", {}),
        Candidate("compute_groups", 4, 8, 0.1, 0.6, num_groups=2): (
            "compute_groups",
            {"num_groups": 2, "staleness_lr": "none", "momentum_compensation": False},
        ),
        Candidate("softsync", 4, 8, 0.1, 0.9, softsync=2): (
            "parameter_server",
            {"mode": "softsync", "softsync": 2, "staleness_lr": "softsync"},
        ),
        Candidate("sma", 8, 8, 0.1, 0.0, replicas_per_device=2): (
            "sma",
            {"replicas_per_device": 2, "alpha": 0.0},
        ),
        Candidate("local_sgd", 4, 8, 0.1, 0.9, average_every=16): (
            "local_sgd",
            {"average_every": 16, "replicas_per_device": 1},
        ),
        Candidate("diloco", 4, 8, 0.1, 0.0, average_every=4): ("diloco", {"average_every": 4}),
    }
    for cand, (name, fields) in cases.items():
        cfg = candidate_config(base, cand)
        p = cfg.protocol
        assert p.name == name
        assert (p.num_learners, p.batch_size) == (cand.num_learners, cand.batch_size)
        assert (cfg.optimizer.lr, cfg.optimizer.momentum) == (cand.lr, cand.momentum)
        assert cfg.schedule.kind == "constant"  # probes run at one η
        for k, v in fields.items():
            assert getattr(p, k) == v, (name, k)
        assert RunConfig.from_dict(tomllib.loads(cfg.to_toml())) == cfg  # round trip
    # hardsync with a backup learner: the backup stays with the hardsync candidates, and
    # the other families (which refuse backup learners) get none
    backup = small_config(protocol={"name": "hardsync", "num_learners": 4, "backup_learners": 1})
    for cand, (name, _) in cases.items():
        cfg = candidate_config(backup, cand)
        assert cfg.protocol.backup_learners == (1 if name == "hardsync" else 0), name
        assert RunConfig.from_dict(tomllib.loads(cfg.to_toml())) == cfg


def test_prediction_says_why_when_the_target_loss_is_not_positive():
    """A long run that ends far below the target maps the target accuracy to a training
    loss <= 0 by the linear error-vs-loss fit: no prediction, and a reason for it."""
    from types import SimpleNamespace

    from distsgd.tuner.tune import predict_plan

    its = list(range(1, 41))
    losses = [2.0 * (i + 1) ** -0.5 + 0.5 for i in its]
    # accuracy rises steeply as the loss falls: 99.9% maps to a loss below 0
    evals = [
        {"iterations": i, "eval_metric": 0.5 + 0.1 * (2.5 - loss)}
        for i, loss in zip(its[9::10], losses[9::10], strict=True)
    ]
    seg = SimpleNamespace(
        iterations=its,
        losses=losses,
        virtual_s=[0.01 * i for i in its],
        evals=evals,
        diverged=False,
    )
    pred = predict_plan([seg], target=0.999)
    assert not pred["target_loss"] > 0
    assert "too far from the target" in pred["reason"] and "larger --budget" in pred["reason"]
    assert math.isnan(pred["predicted_s"])
    # a fresh-user review: a long run that reached the target was told it "ended too far
    # from the target" and to give a larger budget
    pred = predict_plan([seg], target=0.999, reached=True)
    assert math.isnan(pred["predicted_s"]) and "not linear" in pred["reason"]
    assert "too far" not in pred["reason"] and "--budget" not in pred["reason"]


def test_plan_step_factor_is_rounded_and_probe_dirs_are_ascii():
    from distsgd.tuner.plan import plan_config
    from distsgd.tuner.probes import safe_name

    base = small_config(protocol={"num_learners": 4})
    cand = Candidate("hardsync", 4, 16, 0.1, 0.9)
    plan = plan_config(base, cand, replace(cand, lr=0.01), 0.5, DecisionLog())
    assert plan.schedule.decay_factor == 0.1  # 0.01 / 0.1 = 0.09999999999999999
    assert "decay_factor = 0.1\n" in plan.to_toml()
    assert safe_name(cand.label()) == "hardsync_lam=4_b=16_eta=0.1_mu=0.9"


def test_interrupted_tune_says_what_it_kept(tmp_path, capsys, monkeypatch):
    out = tmp_path / "t"

    def interrupted(cfg, out_dir, **kw):
        for name in ("001-probe-a", "002-probe-b"):
            (out_dir / "probes" / name).mkdir(parents=True)
        (out_dir / "decisions.jsonl").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr("distsgd.tuner.tune.tune", interrupted)
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_config().to_toml())
    assert main(["tune", str(cfg), "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        f"distsgd: interrupted: 2 probe run(s) in {out / 'probes'}, decisions in "
        f"{out / 'decisions.jsonl'}, no plan"
    )


@pytest.mark.slow
def test_tune_picks_local_sgd_where_the_link_sets_the_pace(tmp_path):
    """On a simulated link of 50 ms and 10 Mbit/s (hardsync's all-reduce of the mlp takes ~1 s
    against ~3 ms of compute), with local SGD among tune.families, the equal-time probes
    favour averaging every 16 iterations and the plan is local SGD."""
    base = small_config(
        protocol={"num_learners": 2, "batch_size": 16},
        cluster={"latency_s": 0.05, "bandwidth_gbps": 0.01},
        train={"target": 0.0, "max_epochs": 1},
        tune={
            "probe_seconds": 0.5,
            "lrs": [0.1],
            "cold_momentum": 0.0,
            "momenta": [0.0],
            "max_groups": 1,
            "families": ["local_sgd"],
            "batch_sizes": [16],
            "extra_probes": 2,
        },
    )
    cfg = tmp_path / "base.toml"
    cfg.write_text(base.to_toml())
    out = tmp_path / "tune"
    assert main(["tune", str(cfg), "--budget", "60s", "--out", str(out), "--quiet"]) == 0
    plan = RunConfig.from_toml(out / "plan.toml")
    decisions = (out / "decisions.jsonl").read_text()
    assert "local_sgd H=16" in decisions and "local_sgd H=4" in decisions
    assert (plan.protocol.name, plan.protocol.average_every) == ("local_sgd", 16), decisions
