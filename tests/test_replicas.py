"""Several replicas per device (Crossbow, SPEC.md §4): batched gradients against the
one-by-one reference, changing k at a synchronisation point, the k-dependent device
profile and the replicas-per-device auto-tuner."""

import dataclasses
import json

import pytest
import torch

import distsgd
from distsgd.batched import choose_path, supports
from distsgd.config import ConfigError, RunConfig
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.protocols import SMA, LocalSGD
from distsgd.replicas import ReplicaAutoTuner
from distsgd.runtime import dist as rdist
from distsgd.runtime.profiles import CACHE_ENV
from distsgd.runtime.sim import DeviceProfile
from tests.conftest import small_config

SHAPE = (1, 28, 28)


def _engine(name: str, dtype: torch.dtype = torch.float32) -> GradientEngine:
    torch.manual_seed(0)
    return GradientEngine(build_model(name, SHAPE, 10).to(dtype))


def _replica_inputs(engine: GradientEngine, k: int, b: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    p = engine.num_parameters
    w0 = engine.initial_weights()
    w = w0.expand(k, -1) + 0.05 * torch.randn(k, p, generator=g).to(w0.dtype)
    x = torch.randn(k, b, *SHAPE, generator=g).to(w0.dtype)
    y = torch.randint(0, 10, (k, b), generator=g)
    return w, x, y


# Why the batched-vs-loop comparisons run in float64: the paths compute the same maths in
# another summation order, but the cnn's max-pool and ReLU make the gradient discontinuous
# at near-ties, and in float32 the summation order decides which side of a near-tie a path
# lands on (seen on one CPU: at one step's inputs the loop's float32 gradient was 1.3e-2 from
# a float64 reference while the grouped path was 7e-7 from it). Which inputs near-tie
# depends on the CPU's kernels, so a float32 tolerance cannot hold on every machine. In
# float64 the order-dependent rounding (~1e-16 relative) is far below any tie a float32
# input set produces, so both paths take the same branch everywhere.
F64 = torch.float64


# ---- batched gradients ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "path"), [("cnn", "grouped"), ("cnn", "vmap"), ("mlp", "bmm"), ("mlp", "vmap")]
)
def test_batched_replica_gradients_equal_one_by_one(model, path):
    engine = _engine(model, F64)
    w, x, y = _replica_inputs(engine, k=3, b=5)
    ref, ref_losses = engine.replica_gradients(w, x, y, path="loop")
    got, losses = engine.replica_gradients(w, x, y, path=path)
    assert got.shape == ref.shape and got.dtype == F64
    # Same maths, other float64 summation order (grouped/batched GEMMs): gradients are
    # O(0.1-1); observed differences <= 5e-15. Bound: 1e-10, far above float64 rounding
    # on any kernel and far below any real difference (a wrong replica's gradient is O(0.1)).
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    assert losses == pytest.approx(ref_losses, rel=1e-10)
    assert not torch.equal(ref[0], ref[1])  # the replicas' gradients do differ


@pytest.mark.parametrize(("model", "path"), [("cnn", "grouped"), ("mlp", "bmm")])
def test_batched_paths_keep_float32(model, path):
    """The product's dtype: the batched paths run in float32 and give gradients of the loop's
    scale (their equality is checked in float64 above, where no near-tie can flip)."""
    engine = _engine(model)
    w, x, y = _replica_inputs(engine, k=3, b=5)
    ref, _ = engine.replica_gradients(w, x, y, path="loop")
    got, _ = engine.replica_gradients(w, x, y, path=path)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # a near-tie moves a few components by ~1e-2 at most; a wrong computation moves the norm
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.1


