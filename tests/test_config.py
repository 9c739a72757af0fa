import dataclasses
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest

from distsgd.config import (
    ConfigError,
    DistConfig,
    ProtocolConfig,
    RunConfig,
    TuneConfig,
    apply_override,
    fit_layout,
    required_processes,
)


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    cfg = RunConfig()
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig.from_toml(path) == cfg


def test_round_trip_keeps_lists_and_strings(tmp_path):
    cfg = RunConfig.from_dict(
        {
            "name": 'odd "name"',
            "protocol": {"name": "parameter_server", "num_learners": 4, "softsync": 2},
            "cluster": {"speed_factors": [1.0, 2.0, 3.0, 4.0]},
            "schedule": {"kind": "step", "decay_epochs": [2, 4]},
        }
    )
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig.from_toml(path) == cfg


def test_overrides_parse_toml_values_and_bare_words():
    raw: dict = {}
    apply_override(raw, "optimizer.lr=0.5")
    apply_override(raw, "protocol.name=sma")
    apply_override(raw, "cluster.speed_factors=[1, 2]")
    apply_override(raw, "train.stop_at_target=false")
    assert raw == {
        "optimizer": {"lr": 0.5},
        "protocol": {"name": "sma"},
        "cluster": {"speed_factors": [1, 2]},
        "train": {"stop_at_target": False},
    }


def test_override_lists_of_bare_words_are_strings():
    # a shell drops the quotes of --set tune.families=["hardsync", "sma"]; the list of bare
    # words was taken whole as the string '[hardsync, sma]' and named as such in the error
    raw: dict = {}
    apply_override(raw, "tune.families=[hardsync, sma]")
    apply_override(raw, "tune.lrs=[0.1, 0.01,]")
    apply_override(raw, 'model.kwargs.names=["a", b]')
    # a quoted item keeps its commas (it was cut at them: found by a fresh user)
    apply_override(raw, 'data.kwargs.names=["x,y", b, "c\\",d"]')
    assert raw["tune"] == {"families": ["hardsync", "sma"], "lrs": [0.1, 0.01]}
    assert raw["model"] == {"kwargs": {"names": ["a", "b"]}}
    assert raw["data"] == {"kwargs": {"names": ["x,y", "b", 'c",d']}}
    with pytest.raises(ConfigError, match=r"tune.families = \['bogus'\] is not allowed"):
        RunConfig.from_toml(None, ["tune.families=[bogus]"])


# "[a, b]]": an extra bracket was kept in the last item ('b]': found by a fresh user)
@pytest.mark.parametrize("value", ["[0.1", "[1, [2]", "{x = 1", '"text', "[1,,2]", "[a, b]]"])
def test_override_that_opens_a_toml_value_but_is_none_is_one_line(value):
    raw: dict = {}
    with pytest.raises(ConfigError, match=r"--set 'optimizer.lr=") as e:
        apply_override(raw, f"optimizer.lr={value}")
    assert "\n" not in str(e.value) and raw == {}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optimizer.lr=-1", "optimizer.lr = -1"),
        ("optimizer.lr=nan", "optimizer.lr = nan"),
        ("protocol.name=bogus", "protocol.name = 'bogus'"),
        ("protocol.num_learners=0", "protocol.num_learners = 0"),
        ("protocol.batch_size=2.5", "protocol.batch_size = 2.5"),
        ("optimizer.momentum=1.0", "optimizer.momentum = 1.0"),
        ("train.target=1.5", "train.target = 1.5"),
        ("model.name=vgg", "model.name = 'vgg'"),
        ("data.dataset=imagenet", "data.dataset = 'imagenet'"),
        ("protocol.staleness_lr=sometimes", "protocol.staleness_lr = 'sometimes'"),
        ("schedule.decay_epochs=[3, 1]", "schedule.decay_epochs = [3, 1]"),
        ("runtime=gpu-farm", "runtime = 'gpu-farm'"),
        ("train.memory_format=nhwc", "train.memory_format = 'nhwc'"),
    ],
)
def test_bad_values_name_the_setting_and_value(override, fragment):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_toml(None, [override])
    msg = str(e.value)
    assert fragment in msg
    assert "expected" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_momentum_out_of_range_says_the_same_range_either_side(value):
    # a fresh-user review: 1.0 said [0, 1) and -0.1 said [0.0, 1.0] (which allows 1)
    with pytest.raises(ConfigError, match=r"expected a number in \[0\.0, 1\.0\)$"):
        RunConfig.from_toml(None, [f"optimizer.momentum={value}"])


