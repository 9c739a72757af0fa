"""``distsgd train --tune`` (distsgd.tuner.online): the online rule sees only the past, the
winning probe continues bit-identically as the run, the run checks steady state itself and
stops where the earlier one-epoch segments (one launch each) re-optimised, with the same
decisions, a run killed mid-probe or mid-segment resumes to the same decisions, and bad
combinations are one line with exit status 2. All on the simulated runtime with a tiny
model (its clock is simulated, so runs are deterministic)."""

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tqdm import tqdm

from distsgd.cli import main
from distsgd.config import ConfigError, ConfigWarning, RunConfig
from distsgd.control import RunOptions
from distsgd.data import LearnerStream, ShardedSampler
from distsgd.metrics import load_checked, read_metrics, write_json
from distsgd.plateau import next_check, steady_state_due
from distsgd.rundir import RunDirClaim
from distsgd.trainer import Trainer
from distsgd.tuner import budget, online, probes, setup
from distsgd.tuner import perf_model as pm
from distsgd.tuner.chains import ProbeChains, ProbeRounds
from distsgd.tuner.cold_start import ColdStart
from distsgd.tuner.omnivore import Candidate, DecisionLog, ProbeResult, pair_scores
from distsgd.tuner.online import OnlineTune, RunSegments, train_tuned
from distsgd.tuner.probes import candidate_config, safe_name
from distsgd.tuner.steady import SteadyState, effective_rate, steady_grid

from .conftest import small_config

# a tiny run that re-optimises once: 3 epochs of 1024 samples, a 2 + 1 probe cold start
# and a 4-probe steady state (the training loss flattens in its second epoch)
TUNE = {
    "lrs": [0.1, 0.01],
    "momenta": [0.0, 0.9],
    "probe_seconds": 0.05,
    "extra_probes": 1,
    "batch_sizes": [16, 32],
    "check_epochs": 1.0,  # a check at each epoch's end (1024 samples)
}


def tiny_config(**train):
    return small_config(
        train={"target": 0.0, "max_epochs": 3, "eval_every_samples": 256, **train}, tune=TUNE
    )


def decisions(run_dir):
    """The decisions without their wall-clock stamp (the only measurement taken on the
    wall on the simulated runtime)."""
    out = []
    for line in (run_dir / "decisions.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.pop("t_wall_s")
        out.append(rec)
    return out


def test_steady_state_rule_uses_only_measurements_up_to_its_decision_point():
    # a training loss that falls quickly, then flattens, then falls again
    losses = [2.0, 1.2, 0.8, 0.6, 0.55, 0.53, 0.52, 0.3, 0.1, 0.05]
    records = [{"samples": 100 * i, "train_loss": v} for i, v in enumerate(losses)]
    seen_due = set()
    for now in range(0, 1000, 50):
        prefix = [r for r in records if r["samples"] <= now]
        expected = steady_state_due(prefix, now, 200)
        # poison every later measurement three ways: the decision must not move
        for poison in (math.nan, 0.0, 1e9):
            later = [{**r, "train_loss": poison} if r["samples"] > now else r for r in records]
            assert steady_state_due(later, now, 200) == expected, (now, poison)
        due, used = expected
        assert all(r["samples"] <= now for r in used)
        seen_due.add(due)
    assert seen_due == {True, False}  # the stream exercises both outcomes


@pytest.mark.slow
def test_winning_probe_continues_bit_identically_and_report_reads_the_run(tmp_path):
    cfg = tiny_config()
    run = tmp_path / "run"
    s = OnlineTune(cfg, run, progress=False).run()
    first = sorted((run / "train").iterdir())[0]
    start = json.loads((first / "online_segment.json").read_text())["start"]
    assert "probes" in start  # the first segment continues the cold start's winner
    # successive halving: the winner is a second-rung probe, which continued its own
    # first-rung probe's checkpoint (the chain first rung -> second rung -> segment is
    # checked against one plain run below)
    assert "-cold2-" in Path(start).name
    cold = next(d for d in decisions(run) if d["decision"].startswith("continue with"))
    winner = next(m for m in cold["measurements"] if m["probe"] == Path(start).name)
    first_rung = json.loads((run / "probes" / winner["continues"] / "summary.json").read_text())
    assert "-cold-" in winner["continues"] and 0 < first_rung["samples"]
    # one launch: it checked at the end of epoch 1 (keep training) and stopped at the end
    # of epoch 2, where the rule was due
    seg_summary = json.loads((first / "summary.json").read_text())
    assert seg_summary["stop_reason"] == "steady_state" and seg_summary["samples"] == 2048
    checks = [json.loads(x) for x in (first / "plateau_checks.jsonl").read_text().splitlines()]
    assert [(c["samples"], c["due"]) for c in checks] == [(1024, False), (2048, True)]
    # a plain run from scratch of the segment's own config (the winner's configuration,
    # stopping at the segment's end, without the checks): the probe, then its
    # continuation, must equal it
    plain_cfg = RunConfig.from_toml(first / "config.toml")
    assert all(c["window_samples"] == 1024 for c in checks)
    plain_cfg = plain_cfg.replace(train=dataclasses.replace(plain_cfg.train, max_samples=2048))
    Trainer(plain_cfg, tmp_path / "plain", progress=False).run()
    # the segment continued the probe: its first tick follows the probe's last sample
    probe_samples = json.loads((Path(start) / "summary.json").read_text())["samples"]
    first_tick = json.loads((first / "ticks.jsonl").read_text().splitlines()[0])
    assert 0 < probe_samples < first_tick["samples"] <= probe_samples + 32
    got = load_checked(first / "checkpoint.pt")
    want = load_checked(tmp_path / "plain" / "checkpoint.pt")
    assert got["runtime"]["samples"] == want["runtime"]["samples"] == 2048
    assert torch.equal(got["protocol"]["weights"], want["protocol"]["weights"])
    assert torch.equal(
        got["protocol"]["optimizer"][0]["momentum_buffer"],
        want["protocol"]["optimizer"][0]["momentum_buffer"],
    )
    # the run's records: the whole timeline, tuning counted
    assert s["tuned"] and 0 < s["tuning_share"] < 1
    assert s["tuning_virtual_s"] > 0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["total_virtual_s"] >= r["virtual_s"] for r in recs)
    assert recs[-1]["total_virtual_s"] > recs[-1]["virtual_s"]  # losers' seconds added
    # every decision's measurements: the run's own from before its decision point, probes
    # from the snapshot taken there (never the run's later segments)
    checked = 0
    for d in decisions(run):
        for m in d.get("measurements", []):
            if "from_clock_s" in m:
                assert m["from_clock_s"] == d["run_clock_s"]
            else:
                assert m["virtual_s"] <= d["run_clock_s"]
            checked += 1
    assert checked >= 7  # 3 cold-start probes, 2 evaluations, 4 steady-state probes
    # each check's decision says which condition held, with the fall it measured
    checks = [d for d in decisions(run) if d["decision"] in ("keep training", "re-optimise")]
    assert [d["decision"] for d in checks] == ["keep training", "re-optimise"]
    for d in checks:
        used = d["measurements"]
        if len(used) < 2:
            assert d["reason"].startswith("fewer than two evaluations")
            continue
        then, now = (m["train_loss"] for m in used)
        fell = 100 * (then - now) / then
        way = "fell" if fell >= 0 else "rose"
        assert d["reason"].startswith(f"training loss {way} by {abs(fell):.3g}% ")
        said = "at least" if fell >= 10 else "less than" if fell >= 0 else "not"
        assert f"): {said} the rule's 10% fall" in d["reason"]
        assert (d["decision"] == "re-optimise") == (fell < 10)
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0