def test_batched_sgd_trajectory_equals_separate_learners():
    """k replicas trained with batched gradients end at the same weights as k separate
    learners trained one by one (20 SGD steps of each replica on its own batches)."""
    engine = _engine("cnn", F64)
    k, b = 4, 6
    w0, _, _ = _replica_inputs(engine, k, b)
    batched, separate = w0.clone(), w0.clone()
    for t in range(20):
        _, x, y = _replica_inputs(engine, k, b, seed=100 + t)
        g_batched, _ = engine.replica_gradients(batched, x, y)  # auto: grouped
        batched -= 0.1 * g_batched
        for j in range(k):
            g, _ = engine.gradient(separate[j], x[j], y[j])
            separate[j] -= 0.1 * g
    # float64 (see F64): per-step rounding differences (~1e-16 relative) carried through
    # 20 steps of lr 0.1 (observed max 3e-15 on weights of magnitude ~0.1): bound 1e-10.
    torch.testing.assert_close(batched, separate, rtol=0, atol=1e-10)
    assert choose_path(engine.model, k, b) == "grouped"


@pytest.mark.parametrize("model", ["resnet20", "lenet"])
def test_batch_statistics_and_dropout_models_take_the_loop(model):
    engine = _engine(model)
    assert not supports(engine.model, "vmap") and not supports(engine.model, "grouped")
    assert choose_path(engine.model, 4, 8) == "loop"
    with pytest.raises(ValueError, match="path = 'vmap' is not allowed"):
        engine.replica_gradients(*_replica_inputs(engine, 2, 2), path="vmap")


def test_resnet_replicas_keep_their_own_batch_statistics():
    engine = _engine("resnet20")
    w, x, y = _replica_inputs(engine, k=2, b=4)
    got, _ = engine.replica_gradients(w, x, y)
    for j in range(2):
        ref, _ = engine.gradient(w[j], x[j], y[j])
        assert torch.equal(got[j], ref)  # the same computation, one replica at a time


def test_choose_path_rule():
    cnn, mlp = _engine("cnn").model, _engine("mlp").model
    assert choose_path(cnn, 1, 8) == "loop"
    assert choose_path(cnn, 16, 8) == "grouped"
    assert choose_path(cnn, 16, 32) == "grouped"
    assert choose_path(cnn, 4, 64) == "loop"
    assert choose_path(mlp, 8, 4) == "bmm"


# ---- changing k at a synchronisation point ---------------------------------------------
P = 5
W0 = torch.linspace(-1.0, 1.0, P)


