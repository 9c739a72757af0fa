"""``distsgd train --tune`` (distsgd.tuner.online): the online rule sees only the past, the
winning probe continues bit-identically as the run, a run killed mid-probe resumes to the
same decisions, and bad combinations are one line with exit status 2. All on the
simulated runtime with a tiny model (its clock is simulated, so runs are deterministic)."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from distsgd.cli import main
from distsgd.config import ConfigWarning, RunConfig
from distsgd.metrics import load_checked, read_metrics
from distsgd.trainer import Trainer
from distsgd.tuner import online
from distsgd.tuner.online import OnlineTune, steady_state_due, train_tuned

from .conftest import small_config

# a tiny run that re-optimises once: 3 epochs of 1024 samples, a 2 + 1 probe cold start
# and a 4-probe steady state (the training loss flattens in its second epoch)
TUNE = {
    "lrs": [0.1, 0.01],
    "momenta": [0.0, 0.9],
    "probe_seconds": 0.05,
    "extra_probes": 1,
    "batch_sizes": [16, 32],
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


def test_winning_probe_continues_bit_identically_and_report_reads_the_run(tmp_path):
    cfg = tiny_config()
    run = tmp_path / "run"
    s = OnlineTune(cfg, run, progress=False).run()
    first = sorted((run / "train").iterdir())[0]
    start = json.loads((first / "online_segment.json").read_text())["start"]
    assert "probes" in start  # the first segment continues the cold start's winner
    # a plain run from scratch of the segment's own config (the winner's configuration,
    # stopping at the segment's end): the probe, then its continuation, must equal it
    plain_cfg = RunConfig.from_toml(first / "config.toml")
    assert plain_cfg.train.max_samples == 1024
    Trainer(plain_cfg, tmp_path / "plain", progress=False).run()
    # the segment continued the probe: its first tick follows the probe's last sample
    probe_samples = json.loads((Path(start) / "summary.json").read_text())["samples"]
    first_tick = json.loads((first / "ticks.jsonl").read_text().splitlines()[0])
    assert 0 < probe_samples < first_tick["samples"] <= probe_samples + 32
    got = load_checked(first / "checkpoint.pt")
    want = load_checked(tmp_path / "plain" / "checkpoint.pt")
    assert got["runtime"]["samples"] == want["runtime"]["samples"] == 1024
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
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0


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
    monkeypatch.setattr(online, "Trainer", KillSecondSteadyProbe)
    with pytest.raises(KeyboardInterrupt):
        OnlineTune(cfg, killed, progress=False).run()
    cut = sorted((killed / "probes").iterdir())[-1]
    assert "steady" in cut.name and not (cut / "online_probe.json").exists()
    monkeypatch.setattr(online, "Trainer", Trainer)
    s = train_tuned(None, killed, resume=True)
    assert decisions(killed) == decisions(whole)
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


def test_a_run_directory_that_holds_a_run_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run"):
        OnlineTune(tiny_config(), run, progress=False).run()
    shutil.rmtree(run)


def test_a_budget_too_small_says_so_and_trains_with_the_best_probe(tmp_path):
    # 0.2 · 0.1 s for 3 planned probes is below ¼ of tune.probe_seconds (0.05 s): one
    # probe of 0.0125 s fits, and the run trains with it
    assert online.probe_seconds_for(0.05, 0.1, 3) == (0.0125, 1)
    with pytest.warns(ConfigWarning, match="too small for the full cold start"):
        s = OnlineTune(tiny_config(max_virtual_seconds=0.1), tmp_path / "r", progress=False).run()
    assert s["num_probes"] == 1 and s["samples"] > 0
    assert s["stop_reason"] == "max_virtual_seconds"
    first = json.loads((tmp_path / "r" / "decisions.jsonl").read_text().splitlines()[1])
    assert first["decision"] == "budget too small: fewer probes"


def test_probes_leave_a_run_limited_by_epochs_most_of_its_samples(tmp_path):
    # issue 18: with tune.probe_seconds far above what max_epochs allows, the winning probe
    # trained all the epochs and the run continued for none (one evaluation, at the end)
    cfg = tiny_config()
    cfg = cfg.replace(tune=dataclasses.replace(cfg.tune, probe_seconds=5.0))
    run = tmp_path / "r"
    s = OnlineTune(cfg, run, progress=False).run()
    limit = 3 * 1024  # max_epochs · training samples
    cold = [json.loads(p.read_text()) for p in sorted(run.glob("probes/*-cold-*/summary.json"))]
    # the cold start's probes share 0.2 of the run's samples (at hardsync's rate), plus at
    # most one iteration's overshoot of their clock limit: well under 0.25 in all
    assert cold and sum(p["samples"] for p in cold) <= 0.25 * limit
    assert s["samples"] == limit and len(read_metrics(run / "metrics.jsonl")) > 1
