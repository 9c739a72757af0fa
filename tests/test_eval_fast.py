"""Evaluation's fast path and ``train.eval_samples`` (issue 17, evaluation): the
inference path's metric, independence of the batch size, the fixed seeded subset on every
runtime and rank layout, the target decision on the whole test set, validation, resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.config import ConfigError
from distsgd.data import MapSplit, TensorSplit
from distsgd.engine import build_engine, eval_subset, eval_subset_indices
from distsgd.metrics import read_metrics
from distsgd.report import make_report
from tests.conftest import cli_in_process, small_config


def _engine_and_split(num_samples: int = 300) -> tuple[distsgd.engine.GradientEngine, TensorSplit]:
    shape = {"input_shape": [1, 28, 28], "num_classes": 10}
    cfg = small_config(model={"name": "cnn", "kwargs": shape})
    torch.manual_seed(0)
    engine = build_engine(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (num_samples,), generator=g)
    return engine, TensorSplit(x, y)


def test_inference_path_matches_a_plain_autograd_loop_and_any_batch_size():
    engine, split = _engine_and_split()
    w = engine.initial_weights() + 0.01  # not the module's own weights: the copy counts
    # reference: the module in eval mode, autograd on, one sample-weighted sum per batch
    engine._load(w)  # the model at w (channels-last kernels included)
    engine.model.eval()
    right = loss_sum = 0.0
    for lo in range(0, split.num_samples, 64):
        out = engine.model(split.x[lo : lo + 64]).detach()
        yb = split.y[lo : lo + 64]
        right += float((out.argmax(1) == yb).sum())
        loss_sum += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
    want_acc, want_loss = right / split.num_samples, loss_sum / split.num_samples
    for batch_size in (1, 7, 128, 1024):
        acc, loss = engine.evaluate(w, split, batch_size)
        # float32 convolutions cut into other batch sizes may round differently (the
        # kernels block by batch); 1e-5 relative on the mean loss is 100x their rounding,
        # and no logit on random inputs is that close to a tie, so the accuracy is exact
        assert acc == want_acc
        assert loss == pytest.approx(want_loss, rel=1e-5)


def test_subset_is_fixed_seeded_sorted_and_the_whole_set_when_not_smaller():
    a = eval_subset_indices(10_000, 2000, seed=3)
    assert a.shape == (2000,) and torch.equal(a, eval_subset_indices(10_000, 2000, seed=3))
    assert bool((a[1:] > a[:-1]).all()) and 0 <= int(a[0]) and int(a[-1]) < 10_000
    assert not torch.equal(a, eval_subset_indices(10_000, 2000, seed=4))
    assert eval_subset_indices(10_000, 0, seed=3) is None
    assert eval_subset_indices(500, 500, seed=3) is None
    _, split = _engine_and_split()
    sub = eval_subset(split, 50, seed=0)
    idx = eval_subset_indices(300, 50, seed=0)
    assert torch.equal(sub.x, split.x[idx]) and torch.equal(sub.y, split.y[idx])
    assert eval_subset(split, 0, seed=0) is split
    # a map-style split gives the same samples
    items = [(split.x[i], split.y[i]) for i in range(split.num_samples)]
    mapped = eval_subset(MapSplit(items, None, "data.factory"), 50, seed=0)
    xb, yb = next(mapped.batches(50))
    assert torch.equal(xb, sub.x) and torch.equal(yb, sub.y)


def _subset_config(tmp_path: Path, **train):
    """Synthetic data with 512 test samples, subset 100: a run long enough that the subset
    and the whole set differ in metric."""
    t = {"eval_samples": 100, "max_epochs": 1, "eval_every_samples": 256, **train}
    return small_config(data={"num_test": 512}, train=t)


@pytest.mark.slow
def test_intermediate_evaluations_score_the_subset_and_the_final_one_the_whole_set(tmp_path):
    s = distsgd.train(_subset_config(tmp_path), out_dir=tmp_path / "r")
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["eval_samples"] for r in records] == [100] * (len(records) - 1) + [512]
    assert s["eval_samples"] == 100 and s["final_eval_samples"] == 512
    # the final record is the whole set's: eval_samples = 0 scores the same there
    whole = distsgd.train(_subset_config(tmp_path, eval_samples=0), out_dir=tmp_path / "w")
    assert whole["final_metric"] == s["final_metric"]
    # the report reads and plots records of either set
    md = make_report([tmp_path / "r", tmp_path / "w"], tmp_path / "report")
    assert (tmp_path / "report" / "curves.png").exists() and md.exists()


def test_a_subset_reaching_the_target_is_decided_by_the_whole_set(tmp_path, monkeypatch):
    """The runtime's evaluation is wrapped so that the subset always reports an accuracy
    within 3 standard errors of the target: the run must score the whole set at once and
    stop only if that reaches it."""
    real = distsgd.runtime.sim.SimRuntime.evaluate
    scored: list[int] = []

    def evaluate(self, weights, split, batch_size):
        scored.append(split.num_samples)
        metric, loss = real(self, weights, split, batch_size)
        # 0.975: 1.5 standard errors of an accuracy of 0.99 on 100 samples below it
        return (0.975 if split.num_samples == 100 else metric), loss

    monkeypatch.setattr(distsgd.runtime.sim.SimRuntime, "evaluate", evaluate)
    # target 0.99: the subset's faked 0.975 is near it, the whole set's real metric not
    cfg = _subset_config(tmp_path, target=0.99)
    s = distsgd.train(cfg, out_dir=tmp_path / "r")
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert not s["reached"] and s["stop_reason"] == "max_epochs/max_samples"
    # every evaluation: the subset, then at once the whole set (the final: the whole set)
    assert scored == [100, 512] * (len(records) - 1) + [512]
    assert all(r["eval_samples"] == 512 and r["eval_metric"] < 0.99 for r in records)
    # a target the whole set reaches stops the run at the first evaluation after training
    scored.clear()
    s = distsgd.train(_subset_config(tmp_path, target=0.05), out_dir=tmp_path / "t")
    assert s["reached"] and s["samples_to_target"] == 0 and scored == [100, 512]


def test_bad_eval_samples_is_one_line_exit_2(tmp_path):
    r = cli_in_process("train", "--set", "train.eval_samples=-1", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.eval_samples = -1" in lines[0] and ">= 0" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written
    for value in (1.5, True, "100"):
        with pytest.raises(ConfigError, match="train.eval_samples"):
            small_config(train={"eval_samples": value})


def test_resume_keeps_the_subset(tmp_path):
    full = _subset_config(tmp_path, max_epochs=2)
    distsgd.train(full, out_dir=tmp_path / "full")
    distsgd.train(_subset_config(tmp_path, max_epochs=1), out_dir=tmp_path / "half")
    with pytest.raises(ConfigError, match="only these settings may change"):
        distsgd.train(resume=tmp_path / "half", overrides=["train.eval_samples=0"])
    distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=2"])
    mf = read_metrics(tmp_path / "full" / "metrics.jsonl")
    mh = read_metrics(tmp_path / "half" / "metrics.jsonl")
    # the half run's final evaluation (whole set) at epoch 1 is kept in its records
    at_1 = [r for r in mh if r["samples"] == 1024]
    assert at_1 and at_1[0]["eval_samples"] == 512
    keep = [r for r in mh if r["samples"] != 1024]
    ref = [r for r in mf if r["samples"] != 1024]
    assert [(r["samples"], r["eval_samples"], r["eval_loss"]) for r in keep] == [
        (r["samples"], r["eval_samples"], r["eval_loss"]) for r in ref
    ]
    assert json.loads((tmp_path / "half" / "summary.json").read_text())["eval_samples"] == 100


@pytest.mark.slow  # starts 2 processes (a few seconds, most of it start-up)
def test_the_subset_is_the_same_on_sim_and_on_two_ranks(tmp_path):
    """Hardsync with 2 learners on the simulator and on 2 real processes, each rank
    scoring half of the subset: the same records (the subset is drawn from the seed
    alone; each rank's half is a contiguous slice of it)."""
    protocol = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
    runs = {}
    for runtime in ("sim", "dist"):
        cfg = _subset_config(tmp_path, tensorboard=False).replace(runtime=runtime)
        cfg = cfg.replace(protocol=dataclasses.replace(cfg.protocol, **protocol))
        distsgd.train(cfg, out_dir=tmp_path / runtime)
        runs[runtime] = read_metrics(tmp_path / runtime / "metrics.jsonl")
    sim, real = runs["sim"], runs["dist"]
    assert [r["eval_samples"] for r in real] == [r["eval_samples"] for r in sim]
    assert sim[0]["eval_samples"] == 100 and sim[-1]["eval_samples"] == 512
    # accuracy on at most 512 samples: the ranks' float32 weights agree to ~1e-7
    # (test_dist), which flips no prediction here
    assert [r["eval_metric"] for r in real] == [r["eval_metric"] for r in sim]