def _grads(n: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(n, P, generator=g)


def test_sma_add_replica_copies_its_device_last_replica():
    sma = SMA(W0, 4, replicas_per_device=2, alpha=0.2, central_momentum=0.9, momentum=0.9)
    for t in range(3):
        sma.step(_grads(4, t), lr=0.1)
    before = sma.replicas.clone()
    z = sma.eval_weights()
    sma.add_replica_per_device()
    assert (sma.num_learners, sma.replicas_per_device, sma.num_devices) == (6, 3, 2)
    # device-major rows: device 0 = rows 0, 1, copy of 1; device 1 = rows 2, 3, copy of 3
    expected = before[[0, 1, 1, 2, 3, 3]]
    assert torch.equal(sma.replicas, expected)
    assert torch.equal(sma.eval_weights(), z)
    # the copy carries the momentum buffer too: with equal gradients it stays equal
    g = _grads(6, 9)
    g[2], g[5] = g[1], g[4]
    sma.step(g, lr=0.1)
    assert torch.equal(sma.replicas[2], sma.replicas[1])
    assert torch.equal(sma.replicas[5], sma.replicas[4])


def test_sma_remove_replica_restores_the_smaller_layout_exactly():
    kw = dict(alpha=0.2, central_momentum=0.9, momentum=0.9)
    grown = SMA(W0, 2, replicas_per_device=1, **kw)
    ref = SMA(W0, 2, replicas_per_device=1, **kw)
    for t in range(3):
        grown.step(_grads(2, t), lr=0.1)
        ref.step(_grads(2, t), lr=0.1)
    grown.add_replica_per_device()
    grown.remove_replica_per_device()
    for t in range(3, 6):
        grown.step(_grads(2, t), lr=0.1)
        ref.step(_grads(2, t), lr=0.1)
    assert torch.equal(grown.state_dict()["replicas"], ref.state_dict()["replicas"])
    assert torch.equal(grown.eval_weights(), ref.eval_weights())


def test_sma_hierarchical_central_model_identical_on_every_device_across_a_change_of_k():
    """Two devices (as two processes would): per-device correction sums, one all-reduce
    (a sum), the same z update everywhere; both devices add a replica at the same sync
    point. Reference: one SMA object holding all replicas (SPEC.md §4)."""
    kw = dict(alpha=0.1, central_momentum=0.9, momentum=0.9)
    devices = [SMA(W0, 1, replicas_per_device=1, **kw) for _ in range(2)]
    whole = SMA(W0, 2, replicas_per_device=1, **kw)
    k = 1
    for t in range(8):
        if t == 4:  # the tuner's decision, applied by every process
            k = 2
            whole.add_replica_per_device(alpha=0.1)
            for d in devices:
                d.add_replica_per_device(alpha=0.1)
        grads = _grads(2 * k, t)
        sums = [d.local_step(grads[i * k : (i + 1) * k], lr=0.1) for i, d in enumerate(devices)]
        total = torch.cat(sums).sum(0)
        for d in devices:
            d.apply_central(total)
        whole.step(grads, lr=0.1)
        assert torch.equal(devices[0].eval_weights(), devices[1].eval_weights())
        # (c0 + c1) vs the same two per-device sums summed as rows: same order, but the
        # whole object sums within a device first too; reordering bound ~1e-7 per step.
        torch.testing.assert_close(
            devices[0].eval_weights(), whole.eval_weights(), rtol=0, atol=1e-6
        )
    assert torch.equal(torch.cat([d.replicas for d in devices]), whole.replicas)


def test_sma_change_of_k_lifecycle_errors():
    sma = SMA(W0, 2, replicas_per_device=1)
    with pytest.raises(ValueError, match="only one"):
        sma.remove_replica_per_device()
    sma.local_step(torch.zeros(2, P), 0.1)
    with pytest.raises(RuntimeError, match="between local_step and apply_central"):
        sma.add_replica_per_device()
    with pytest.raises(ValueError, match="replicas_per_device = 0"):
        SMA(W0, 2).set_replicas_per_device(0)


def test_local_sgd_add_replica_after_averaging():
    ls = LocalSGD(W0, 2, average_every=2, momentum=0.9, replicas_per_device=1)
    for t in range(2):
        ls.step(_grads(2, t), lr=0.1)
    avg = ls.eval_weights()
    ls.add_replica_per_device()
    assert ls.num_learners == 4 and ls.replicas_per_device == 2
    assert all(torch.equal(ls.learner_weights(j), avg) for j in range(4))
    ls.remove_replica_per_device()
    assert ls.num_learners == 2


# ---- device profile ----------------------------------------------------------------------
def test_device_profile_of_k_replicas():
    prof = DeviceProfile(1e-3, 1e-4, seconds_per_replica=1e-3)
    assert prof.device_seconds(1, 8) == pytest.approx(prof.compute_seconds(8))
    assert prof.device_seconds(4, 8) == pytest.approx(1e-3 + 8 * 1e-4 + 3 * 1e-3)
    # without a replica cost: k separate minibatches
    plain = DeviceProfile(1e-3, 1e-4)
    assert plain.device_seconds(4, 8) == pytest.approx(4 * plain.compute_seconds(8))


# ---- auto-tuner ------------------------------------------------------------------------
def _tune(seconds_of_k, threshold=0.1, max_replicas=16, interval=3):
    tuner = ReplicaAutoTuner(threshold, interval, max_replicas, warmup=1)
    for _ in range(1000):
        if tuner.done:
            break
        tuner.observe(8 * tuner.k, seconds_of_k(tuner.k))
    return tuner


def test_tuner_adds_while_gain_exceeds_threshold_then_removes_the_last():
    prof = DeviceProfile(4e-3, 5e-4, seconds_per_replica=5e-3)
    tuner = _tune(lambda k: prof.device_seconds(k, 8))
    gains = [d.gain for d in tuner.decisions if d.gain is not None]
    assert [d.action for d in tuner.decisions][-1] == "remove"
    assert all(g > 0.1 for g in gains[:-1]) and gains[-1] <= 0.1
    assert tuner.k == tuner.decisions[-1].k_before - 1
    # throughput = 8k / (a + 8 s + (k-1) r); adding the k-th replica gains
    # ratio(k) - 1 with the formula below: the tuner stops at the first k where it is <= 10%.
    first_small = next(
        k
        for k in range(2, 17)
        if (k / (k - 1)) * prof.device_seconds(k - 1, 8) / prof.device_seconds(k, 8) - 1 <= 0.1
    )
    assert tuner.k == first_small - 1


def test_tuner_keeps_k_at_max_and_never_adds_without_gain():
    assert _tune(lambda k: 1.0, max_replicas=3).k == 3  # perfect scaling: stops at the cap
    flat = _tune(lambda k: float(k))  # no gain at all
    assert flat.k == 1 and [d.action for d in flat.decisions] == ["add", "remove"]


def test_marginal_rule_follows_a_slowly_rising_curve_that_crossbow_stops_on():
    # samples/s at k replicas: +30% at k = 2, then a slow rise to a maximum at k = 8 (the
    # shape measured on a 2-core CPU, bench/results/replicas_throughput_b8.md)
    rate = {1: 1000, 2: 1300, 3: 1400, 4: 1480, 5: 1540, 6: 1590, 7: 1630, 8: 1660}
    rate.update({k: 1660 - 10 * (k - 8) for k in range(9, 17)})

    def seconds(k):
        return 8 * k / rate[k]

    crossbow = _tune(seconds)
    assert crossbow.k == 2  # k = 3 gains 7.7% <= 10%
    marginal = ReplicaAutoTuner(0.1, 3, 16, warmup=1, rule="marginal")
    for _ in range(1000):
        if marginal.done:
            break
        marginal.observe(8 * marginal.k, seconds(marginal.k))
    # the k-th replica adds (k−1)·gain: 15%, 17%, 16%, 16%, 15%, 13% up to k = 8, then < 0
    assert marginal.k == 8 and marginal.decisions[-1].action == "remove"
    crits = [d.criterion for d in marginal.decisions if d.criterion is not None]
    gains = [d.gain for d in marginal.decisions if d.gain is not None]
    assert crits == pytest.approx([g * i for i, g in enumerate(gains, start=1)])
    assert "(k−1)·gain" in marginal.decisions[-1].reason
    # perfect scaling: Crossbow's total gain 1/(k−1) is 14.3% <= 15% at k = 8, so it
    # stops at 7; the marginal rule sees every replica add a whole replica's throughput
    assert _tune(lambda k: 1.0, threshold=0.15).k == 7
    linear = ReplicaAutoTuner(0.15, 3, 16, warmup=1, rule="marginal")
    while not linear.done:
        linear.observe(8 * linear.k, 1.0)
    assert linear.k == 16 and linear.decisions[-1].action == "keep"
    with pytest.raises(ValueError, match="rule"):
        ReplicaAutoTuner(0.1, rule="greedy")


def test_one_outlier_iteration_does_not_flip_a_decision():
    """Throughput is samples / (median seconds per iteration × iterations): one
    iteration 20× slower (an OS hiccup) inside an interval of 5 leaves every decision as
    without it. With the plain sum of seconds the same outlier flips both cases below."""

    def decisions(seconds_of_k, outlier_k):
        tuner = ReplicaAutoTuner(0.1, interval=5, max_replicas=4, warmup=0)
        out, at_k = [], 0
        while not tuner.done:
            at_k += 1
            slow = tuner.k == outlier_k and at_k == 3  # the 3rd of the 5 iterations
            d = tuner.observe(8 * tuner.k, seconds_of_k[tuner.k] * (20.0 if slow else 1.0))
            if d is not None:
                out.append((d.k_before, d.action))
                at_k = 0
        return out

    grows = {1: 1.0, 2: 1.5, 3: 2.5}  # k = 2: +33% (add); k = 3: -10% (remove)
    flat = {1: 1.0, 2: 2.0, 3: 3.0}  # k = 2: no gain (remove)
    assert decisions(grows, None) == [(1, "add"), (2, "add"), (3, "remove")]
    assert decisions(grows, 2) == decisions(grows, None)  # slow k = 2 would look like a loss
    assert decisions(flat, None) == [(1, "add"), (2, "remove")]
    assert decisions(flat, 1) == decisions(flat, None)  # slow k = 1 would fake a gain
    # the plain sum would have flipped them: 5 iterations with one 20× slower
    assert (8 * 2 * 5) / (1.5 * 24) < 1.1 * (8 * 5) / (1.0 * 5)
    assert (8 * 2 * 5) / (2.0 * 5) > 1.1 * (8 * 5) / (1.0 * 24)


def test_tuner_state_round_trip_and_errors():
    tuner = ReplicaAutoTuner(0.1, 2, 8, warmup=0)
    for _ in range(3):
        tuner.observe(8, 0.01)
    other = ReplicaAutoTuner(0.1, 2, 8, warmup=0)
    other.load_state_dict(json.loads(json.dumps(tuner.state_dict())))
    for _ in range(5):
        assert tuner.observe(8 * tuner.k, 0.01) == other.observe(8 * other.k, 0.01)
    with pytest.raises(ValueError, match="threshold"):
        ReplicaAutoTuner(0.0)
    with pytest.raises(ValueError, match="interval"):
        ReplicaAutoTuner(0.1, interval=0)


# ---- config and end to end ---------------------------------------------------------------
def test_config_replicas_auto_and_errors():
    cfg = RunConfig.from_dict({"protocol": {"name": "sma", "replicas_per_device": "auto"}})
    assert cfg.protocol.auto_replicas and cfg.protocol.num_devices == 4
    assert RunConfig().protocol.replicas_per_device == 1
    bad = [
        (
            {"name": "hardsync", "replicas_per_device": "auto"},
            "protocol.replicas_per_device = 'auto'",
        ),
        ({"name": "sma", "replicas_per_device": "many"}, "an integer >= 1 or 'auto'"),
        (
            {"name": "sma", "replicas_per_device": "auto", "autotune_threshold": 0},
            "autotune_threshold",
        ),
        (
            {"name": "sma", "replicas_per_device": "auto", "autotune_interval": 0},
            "autotune_interval",
        ),
        (
            {"name": "sma", "replicas_per_device": "auto", "autotune_rule": "greedy"},
            "autotune_rule",
        ),
    ]
    for protocol, match in bad:
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_dict({"protocol": protocol})
    # the dist runtime takes "auto": one process per device, fitted at k = 1
    dist_auto = RunConfig.from_dict(
        {
            "runtime": "dist",
            "protocol": {"name": "sma", "num_learners": 2, "replicas_per_device": "auto"},
            "dist": {"num_processes": 3},
        }
    )
    assert dist_auto.protocol.num_learners == 3 and dist_auto.protocol.auto_replicas
    with pytest.raises(ConfigError, match="cluster.speed_factors"):
        RunConfig.from_dict(
            {
                "protocol": {"name": "sma", "num_learners": 2, "replicas_per_device": "auto"},
                "cluster": {"speed_factors": [1, 2]},
            }
        )


def _auto_config(**protocol):
    return small_config(
        protocol={
            "name": "sma",
            "num_learners": 2,
            "batch_size": 8,
            "replicas_per_device": "auto",
            "autotune_interval": 2,
            "alpha": 0.0,
            **protocol,
        },
        cluster={
            "seconds_per_replica": 1e-3,
            "jitter": 0.0,
            "latency_s": 0.0,
            "bandwidth_gbps": 0.0,
        },
        train={"max_epochs": 1.0, "eval_every_samples": 256},
    )


@pytest.mark.parametrize("protocol", ["sma", "local_sgd"])
def test_autotune_end_to_end_on_the_simulated_cluster(tmp_path, protocol):
    cfg = _auto_config(name=protocol, average_every=2)
    summary = distsgd.train(cfg, out_dir=tmp_path / "run")
    log = json.loads((tmp_path / "run" / "autotune.json").read_text())
    prof = DeviceProfile(1e-3, 1e-4, seconds_per_replica=1e-3)  # conftest's FIXED_CLUSTER
    expected = _tune(lambda k: prof.device_seconds(k, 8)).k
    assert log["done"] and log["k"] == expected == summary["replicas_per_device"]
    assert summary["num_learners"] == 2 * expected
    # the layout at the end: the λ and k the run holds, not "k=auto"
    h = " H=2" if protocol == "local_sgd" else ""
    assert summary["layout"] == f"λ={2 * expected} b=8 k={expected} (auto){h}"
    assert {"k_before", "k_after", "throughput", "action", "reason"} <= set(log["decisions"][0])
    assert log["decisions"][-1]["action"] == "remove"


@pytest.mark.slow
def test_autotune_resume_continues_identically(tmp_path):
    cfg = _auto_config()
    full = distsgd.train(cfg, out_dir=tmp_path / "full")
    half = cfg.replace(train=dataclasses.replace(cfg.train, max_epochs=0.5))
    distsgd.train(half, out_dir=tmp_path / "half")
    resumed = distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=1.0"])
    assert resumed["replicas_per_device"] == full["replicas_per_device"]
    assert resumed["final_metric"] == full["final_metric"]
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["protocol"]
    b = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=True)["protocol"]
    assert torch.equal(a["central"], b["central"])


