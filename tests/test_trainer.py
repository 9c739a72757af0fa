"""The training loop end to end on synthetic data: outputs, equivalences, resume, failures."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.config import ConfigError, resolved_device_setting
from distsgd.metrics import read_metrics
from distsgd.runtime.sim import SimRuntime, TrainingDiverged
from distsgd.trainer import Trainer
from tests.conftest import small_config

SUMMARY_KEYS = {
    "protocol",
    "runtime",
    "target",
    "best_metric",
    "reached",
    "time_to_target_s",
    "time_to_target_virtual_s",
    "samples_to_target",
    "throughput_samples_per_s",
    "staleness_mean",
    "staleness_max",
}
METRIC_KEYS = {"samples", "virtual_s", "wall_s", "eval_metric", "eval_loss", "train_loss", "lr"}


def final_weights(run_dir):
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    return state


def test_run_directory_contents(tmp_path):
    cfg = small_config(protocol={"name": "parameter_server", "num_learners": 4, "softsync": 4})
    summary = distsgd.train(cfg, out_dir=tmp_path / "run")
    run = tmp_path / "run"
    assert SUMMARY_KEYS <= set(summary)
    assert json.loads((run / "summary.json").read_text())["protocol"] == "parameter_server"
    records = read_metrics(run / "metrics.jsonl")
    # eval at 0 and every 512 samples of 2 epochs x 1024
    assert [r["samples"] for r in records] == [0, 512, 1024, 1536, 2048]
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert records[0]["train_loss"] is None and records[1]["train_loss"] > 0
    assert records[-1]["virtual_s"] > records[1]["virtual_s"] > 0
    assert summary["staleness_mean"] > 0
    assert summary["runtime"] == "sim"
    # the resolved config reproduces the run settings, with the built-in model's shape,
    # the device train.device = "auto" resolved to and the layout train.memory_format =
    # "auto" resolved to (contiguous: the model has no convolution)
    again = distsgd.RunConfig.from_toml(run / "config.toml")
    shape = {"input_shape": [1, 28, 28], "num_classes": 10}
    device = dataclasses.replace(
        cfg.train, device=resolved_device_setting("auto"), memory_format="contiguous"
    )
    assert again == cfg.replace(model=dataclasses.replace(cfg.model, kwargs=shape), train=device)
    assert sum(json.loads((run / "staleness.json").read_text())["counts"].values()) == 2048 // 32


def test_reaches_target_and_records_time_to_accuracy(tmp_path):
    cfg = small_config(train={"target": 0.5, "max_epochs": 5})
    s = distsgd.train(cfg, out_dir=tmp_path / "r")
    assert s["reached"] and s["stop_reason"] == "target"
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    first = next(r for r in records if r["eval_metric"] >= 0.5)
    assert s["samples_to_target"] == first["samples"] == records[-1]["samples"]
    assert s["time_to_target_s"] == first["wall_s"]
    assert s["time_to_target_virtual_s"] == first["virtual_s"]


def test_hardsync_matches_single_learner_with_global_batch(tmp_path):
    a = distsgd.train(
        small_config(protocol={"name": "hardsync", "num_learners": 4, "batch_size": 16}),
        out_dir=tmp_path / "a",
    )
    b = distsgd.train(
        small_config(protocol={"name": "hardsync", "num_learners": 1, "batch_size": 64}),
        out_dir=tmp_path / "b",
    )
    la = [r["eval_loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    lb = [r["eval_loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert len(la) == len(lb) == 5
    # The four learners share weights, so the simulator computes their mean gradient as one
    # batch of 64 ordered exactly as the single learner's: the runs are bit-identical.
    assert la == lb
    assert a["staleness_max"] == 0 and b["staleness_mean"] == 0


def test_softsync_with_one_learner_equals_plain_sgd(tmp_path):
    ps = small_config(protocol={"name": "parameter_server", "num_learners": 1, "mode": "async"})
    plain = small_config(protocol={"name": "plain", "num_learners": 1})
    a = distsgd.train(ps, out_dir=tmp_path / "a")
    distsgd.train(plain, out_dir=tmp_path / "b")
    wa = final_weights(tmp_path / "a")["protocol"]
    wb = final_weights(tmp_path / "b")["protocol"]
    ra = read_metrics(tmp_path / "a" / "metrics.jsonl")
    rb = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["eval_loss"] for r in ra] == [r["eval_loss"] for r in rb]
    assert a["staleness_max"] == 0
    assert wa and wb


def test_groups_with_one_group_equal_hardsync(tmp_path):
    g1 = small_config(
        protocol={"name": "compute_groups", "num_learners": 4, "batch_size": 16, "num_groups": 1}
    )
    hs = small_config(protocol={"name": "hardsync", "num_learners": 4, "batch_size": 16})
    distsgd.train(g1, out_dir=tmp_path / "a")
    distsgd.train(hs, out_dir=tmp_path / "b")
    la = [r["eval_loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    lb = [r["eval_loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert la == pytest.approx(lb, abs=1e-5)  # same maths, only summation order differs


@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "parameter_server", "num_learners": 4, "softsync": 2},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 2},
        {"name": "local_sgd", "num_learners": 2, "average_every": 3},
        {"name": "compute_groups", "num_learners": 4, "num_groups": 2},
    ],
)
def test_same_seed_gives_identical_weights(tmp_path, protocol):
    cfg = small_config(protocol=protocol, cluster={"jitter": 0.3}, train={"max_epochs": 1})
    distsgd.train(cfg, out_dir=tmp_path / "a")
    distsgd.train(cfg, out_dir=tmp_path / "b")
    ma = read_metrics(tmp_path / "a" / "metrics.jsonl")
    mb = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["eval_loss"] for r in ma] == [r["eval_loss"] for r in mb]
    assert [r["virtual_s"] for r in ma] == [r["virtual_s"] for r in mb]
    pa = final_weights(tmp_path / "a")["protocol"]
    pb = final_weights(tmp_path / "b")["protocol"]
    for key, value in pa.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, pb[key]), key
    # a different seed changes the run
    other = small_config(
        protocol=protocol, cluster={"jitter": 0.3}, train={"max_epochs": 1, "seed": 1}
    )
    distsgd.train(other, out_dir=tmp_path / "c")
    mc = read_metrics(tmp_path / "c" / "metrics.jsonl")
    assert [r["eval_loss"] for r in mc] != [r["eval_loss"] for r in ma]


@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "parameter_server", "num_learners": 4, "softsync": 2},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 4},
        {"name": "diloco", "num_learners": 4, "replicas_per_device": 2, "average_every": 5},
    ],
)
def test_resume_equals_uninterrupted_run(tmp_path, protocol):
    full = small_config(protocol=protocol, cluster={"jitter": 0.3})
    distsgd.train(full, out_dir=tmp_path / "full")
    half = small_config(protocol=protocol, cluster={"jitter": 0.3}, train={"max_epochs": 1})
    distsgd.train(half, out_dir=tmp_path / "half")
    s = distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=2"])
    assert s["epochs"] == 2
    mf = read_metrics(tmp_path / "full" / "metrics.jsonl")
    mh = read_metrics(tmp_path / "half" / "metrics.jsonl")
    assert [r["samples"] for r in mh] == [r["samples"] for r in mf]
    assert [r["eval_loss"] for r in mh] == [r["eval_loss"] for r in mf]
    assert [r["virtual_s"] for r in mh] == [r["virtual_s"] for r in mf]


def test_resume_refuses_changes_to_what_was_computed(tmp_path):
    distsgd.train(small_config(train={"max_epochs": 1}), out_dir=tmp_path / "r")
    for item in ("optimizer.lr=0.1", "train.seed=5", "train.target=0.99"):
        with pytest.raises(ConfigError, match="only these settings may change"):
            distsgd.train(resume=tmp_path / "r", overrides=[item])
    with pytest.raises(ConfigError, match="does not exist"):
        distsgd.train(resume=tmp_path / "nothing")


def test_resume_of_a_run_that_reached_its_target_needs_stop_at_target_off(tmp_path):
    cfg = small_config(train={"target": 0.3, "max_epochs": 3})
    s = distsgd.train(cfg, out_dir=tmp_path / "r")
    assert s["reached"]
    with pytest.raises(ConfigError, match="already reached its target"):
        distsgd.train(resume=tmp_path / "r")
    s2 = distsgd.train(resume=tmp_path / "r", overrides=["train.stop_at_target=false"])
    assert s2["epochs"] == 3 and s2["samples_to_target"] == s["samples_to_target"]


def test_python_api_leaves_the_callers_dict_alone(tmp_path):
    raw = small_config(train={"max_epochs": 1}).to_dict()
    before = json.dumps(raw, sort_keys=True)
    distsgd.train(raw, overrides=["optimizer.lr=0.02"], out_dir=tmp_path / "r")
    assert json.dumps(raw, sort_keys=True) == before


def test_failed_start_leaves_no_directory(tmp_path):
    cfg = small_config(data={"dataset": "fashion_mnist", "root": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="none"):
        distsgd.train(cfg, out_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_default_out_dir_stays_under_runs():
    from distsgd.api import default_out_dir

    out = default_out_dir(small_config(name="../../etc/x"))
    assert out.parent == Path("runs") and "/" not in out.name and not out.name.startswith(".")


def test_default_out_dirs_of_runs_started_within_one_second_differ(tmp_path, monkeypatch):
    from distsgd.api import default_out_dir

    monkeypatch.chdir(tmp_path)
    first = default_out_dir(small_config(name="x"))
    first.mkdir(parents=True)
    second = default_out_dir(small_config(name="x"))
    assert second != first and second.parent == first.parent
    assert second.name.startswith(first.name) or second.name[:15] != first.name[:15]


def test_out_dir_with_a_run_is_not_overwritten(tmp_path):
    cfg = small_config(train={"max_epochs": 1})
    distsgd.train(cfg, out_dir=tmp_path / "r")
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        distsgd.train(cfg, out_dir=tmp_path / "r")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_out_dir_with_run_files_but_no_checkpoint_says_so_in_one_sentence(tmp_path):
    # a fresh-user review: "...choose another output directory (--out) or it has no
    # checkpoint to resume from; delete it to start again" (two sentences run together,
    # and advice to delete what may be the user's own files)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("x\n")
    with pytest.raises(ConfigError) as e:
        distsgd.train(small_config(train={"max_epochs": 1}), out_dir=tmp_path / "r")
    assert str(e.value).endswith(
        "already holds a run; it has no checkpoint to resume from; choose another output "
        "directory (--out)"
    )
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == "x\n"


def test_divergence_stops_with_step_learner_and_lr_and_keeps_checkpoint(tmp_path):
    cfg = small_config(
        protocol={"name": "parameter_server", "num_learners": 2, "mode": "async"},
        optimizer={"lr": 1000.0, "momentum": 0.0},  # the largest lr allowed
        train={"eval_every_samples": 64},
    )
    with pytest.raises(TrainingDiverged) as e:
        Trainer(cfg, tmp_path / "r", progress=False).run()
    msg = str(e.value)
    assert "step" in msg and "learner" in msg and "base learning rate 1000" in msg
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    ckpt = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    w = ckpt["protocol"]
    assert all(
        torch.isfinite(v).all()
        for v in w.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )
    assert not math.isnan(summary["best_metric"])


def test_global_batch_larger_than_dataset_is_a_config_error(tmp_path):
    cfg = small_config(protocol={"num_learners": 8, "batch_size": 256})
    with pytest.raises(ConfigError, match="protocol.batch_size"):
        distsgd.train(cfg, out_dir=tmp_path / "r")


FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed")
@pytest.mark.slow
def test_hardsync_4x32_matches_1x128_on_fashion_mnist(tmp_path):
    def run(lam, b, name):
        cfg = small_config(
            data={"dataset": "fashion_mnist"},
            model={"name": "cnn"},
            protocol={"name": "hardsync", "num_learners": lam, "batch_size": b},
            train={"max_epochs": 0, "max_samples": 1920, "eval_every_samples": 960},
        )
        distsgd.train(cfg, out_dir=tmp_path / name)
        return [r["eval_loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]

    a, b = run(4, 32, "a"), run(1, 128, "b")
    assert len(a) == 3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4


def test_read_metrics_ignores_a_torn_last_line_but_not_corruption(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')
    assert read_metrics(p) == [{"a": 1}, {"a": 2}]
    p.write_text('{"a": 1}\ngarbage\n{"a": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(p)


def test_resume_of_a_run_written_with_the_former_accuracy_names(tmp_path):
    """A run directory of the version whose only metric was accuracy: config.toml says
    ``train.target_accuracy``, the checkpoint's counters ``best_accuracy``."""
    from distsgd.metrics import save_checked

    run = tmp_path / "r"
    distsgd.train(small_config(train={"max_epochs": 1}), out_dir=run)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["trainer"]["best_accuracy"] = state["trainer"].pop("best_metric")
    save_checked(state, run / "checkpoint.pt")
    toml = (run / "config.toml").read_text().replace("\ntarget = ", "\ntarget_accuracy = ")
    assert "\ntarget_accuracy = " in toml
    (run / "config.toml").write_text(toml)
    s = distsgd.train(resume=run, overrides=["train.max_epochs=2"])
    records = read_metrics(run / "metrics.jsonl")
    assert s["status"] == "completed" and s["epochs"] == 2
    assert s["best_metric"] == max(r["eval_metric"] for r in records)


