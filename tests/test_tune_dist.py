"""``distsgd tune --runtime dist``: probes as ordinary dist trainings from a snapshot file,
candidate layouts that fit N processes, measured/predicted HE scaling, and one tiny
end-to-end tune on 2 gloo processes whose plan ``distsgd train --runtime dist`` accepts."""

import dataclasses
import json
import math

import pytest
import torch

from distsgd.cli import main
from distsgd.config import ConfigError, RunConfig, TuneConfig
from distsgd.control import RunOptions
from distsgd.trainer import Trainer
from distsgd.tuner.omnivore import (
    Candidate,
    DecisionLog,
    OmnivoreSearch,
    ProbeResult,
    he_scales,
    joint_candidates,
    rank_candidates,
)
from distsgd.tuner.perf_model import ClusterModel, seconds_per_iteration
from distsgd.tuner.setup import RunLayout
from distsgd.tuner.tune import tune_layout

from .conftest import small_config
from .test_tuner import FakeProbe


def test_record_ticks_and_initial_weights_file_continue_a_run(tmp_path):
    cfg = small_config(train={"max_epochs": 0.5})
    first = Trainer(cfg, tmp_path / "a", progress=False, options=RunOptions(record=True))
    s = first.run()
    ticks = [json.loads(x) for x in (tmp_path / "a" / "ticks.jsonl").read_text().splitlines()]
    assert len(ticks) == s["iterations"]  # hardsync: one tick per iteration
    assert [t["iterations"] for t in ticks] == list(range(1, s["iterations"] + 1))
    assert all(math.isfinite(t["loss"]) for t in ticks)
    final = torch.load(tmp_path / "a" / "final_weights.pt", weights_only=True)
    assert torch.equal(final, first.runtime.eval_weights())
    # a run from that file starts where the first ended: same weights, same accuracy
    path = str(tmp_path / "a" / "final_weights.pt")
    cont = cfg.replace(train=dataclasses.replace(cfg.train, initial_weights=path))
    Trainer(cont, tmp_path / "b", progress=False).run()
    last_a = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    first_b = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_b["samples"] == 0 and first_b["eval_metric"] == last_a["eval_metric"]
    bad = small_config(train={"initial_weights": str(tmp_path / "missing.pt")})
    with pytest.raises(ConfigError, match="train.initial_weights = "):
        Trainer(bad, tmp_path / "c", progress=False).run()
    with pytest.raises(ConfigError, match="train.evaluate"):
        RunConfig.from_dict({"train": {"evaluate": "no"}})


def test_no_evaluation_run_writes_no_metrics(tmp_path):
    cfg = small_config(train={"max_epochs": 0.25, "evaluate": False})
    s = Trainer(cfg, tmp_path / "a", progress=False).run()
    assert s["iterations"] > 0
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == ""


def test_layouts_fit_the_processes():
    # 2 processes: hardsync / SMA on 2 learners (devices); a server leaves 1 learner, so
    # no compute groups (g must divide it) and no n-softsync with n < λ
    probe = FakeProbe(lambda c, s: 1.0 + abs(c.lr - 0.01))
    s = TuneConfig(lrs=[0.1, 0.01])
    search = OmnivoreSearch(probe, s, 2, 16, DecisionLog(), ps_learners=1)
    assert search.group_counts() == [1]
    chosen = search.cold_start().candidate
    assert chosen.family == "hardsync" and chosen.num_learners == 2
    fams = {(c.family, c.num_learners) for c in joint_candidates(search, chosen, s)}
    assert fams == {("hardsync", 2), ("sma", 4), ("sma", 8)}
    # 5 processes: hardsync on 5, compute groups and softsync on 4 learners + 1 server
    search = OmnivoreSearch(FakeProbe(lambda c, s: 1.0), s, 5, 16, DecisionLog(), ps_learners=4)
    assert search.group_counts() == [1, 2, 4]
    assert search.candidate(2, 0.1, 0.0) == Candidate(
        "compute_groups", 4, 16, 0.1, 0.0, num_groups=2
    )
    assert search.candidate(1, 0.1, 0.0).num_learners == 5
    soft = [c for c in joint_candidates(search, chosen, s) if c.family == "softsync"]
    assert {(c.num_learners, c.softsync) for c in soft} == {(4, 1), (4, 2)}


