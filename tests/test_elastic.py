"""Learners that join and leave a running parameter server or compute-group run
(docs/elastic.md): the protocol's admission and staleness, re-sharding, records, resume."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distsgd.config import ClusterConfig, ConfigError, DataConfig, RunConfig
from distsgd.data import ElasticShards, LearnerStream, ShardedSampler, load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.protocols import ComputeGroups, ParameterServer
from distsgd.protocols.backup import BackupHardSync
from distsgd.runtime.sim import DeviceProfile, SimRuntime
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1]

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
    with pytest.raises(RuntimeError, match="fixed membership: it cannot be reset"):
        BackupHardSync(torch.zeros(1), 2, 1).reset_membership(2)


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


# ---- the simulated cluster ----------------------------------------------------------------
PROFILE = DeviceProfile(seconds_per_batch=1e-3, seconds_per_sample=1e-4)  # 1.8 ms per push
MEMBERSHIP = [{"at_s": 0.01, "join": 2}, {"at_s": 0.025, "leave": [1]}]


@pytest.fixture(scope="module")
def dataset():  # 16 steps of λ·b = 16 per epoch at λ = 2
    return load_dataset(DataConfig(dataset="synthetic", num_train=256, num_test=64), seed=0)


def _sim(dataset, membership=MEMBERSHIP, groups=0):
    torch.manual_seed(0)
    engine = GradientEngine(build_model("mlp", dataset.input_shape, dataset.num_classes))
    w = engine.initial_weights()
    lam = 2 * groups or 2
    proto = ComputeGroups(w, lam, groups) if groups else ParameterServer(w, 2, 2, momentum=0.9)
    cluster = ClusterConfig(seconds_per_sample=1e-4, seconds_per_batch=1e-3, membership=membership)
    return SimRuntime(
        proto, engine, dataset, batch_size=8, num_learners=lam, profile=PROFILE, cluster=cluster
    )


def _ticks(rt, n):
    ticks = [rt.advance(0.05) for _ in range(n)]
    return [u.clock[0][0] for t in ticks for u in [t.update]], [
        r for t in ticks for r in t.membership
    ]


def test_sim_joiners_push_leavers_stop_and_no_sample_is_drawn_twice(dataset, monkeypatch):
    drawn: dict[int, list[int]] = {}
    next_indices = LearnerStream.next_indices

    def record(stream):
        epoch = stream.epoch
        idx = next_indices(stream)
        drawn.setdefault(epoch, []).extend(idx.tolist())
        return idx

    monkeypatch.setattr(LearnerStream, "next_indices", record)
    rt = _sim(dataset)
    pushers, records = _ticks(rt, 80)
    assert [(r["event"], r["worker"], r["time_s"]) for r in records] == [
        ("join", 2, 0.01),
        ("join", 3, 0.01),
        ("leave", 1, 0.025),
    ]
    assert records[2]["active_workers"] == [0, 2, 3] and records[0]["ranks"] == [3]
    joined = pushers.index(2)
    assert 3 in pushers[joined:] and rt.protocol.version == 80
    left = max(i for i, w in enumerate(pushers) if w == 1)
    assert {0, 2, 3} <= set(pushers[left + 1 :])  # the others go on, 1 never again
    assert len(drawn) >= 3  # three epochs at least, each without a sample twice
    assert all(len(set(idx)) == len(idx) for idx in drawn.values())


def test_sim_compute_group_joins_and_leaves_as_a_whole(dataset):
    rt = _sim(dataset, [{"at_s": 0.01, "join": 1}, {"at_s": 0.02, "leave": [0]}], groups=2)
    ticks = [rt.advance(0.05) for _ in range(30)]
    records = [r for t in ticks for r in t.membership]
    assert [(r["event"], r["worker"], r["learners"]) for r in records] == [
        ("join", 2, [4, 5]),
        ("leave", 0, [0, 1]),
    ]
    left = next(
        i for i, t in enumerate(ticks) if t.membership and t.membership[0]["event"] == "leave"
    )
    after = [t.update.clock[0][0] for t in ticks[left:]]
    assert set(after) == {1, 2} and rt.protocol.members(2) == [4, 5]


@pytest.mark.parametrize("split", [20, 50])  # after the join; after the leave
def test_sim_resume_after_a_membership_change_gives_the_same_weights(dataset, split):
    whole = _sim(dataset)
    pushers, records = _ticks(whole, 70)
    first = _sim(dataset)
    p1, r1 = _ticks(first, split)
    state = (first.protocol.state_dict(), first.state_dict())
    resumed = _sim(dataset)
    resumed.protocol.load_state_dict(state[0])
    resumed.load_state_dict(state[1])
    p2, r2 = _ticks(resumed, 70 - split)
    assert (p1 + p2, r1 + r2) == (pushers, records)
    assert torch.equal(resumed.eval_weights(), whole.eval_weights())


def test_membership_settings_are_checked():
    base = {"runtime": "sim", "protocol": {"name": "parameter_server", "mode": "async"}}

    def config(membership, **protocol):
        raw = {**base, "cluster": {"membership": membership}}
        raw["protocol"] = {**raw["protocol"], **protocol}
        return RunConfig.from_dict(raw)

    assert config(MEMBERSHIP, num_learners=2).cluster.membership == MEMBERSHIP
    with pytest.raises(ConfigError, match=r"cluster.membership\[1\].at_s = 0.005"):
        config([{"at_s": 0.01, "join": 1}, {"at_s": 0.005, "join": 1}])
    with pytest.raises(ConfigError, match=r"membership\[0\].leave = \[5\].*active workers"):
        config([{"at_s": 0.01, "leave": [5]}], num_learners=2)
    with pytest.raises(ConfigError, match="synchronous protocol"):
        config(MEMBERSHIP, mode="hardsync", num_learners=2)
    # the joins are bounded as num_learners is: 65536 workers in all
    with pytest.raises(ConfigError, match=r"membership\[0\].join = 100000 .*<= 65536"):
        config([{"at_s": 0.0, "join": 100000}], num_learners=2)
    with pytest.raises(ConfigError, match=r"membership\[1\].join = 6000 .*at most 5534"):
        config([{"at_s": 0.0, "join": 60000}, {"at_s": 1.0, "join": 6000}], num_learners=2)
    with pytest.raises(ConfigError, match="synchronous protocol"):
        RunConfig.from_dict({"runtime": "sim", "cluster": {"membership": MEMBERSHIP}})


def test_schedule_over_the_training_set_is_refused_before_training(tmp_path):
    """2 learners of b = 16 fit in 40 samples, the 4 that a join of 2 makes do not: the
    run is refused before it trains (no run directory), naming the schedule."""
    import distsgd

    cfg = small_config(
        data={"num_train": 40},
        protocol={"name": "parameter_server", "mode": "async", "num_learners": 2, "batch_size": 16},
        cluster={"membership": MEMBERSHIP},
    )
    with pytest.raises(ConfigError, match=r"^cluster.membership = .*reaches 4 learners"):
        distsgd.train(cfg, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_run_directory_records_the_changes_and_resumes_across_them(tmp_path):
    import distsgd
    from distsgd.metrics import read_metrics
    from tests.conftest import small_config

    protocol = {"name": "parameter_server", "num_learners": 2, "mode": "async"}
    cluster = {"membership": [{"at_s": 0.02, "join": 2}, {"at_s": 0.06, "leave": [1]}]}
    distsgd.train(small_config(protocol=protocol, cluster=cluster), out_dir=tmp_path / "full")
    half = small_config(protocol=protocol, cluster=cluster, train={"max_epochs": 1})
    distsgd.train(half, out_dir=tmp_path / "half")
    distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=2"])
    full = (tmp_path / "full" / "membership.jsonl").read_text().splitlines()
    assert [json.loads(r)["event"] for r in full] == ["join", "join", "leave"]
    assert (tmp_path / "half" / "membership.jsonl").read_text().splitlines() == full
    mf = read_metrics(tmp_path / "full" / "metrics.jsonl")
    mh = read_metrics(tmp_path / "half" / "metrics.jsonl")
    assert [r["eval_loss"] for r in mh] == [r["eval_loss"] for r in mf]


def _serve_draws(actions, num_learners=3, drawn=None):
    """Replay a parameter server's sends with :class:`ElasticShards`: ``w`` = the server
    sends worker w weights (it takes the position they carry, then draws), ``"join"``,
    ``("leave", w)``. Returns the shards, each worker's stream and every draw as
    ``(worker, epoch, indices)``."""
    sampler = ShardedSampler(120, num_learners, 5, seed=3)  # 8 steps of 15 per epoch
    drawn = drawn or [0] * num_learners
    shards = ElasticShards(sampler, drawn)
    streams = {w: LearnerStream(sampler, w) for w in range(num_learners)}
    for w, d in enumerate(drawn):
        streams[w].epoch, streams[w].step = divmod(d, sampler.steps_per_epoch)
    active, pending, draws = list(range(num_learners)), {}, []
    for a in actions:
        if a == "join" or isinstance(a, tuple):
            if a == "join":
                active.append(max(streams) + 1)
                streams[active[-1]] = None
            else:
                active.remove(a[1])
                streams.pop(a[1])
            pending.update(shards.reshard(active))
            continue
        if a in pending:
            lam, slot, epoch, step = pending.pop(a)
            streams[a] = LearnerStream(ShardedSampler(120, lam, 5, seed=3), slot)
            streams[a].epoch, streams[a].step = epoch, step
        shards.draw(a)
        epoch = streams[a].epoch
        draws.append((a, epoch, streams[a].next_indices().tolist()))
    return shards, streams, draws


def _no_index_twice_per_epoch(draws):
    by_epoch = {}
    for _, epoch, idx in draws:
        by_epoch.setdefault(epoch, []).extend(idx)
    for epoch, idx in by_epoch.items():
        assert len(idx) == len(set(idx)), f"epoch {epoch} draws a sample twice"


def test_reshard_on_join_and_leave_draws_no_sample_twice_per_epoch():
    # learners at different positions (the server counts the minibatch in flight), a
    # joiner, a leaver, into the next epoch
    order = [0, 1, 2, 0, 0, 1, "join", 3, 2, 0, 1, 3, ("leave", 1), 0, 2, 3] + [0, 2, 3] * 8
    shards, streams, draws = _serve_draws(order, drawn=[3, 1, 2])
    _no_index_twice_per_epoch(draws)
    assert {w for w, e, _ in draws if e == 1} == {0, 2, 3}  # the run reached epoch 1
    for w, st in shards.streams.items():  # the server's view is where each learner is
        assert (st.epoch, st.step, st.learner) == (
            streams[w].epoch,
            streams[w].step,
            streams[w].learner,
        )


def test_a_leavers_remaining_shard_is_taken_over():
    sampler = ShardedSampler(120, 3, 5, seed=3)
    order = [0, 1, 2, 0, 1, 2, ("leave", 1)] + [0, 2] * 9  # 2 steps each, then λ = 2
    _, _, draws = _serve_draws(order)
    _no_index_twice_per_epoch(draws)
    left = {i for s in range(2, 8) for i in sampler.batch_indices(1, 0, s).tolist()}
    survivors = {i for w, e, idx in draws if e == 0 and w != 1 for i in idx}
    assert left and left <= survivors
    # a joiner's draws are its own shard
    _, _, draws = _serve_draws([0, 1, 2, "join", 3, 0, 1, 2, 3])
    _no_index_twice_per_epoch(draws)
    assert len(draws[3][2]) == 5 and draws[3][0] == 3


def test_resume_reshards_the_launched_learners_from_the_saved_positions():
    shards, _, draws = _serve_draws([0, 1, 2, "join", 3, 0, ("leave", 1), 2, 3, 0, 3])
    again = ElasticShards.at(120, 5, 3, shards.positions())  # from a checkpoint
    assert again.positions() == shards.positions()
    for w, (lam, slot, epoch, step) in again.reshard([0, 1, 2]).items():
        st = LearnerStream(ShardedSampler(120, lam, 5, seed=3), slot)
        st.epoch, st.step = epoch, step
        draws += [(w, st.epoch, st.next_indices().tolist()) for _ in range(3)]
    _no_index_twice_per_epoch(draws)


ASYNC_DIST = {"name": "parameter_server", "num_learners": 2, "mode": "async", "batch_size": 16}


def _dist_config(protocol, **train):
    t = {"max_epochs": 1000, "eval_every_samples": 2048, "tensorboard": False, **train}
    return small_config(protocol=protocol, train=t, runtime="dist", dist={"timeout_s": 20.0})


@pytest.mark.slow
def test_a_learner_joins_a_running_dist_run(tmp_path):
    """``distsgd join RUN_DIR`` into an async dist run of 2 learners: it is admitted as
    worker 2 (membership.jsonl), its pushes are applied, both commands end well."""
    out, config = tmp_path / "run", tmp_path / "run.toml"
    config.write_text(_dist_config(ASYNC_DIST, max_seconds=12.0).to_toml())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "distsgd", "train", str(config), "--out", str(out), "--quiet"]
    run = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    # the joiner imports the commands (torch) meanwhile and joins as soon as the run has
    # join.json
    joiner_code = (
        "import sys, time, pathlib; import distsgd.commands; from distsgd.cli import main\n"
        f"p = pathlib.Path({str(out / 'join.json')!r})\n"
        "while not p.exists(): time.sleep(0.05)\n"
        f"sys.exit(main(['join', {str(out)!r}]))"
    )
    joiner = subprocess.Popen(
        [sys.executable, "-c", joiner_code], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        _, run_err = run.communicate(timeout=120)
        _, join_err = joiner.communicate(timeout=60)
    finally:
        for p in (run, joiner):
            p.kill()
    assert run.returncode == 0, run_err
    assert joiner.returncode == 0 and "gradients computed" in join_err, join_err
    records = [json.loads(x) for x in (out / "membership.jsonl").open()]
    assert [(r["event"], r["worker"], r["active_workers"]) for r in records] == [
        ("join", 2, [0, 1, 2])
    ]
    pushes = torch.load(out / "checkpoint.pt", weights_only=True)["runtime"]["pushes"]
    assert len(pushes) == 3 and pushes[2] > 0  # the joiner's pushes were applied
    # the joiner's first gradient: σ counts from the version it pulled at admission
    pulled, applied, sigma = json.loads((out / "summary.json").read_text())["first_pushes"]["2"]
    assert pulled == records[0]["version"] > 0 and sigma == applied - pulled < applied


def test_join_refuses_what_it_cannot_join_in_one_line(tmp_path, capsys):
    from distsgd.cli import main

    assert main(["join", str(tmp_path / "missing")]) == 2
    assert "the directory does not exist" in capsys.readouterr().err
    assert main(["join", str(tmp_path)]) == 2
    assert "has no config.toml" in capsys.readouterr().err
    hardsync = {**ASYNC_DIST, "mode": "hardsync"}
    (tmp_path / "config.toml").write_text(_dist_config(hardsync, max_seconds=1.0).to_toml())
    assert main(["join", str(tmp_path)]) == 2
    assert "protocol.mode = 'hardsync'" in capsys.readouterr().err
    (tmp_path / "config.toml").write_text(_dist_config(ASYNC_DIST, max_seconds=1.0).to_toml())
    assert main(["join", str(tmp_path)]) == 2
    assert "no readable join.json" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on: the run has ended
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = {"master_addr": "127.0.0.1", "master_port": port, "restart": "0", "run": ""}
    (tmp_path / "join.json").write_text(json.dumps(info))
    assert main(["join", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not answer" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "summary.json").write_text("{}")  # written after join.json: it ended
    assert main(["join", str(tmp_path)]) == 2
    assert "the run has ended" in capsys.readouterr().err


def test_dist_resume_after_a_join_reshards_the_launched_learners():
    """PSDistRuntime.load_state_dict of a checkpoint taken after a join: the protocol's
    membership is the launched learners again, re-sharded from the saved positions."""
    from types import SimpleNamespace

    from distsgd.runtime.dist import PSDistRuntime

    ps = ParameterServer(torch.zeros(3), num_learners=2, softsync=2)
    shards, _, draws = _serve_draws([0, 1, 0, "join", 2, 1, 2, 0], num_learners=2)
    assert ps.admit() == 2
    state = {"world_size": 3, "samples": 35, "virtual_time": 1.0, "pushes": [3, 2, 2]}
    state["data_positions"] = {str(w): list(p) for w, p in shards.positions().items()}
    state["first_pushes"] = [{"0": [0, 0, 0], "2": [5, 6, 1]}]
    protocol_state = ps.state_dict()
    rt = PSDistRuntime.__new__(PSDistRuntime)  # the coordinator's state, no process group
    rt.__dict__.update(_membership=[], first_pushes={})
    cfg = SimpleNamespace(train=SimpleNamespace(seed=3))
    rt.__dict__.update(world_size=3, num_servers=1, num_computing=2, batch_size=5, rank=0)
    rt.__dict__.update(cfg=cfg, dataset=SimpleNamespace(num_train=120), shards=shards)
    rt.protocol = ParameterServer(torch.zeros(3), num_learners=2, softsync=2)
    rt.protocol.load_state_dict(protocol_state)
    assert rt.protocol.active_workers == [0, 1, 2]
    rt.load_state_dict(state)
    assert rt.protocol.active_workers == [0, 1] and rt.protocol.num_workers == 2
    positions = rt.shards.positions()
    assert sorted(positions) == [0, 1] and {p[0] for p in positions.values()} == {2}
    for w, (lam, slot, epoch, step) in positions.items():
        st = LearnerStream(ShardedSampler(120, lam, 5, seed=3), slot)
        st.epoch, st.step = epoch, step
        draws += [(w, st.epoch, st.next_indices().tolist()) for _ in range(3)]
    _no_index_twice_per_epoch(draws)
    assert rt.protocol.admit() == 2  # a joiner joins again with the next index
    # worker 2 is a new joiner: a resume record marks where the indices restart, and the
    # first gradients of before the resume are kept apart
    (resume,) = rt.late_membership()
    assert resume["event"] == "resume" and resume["active_workers"] == [0, 1]
    assert rt.pushes == [3, 2] and rt.first_pushes_before == state["first_pushes"]


def test_reset_membership_restores_the_launched_learners():
    ps = ParameterServer(torch.zeros(2), num_learners=2, softsync=1, staleness_lr="softsync")
    ps.admit()
    ps.retire(0)
    assert ps.push(1, torch.ones(2), 0, lr=0.6) is None  # c = λ = 2 (workers 1, 2)
    ps.reset_membership(2)
    assert ps.active_workers == [0, 1] and ps.gradients_per_update == 2
    u = ps.push(0, torch.ones(2), 0, lr=0.6)  # the buffered gradient is applied with it
    assert u.clock == [(1, 0), (0, 0)] and u.lr == pytest.approx(0.6)
    with pytest.raises(ValueError, match="num_workers = 4"):
        ps.reset_membership(4)


def _coordinator(protocol, worker_ranks, elastic=True):
    """A PSDistRuntime's coordinator state without a process group (its records)."""
    from distsgd.runtime.dist import PSDistRuntime

    rt = PSDistRuntime.__new__(PSDistRuntime)
    rt.__dict__.update(protocol=protocol, worker_ranks=worker_ranks, elastic=elastic)
    rt.__dict__.update(virtual_time=1.0, _membership=[], _lost=set(), _closing=False)
    rt.__dict__.update(_thread=None, first_pushes={}, first_pushes_before=[], pushes=[0, 0])
    return rt


