"""Protocols against single-process references and the equivalences of SPEC.md.

The problem is a fixed softmax regression (15 features, 4 classes: P = 64) on seeded random
data; learner l's minibatch at step t is a fixed slice, so gradients differ per learner and
every run is deterministic. P = 64 keeps every [λ, P] stack a whole number of SIMD vectors,
so elementwise optimizer maths gives the same bits per row whatever λ is.

Tolerances: "exact" means torch.equal. Where two computations are equal mathematically
but sum in a different order, the bound is stated next to the assertion; float32 has
eps = 1.2e-7, the weights here are O(1), so one reordered sum differs by ~1e-7.
"""

from __future__ import annotations

import doctest
import importlib
import io
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from distsgd.config import ConfigError, OptimizerConfig, ProtocolConfig, RunConfig
from distsgd.layout import build_protocol
from distsgd.protocols import (
    SMA,
    ComputeGroups,
    DiLoCo,
    HardSync,
    LocalSGD,
    ParameterServer,
    Update,
)

D_IN, K = 15, 4
P = D_IN * K + K  # 64
N = 1024
_gen = torch.Generator().manual_seed(1234)
X = torch.randn(N, D_IN, generator=_gen)
Y = torch.randint(0, K, (N,), generator=_gen)
W0 = 0.3 * torch.randn(P, generator=_gen)


def loss_grad(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gradient, shape [P], of the mean cross-entropy over samples ``idx`` at weights ``w``."""
    w = w.detach().clone().requires_grad_(True)
    logits = X[idx] @ w[: D_IN * K].view(D_IN, K) + w[D_IN * K :]
    (g,) = torch.autograd.grad(F.cross_entropy(logits, Y[idx]), w)
    return g


def batch(learner: int, step: int, b: int, num_learners: int) -> torch.Tensor:
    """Learner ``learner``'s b sample indices at ``step``: consecutive learners get
    consecutive slices, so the union over learners is one slice of λ·b samples."""
    start = (step * num_learners + learner) * b
    return (torch.arange(b) + start) % N


def sync_grads(proto, step: int, b: int = 8) -> torch.Tensor:
    """[λ, P] gradients of every learner at its ``learner_weights``."""
    lam = proto.num_learners
    return torch.stack(
        [loss_grad(proto.learner_weights(i), batch(i, step, b, lam)) for i in range(lam)]
    )


def roundtrip(state: dict) -> dict:
    """state through torch.save and torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Learners:
    """Runtime-side state of asynchronous workers: the weights and version each pulled, and
    a per-worker minibatch counter. ``push(w)`` computes worker w's gradient (for compute
    groups: the mean over its members) on its pulled weights and pushes it."""

    def __init__(self, proto, b: int = 8) -> None:
        self.proto = proto
        self.b = b
        self.pulled: dict[int, tuple[torch.Tensor, int]] = {}
        self.count = [0] * proto.num_workers
        self.updates: list[Update] = []

    def pull(self, w: int) -> int:
        self.pulled[w] = self.proto.pull(w)
        return self.pulled[w][1]

    def grad(self, w: int) -> torch.Tensor:
        weights, _ = self.pulled[w]
        members = self.proto.members(w) if isinstance(self.proto, ComputeGroups) else [w]
        lam = self.proto.num_learners
        t = self.count[w]
        self.count[w] += 1
        return torch.stack([loss_grad(weights, batch(m, t, self.b, lam)) for m in members]).mean(0)

    def push(self, w: int, lr: float = 0.1) -> Update | None:
        u = self.proto.push(w, self.grad(w), self.pulled.pop(w)[1], lr)
        if u is not None:
            self.updates.append(u)
        return u

    def pull_all_waiting(self) -> None:
        for w in range(self.proto.num_workers):
            if w not in self.pulled and self.proto.can_pull(w):
                self.pull(w)

    def copy(self, proto) -> Learners:
        other = Learners(proto, self.b)
        other.pulled = {w: (t.clone(), v) for w, (t, v) in self.pulled.items()}
        other.count = list(self.count)
        return other


def round_robin(learners: Learners, rounds: int, lr: float = 0.1) -> None:
    """Every worker pulls once, then in order 0..λ-1 each pushes and pulls right after."""
    for w in range(learners.proto.num_workers):
        learners.pull(w)
    for _ in range(rounds):
        for w in range(learners.proto.num_workers):
            learners.push(w, lr)
            learners.pull(w)


# ---- §1 hardsync -----------------------------------------------------------------------


def test_hardsync_lambda_learners_equals_one_learner_with_lambda_b_batch():
    lam, b = 4, 8
    multi = HardSync(W0, lam, momentum=0.9, weight_decay=1e-3)
    single = HardSync(W0, 1, momentum=0.9, weight_decay=1e-3)
    for t in range(20):
        multi.step(sync_grads(multi, t, b), lr=0.2)
        union = batch(0, t, lam * b, 1)  # = union of the λ learners' slices at step t
        assert torch.equal(union, torch.cat([batch(i, t, b, lam) for i in range(lam)]))
        single.step(loss_grad(single.learner_weights(0), union).unsqueeze(0), lr=0.2)
        # Mean of 4 per-learner means vs one mean of 32 samples: same sum in another order,
        # ~1e-7 per step; momentum 0.9 carries errors ~10 steps: bound 1e-6 (O(1) weights).
        torch.testing.assert_close(multi.eval_weights(), single.eval_weights(), rtol=0, atol=1e-6)
    assert multi.iteration == single.iteration == 20
    assert (multi.eval_weights() - W0).abs().max() > 0.1  # it trained


# ---- §2 parameter server ---------------------------------------------------------------


def test_parameter_server_barrier_equals_hardsync_and_staleness_is_zero():
    lam = 4
    kw = dict(momentum=0.9, weight_decay=1e-3, nesterov=True)
    ps = ParameterServer(W0, lam, softsync=1, barrier=True, **kw)
    hs = HardSync(W0, lam, **kw)
    for t in range(15):
        pulled = [ps.pull(i) for i in range(lam)]
        assert all(v == t for _, v in pulled)
        grads = torch.stack([loss_grad(w, batch(i, t, 8, lam)) for i, (w, _) in enumerate(pulled)])
        for i in range(lam - 1):
            assert ps.push(i, grads[i], t, lr=0.1) is None
            assert not ps.can_pull(i)
        u = ps.push(lam - 1, grads[lam - 1], t, lr=0.1)
        hs.step(sync_grads(hs, t), lr=0.1)
        # Same rows stacked in the same order, same optimizer: exact.
        assert torch.equal(ps.eval_weights(), hs.eval_weights())
        assert u == Update(t + 1, [(i, t) for i in range(lam)], [0] * lam, 0.1, [1.0] * lam)
    assert ps.staleness_counts == {0: 15 * lam} and ps.staleness_max == 0


def test_parameter_server_barrier_lifecycle_errors():
    ps = ParameterServer(W0, 2, softsync=1, barrier=True)
    g = torch.zeros(P)
    ps.push(0, g, 0, lr=0.1)
    with pytest.raises(RuntimeError, match="already pushed"):
        ps.push(0, g, 0, lr=0.1)
    with pytest.raises(RuntimeError, match="cannot pull"):
        ps.pull(0)
    assert ps.can_pull(1)
    ps.push(1, g, 0, lr=0.1)
    assert ps.version == 1 and ps.can_pull(0)
    with pytest.raises(RuntimeError, match="must pull"):
        ps.push(0, g, 0, lr=0.1)  # computed on version 0, server at 1


@pytest.mark.parametrize(
    "barrier,staleness_lr",
    [(False, "none"), (True, "softsync"), (False, "measured"), (False, "per_gradient")],
)
def test_parameter_server_one_learner_equals_sgd(barrier, staleness_lr):
    ps = ParameterServer(
        W0,
        1,
        softsync=1,
        barrier=barrier,
        staleness_lr=staleness_lr,
        momentum=0.9,
        weight_decay=1e-3,
    )
    ref = W0.clone()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=1e-3)
    for t in range(20):
        w, v = ps.pull(0)
        u = ps.push(0, loss_grad(w, batch(0, t, 8, 1)), v, lr=0.1)
        ref.grad = loss_grad(ref, batch(0, t, 8, 1))
        opt.step()
        assert torch.equal(ps.eval_weights(), ref)  # same op sequence: exact
        assert u.staleness == [0] and u.lr == 0.1
    assert ps.staleness_counts == {0: 20} and ps.staleness_mean == 0.0


