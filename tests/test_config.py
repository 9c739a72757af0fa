import pytest

from distsgd.config import ConfigError, RunConfig, apply_override


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


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optimizer.lr=-1", "optimizer.lr = -1"),
        ("optimizer.lr=nan", "optimizer.lr = nan"),
        ("protocol.name=bogus", "protocol.name = 'bogus'"),
        ("protocol.num_learners=0", "protocol.num_learners = 0"),
        ("protocol.batch_size=2.5", "protocol.batch_size = 2.5"),
        ("optimizer.momentum=1.0", "optimizer.momentum = 1.0"),
        ("train.target_accuracy=1.5", "train.target_accuracy = 1.5"),
        ("model.name=vgg", "model.name = 'vgg'"),
        ("data.dataset=imagenet", "data.dataset = 'imagenet'"),
        ("protocol.staleness_lr=sometimes", "protocol.staleness_lr = 'sometimes'"),
        ("schedule.decay_epochs=[3, 1]", "schedule.decay_epochs = [3, 1]"),
        ("runtime=gpu-farm", "runtime = 'gpu-farm'"),
    ],
)
def test_bad_values_name_the_setting_and_value(override, fragment):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_toml(None, [override])
    msg = str(e.value)
    assert fragment in msg
    assert "expected" in msg
    assert "\n" not in msg


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