def test_a_joiner_that_would_exceed_the_training_set_is_refused_in_one_line():
    """40 samples, b = 16, 2 learners: the server refuses a third (48 > 40) on its channel,
    its protocol and shards untouched; the joiner's learner raises JoinRefused."""
    import threading

    import torch.distributed as dist

    from distsgd.runtime import ps
    from distsgd.runtime.dist import join_refusal
    from distsgd.runtime.ps.server import _ServerLoop

    store, links = dist.HashStore(), {}

    def connect(rank):
        links[rank] = ps.join_channel(store, "j/", rank, 10.0)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop = _ServerLoop.__new__(_ServerLoop)
    log = []
    shards = ElasticShards(ShardedSampler(40, 2, 16, seed=0), [0, 0])
    protocol = ParameterServer(torch.zeros(3), num_learners=2, softsync=1)
    loop.__dict__.update(stopping=False, protocol=protocol, shards=shards, log=log.append)
    loop.timeout_s = 5.0
    server = threading.Thread(target=loop.admit, args=(links[0],))
    server.start()  # its reply completes once the joiner receives it
    layout = ps.PSLayout(server_ranks=[0], worker_groups=[[1]])
    with pytest.raises(ps.JoinRefused) as refused:
        ps.run_learner(
            layout, 1, compute=None, group=None, num_samples=16, timeout_s=5.0, links={0: links[1]}
        )
    server.join()
    assert protocol.active_workers == [0, 1] and sorted(shards.positions()) == [0, 1]
    assert "3 learners would exceed 40 samples" in log[0]
    assert join_refusal(16, refused.value) == (
        "cannot join: protocol.batch_size = 16 × 3 learners = 48 samples per step would "
        "exceed the 40 training samples"
    )