def test_parameter_server_one_learner_adagrad_equals_torch_adagrad():
    ps = ParameterServer(W0, 1, softsync=1, optimizer="adagrad", weight_decay=1e-3)
    ref = W0.clone()
    opt = torch.optim.Adagrad([ref], lr=0.1, weight_decay=1e-3)
    for t in range(20):
        w, v = ps.pull(0)
        ps.push(0, loss_grad(w, batch(0, t, 8, 1)), v, lr=0.1)
        ref.grad = loss_grad(ref, batch(0, t, 8, 1))
        opt.step()
        assert torch.equal(ps.eval_weights(), ref)


def test_async_round_robin_staleness_is_lambda_minus_one():
    lam = 4
    learners = Learners(ParameterServer(W0, lam, softsync=lam))
    round_robin(learners, rounds=5)
    for u_idx, u in enumerate(learners.updates):
        i, r = u_idx % lam, u_idx // lam + 1  # update u_idx+1: learner i, round r
        pulled = 0 if r == 1 else 4 * (r - 2) + i + 1  # i pulled right after its last push
        assert u.version == u_idx + 1
        assert u.clock == [(i, pulled)]
        assert u.staleness == [u_idx - pulled] == ([i] if r == 1 else [lam - 1])
    assert learners.proto.staleness_counts == {0: 1, 1: 1, 2: 1, 3: 17}