def test_default_alpha_is_one_over_all_learners_across_devices():
    """α = 0 means 1/λ over all learners (SPEC §4), not 1/k per device: with 2 devices of
    2 replicas and μ_z = 0 the new z must be the mean of the 4 pre-update replicas. With
    1/k per device the 2 device sums would move z twice as far (and diverge)."""
    from distsgd.layout import build_protocol

    cfg = RunConfig.from_dict(
        {
            "protocol": {
                "name": "sma",
                "num_learners": 4,
                "replicas_per_device": 2,
                "alpha": 0.0,
                "central_momentum": 0.0,
            },
            "optimizer": {"momentum": 0.0},
        }
    )
    sma = build_protocol(cfg, torch.zeros(3))
    assert sma.alpha == pytest.approx(0.25)
    sma.step(torch.arange(12.0).view(4, 3), lr=1.0)  # replicas move apart, z stays 0
    replicas = sma.replicas.clone()
    sma.step(torch.zeros(4, 3), lr=1.0)
    torch.testing.assert_close(sma.eval_weights(), replicas.mean(0))  # float32 rounding only


# ---- calibration of the k-replica profile (stubbed timings: no wall clock is asserted) ---
# t(k)/t(1) of the batched path with the shape measured on this machine (cnn, b = 8, one
# thread, bench/results/replica_calibration.md): a second replica costs little, later
# ones about a full replica; no single per-replica cost reproduces it
_RATIOS = [1.0, 1.15, 1.62, 2.2]