def test_softsync_must_divide_num_learners():
    with pytest.raises(ConfigError, match="protocol.softsync = 3"):
        RunConfig.from_dict(
            {"protocol": {"name": "parameter_server", "num_learners": 4, "softsync": 3}}
        )
    # async ignores the softsync setting
    RunConfig.from_dict(
        {
            "protocol": {
                "name": "parameter_server",
                "mode": "async",
                "num_learners": 4,
                "softsync": 3,
            }
        }
    )


def test_groups_and_replicas_must_divide_num_learners():
    with pytest.raises(ConfigError, match="protocol.num_groups = 3"):
        RunConfig.from_dict(
            {"protocol": {"name": "compute_groups", "num_learners": 8, "num_groups": 3}}
        )
    with pytest.raises(ConfigError, match="protocol.replicas_per_device = 3"):
        RunConfig.from_dict(
            {"protocol": {"name": "sma", "num_learners": 4, "replicas_per_device": 3}}
        )


def test_unknown_keys_are_rejected():
    with pytest.raises(ConfigError, match="optimizer.learning_rate is not a setting"):
        RunConfig.from_dict({"optimizer": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError, match="trainer is not a setting"):
        RunConfig.from_dict({"trainer": {}})


def test_speed_factors_need_one_per_learner():
    with pytest.raises(ConfigError, match="cluster.speed_factors"):
        RunConfig.from_dict({"protocol": {"num_learners": 4}, "cluster": {"speed_factors": [1, 2]}})


def test_bad_toml_file_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[protocol\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunConfig.from_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        RunConfig.from_toml(None, ["optimizer.lr"])


def test_schedule_step_and_warmup():
    cfg = RunConfig.from_dict(
        {
            "schedule": {
                "kind": "step",
                "decay_epochs": [2, 4],
                "decay_factor": 0.5,
                "warmup_epochs": 1,
            }
        }
    )
    s = cfg.schedule
    assert s.lr_at(1.0, 0.0) == pytest.approx(0.1)
    assert s.lr_at(1.0, 0.5) == pytest.approx(0.55)
    assert s.lr_at(1.0, 1.0) == 1.0
    assert s.lr_at(1.0, 2.0) == 0.5
    assert s.lr_at(1.0, 5.0) == 0.25


def test_adagrad_server_rejects_momentum():
    with pytest.raises(ConfigError, match="optimizer.momentum = 0.9"):
        RunConfig.from_dict(
            {"protocol": {"name": "parameter_server", "server_optimizer": "adagrad"}}
        )
    RunConfig.from_dict(
        {
            "protocol": {"name": "parameter_server", "server_optimizer": "adagrad"},
            "optimizer": {"momentum": 0.0},
        }
    )


# ---- fitting the dist layout to an explicit process count ------------------------------

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))

# Expected layout of each shipped config fitted to 3 processes (SPEC §1–§5 rules in
# fit_layout's docstring): (λ, n-softsync, g, changes printed).
FITTED_TO_3 = {
    "async": (2, 1, 1, ["protocol.num_learners 8 → 2"]),  # mode async: n = λ implicitly
    "groups": (2, 1, 2, ["protocol.num_learners 8 → 2"]),  # g = 2 still divides λ = 2
    "hardsync": (3, 1, 1, ["protocol.num_learners 4 → 3"]),
    "local_sgd": (3, 1, 1, ["protocol.num_learners 4 → 3"]),  # k = 1: 3 devices
    "sma": (12, 1, 1, ["protocol.num_learners 4 → 12"]),  # 3 devices × k = 4
    "softsync1": (2, 1, 1, ["protocol.num_learners 4 → 2"]),
    "softsync4": (2, 2, 1, ["protocol.num_learners 4 → 2", "protocol.softsync 4 → 2"]),
    "tune_fashion_mnist": (3, 1, 1, ["protocol.num_learners 2 → 3"]),  # base of distsgd tune
}