def test_no_lost_records_for_the_runs_own_stop():
    """A learner the server loses while the run stops on its own (it did not take its
    STOP) is lost; an interrupt drops the lost records not yet written and records no
    more (the learners got it too)."""
    from distsgd.runtime.ps.server import ServerResult, _ServerLoop

    lost = []
    loop = _ServerLoop.__new__(_ServerLoop)
    loop.__dict__.update(stopping=True, sending={}, live={0, 1}, waiting=[], leaders=[1, 2])
    loop.__dict__.update(result=ServerResult(), log=lambda m: None, rank=0, shards=None)
    loop.__dict__.update(
        protocol=ParameterServer(torch.zeros(1), 2, softsync=1), on_lost=lost.append
    )
    loop.__dict__.update(gather_target=None, barrier=False)
    loop.lose(0, "Connection closed by peer")
    assert lost == [0] and loop.result.lost_ranks == [1]
    rt = _coordinator(ParameterServer(torch.zeros(1), 2, softsync=1), [[1], [2]])
    rt._on_lost(0)
    rt._stop_recording(interrupted=True)
    rt._on_lost(1)
    assert rt.late_membership() == []
    rt = _coordinator(ParameterServer(torch.zeros(1), 2, softsync=1), [[1], [2]])
    rt._on_lost(0)
    rt._stop_recording(interrupted=False)  # a run stopping on its own: both kept
    rt._on_lost(1)
    assert [(r["event"], r["worker"]) for r in rt.late_membership()] == [("lost", 0), ("lost", 1)]


