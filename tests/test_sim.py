"""The simulated cluster: timing, staleness arising from the schedule, mixed speeds."""

from collections import Counter

import pytest
import torch

from distsgd.config import ClusterConfig, ConfigWarning, DataConfig
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.protocols import ComputeGroups, HardSync, ParameterServer
from distsgd.runtime import sim as sim_module
from distsgd.runtime.sim import DeviceProfile, SimRuntime, calibrate

PROFILE = DeviceProfile(seconds_per_batch=1e-3, seconds_per_sample=1e-4)


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(DataConfig(dataset="synthetic", num_train=1024, num_test=64), seed=0)


def make_runtime(dataset, protocol, num_learners, batch_size=8, jitter=0.0, speeds=None, seed=0):
    torch.manual_seed(0)
    engine = GradientEngine(build_model("mlp", dataset.input_shape, dataset.num_classes))
    if callable(protocol):
        protocol = protocol(engine.initial_weights())
    cluster = ClusterConfig(
        seconds_per_sample=PROFILE.seconds_per_sample,
        seconds_per_batch=PROFILE.seconds_per_batch,
        jitter=jitter,
        speed_factors=speeds or [],
        latency_s=1e-4,
        bandwidth_gbps=10.0,
    )
    return SimRuntime(
        protocol,
        engine,
        dataset,
        batch_size=batch_size,
        num_learners=num_learners,
        profile=PROFILE,
        cluster=cluster,
        seed=seed,
    )


def run_updates(rt, ticks, lr=0.01):
    updates = []
    for _ in range(ticks):
        tick = rt.advance(lr)
        if tick.update is not None:
            updates.append(tick.update)
    return updates


