"""Every ready config in configs/ is valid and runs (shrunk to synthetic data here; the
full runs on Fashion-MNIST are on the docs' benchmarks page)."""

from pathlib import Path

import pytest

import distsgd
from distsgd.config import ConfigError, RunConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
SHRINK = [
    "data.dataset=synthetic",
    "data.num_train=512",
    "data.num_test=128",
    "model.name=mlp",
    "train.max_epochs=0",
    "train.max_samples=512",
    "train.eval_every_samples=256",
    "train.num_threads=1",
    "train.tensorboard=false",
    "cluster.seconds_per_sample=1e-4",
    "cluster.seconds_per_batch=1e-3",
]


def test_there_is_a_config_per_protocol():
    names = {RunConfig.from_toml(p).protocol.name for p in CONFIGS}
    assert {"hardsync", "parameter_server", "compute_groups", "sma", "local_sgd"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_runs(path, tmp_path):
    cfg = RunConfig.from_toml(path)
    assert cfg.data.dataset == "fashion_mnist" and cfg.model.name == "cnn"
    s = distsgd.train(path, overrides=SHRINK, out_dir=tmp_path / "run")
    assert s["status"] == "completed" and s["samples"] >= 512


@pytest.mark.parametrize("overrides", [{"tune.promote": 0}, "train.max_epochs=1", [1]])
def test_overrides_that_are_not_a_list_of_strings_are_one_clear_error(tmp_path, overrides):
    # a dict gave "--set 'tune.promote': expected KEY=VALUE" (its keys were iterated)
    with pytest.raises(ConfigError, match="expected a list of 'section.key=value' strings"):
        distsgd.train(None, overrides=overrides, out_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="expected a list"):
        distsgd.api.resume_config(tmp_path, overrides)
    assert not (tmp_path / "r").exists()
