"""Learners that join and leave a running parameter server or compute-group run
(docs/elastic.md): the protocol's admission and staleness, re-sharding, records, resume."""

import pytest
import torch

from distsgd.protocols import ComputeGroups, ParameterServer
from distsgd.runtime.sim import DeviceProfile

PROFILE = DeviceProfile(seconds_per_batch=1e-3, seconds_per_sample=1e-4)  # 1.8 ms per push


def test_joiner_staleness_counts_from_the_version_it_pulled():
    ps = ParameterServer(torch.zeros(2), num_learners=2, softsync=2, staleness_lr="softsync")
    g = torch.ones(2)
    v0, v1 = ps.pull(0)[1], ps.pull(1)[1]
    assert ps.push(0, g, v0, lr=0.6).lr == pytest.approx(0.3)  # α0/λ, λ = 2
    joiner = ps.admit()
    assert joiner == 2 and ps.active_workers == [0, 1, 2]
    w2, v2 = ps.pull(joiner)
    assert v2 == 1 and torch.equal(w2, torch.full((2,), -0.3))
    u = ps.push(1, g, v1, lr=0.6)  # pulled 0, applied to version 1
    assert (u.staleness, u.lr) == ([1], pytest.approx(0.2))  # α0/λ, λ = 3 now
    v0 = ps.pull(0)[1]
    ps.push(0, g, v0, lr=0.6)  # pulled 2, applied to 2
    u = ps.push(joiner, g, v2, lr=0.6)  # pulled 1, applied to 3: σ = 2, not 3
    assert u.clock == [(2, 1)] and u.staleness == [2]
    ps.retire(1)
    with pytest.raises(ValueError, match="has left"):
        ps.push(1, g, 2, lr=0.6)
    assert ps.push(0, g, ps.pull(0)[1], lr=0.6).lr == pytest.approx(0.3)  # λ = 2 again
    assert ps.staleness_counts == {0: 3, 1: 1, 2: 1}


def test_one_softsync_refits_c_to_the_learners_present():
    ps = ParameterServer(torch.zeros(1), num_learners=2, softsync=1)
    assert ps.push(0, torch.ones(1), 0, lr=1.0) is None
    ps.admit()  # c = λ = 3
    assert ps.push(1, torch.ones(1), 0, lr=1.0) is None
    ps.retire(1)  # c = 2: its buffered gradient stays and is applied with the next push
    u = ps.push(2, torch.ones(1), 0, lr=1.0)
    assert u.clock == [(0, 0), (1, 0), (2, 0)] and ps.gradients_per_update == 2


def test_fixed_membership_is_refused():
    with pytest.raises(RuntimeError, match="hardsync barrier"):
        ParameterServer(torch.zeros(1), 2, 1, barrier=True).admit()
    with pytest.raises(RuntimeError, match="last learner"):
        ParameterServer(torch.zeros(1), 1, 1).retire(0)


def test_compute_group_joins_as_a_whole():
    cg = ComputeGroups(torch.zeros(1), num_learners=4, num_groups=2)
    assert cg.admit() == 2 and cg.members(2) == [4, 5] and cg.active_workers == [0, 1, 2]
    cg.retire(0)
    assert cg.active_workers == [1, 2]


# a push order with a join (learner 2) and a leave (learner 1); the step after the split
# at 7 finds learner 0's gradient buffered (c = 2 at λ = 2)
ACTIONS = [0, 1, 0, "join", 2, 1, 0, "leave 1", 2, 0, 2, 0, 2]


def _run(ps, actions, pulled, start=0):
    """Apply ``actions`` (a worker pushes a gradient seeded by its position ``i`` in
    :data:`ACTIONS`, then pulls; join; leave)."""
    for i, a in enumerate(actions, start):
        if a == "join":
            w = ps.admit()
            pulled[w] = ps.pull(w)[1]
        elif a == "leave 1":
            ps.retire(1)
        else:
            g = torch.randn(3, generator=torch.Generator().manual_seed(i))
            ps.push(a, g, pulled[a], lr=0.1)
            pulled[a] = ps.pull(a)[1]


def test_resume_after_a_membership_change_gives_the_same_weights():
    def make():
        return ParameterServer(torch.zeros(3), 2, 1, momentum=0.9, staleness_lr="softsync")

    whole, first = make(), make()
    _run(whole, ACTIONS, {0: 0, 1: 0})
    pulled = {0: 0, 1: 0}
    _run(first, ACTIONS[:8], pulled)
    assert first.active_workers == [0, 2] and first.num_buffered == 1
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    _run(resumed, ACTIONS[8:], pulled, start=8)
    assert torch.equal(resumed.eval_weights(), whole.eval_weights())
    assert resumed.staleness_counts == whole.staleness_counts