@pytest.mark.parametrize("t1", [3e-3, 0.5])  # the absolute seconds do not matter
def test_calibrated_profile_reproduces_the_measured_ratios(t1):
    from distsgd.runtime.sim import replica_ratios

    ratios = replica_ratios({k: t1 * q for k, q in enumerate(_RATIOS, 1)})
    # a large-batch profile whose t(1) at b = 8 is far from the measured t(1)
    prof = DeviceProfile(0.0, 2e-4, replica_ratios=tuple(ratios))
    for k, q in enumerate(_RATIOS, 1):
        # rel 1e-12: float rounding of the division only
        assert prof.device_seconds(k, 8) / prof.device_seconds(1, 8) == pytest.approx(q, rel=1e-12)
    # beyond the measured k: the last measured step (2.2 − 1.62) continues
    assert prof.device_seconds(6, 8) / prof.device_seconds(1, 8) == pytest.approx(2.2 + 2 * 0.58)
    with pytest.raises(ValueError, match="k = 1"):
        replica_ratios({1: 1.0, 3: 2.0})


@pytest.mark.parametrize(
    "value", [[1.2, 2.0], [1.0], [1.0, 0.0], [1.0, float("nan")], [1.0, True], "1,2"]
)
def test_replica_ratios_are_validated(value):
    with pytest.raises(ConfigError, match="cluster.replica_ratios"):
        small_config(cluster={"replica_ratios": value})