def test_resuming_a_run_from_before_memory_format_keeps_it_contiguous(tmp_path):
    """A run directory written before train.memory_format existed trained contiguous: its
    resume must not switch a cnn to auto's channels_last (another rounding, silently)."""
    cfg = small_config(
        model={"name": "cnn"}, data={"num_train": 256, "num_test": 64}, train={"max_epochs": 1}
    )
    distsgd.train(cfg, out_dir=tmp_path / "run")
    path = tmp_path / "run" / "config.toml"
    assert distsgd.api.resume_config(tmp_path / "run").train.memory_format == "channels_last"
    lines = [x for x in path.read_text().splitlines() if not x.startswith("memory_format")]
    path.write_text("\n".join(lines) + "\n")
    assert distsgd.api.resume_config(tmp_path / "run").train.memory_format == "contiguous"


def test_a_time_limit_another_rank_reached_is_named_max_seconds(tmp_path, monkeypatch):
    """A user's review: a --tune run on dist with train.max_seconds ended with
    stop_reason "max_virtual_seconds". On dist every rank decides the limit together
    (``any_rank``), and the writer's own wall can be short of it when another rank's is
    not; the reason named the other limit then. Here every rank but the writer is past it."""
    monkeypatch.setattr(SimRuntime, "any_rank", lambda self, flag: True)
    cfg = small_config(train={"max_seconds": 1e9})
    s = Trainer(cfg, tmp_path / "r", progress=False).run()
    assert s["stop_reason"] == "max_seconds"