@pytest.mark.slow
def test_resume_of_a_run_killed_mid_probe_gives_the_same_decisions(tmp_path, monkeypatch):
    cfg = tiny_config()
    whole = tmp_path / "whole"
    OnlineTune(cfg, whole, progress=False).run()

    made = {"steady": 0}

    class KillSecondSteadyProbe(Trainer):
        def __init__(self, cfg, out_dir, *args, **kwargs):
            super().__init__(cfg, out_dir, *args, **kwargs)
            if "steady" in str(out_dir):
                made["steady"] += 1
                if made["steady"] == 2:
                    ticks = []

                    def kill(tick, trainer):
                        ticks.append(tick)
                        if len(ticks) == 3:
                            raise KeyboardInterrupt

                    self.on_tick = kill

    killed = tmp_path / "killed"
    monkeypatch.setattr(probes, "Trainer", KillSecondSteadyProbe)
    with pytest.raises(KeyboardInterrupt):
        OnlineTune(cfg, killed, progress=False).run()
    cut = sorted((killed / "probes").iterdir())[-1]
    assert "steady" in cut.name and not (cut / "online_probe.json").exists()
    monkeypatch.setattr(probes, "Trainer", Trainer)
    s = train_tuned(None, killed, resume=True)
    assert decisions(killed) == decisions(whole)
    # a resume of the run that ended: nothing runs, its summary (walls included) stays
    assert train_tuned(None, killed, resume=True) == s
    assert json.loads((killed / "summary.json").read_text()) == s
    assert s["samples"] == json.loads((whole / "summary.json").read_text())["samples"]
    assert torch.equal(
        load_checked(killed / "checkpoint.pt")["protocol"]["weights"],
        load_checked(whole / "checkpoint.pt")["protocol"]["weights"],
    )


@pytest.mark.parametrize(
    "sets, names",
    [
        (["train.metric=loss"], "train.metric"),
        (["optimizer.name=adam"], "optimizer.name"),
        (["runtime=local"], "runtime"),
        # issue 18: both were overridden silently (evaluated anyway; trained hardsync)
        (["train.evaluate=false"], "train.evaluate = false"),
        (["protocol.name=local_sgd"], "protocol.name = 'local_sgd'"),
        (["tune.check_epochs=0"], "tune.check_epochs = 0"),
        # found by a fresh-user review: the same probe ran twice
        (["tune.lrs=[0.01, 0.01, 0.001]"], "without repeated values"),
        (["tune.steady_promote=0"], "tune.steady_promote = 0"),
    ],
)
def test_bad_tune_combinations_are_one_line_and_exit_2(tmp_path, capsys, sets, names):
    path = tmp_path / "c.toml"
    path.write_text(tiny_config().to_toml())
    args = ["train", str(path), "--tune", "--out", str(tmp_path / "r"), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0], err
    assert not (tmp_path / "r" / "summary.json").exists()


def test_tune_with_resume_is_refused(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path), "--tune"]) == 2
    assert "--tune" in capsys.readouterr().err


def test_a_run_directory_that_holds_a_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run"):
        OnlineTune(tiny_config(), run, progress=False).run()
    shutil.rmtree(run)
    # a second review: --tune wrote into distsgd tune's directory (its decisions.jsonl
    # replaced), and distsgd tune beside a training run's checkpoint
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_config().to_toml())
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "tune.json").write_text("{}")
    assert main(["train", str(cfg), "--tune", "--out", str(offline), "--quiet"]) == 2
    assert "already holds a run (tune.json)" in capsys.readouterr().err
    assert (offline / "tune.json").read_text() == "{}" and len(list(offline.iterdir())) == 1
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "checkpoint.pt").write_text("")
    assert main(["tune", str(cfg), "--out", str(trained), "--quiet"]) == 2
    assert "already holds a training run" in capsys.readouterr().err


def test_a_batch_beyond_the_training_set_is_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    """A second review: the run's own λ·b above the training set failed after measuring
    the device and left a directory that --resume replayed the error from."""
    measured = []
    monkeypatch.setattr(setup, "with_device_profile", lambda *a, **k: measured.append(1))
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_config().replace(protocol=dataclasses.replace(
        tiny_config().protocol, batch_size=2048)).to_toml())  # fmt: skip
    out = tmp_path / "r"
    assert main(["train", str(cfg), "--tune", "--out", str(out), "--quiet"]) == 2
    assert "needs 2048 samples per iteration but the training set has 1024" in (
        capsys.readouterr().err
    )
    assert not measured and (not out.exists() or not list(out.iterdir()))


def test_tune_measures_the_device_at_the_threads_a_run_of_its_config_uses(tmp_path, monkeypatch):
    """A second review: --tune measured (and cached) the device profile at torch's current
    thread count, not train.num_threads, so it simulated another device than a plain run
    of the same config."""
    threads = []

    def profile(cfg, ds, code=None):
        threads.append(torch.get_num_threads())
        return cfg, False

    monkeypatch.setattr(setup, "with_device_profile", profile)
    torch.set_num_threads(2)
    OnlineTune(tiny_config(num_threads=1), tmp_path / "r", progress=False)._setup(False)
    assert threads == [1]


class _EchoingTqdm:
    """online's tqdm, silent, its ``write`` (decision lines) into ``shown``."""

    def __init__(self, shown):
        self.shown = shown

    def __call__(self, *args, **kwargs):
        return tqdm(disable=True)

    def write(self, text):
        self.shown.append(text)


def test_a_budget_too_small_says_so_and_trains_with_the_best_probe(tmp_path, monkeypatch):
    # 0.2 · 0.1 s for 3 planned probes is below ¼ of tune.probe_seconds (0.05 s): one
    # probe of 0.0125 s fits, and the run trains with it
    assert budget.probe_seconds_for(0.05, 0.1, 3) == (0.0125, 1)
    with pytest.warns(ConfigWarning, match="too small for the full cold start") as said:
        s = OnlineTune(tiny_config(max_virtual_seconds=0.1), tmp_path / "r", progress=False).run()
    assert s["num_probes"] == 1 and s["samples"] > 0
    # one probe ranks nothing: no warning that short probes rank by noise (a user's review)
    assert not [w for w in said if "tune.score_window" in str(w.message)]
    assert s["stop_reason"] == "max_virtual_seconds"
    first = json.loads((tmp_path / "r" / "decisions.jsonl").read_text().splitlines()[1])
    assert first["decision"] == "budget too small: fewer probes"
    # on screen once: the warning, not also its decision line (a fresh-user review)
    shown: list[str] = []
    tune = OnlineTune(tiny_config(max_virtual_seconds=0.1), tmp_path / "q", progress=True)
    monkeypatch.setattr(online, "tqdm", _EchoingTqdm(shown))
    with pytest.warns(ConfigWarning, match="too small for the full cold start"):
        tune.run()
    assert shown and not [x for x in shown if "too small for the full cold start" in x]


def test_a_budget_too_small_for_the_cold_start_has_no_steady_state_rounds(tmp_path):
    # found by a fresh-user review: the cold start kept to one probe of its budget, then
    # two steady-state rounds of one probe per grid point ran 3x the run's whole budget.
    # 3 epochs at hardsync's rate hold far less than 0.2 of them for probes of 100 s
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=100.0))
    run = tmp_path / "r"
    with pytest.warns(ConfigWarning, match="without steady-state rounds") as said:
        s = OnlineTune(cfg, run, progress=False).run()
    # the line names where its budget came from (found by a fresh-user review)
    assert any("train.max_epochs = 3 at hardsync's predicted rate" in str(w.message) for w in said)
    assert s["num_probes"] >= 1 and s["samples"] == 3 * 1024
    assert not list(run.glob("probes/*-steady*"))
    assert not [d for d in decisions(run) if d["decision"] in ("keep training", "re-optimise")]
    (seg,) = (run / "train").iterdir()
    assert not (seg / "plateau_checks.jsonl").exists()  # no checks


def test_on_real_processes_the_sample_budget_sizes_the_probes_too(tmp_path):
    # found by a fresh-user review: on dist a run limited by epochs had "no time budget",
    # and its winning probe trained all of them. Its budget is now the predicted wall
    # seconds of its samples at hardsync's rate, as on sim (no rank starts here)
    cfg = tiny_config().replace(runtime="dist")
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=100.0))
    tune = OnlineTune(cfg, tmp_path / "r", progress=False)
    tune._setup(resume=False)
    layout = Candidate(
        "hardsync", tune.layout.num_learners, cfg.protocol.batch_size, 0.1, 0.0
    ).layout()
    per_sample = pm.seconds_per_iteration(layout, tune.cluster) / pm.samples_per_iteration(layout)
    assert tune.budget.time_budget_s == pytest.approx(3 * 1024 * per_sample)
    b = tune.budget
    assert b.max_probes and b.probe_s < 100.0 and b.steady_rounds == 0