def test_unprobed_he_is_scaled_by_measured_over_predicted():
    cluster = ClusterModel(1e-3, 1e-4, num_parameters=1000)

    def measured(cand, factor):
        he = seconds_per_iteration(cand.layout(), cluster) * factor
        return ProbeResult(cand, "initial", iterations=[10], virtual_s=[10 * he], losses=[1.0])

    hs = Candidate("hardsync", 2, 16, 0.1, 0.9)
    sma = Candidate("sma", 4, 16, 0.1, 0.0, replicas_per_device=2)
    scales = he_scales([measured(hs, 2.0), measured(hs, 8.0), measured(sma, 3.0)], cluster)
    assert scales["hardsync"] == pytest.approx(4.0)  # geometric mean of 2 and 8
    assert scales["sma"] == pytest.approx(3.0)
    assert scales["*"] == pytest.approx((2 * 8 * 3) ** (1 / 3))
    other = Candidate("hardsync", 2, 32, 0.2, 0.9)
    soft = Candidate("softsync", 2, 16, 0.1, 0.9, softsync=1)
    plain = dict((c, t) for t, c in rank_candidates([other, soft], hs, 1.0, cluster, 32.0))
    scaled = dict((c, t) for t, c in rank_candidates([other, soft], hs, 1.0, cluster, 32.0, scales))
    assert scaled[other] == pytest.approx(4.0 * plain[other])  # its family's ratio
    assert scaled[soft] == pytest.approx(scales["*"] * plain[soft])  # unprobed family: all