def test_simulated_tuner_follows_the_calibrated_curve(tmp_path, monkeypatch):
    """Calibration (stubbed measured seconds) → simulated device profile → tuner: the
    ratios in config.toml / summary.json are the measured ones, and every decision's gain
    is the measured curve's T(k)/T(k−1) − 1 (jitter 0: simulated seconds are the model's)."""
    import distsgd.runtime.sim as sim

    asked = []

    def measure(engine, dataset, b, ks, repeats=5):
        asked.append(ks)
        return {k: 0.01 * q for k, q in zip(ks, _RATIOS, strict=False)}

    monkeypatch.setattr(sim, "measure_replica_seconds", measure)
    # the device's work per iteration beyond its gradients (measured with the profile) is
    # added once per device iteration, so it would raise every gain by an amount that
    # depends on the measured t(1) and on timing: this test pins the replica curve alone
    monkeypatch.setattr(rdist, "calibrate_iteration", lambda *a, **k: 0.0)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # measured here, not cached
    cfg = _auto_config(autotune_max_replicas=4)
    cfg = cfg.replace(
        cluster=dataclasses.replace(
            cfg.cluster, seconds_per_sample=-1.0, seconds_per_batch=-1.0, seconds_per_replica=-1.0
        )
    )
    summary = distsgd.train(cfg, out_dir=tmp_path / "run")
    assert asked == [(1, 2, 3, 4)]  # every k up to autotune_max_replicas
    assert summary["device_profile"]["replica_ratios"] == pytest.approx(_RATIOS, rel=1e-12)
    log = json.loads((tmp_path / "run" / "autotune.json").read_text())
    measured_gain = {k: k * _RATIOS[k - 2] / ((k - 1) * _RATIOS[k - 1]) - 1 for k in (2, 3, 4)}
    for d in log["decisions"][1:]:
        # rel 1e-6: float sums of virtual time over the interval
        assert d["gain"] == pytest.approx(measured_gain[d["k_before"]], rel=1e-6)
    # +74% at k = 2, then +6.5% at k = 3: back to k = 2, as on the measured curve
    assert [(d["k_before"], d["action"]) for d in log["decisions"]] == [
        (1, "add"),
        (2, "add"),
        (3, "remove"),
    ]
    assert log["k"] == 2 == _tune(lambda k: _RATIOS[k - 1], max_replicas=4).k