def test_probes_leave_a_run_limited_by_epochs_most_of_its_samples(tmp_path):
    # issue 18: with tune.probe_seconds far above what max_epochs allows, the winning probe
    # trained all the epochs and the run continued for none (one evaluation, at the end)
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=5.0))
    run = tmp_path / "r"
    s = OnlineTune(cfg, run, progress=False).run()
    limit = 3 * 1024  # max_epochs · training samples

    def samples(probe):
        return json.loads((run / "probes" / probe / "summary.json").read_text())["samples"]

    cold = [p.name for p in sorted(run.glob("probes/*-cold-*"))]
    # a second rung continues its first rung's checkpoint: only the samples it added count
    measured = next(d for d in decisions(run) if d["decision"].startswith("continue with"))
    added = [
        samples(m["probe"]) - samples(m["continues"])
        for m in measured["measurements"]
        if "continues" in m
    ]
    # the cold start's probes share 0.2 of the run's samples (at hardsync's rate), plus at
    # most one iteration's overshoot of their clock limit per probe: under 0.25 in all
    assert cold and sum(map(samples, cold)) + sum(added) <= 0.25 * limit
    assert s["samples"] == limit and len(read_metrics(run / "metrics.jsonl")) > 1


@pytest.mark.slow
def test_a_second_rung_equals_a_full_length_probe_and_first_rung_1_has_none(tmp_path):
    # probe_seconds fixed by the budget: the same probe length with and without halving
    cfg = tiny_config(max_virtual_seconds=2.0)
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=0.02, first_rung=1.0))
    assert budget.planned_probes(cfg.tune) == 3.0
    halved = dataclasses.replace(cfg.tune, first_rung=0.25, promote=2)
    # 2 first rungs, at most 2 second rungs (of the grid's 2), the joint probe full length
    assert budget.planned_probes(halved) == pytest.approx(2 * 0.25 + 2 * 0.75 + 1)
    # 3 first rungs: the promoted 2 and the next larger η than the best at g = 1
    three = dataclasses.replace(halved, lrs=[0.1, 0.01, 0.001])
    assert budget.planned_probes(three) == pytest.approx(3 * 0.25 + 3 * 0.75 + 1)
    one = dataclasses.replace(three, promote=1, extra_probes=0)
    assert budget.planned_probes(one) == pytest.approx(3 * 0.25 + 2 * 0.75)
    full = OnlineTune(cfg, tmp_path / "full", progress=False)
    full.run()
    names = [p.name for p in (tmp_path / "full" / "probes").iterdir()]
    assert names and not [n for n in names if "cold2" in n or "steady2" in n]
    cold = next(
        d for d in decisions(tmp_path / "full") if d["decision"].startswith("continue with")
    )
    assert "second rung" not in cold["reason"]
    assert not [m for m in cold["measurements"] if "continues" in m]
    by_label = {m["label"]: m for m in cold["measurements"]}
    # with halving: a first rung, then its continuation, is the full-length probe of the
    # same candidate: it ends on the same iteration and scores the same losses (issue 18:
    # the second rung ran its full length on top of the first rung's overshoot and scored
    # its own losses only)
    half = OnlineTune(cfg.replace(tune=halved), tmp_path / "half", progress=False)
    half.run()
    assert half.budget.probe_s == full.budget.probe_s == 0.02 and half.budget.rung_s == 0.005
    cold = next(
        d for d in decisions(tmp_path / "half") if d["decision"].startswith("continue with")
    )
    chained = [m for m in cold["measurements"] if "-cold2-" in m["probe"]]
    assert len(chained) == 2
    for m in chained:
        want = by_label[m["label"]]
        assert m["from_clock_s"] == want["from_clock_s"] == 0.0
        assert m["measured_until_clock_s"] == pytest.approx(want["measured_until_clock_s"])
        assert m["score"] == pytest.approx(want["score"], rel=1e-12)


@pytest.mark.slow
def test_the_next_larger_lr_than_the_best_gets_a_second_rung_chance(tmp_path, monkeypatch):
    """Short probes prefer smaller η: when a smaller η leads g = 1's first rung, the next
    larger one that did not diverge continues to the second rung too (issue 18: η 0.1's
    loss spike at its 21st iteration ranked it third after 1 s, and the run trained at η
    0.01, a decade lower, to 2.4x the swept-best DDP's wall)."""
    probe = ProbeChains.probe
    shift = {}

    def shifted(self, cand, snapshot, until_clock_s=None, kind=None):
        # η 0.1's first rung (at the run's b, 32) moved to lead (-10) or to rank last (+10)
        r = probe(self, cand, snapshot, until_clock_s, kind)
        if snapshot == "initial" and cand.lr == 0.1 and cand.batch_size == 32:
            r.losses = [x + shift["by"] for x in r.losses]
        return r

    monkeypatch.setattr(ProbeChains, "probe", shifted)
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, first_rung=0.25, promote=1))
    for name, by in (("leads", -10.0), ("spiked", 10.0)):
        shift["by"] = by
        OnlineTune(cfg, tmp_path / name, progress=False).run()

    def second(run):  # the second rung's decisions (not a joint probe's confirmation)
        return [
            d
            for d in decisions(run)
            if d["decision"].startswith("continue hardsync") and "confirmation" not in d["reason"]
        ]

    # η 0.1 leads its first rung: one second rung (promote = 1), no extra
    assert [("η=0.1 " in d["decision"]) for d in second(tmp_path / "leads")] == [True]
    got = second(tmp_path / "spiked")
    assert len(got) == 2 and "η=0.1 " not in got[0]["decision"]
    assert "η=0.1 " in got[1]["decision"] and "short-horizon bias" in got[1]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("joint_holds", [False, True], ids=["grid wins", "joint wins"])
def test_a_joint_probe_that_leads_is_confirmed_at_twice_the_length(
    tmp_path, monkeypatch, joint_holds
):
    """Short probes favour a smaller batch: a joint probe that beats the grid's winner at
    the full probe length continues to twice it, as the grid's winner's chain does, and
    the better there continues as the run (the bench's b = 32 probe won 6 of 12 cold
    starts at 2 s, and those runs took 1.18x DDP's wall on average)."""
    probe = ProbeChains.probe

    def scored(self, cand, snapshot, until_clock_s=None, kind=None):
        r = probe(self, cand, snapshot, until_clock_s, kind)
        if cand.batch_size == 16:  # the joint probe (the run's b is 32)
            low = kind == "joint" or joint_holds
            r.losses = [0.0 if low else 100.0] * len(r.losses)
        return r

    monkeypatch.setattr(ProbeChains, "probe", scored)
    run = tmp_path / "r"
    cfg = tiny_config()  # no steady-state round: the tuning overhead is the cold start's
    tune = OnlineTune(
        cfg.replace(tune=dataclasses.replace(cfg.tune, steady_rounds=0)), run, progress=False
    )
    s = tune.run()
    third = sorted(p.name for p in (run / "probes").iterdir() if "-cold3-" in p.name)
    assert len(third) == 2 and "b=16" in third[0] and "b=32" in third[1]
    confirm = [d for d in decisions(run) if "confirmation" in d["reason"]]
    twice = f"to {2 * tune.budget.probe_s:.4g} s"
    assert len(confirm) == 2 and all(twice in d["decision"] for d in confirm)
    won = next(d for d in decisions(run) if d["decision"].startswith("continue with"))
    assert "twice the probe length" in won["reason"]
    assert ("b=16" in won["decision"]) == joint_holds
    assert s["batch_size"] == (16 if joint_holds else 32)
    # the winner's chain (its first probe and later rungs) continues as the run; every
    # other probe, the other chain's included, is tuning overhead
    by_name = {m["probe"]: m for m in won["measurements"]}
    winner = next(m for m in won["measurements"] if "-cold3-" in m["probe"] and (
        "b=16" in m["label"]) == joint_holds)  # fmt: skip
    kept, m = set(), winner
    while m is not None:
        kept.add(m["probe"])
        m = by_name.get(m.get("continues"))
    # joint: its confirmation, the joint probe and the grid winner's first rung it
    # continued (a batch change); grid: the confirmation, the second and the first rung
    assert len(kept) == 3
    assert ("-joint-" in by_name[winner["continues"]]["probe"]) == joint_holds
    lost = [m for m in won["measurements"] if m["probe"] not in kept]
    assert s["tuning_virtual_s"] == pytest.approx(
        sum(m["measured_until_clock_s"] - _rung_start(m, by_name) for m in lost)
    )


