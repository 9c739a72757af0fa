"""The trainer's control interface (distsgd.control): run options outside the config, an
observer of losses, evaluations and steady-state checks, the same events recorded across a
process boundary, and a checkpoint continued under other hyperparameters (μ, batch)."""

import dataclasses
import shutil

import pytest
import torch

from distsgd.config import ConfigError
from distsgd.control import LossPoint, RunObserver, RunOptions, replay
from distsgd.metrics import load_checked, read_metrics
from distsgd.protocols._util import with_momentum
from distsgd.trainer import Trainer

from .conftest import small_config


class Heard(RunObserver):
    def __init__(self):
        self.losses, self.evals, self.checks = [], [], []

    def on_losses(self, point: LossPoint) -> None:
        self.losses.append(point)

    def on_evaluation(self, record, weights) -> None:
        self.evals.append((record, weights.clone()))

    def on_steady_check(self, check) -> None:
        self.checks.append(check)


def test_the_observer_hears_what_the_recorder_keeps(tmp_path):
    cfg = small_config(optimizer={"lr": 0.1, "momentum": 0.9}, train={"max_epochs": 3})
    heard = Heard()
    options = RunOptions(steady_check_samples=1024, record=True)
    trainer = Trainer(cfg, tmp_path / "r", progress=False, options=options, observer=heard)
    s = trainer.run()
    # hardsync: one tick (with losses) per iteration; an evaluation per metrics record
    assert [p.iterations for p in heard.losses] == list(range(1, s["iterations"] + 1))
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["eval"] for r, _ in heard.evals] == [r["eval"] for r in records]
    assert [c["samples"] for c in heard.checks] == [
        1024 * (i + 1) for i in range(len(heard.checks))
    ]
    assert heard.checks and all(c["window_samples"] == 1024 for c in heard.checks)
    # what the recorder kept replays as the same events; its final model is the last one
    again = Heard()
    replay(tmp_path / "r", again)
    assert again.losses == heard.losses and again.checks == heard.checks
    final = load_checked(tmp_path / "r" / "final_weights.pt")
    assert torch.equal(final, heard.evals[-1][1])


def test_without_evaluation_the_run_hears_losses_only(tmp_path):
    heard = Heard()
    cfg = small_config(train={"max_epochs": 0.5})
    options = RunOptions(evaluate=False, steady_check_samples=256)
    Trainer(cfg, tmp_path / "r", progress=False, options=options, observer=heard).run()
    assert heard.losses and not heard.evals and not heard.checks
    assert not (tmp_path / "r" / "metrics.jsonl").read_text()
    assert not (tmp_path / "r" / "ticks.jsonl").exists()  # nothing recorded unless asked


def test_a_continued_checkpoint_takes_the_new_momentum_and_batch(tmp_path):
    """Omnivore's steady state: another μ and batch from a run's state. Without
    ``continues`` the checkpoint of another μ is refused, as any resume of another
    configuration; with it the run goes on from the same sample with the new μ and b."""
    first = small_config(train={"max_samples": 512, "eval_every_samples": 256})
    Trainer(first, tmp_path / "a", progress=False).run()
    cfg = first.replace(
        optimizer=dataclasses.replace(first.optimizer, momentum=0.5),
        protocol=dataclasses.replace(first.protocol, batch_size=64),
        train=dataclasses.replace(first.train, max_samples=1024),
    )
    run = tmp_path / "b"
    run.mkdir()
    for name in ("checkpoint.pt", "checkpoint.pt.sha256", "metrics.jsonl"):
        shutil.copy2(tmp_path / "a" / name, run / name)
    with pytest.raises(ConfigError, match="momentum"):
        Trainer(cfg, run, progress=False).run(resume=True)
    s = Trainer(cfg, run, progress=False, options=RunOptions(continues=True)).run(resume=True)
    assert s["samples"] == 1024 and s["batch_size"] == 64
    state = load_checked(run / "checkpoint.pt")
    assert state["protocol"]["config"]["momentum"] == 0.5
    # 512 samples at b = 32 are 8 steps at b = 64: the epoch's 16 steps end at 1024
    assert state["runtime"]["streams"] == [{"epoch": 1, "step": 0, "batch_size": 64}]


def test_with_momentum_sets_every_protocol_header_and_leaves_its_input():
    state = {
        "protocol": "ComputeGroups",
        "config": {"momentum": 0.9, "num_groups": 2},
        "server": {"protocol": "X", "config": {"momentum": 0.9}, "w": torch.ones(2)},
        "ranks": [{"protocol": "HardSync", "config": {"momentum": 0.9}}],
        "other": {"config": {"momentum": 0.9}},  # no protocol header: not a protocol's
    }
    out = with_momentum(state, 0.0)
    assert out["config"] == {"momentum": 0.0, "num_groups": 2}
    assert out["server"]["config"]["momentum"] == 0.0 and out["server"]["w"] is state["server"]["w"]
    assert out["ranks"][0]["config"]["momentum"] == 0.0
    assert out["other"]["config"]["momentum"] == 0.9
    assert state["config"]["momentum"] == state["ranks"][0]["config"]["momentum"] == 0.9


def test_run_options_refuse_a_negative_check_interval_and_round_trip():
    with pytest.raises(ValueError, match="steady_check_samples = -1"):
        RunOptions(steady_check_samples=-1)
    o = RunOptions(evaluate=False, steady_check_samples=5, continues=True, record=True)
    assert RunOptions.from_json(o.to_json()) == o and RunOptions.from_json(None) == RunOptions()
