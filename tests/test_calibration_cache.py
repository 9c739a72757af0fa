"""Simulated seconds that do not depend on the load of the moment (issue 18): the device
profile is measured once per machine, model, batch, threads and torch version into a cache
(with its spread), reused, and can come from a file measured elsewhere
(``distsgd calibrate --out`` + ``cluster.profile``)."""

import json
import tomllib
import warnings

import pytest
import torch

from distsgd import cli
from distsgd.config import ConfigWarning, RunConfig
from distsgd.data import load_dataset
from distsgd.engine import config_for_data
from distsgd.runtime import factory, profiles
from distsgd.runtime import sim as sim_module
from distsgd.runtime.sim import DeviceProfile
from distsgd.tuner import tune as tune_module
from distsgd.tuner.budget import TuneBudget
from tests.conftest import small_config

CALIBRATE = {"seconds_per_sample": -1, "seconds_per_batch": -1, "jitter": 0.0}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty profile cache of this test's own (never the user's home)."""
    path = tmp_path / "cache"
    monkeypatch.setenv(profiles.CACHE_ENV, str(path))
    return path


@pytest.fixture
def calls(monkeypatch):
    """Counts the device measurements (:func:`distsgd.runtime.sim.calibrate`), each of which
    returns a fixed profile here: these tests are of the cache, not of the timing (which
    tests/test_sim.py measures), and a real measurement of the cnn costs seconds."""
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return DeviceProfile(seconds_per_batch=1e-3, seconds_per_sample=1e-4, calibrated=True)

    monkeypatch.setattr(factory, "calibrate", counting)
    return counted


def _calibrated(cfg: RunConfig) -> RunConfig:
    ds = load_dataset(cfg.data, seed=0)
    return factory.calibrated_config(config_for_data(cfg, ds), ds)[0]


def test_cache_is_written_once_and_reused(cache, calls, capsys):
    cfg = small_config(cluster=CALIBRATE)
    first = _calibrated(cfg)
    assert len(calls) == factory.PROFILE_REPEATS  # measured: the median of 3
    files = list(cache.glob("*.toml"))
    assert len(files) == 1
    assert f"cached in {files[0]}" in capsys.readouterr().err
    second = _calibrated(cfg)
    assert len(calls) == factory.PROFILE_REPEATS  # not measured again
    assert "cached device profile used" in capsys.readouterr().err
    assert second.cluster == first.cluster  # the same simulated device, bit for bit
    saved = tomllib.loads(files[0].read_text())["profile"]
    assert saved["seconds_per_sample"] == first.cluster.seconds_per_sample
    assert saved["batch_size"] == 32 and saved["model"] == "mlp"


def test_cache_is_keyed_by_batch_size(cache, calls):
    _calibrated(small_config(cluster=CALIBRATE))
    _calibrated(small_config(cluster=CALIBRATE, protocol={"batch_size": 16}))
    assert len(calls) == 2 * factory.PROFILE_REPEATS
    assert len(list(cache.glob("*.toml"))) == 2


def test_cache_is_keyed_by_memory_format(cache, calls):
    """A device measured with NCHW kernels is not the device with NHWC ones (the cnn runs
    1.3-1.6x faster in channels_last here): each layout has its own entry, and a file
    without the key (written before it existed) reads as contiguous."""
    cnn = {"model": {"name": "cnn"}, "data": {"num_train": 256, "num_test": 64}}
    _calibrated(small_config(cluster=CALIBRATE, **cnn))  # auto: channels_last
    _calibrated(small_config(cluster=CALIBRATE, train={"memory_format": "contiguous"}, **cnn))
    assert len(calls) == 2 * factory.PROFILE_REPEATS
    files = sorted(cache.glob("*.toml"))
    formats = sorted(tomllib.loads(f.read_text())["profile"]["memory_format"] for f in files)
    assert formats == ["channels_last", "contiguous"]
    older = files[0].read_text()
    older = "\n".join(x for x in older.splitlines() if not x.startswith("memory_format"))
    files[0].write_text(older)
    assert profiles.read_profile(files[0], setting="s").key.memory_format == "contiguous"


def test_cache_is_keyed_by_precision_device_and_model_kwargs(cache, calls):
    """A bf16-mixed or GPU device is not the fp32 CPU one, and a factory's kwargs can change
    its cost without changing P: each has its own entry; a file without the newer key
    fields reads as measured on the CPU in fp32, compile off, kwargs unknown."""
    _calibrated(small_config(cluster=CALIBRATE))
    _calibrated(small_config(cluster=CALIBRATE, train={"precision": "bf16-mixed"}))
    assert len(calls) == 2 * factory.PROFILE_REPEATS
    saved = {tomllib.loads(f.read_text())["profile"]["precision"] for f in cache.glob("*.toml")}
    assert saved == {"fp32", "bf16-mixed"}
    user = {"data": {"factory": "tests.user_project.zoo:tabular"}}
    keys = []
    for kwargs in ({"hidden": 16}, {"hidden": 16, "batchnorm": True}):
        cfg = small_config(
            model={"factory": "tests.user_project.zoo:tabular_mlp", "kwargs": kwargs}, **user
        )
        ds = load_dataset(cfg.data, seed=0)
        cfg = config_for_data(cfg, ds)
        engine = factory._throwaway_engine(cfg, None)
        keys.append(factory.profile_key(cfg, engine))
    assert keys[0].num_parameters == keys[1].num_parameters and keys[0] != keys[1]
    assert keys[0].device == "cpu" and keys[0].compile == "off"
    path = next(cache.glob("*.toml"))
    older = "\n".join(
        x
        for x in path.read_text().splitlines()
        if x.split(" =")[0] not in ("device", "precision", "compile", "model_kwargs")
    )
    path.write_text(older)
    key = profiles.read_profile(path, setting="s").key
    assert (key.device, key.precision, key.compile, key.model_kwargs) == ("cpu", "fp32", "off", "")


def test_an_object_models_profile_is_named_by_its_class(cache):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    cfg = small_config()
    code = factory.UserCode(model=lambda: model)  # what fit() makes of an instance
    engine = factory._throwaway_engine(cfg, code)
    key = factory.profile_key(cfg, engine, code)
    assert key.model == "(object) Sequential" and "cnn" not in key.file_name()


def test_cached_profile_without_the_servers_cost_gets_it(cache, calls):
    """The server's work per push is measured with the device (the tuner's parameter-server
    candidates need it whatever the run's protocol); a cached file without it (written by
    hand, or before it was measured) gets it added, and the device is not measured again."""
    first = _calibrated(small_config(cluster=CALIBRATE))
    assert first.cluster.seconds_per_push > 0
    (saved,) = cache.glob("*.toml")
    lines = saved.read_text().splitlines(keepends=True)
    saved.write_text("".join(x for x in lines if not x.startswith("seconds_per_push")))
    cfg = _calibrated(
        small_config(cluster=CALIBRATE, protocol={"name": "parameter_server", "mode": "async"})
    )
    assert len(calls) == factory.PROFILE_REPEATS
    assert cfg.cluster.seconds_per_push > 0
    assert tomllib.loads(saved.read_text())["profile"]["seconds_per_push"] > 0


def test_cold_cache_calibrates_hardsync_with_backup_learners(cache, calls):
    """The server's cost is measured on a parameter server derived from the run's config:
    hardsync's backup learners (not a parameter server's setting) stay out of it."""
    cfg = _calibrated(
        small_config(cluster=CALIBRATE, protocol={"num_learners": 2, "backup_learners": 1})
    )
    assert len(calls) == factory.PROFILE_REPEATS
    assert cfg.protocol.backup_learners == 1
    assert cfg.cluster.seconds_per_push > 0


def test_large_spread_warns_in_one_line(cache, monkeypatch):
    """Measurements that disagree (a machine whose load changed) warn, naming the spread."""
    fits = iter([DeviceProfile(0.0, 1e-4), DeviceProfile(0.0, 3e-4), DeviceProfile(0.0, 1e-4)])
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: next(fits))
    with pytest.warns(profiles.ProfileSpreadWarning) as got:
        cfg = _calibrated(small_config(cluster=CALIBRATE))
    assert cfg.cluster.seconds_per_sample == 1e-4  # the median
    (w,) = got
    assert "differ by 200%" in str(w.message) and "\n" not in str(w.message)
    # a later run that reuses the cached profile measures nothing and warns again
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    with pytest.warns(profiles.ProfileSpreadWarning, match="differ by 200%"):
        assert _calibrated(small_config(cluster=CALIBRATE)).cluster.seconds_per_sample == 1e-4
    fits = iter([DeviceProfile(0.0, 1e-4), DeviceProfile(0.0, 1.1e-4), DeviceProfile(0.0, 1e-4)])
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: next(fits))
    with warnings.catch_warnings():
        warnings.simplefilter("error", profiles.ProfileSpreadWarning)
        _calibrated(small_config(cluster=CALIBRATE, protocol={"batch_size": 16}))  # 10%: quiet


def _write_config(path, cfg: RunConfig):
    path.write_text(cfg.to_toml())
    return str(path)


def test_calibrate_out_and_profile_round_trip(tmp_path, cache, calls, capsys):
    """``distsgd calibrate --out`` writes a profile; two same-seed runs that name it
    (measuring nothing) give identical simulated seconds, those of the file."""
    base = small_config(
        cluster=CALIBRATE,
        protocol={"name": "parameter_server", "mode": "async", "num_learners": 2},
        train={"max_epochs": 0.5},
    )
    config = _write_config(tmp_path / "run.toml", base)
    profile = tmp_path / "gpu-node.toml"
    assert cli.main(["calibrate", config, "--out", str(profile)]) == 0
    assert f"written to {profile}" in capsys.readouterr().out
    measured = len(calls)
    saved = tomllib.loads(profile.read_text())["profile"]
    # the file as if measured elsewhere: a device 10x faster than this machine
    text = profile.read_text().replace(
        f"seconds_per_sample = {saved['seconds_per_sample']!r}", "seconds_per_sample = 1e-06"
    )
    profile.write_text(text)
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        rc = cli.main(
            ["train", config, "--set", f"cluster.profile={str(profile)!r}", "--out", str(out)]
        )
        assert rc == 0
        runs.append(RunConfig.from_toml(out / "config.toml"))
        assert f"device profile from {profile}" in capsys.readouterr().err
    assert len(calls) == measured  # the named file: nothing measured
    assert runs[0].cluster.seconds_per_sample == 1e-6
    assert runs[0].cluster.seconds_per_push == saved["seconds_per_push"]
    summaries = [(tmp_path / f"run{i}" / "summary.json").read_text() for i in range(2)]
    virtual = [json.loads(s)["virtual_s"] for s in summaries]  # same device, same seed
    assert virtual[0] == virtual[1] > 0


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (
            lambda t: t.replace("seconds_per_sample", "seconds_per_sampel"),
            "no 'seconds_per_sample'",
        ),
        (lambda t: t.replace('model = "mlp"', 'model = "cnn"'), "measured on model 'cnn'"),
        (lambda t: "not toml [", "not TOML"),
        (lambda t: t.replace("[profile]", "[device]"), "no [profile] table"),
        (
            lambda t: t.replace('memory_format = "contiguous"', 'memory_format = "nhwc"'),
            "memory_format = 'nhwc' is not 'contiguous' or 'channels_last'",
        ),
        (lambda t: t.replace("format = 1", "format = 99"), "format = 99 is not 1"),
        (
            lambda t: "\n".join(
                "spread = -1.0" if x.startswith("spread") else x for x in t.splitlines()
            ),
            "spread = -1.0 is not a relative spread >= 0",
        ),
        (lambda t: t.replace("repeats = 3", "repeats = 0"), "repeats = 0 is not an integer >= 1"),
        (lambda t: t.replace("repeats = 3", 'repeats = "x"'), "repeats = 'x' is not an integer"),
    ],
)
def test_bad_profile_is_one_line_exit_2(tmp_path, cache, capsys, edit, fragment):
    config = _write_config(tmp_path / "run.toml", small_config(cluster=CALIBRATE))
    profile = tmp_path / "p.toml"
    assert cli.main(["calibrate", config, "--out", str(profile)]) == 0
    profile.write_text(edit(profile.read_text()))
    capsys.readouterr()
    out = tmp_path / "run"
    rc = cli.main(
        ["train", config, "--set", f"cluster.profile={str(profile)!r}", "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("distsgd: error: cluster.profile = ")
    assert fragment in err
    assert not (out / "summary.json").exists()


def test_profile_measured_with_other_settings_warns_in_one_line(tmp_path, cache, capsys):
    """Found by a fresh user: a file measured in fp32 at b = 32 was used silently for a
    bf16-mixed run at b = 64 (the cache keys both)."""
    config = _write_config(tmp_path / "run.toml", small_config(cluster=CALIBRATE))
    profile = tmp_path / "p.toml"
    assert cli.main(["calibrate", config, "--out", str(profile)]) == 0
    capsys.readouterr()
    args = ["train", config, "--set", f"cluster.profile={str(profile)!r}", "--quiet"]
    same = cli.main([*args, "--out", str(tmp_path / "same")])
    assert same == 0 and "was measured with" not in capsys.readouterr().err
    other = ["--set", "train.precision='bf16-mixed'", "--set", "protocol.batch_size=64"]
    assert cli.main([*args, *other, "--out", str(tmp_path / "other")]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "was measured with" in x]
    assert "batch_size 32 (this run: 64)" in line
    assert "precision 'fp32' (this run: 'bf16-mixed')" in line


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_a_cache_that_is_not_a_directory_is_one_line_before_measuring(
    tmp_path, monkeypatch, calls, capsys, where
):
    """Found by a fresh user: DISTSGD_PROFILE_CACHE naming a file gave a traceback after
    the device had been measured."""
    blocker = tmp_path / "cachefile"
    blocker.write_text("")
    path = blocker if where == "file" else blocker / "sub"
    monkeypatch.setenv(profiles.CACHE_ENV, str(path))
    config = _write_config(tmp_path / "run.toml", small_config(cluster=CALIBRATE))
    rc = cli.main(["train", config, "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"distsgd: error: {profiles.CACHE_ENV} = ") and not calls
    assert not (tmp_path / "run").exists()


def test_a_cache_entry_that_is_a_directory_is_one_line_before_measuring(
    tmp_path, cache, calls, capsys
):
    """Found by a fresh user: a traceback after measuring (the rename onto it failed)."""
    cfg = small_config(cluster=CALIBRATE)
    _calibrated(cfg)
    (entry,) = cache.glob("*.toml")
    entry.unlink()
    entry.mkdir()
    measured = len(calls)
    capsys.readouterr()
    config = _write_config(tmp_path / "run.toml", cfg)
    rc = cli.main(["train", config, "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "is a directory: remove it" in err
    assert len(calls) == measured and not (tmp_path / "run").exists()


def test_a_relative_profile_is_recorded_absolute_and_a_resume_elsewhere_finds_it(
    tmp_path, cache, capsys, monkeypatch
):
    """Found by a fresh user: config.toml kept the relative path, so a resume from another
    directory could not read the profile."""
    base = small_config(cluster=CALIBRATE, train={"max_epochs": 1})
    config = _write_config(tmp_path / "run.toml", base)
    assert cli.main(["calibrate", config, "--out", str(tmp_path / "p.toml")]) == 0
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    args = ["train", config, "--set", "cluster.profile='p.toml'", "--out", str(out), "--quiet"]
    assert cli.main(args) == 0
    recorded = RunConfig.from_toml(out / "config.toml").cluster.profile
    assert recorded == str(tmp_path / "p.toml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    rc = cli.main(["train", "--resume", str(out), "--set", "train.max_epochs=2", "--quiet"])
    assert rc == 0, capsys.readouterr().err


def test_missing_profile_file_is_one_line_exit_2(tmp_path, cache, capsys):
    config = _write_config(tmp_path / "run.toml", small_config(cluster=CALIBRATE))
    rc = cli.main(["train", config, "--set", "cluster.profile='nowhere.toml'"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot read it" in err


def test_calibrate_without_out_refreshes_the_cache(tmp_path, cache, calls):
    """``distsgd calibrate CONFIG`` measures again into the cache (recalibration)."""
    cfg = small_config(cluster=CALIBRATE)
    _calibrated(cfg)
    config = _write_config(tmp_path / "run.toml", cfg)
    assert cli.main(["calibrate", config]) == 0
    assert len(calls) == 2 * factory.PROFILE_REPEATS
    assert len(list(cache.glob("*.toml"))) == 1  # the same key: replaced


def test_too_small_budget_is_refused_with_the_minimum(tmp_path, capsys, monkeypatch):
    """``distsgd tune --budget 3m`` on a config whose long run cannot make the 4
    evaluations a prediction needs in 3 minutes: one line naming --budget, the value and
    the minimum, exit 2, nothing written (issue 18: it ran one probe and wrote a report of
    empty panels). The long run's wall throughput is stipulated at 100 samples/s (the setup
    measures it; a fake keeps the figure independent of this machine), so the minimum is
    about 20000 samples / 100 samples/s over the long run's share: far above 3 minutes,
    while the setup and one probe of 0.05 simulated seconds fit."""
    monkeypatch.setattr(tune_module, "estimated_samples_per_s", lambda fixed: 100.0)
    cfg = tmp_path / "c.toml"
    base = small_config(
        cluster={"seconds_per_sample": 0.01, "seconds_per_batch": 0.0},
        train={"eval_every_samples": 5000},
        tune={"probe_seconds": 0.05},
    )
    cfg.write_text(base.to_toml())
    out = tmp_path / "t"
    assert main_tune(cfg, out, "3m") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("distsgd: error: --budget 180s is not allowed for this config: ")
    minimum = int(err.split("needs at least ")[1].split("s here")[0])
    assert minimum > 4 * 5000 / 100  # at least the long run's training
    assert "4 evaluations every 5000 samples" in err
    assert not out.exists()


def main_tune(cfg, out, budget: str) -> int:
    return cli.main(["tune", str(cfg), "--budget", budget, "--out", str(out), "--quiet"])


@pytest.mark.parametrize(("setup_s", "probe_s", "eval_s"), [(1.0, 3.0, 0.5), (20.0, 2.0, 4.0)])
def test_prediction_minimum_gives_the_long_run_its_evaluations(setup_s, probe_s, eval_s):
    """At the computed minimum the budget's own rule (first_long_run_seconds, after a
    search that used its whole share) trains the long run long enough for 4 evaluations;
    at 0.9 of it, it does not (fake clock: no timing)."""
    sps, every, build_s = 1000.0, 5000, 0.4

    def long_run_training(budget_s: float) -> float:
        now = [0.0]
        tb = TuneBudget(budget_s, 0.35, 0.15, probe_s, eval_s, clock=lambda: now[0], start=0.0)
        now[0] = setup_s
        minimum = tb.prediction_minimum_s(sps, every, 4, build_s)
        now[0] += probe_s
        tb.record_probe(probe_s, probe_s - build_s)
        now[0] = max(now[0], tb.search_end)  # the search used its share
        return tb.first_long_run_seconds(sps, every), minimum

    _, minimum = long_run_training(100.0)
    need = 4 * every / sps
    # the training seconds t solve the same linear cost: 1e-9 relative is rounding
    assert long_run_training(minimum)[0] >= need * (1 - 1e-9)
    assert long_run_training(0.9 * minimum)[0] < need


def test_unreadable_cache_entry_is_measured_again(cache, calls, capsys):
    cfg = small_config(cluster=CALIBRATE)
    _calibrated(cfg)
    (saved,) = cache.glob("*.toml")
    saved.write_text("[profile]\nmodel = ")  # cut short, e.g. by a full disk
    again = _calibrated(cfg)
    assert len(calls) == 2 * factory.PROFILE_REPEATS
    assert "measuring the device profile again" in capsys.readouterr().err
    assert tomllib.loads(saved.read_text())["profile"]["seconds_per_sample"] == (
        again.cluster.seconds_per_sample
    )


def test_calibrate_command_warns_of_a_large_spread_in_one_line(
    tmp_path, cache, monkeypatch, capsys
):
    """``distsgd calibrate`` of a disturbed measurement says so in one ``distsgd: warning``
    line (it wrote the profile silently, and calibration's own fallback printed a Python
    warning with its source line)."""
    fits = iter([DeviceProfile(0.0, 1e-4), DeviceProfile(0.0, 3e-4), DeviceProfile(0.0, 1e-4)])
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: next(fits))
    config = _write_config(tmp_path / "run.toml", small_config(cluster=CALIBRATE))
    assert cli.main(["calibrate", config, "--out", str(tmp_path / "p.toml")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distsgd: warning: ") and "200%" in err[0]


def test_calibration_fallback_is_a_config_warning(monkeypatch):
    """A larger batch measured faster (a loaded machine): the fallback's warning is a
    ConfigWarning, which the CLI prints as one line."""
    cfg = small_config()
    ds = load_dataset(cfg.data, seed=0)
    engine = factory._throwaway_engine(config_for_data(cfg, ds), None)
    ticks = iter(range(1, 1000))  # every call of the clock advances it less: later
    now = [0.0]  # (larger) batches measure faster

    def clock() -> float:
        now[0] += 1.0 / next(ticks)
        return now[0]

    monkeypatch.setattr(sim_module.time, "perf_counter", clock)
    with pytest.warns(ConfigWarning, match="device calibration is unreliable"):
        prof = sim_module.calibrate(engine, ds)
    assert prof.seconds_per_sample == 0.0 and prof.seconds_per_batch > 0