def test_every_shipped_config_is_listed():
    assert sorted(p.stem for p in CONFIGS) == sorted(FITTED_TO_3)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_fit_three_processes(path):
    base = RunConfig.from_toml(path, ["runtime=dist"])
    cfg = RunConfig.from_toml(path, ["runtime=dist", "dist.num_processes=3"])
    lam, n, g, changes = FITTED_TO_3[path.stem]
    p = cfg.protocol
    assert (p.num_learners, p.softsync, p.num_groups) == (lam, n, g)
    assert cfg.layout_changes == changes
    assert required_processes(p, cfg.dist)[0] == 3
    # Only the layout changed: per-learner batch, lr and every other setting kept.
    assert cfg.optimizer == base.optimizer and cfg.train == base.train
    assert p.batch_size == base.protocol.batch_size
    rest = {"num_learners", "softsync", "num_groups"}
    assert {k: v for k, v in asdict(p).items() if k not in rest} == {
        k: v for k, v in asdict(base.protocol).items() if k not in rest
    }
    # The fitted config written to a run's config.toml reads back equal, with no change.
    again = RunConfig.from_dict(tomllib.loads(cfg.to_toml()))
    assert again == cfg and again.layout_changes == []


def test_a_fitting_process_count_changes_nothing():
    cfg = RunConfig.from_toml(CONFIGS[0].parent / "hardsync.toml", ["runtime=dist"])
    fitted = RunConfig.from_toml(
        CONFIGS[0].parent / "hardsync.toml", ["runtime=dist", "dist.num_processes=4"]
    )
    assert fitted == cfg.replace(dist=fitted.dist) and fitted.layout_changes == []


@pytest.mark.parametrize(
    "protocol, n, expected",
    [
        # compute groups: g = largest divisor of the new λ that is <= the old g
        ({"name": "compute_groups", "num_learners": 8, "num_groups": 4}, 7, (6, 1, 3)),
        ({"name": "compute_groups", "num_learners": 8, "num_groups": 4}, 6, (5, 1, 1)),
        # n-softsync: n kept when it still divides λ, else the largest divisor below it
        ({"name": "parameter_server", "num_learners": 8, "softsync": 2}, 7, (6, 2, 1)),
        ({"name": "parameter_server", "num_learners": 8, "softsync": 4}, 6, (5, 1, 1)),
        ({"name": "parameter_server", "num_learners": 8, "softsync": 4}, 10, (9, 3, 1)),
        # fully asynchronous n = λ stays n = λ (also when λ grows)
        ({"name": "parameter_server", "num_learners": 2, "softsync": 2}, 8, (7, 7, 1)),
    ],
)
def test_fit_layout_divisor_rules(protocol, n, expected):
    p, changes = fit_layout(ProtocolConfig(**protocol), DistConfig(), n)
    assert (p.num_learners, p.softsync, p.num_groups) == expected
    assert changes[0].startswith("protocol.num_learners ")


def test_fit_layout_with_server_shards_and_the_sim_runtime():
    cfg = RunConfig.from_toml(
        CONFIGS[0].parent / "async.toml",
        ["runtime=dist", "dist.num_servers=2", "dist.num_processes=5"],
    )
    assert cfg.protocol.num_learners == 3
    # The sim runtime ignores dist.num_processes: nothing is fitted.
    sim = RunConfig.from_toml(CONFIGS[0].parent / "async.toml", ["dist.num_processes=5"])
    assert sim.protocol.num_learners == 8 and sim.layout_changes == []


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["protocol.name=plain", "protocol.num_learners=1", "dist.num_processes=2"], "1 or 0"),
        (["protocol.name=parameter_server", "dist.num_processes=1"], "more than dist.num_s"),
        (
            ["protocol.name=compute_groups", "dist.num_servers=2", "dist.num_processes=2"],
            "more than dist.num_servers = 2",
        ),
    ],
)
def test_layouts_that_cannot_fit_are_config_errors(overrides, fragment):
    with pytest.raises(ConfigError, match="dist.num_processes = ") as e:
        RunConfig.from_toml(None, ["runtime=dist", *overrides])
    assert fragment in str(e.value)