def test_n_softsync_round_robin_staleness_alternates_4_3():
    lam, n = 8, 4  # c = 2
    ps = ParameterServer(W0, lam, softsync=n)
    learners = Learners(ps)
    round_robin(learners, rounds=4)
    ups = learners.updates
    assert len(ups) == 4 * n
    # Round 1: every gradient is computed on version 0; pair m is applied to version m.
    for m in range(4):
        assert ups[m].clock == [(2 * m, 0), (2 * m + 1, 0)]
        assert ups[m].staleness == [m, m]
    # Round r >= 2, pair m: the update is the (4(r-1)+m+1)-th, applied to version 4(r-1)+m.
    # In round r-1 learner 2m pulled right after its push, before its pair's update
    # (version 4(r-2)+m); learner 2m+1 pulled after it (version 4(r-2)+m+1). So σ = 4, 3,
    # and the mean is n(λ-1)/λ = 3.5.
    for r in range(2, 5):
        for m in range(4):
            u = ups[4 * (r - 1) + m]
            assert u.version == 4 * (r - 1) + m + 1
            assert u.clock == [(2 * m, 4 * (r - 2) + m), (2 * m + 1, 4 * (r - 2) + m + 1)]
            assert u.staleness == [4, 3]
    steady = [s for u in ups[4:] for s in u.staleness]
    assert sum(steady) / len(steady) == n * (lam - 1) / lam == 3.5


def test_one_softsync_equal_speed_has_zero_staleness():
    lam = 4
    learners = Learners(ParameterServer(W0, lam, softsync=1))
    for t in range(5):  # equal speed: all pushes arrive, then all learners pull
        for i in range(lam):
            learners.pull(i)
        for i in range(lam):
            learners.push(i)
        u = learners.updates[-1]
        assert u.clock == [(i, t) for i in range(lam)] and u.staleness == [0] * lam
    assert len(learners.updates) == 5


def test_one_softsync_round_robin_with_immediate_pull():
    # Learners 0..2 pull before the update their push completes: one update stale.
    lam = 4
    learners = Learners(ParameterServer(W0, lam, softsync=1))
    round_robin(learners, rounds=4)
    assert learners.updates[0].staleness == [0, 0, 0, 0]
    for i, u in enumerate(learners.updates[1:], start=1):
        assert u.clock == [(0, i - 1), (1, i - 1), (2, i - 1), (3, i)]
        assert u.staleness == [1, 1, 1, 0]


def test_one_softsync_fast_learner_contributes_twice():
    lam = 4
    ps = ParameterServer(W0, lam, softsync=1)
    learners = Learners(ps)
    for i in range(lam):
        learners.pull(i)
    for i in (0, 0, 1, 2):  # learner 0 pushes, pulls (still version 0), pushes again
        learners.push(i)
        if i == 0:
            learners.pull(0)
    (u,) = learners.updates
    assert u.clock == [(0, 0), (0, 0), (1, 0), (2, 0)] and u.staleness == [0, 0, 0, 0]
    assert learners.push(3) is None
    assert ps.num_buffered == 1 and ps.buffered_clock == [(3, 0)]


def _stale_pushes(staleness_lr: str, lr: float = 0.1, pushes: int = 5):
    """Async (c = 1) server; learner 0 pushes the same gradient on version 0 every time,
    so the k-th update (k = 0, 1, ...) has σ = k."""
    ps = ParameterServer(torch.zeros(P), 2, softsync=2, staleness_lr=staleness_lr)
    g = torch.linspace(-1.0, 1.0, P)
    ups = [ps.push(0, g, 0, lr) for _ in range(pushes)]
    return ps, g, ups


@pytest.mark.parametrize(
    "rule,lrs,scales",
    [
        ("none", [0.1] * 5, [1.0] * 5),
        ("softsync", [0.05] * 5, [1.0] * 5),  # α0/n, n = 2
        # running mean σ after update k is k/2: α0 / max(1, k/2)
        ("measured", [0.1, 0.1, 0.1, 0.1 / 1.5, 0.1 / 2.0], [1.0] * 5),
        ("per_gradient", [0.1] * 5, [1.0, 1.0, 1 / 2, 1 / 3, 1 / 4]),  # 1 / max(1, σ)
    ],
)
def test_staleness_lr_rules(rule, lrs, scales):
    ps, g, ups = _stale_pushes(rule)
    assert [u.staleness for u in ups] == [[k] for k in range(5)]
    assert [u.lr for u in ups] == pytest.approx(lrs, rel=1e-15)
    assert [u.scales for u in ups] == [[s] for s in scales]
    expected = -sum(a * s for a, s in zip(lrs, scales, strict=True)) * g
    # Five rounded float32 updates vs one float64 coefficient: |g| <= 1, total step
    # < 0.5, so rounding stays below ~5 ulp of 0.5.
    torch.testing.assert_close(ps.eval_weights(), expected, rtol=0, atol=5e-7)
    assert ps.staleness_mean == 2.0 and ps.staleness_max == 4