@pytest.mark.slow
def test_tune_on_dist_writes_a_plan_that_train_dist_accepts(tmp_path, capsys, monkeypatch):
    from distsgd import launch

    starts = []  # rank starts: every probe and long run on one pool of ranks
    real_start = launch._start
    monkeypatch.setattr(launch, "_start", lambda *a, **k: starts.append(1) or real_start(*a, **k))
    base = small_config(
        protocol={"num_learners": 2, "batch_size": 16},
        train={"target": 0.5, "max_epochs": 1, "eval_every_samples": 256},
        dist={"timeout_s": 60},
        tune={
            "probe_seconds": 0.5,
            "lrs": [0.1, 0.01],
            "momenta": [0.0, 0.9],
            "batch_sizes": [16],
            "extra_probes": 1,
        },
    )
    cfg = tmp_path / "base.toml"
    cfg.write_text(base.to_toml())
    out = tmp_path / "tune"
    argv = ["tune", str(cfg), "--runtime", "dist", "--num-processes", "2"]
    # a budget far above the work, which the grids and train.max_epochs bound (a few probes
    # of 0.5 s, a long run of at most 1 epoch, a few runs from its snapshots; ~35 s here):
    # the tune refuses a budget below its measured set-up plus one probe, and the set-up
    # alone took 24 s on a loaded machine
    assert main([*argv, "--budget", "1h", "--out", str(out), "--quiet"]) == 0
    state = json.loads((out / "tune.json").read_text())
    assert len(state["probes"]) >= 3 and len(starts) == 1
    assert state["clock"] == "wall" and state["runtime"] == "dist"
    assert state["num_processes"] == 2 and state["network"]["measurements"]
    assert state["probes"]
    for p in state["probes"]:  # every probe's curve came back from rank 0
        assert p["losses"] and len(p["losses"]) == len(p["iterations"]) == len(p["virtual_s"])
        assert p["seconds_per_iteration"] > 0
        assert (tmp_path / p["run_dir"] / "ticks.jsonl").exists()
    decisions = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    assert any("wall seconds each" in d["decision"] for d in decisions)
    assert any("real processes" in d["decision"] for d in decisions)
    plan = RunConfig.from_toml(out / "plan.toml")
    assert plan.runtime == "dist" and not plan.train.initial_weights
    assert plan.train.evaluate and not plan.train.save_eval_weights
    capsys.readouterr()
    run = tmp_path / "run"
    assert (
        main(["train", str(out / "plan.toml"), "--runtime", "dist", "--out", str(run), "--quiet"])
        == 0
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runtime"] == "dist" and summary["protocol"] == plan.protocol.name
    # --verify-only trains the plan on real processes: wall seconds against wall seconds
    assert main(["tune", "--verify-only", str(out), "--quiet"]) == 0
    v = json.loads((out / "tune.json").read_text())["verify"]
    verify = json.loads((out / "verify" / "summary.json").read_text())
    assert verify["runtime"] == "dist"
    assert v["measured_s"] == verify["time_to_target_s"]  # wall (None if not reached)


@pytest.mark.slow
def test_dist_ranks_start_from_the_initial_weights_file(tmp_path):
    from distsgd.launch import run

    cfg = small_config(
        protocol={"num_learners": 2, "batch_size": 16},
        train={"max_epochs": 0.5},
    )
    Trainer(cfg, tmp_path / "sim", progress=False, options=RunOptions(record=True)).run()
    path = str(tmp_path / "sim" / "final_weights.pt")
    dist_cfg = cfg.replace(
        runtime="dist",
        train=dataclasses.replace(cfg.train, initial_weights=path, max_epochs=0.25),
    )
    run(dist_cfg, tmp_path / "dist", options=RunOptions(record=True))
    last_sim = json.loads((tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()[-1])
    first = json.loads((tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()[0])
    # the same weights on the same test set: the same count of correct answers
    assert first["samples"] == 0 and first["eval_metric"] == last_sim["eval_metric"]
    ticks = (tmp_path / "dist" / "ticks.jsonl").read_text().splitlines()
    assert len(ticks) == json.loads((tmp_path / "dist" / "summary.json").read_text())["iterations"]


def test_a_rank_lost_after_the_run_completed_leaves_a_complete_probe(tmp_path, monkeypatch):
    import distsgd.launch as launch
    from distsgd.tuner.probes import Prober

    status = {"value": "completed"}

    def fake_run(cfg, out_dir, **kw):  # rank 0 finished and wrote its files, then a rank died
        out_dir.mkdir(parents=True)
        (out_dir / "ticks.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "iterations": i,
                        "samples": 32 * i,
                        "train_wall_s": 0.1 * i,
                        "clock_s": 0.1 * i,
                        "loss": 2.0 / i,
                    }
                )
                + "\n"
                for i in range(1, 4)
            )
        )
        summary = {"status": status["value"], "train_wall_s": 0.3, "samples": 96}
        (out_dir / "summary.json").write_text(json.dumps(summary))
        raise launch.DistRunFailed("rank 1 (learner) was killed by SIGABRT")

    monkeypatch.setattr(launch, "run", fake_run)
    base = small_config(runtime="dist", protocol={"num_learners": 2, "batch_size": 16})
    prober = Prober(base, tmp_path, 1.0, 10, torch.zeros(3))
    r = prober(Candidate("hardsync", 2, 16, 0.1, 0.9), "initial")
    assert r.losses == [2.0, 1.0, 2.0 / 3] and r.iterations == [1, 2, 3]
    assert r.samples == 96 and "SIGABRT" in r.notes[0]
    status["value"] = "failed"  # the run itself did not complete: the failure stands
    with pytest.raises(launch.DistRunFailed):
        prober(Candidate("hardsync", 2, 16, 0.01, 0.9), "initial")