def test_a_receive_error_of_any_kind_is_handed_over():
    """A receive that raises something else than RuntimeError (here: no process group)
    ends the receiver thread with the error in the server's queue, no thread traceback."""
    import queue

    from distsgd.runtime.ps.transport import _Receiver

    out = queue.Queue()
    receiver = _Receiver(0, 1, object(), 1.0, out)
    receiver.start()
    receiver.arm()
    worker, header, _, error = out.get(timeout=10)
    receiver.join(5)
    assert worker == 0 and header is None and error is not None and not receiver.is_alive()


def test_lost_records_of_a_fixed_membership_have_the_elastic_fields():
    """Hardsync with a backup learner: its lost record has active_workers (without the
    lost worker) and gradients_per_update, as the elastic parameter server's records."""
    rt = _coordinator(BackupHardSync(torch.zeros(1), 2, 1), [[1], [2], [3]], elastic=False)
    rt._on_lost(2)
    elastic = _coordinator(ParameterServer(torch.zeros(1), 3, softsync=1), [[1], [2], [3]])
    elastic._on_lost(2)
    (record,), (expected,) = rt.late_membership(), elastic.late_membership()
    assert record.keys() == expected.keys() and record["active_workers"] == [0, 1]
    assert record["gradients_per_update"] == 2  # λ gradients per update