def test_a_joint_probe_continues_the_grid_winners_first_rung_with_its_batch(tmp_path):
    """A hardsync joint probe that differs from the grid's winner only in batch and η
    continues the winner's first rung (its batch changed there) to the clock at which the
    winner's chain ends, on the next samples of the epoch: the two compare from a common
    snapshot and the first rung is not trained again (issue 18: a joint probe from the
    initial model cost 2 of the bench's 5 cold-start training seconds)."""
    run = tmp_path / "r"
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, steady_rounds=0))
    OnlineTune(cfg, run, progress=False).run()
    cold = next(d for d in decisions(run) if d["decision"].startswith("continue with"))
    by_name = {m["probe"]: m for m in cold["measurements"]}
    joint = next(m for m in cold["measurements"] if "-joint-" in m["probe"])
    root = by_name[joint["continues"]]
    assert "-cold-" in root["probe"] and "b=32" in root["label"] and "b=16" in joint["label"]
    assert root["from_clock_s"] == joint["from_clock_s"] == 0.0
    line = next(d for d in decisions(run) if d["phase"] == "joint")  # as the grid's lines
    assert line["snapshot"] == f"probes/{root['probe']}"
    assert line["seconds_per_iteration"] == joint["seconds_per_iteration"]
    # the grid's winner: the second rung that continued the same first rung; both end at
    # the full probe length, within an iteration of each other
    grid = next(m for m in cold["measurements"] if m.get("continues") == root["probe"] and (
        "-cold2-" in m["probe"]))  # fmt: skip
    step = max(grid["seconds_per_iteration"], joint["seconds_per_iteration"])
    assert abs(joint["measured_until_clock_s"] - grid["measured_until_clock_s"]) < step
    assert joint["measured_until_clock_s"] > root["measured_until_clock_s"]
    # the data: the first tick after the branch is one b = 16 step past the first rung's
    # samples, and the stream's position is the run's samples at b = 16 (1024 samples an
    # epoch: no sample skipped or drawn twice)
    probes = run / "probes"
    root_samples = json.loads((probes / root["probe"] / "summary.json").read_text())["samples"]
    ticks = (probes / joint["probe"] / "ticks.jsonl").read_text().splitlines()
    assert json.loads(ticks[0])["samples"] == root_samples + 16
    samples = json.loads((probes / joint["probe"] / "summary.json").read_text())["samples"]
    (stream,) = load_checked(probes / joint["probe"] / "checkpoint.pt")["runtime"]["streams"]
    assert (stream["epoch"] * 64 + stream["step"]) * 16 == samples


@pytest.mark.parametrize(
    "old, new, steps",
    [(64, 32, 6), (32, 64, 7), (32, 64, 8), (16, 48, 5), (32, 48, 14)],
    ids=["halved", "doubled odd", "doubled even", "not a divisor", "past the epoch"],
)
def test_a_batch_change_continues_at_the_same_sample_of_the_epoch(tmp_path, old, new, steps):
    """A learner stream's position saved at another batch: every learner's next minibatch
    at the new batch starts at the first step boundary at or after the samples drawn
    (none drawn twice, less than a step skipped; the next epoch's first step where none
    is left in this one)."""
    n, lam = 1000, 2
    before = ShardedSampler(n, lam, old, seed=3)
    streams = [LearnerStream(before, learner) for learner in range(lam)]
    drawn = set()
    for _ in range(steps):
        for st in streams:
            drawn.update(st.next_indices().tolist())
    saved = [st.state_dict() for st in streams]
    after = ShardedSampler(n, lam, new, seed=3)
    offset = steps * lam * old
    for learner, state in enumerate(saved):
        st = LearnerStream(after, learner)
        st.load_state_dict(state)
        start = st.step * lam * new
        if st.epoch == 1:  # nothing of the epoch left at the new batch
            assert st.step == 0 and offset + lam * new > after.samples_per_epoch
            continue
        assert st.epoch == 0 and offset <= start < offset + lam * new
        rest = after.permutation(0)[start : after.samples_per_epoch]
        assert not drawn & set(rest.tolist())
    # the same batch: the same position
    for learner, state in enumerate(saved):
        st = LearnerStream(before, learner)
        st.load_state_dict(state)
        assert (st.epoch, st.step) == (state["epoch"], state["step"])


def _rung_start(m, by_name):
    """The clock at which a probe of a chain began: where the probe it continues ended."""
    parent = by_name.get(m.get("continues"))
    return parent["measured_until_clock_s"] if parent is not None else m["from_clock_s"]


def _exploding(monkeypatch, lrs):
    """Probes at ``lrs`` record losses a million times their own: blown up, not NaN."""
    run_probe = ProbeChains._run_probe

    def exploding(self, cfg, run_dir, start):
        run_probe(self, cfg, run_dir, start)
        if cfg.optimizer.lr in lrs:
            ticks = [json.loads(x) for x in (run_dir / "ticks.jsonl").read_text().splitlines()]
            for i, t in enumerate(ticks):
                t["loss"] *= 1.0 if i == 0 else 1e6
            (run_dir / "ticks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ticks))

    monkeypatch.setattr(ProbeChains, "_run_probe", exploding)


@pytest.mark.slow
def test_a_probe_whose_loss_blows_up_without_nan_diverged(tmp_path, monkeypatch, capsys):
    """A user's review: η = 10 scored 1.6e26 and counted as stable (only NaN did), so a
    cold start of η in {10, 5} chose η = 5, and a blown-up η set the steady state's rate
    ceiling. Now it is pruned as a NaN, and the ceiling is that of the stable rates."""
    _exploding(monkeypatch, {0.1})
    run = tmp_path / "r"
    tune = OnlineTune(tiny_config(), run, progress=False)
    s = tune.run()
    d = decisions(run)
    assert any(x["decision"] == "probe hardsync λ=1 b=32 η=0.1 μ=0.9: NaN" for x in d)
    won = next(x for x in d if x["decision"].startswith("continue with"))
    assert "η=0.1 " not in won["decision"] and s["lr"] != 0.1
    assert tune.steady.rate_ceiling(Candidate("hardsync", 1, 32, 0.01, 0.9)) < effective_rate(
        0.1, 0.9
    )
    # every cold-start probe blown up: the documented refusal, one line, exit 2
    _exploding(monkeypatch, {0.1, 0.01})
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_config().to_toml())
    assert main(["train", str(cfg), "--tune", "--out", str(tmp_path / "all"), "--quiet"]) == 2
    assert "every cold-start probe diverged" in capsys.readouterr().err


