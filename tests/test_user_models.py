"""The user's own model, data, loss and metric, named by import path, on every protocol
and both runtimes (the models and data live only in ``tests/user_project``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.cli import main as cli_main
from distsgd.config import ConfigError
from distsgd.metrics import read_metrics
from distsgd.runtime import factory, profiles
from tests.conftest import small_config

ZOO = "tests.user_project.zoo"
REPO = Path(__file__).resolve().parents[1]
TABULAR = {
    "model": {"factory": f"{ZOO}:tabular_mlp", "kwargs": {"hidden": 16}},
    "data": {"factory": f"{ZOO}:tabular"},
}
TOKENS = {
    "model": {"factory": f"{ZOO}:TokenModel"},
    "data": {"factory": f"{ZOO}:tokens"},
}
PROTOCOLS = {
    "hardsync": {"name": "hardsync", "num_learners": 2, "batch_size": 16},
    "softsync": {
        "name": "parameter_server",
        "num_learners": 2,
        "mode": "softsync",
        "batch_size": 16,
    },
    "async": {"name": "parameter_server", "num_learners": 2, "mode": "async", "batch_size": 16},
    "groups": {"name": "compute_groups", "num_learners": 4, "num_groups": 2, "batch_size": 16},
    "sma": {"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 16},
    "local_sgd": {
        "name": "local_sgd",
        "num_learners": 4,
        "replicas_per_device": 2,
        "average_every": 3,
        "batch_size": 16,
    },
    "plain": {"name": "plain", "num_learners": 1, "batch_size": 16},
}


def user_config(user: dict, protocol: dict | None = None, runtime: str = "sim", **train):
    t = {"max_epochs": 2, "eval_every_samples": 256, "tensorboard": False, **train}
    sections = {k: dict(v) for k, v in user.items()}
    return small_config(
        **sections,
        protocol=protocol or PROTOCOLS["hardsync"],
        train=t,
        runtime=runtime,
        dist={"timeout_s": 20.0},
    )


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_every_protocol_trains_a_user_model_with_batchnorm_on_map_style_data(tmp_path, protocol):
    s = distsgd.train(user_config(TABULAR, PROTOCOLS[protocol]), out_dir=tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert s["status"] == "completed" and s["metric"] == "accuracy"
    assert s["model"] == f"{ZOO}:tabular_mlp" and s["dataset"] == f"{ZOO}:tabular"
    # 3 well separated classes: chance is 1/3, two epochs of 512 samples get far above it
    assert records[-1]["eval_metric"] > 0.8 > records[0]["eval_metric"] - 0.2
    saved = distsgd.RunConfig.from_toml(tmp_path / "config.toml")
    assert saved.model.factory == f"{ZOO}:tabular_mlp" and saved.model.kwargs == {"hidden": 16}


def test_hardsync_lambda_b_equals_one_learner_lambda_b_for_a_user_model(tmp_path):
    four = {"name": "hardsync", "num_learners": 4, "batch_size": 16}
    one = {"name": "hardsync", "num_learners": 1, "batch_size": 64}
    distsgd.train(user_config(TOKENS, four), out_dir=tmp_path / "a")
    distsgd.train(user_config(TOKENS, one), out_dir=tmp_path / "b")
    la = [r["eval_loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    lb = [r["eval_loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert len(la) == 5
    # as for the built-in models: the learners share weights and no layer sees the batch,
    # so the simulator computes one batch of 64 in the single learner's order: identical
    assert la == lb


def test_sequence_model_with_perplexity_stops_at_its_target(tmp_path):
    cfg = user_config(
        TOKENS,
        PROTOCOLS["sma"],
        metric="perplexity",
        target=1.5,
        max_epochs=20,
        eval_every_samples=512,
    )
    s = distsgd.train(cfg, out_dir=tmp_path, overrides=["optimizer.lr=0.5"])
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert s["metric"] == "perplexity" and s["metric_direction"] == "min"
    assert s["reached"] and s["stop_reason"] == "target"
    assert records[-1]["eval_metric"] <= 1.5 < records[0]["eval_metric"]
    # perplexity is exp of the mean evaluation loss (nats per position)
    assert records[-1]["eval_metric"] == pytest.approx(
        torch.tensor(records[-1]["eval_loss"]).exp().item()
    )
    assert s["best_metric"] == min(r["eval_metric"] for r in records)


def test_user_loss_and_min_metric(tmp_path):
    cfg = user_config(
        TABULAR,
        PROTOCOLS["softsync"],
        loss=f"{ZOO}:smooth_l1",
        metric=f"{ZOO}:error_rate",
        metric_direction="min",
        target=0.05,
        max_epochs=6,
    )
    s = distsgd.train(cfg, out_dir=tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert s["loss"] == f"{ZOO}:smooth_l1" and s["metric_direction"] == "min"
    assert s["reached"] and s["stop_reason"] == "target"
    assert records[-1]["eval_metric"] <= 0.05 < records[0]["eval_metric"]
    assert s["best_metric"] == min(r["eval_metric"] for r in records)


def test_tensor_pairs_and_map_style_data_train_alike(tmp_path):
    """The fast path (tensors) and the general one (items through default_collate) give
    the same batches, so the same run."""
    tensors = {**TABULAR, "data": {"factory": f"{ZOO}:tabular_tensors"}}
    distsgd.train(user_config(TABULAR), out_dir=tmp_path / "map")
    distsgd.train(user_config(tensors), out_dir=tmp_path / "tensors")
    a = read_metrics(tmp_path / "map" / "metrics.jsonl")
    b = read_metrics(tmp_path / "tensors" / "metrics.jsonl")
    assert [r["eval_loss"] for r in a] == [r["eval_loss"] for r in b]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.factory=nowhere.model:build"],
            r"model.factory = 'nowhere.model:build' does not import: no module named 'nowhere'",
        ),
        ([f"model.factory={ZOO}:missing"], r"has no attribute 'missing'"),
        ([f"model.factory={ZOO}:NOT_CALLABLE"], r"names a int, expected a function or class"),
        ([f"model.factory={ZOO}:not_a_module"], r"returned a str: expected a torch.nn.Module"),
        (["model.factory=tabular_mlp"], r'expected "" or an import path'),
        (
            [f"data.factory={ZOO}:not_tensor_items"],
            r"items do not make a batch|expected \(inputs, targets\) tensors",
        ),
        ([f"data.factory={ZOO}:ragged_items"], r"its items do not make a batch .*data.collate"),
        ([f"data.factory={ZOO}:raising_factory"], r"raised FileNotFoundError: /data/missing.csv"),
        (
            [f"train.loss={ZOO}:per_sample_loss"],
            r"train.loss = .* returned \[\d+\], expected a scalar",
        ),
        (
            [f"train.metric={ZOO}:error_rate"],
            r"train.metric_direction = '' is not allowed: expected \"max\" or \"min\"",
        ),
        (
            ["train.metric=accuracy", "train.metric_direction=min"],
            r"train.metric_direction = 'min' is not allowed",
        ),
        (
            [f"model.factory={ZOO}:TupleModel", "model.kwargs={}"],
            r"its forward returned a tuple, expected one tensor of outputs",
        ),
        (
            [f"model.factory={ZOO}:Frozen", "model.kwargs={}"],
            r"the model has no trainable parameters",
        ),
        (
            [f"data.factory={ZOO}:float_targets"],
            r"train.loss = 'cross_entropy' on outputs \[2, 3\] torch.float32 and targets \[2\] "
            r"torch.float32 raised RuntimeError",
        ),
        (
            [
                f"data.factory={ZOO}:regression_flat",
                "train.loss=mse",
                "train.metric=loss",
                "model.kwargs.num_classes=1",
            ],
            r"train.loss = 'mse' needs outputs and targets of one shape: the model gives "
            r"\[2, 1\], the data \[2\]",
        ),
        (["train.loss=hinge"], r"train.loss = 'hinge' is not allowed: expected 'cross_entropy'"),
        # user code that exits or interrupts is a failure of that code, named
        (
            [f"model.factory={ZOO}:exits", "model.kwargs={}"],
            rf"model.factory = '{ZOO}:exits' raised SystemExit: 0 \(it called sys.exit\)",
        ),
        (
            [f"model.factory={ZOO}:interrupts", "model.kwargs={}"],
            rf"model.factory = '{ZOO}:interrupts' raised KeyboardInterrupt$",
        ),
        (
            ["model.factory=tests.user_project.exits_on_import:build", "model.kwargs={}"],
            r"importing 'tests.user_project.exits_on_import' raised SystemExit: 0",
        ),
        ([f"data.factory={ZOO}:exits"], rf"data.factory = '{ZOO}:exits' raised SystemExit: 0"),
        (
            [f"train.loss={ZOO}:exiting_loss"],
            rf"train.loss = '{ZOO}:exiting_loss' raised SystemExit: 3 \(it called sys.exit\)",
        ),
        # data that cannot train: empty, or NaN before any update
        (
            [f"data.factory={ZOO}:empty_train"],
            rf"data.factory = '{ZOO}:empty_train' \(train\): the data set is empty",
        ),
        (
            [f"data.factory={ZOO}:nan_inputs"],
            r"\(train\): sample 5 holds NaN or infinity in its inputs \(1 of 512 samples",
        ),
        # a metric that cannot mean anything
        (
            [
                f"data.factory={ZOO}:regression",
                f"train.loss={ZOO}:smooth_l1_raw",
                "model.kwargs.num_classes=1",
            ],
            r"train.metric = 'accuracy' is not allowed on outputs \[2, 1\] and targets "
            r"\[2, 1\] torch.float32 \(not class labels",
        ),
        (
            [f"train.metric={ZOO}:nan_metric", "train.metric_direction=max"],
            rf"train.metric = '{ZOO}:nan_metric' returned nan on a batch of 2 evaluation",
        ),
        ([f"train.loss={ZOO}:nan_loss"], r"is nan on the untrained model's outputs"),
        (
            [f"model.factory={ZOO}:TokenModel", "model.kwargs={}"],
            r"forward on a batch of the data \(inputs \[2, 12\] torch.float32\) raised",
        ),
    ],
)
def test_bad_user_code_is_one_config_error_and_no_run_is_left(tmp_path, overrides, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message) as e:
        distsgd.train(user_config(TABULAR), overrides=overrides, out_dir=out)
    assert "\n" not in str(e.value)
    for name in ("summary.json", "config.toml", "metrics.jsonl", "checkpoint.pt", "model.pt"):
        assert not (out / name).exists(), name


def test_cli_bad_factory_exits_2_with_one_line(tmp_path, capsys):
    code = cli_main(
        ["train", "--set", "model.factory=nowhere:build", "--out", str(tmp_path / "r"), "--quiet"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "model.factory" in err


def test_built_in_model_on_user_data_takes_its_shape_from_the_data(tmp_path):
    cfg = user_config({"model": {"name": "mlp"}, "data": {"factory": f"{ZOO}:tabular_tensors"}})
    distsgd.train(cfg, out_dir=tmp_path)
    saved = distsgd.RunConfig.from_toml(tmp_path / "config.toml")
    assert saved.model.kwargs == {"input_shape": [12], "num_classes": 3}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("user", "protocol", "tol"),
    [(TOKENS, "hardsync", 1e-6), (TABULAR, "sma", 0.0)],
    ids=["tokens-hardsync", "tabular-batchnorm-sma"],
)
def test_user_model_on_real_processes_matches_the_simulator(tmp_path, user, protocol, tol):
    """The same equivalence and tolerances as the built-in models' (tests/test_dist.py):
    hardsync 1e-6 (DDP all-reduces two means of 16 where the simulator takes one batch of
    32), SMA exact (per-device sums, then an order-independent all-reduce of two)."""
    from tests.test_dist import check_equivalent

    distsgd.train(user_config(user, PROTOCOLS[protocol]), out_dir=tmp_path / "sim")
    distsgd.train(
        user_config(user, PROTOCOLS[protocol], runtime="dist"),
        overrides=["dist.num_processes=2"],
        out_dir=tmp_path / "dist",
    )
    keys = ["weights"] if protocol == "hardsync" else ["replicas", "central"]
    check_equivalent(tmp_path / "sim", tmp_path / "dist", keys, tol)
    assert (
        json.loads((tmp_path / "dist" / "summary.json").read_text())["model"]
        == user["model"]["factory"]
    )


@pytest.mark.slow
def test_tune_plans_a_user_model_and_the_plan_trains(tmp_path):
    base = user_config(
        TABULAR,
        {"name": "hardsync", "num_learners": 2, "batch_size": 16},
        target=0.9,
        max_epochs=4,
    )
    base = base.replace(
        tune=dataclasses.replace(
            base.tune,
            probe_seconds=0.03,
            lrs=[0.1, 0.01],
            momenta=[0.0, 0.9],
            batch_sizes=[16],
            extra_probes=1,
        )
    )
    (tmp_path / "base.toml").write_text(base.to_toml())
    out = tmp_path / "tune"
    assert (
        cli_main(
            ["tune", str(tmp_path / "base.toml"), "--budget", "40s", "--out", str(out), "--quiet"]
        )
        == 0
    )
    plan = distsgd.RunConfig.from_toml(out / "plan.toml")
    assert plan.model.factory == f"{ZOO}:tabular_mlp" and plan.data.factory == f"{ZOO}:tabular"
    assert (
        cli_main(["train", str(out / "plan.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["reached"]


def test_tune_refuses_a_lower_is_better_metric_in_one_line(tmp_path, capsys):
    base = user_config(TOKENS, metric="perplexity", target=1.5)
    (tmp_path / "base.toml").write_text(base.to_toml())
    assert cli_main(["tune", str(tmp_path / "base.toml"), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.metric = 'perplexity'" in err


def test_dist_run_checks_import_paths_before_starting_any_process(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["train", "--set", "runtime=dist", "--set", f"train.metric={ZOO}:nothing"]
    code = cli_main([*args, "--set", "train.metric_direction=max", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].endswith(
        f"train.metric = '{ZOO}:nothing' is not allowed: {ZOO!r} has no attribute 'nothing'"
    )
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["softsync", "async", "groups", "local_sgd", "plain"])
def test_every_other_protocol_trains_a_user_model_on_real_processes(tmp_path, protocol):
    """The protocols the equivalence tests above do not cover, on real processes with the
    BatchNorm MLP on map-style data: the run completes, evaluates and writes model.pt."""
    cfg = user_config(TABULAR, PROTOCOLS[protocol], runtime="dist", max_epochs=1)
    s = distsgd.train(cfg, out_dir=tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert s["status"] == "completed" and s["runtime"] == "dist"
    assert records[-1]["eval_metric"] > records[0]["eval_metric"]
    assert (tmp_path / "model.pt").exists()


def test_a_model_that_does_not_fit_fails_in_one_line_before_the_device_is_calibrated(
    tmp_path, monkeypatch, capsys
):
    """Found by a fresh user: on a model's first simulated run (no cached device profile)
    a forward that fails on the data raised inside the calibration: a traceback, exit 1."""
    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: measured.append(1))
    out = tmp_path / "run"
    code = cli_main(
        [
            "train",
            "--set", f"model.factory={ZOO}:TokenModel",
            "--set", "model.kwargs={}",
            "--set", f"data.factory={ZOO}:tabular",
            "--set", "cluster.seconds_per_sample=-1",
            "--set", "cluster.seconds_per_batch=-1",
            "--set", "train.max_epochs=1",
            "--out", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "forward on a batch of the data" in err and not measured
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_a_factory_that_exits_on_real_processes_is_one_line(tmp_path):
    """A data factory that calls sys.exit inside every rank of a dist run: the run ends
    with the one line of the sim runtime and exit status 2, no rank's own copy of it and
    no launcher line per rank."""
    out = tmp_path / "r"
    r = subprocess.run(
        [sys.executable, "-m", "distsgd", "train", "--runtime", "dist", "--quiet"]
        + ["--set", f"data.factory={ZOO}:exits", "--set", "protocol.num_learners=2"]
        + ["--set", "protocol.batch_size=16", "--set", "train.max_samples=256"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and "raised SystemExit: 0" in err[0], r.stderr
