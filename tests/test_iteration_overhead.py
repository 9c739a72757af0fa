"""A synchronous learner's work per iteration beyond its gradient (issue 18: the protocol's
update of the flat weights and the runtime loop's own work, ``cluster.seconds_per_iteration``):
the simulator and the performance model charge it, the device profile measures and caches
it, and a profile file of an older distsgd (without it) still loads."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from distsgd.config import ConfigError, RunConfig
from distsgd.data import load_dataset
from distsgd.engine import build_engine, config_for_data
from distsgd.runtime import dist as rdist
from distsgd.runtime import factory, profiles
from distsgd.tuner import perf_model as pm
from distsgd.tuner.setup import cluster_model
from tests.conftest import simulate_ticks, small_config

CALIBRATE = {"seconds_per_sample": -1, "seconds_per_batch": -1, "jitter": 0.0}
SMA2 = {"name": "sma", "num_learners": 4, "batch_size": 8, "replicas_per_device": 2}


def _config(protocol: dict, per_iteration: float | None, **cluster) -> RunConfig:
    extra = {} if per_iteration is None else {"seconds_per_iteration": per_iteration}
    return small_config(
        protocol=protocol,
        cluster={"jitter": 0.0, **extra, **cluster},
        train={"max_samples": 640, "evaluate": False, "max_epochs": 0},
    )


def _simulated(cfg: RunConfig) -> tuple[float, int, torch.Tensor]:
    """Simulated seconds, ticks and final weights of ``cfg``, built as the trainer does."""
    rt, _, ticks = simulate_ticks(cfg)
    return rt.clock_s, ticks, rt.eval_weights()


@pytest.mark.parametrize("protocol", [{"name": "hardsync", "num_learners": 2}, SMA2])
def test_synchronous_devices_are_charged_their_work_per_iteration(protocol):
    """Each iteration costs ``seconds_per_iteration`` more, and nothing else changes;
    unset (a given device) charges none."""
    free, n0, w0 = _simulated(_config(protocol, 0.0))
    unset, n1, w1 = _simulated(_config(protocol, None))
    charged, n2, w2 = _simulated(_config(protocol, 4e-3))
    assert unset == free and n0 == n1 == n2
    assert torch.equal(w0, w1) and torch.equal(w0, w2)
    # float sums of the same terms in another order: 1e-12 s is far above rounding
    assert charged - free == pytest.approx(n0 * 4e-3, abs=1e-12)


def test_the_work_per_iteration_stretches_with_the_compute_when_cores_are_shared():
    """Two devices on one core: the learner's work beyond its gradient is CPU work too,
    so it takes twice as long, as the gradient does."""
    protocol = {"name": "hardsync", "num_learners": 2}
    free, n, _ = _simulated(_config(protocol, 0.0, cores=1))
    charged, _, _ = _simulated(_config(protocol, 4e-3, cores=1))
    assert charged - free == pytest.approx(n * 2 * 4e-3, abs=1e-12)


def test_parameter_server_learners_are_not_charged_it():
    """The update is the server's (``seconds_per_push``): a learner's cycle is as before."""
    protocol = {"name": "parameter_server", "mode": "async", "num_learners": 2}
    free, n0, _ = _simulated(_config(protocol, 0.0))
    charged, n1, _ = _simulated(_config(protocol, 4e-3))
    assert charged == free and n0 == n1
    assert "cluster.seconds_per_iteration" in _config(protocol, 0.0).unread_settings()


@pytest.mark.parametrize("protocol", [{"name": "hardsync", "num_learners": 2}, SMA2])
def test_performance_model_charges_what_the_simulator_does(protocol):
    cfg = _config(protocol, 3e-3, latency_s=2e-4)
    seconds, ticks, _ = _simulated(cfg)
    ds = load_dataset(cfg.data, seed=0)
    torch.manual_seed(0)
    p = cfg.protocol
    layout = pm.Layout(
        "sma" if p.name == "sma" else "hardsync",
        p.num_learners,
        p.batch_size,
        **({"replicas_per_device": 2} if p.name == "sma" else {}),
    )
    model = cluster_model(cfg, build_engine(config_for_data(cfg, ds)).num_parameters)
    assert model.t_iteration == 3e-3
    assert pm.seconds_per_iteration(layout, model) == pytest.approx(seconds / ticks, rel=1e-9)


def test_seconds_per_iteration_is_validated():
    with pytest.raises(ConfigError, match=r"cluster.seconds_per_iteration = 'x' is not allowed"):
        _config({"name": "hardsync"}, "x")


def _profile(per_iteration: float | None) -> profiles.DeviceProfileFile:
    key = profiles.ProfileKey("mlp", 1000, 32, 1, "2.0", "host")
    return profiles.DeviceProfileFile(key, 1e-3, 1e-4, seconds_per_iteration=per_iteration)


def test_profile_file_round_trip_and_an_older_file_without_it(tmp_path):
    path = tmp_path / "p.toml"
    profiles.write_profile(path, _profile(3.5e-3))
    assert "seconds_per_iteration = 0.0035" in path.read_text()
    assert profiles.read_profile(path).seconds_per_iteration == 3.5e-3
    profiles.write_profile(path, _profile(None))  # as an older distsgd wrote it
    assert "seconds_per_iteration" not in path.read_text()
    assert profiles.read_profile(path).seconds_per_iteration is None
    path.write_text(path.read_text() + "seconds_per_iteration = -1.0\n")
    with pytest.raises(ConfigError, match="seconds_per_iteration = -1.0 is not a number"):
        profiles.read_profile(path)


@pytest.fixture
def measured(monkeypatch):
    """:func:`calibrate_iteration` as the factory calls it, counted, answering 4 ms."""
    counted = []

    def fake(*args, **kwargs):
        counted.append(1)
        return 4e-3

    monkeypatch.setattr(rdist, "calibrate_iteration", fake)
    return counted


def _calibrated(cfg: RunConfig) -> RunConfig:
    ds = load_dataset(cfg.data, seed=0)
    return factory.calibrated_config(config_for_data(cfg, ds), ds)[0]


def test_the_profile_measures_it_and_an_older_cached_file_gets_it_added(
    tmp_path, monkeypatch, measured, capsys
):
    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "cache"))
    calls = []
    real = factory.calibrate
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = small_config(cluster=CALIBRATE)
    assert _calibrated(cfg).cluster.seconds_per_iteration == 4e-3
    assert len(measured) == 1
    (saved,) = (tmp_path / "cache").glob("*.toml")
    lines = saved.read_text().splitlines(keepends=True)
    saved.write_text("".join(x for x in lines if not x.startswith("seconds_per_iteration")))
    device_measurements = len(calls)
    capsys.readouterr()
    again = _calibrated(cfg)
    assert again.cluster.seconds_per_iteration == 4e-3 and len(measured) == 2
    # the line says the cache entry was completed, not only used
    err = capsys.readouterr().err
    assert "measured now and added to it: the work per iteration beyond the gradient" in err
    assert len(calls) == device_measurements  # the device itself is not measured again
    assert profiles.read_profile(saved).seconds_per_iteration == 4e-3
    given = _calibrated(small_config(cluster={**CALIBRATE, "seconds_per_iteration": 1e-3}))
    assert given.cluster.seconds_per_iteration == 1e-3  # a given value wins, and says so
    err = capsys.readouterr().err
    assert "measured now" not in err
    assert "the config's cluster.seconds_per_iteration = 0.001 replaces the profile's" in err


def test_a_named_profile_without_it_charges_none(tmp_path, measured, capsys):
    path = tmp_path / "older.toml"
    cfg = small_config()
    ds = load_dataset(cfg.data, seed=0)
    cfg = config_for_data(cfg, ds)
    engine = build_engine(cfg)
    key = factory.profile_key(cfg, engine)
    profiles.write_profile(path, profiles.DeviceProfileFile(key, 1e-3, 1e-4))
    named = cfg.replace(cluster=dataclasses.replace(cfg.cluster, **CALIBRATE, profile=str(path)))
    got = factory.calibrated_config(named, ds)[0]
    assert got.cluster.seconds_per_iteration == 0.0 and not measured
    assert factory.device_profile(got, False).seconds_per_iteration == 0.0
    # and says so in its line, with how to measure it
    assert "no seconds_per_iteration" in capsys.readouterr().err
    # unless the config gives it (found by a fresh-user review: two lines contradicted)
    given = named.replace(cluster=dataclasses.replace(named.cluster, seconds_per_iteration=1e-3))
    assert factory.calibrated_config(given, ds)[0].cluster.seconds_per_iteration == 1e-3
    err = capsys.readouterr().err
    assert "no seconds_per_iteration" not in err and "replaces the profile's" in err


def test_a_named_profile_without_server_work_takes_the_configs(tmp_path):
    # refused with "or set cluster.seconds_per_push", and then refused with it set (found
    # by a fresh-user review); without either, still one line
    path = tmp_path / "older.toml"
    cfg = small_config(protocol={"name": "parameter_server", "mode": "async", "num_learners": 2})
    ds = load_dataset(cfg.data, seed=0)
    cfg = config_for_data(cfg, ds)
    key = factory.profile_key(cfg, build_engine(cfg))
    profiles.write_profile(path, profiles.DeviceProfileFile(key, 1e-3, 1e-4))
    named = cfg.replace(cluster=dataclasses.replace(cfg.cluster, **CALIBRATE, profile=str(path)))
    with pytest.raises(ConfigError, match="or set cluster.seconds_per_push"):
        factory.calibrated_config(named, ds)
    given = named.replace(cluster=dataclasses.replace(named.cluster, seconds_per_push=2e-4))
    assert factory.calibrated_config(given, ds)[0].cluster.seconds_per_push == 2e-4


def _counted_steps(monkeypatch) -> list:
    """Each call of the runtime's hardsync iteration: whether it went through a wrapper."""
    wrapped = []
    real = rdist.hardsync_step

    def step(engine, proto, x, y, lr, module, check):
        wrapped.append(module is not None)
        return real(engine, proto, x, y, lr, module, check)

    monkeypatch.setattr(rdist, "hardsync_step", step)
    return wrapped