@pytest.mark.slow
def test_check_epochs_sets_where_and_over_what_span_the_run_checks(tmp_path):
    # half-epoch checks (512 samples): the run re-optimises at the first multiple of 512
    # where the training loss fell by less than 10% over the last 512 samples; with
    # one-epoch checks (the tiny runs above) only at the end of epoch 2
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, check_epochs=0.5))
    run = tmp_path / "r"
    OnlineTune(cfg, run, progress=False).run()
    first = sorted((run / "train").iterdir())[0]
    checks = [json.loads(x) for x in (first / "plateau_checks.jsonl").read_text().splitlines()]
    assert all(c["window_samples"] == 512 for c in checks)
    assert [c["samples"] % 512 for c in checks] == [0] * len(checks) and checks[-1]["due"]
    records = read_metrics(first / "metrics.jsonl")
    for c in checks:  # each the rule over 512 samples, from the records up to its point
        assert steady_state_due(records, c["samples"], 512) == (c["due"], c["used"])
    due = [d for d in decisions(run) if d["decision"] == "re-optimise"]
    assert due and "10% fall between evaluations at least 0.5 epoch apart" in due[0]["reason"]
    used = [m["samples"] for m in due[0]["measurements"]]  # the span actually compared
    assert f"over {(used[1] - used[0]) / 1024:.3g} epoch (" in due[0]["reason"]
    assert due[0]["measurements"][-1]["samples"] == checks[-1]["samples"]


@pytest.mark.parametrize(
    "then, now, says",
    [
        (1.0, 0.85, "fell by 15% over 0.5 epoch (1 at 0 samples to 0.85 at 512): at least"),
        (1.0, 0.95, "fell by 5% over 0.5 epoch (1 at 0 samples to 0.95 at 512): less than"),
        (1.0, 1.1, "rose by 10% over 0.5 epoch (1 at 0 samples to 1.1 at 512): not"),
    ],
)
def test_a_check_line_says_what_it_compared_and_reads_right_for_a_rise(tmp_path, then, now, says):
    # a fresh-user review: "rose by 11% …: less than the rule's 10%" read as a contradiction
    tune = OnlineTune(tiny_config(), tmp_path / "r", progress=False)
    tune._setup(resume=False)
    log = DecisionLog()
    chains = SimpleNamespace(clock=probes.RunClock.of(True))
    steady = SteadyState(ProbeRounds(chains, log, tune.settings, tune.budget), {}, tune.num_train)
    used = [{"samples": 0, "train_loss": then}, {"samples": 512, "train_loss": now}]
    due = (then - now) / then < 0.1
    steady.log_check({"due": due, "used": used}, rounds=0)
    (line,) = [d for d in log.entries if d["phase"] == "steady state"]
    assert line["reason"].startswith("training loss " + says)
    assert line["reason"].endswith("the rule's 10% fall between evaluations at least 1 epoch apart")


def test_steady_grid_steps_down_only_from_the_top_decade_of_rates():
    momenta = [0.0, 0.9]
    # within a decade of the highest stable rate (1.0): the whole grid, as before
    assert steady_grid(0.1, 0.9, momenta, 1.0) == [
        (0.1, 0.9),
        (0.1 / 10, 0.9),
        (0.1, 0.0),
        (0.1 / 10, 0.0),
    ]
    assert len(steady_grid(0.05, 0.9, momenta, 1.0)) == 4  # effective rate 0.5
    # a decade below it (η 0.01, μ 0.9: 0.1 up to float noise): no step down; the input
    # of bench/tune_online_vs_ddp.py's seed 1 that stalled at 0.87-0.895 for 10 epochs
    assert steady_grid(0.01, 0.9, momenta, 0.1 / (1 - 0.9)) == [(0.01, 0.9)]
    # a higher rate (μ up) or the same one (η/10 with μ 0.9) only
    assert steady_grid(0.01, 0.0, momenta, 1.0) == [(0.01, 0.0), (0.01, 0.9), (0.001, 0.9)]


def test_steady_grid_on_hardsync_probes_one_momentum_per_effective_rate():
    momenta = [0.0, 0.9]
    # (0.1, 0) has (0.01, 0.9)'s rate 0.1: the larger μ (first in the order) is kept;
    # (0.01, 0) is two decades below the incumbent's rate: not in this round
    assert steady_grid(0.1, 0.9, momenta, 1.0, one_per_rate=True) == [(0.1, 0.9), (0.01, 0.9)]
    # the incumbent's μ is kept whatever its place: (0.01, 0.9) has the incumbent's rate
    assert steady_grid(0.1, 0.0, [0.0, 0.9], 0.5, one_per_rate=True) == [
        (0.1, 0.0),
        (0.1, 0.9),
        (0.1 / 10, 0.0),
    ]
    four = steady_grid(0.05, 0.9, [0.0, 0.3, 0.6, 0.9], 1.0, one_per_rate=True)
    rates = [lr / (1 - mu) for lr, mu in four]
    assert len({round(r, 12) for r in rates}) == len(rates) == 4
    assert min(rates) == pytest.approx(0.05) and (0.05, 0.0) not in four
    # without it (compute groups: asynchrony's implicit momentum) the whole grid
    assert len(steady_grid(0.1, 0.9, momenta, 1.0)) == 4


@pytest.mark.slow
def test_a_steady_state_round_that_promotes_one_continues_its_best_first_rung(tmp_path):
    # tune.steady_promote = 1 (default): no steady2 probe, the best first rung continues as
    # the run; = 2: the two best first rungs continue to the full length, as the cold start
    cfg = tiny_config()
    halved = dataclasses.replace(cfg.tune, first_rung=0.25, promote=2)
    one, two = tmp_path / "one", tmp_path / "two"
    OnlineTune(cfg.replace(tune=halved), one, progress=False).run()
    names = [p.name for p in (one / "probes").iterdir()]
    assert [n for n in names if "-steady-" in n] and not [n for n in names if "steady2" in n]
    assert len([n for n in names if "cold2" in n]) == 2
    won = [d for d in decisions(one) if d["decision"].startswith("continue with hardsync")]
    steady_won = [d for d in won if d["phase"] == "steady state"]
    assert steady_won and all("continues" not in m for m in steady_won[0]["measurements"])
    segs = sorted((one / "train").iterdir())
    start = json.loads((segs[1] / "online_segment.json").read_text())["start"]
    assert "-steady-" in Path(start).name  # the first-rung probe itself continued
    both = dataclasses.replace(halved, steady_promote=2)
    OnlineTune(cfg.replace(tune=both), two, progress=False).run()
    assert len([p for p in (two / "probes").iterdir() if "steady2" in p.name]) == 2
    # both ways a round's probes are scored paired: the mean loss over the iterations
    # every probe (every chain) of the round trained, read back from their ticks
    for run, rung in ((one, "-steady-"), (two, "-steady2-")):
        won = next(d for d in decisions(run) if d["decision"].startswith("continue with hardsync")
                   and d["phase"] == "steady state")  # fmt: skip
        by_name = {m["probe"]: m for m in won["measurements"]}
        probed = [m for m in won["measurements"] if rung in m["probe"]]
        assert len(probed) == 2
        chains = [_chain_losses(run, by_name, m) for m in probed]
        span = min(len(c) for c in chains)
        for m, chain in zip(probed, chains, strict=True):
            assert m["paired_iterations"] == span > 0
            assert m["score"] == pytest.approx(sum(chain[:span]) / span, rel=1e-12)


def _chain_losses(run, by_name, m):
    """A probe's training losses from its ticks, those of the probes it continues first."""
    parent = by_name.get(m.get("continues"))
    ticks = (run / "probes" / m["probe"] / "ticks.jsonl").read_text().splitlines()
    earlier = _chain_losses(run, by_name, parent) if parent else []
    return earlier + [json.loads(t)["loss"] for t in ticks]