def test_factory_settings_and_kwargs_round_trip_and_bad_values_are_one_line(tmp_path):
    cfg = RunConfig.from_toml(
        None,
        [
            "model.factory=pkg.model:build",
            "model.kwargs.hidden=3",
            "model.kwargs.shape=[1, 2]",
            'data.kwargs={path = "a \\"b\\"", sub = {n = 1}}',
            "train.metric=pkg.metrics:f1",
            "train.metric_direction=max",
        ],
    )
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig.from_toml(path) == cfg
    assert cfg.data.kwargs == {"path": 'a "b"', "sub": {"n": 1}}
    bad = [
        ({"model": {"factory": "no_colon"}}, r"model.factory = 'no_colon' is not allowed"),
        ({"model": {"kwargs": {"x": None}}}, r"model.kwargs.x = None is not allowed"),
        ({"data": {"kwargs": [1]}}, r"data.kwargs = \[1\] is not allowed"),
        ({"train": {"metric": "f1"}}, r"train.metric = 'f1' is not allowed"),
        ({"train": {"metric": "perplexity", "target": -1.0}}, None),
    ]
    for raw, message in bad:
        if message is None:
            RunConfig.from_dict(raw)  # a min metric's target may be any number
            continue
        with pytest.raises(ConfigError, match=message) as e:
            RunConfig.from_dict(raw)
        assert "\n" not in str(e.value)


def test_an_optimizer_and_a_scheduler_of_the_current_directory_import_from_the_console_script(
    tmp_path, monkeypatch
):
    """The ``distsgd`` console script puts its own folder, not the current directory, first
    on ``sys.path``: the user's optimizer and scheduler classes resolve against the current
    directory all the same, as factories do (they were refused with ModuleNotFoundError)."""
    import sys

    (tmp_path / "cwd_optim.py").write_text(
        "import torch\n"
        "class MySGD(torch.optim.SGD):\n"
        "    pass\n"
        "class Late(torch.optim.lr_scheduler.StepLR):\n"
        "    def __init__(self, optimizer):\n"
        "        super().__init__(optimizer, step_size=1)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_optim", raising=False)
    cfg = RunConfig.from_dict(
        {"optimizer": {"name": "cwd_optim:MySGD"}, "schedule": {"kind": "cwd_optim:Late"}}
    )
    assert cfg.optimizer.name == "cwd_optim:MySGD"


def test_tune_settings_split_by_reader_keep_one_flat_table():
    from distsgd.config import OfflineTuneSettings, OnlineTuneSettings, TuneSearchSettings

    # each [tune] key belongs to one piece: both tuners, distsgd tune or train --tune
    def own(cls):
        return set(cls.__annotations__) - {"READ_BY"}

    shared, offline, online = (
        own(TuneSearchSettings),
        own(OfflineTuneSettings),
        own(OnlineTuneSettings),
    )
    assert not shared & offline and not shared & online and not offline & online
    assert {f.name for f in dataclasses.fields(TuneConfig)} == shared | offline | online
    assert offline == {"budget_s", "segment_fraction", "step_points", "step_margin"}
    # the flat [tune] keys of every piece still load, and every range check still runs
    cfg = RunConfig.from_dict({"tune": {"budget_s": 30, "first_rung": 0.25, "lrs": [0.1]}})
    assert (cfg.tune.budget_s, cfg.tune.first_rung, cfg.tune.lrs) == (30, 0.25, [0.1])
    for key, bad in (("budget_s", 0), ("first_rung", 0), ("score_window", 0)):
        with pytest.raises(ConfigError, match=f"tune.{key} = 0 is not allowed"):
            RunConfig.from_dict({"tune": {key: bad}})
