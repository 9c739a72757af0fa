"""The simulated cluster places ranks on hosts (``cluster.processes_per_host``): a message
inside a host is charged the local terms, across hosts the link's."""

import pytest
import torch

from distsgd.config import ConfigError
from tests.conftest import simulate_ticks, small_config

LINK = {"latency_s": 0.02, "bandwidth_gbps": 0.1}  # 20 ms + 100 Mbit/s
LOCAL = {"local_latency_s": 50e-6, "local_bandwidth_gbps": 10.0}


def _run(protocol: dict, **cluster):
    cfg = small_config(
        protocol={"batch_size": 32, **protocol},
        cluster={"jitter": 0.0, "seconds_per_push": 1e-3, **LINK, **LOCAL, **cluster},
        train={"max_samples": 640, "evaluate": False, "max_epochs": 0},
    )
    rt, engine, ticks = simulate_ticks(cfg)
    return rt, engine.num_parameters, ticks


def _message(latency: float, gbps: float, p: int) -> float:
    return latency + 32.0 * p / (gbps * 1e9)


ASYNC = {"name": "parameter_server", "mode": "async"}


def test_a_learner_on_the_servers_host_is_charged_local_messages():
    """λ = 1: each push's cycle holds two messages; with the learner beside the server
    (2 processes per host) they are local, on a host of its own the link's, and nothing
    else changes (the same pushes, the same weights)."""
    local, p, n = _run({**ASYNC, "num_learners": 1}, processes_per_host=2)
    remote, _, n2 = _run({**ASYNC, "num_learners": 1}, processes_per_host=1)
    default, _, _ = _run({**ASYNC, "num_learners": 1})
    assert n == n2 == 20
    assert remote.clock_s == default.clock_s  # one process per host: every message remote
    saved = 2 * n * (_message(0.02, 0.1, p) - _message(50e-6, 10.0, p))
    assert remote.clock_s - local.clock_s == pytest.approx(saved, rel=1e-9)
    assert torch.equal(local.eval_weights(), remote.eval_weights())


def test_two_hosts_run_async_faster_than_all_remote():
    """2 hosts × 2 processes, λ = 3: learner 0 shares the server's host, learners 1 and 2
    are on the other; more samples per simulated second than with every learner remote,
    fewer than with all on one host."""
    lam = {**ASYNC, "num_learners": 3}
    two, _, _ = _run(lam, processes_per_host=2)
    remote, _, _ = _run(lam)
    one, _, _ = _run(lam, processes_per_host=4)
    assert one.clock_s < two.clock_s < remote.clock_s


def test_hosts_do_not_matter_when_local_costs_the_link():
    """Local terms equal to the link's: any placement gives today's figures exactly
    (hardsync's all-reduce, the parameter server's and compute groups' messages)."""
    same = {"local_latency_s": LINK["latency_s"], "local_bandwidth_gbps": LINK["bandwidth_gbps"]}
    for protocol in (
        {"name": "hardsync", "num_learners": 4},
        {**ASYNC, "num_learners": 3},
        {"name": "compute_groups", "num_learners": 4, "num_groups": 2},
    ):
        base, _, _ = _run(protocol)
        placed, _, _ = _run(protocol, processes_per_host=2, **same)
        assert placed.clock_s == base.clock_s, protocol


def test_hardsync_all_reduce_is_local_only_on_one_host():
    """λ = 4: an all-reduce across 2 hosts is charged the link's ring (as with every
    process alone), on one host the local ring."""
    hs = {"name": "hardsync", "num_learners": 4}
    two, p, n = _run(hs, processes_per_host=2)
    alone, _, _ = _run(hs)
    one, _, _ = _run(hs, processes_per_host=4)
    assert two.clock_s == alone.clock_s
    lat, inv_bw = 0.02 - 50e-6, 1 / 0.1e9 - 1 / 10e9
    ring = 2 * 3 * lat + 2 * 3 / 4 * 32.0 * p * inv_bw  # 2(m−1)·lat + 2(m−1)/m·32P/bw
    assert alone.clock_s - one.clock_s == pytest.approx(n * ring, rel=1e-9)


