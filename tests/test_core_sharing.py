"""Processes sharing cores (issue 18, simulator fidelity): with more busy processes than
``cluster.cores``, compute and the parameter server's work stretch, in the simulator and
in the tuner's performance model alike (:mod:`distsgd.runtime.cluster_model`)."""

import pytest

from distsgd.config import ConfigError
from distsgd.runtime import cluster_model as cm
from distsgd.tuner import perf_model as pm
from tests.conftest import FIXED_CLUSTER, simulate_ticks, small_config


def test_core_stretch_invariants():
    assert cm.core_stretch(5, 0) == 1.0  # a core per process: never stretched
    assert cm.core_stretch(1, 2) == cm.core_stretch(2, 2) == 1.0  # they fit
    assert cm.core_stretch(3, 2) == pytest.approx(1.5)  # 3 busy on 2 cores: each gets 2/3
    busy = [0.5, 1, 1.5, 2, 2.2, 3, 4, 8]
    for cores in (1, 2, 4):
        s = [cm.core_stretch(b, cores) for b in busy]
        assert all(x >= 1 for x in s) and s == sorted(s)  # >= 1, non-decreasing in busy
    for b in busy:
        s = [cm.core_stretch(b, c) for c in (1, 2, 3, 4, 8)]
        assert s == sorted(s, reverse=True)  # non-increasing in cores


def _model(t_server: float, cores: int) -> cm.ClusterModel:
    return cm.ClusterModel(
        1e-3, 1e-4, latency_s=1e-4, num_parameters=10_000, t_server=t_server, cores=cores
    )


def test_server_core_stretch():
    # no sharing, or the learners and the server fit the cores: 1
    assert cm.server_core_stretch(2, 32, _model(5e-3, 0)) == 1.0
    assert cm.server_core_stretch(1, 32, _model(5e-3, 2)) == 1.0  # 1 + u <= 2
    assert cm.server_core_stretch(2, 32, _model(0.0, 2)) == 1.0  # a free server: 2 busy
    # 2 learners + a busy server on 2 cores: 1 + u/2, u = 2 t_server / cycle
    m = _model(1e-3, 2)
    cycle = 2 * m.message_seconds + cm.compute_seconds(32, m) + 1e-3
    assert 2 * 1e-3 / cycle < 1
    assert cm.server_core_stretch(2, 32, m) == pytest.approx(1 + (2 * 1e-3 / cycle) / 2)
    # more server work, more learners or fewer cores never stretch less
    xs = [cm.server_core_stretch(2, 32, _model(t, 2)) for t in (0, 1e-3, 5e-3, 2e-2, 1.0)]
    assert xs == sorted(xs) and xs[-1] == pytest.approx(1.5)  # u capped at 1
    assert cm.server_core_stretch(3, 32, m) > cm.server_core_stretch(2, 32, m)
    assert cm.server_core_stretch(2, 32, _model(5e-3, 1)) > cm.server_core_stretch(2, 32, m)


def _seconds_per_push(cores: int, num_learners: int = 2, push: float = 5e-3) -> float:
    cfg = small_config(
        protocol={"name": "parameter_server", "mode": "async", "num_learners": num_learners},
        cluster={"seconds_per_push": push, "jitter": 0.0, "cores": cores},
        train={"max_samples": 640, "evaluate": False, "max_epochs": 0},
    )
    rt, engine, pushes = simulate_ticks(cfg)
    return rt.clock_s / pushes, engine.num_parameters


def test_simulator_stretches_async_runs_that_share_cores():
    """cores = 0 and cores that fit give the same clock; 2 learners + server on 2 cores
    run slower, by the model's stretch at λ = 1 (one learner: exact cycle)."""
    free, _ = _seconds_per_push(0)
    assert _seconds_per_push(8)[0] == free  # plenty of cores: as without the model
    shared, p = _seconds_per_push(2)
    assert shared > free
    # one learner + its server on 2 cores fit: as without the model
    assert _seconds_per_push(2, num_learners=1)[0] == _seconds_per_push(0, num_learners=1)[0]
    # λ = 1 on one core: learner + server busy fraction > 1 core, the cycle stretches
    c = cm.ClusterModel(
        FIXED_CLUSTER["seconds_per_batch"],
        FIXED_CLUSTER["seconds_per_sample"],
        latency_s=FIXED_CLUSTER["latency_s"],
        bandwidth_gbps=FIXED_CLUSTER["bandwidth_gbps"],
        num_parameters=p,
        t_server=5e-3,
        cores=1,
    )
    x = cm.server_core_stretch(1, 32, c)
    assert x > 1
    expected = 2 * c.message_seconds + x * (cm.compute_seconds(32, c) + 5e-3)
    assert _seconds_per_push(1, num_learners=1)[0] == pytest.approx(expected, rel=1e-9)
    # the tuner's model gives the simulator's figure (same formulas)
    layout = pm.Layout("softsync", 1, 32, softsync=1)
    assert pm.seconds_per_iteration(layout, c) == pytest.approx(expected, rel=1e-9)


def test_synchronous_devices_beyond_the_cores_stretch():
    lay = pm.Layout("hardsync", 4, 32)
    base = _model(0.0, 0)
    two = _model(0.0, 2)
    tc = cm.compute_seconds(32, base)
    assert pm.seconds_per_iteration(lay, two) - pm.seconds_per_iteration(
        lay, base
    ) == pytest.approx(tc)  # 4 devices on 2 cores: compute ×2
    assert pm.seconds_per_iteration(pm.Layout("hardsync", 2, 32), two) == pytest.approx(
        pm.seconds_per_iteration(pm.Layout("hardsync", 2, 32), base)
    )


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_cores_must_be_a_count(bad):
    with pytest.raises(ConfigError, match="cluster.cores"):
        small_config(cluster={"cores": bad})