def test_pair_scores_compares_a_round_on_the_iterations_all_of_it_trained():
    """The steady state's probes share a snapshot and a layout (the same minibatches):
    each is scored over the first iterations they all trained, not over its own last
    ``score_window`` (issue 18: that window kept η on a b = 32 run twice, which then
    trained 300,032 samples to 90% against 105,024 where it stepped)."""
    base = Candidate("hardsync", 2, 32, 0.05, 0.9)
    keep = ProbeResult(base, "s", losses=[0.3, 0.3, 0.3, 0.2, 0.2], score_window=2)
    step = ProbeResult(dataclasses.replace(base, lr=0.005), "s", losses=[0.25, 0.25, 0.25, 0.3])
    step.score_window = 2
    assert keep.score < step.score  # own last two: keep η
    assert pair_scores([keep, step]) == 4
    assert step.score == pytest.approx(0.2625) and keep.score == pytest.approx(0.275)
    # a second rung pairs over its chain (the first rung's losses first)
    cont = ProbeResult(base, "s", losses=[0.1], earlier_losses=[0.5, 0.5])
    other = ProbeResult(dataclasses.replace(base, lr=0.005), "s", losses=[0.4, 0.4, 0.4])
    assert pair_scores([cont, other]) == 3
    assert cont.score == pytest.approx(1.1 / 3)
    # diverged probes are left out; other layouts are not paired
    nan = ProbeResult(base, "s", losses=[9.0], diverged=True)
    assert pair_scores([keep, step, nan]) == 4 and nan.paired_span == 0
    other_b = ProbeResult(dataclasses.replace(base, batch_size=16), "s", losses=[0.1])
    fresh = ProbeResult(base, "s", losses=[0.3, 0.2])
    assert pair_scores([fresh, other_b]) == 0 and fresh.paired_span == 0


def test_a_losing_larger_batch_probe_leaves_the_steady_state_its_rounds(tmp_path, monkeypatch):
    """A user's review: the joint search's b = 100 probe (η scaled 12.5x with the batch)
    lost, yet its rate became the ceiling against which the b = 8 winner's rate was "a
    decade below", and the run trained to the end without checks. Rates compare per
    sample of an iteration now; a batch beyond the training set is skipped."""
    probe = ProbeChains.probe

    def losing(self, cand, snapshot, until_clock_s=None, kind=None):
        r = probe(self, cand, snapshot, until_clock_s, kind)
        if cand.batch_size == 320:  # loses, but stable (not 10x the initial loss)
            r.losses = [5.0] * len(r.losses)
        return r

    monkeypatch.setattr(ProbeChains, "probe", losing)
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, batch_sizes=[320, 2048], extra_probes=2))
    run = tmp_path / "r"
    tune = OnlineTune(cfg, run, progress=False)
    s = tune.run()
    assert list(run.glob("probes/*-joint-*b=320*")) and s["batch_size"] == 32
    assert list(run.glob("probes/*-steady-*"))  # the winner's round was not taken away
    assert tune.steady.rate_ceiling(Candidate("hardsync", 1, 32, 0.1, 0.9)) == pytest.approx(
        effective_rate(0.1, 0.9)
    )
    # λ·b = 2048 > 1024 training samples: left out with a decision, not a failed run
    (skip,) = [d for d in decisions(run) if d["decision"].startswith("skip ")]
    assert "b=2048" in skip["decision"] and "training set's 1024" in skip["reason"]


def test_a_losing_smaller_batch_rate_leaves_a_larger_batch_winner_its_rounds(tmp_path, monkeypatch):
    """The mirror case, from a second review: η 0.1 at the run's b = 32 loses (stable), the
    joint b = 320 probe (η 0.01 scaled to 0.1) wins; scaled per sample, η 0.1 at b = 32
    made a ceiling of 10 at b = 320, "a decade above" the winner's 1.0, and the run trained
    without checks. The ceiling is that of the winner's own layout."""
    probe = ProbeChains.probe

    def scored(self, cand, snapshot, until_clock_s=None, kind=None):
        r = probe(self, cand, snapshot, until_clock_s, kind)
        if cand.batch_size == 320:
            r.losses = [0.01] * len(r.losses)
        elif cand.lr == 0.1:  # loses, but stable (not 10x the initial loss)
            r.losses = [5.0] * len(r.losses)
        return r

    monkeypatch.setattr(ProbeChains, "probe", scored)
    cfg = tiny_config()
    run = tmp_path / "r"
    tune = OnlineTune(
        cfg.replace(tune=dataclasses.replace(cfg.tune, batch_sizes=[320])), run, progress=False
    )
    s = tune.run()
    assert s["batch_size"] == 320
    winner = Candidate("hardsync", 1, 320, 0.1, 0.9)
    assert tune.steady.rate_ceiling(winner) == pytest.approx(effective_rate(0.1, 0.9))
    assert not [d for d in decisions(run) if "a decade or more below" in d["reason"]]


def test_the_last_round_says_the_run_trains_on_without_checks(tmp_path):
    """A user's review: once tune.steady_rounds were used up the run trained on without
    checks and no decision said so."""
    cfg = tiny_config()
    run = tmp_path / "r"
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, steady_rounds=1))
    OnlineTune(cfg, run, progress=False).run()
    steady = [d for d in decisions(run) if d["phase"] == "steady state"]
    assert steady[-1]["decision"].endswith("to the end without checks")
    assert steady[-1]["reason"] == "the run re-optimised 1 times (tune.steady_rounds = 1)"
    assert len(list(run.glob("probes/*-steady-*"))) >= 1


def test_a_winner_a_decade_below_the_highest_stable_rate_trains_without_rounds(
    tmp_path, monkeypatch
):
    # the cold start's highest stable rate raised 100-fold: the winner may not step down,
    # and tune.momenta holds no higher rate, so no checks and no steady-state probes
    cold_start = ColdStart.run

    def high_ceiling(self):
        best = cold_start(self)
        self.rate_ceilings = {k: 100 * v for k, v in self.rate_ceilings.items()}
        return best

    monkeypatch.setattr(ColdStart, "run", high_ceiling)
    run = tmp_path / "r"
    s = OnlineTune(tiny_config(), run, progress=False).run()
    assert not list(run.glob("probes/*-steady*"))  # the tiny run re-optimises otherwise
    assert [p.name[:3] for p in (run / "train").iterdir()] == ["01-"]
    assert not (next((run / "train").iterdir()) / "plateau_checks.jsonl").exists()
    assert s["samples"] == 3 * 1024 and s["stop_reason"] == "max_epochs/max_samples"
    steady = [d for d in decisions(run) if d["phase"] == "steady state"]
    assert len(steady) == 1 and "to the end without checks" in steady[0]["decision"]
    assert "a decade or more below" in steady[0]["reason"]


@pytest.mark.slow
def test_steady_rounds_0_trains_the_cold_start_winner_to_the_end(tmp_path):
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, steady_rounds=0))
    run = tmp_path / "r"
    s = OnlineTune(cfg, run, progress=False).run()
    assert not list(run.glob("probes/*-steady*"))  # the tiny run re-optimises once by default
    assert [p.name[:3] for p in (run / "train").iterdir()] == ["01-"]
    assert s["samples"] == 3 * 1024 and s["stop_reason"] == "max_epochs/max_samples"
    steady = [d for d in decisions(run) if d["phase"] == "steady state"]
    assert len(steady) == 1 and steady[0]["decision"].endswith("to the end without checks")
    assert steady[0]["reason"] == "tune.steady_rounds = 0: no steady-state re-optimisation"


class PerEpochSegments(RunSegments):
    """The procedure before the run checked steady state itself (issue 18): every epoch a
    segment of its own, each a launch (``Trainer.run(resume=True)`` of the previous one's
    checkpoint, stopping at the epoch's end by its sample budget), the rule applied by the
    tuner to that segment's ``metrics.jsonl`` at its end. Its checks are handed to the run
    loop as the new segment's ``plateau_checks.jsonl`` (the same decisions are logged)."""

    def train(self, cand, start, check_every, overhead_clock_s):
        user, checks = self.cfg.train, []
        budget = [math.ceil(user.max_epochs * self.cfg.data.num_train)] if user.max_epochs else []
        budget += [user.max_samples] if user.max_samples else []
        while True:
            self.count += 1
            seg = self.out / "train" / f"{self.count:02d}-{safe_name(cand.label())}"
            seg.mkdir(parents=True)
            for name in ("checkpoint.pt", "checkpoint.pt.sha256", "metrics.jsonl"):
                if (start / name).exists():
                    shutil.copy2(start / name, seg / name)
            samples0 = json.loads((start / "summary.json").read_text())["samples"]
            check = next_check(samples0, check_every) if check_every else 2**62
            cfg = candidate_config(self.cfg, cand)
            train = dataclasses.replace(user, max_samples=min([check, *budget]), evaluate=True)
            begin = self.elapsed()
            options = RunOptions(record=True)
            Trainer(cfg.replace(train=train), seg, progress=False, options=options).run(resume=True)
            saved = {
                "begin_elapsed_s": begin,
                "end_elapsed_s": self.elapsed(),
                "overhead_clock_s": overhead_clock_s,
                "start": str(start),
            }
            write_json(seg / "online_segment.json", saved)
            self.timeline.append((seg, saved))
            s = json.loads((seg / "summary.json").read_text())
            ends = (
                s["stop_reason"] != "max_epochs/max_samples"
                or (budget and s["samples"] >= min(budget))
                or s["samples"] < check
            )
            if ends:
                break
            due, used = steady_state_due(
                read_metrics(seg / "metrics.jsonl"), s["samples"], check_every
            )
            checks.append({"samples": s["samples"], "virtual_s": s["virtual_s"], "due": due})
            checks[-1]["used"] = used
            if due:
                break
            start = seg
        (seg / "plateau_checks.jsonl").write_text("".join(json.dumps(c) + "\n" for c in checks))
        return seg, bool(ends)


