"""The simulated parameter server charges its work per push (issue 18: the simulator's
time model for asynchronous runs; ``cluster.seconds_per_push``)."""

import dataclasses

import pytest
import torch

from distsgd.config import ConfigError
from distsgd.layout import build_protocol
from distsgd.runtime.sim import calibrate_server
from distsgd.tuner import perf_model as pm
from tests.conftest import simulated_runtime, small_config


def _async(push_s: float | None, num_learners: int = 2, mode: str = "async", **train):
    cluster = {} if push_s is None else {"seconds_per_push": push_s}
    return small_config(
        protocol={"name": "parameter_server", "mode": mode, "num_learners": num_learners},
        cluster={**cluster, "jitter": 0.0},
        train={"max_samples": 640, "evaluate": False, "max_epochs": 0, **train},
    )


def _simulated(cfg):
    """``cfg``'s simulated runtime built as the trainer builds it (seed 0)."""
    return simulated_runtime(cfg)[0]


def _simulated_seconds(cfg) -> tuple[float, int, torch.Tensor]:
    """Simulated seconds, updates and final weights of ``cfg`` without the trainer."""
    rt = _simulated(cfg)
    updates = 0
    while rt.samples < cfg.train.max_samples:
        updates += rt.advance(0.05).update is not None
    return rt.clock_s, updates, rt.eval_weights()


def test_server_work_per_push_is_charged():
    """A larger server cost gives more simulated seconds for the same updates and the same
    weights (timing only); zero gives the figures of a config that does not set it."""
    free, n0, w0 = _simulated_seconds(_async(0.0))
    unset, n1, w1 = _simulated_seconds(_async(None))  # a given profile, no server cost: free
    slow, n2, w2 = _simulated_seconds(_async(5e-3))
    assert unset == free and n1 == n0 and torch.equal(w1, w0)
    assert slow > free and n2 == n0
    # 640 samples of batch 32 = 20 pushes; each costs at least 5 ms of the server's time
    assert slow - free >= 20 * 5e-3 * 0.5  # at least half: the learners overlap the rest


def test_one_learner_cycle_adds_the_server_work_exactly():
    """λ = 1: every push waits for nothing, so each cycle is message + compute + message +
    server work; the simulator and the performance model agree on it."""
    push = 2e-3
    base, n, _ = _simulated_seconds(_async(0.0, num_learners=1))
    charged, n2, _ = _simulated_seconds(_async(push, num_learners=1))
    assert n == n2 == 20
    # float sums of the same terms in another order: 1e-12 s is far above rounding
    assert charged - base == pytest.approx(20 * push, abs=1e-12)
    c = small_config().cluster
    model = pm.ClusterModel(
        c.seconds_per_batch,
        c.seconds_per_sample,
        latency_s=c.latency_s,
        bandwidth_gbps=c.bandwidth_gbps,
        num_parameters=_simulated(_async(0.0)).engine.num_parameters,
        t_server=push,
    )
    layout = pm.Layout("softsync", 1, 32, softsync=1)
    # the model's HE and the simulator's seconds per update: same formula, rel 1e-9
    assert pm.seconds_per_iteration(layout, model) == pytest.approx(charged / n2, rel=1e-9)


def test_server_saturates_at_its_work_per_push():
    """With the server slower than the learners, updates come one per server work."""
    push = 0.05  # far above a learner's cycle of ~4 ms
    seconds, n, _ = _simulated_seconds(_async(push, num_learners=2))
    assert seconds == pytest.approx(n * push, rel=0.05)  # + the first cycle's few ms


def test_calibrate_server_measures_push_and_pull():
    """Positive seconds, also under the hardsync barrier (workers push in turn)."""
    for mode in ("async", "hardsync"):
        cfg = _async(0.0, mode=mode)
        proto = build_protocol(cfg, torch.zeros(1000))
        assert calibrate_server(proto, 0.05, repeats=5) > 0


def test_seconds_per_push_is_validated():
    with pytest.raises(ConfigError, match=r"cluster.seconds_per_push = 'x' is not allowed"):
        _async("x")
    c = dataclasses.asdict(small_config().cluster)
    assert c["seconds_per_push"] == -1.0  # calibrated with the device profile by default