def test_cores_are_each_hosts_own():
    """cores = 1 per host, 2 devices per host: compute stretches 2×, not 4× as with the
    4 devices sharing one machine's core."""
    hs = {"name": "hardsync", "num_learners": 4}
    per_host, _, _ = _run(hs, processes_per_host=2, cores=1, latency_s=0.0, bandwidth_gbps=0)
    shared, _, _ = _run(hs, cores=1, latency_s=0.0, bandwidth_gbps=0)
    free, _, _ = _run(hs, latency_s=0.0, bandwidth_gbps=0)
    assert per_host.clock_s == pytest.approx(2 * free.clock_s, rel=1e-9)
    assert shared.clock_s == pytest.approx(4 * free.clock_s, rel=1e-9)
    # SMA, k = 2 replicas per device: 4 devices (ranks 0 … 3), 2 on each host
    sma = {"name": "sma", "num_learners": 8, "replicas_per_device": 2}
    no_net = {"latency_s": 0.0, "bandwidth_gbps": 0, "local_latency_s": 0.0}
    per_host, _, _ = _run(sma, processes_per_host=2, cores=1, **no_net)
    free, _, _ = _run(sma, **no_net)
    assert per_host.clock_s == pytest.approx(2 * free.clock_s, rel=1e-9)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("processes_per_host", -1),
        ("processes_per_host", 1.5),
        ("local_latency_s", -1.0),
        ("local_bandwidth_gbps", -2.0),
    ],  # fmt: skip
)
def test_host_settings_are_checked(key, value):
    with pytest.raises(ConfigError, match=rf"cluster.{key} = .* is not allowed") as e:
        small_config(cluster={key: value})
    assert "\n" not in str(e.value)


def test_a_learner_is_local_only_when_every_server_shard_shares_its_host():
    """S = 2 shards (ranks 0, 1) and one learner (rank 2): 2 processes per host put the
    learner alone on host 1 (the link's messages, as with every process alone); 3 put all
    on one host (local messages)."""

    def run(**cluster):
        cfg = small_config(
            protocol={**ASYNC, "num_learners": 1, "batch_size": 32},
            cluster={"jitter": 0.0, "seconds_per_push": 1e-3, **LINK, **LOCAL, **cluster},
            train={"max_samples": 320, "evaluate": False, "max_epochs": 0},
            dist={"num_servers": 2},
        )
        return simulate_ticks(cfg)[0].clock_s

    apart, alone, together = run(processes_per_host=2), run(), run(processes_per_host=3)
    assert apart == alone
    assert together < alone


def test_a_compute_groups_broadcast_is_charged_on_its_hosts_terms():
    """Bug: a compute group leader's broadcast of the weights to its members was not
    charged. One group of 3 (λ = 3, g = 1: every round waits for the one before): with
    the group on one host each round costs two binomial-tree broadcasts (⌈log₂ 3⌉ = 2
    rounds of a latency, then of a message of P values) on the local terms, across hosts
    on the link's; a group of one is charged none."""
    cg = {"name": "compute_groups", "num_learners": 3, "num_groups": 1}
    # one process per host: the group spans 3 hosts; 4 per host: all on host 0
    apart, p, n = _run(cg, processes_per_host=1)
    together, _, n2 = _run(cg, processes_per_host=4)
    assert n == n2
    lat, inv_bw = 0.02 - 50e-6, 1 / 0.1e9 - 1 / 10e9
    ring = 2 * 2 * lat + 2 * 2 / 3 * 32.0 * p * inv_bw
    messages = 2 * lat + 2 * 32.0 * p * inv_bw
    broadcast = 2 * (2 * lat + 32.0 * p * inv_bw)
    diff = apart.clock_s - together.clock_s
    assert diff == pytest.approx(n * (messages + ring + broadcast), rel=1e-9)
