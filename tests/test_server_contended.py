"""The parameter server's time per push measured while the other learners compute
(``cluster.seconds_per_push_contended``, issue 18): a wall time with the waits for a core
in it, charged as measured and not stretched again by the share of the cores, while the
server's work measured alone (``seconds_per_push``) stays its demand for a core in the
stretch of the learners' compute. Deterministic arithmetic of the simulator and the
tuner's model; no timing."""

import dataclasses

import pytest

from distsgd.config import ConfigError
from distsgd.runtime import cluster_model as cm
from distsgd.tuner import perf_model as pm
from tests.conftest import FIXED_CLUSTER, simulate_ticks, small_config

ALONE, CONTENDED = 3e-3, 12e-3  # the server's work alone; its time per push while others compute


def _model(cores: int, t_server: float = ALONE, contended: float = 0.0) -> cm.ClusterModel:
    return cm.ClusterModel(
        FIXED_CLUSTER["seconds_per_batch"],
        FIXED_CLUSTER["seconds_per_sample"],
        latency_s=FIXED_CLUSTER["latency_s"],
        bandwidth_gbps=FIXED_CLUSTER["bandwidth_gbps"],
        num_parameters=10_000,
        t_server=t_server,
        t_server_contended=contended,
        cores=cores,
    )


def test_a_contended_time_is_charged_as_measured():
    m = _model(2, contended=CONTENDED)
    assert cm.server_push_seconds(1.4, m) == CONTENDED  # not stretched again
    assert cm.server_push_seconds(1.4, _model(2)) == pytest.approx(ALONE * 1.4)  # as before
    # a core per process (cores = 0, a real cluster): nothing waits for a core, the
    # contended time does not apply (found by a fresh-user review: it was charged there)
    assert cm.server_push_seconds(1.0, _model(0, contended=CONTENDED)) == ALONE
    assert cm.server_core_stretch(2, 32, _model(0, contended=CONTENDED)) == 1.0


def test_the_server_demands_a_core_for_its_work_alone():
    """u = pushers · t_server / (2m + t_c + t_contended): the work measured alone over the
    cycle the learner waits through; the contended time's waits are not demand."""
    m = _model(2, contended=CONTENDED)
    cycle = 2 * m.message_seconds + cm.compute_seconds(32, m) + CONTENDED
    u = 2 * ALONE / cycle
    assert u < 1
    assert cm.server_core_stretch(2, 32, m) == pytest.approx(1 + u / 2)
    # charging the contended time as the server's work (the earlier experiment) counts
    # its waits as demand for a core: a larger stretch of compute, and of that time
    doubled = _model(2, t_server=CONTENDED)
    assert cm.server_core_stretch(2, 32, doubled) > cm.server_core_stretch(2, 32, m)


def _seconds_per_push(
    cores: int, num_learners: int, protocol: dict | None = None, **cluster: float
) -> tuple[float, int]:
    """Simulated seconds per push (tick) and the model's parameter count."""
    cfg = small_config(
        protocol=protocol
        or {"name": "parameter_server", "mode": "async", "num_learners": num_learners},
        cluster={"jitter": 0.0, "cores": cores, **cluster},
        train={"max_samples": 640, "evaluate": False, "max_epochs": 0},
    )
    rt, engine, pushes = simulate_ticks(cfg)
    return rt.clock_s / pushes, engine.num_parameters


def test_the_simulator_charges_it_unstretched_and_the_tuner_agrees():
    """One learner on one core (learner + server exceed it: compute stretches): the cycle
    is 2m + x·t_c + t_contended exactly, x from the work alone; the tuner's model gives
    the same figure."""
    got, p = _seconds_per_push(1, 1, seconds_per_push=ALONE, seconds_per_push_contended=CONTENDED)
    c = dataclasses.replace(_model(1, contended=CONTENDED), num_parameters=p)
    x = cm.server_core_stretch(1, 32, c)
    assert x > 1
    expected = 2 * c.message_seconds + x * cm.compute_seconds(32, c) + CONTENDED
    assert got == pytest.approx(expected, rel=1e-9)
    assert pm.seconds_per_iteration(pm.Layout("softsync", 1, 32, softsync=1), c) == (
        pytest.approx(expected, rel=1e-9)
    )
    # the same figures charged the earlier way (the contended time as the server's work,
    # stretched): slower, by the double count
    doubled, _ = _seconds_per_push(1, 1, seconds_per_push=CONTENDED)
    assert doubled > got * 1.05


def test_two_learners_sharing_two_cores_are_not_charged_the_wait_twice():
    contended, _ = _seconds_per_push(
        2, 2, seconds_per_push=ALONE, seconds_per_push_contended=CONTENDED
    )
    alone, _ = _seconds_per_push(2, 2, seconds_per_push=ALONE)
    doubled, _ = _seconds_per_push(2, 2, seconds_per_push=CONTENDED)
    assert alone < contended < doubled
    # a core per process: nothing waits for a core, so the contended time does not apply
    # and the run is the one with the server's work alone
    assert _seconds_per_push(0, 2, seconds_per_push=ALONE, seconds_per_push_contended=CONTENDED)[
        0
    ] == pytest.approx(_seconds_per_push(0, 2, seconds_per_push=ALONE)[0], rel=1e-12)


def test_compute_groups_are_not_charged_a_time_measured_for_learners_pushing_alone():
    # found by a review: it was measured with each learner pushing while the other λ − 1
    # compute; 2 groups of 2 learners push half as often, so the model stays the stretch
    groups = {"name": "compute_groups", "num_learners": 4, "num_groups": 2}
    with_it, _ = _seconds_per_push(
        2, 4, groups, seconds_per_push=ALONE, seconds_per_push_contended=CONTENDED
    )
    assert with_it == _seconds_per_push(2, 4, groups, seconds_per_push=ALONE)[0]
    m = _model(2, contended=CONTENDED)
    assert cm.server_push_seconds(1.3, m, each_learner_pushes=False) == pytest.approx(ALONE * 1.3)
    layout = pm.Layout("compute_groups", 4, 32, num_groups=2)
    assert pm.seconds_per_iteration(layout, m) == pm.seconds_per_iteration(layout, _model(2))
    assert pm.seconds_per_iteration(pm.Layout("softsync", 4, 32, softsync=1), m) != (
        pm.seconds_per_iteration(pm.Layout("softsync", 4, 32, softsync=1), _model(2))
    )


def test_one_learner_on_two_cores_is_unchanged():
    """λ = 1 (learner + server fit 2 cores): its contended time is the time alone (no
    other learner computes), so charging it changes nothing (async λ = 1 of the bench)."""
    got, _ = _seconds_per_push(2, 1, seconds_per_push=ALONE, seconds_per_push_contended=ALONE)
    assert got == pytest.approx(_seconds_per_push(2, 1, seconds_per_push=ALONE)[0], rel=1e-12)


@pytest.mark.parametrize("bad", [-1, -1e-3, float("inf"), True, "1"])
def test_it_must_be_a_number_of_seconds(bad):
    with pytest.raises(ConfigError, match="cluster.seconds_per_push_contended"):
        small_config(cluster={"seconds_per_push_contended": bad})


def test_protocols_without_a_server_do_not_read_it():
    cfg = small_config(cluster={"seconds_per_push_contended": 1e-3})
    assert "cluster.seconds_per_push_contended" in cfg.unread_settings()
    ps = small_config(
        protocol={"name": "parameter_server", "mode": "async", "num_learners": 2},
        cluster={"seconds_per_push_contended": 1e-3},
    )
    assert "cluster.seconds_per_push_contended" not in ps.unread_settings()
