"""Inputs at the edges: numbers at the limits of floating point, schedules that leave the
allowed rates, configs nested without end, NaN in the data or the initial weights, a
metric that means nothing, and user code that exits. Each is one line (exit status 2 from
the CLI) before the run writes anything."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest
import torch

import distsgd
from distsgd.cli import main
from distsgd.config import (
    _SECTIONS,
    MAX_LR,
    MAX_NESTING,
    ConfigError,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from distsgd.data import load_dataset
from distsgd.engine import build_engine, config_for_data
from tests.conftest import FIXED_CLUSTER, small_config

ZOO = "tests.user_project.zoo"
EXPONENTIAL = "torch.optim.lr_scheduler:ExponentialLR"
# the small synthetic run ($B), on a fixed device profile (no calibration line)
B = [
    "--set",
    "data.dataset=synthetic",
    "--set",
    "model.name=mlp",
    "--set",
    "protocol.num_learners=2",
    "--set",
    "protocol.batch_size=16",
    "--set",
    "train.max_samples=256",
    "--set",
    "train.eval_every_samples=128",
    "--set",
    "train.tensorboard=false",
    *[a for k, v in FIXED_CLUSTER.items() for a in ("--set", f"cluster.{k}={v}")],
    "--quiet",
]


def one_line_exit_2_nothing_written(capsys, tmp_path, *sets: str) -> str:
    """``distsgd train $B --set ...`` exits 2 with one line and leaves --out unmade."""
    out = tmp_path / "run"
    argv = ["train", *B, *[a for s in sets for a in ("--set", s)], "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("distsgd: error: "), err
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    return err


# ---- every numeric setting has a finite range -----------------------------------------


@pytest.mark.parametrize(
    "item",
    [
        "optimizer.lr=1e308",  # overflowed float32 in torch's SGD after 8 files
        f"optimizer.lr={MAX_LR * 1.001}",
        "optimizer.weight_decay=1e308",
        "cluster.latency_s=1e308",  # completed with virtual_s null
        "cluster.latency_s=61",
        "cluster.bandwidth_gbps=1e-300",  # 32 P / bandwidth overflows
        "cluster.seconds_per_sample=1e308",
        "cluster.seconds_per_push_contended=1e308",
        "cluster.allreduce_latency_s=1e308",
        "cluster.allreduce_bandwidth_gbps=1e-300",
        "cluster.speed_factors=[1e-300, 1, 1, 1]",
        "cluster.replica_ratios=[1, 1e308]",
        "cluster.cores=100000",
        "data.noise=1e308",
        "schedule.steps_per_epoch=1e308",  # a replay of 1e308 scheduler steps
        "schedule.warmup_epochs=1e308",
        "schedule.decay_epochs=[1e308]",
        "train.max_epochs=1e308",  # ceil(max_epochs * num_train) overflowed
        f"train.max_samples={10**19}",
        "train.max_seconds=1e308",
        "train.max_virtual_seconds=1e308",
        f"train.eval_every_samples={10**19}",
        f"train.eval_batch_size={2**40}",
        f"protocol.batch_size={2**63}",
        f"protocol.num_learners={2**40}",
        "protocol.average_every=10000000",
        "tune.budget_s=1e308",
        "tune.noise_scale=1e308",
    ],
)
def test_numbers_beyond_a_settings_range_are_one_config_error(item):
    key = item.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} = .* is not allowed"):
        RunConfig.from_toml(None, [item])


@pytest.mark.parametrize(
    "item",
    [
        f"optimizer.lr={MAX_LR}",
        "cluster.latency_s=60",
        "cluster.bandwidth_gbps=1e-6",
        "cluster.bandwidth_gbps=0",
        "cluster.allreduce_bandwidth_gbps=0",
        "cluster.allreduce_latency_s=-1",
        "cluster.seconds_per_sample=-1",
        "train.max_epochs=1000000",
        f"train.max_samples={10**12}",
    ],
)
def test_a_settings_bounds_are_allowed(item):
    RunConfig.from_toml(None, [item])


def _numeric_fields():
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float, list[float], list[int], int | str):
                yield section, cls, f.name


def _attribute_text(cls: type, name: str) -> str:
    """The text of ``name``'s entry under the ``Attributes:`` of the docstring of ``cls``
    or of the base class that declares it."""
    for owner in cls.__mro__:
        doc = owner.__doc__ or ""
        m = re.search(rf"^ {{8}}{name}: (.*?)(?=^ {{8}}\w+: |\Z)", doc, re.M | re.S)
        if m:
            return " ".join(m.group(1).split())
    return ""


@pytest.mark.parametrize(("section", "cls", "name"), list(_numeric_fields()))
def test_every_numeric_setting_states_its_range_where_it_is_documented(section, cls, name):
    text = _attribute_text(cls, name)
    assert text, f"{section}.{name} is not documented in {cls.__name__}"
    assert re.search(r"in [\[(][^\]\)]*, [^\]\)]*[\])]|\[0, 1\)", text), f"{section}.{name}: {text}"


@pytest.mark.slow
def test_a_run_at_the_slow_ends_of_the_cluster_keeps_a_finite_virtual_clock(tmp_path):
    """The largest latency and times with the smallest bandwidth and speed: the virtual
    clock stays finite (latency_s = 1e308 completed with virtual_s null)."""
    cfg = small_config(
        protocol={"name": "parameter_server", "num_learners": 2, "mode": "async"},
        cluster={
            "seconds_per_sample": 3600.0,
            "seconds_per_batch": 3600.0,
            "seconds_per_push": 3600.0,
            "latency_s": 60.0,
            "bandwidth_gbps": 1e-6,
            "speed_factors": [1e-6, 1.0],
        },
        train={"max_samples": 128, "max_epochs": 0, "tensorboard": False},
    )
    s = distsgd.train(cfg, out_dir=tmp_path / "run")
    assert s["virtual_s"] is not None and math.isfinite(s["virtual_s"]) and s["virtual_s"] > 0


# ---- a schedule's rates over the run -------------------------------------------------


def test_a_scheduler_that_sets_a_negative_rate_is_refused_with_its_step():
    sched = ScheduleConfig(kind=EXPONENTIAL, kwargs={"gamma": -1.0})
    with pytest.raises(ConfigError, match=r"sets lr = -0.05 at scheduler step 1, epoch 1 "):
        sched.check_rates(0.05, 3.0)
    sched.check_rates(0.05, 0.5)  # the run ends before its first step: rate 0.05 only


def test_a_scheduler_whose_rate_grows_past_the_largest_lr_is_refused():
    sched = ScheduleConfig(kind=EXPONENTIAL, kwargs={"gamma": 10.0})
    with pytest.raises(ConfigError, match=r"sets lr = 5000 at scheduler step 5"):
        sched.check_rates(0.05, math.inf)  # no budget in samples: the first steps
    ScheduleConfig(kind=EXPONENTIAL, kwargs={"gamma": 0.5}).check_rates(0.05, math.inf)


def test_a_rate_past_the_checked_steps_is_refused_when_the_run_reaches_it():
    """check_rates looks at the first MAX_SCHEDULE_CHECK_STEPS steps of a run without a
    budget in samples; a rate that leaves the range later stops the run then, naming the
    schedule (gamma = 1.01 from 0.05 passes 1000 after about 995 steps)."""
    sched = ScheduleConfig(kind=EXPONENTIAL, kwargs={"gamma": 1.01}, steps_per_epoch=100)
    assert sched.lr_at(0.05, 9.0) == pytest.approx(0.05 * 1.01**900)
    with pytest.raises(ConfigError, match=r"it sets lr = 1007.07 at scheduler step 996,"):
        sched.lr_at(0.05, 9.96)


def test_cli_negative_gamma_is_one_line_before_the_run_directory(capsys, tmp_path):
    """gamma = -1 gave "lr = -0.05 is not allowed" naming no setting, after the run
    directory was written."""
    err = one_line_exit_2_nothing_written(
        capsys,
        tmp_path,
        f"schedule.kind={EXPONENTIAL}",
        "schedule.kwargs.gamma=-1.0",
        "schedule.steps_per_epoch=100",
    )
    assert "schedule.kind = 'torch.optim.lr_scheduler:ExponentialLR' with " in err
    assert "schedule.kwargs = {'gamma': -1.0} is not allowed" in err


# ---- configs nested without end ------------------------------------------------------


def test_a_toml_file_nested_20000_levels_is_one_config_error(tmp_path):
    n = 20_000
    path = tmp_path / "deep.toml"
    path.write_text("[model]\nkwargs = {a = " + "[" * n + "]" * n + "}\n")
    with pytest.raises(ConfigError, match="nested too deep to read; expected at most"):
        RunConfig.from_toml(path)


def test_a_dict_nested_20000_levels_or_holding_itself_is_one_config_error(tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(20_000):
        node["a"] = {}
        node = node["a"]
    looped: dict = {}
    looped["me"] = looped
    for kwargs in (deep, looped):
        with pytest.raises(ConfigError, match=r"^model.kwargs = .* levels of nesting"):
            distsgd.train({"model": {"kwargs": kwargs}}, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_override_nested_20000_levels_is_one_short_config_error():
    with pytest.raises(ConfigError, match="nested deeper than") as e:
        RunConfig.from_toml(None, ["model.kwargs.a=" + "[" * 20_000 + "]" * 20_000])
    assert len(str(e.value)) < 400


def test_nesting_up_to_the_limit_is_allowed():
    value: list = []
    for _ in range(MAX_NESTING - 3):  # [model] > kwargs > a > lists
        value = [value]
    cfg = RunConfig.from_dict({"model": {"factory": f"{ZOO}:tabular_mlp", "kwargs": {"a": value}}})
    assert cfg.model.kwargs["a"] == value


# ---- NaN before any update -------------------------------------------------------------


def test_nan_initial_weights_are_refused_before_anything_is_written(tmp_path):
    """Before: exit 1 "training diverged at step 0" after the run directory was written."""
    cfg = small_config(train={"tensorboard": False})
    ds = load_dataset(cfg.data)
    torch.manual_seed(0)
    num_parameters = build_engine(config_for_data(cfg, ds)).num_parameters
    weights = torch.zeros(num_parameters)
    weights[7] = math.nan
    path = tmp_path / "w.pt"
    torch.save(weights, path)
    out = tmp_path / "run"
    overrides = [f'train.initial_weights="{path}"']
    with pytest.raises(ConfigError, match=r"is not allowed: 1 of its \d+ weights are NaN"):
        distsgd.train(cfg, overrides=overrides, out_dir=out)
    assert not out.exists()


def test_cli_nan_in_the_data_is_one_line_before_the_run_directory(capsys, tmp_path):
    """Before: exit 1 "training diverged" with the run directory written."""
    err = one_line_exit_2_nothing_written(
        capsys,
        tmp_path,
        f"data.factory={ZOO}:nan_inputs",
        f"model.factory={ZOO}:tabular_mlp",
    )
    assert "sample 5 holds NaN or infinity in its inputs" in err


def test_cli_an_empty_training_set_is_one_line(capsys, tmp_path):
    """Before: IndexError."""
    err = one_line_exit_2_nothing_written(
        capsys,
        tmp_path,
        f"data.factory={ZOO}:empty_train",
        f"model.factory={ZOO}:tabular_mlp",
    )
    assert "the data set is empty" in err


# ---- user code that exits --------------------------------------------------------------


@pytest.mark.parametrize(
    "setting",
    [
        f"model.factory={ZOO}:exits",
        "model.factory=tests.user_project.exits_on_import:build",
        f"data.factory={ZOO}:exits",
    ],
)
def test_cli_a_factory_that_calls_sys_exit_is_one_line_exit_2(capsys, tmp_path, setting):
    """Before: exit status 0 and nothing printed."""
    err = one_line_exit_2_nothing_written(capsys, tmp_path, setting)
    assert setting.split("=")[0] in err and "SystemExit: 0 (it called sys.exit)" in err


# ---- a metric that cannot mean anything ------------------------------------------------


def test_accuracy_is_refused_for_a_regression_loss():
    with pytest.raises(ConfigError, match=r"^train.metric = 'accuracy' is not allowed: "):
        TrainConfig(loss="mse")
    TrainConfig(loss="mse", metric="loss", target=0.0)


def test_a_user_metric_that_turns_nan_during_the_run_stops_it_naming_the_metric(tmp_path):
    """The two-sample check passes; the first evaluation's NaN stops the run (before:
    "completed" with best_metric null)."""
    cfg = small_config(
        train={
            "metric": f"{ZOO}:nan_on_large_batches",
            "metric_direction": "max",
            "tensorboard": False,
        }
    )
    with pytest.raises(ConfigError, match=rf"^train.metric = '{ZOO}:nan_on_large_batches' "):
        distsgd.train(cfg, out_dir=tmp_path / "run")