def _one_line_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_tune_refuses_more_processes_than_cores_and_families_it_cannot_probe(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("distsgd.tuner.setup.os.cpu_count", lambda: 2)
    base = small_config(protocol={"num_learners": 2, "batch_size": 16})
    cfg = tmp_path / "base.toml"
    cfg.write_text(base.to_toml())
    out = tmp_path / "t"
    argv = ["tune", str(cfg), "--runtime", "dist", "--out", str(out), "--quiet"]
    err = _one_line_exit_2(capsys, [*argv, "--num-processes", "99"])
    assert "dist.num_processes = 99 is not allowed for tuning (distsgd tune, train --tune)" in err
    assert "expected at most 2" in err
    assert not out.exists()  # refused before anything was written
    # train --tune: the refusal alone, not after the line announcing the fitted layout
    # (a fresh-user review: "dist: fitted the layout to 3 processes: ..." came first)
    err = _one_line_exit_2(
        capsys, ["train", str(cfg), "--tune", "--runtime", "dist", "--num-processes", "3",
                 "--out", str(out), "--quiet"],
    )  # fmt: skip
    assert err.startswith("distsgd: error: dist.num_processes = 3 is not allowed for tuning")
    assert not out.exists()
    # 0 (and no flag) means what the base protocol needs: 2 learners of hardsync
    zero = RunConfig.from_toml(cfg, ["runtime=dist", "dist.num_processes=0"])
    assert tune_layout(zero) == RunLayout(num_processes=2, num_learners=2, ps_learners=1)
    # a layout that needs more than the cores, the count not set: the message names the
    # protocol's need, not a value the user never gave (found by a fresh user)
    ps = ["--set", "protocol.name=parameter_server", "--set", "protocol.num_learners=4"]
    err = _one_line_exit_2(capsys, [*argv, *ps])
    assert "dist.num_processes = 0 (what parameter_server with protocol.num_learners = 4" in err
    assert "needs: 5) is not allowed for tuning (distsgd tune, train --tune): expected" in err
    assert not out.exists()
    # 2 processes leave one learner beside the server: no n-softsync to probe
    err = _one_line_exit_2(
        capsys, [*argv, "--num-processes", "2", "--set", 'tune.families=["softsync"]']
    )
    assert "tune.families = ['softsync'] is not allowed with 2 processes" in err
    assert "expected at least one family these layouts can probe: hardsync, sma" in err
    assert not out.exists()
    # on the simulated runtime the flag would start nothing: refused, not ignored
    for cmd in ("tune", "train"):
        sim = [cmd, str(cfg), "--out", str(out), "--quiet", "--num-processes", "2"]
        err = _one_line_exit_2(capsys, sim)
        assert "--num-processes 2 is not allowed with runtime = 'sim'" in err
        assert "add --runtime dist" in err
        assert not out.exists()


def test_tune_refuses_an_out_that_is_a_file_and_leaves_no_dir_after_a_failed_start(
    tmp_path, capsys
):
    base = small_config(protocol={"num_learners": 2, "batch_size": 16})
    cfg = tmp_path / "base.toml"
    cfg.write_text(base.to_toml())
    f = tmp_path / "file"
    f.write_text("x")
    err = _one_line_exit_2(capsys, ["tune", str(cfg), "--out", str(f), "--quiet"])
    assert "is a file: expected a directory" in err
    out = tmp_path / "t"
    missing = ["--set", "data.dataset=fashion_mnist", "--set", f"data.root={tmp_path / 'no'}"]
    _one_line_exit_2(capsys, ["tune", str(cfg), "--out", str(out), "--quiet", *missing])
    assert not out.exists()


def test_segment_fraction_must_leave_the_search_a_share():
    TuneConfig(segment_fraction=0.8)
    with pytest.raises(ConfigError, match=r"tune.segment_fraction = 0.85 is not allowed"):
        TuneConfig(segment_fraction=0.85)