def _fixed_times(monkeypatch, iteration: list[float], gradient: list[float]) -> list:
    """Time the functions as calibrate_iteration gives them (each called once per round),
    but report these seconds."""
    calls = []

    def timed(fns, repeats, device, warmup=1):
        for _ in range(warmup + repeats):
            for fn in fns:
                fn()
        calls.append(len(fns))
        return [iteration, gradient]

    monkeypatch.setattr(rdist, "time_in_turn", timed)
    return calls


def _iteration_seconds(repeats: int = 3) -> float:
    cfg = small_config()
    ds = load_dataset(cfg.data, seed=0)
    cfg = config_for_data(cfg, ds)
    return rdist.calibrate_iteration(cfg, ds, lambda: build_engine(cfg), repeats=repeats)


def test_calibrate_iteration_times_the_real_iteration_and_leaves_no_process_group(monkeypatch):
    # the runtime's own iteration, through the DDP wrapper of a one-process group, timed
    # against the bare gradient: the difference of their medians, at least 0
    wrapped = _counted_steps(monkeypatch)
    calls = _fixed_times(monkeypatch, [3.0, 5.0, 4.0], [1.0, 1.5, 9.0])
    assert _iteration_seconds(repeats=3) == pytest.approx(4.0 - 1.5)
    assert calls == [2] and wrapped == [True] * 5  # 2 warm-up rounds + 3
    assert not dist.is_initialized()
    _fixed_times(monkeypatch, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert _iteration_seconds() == 0.0


def test_calibrate_iteration_inside_a_process_group_leaves_it_alone(monkeypatch):
    """A rank that calibrates keeps its group; the wrapper is then not timed."""
    wrapped = _counted_steps(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _iteration_seconds() >= 0 and dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert wrapped and not any(wrapped)


def test_calibrate_iteration_goes_on_without_a_wrapper_that_cannot_run(monkeypatch):
    """A DDP wrapper that fails (e.g. a backend without this device's collectives) is left
    out: the update and the draw are still measured."""

    tried = []

    class Broken(torch.nn.Module):
        def forward(self, x):
            tried.append(1)
            raise RuntimeError("no collectives here")

    monkeypatch.setattr(rdist, "_ddp", lambda engine: Broken())
    wrapped = _counted_steps(monkeypatch)
    assert _iteration_seconds() >= 0 and not dist.is_initialized()
    # the wrapper was tried once, then every timed iteration ran without it
    assert tried == [1] and wrapped[0] and not any(wrapped[1:]) and len(wrapped) > 1