def test_per_gradient_scales_before_averaging():
    lam = 4  # softsync 2: c = 2
    ps = ParameterServer(torch.zeros(P), lam, softsync=2, staleness_lr="per_gradient")
    gen = torch.Generator().manual_seed(7)
    g = [torch.randn(P, generator=gen) for _ in range(6)]
    ps.push(0, g[0], 0, 0.1)
    ps.push(1, g[1], 0, 0.1)  # version 1
    ps.push(2, g[2], 0, 0.1)
    ps.push(3, g[3], 1, 0.1)  # version 2
    before = ps.eval_weights()
    ps.push(0, g[4], 0, 0.1)
    u = ps.push(1, g[5], 2, 0.1)
    assert u.staleness == [2, 0] and u.scales == [0.5, 1.0] and u.lr == 0.1
    expected = before - 0.1 * (0.5 * g[4] + g[5]) / 2
    # One step on O(1) values; different rounding order of the same three float ops.
    torch.testing.assert_close(ps.eval_weights(), expected, rtol=0, atol=1e-7)


# ---- §3 compute groups -----------------------------------------------------------------


def test_compute_groups_one_group_equals_hardsync():
    lam = 4
    kw = dict(momentum=0.9, weight_decay=1e-3)
    cg = ComputeGroups(W0, lam, num_groups=1, **kw)
    hs = HardSync(W0, lam, **kw)
    learners = Learners(cg)
    for t in range(15):
        learners.pull(0)
        u = learners.push(0)  # the mean of the 4 members' gradients at the group's weights
        hs.step(sync_grads(hs, t), lr=0.1)
        assert torch.equal(cg.eval_weights(), hs.eval_weights())  # same mean, same SGD
        assert u.staleness == [0]
    assert cg.members(0) == [0, 1, 2, 3] and cg.explicit_momentum == 0.9


def test_compute_groups_lambda_groups_equals_async_parameter_server():
    lam = 4
    kw = dict(staleness_lr="softsync", momentum=0.5)
    cg = Learners(ComputeGroups(W0, lam, num_groups=lam, **kw))
    ps = Learners(ParameterServer(W0, lam, softsync=lam, **kw))
    round_robin(cg, rounds=5)
    round_robin(ps, rounds=5)
    assert torch.equal(cg.proto.eval_weights(), ps.proto.eval_weights())
    assert cg.updates == ps.updates  # same clocks, staleness and α_eff = α0/g
    assert cg.updates[-1].lr == 0.1 / lam


@pytest.mark.parametrize("g,expected", [(1, 0.9), (2, 0.4), (4, 0.15), (8, 0.025)])
def test_momentum_compensation(g, expected):
    cg = ComputeGroups(W0, 8, g, momentum=0.9, momentum_compensation=True)
    assert cg.explicit_momentum == pytest.approx(expected, abs=1e-12)  # 0.9 - (1 - 1/g)
    assert ComputeGroups(W0, 8, g, momentum=0.9).explicit_momentum == 0.9


def test_momentum_compensation_clamps_at_zero_and_drops_nesterov():
    with pytest.warns(UserWarning, match="nesterov"):
        cg = ComputeGroups(W0, 8, 8, momentum=0.5, momentum_compensation=True, nesterov=True)
    assert cg.explicit_momentum == 0.0 and not cg.server.nesterov