@pytest.mark.slow
def test_autotune_resume_in_the_middle_of_a_measurement(tmp_path):
    """Interrupted while the tuner is still measuring (checkpoint: not done, an interval
    half counted), the resumed run takes the same decisions and ends with the same
    weights as the uninterrupted one."""
    cfg = _auto_config()
    full = distsgd.train(cfg, out_dir=tmp_path / "full")
    half = cfg.replace(train=dataclasses.replace(cfg.train, max_epochs=0.125))
    distsgd.train(half, out_dir=tmp_path / "half")
    state = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=True)
    assert state["autotune"]["done"] is False
    assert state["autotune"]["decisions"]  # stopped after at least one decision …
    assert state["autotune"]["count"] + state["autotune"]["skip"] > 0  # … mid-interval
    resumed = distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=1.0"])
    a = json.loads((tmp_path / "full" / "autotune.json").read_text())
    b = json.loads((tmp_path / "half" / "autotune.json").read_text())
    assert a == b
    assert resumed["replicas_per_device"] == full["replicas_per_device"]
    assert resumed["final_metric"] == full["final_metric"]
    wa = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["protocol"]
    wb = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=True)["protocol"]
    assert torch.equal(wa["central"], wb["central"])


@pytest.mark.parametrize("threshold, shown", [(0.1, "10%"), (0.105, "10.5%"), (0.005, "0.5%")])
def test_decision_reason_shows_the_threshold_as_given(threshold, shown):
    tuner = _tune(lambda k: float(k), threshold=threshold)  # no gain: add, then remove
    assert tuner.decisions[-1].reason.endswith(f"is not above the threshold {shown}")
