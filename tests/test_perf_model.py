"""The tuner's performance model: invariants over random parameters (pure numerics)."""

import math

import numpy as np
import pytest

from distsgd.control import RunOptions
from distsgd.tuner.perf_model import (
    ClusterModel,
    Layout,
    LossCurve,
    estimate_noise_scale,
    fit_error_vs_loss,
    fit_loss_curve,
    iterations_to_loss,
    samples_per_iteration,
    scale_iterations,
    seconds_per_iteration,
    straggler_factor,
    time_to_accuracy,
)

RNG = np.random.default_rng(1234)


def random_cluster(rng, t_server=0.0):
    return ClusterModel(
        t_batch=float(rng.uniform(0, 5e-3)),
        t_sample=float(rng.uniform(1e-5, 1e-3)),
        latency_s=float(rng.uniform(0, 1e-3)),
        bandwidth_gbps=float(rng.choice([0.0, 1.0, 10.0, 100.0])),
        num_parameters=int(rng.integers(1_000, 10_000_000)),
        jitter=float(rng.uniform(0, 0.5)),
        t_server=t_server,
    )


def test_compute_groups_he_falls_with_g_until_the_server_saturates():
    for _ in range(200):
        lam = int(2 ** RNG.integers(1, 7))
        t_server = float(RNG.choice([0.0, RNG.uniform(1e-5, 5e-3)]))
        c = random_cluster(RNG, t_server)
        b = int(RNG.integers(1, 129))
        gs = [g for g in (1, 2, 4, 8, 16, 32, 64) if lam % g == 0]
        he = [seconds_per_iteration(Layout("compute_groups", lam, b, num_groups=g), c) for g in gs]
        for g, prev, cur in zip(gs[1:], he, he[1:], strict=False):
            assert cur <= prev * (1 + 1e-12)
            if cur > t_server:  # not saturated: strictly faster with more groups
                assert cur < prev, (g, prev, cur)
            assert cur >= t_server  # never faster than the server allows
        if t_server > 0 and he[-1] == t_server:
            # once saturated it stays at the floor
            first = he.index(t_server)
            assert all(h == t_server for h in he[first:])


def test_he_is_positive_and_grows_with_batch_and_never_beats_perfect_scaling():
    for _ in range(300):
        c = random_cluster(RNG)
        lam = int(2 ** RNG.integers(0, 6))
        fam = str(RNG.choice(["hardsync", "compute_groups", "softsync", "sma"]))
        div = int(2 ** RNG.integers(0, int(math.log2(lam)) + 1))
        kw = {"compute_groups": "num_groups", "softsync": "softsync", "sma": "replicas_per_device"}
        extra = {kw[fam]: div} if fam in kw else {}
        b = int(RNG.integers(1, 256))
        small = seconds_per_iteration(Layout(fam, lam, b, **extra), c)
        big = seconds_per_iteration(Layout(fam, lam, 2 * b, **extra), c)
        assert 0 < small < big
        # throughput bound: every device computing back to back, nothing else; an SMA
        # device computes its k learners in turn
        lay = Layout(fam, lam, b, **extra)
        per_learner = c.t_batch + b * c.t_sample
        best_rate = lam * b / per_learner / (lay.replicas_per_device if fam == "sma" else 1)
        rate = samples_per_iteration(lay) / seconds_per_iteration(lay, c)
        assert rate <= best_rate * (1 + 1e-9)


def test_he_special_cases_match_the_simulated_clusters_formulas():
    c = ClusterModel(1e-3, 1e-4, latency_s=1e-4, bandwidth_gbps=0.0, num_parameters=10)
    # one learner, no jitter, no bandwidth cost: compute only
    assert seconds_per_iteration(Layout("hardsync", 1, 32), c) == pytest.approx(1e-3 + 32e-4)
    # hardsync λ=4: compute + ring all-reduce 2(m-1)·latency
    assert seconds_per_iteration(Layout("hardsync", 4, 32), c) == pytest.approx(1e-3 + 32e-4 + 6e-4)
    # g = λ compute groups = async: (2 messages + compute) / λ
    g4 = seconds_per_iteration(Layout("compute_groups", 4, 32, num_groups=4), c)
    assert g4 == pytest.approx((2e-4 + 1e-3 + 32e-4) / 4)
    # ... which is λ-softsync (SPEC equivalences)
    assert g4 == pytest.approx(seconds_per_iteration(Layout("softsync", 4, 32, softsync=4), c))
    assert samples_per_iteration(Layout("compute_groups", 8, 16, num_groups=2)) == 64
    assert samples_per_iteration(Layout("softsync", 8, 16, softsync=2)) == 64
    assert samples_per_iteration(Layout("sma", 8, 16, replicas_per_device=4)) == 128


def test_layout_rejects_counts_that_do_not_divide_lambda():
    with pytest.raises(ValueError, match="num_groups = 3"):
        Layout("compute_groups", 4, 32, num_groups=3)
    with pytest.raises(ValueError, match="family"):
        Layout("ddp", 4, 32)


def test_straggler_factor_is_one_without_spread_and_grows_with_m():
    assert straggler_factor(1, 0.5) == 1.0
    assert straggler_factor(64, 0.0) == 1.0
    for _ in range(100):
        s = float(RNG.uniform(0, 1))
        m = int(RNG.integers(1, 100))
        assert straggler_factor(m + 1, s) >= straggler_factor(m, s) >= 1.0