def test_compute_groups_layout():
    cg = ComputeGroups(W0, 6, 3)
    assert [cg.group_of(i) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [cg.members(j) for j in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert cg.num_workers == 3 and cg.group_size == 2


# ---- §4 SMA ----------------------------------------------------------------------------


def test_sma_one_replica_no_correction_equals_sgd():
    sma = SMA(W0, 1, alpha=0.0, central_momentum=0.0, momentum=0.9, weight_decay=1e-3)
    ref = W0.clone()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=1e-3)
    for t in range(20):
        sma.step(sync_grads(sma, t), lr=0.1)
        ref.grad = loss_grad(ref, batch(0, t, 8, 1))
        opt.step()
        assert torch.equal(sma.learner_weights(0), ref)  # c = 0 exactly: same SGD steps
    assert torch.equal(sma.eval_weights(), W0)  # z + 0 + 0·(z - z_prev)


def test_sma_alpha_one_over_k_makes_z_the_mean_of_pre_update_replicas():
    lam = 4
    sma = SMA(W0, lam, alpha=1 / lam, central_momentum=0.0, momentum=0.9)
    for t in range(10):
        pre = sma.replicas.clone()
        sma.step(sync_grads(sma, t), lr=0.2)
        # z + Σ (w_j - z)/4 vs Σ w_j / 4: reordered sums of O(1) values, ~1e-7.
        torch.testing.assert_close(sma.eval_weights(), pre.mean(0), rtol=0, atol=1e-6)
    assert (sma.replicas[0] - sma.replicas[1]).abs().max() > 1e-3  # replicas did diverge


def test_sma_hierarchical_device_sums():
    lam, k = 4, 2
    kw = dict(alpha=0.1, central_momentum=0.9, momentum=0.9)
    whole = SMA(W0, lam, replicas_per_device=k, **kw)
    devices = [SMA(W0, k, replicas_per_device=k, **kw) for _ in range(lam // k)]
    one_device = SMA(W0, lam, replicas_per_device=lam, **kw)
    for t in range(10):
        grads = sync_grads(whole, t)
        sums = whole.local_step(grads, lr=0.1)
        assert sums.shape == (2, P)
        whole.apply_central(sums.sum(0))
        # Two "processes", each with its own k replicas; the all-reduce is a sum of sums.
        dev_sums = [d.local_step(grads[i * k : (i + 1) * k], lr=0.1) for i, d in enumerate(devices)]
        total = torch.cat(dev_sums).sum(0)
        for d in devices:
            d.apply_central(total)
        # Same rows, same sums in the same order: exact.
        assert torch.equal(devices[0].eval_weights(), whole.eval_weights())
        assert torch.equal(devices[1].eval_weights(), whole.eval_weights())
        assert torch.equal(torch.cat([d.replicas for d in devices]), whole.replicas)
        one_device.step(sync_grads(one_device, t), lr=0.1)
        # (c0+c1)+(c2+c3) vs one sum of 4: reordered, ~1e-7 per step, carried by μ_z = 0.9
        # and fed back through the corrections (observed 4e-8): bound 1e-6 over 10 steps.
        torch.testing.assert_close(
            one_device.eval_weights(), whole.eval_weights(), rtol=0, atol=1e-6
        )
    torch.testing.assert_close(
        whole.device_corrections().sum(0),
        0.1 * (whole.replicas - whole.eval_weights()).sum(0),
        rtol=0,
        atol=1e-6,  # reordered sum of 4 values
    )


def test_sma_lr_drop_resets_replicas_to_z():
    sma = SMA(W0, 2, alpha=0.1, central_momentum=0.9, momentum=0.9)
    for t in range(5):
        sma.step(sync_grads(sma, t), lr=0.1)
    sma.step(sync_grads(sma, 5), lr=0.2)  # a rise does not reset
    assert not torch.equal(sma.replicas[0], sma.eval_weights())
    z = sma.eval_weights()
    sma.step(torch.zeros(2, P), lr=0.05)  # drop: replicas ← z, momentum cleared, c = 0
    # With zero gradients and cleared momentum the replicas stay exactly at the old z.
    assert torch.equal(sma.replicas, z.expand(2, P))


def test_sma_lifecycle_errors():
    sma = SMA(W0, 2)
    with pytest.raises(RuntimeError, match="without a preceding local_step"):
        sma.apply_central(torch.zeros(P))
    sma.local_step(torch.zeros(2, P), 0.1)
    with pytest.raises(RuntimeError, match="twice"):
        sma.local_step(torch.zeros(2, P), 0.1)
    with pytest.raises(RuntimeError, match="between"):
        sma.state_dict()


# ---- §5 local SGD ----------------------------------------------------------------------


def test_local_sgd_every_step_equals_hardsync():
    lam = 4
    ls = LocalSGD(W0, lam, average_every=1)
    hs = HardSync(W0, lam)
    for t in range(20):
        ls.step(sync_grads(ls, t), lr=0.2)
        hs.step(sync_grads(hs, t), lr=0.2)
        # mean_j(w - γ g_j) vs w - γ mean_j g_j: reordered, ~1e-7 per step; errors add up
        # over 20 steps (no momentum): bound 1e-6.
        torch.testing.assert_close(ls.eval_weights(), hs.eval_weights(), rtol=0, atol=1e-6)


def test_local_sgd_averaging_makes_replicas_identical():
    lam, h = 3, 3
    ls = LocalSGD(W0, lam, average_every=h, momentum=0.9)
    for t in range(7):
        ls.step(sync_grads(ls, t), lr=0.1)
        identical = all(torch.equal(ls.replicas[0], ls.replicas[i]) for i in range(lam))
        assert identical == ((t + 1) % h == 0)
        if (t + 1) % h == 0:
            assert torch.equal(ls.eval_weights(), ls.replicas[0])
        else:
            assert torch.equal(ls.eval_weights(), ls.replicas.mean(0))


# ---- §6 DiLoCo -------------------------------------------------------------------------


def test_diloco_outer_sgd_lr_one_no_momentum_equals_local_sgd():
    lam, h = 3, 4
    kw = {"average_every": h, "momentum": 0.9}
    dl = DiLoCo(W0, lam, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False, **kw)
    ls = LocalSGD(W0, lam, **kw)
    for t in range(4 * h):
        dl.step(sync_grads(dl, t), lr=0.1)
        ls.step(sync_grads(ls, t), lr=0.1)
        # θ − mean(θ − w_l) vs mean(w_l): float32 rounding only, ~1e-7 per averaging,
        # carried by the replicas' momentum between averagings: bound 1e-6
        torch.testing.assert_close(dl.replicas, ls.replicas, rtol=0, atol=1e-6)
    torch.testing.assert_close(dl.eval_weights(), ls.eval_weights(), rtol=0, atol=1e-6)


def test_diloco_every_step_outer_lr_one_equals_hardsync():
    lam = 4
    dl = DiLoCo(W0, lam, average_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    hs = HardSync(W0, lam)
    for t in range(20):
        dl.step(sync_grads(dl, t), lr=0.2)
        hs.step(sync_grads(hs, t), lr=0.2)
        torch.testing.assert_close(dl.eval_weights(), hs.eval_weights(), rtol=0, atol=1e-6)


def test_diloco_outer_nesterov_step_on_mean_pseudo_gradient():
    """One outer period by hand: Δ = θ − mean w_l; torch's Nesterov SGD on θ (first step:
    buffer b = Δ, θ ← θ − η (Δ + μ b)); every replica becomes θ."""
    lam, h, eta, mu = 2, 3, 0.7, 0.9
    dl = DiLoCo(W0, lam, average_every=h, outer_lr=eta, outer_momentum=mu)
    ls = LocalSGD(W0, lam, average_every=h * 1000)  # the same inner steps, never averaged
    for t in range(h):
        dl.step(sync_grads(dl, t), lr=0.1)
        ls.step(sync_grads(ls, t), lr=0.1)
    delta = W0 - ls.replicas.mean(0)
    expected = W0 - eta * (delta + mu * delta)
    torch.testing.assert_close(dl.eval_weights(), expected, rtol=0, atol=1e-6)
    assert all(torch.equal(dl.learner_weights(i), dl.eval_weights()) for i in range(lam))


def test_diloco_outer_optimizer_factory_and_argument_errors():
    dl = DiLoCo(
        W0,
        2,
        average_every=2,
        outer_lr=0.1,
        outer_momentum=0.0,
        outer_nesterov=False,
        make_outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
    )
    for t in range(4):
        dl.step(sync_grads(dl, t), lr=0.1)
    assert "Adam" in dl.state_dict()["config"]["outer_optimizer"]
    with pytest.raises(ValueError, match="^outer_nesterov"):
        DiLoCo(W0, 2, average_every=2, outer_momentum=0.0)
    with pytest.raises(ValueError, match="^outer_lr"):
        DiLoCo(W0, 2, average_every=2, outer_lr=0.0)
    with pytest.raises(ValueError, match="^outer_momentum"):
        DiLoCo(W0, 2, average_every=2, outer_momentum=1.0)


# ---- state_dict round trip -------------------------------------------------------------


def _check_types(obj) -> None:
    allowed = (torch.Tensor, int, float, str, bool)
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_types(k)
            _check_types(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _check_types(v)
    else:
        assert isinstance(obj, allowed), f"{type(obj).__name__} in state_dict"


def _lr(t: int) -> float:
    return 0.1 if t < 5 else 0.03  # drops right after the save point: SMA resets then


SYNC_FACTORIES: dict[str, Callable] = {
    "hardsync": lambda w: HardSync(w, 3, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "sma": lambda w: SMA(w, 4, replicas_per_device=2, alpha=0.2, momentum=0.9),
    "local_sgd": lambda w: LocalSGD(w, 3, average_every=3, momentum=0.9, weight_decay=1e-3),
    "diloco": lambda w: DiLoCo(w, 3, average_every=2, momentum=0.9),  # t = 4: outer step
}


@pytest.mark.parametrize("name", sorted(SYNC_FACTORIES))
def test_state_dict_roundtrip_sync(name):
    make = SYNC_FACTORIES[name]
    a = make(W0)
    for t in range(5):  # t = 5 is not an averaging step of local SGD (H = 3)
        a.step(sync_grads(a, t), _lr(t))
    state = a.state_dict()
    _check_types(state)
    b = make(torch.zeros(P))
    b.load_state_dict(roundtrip(state))
    assert b.iteration == a.iteration == 5
    for t in range(5, 12):
        a.step(sync_grads(a, t), _lr(t))
        b.step(sync_grads(b, t), _lr(t))
        assert torch.equal(a.eval_weights(), b.eval_weights())
        for i in range(a.num_learners):
            assert torch.equal(a.learner_weights(i), b.learner_weights(i))


ASYNC_FACTORIES: dict[str, Callable] = {
    "ps_barrier": lambda w: ParameterServer(w, 3, 1, barrier=True, momentum=0.9),
    "ps_1softsync_measured": lambda w: ParameterServer(
        w, 4, 1, staleness_lr="measured", momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "ps_2softsync_per_gradient": lambda w: ParameterServer(
        w, 4, 2, staleness_lr="per_gradient", momentum=0.9
    ),
    "ps_async_adagrad": lambda w: ParameterServer(w, 4, 4, optimizer="adagrad"),
    "compute_groups": lambda w: ComputeGroups(
        w, 6, 3, staleness_lr="softsync", momentum=0.9, momentum_compensation=True
    ),
}


def _async_events(proto, count: int, seed: int) -> list[int]:
    """A seeded order of pushes: random permutations per round under a barrier, otherwise
    workers drawn with replacement (so one may push several times in a row)."""
    gen = torch.Generator().manual_seed(seed)
    nw = proto.num_workers
    if getattr(proto, "barrier", False):
        rounds = [torch.randperm(nw, generator=gen).tolist() for _ in range(count // nw + 1)]
        return [w for r in rounds for w in r][:count]
    return torch.randint(0, nw, (count,), generator=gen).tolist()


def _drive_async(learners: Learners, events: list[int]) -> None:
    for w in events:
        learners.push(w, lr=0.1)
        learners.pull_all_waiting()


@pytest.mark.parametrize("name", sorted(ASYNC_FACTORIES))
def test_state_dict_roundtrip_async(name):
    make = ASYNC_FACTORIES[name]
    a = Learners(make(W0))
    events = _async_events(a.proto, 40, seed=3)
    a.pull_all_waiting()
    _drive_async(a, events[:19])  # 19 pushes: mid-buffer for every c > 1 here
    state = a.proto.state_dict()
    _check_types(state)
    b = a.copy(make(torch.zeros(P)))
    b.proto.load_state_dict(roundtrip(state))
    assert b.proto.version == a.proto.version
    _drive_async(a, events[19:])
    _drive_async(b, events[19:])
    assert torch.equal(a.proto.eval_weights(), b.proto.eval_weights())
    assert a.updates[-len(b.updates) :] == b.updates
    assert a.proto.staleness_counts == b.proto.staleness_counts
    assert a.proto.num_gradients == b.proto.num_gradients > 0


def test_state_dict_is_a_snapshot():
    ps = ParameterServer(W0, 1, 1, momentum=0.9)
    ps.push(0, torch.ones(P), 0, 0.1)
    state = ps.state_dict()
    before = state["weights"].clone(), state["optimizer"][0]["momentum_buffer"].clone()
    ps.push(0, torch.ones(P), 1, 0.1)
    assert torch.equal(state["weights"], before[0])
    assert torch.equal(state["optimizer"][0]["momentum_buffer"], before[1])


def test_load_state_dict_rejects_other_protocol_or_configuration():
    state = HardSync(W0, 2).state_dict()
    with pytest.raises(ValueError, match="not a SMA state_dict"):
        SMA(W0, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_learners = 2"):
        HardSync(W0, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="momentum"):
        HardSync(W0, 2, momentum=0.5).load_state_dict(state)


# ---- argument errors -------------------------------------------------------------------

BAD_ARGUMENTS = [
    (lambda: HardSync(W0, 0), "num_learners"),
    (lambda: HardSync(W0.view(8, 8), 1), "initial"),
    (lambda: HardSync([0.0], 1), "initial"),
    (lambda: HardSync(torch.arange(4), 1), "initial"),
    (lambda: HardSync(W0, 1, momentum=1.0), "momentum"),
    (lambda: HardSync(W0, 1, weight_decay=-1e-3), "weight_decay"),
    (lambda: HardSync(W0, 1, nesterov=True), "nesterov"),
    (lambda: ParameterServer(W0, 4, 3), "softsync"),
    (lambda: ParameterServer(W0, 4, 8), "softsync"),
    (lambda: ParameterServer(W0, 4, 0), "softsync"),
    (lambda: ParameterServer(W0, 4, 2, barrier=True), "softsync"),
    (lambda: ParameterServer(W0, 4, 1, barrier=1), "barrier"),
    (lambda: ParameterServer(W0, 4, 1, staleness_lr="fast"), "staleness_lr"),
    (lambda: ParameterServer(W0, 4, 1, optimizer="adam"), "optimizer"),
    (lambda: ParameterServer(W0, 4, 1, optimizer="adagrad", momentum=0.9), "momentum"),
    (lambda: ComputeGroups(W0, 4, 3), "num_groups"),
    (lambda: ComputeGroups(W0, 4, 8), "num_groups"),
    (lambda: ComputeGroups(W0, 4, 2, staleness_lr="x"), "staleness_lr"),
    (lambda: ComputeGroups(W0, 4, 2, momentum_compensation="yes"), "momentum_compensation"),
    (lambda: SMA(W0, 4, replicas_per_device=3), "replicas_per_device"),
    (lambda: SMA(W0, 4, alpha=1.5), "alpha"),
    (lambda: SMA(W0, 4, alpha=float("nan")), "alpha"),
    (lambda: SMA(W0, 4, central_momentum=1.0), "central_momentum"),
    (lambda: LocalSGD(W0, 4, average_every=0), "average_every"),
    (lambda: LocalSGD(W0, 4, average_every=2, momentum=-0.1), "momentum"),
]


@pytest.mark.parametrize("make,argument", BAD_ARGUMENTS)
def test_constructor_argument_errors(make, argument):
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        make()


def test_call_argument_errors():
    hs = HardSync(W0, 2)
    with pytest.raises(ValueError, match="grads"):
        hs.step(torch.zeros(3, P), 0.1)
    with pytest.raises(ValueError, match="grads"):
        hs.step(torch.zeros(2, P, dtype=torch.float64), 0.1)
    with pytest.raises(ValueError, match="lr"):
        hs.step(torch.zeros(2, P), -0.1)
    with pytest.raises(ValueError, match="learner"):
        hs.learner_weights(2)
    ps = ParameterServer(W0, 2, 2)
    with pytest.raises(ValueError, match="version"):
        ps.push(0, torch.zeros(P), 1, 0.1)  # the server is at version 0
    with pytest.raises(ValueError, match="worker"):
        ps.push(2, torch.zeros(P), 0, 0.1)
    with pytest.raises(ValueError, match="grad"):
        ps.push(0, torch.zeros(P + 1), 0, 0.1)
    with pytest.raises(ValueError, match="lr"):
        ps.push(0, torch.zeros(P), 0, math.inf)


# ---- build_protocol --------------------------------------------------------------------


def _cfg(momentum: float = 0.9, **protocol) -> RunConfig:
    return RunConfig(
        protocol=ProtocolConfig(**protocol), optimizer=OptimizerConfig(momentum=momentum)
    )


def test_build_protocol_mapping():
    hs = build_protocol(_cfg(name="hardsync", num_learners=4), W0)
    assert isinstance(hs, HardSync) and hs.num_learners == 4 and hs.momentum == 0.9
    assert isinstance(build_protocol(_cfg(name="plain", num_learners=1), W0), HardSync)

    def ps(mode: str, **kw) -> ParameterServer:
        p = build_protocol(_cfg(name="parameter_server", num_learners=8, mode=mode, **kw), W0)
        assert isinstance(p, ParameterServer)
        return p

    assert (ps("async").softsync, ps("async").barrier) == (8, False)
    assert (ps("hardsync").softsync, ps("hardsync").barrier) == (1, True)
    soft = ps("softsync", softsync=4, staleness_lr="measured")
    assert (soft.softsync, soft.gradients_per_update, soft.staleness_lr) == (4, 2, "measured")
    ada = build_protocol(
        _cfg(0.0, name="parameter_server", num_learners=2, server_optimizer="adagrad"), W0
    )
    assert ada.optimizer == "adagrad"
    with pytest.raises(ConfigError, match="optimizer.momentum"):
        build_protocol(_cfg(name="parameter_server", server_optimizer="adagrad"), W0)

    cg = build_protocol(
        _cfg(name="compute_groups", num_learners=8, num_groups=4, momentum_compensation=True),
        W0,
    )
    assert isinstance(cg, ComputeGroups) and cg.explicit_momentum == pytest.approx(0.15)

    sma = build_protocol(_cfg(name="sma", num_learners=8, replicas_per_device=4, alpha=0.0), W0)
    # α = 0 means 1/λ over all 8 learners (SPEC §4: z becomes the replicas' mean)
    assert isinstance(sma, SMA) and sma.alpha == 0.125 and sma.num_devices == 2
    sma = build_protocol(_cfg(name="sma", num_learners=8, replicas_per_device=4, alpha=0.3), W0)
    assert sma.alpha == 0.3 and sma.central_momentum == 0.9

    ls = build_protocol(_cfg(name="local_sgd", num_learners=4, average_every=5), W0)
    assert isinstance(ls, LocalSGD) and ls.average_every == 5
    dl = build_protocol(_cfg(name="diloco", num_learners=4, average_every=5, outer_lr=0.5), W0)
    assert isinstance(dl, DiLoCo) and (dl.outer_lr, dl.outer_momentum) == (0.5, 0.9)
    assert dl.outer_nesterov
    adam = build_protocol(
        _cfg(name="diloco", outer_optimizer="torch.optim:Adam", outer_lr=0.01), W0
    )
    assert adam._outer_opt.defaults["lr"] == 0.01
    with pytest.raises(ConfigError, match="protocol.outer_optimizer"):
        ProtocolConfig(name="diloco", outer_optimizer="adam")
    with pytest.raises(ConfigError, match="protocol.outer_nesterov"):
        ProtocolConfig(name="diloco", outer_momentum=0.0)


# ---- docstring examples ----------------------------------------------------------------


@pytest.mark.parametrize(
    "module", ["hardsync", "parameter_server", "compute_groups", "sma", "local_sgd", "diloco"]
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"distsgd.protocols.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("cls", ["LocalSGD", "DiLoCo"])
def test_local_step_to_is_a_local_step_taken_outside(cls):
    """A replica set to where a step outside the protocol took it (the drop-in's user
    optimizer) counts the iteration as local_step does, and the period's exchange is the
    one exchange_step names; it refuses a protocol of more than one replica."""
    import distsgd.protocols as protocols

    make = getattr(protocols, cls)
    a, b = make(torch.zeros(3), 1, average_every=2), make(torch.zeros(3), 1, average_every=2)
    g = torch.tensor([[1.0, -2.0, 0.5]])
    assert a.exchange_step(g, 0.1) is None
    assert not b.local_step_to(b.learner_weights(0) - 0.1 * g[0])
    ea, g2 = a.exchange_step(g, 0.1), b.learner_weights(0) - 0.1 * g[0]
    assert b.local_step_to(g2)
    eb = b.period_exchange()
    assert torch.equal(ea.payload, eb.payload)
    ea.apply(ea.reduce_here())
    eb.apply(eb.reduce_here())
    assert torch.equal(a.eval_weights(), b.eval_weights()) and a.iteration == b.iteration == 2
    with pytest.raises(ValueError, match="num_learners = 1"):
        make(torch.zeros(3), 2, average_every=2).local_step_to(torch.zeros(3))