def test_async_equal_speeds_gives_exact_staleness(dataset):
    lam = 4
    rt = make_runtime(dataset, lambda w: ParameterServer(w, lam, softsync=lam), lam)
    updates = run_updates(rt, 40)
    sigmas = [s for u in updates for s in u.staleness]
    # First round: all pulled version 0, applied at versions 0, 1, 2, 3.
    assert sigmas[:4] == [0, 1, 2, 3]
    # Afterwards every gradient has seen the other λ-1 learners' updates.
    assert set(sigmas[4:]) == {lam - 1}
    assert [u.clock[0][0] for u in updates[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_softsync_equal_speeds_gives_exact_staleness(dataset):
    lam, n = 8, 4  # c = 2 gradients per update
    rt = make_runtime(dataset, lambda w: ParameterServer(w, lam, softsync=n), lam)
    updates = run_updates(rt, 8 * 10)
    assert all(len(u.staleness) == 2 for u in updates)
    sigmas = [s for u in updates for s in u.staleness]
    assert sigmas[:8] == [0, 0, 1, 1, 2, 2, 3, 3]
    steady = sigmas[8:]
    assert steady[:8] == [4, 3, 4, 3, 4, 3, 4, 3]
    # Steady-state mean n(λ-1)/λ: the other λ-1 gradients arrive between pull and push.
    assert sum(steady) / len(steady) == n * (lam - 1) / lam


def test_one_softsync_equal_speeds(dataset):
    lam = 4
    rt = make_runtime(dataset, lambda w: ParameterServer(w, lam, softsync=1), lam)
    updates = run_updates(rt, 4 * 6)
    assert len(updates) == 6
    assert updates[0].staleness == [0, 0, 0, 0]
    # Without a barrier the first λ-1 learners are answered before the update (with the
    # old version), the last one after it: σ = 1, 1, 1, 0, mean n(λ-1)/λ with n = 1.
    assert all(u.staleness == [1, 1, 1, 0] for u in updates[1:])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_mean_staleness_is_about_n_with_jitter(dataset, n):
    lam = 8
    rt = make_runtime(
        dataset, lambda w: ParameterServer(w, lam, softsync=n), lam, jitter=0.3, seed=n
    )
    run_updates(rt, 400)
    mean = rt.protocol.staleness_mean
    # Rudra reports <σ> ≈ n; with λ learners the exact expectation for equal mean speeds is
    # n(λ-1)/λ (here 7n/8). Jitter spreads σ but should not move the mean by more than ~15%.
    assert n * (lam - 1) / lam * 0.85 <= mean <= n * 1.15, mean


def test_fast_learner_contributes_more_and_twice_under_one_softsync(dataset):
    lam = 4
    rt = make_runtime(
        dataset, lambda w: ParameterServer(w, lam, softsync=1), lam, speeds=[4.0, 1.0, 1.0, 1.0]
    )
    updates = run_updates(rt, 200)
    per_learner = Counter(learner for u in updates for learner, _ in u.clock)
    # Each round trip is two messages plus compute; the fast learner computes 4x faster.
    trip = 2 * rt.message_s
    expected = (trip + PROFILE.compute_seconds(8)) / (trip + PROFILE.compute_seconds(8) / 4)
    assert per_learner[0] / per_learner[1] == pytest.approx(expected, rel=0.05)
    assert max(per_learner[i] for i in (1, 2, 3)) - min(per_learner[i] for i in (1, 2, 3)) <= 1
    assert any(sum(1 for learner, _ in u.clock if learner == 0) >= 2 for u in updates)


def test_hardsync_through_server_has_zero_staleness_and_waits(dataset):
    lam = 4
    rt = make_runtime(
        dataset,
        lambda w: ParameterServer(w, lam, softsync=1, barrier=True),
        lam,
        jitter=0.5,
        speeds=[4.0, 1.0, 1.0, 2.0],
    )
    updates = run_updates(rt, 40)
    assert len(updates) == 10
    for u in updates:
        assert sorted(learner for learner, _ in u.clock) == [0, 1, 2, 3]
        assert u.staleness == [0, 0, 0, 0]


def test_sync_iteration_time_is_slowest_learner_plus_allreduce(dataset):
    lam, b = 4, 8
    rt = make_runtime(dataset, lambda w: HardSync(w, lam), lam, batch_size=b, speeds=[1, 1, 2, 0.5])
    rt.advance(0.01)
    p = rt.engine.num_parameters
    slowest = PROFILE.compute_seconds(b) / 0.5
    transfer = 32 * p / 10e9
    allreduce = 2 * (lam - 1) * 1e-4 + 2 * (lam - 1) / lam * transfer
    assert rt.virtual_time == pytest.approx(slowest + allreduce, rel=1e-9)
    assert rt.samples == lam * b


def test_groups_async_across_groups(dataset):
    lam, g = 8, 4
    rt = make_runtime(dataset, lambda w: ComputeGroups(w, lam, g), lam)
    updates = run_updates(rt, 20)
    # Each push is one group's averaged gradient: c = 1 update per push, 2 learners' samples.
    assert len(updates) == 20
    assert rt.samples == 20 * (lam // g) * 8
    assert set(s for u in updates[g:] for s in u.staleness) == {g - 1}


def test_state_dict_round_trip_continues_identically(dataset, tmp_path):
    lam = 4

    def proto(w):
        return ParameterServer(w, lam, softsync=2, momentum=0.9)

    a = make_runtime(dataset, proto, lam, jitter=0.3)
    run_updates(a, 17)
    path = tmp_path / "rt.pt"
    torch.save({"rt": a.state_dict(), "p": a.protocol.state_dict()}, path)
    run_updates(a, 23)

    b = make_runtime(dataset, proto, lam, jitter=0.3)
    state = torch.load(path, weights_only=True)
    b.protocol.load_state_dict(state["p"])
    b.load_state_dict(state["rt"])
    run_updates(b, 23)
    assert torch.equal(a.eval_weights(), b.eval_weights())
    assert a.virtual_time == b.virtual_time


def test_calibration_gives_positive_profile(dataset):
    engine = GradientEngine(build_model("mlp", dataset.input_shape, dataset.num_classes))
    prof = calibrate(engine, dataset, batch_sizes=(8, 64), repeats=3)
    assert prof.calibrated
    assert prof.seconds_per_sample > 0 and prof.seconds_per_batch >= 0
    assert prof.compute_seconds(64) > prof.compute_seconds(8)


class _ClockedEngine:
    """An engine whose gradient costs ``cost(b)`` seconds of a fake clock."""

    def __init__(self, cost, clock):
        self.cost, self.clock = cost, clock

    def initial_weights(self):
        return torch.zeros(3)

    def gradient(self, w, x, y):
        self.clock[0] += self.cost(len(x))
        return torch.zeros(3), 0.0


class _Indices:
    num_train = 60_000

    class train:  # noqa: N801 - the Split interface
        @staticmethod
        def batch(idx):
            return idx, idx


def _calibrate_with(cost, monkeypatch, **kw):
    clock = [0.0]
    monkeypatch.setattr(sim_module.time, "perf_counter", lambda: clock[0])
    return calibrate(_ClockedEngine(cost, clock), _Indices(), **kw)


def test_calibration_of_a_launch_bound_device_grows_the_batch(monkeypatch):
    """On an H200 the cnn's step took 1.77 ms at b = 16 and 1.52 ms at b = 128 (kernel
    launches, not samples): the profile then was per sample and predicted 0.19 ms at
    b = 16. The larger batch now grows until its time shows the per-sample cost."""
    prof = _calibrate_with(lambda b: 1e-3 + max(0, b - 1024) * 1e-6, monkeypatch)
    assert prof.compute_seconds(16) == pytest.approx(1e-3, rel=0.02)
    assert prof.compute_seconds(128) == pytest.approx(1e-3, rel=0.1)
    assert prof.seconds_per_sample > 0
    assert prof.compute_seconds(4096) == pytest.approx(1e-3 + 3072e-6, rel=0.3)


def test_calibration_of_a_cpu_keeps_its_two_batches(monkeypatch):
    seen = []
    prof = _calibrate_with(lambda b: seen.append(b) or 2e-4 + b * 1e-5, monkeypatch)
    assert set(seen) == {16, 128}
    assert prof.seconds_per_batch == pytest.approx(2e-4) and prof.seconds_per_sample == (
        pytest.approx(1e-5)
    )


def test_calibration_that_measures_a_larger_batch_faster_warns_and_is_per_batch(monkeypatch):
    with pytest.warns(ConfigWarning, match="larger batch measured faster"):
        prof = _calibrate_with(lambda b: 1e-3 if b <= 16 else 5e-4, monkeypatch)
    assert prof.seconds_per_sample == 0 and prof.seconds_per_batch == pytest.approx(1e-3)
