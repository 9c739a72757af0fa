"""distsgd.launch.RankPool: ranks kept alive from one dist run to the next (the --tune
probes' and segments' launches on real processes)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import time

import pytest
import torch

from distsgd import launch
from distsgd.config import ConfigError
from distsgd.runtime.base import TrainingDiverged
from distsgd.runtime.faults import RankFaults
from distsgd.tuner.online import train_tuned
from tests.conftest import small_config

pytestmark = pytest.mark.slow  # starts processes

HARDSYNC = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
ASYNC = {"name": "parameter_server", "num_learners": 1, "mode": "async", "batch_size": 16}


def dist_config(protocol: dict, **train):
    t = {"max_epochs": 1, "eval_every_samples": 256, "tensorboard": False, **train}
    return small_config(protocol=protocol, train=t, runtime="dist", dist={"timeout_s": 20.0})


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def starts(monkeypatch):
    """How many times ranks were started (every launch.run and every fresh pool)."""
    count = []
    real = launch._start
    monkeypatch.setattr(launch, "_start", lambda *a, **k: count.append(1) or real(*a, **k))
    return count


def test_pooled_runs_equal_fresh_launches_start_the_ranks_once_and_a_dropped_pool_ends(
    tmp_path, starts
):
    """Each run on the pool is the run a fresh launch trains (model.pt bit-identical,
    hardsync and an asynchronous parameter server, the same ranks one after the other);
    the ranks start once for all of them. After ranks were started, SIGINT in this
    process is a KeyboardInterrupt (not torch's SignalException), so the CLI's interrupt
    handling applies between two runs too; a pool dropped without close() ends its
    ranks (close() itself: the other tests' ``with`` blocks)."""
    hs, ps = dist_config(HARDSYNC), dist_config(ASYNC)
    launch.run(hs, tmp_path / "fresh-hs")
    launch.run(ps, tmp_path / "fresh-ps")
    starts.clear()
    pool = launch.RankPool(2)
    for name, cfg in (("hs", hs), ("ps", ps), ("hs2", hs)):
        summary = pool.run(cfg, tmp_path / name)
        assert summary["status"] == "completed"
    assert len(starts) == 1
    assert equal(weights(tmp_path / "hs"), weights(tmp_path / "fresh-hs"))
    assert equal(weights(tmp_path / "hs2"), weights(tmp_path / "fresh-hs"))
    # the asynchronous schedule depends on timing: the same run trains, not the same bits
    assert (
        json.loads((tmp_path / "ps" / "summary.json").read_text())["samples"]
        == json.loads((tmp_path / "fresh-ps" / "summary.json").read_text())["samples"]
    )
    procs = [h.proc for h in pool._ctx.subprocess_handlers.values()]
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the signal arrives at once; this only bounds a failure
    del pool
    gc.collect()
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in procs)


def test_a_failed_run_ends_the_pool_and_the_next_run_starts_fresh_ranks(tmp_path, starts):
    """A run that diverges raises as launch.run does and ends the pool's ranks; a resume
    continues on fresh ones; a run of the wrong size is refused before anything starts."""
    cfg = dist_config(HARDSYNC)
    bad = cfg.replace(optimizer=dataclasses.replace(cfg.optimizer, lr=1000.0, momentum=0.0))
    with launch.RankPool(2) as pool:
        with pytest.raises(TrainingDiverged):
            pool.run(bad, tmp_path / "bad")
        assert pool.run(cfg, tmp_path / "good")["status"] == "completed"
        with pytest.raises(ValueError, match="the pool has 2 ranks, the run needs 3"):
            pool.run(dist_config({**HARDSYNC, "num_learners": 3}), tmp_path / "three")
        with pytest.raises(ConfigError, match="already holds a run"):
            pool.run(cfg, tmp_path / "good")
    assert len(starts) == 2
    assert not (tmp_path / "three").exists()


def test_a_tolerated_learner_loss_completes_the_run_and_the_pool_restarts(tmp_path, starts):
    """An asynchronous learner killed mid-run: the server completes the run (as with
    launch.run), the pool's ranks end, and the next run starts fresh ones."""
    cfg = dist_config({**ASYNC, "num_learners": 2})
    with launch.RankPool(3) as pool:
        faults = RankFaults(kill_at_step={2: 3})
        summary = pool.run(cfg, tmp_path / "lost", faults=faults)
        assert summary["status"] == "completed"
        assert any("lost" in str(e) for e in summary["events"])
        assert pool.run(cfg, tmp_path / "next")["status"] == "completed"
    assert len(starts) == 2


def test_tune_on_dist_starts_the_ranks_once(tmp_path, starts):
    """distsgd train --tune on real processes: every probe and segment on one pool; the
    joint search's b = 8 probe continues the grid winner's b = 16 first rung (its batch
    changed there) on the next samples of every rank's stream."""
    tune = {
        "lrs": [0.1, 0.01],
        "momenta": [0.9],
        "probe_seconds": 0.3,
        "extra_probes": 1,
        "batch_sizes": [8],
    }
    # the run's 2 epochs size its probes at the cluster model's predicted rate: a device of
    # 2 ms a sample (not the fixed 0.1 ms) leaves the cold start room for both probes
    cfg = small_config(
        protocol=HARDSYNC,
        runtime="dist",
        cluster={"seconds_per_sample": 2e-3},
        dist={"timeout_s": 20.0},
        train={"target": 0.0, "max_epochs": 2, "eval_every_samples": 512, "tensorboard": False},
        tune=tune,
    )
    summary = train_tuned(cfg, tmp_path / "run")
    assert summary["tuned"] and summary["num_probes"] >= 2
    assert summary["status"] == "completed"
    assert len(starts) == 1
    assert (tmp_path / "run" / "model.pt").exists()
    (joint,) = (tmp_path / "run" / "probes").glob("*-joint-*b=8*")
    samples = json.loads((joint / "summary.json").read_text())["samples"]
    ranks = torch.load(joint / "checkpoint.pt", weights_only=True)["runtime"]["ranks"]
    for rank in ranks:  # 1024 samples an epoch: 64 steps of 2 × 8
        (pos,) = rank["streams"]
        assert (pos["epoch"] * 64 + pos["step"]) * 16 == samples