def test_fit_recovers_known_curves():
    for _ in range(25):
        true = LossCurve(
            L_inf=float(RNG.uniform(0.0, 0.5)),
            A=float(RNG.uniform(0.5, 3.0)),
            beta=float(RNG.uniform(0.2, 1.5)),
        )
        i = np.arange(0, 2000, 7.0)
        noise = RNG.normal(0, 0.003, i.size)  # small minibatch noise
        fit = fit_loss_curve(i, true(i) + noise)
        # the curve itself is recovered to within a few noise levels over the range seen
        assert np.max(np.abs(fit(i) - true(i))) < 0.02
        # parameters: β is determined up to the grid refinement (±1%) and the noise
        assert fit.beta == pytest.approx(true.beta, rel=0.1)
        assert fit.A == pytest.approx(true.A, rel=0.15)
        assert fit.L_inf == pytest.approx(true.L_inf, abs=0.05)


def test_fit_is_exact_on_noise_free_data():
    true = LossCurve(0.2, 2.0, 0.7)
    i = np.arange(0, 500.0)
    fit = fit_loss_curve(i, true(i))
    # the fine β grid has steps of 0.25%: the residual is well below 1e-3 nats
    assert fit.rmse < 1e-3
    assert fit.beta == pytest.approx(0.7, rel=0.01)


def test_fit_needs_three_finite_points():
    with pytest.raises(ValueError, match="at least 3"):
        fit_loss_curve(np.array([0.0, 1.0, 2.0]), np.array([1.0, np.nan, 0.5]))


def test_iterations_to_loss_inverts_the_curve_and_is_monotone():
    for _ in range(200):
        curve = LossCurve(
            float(RNG.uniform(0, 1)), float(RNG.uniform(0.1, 3)), float(RNG.uniform(0.1, 2))
        )
        i = float(RNG.uniform(0, 10_000))
        target = float(curve(i))
        assert iterations_to_loss(curve, target) == pytest.approx(i, rel=1e-6, abs=1e-6)
        assert iterations_to_loss(curve, target * 0.99 + curve.L_inf * 0.01) >= i
        assert iterations_to_loss(curve, curve.L_inf) == math.inf
        assert iterations_to_loss(curve, curve.L_inf + curve.A + 1) == 0.0


def test_error_vs_loss_maps_target_accuracy_to_loss():
    loss = np.array([2.0, 1.0, 0.6, 0.5, 0.4, 0.35])
    acc = 1 - (0.02 + 0.25 * loss)
    m = fit_error_vs_loss(loss, acc)
    assert m.target_loss(0.9) == pytest.approx((0.1 - 0.02) / 0.25)
    # a higher target needs a lower loss
    assert m.target_loss(0.92) < m.target_loss(0.9)


def test_batch_scaling_law_bounds_and_inverse():
    for _ in range(200):
        bn = float(RNG.uniform(0, 2000))
        s_ref, b_ref = float(RNG.uniform(10, 1e4)), float(RNG.uniform(1, 1024))
        bs = np.sort(RNG.uniform(1, 4096, 5))
        s = [scale_iterations(s_ref, b_ref, b, bn) for b in bs]
        assert all(x >= y - 1e-9 for x, y in zip(s, s[1:], strict=False))  # fewer steps
        samples = [b * x for b, x in zip(bs, s, strict=True)]
        assert all(x <= y + 1e-6 for x, y in zip(samples, samples[1:], strict=False))  # more data
        s_min = s_ref / (1 + bn / b_ref)
        assert min(s) >= s_min - 1e-9
        b2 = float(RNG.uniform(1, 4096))
        if abs(b2 - b_ref) > 1 and bn > 1:
            est = estimate_noise_scale(b_ref, s_ref, b2, scale_iterations(s_ref, b_ref, b2, bn))
            assert est == pytest.approx(bn, rel=1e-6)


def test_time_to_accuracy_is_he_times_se():
    assert time_to_accuracy(0.02, 500) == pytest.approx(10.0)
    assert time_to_accuracy(0.02, math.inf) == math.inf


@pytest.mark.parametrize(
    "replica",
    [  # a replica cost; unset (k separate minibatches); measured ratios (k = 4 beyond them)
        {"seconds_per_replica": 2e-4},
        {"seconds_per_replica": -1.0},
        {"replica_ratios": [1.0, 1.15, 1.62]},
    ],
)
@pytest.mark.parametrize("k", [2, 4])
def test_sma_he_equals_the_simulated_runtimes_time_per_iteration(tmp_path, k, replica):
    from distsgd.trainer import Trainer
    from distsgd.tuner.tune import cluster_model

    from .conftest import small_config

    cfg = small_config(
        protocol={"name": "sma", "num_learners": 2 * k, "batch_size": 8, "replicas_per_device": k},
        cluster={**replica, "jitter": 0.0, "latency_s": 2e-4},
        train={"max_epochs": 0.25, "eval_every_samples": 0},
    )
    tr = Trainer(cfg, tmp_path / "run", progress=False, options=RunOptions(evaluate=False))
    s = tr.run()
    he = seconds_per_iteration(
        Layout("sma", 2 * k, 8, replicas_per_device=k),
        cluster_model(cfg, tr.engine.num_parameters),
    )
    # no jitter: every iteration takes the same simulated time; rel 1e-9 for float sums
    assert s["virtual_s"] / s["iterations"] == pytest.approx(he, rel=1e-9)