def _strip_segment_names(decs):
    """Decisions with the segment a steady-state probe started from left out of their
    reason (the one-epoch segments are numbered otherwise)."""
    out = []
    for d in decs:
        d = dict(d)
        d["reason"] = " ".join(w for w in d["reason"].split() if not w[:2].isdigit())
        out.append(d)
    return out


@pytest.mark.slow
def test_one_launch_stops_and_decides_as_the_per_epoch_segments_did(tmp_path, monkeypatch):
    # 6 epochs, evaluations every 300 samples (not at the epochs' ends): the rule is due at
    # the end of epoch 2; the round steps the rate a decade down to the highest stable
    # rate's tenth, so no round is left and the run trains to the end without checks
    cfg = small_config(train={"target": 0.0, "max_epochs": 6, "eval_every_samples": 300}, tune=TUNE)
    new, old = tmp_path / "one_launch", tmp_path / "per_epoch"
    OnlineTune(cfg, new, progress=False).run()
    monkeypatch.setattr(online, "RunSegments", PerEpochSegments)
    OnlineTune(cfg, old, progress=False).run()
    # the same decisions: the same checks at the same points from the same evaluations, the
    # same probes and scores
    steady = [
        (d["decision"], d["run_clock_s"], [m["samples"] for m in d["measurements"]])
        for d in decisions(new)
        if d["decision"] in ("keep training", "re-optimise")
    ]
    keep, reopt = "keep training", "re-optimise"
    assert [s[0] for s in steady] == [keep, reopt]
    assert [s[2] for s in steady[1:]] == [[1024, 2048]]
    assert decisions(new)[-1]["decision"].endswith("to the end without checks")
    assert _strip_segment_names(decisions(new)) == _strip_segment_names(decisions(old))
    # the stop points: where the one-epoch segments re-optimised, the one launch stopped
    segs = sorted((new / "train").iterdir())
    assert len(segs) == 2 and len(list((old / "train").iterdir())) == 3
    first = json.loads((segs[0] / "summary.json").read_text())
    assert first["stop_reason"] == "steady_state" and first["samples"] == 2048
    # the same training and the same evaluations, bit for bit
    assert torch.equal(
        load_checked(new / "checkpoint.pt")["protocol"]["weights"],
        load_checked(old / "checkpoint.pt")["protocol"]["weights"],
    )
    walls = ("wall_s", "eval_wall_s", "total_wall_s")
    strip = [
        {k: v for k, v in r.items() if k not in walls} for r in read_metrics(new / "metrics.jsonl")
    ]
    assert strip == [
        {k: v for k, v in r.items() if k not in walls} for r in read_metrics(old / "metrics.jsonl")
    ]
    # every check in the launch saw only the evaluations up to its decision point: later
    # ones poisoned, the rule decides alike
    records = read_metrics(segs[-1] / "metrics.jsonl")
    assert not (segs[-1] / "plateau_checks.jsonl").exists()  # tune.steady_rounds spent
    for seg in segs[:-1]:
        for line in (seg / "plateau_checks.jsonl").read_text().splitlines():
            check = json.loads(line)
            now = check["samples"]
            later = [{**r, "train_loss": 1e9} if r["samples"] > now else r for r in records]
            assert steady_state_due(later, now, 1024) == (check["due"], check["used"])
            assert all(r["samples"] <= now for r in check["used"])


@pytest.mark.slow
def test_resume_of_a_run_killed_mid_segment_gives_the_same_decisions(tmp_path, monkeypatch):
    # killed in the first segment's second epoch, after its check at the end of epoch 1
    cfg = tiny_config()
    whole = tmp_path / "whole"
    OnlineTune(cfg, whole, progress=False).run()

    class KillFirstSegmentInEpochTwo(Trainer):
        def __init__(self, cfg, out_dir, *args, **kwargs):
            super().__init__(cfg, out_dir, *args, **kwargs)
            if Path(out_dir).parent.name == "train" and Path(out_dir).name.startswith("01-"):

                def kill(tick, trainer):
                    if trainer.runtime.samples > 1024 + 200:
                        raise KeyboardInterrupt

                self.on_tick = kill

    killed = tmp_path / "killed"
    monkeypatch.setattr(probes, "Trainer", KillFirstSegmentInEpochTwo)
    with pytest.raises(KeyboardInterrupt):
        OnlineTune(cfg, killed, progress=False).run()
    seg = sorted((killed / "train").iterdir())[0]
    assert not (seg / "online_segment.json").exists()
    made = [json.loads(x) for x in (seg / "plateau_checks.jsonl").read_text().splitlines()]
    assert [(c["samples"], c["due"]) for c in made] == [(1024, False)]
    monkeypatch.setattr(probes, "Trainer", Trainer)
    s = train_tuned(None, killed, resume=True)
    assert decisions(killed) == decisions(whole)
    # a resume of the run that ended: nothing runs, its summary (walls included) stays
    assert train_tuned(None, killed, resume=True) == s
    assert json.loads((killed / "summary.json").read_text()) == s
    assert s["samples"] == json.loads((whole / "summary.json").read_text())["samples"]
    assert torch.equal(
        load_checked(killed / "checkpoint.pt")["protocol"]["weights"],
        load_checked(whole / "checkpoint.pt")["protocol"]["weights"],
    )


def plateau_config(**train):
    """A plain run (with :data:`CHECKS`: a steady-state check every 1024 samples); at η 0.1
    its loss flattens in epoch 2, so the second check is due."""
    return small_config(
        optimizer={"lr": 0.1, "momentum": 0.9},
        train={"target": 0.0, "max_epochs": 6, "eval_every_samples": 256, **train},
    )


CHECKS = RunOptions(steady_check_samples=1024, record=True)


def test_a_plain_run_with_plateau_checks_resumes_without_repeating_them(tmp_path):
    # steady-state checks on their own: killed after its first check, resumed from
    # a checkpoint before it, the run makes each check once, as without the kill,
    # and stops at the second
    # the last checkpoint before the kill: at 512 samples
    cfg = plateau_config(checkpoint_every_evals=3)
    whole = Trainer(cfg, tmp_path / "whole", progress=False, options=CHECKS).run()

    def kill(tick, trainer):
        if trainer.runtime.samples > 1024 + 100:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tmp_path / "killed", progress=False, on_tick=kill, options=CHECKS).run()
    made = (tmp_path / "killed" / "plateau_checks.jsonl").read_text().splitlines()
    assert [json.loads(x)["samples"] for x in made] == [1024]
    resumed = Trainer(cfg, tmp_path / "killed", progress=False, options=CHECKS).run(resume=True)

    def checks(run):
        lines = (run / "plateau_checks.jsonl").read_text().splitlines()
        walls = ("train_wall_s", "wall_s", "eval_wall_s")
        out = []
        for line in lines:
            c = {k: v for k, v in json.loads(line).items() if k not in walls}
            c["used"] = [{k: v for k, v in r.items() if k not in walls} for r in c["used"]]
            out.append(c)
        return out

    got, want = checks(tmp_path / "killed"), checks(tmp_path / "whole")
    assert got == want and [c["samples"] for c in got] == [1024 * (i + 1) for i in range(len(got))]
    assert [c["due"] for c in got] == [False, True]
    assert resumed["stop_reason"] == whole["stop_reason"] == "steady_state"
    assert resumed["samples"] == whole["samples"] == 2048
    assert torch.equal(
        load_checked(tmp_path / "killed" / "checkpoint.pt")["protocol"]["weights"],
        load_checked(tmp_path / "whole" / "checkpoint.pt")["protocol"]["weights"],
    )


def test_a_steady_state_check_scores_the_evaluation_subset(tmp_path):
    """A check reads the training loss only, so its evaluation scores the subset as any
    other before the run's end (it scored the whole test set: on Fashion-MNIST 1.1-1.5 s
    more per check than the 2,000-sample subset, about 5 s of a --tune run's wall)."""
    cfg = plateau_config(eval_samples=64)
    s = Trainer(cfg, tmp_path / "run", progress=False, options=CHECKS).run()
    assert s["stop_reason"] == "steady_state" and s["samples"] == 2048
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["eval_samples"] for r in records if r["samples"] % 1024 == 0] == [64, 64, 64]
    # the run's end by its budget still scores the whole set
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, max_epochs=1))
    s = Trainer(cfg, tmp_path / "budget", progress=False, options=CHECKS).run()
    assert s["stop_reason"] == "max_epochs/max_samples"
    assert read_metrics(tmp_path / "budget" / "metrics.jsonl")[-1]["eval_samples"] == 256


def test_an_interrupted_tuning_run_says_resume_works(tmp_path, capsys, monkeypatch):
    """Ctrl-C mid-probe: a run of --tune has no checkpoint.pt of its own yet, but its
    probes are kept and --resume continues it; the line says so."""
    from distsgd import api
    from distsgd.tuner import online

    out = tmp_path / "run"

    def interrupted(config, out_dir, **kw):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / online.STATE_FILE).write_text(config.to_toml())
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "train_tuned", interrupted)
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_config().to_toml())
    assert main(["train", str(cfg), "--tune", "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        f"distsgd: interrupted; the probes so far are kept in {out} (continue with --resume {out})"
    )


# ---- found by a fresh user's review ------------------------------------------------------


def test_a_running_tune_holds_its_run_directory_against_a_second_writer(tmp_path):
    # a --resume (or a second --tune) into a directory a tuning run holds ran alongside
    # it and broke it (FileNotFoundError in the first one's TensorBoard writer)
    run = tmp_path / "run"
    run.mkdir()
    (run / online.STATE_FILE).write_text(tiny_config().to_toml())  # a tuning run's dir
    holder = RunDirClaim.acquire(run)  # the running tune's claim
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            train_tuned(None, run, resume=True)
        with pytest.raises(ConfigError, match="is in use by another run"):
            train_tuned(tiny_config(), run)
    finally:
        holder.release()
    assert sorted(p.name for p in run.iterdir()) == [online.STATE_FILE]  # nothing written


def test_runs_into_or_resumed_from_inside_a_tuning_run_are_refused(tmp_path, capsys):
    # a fresh-user review: --out RUN/probes wrote a whole run into the tuning run's probes
    # folder, and --resume RUN/probes/001-… rewrote a probe's files as a plain run
    # (and likewise distsgd tune's directories, and distsgd tune --out inside either)
    run, tune = tmp_path / "run", tmp_path / "tune"
    probe, tune_probe = run / "probes" / "001-cold-x", tune / "probes" / "001-probe-x"
    for d in (probe, tune_probe):
        d.mkdir(parents=True)
        (d / "config.toml").write_text(tiny_config().to_toml())
        (d.parent.parent / "decisions.jsonl").write_text("")
    (run / online.STATE_FILE).write_text(tiny_config().to_toml())
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_config().to_toml())
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for argv, inside, says in [
        (["train", str(cfg), "--out", str(run / "probes")], "the run of --tune", "another --out"),
        (["train", str(cfg), "--tune", "--out", str(probe / "x")], "the run of --tune", "--out"),
        (["train", "--resume", str(probe)], "the run of --tune", f"(--resume {run})"),
        (["train", "--resume", str(tune_probe)], "the tune", "choose another --out"),
        (["train", str(cfg), "--out", str(tune / "probes" / "y")], "the tune", "another --out"),
        (["tune", str(cfg), "--out", str(run / "probes" / "t")], "the tuner's", "another --out"),
        (["tune", str(cfg), "--out", str(tune / "probes" / "t")], "the tuner's", "another --out"),
    ]:
        assert main([*argv, "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"is inside {inside}" in err, err
        assert says in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # a decisions.jsonl of the user's own above an ordinary run directory is no tuner's
    (tmp_path / "decisions.jsonl").write_text("")
    assert main(["train", str(cfg), "--out", str(tmp_path / "mine" / "r"), "--quiet"]) == 0


def test_tune_into_an_out_that_is_a_file_is_one_line_exit_2(tmp_path, capsys):
    target = tmp_path / "file.toml"
    target.write_text("x = 1\n")
    for out in (target, target / "sub"):
        args = ["train", "--tune", "--out", str(out), "--set", "data.dataset=synthetic"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert "a file" in err
    assert target.read_text() == "x = 1\n"


def test_the_run_directory_has_the_last_segments_staleness_and_a_clock_across_resume(
    tmp_path, monkeypatch
):
    cfg = tiny_config()
    killed = tmp_path / "killed"

    class KillFirstSegment(Trainer):
        def __init__(self, cfg, out_dir, *args, **kwargs):
            super().__init__(cfg, out_dir, *args, **kwargs)
            if "train" in Path(out_dir).parts[-2]:
                self.on_tick = lambda tick, trainer: (_ for _ in ()).throw(KeyboardInterrupt)

    monkeypatch.setattr(probes, "Trainer", KillFirstSegment)
    with pytest.raises(KeyboardInterrupt):
        OnlineTune(cfg, killed, progress=False).run()
    first_session = json.loads((killed / online.CLOCK_FILE).read_text())["elapsed_s"]
    # the cold start's probes completed in the first session
    note = json.loads(sorted((killed / "probes").glob("*/online_probe.json"))[-1].read_text())
    assert 0 < note["end_elapsed_s"] <= first_session
    monkeypatch.setattr(probes, "Trainer", Trainer)
    s = train_tuned(None, killed, resume=True)
    # the clock went on from the first session: the resumed run's wall counts it
    assert s["total_wall_s"] > first_session
    assert s["tuning_wall_s"] >= note["end_elapsed_s"]
    stamps = [
        json.loads(x)["t_wall_s"] for x in (killed / "decisions.jsonl").read_text().splitlines()
    ]
    assert stamps == sorted(stamps) and stamps[0] >= first_session
    last = sorted((killed / "train").iterdir())[-1]
    assert (killed / "staleness.json").read_text() == (last / "staleness.json").read_text()


def test_probes_shorter_than_the_score_window_warn_and_a_second_rung_scores_its_chain(tmp_path):
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=1e-9))
    with pytest.warns(ConfigWarning, match="too short to score|fewer than tune.score_window"):
        OnlineTune(cfg, tmp_path / "r", progress=False).run()
    # the steady state's rounds too (a user's review: paired over 6 iterations, unsaid)
    short = [d["phase"] for d in decisions(tmp_path / "r") if "too short" in d["decision"]]
    assert short[0] == "cold start" and "steady state" in short
    # a second rung that trained nothing of its own (its first rung overshot the probe's
    # end) scores the chain, not NaN
    rung = ProbeResult(Candidate("hardsync", 2, 16, 0.1, 0.9), "x", earlier_losses=[1.0, 3.0])
    assert rung.score == 2.0
    assert math.isnan(ProbeResult(Candidate("hardsync", 2, 16, 0.1, 0.9), "x").score)
