"""Hardsync's backup learners and the simulated cluster's stragglers (slow devices, stalls)."""

import json

import pytest
import torch

import distsgd
import distsgd.torch
from distsgd.config import ConfigError, required_processes
from distsgd.data import LearnerStream, ShardedSampler, load_dataset
from distsgd.layout import spec_for
from distsgd.protocols import BackupHardSync, HardSync

from .conftest import simulated_runtime, small_config

NO_NETWORK = {"jitter": 0.0, "latency_s": 0.0, "bandwidth_gbps": 0.0}


def advance(cfg, ticks=3, lr=0.05):
    rt, engine = simulated_runtime(cfg)
    times = []
    for _ in range(ticks):
        rt.advance(lr)
        times.append(rt.clock_s)
    return rt, engine, times


def test_first_arrivals_keeps_the_first_lambda():
    p = HardSync(torch.zeros(3), num_learners=2, backup_learners=2)
    assert p.first_arrivals([3, 0, 2, 1]) == [0, 3]
    with pytest.raises(ValueError, match="order"):
        p.first_arrivals([0, 1, 2])


def test_zero_backups_is_hardsync_bit_for_bit():
    cfg = {"protocol": {"num_learners": 2}, "cluster": {"jitter": 0.3}}
    plain, _, t0 = advance(small_config(**cfg))
    cfg["protocol"]["backup_learners"] = 0
    zero, _, t1 = advance(small_config(**cfg))
    assert torch.equal(plain.eval_weights(), zero.eval_weights()) and t0 == t1
    assert zero.dropped_gradients == 0
    # its checkpoint is a plain HardSync's
    HardSync(torch.zeros(plain.engine.num_parameters), 2, momentum=0.9).load_state_dict(
        zero.protocol.state_dict()
    )


def until_version(rt, version, lr=0.05):
    """Advance a served run push by push until the server reaches ``version``; the
    clock after each push."""
    times = []
    while rt.protocol.version < version:
        rt.advance(lr)
        times.append(rt.clock_s)
    return times


def test_backups_average_exactly_the_first_lambda_gradients():
    # learner 0 is 2× slower, so learners 1 and 2 always arrive first
    cfg = small_config(
        protocol={"num_learners": 2, "backup_learners": 1, "batch_size": 16},
        optimizer={"momentum": 0.0},
        cluster={"speed_factors": [0.5, 1.0, 1.0], "jitter": 0.0},
    )
    rt, engine = simulated_runtime(cfg)
    assert isinstance(rt.protocol, BackupHardSync)  # the form runtime dist serves
    ref = HardSync(rt.protocol.eval_weights(), 2)
    until_version(rt, 3)
    assert rt.dropped_gradients == rt.protocol.dropped_gradients >= 1
    assert rt.samples == 3 * 2 * 16  # a dropped push counts no samples
    ds = load_dataset(cfg.data, seed=0)
    sampler = ShardedSampler(ds.num_train, 3, 16, cfg.train.seed)
    streams = [LearnerStream(sampler, i) for i in range(3)]
    for _ in range(3):
        w = ref.learner_weights(0)
        grads = [engine.gradient(w, *ds.train.batch(streams[m].next_indices()))[0] for m in (1, 2)]
        ref.apply_mean_gradient(torch.stack(grads).mean(0), 0.05)
    assert torch.allclose(rt.eval_weights(), ref.eval_weights(), atol=1e-6)


def test_a_slow_learner_doubles_the_step_and_a_backup_hides_it():
    def step_s(speeds, backups=0):
        protocol = {"num_learners": 2, "backup_learners": backups}
        cfg = small_config(protocol=protocol, cluster={**NO_NETWORK, "speed_factors": speeds})
        if backups:
            return until_version(simulated_runtime(cfg)[0], 2)[-1]
        return advance(cfg, ticks=2)[2][-1]

    even = step_s([1.0, 1.0])
    assert step_s([0.5, 1.0]) == pytest.approx(2 * even, rel=1e-12)
    assert step_s([0.5, 1.0, 1.0], backups=1) == pytest.approx(even, rel=1e-12)


def test_a_backup_iteration_is_charged_as_served():
    """λ = 2, β = 1, learner 0 2× slower, no jitter: the served form's clock, push by push.
    Fast learners (compute t) push together; each push crosses a message m each way and
    the server serves them one at a time, s each: a step every T = 2m + t + 2s. The slow
    learner (2t) is not restarted by the step: it finishes its stale gradient, which is
    served (s) and dropped (no samples), and only then pulls the new weights."""
    cluster = {"latency_s": 2e-3, "seconds_per_push": 1e-3, "speed_factors": [0.5, 1.0, 1.0]}
    cfg = small_config(
        protocol={"num_learners": 2, "backup_learners": 1}, cluster={**cluster, "jitter": 0.0}
    )
    rt, _ = simulated_runtime(cfg)
    m, t, s, b = rt.message_s, 1e-3 + 32 * 1e-4, 1e-3, 32
    assert t < 2 * m + 2 * s and 3 * s < 2 * t  # the slow pushes land between two rounds
    step = 2 * m + t + 2 * s
    slow = [2 * m + 2 * t + s, 4 * m + 4 * t + 2 * s]  # served; restarts after each
    expected = [step - s, step, slow[0], 2 * step - s, 2 * step, slow[1], 3 * step - s, 3 * step]
    ticks, clock = [], []
    for _ in range(8):
        ticks.append(rt.advance(0.05))
        clock.append(rt.clock_s)
    assert clock == pytest.approx(expected, rel=1e-12)
    assert [tk.samples for tk in ticks] == [b, b, 0, b, b, 0, b, b]
    assert rt.dropped_gradients == 2 and rt.protocol.version == 3
    assert rt.bytes_sent == 8 * 2 * 4 * rt.engine.num_parameters  # a push and a reply each


def test_stalls_are_seeded():
    def times(seed):
        cluster = {**NO_NETWORK, "stall_probability": 0.3, "stall_seconds": 0.01}
        cfg = small_config(protocol={"num_learners": 2}, cluster=cluster, train={"seed": seed})
        return advance(cfg, ticks=6)[2]

    first = times(1)
    assert first == times(1)
    assert first != times(2)
    steps = [b - a for a, b in zip([0.0] + first, first, strict=False)]
    assert max(steps) > min(steps)  # some steps stalled, some not


def test_backups_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match="protocol.backup_learners"):
        small_config(protocol={"name": "sma", "num_learners": 2, "backup_learners": 1})
    with pytest.raises(ConfigError, match="protocol.compression.*'none'"):
        small_config(
            runtime="dist",
            protocol={"num_learners": 2, "backup_learners": 1, "compression": "bf16"},
        )
    cfg = small_config(protocol={"num_learners": 2, "backup_learners": 1})
    with pytest.raises(ConfigError, match="protocol.backup_learners = 1 .*drop-in"):
        distsgd.torch.init(config=cfg)
    with pytest.raises(ConfigError, match="cluster.speed_factors.*3 speeds"):
        small_config(
            protocol={"num_learners": 2, "backup_learners": 1},
            cluster={"speed_factors": [1.0, 1.0]},
        )


def test_backups_and_stalls_resume_bit_for_bit():
    cluster = {"stall_probability": 0.3, "stall_seconds": 0.01, "jitter": 0.2}
    cfg = small_config(protocol={"num_learners": 2, "backup_learners": 1}, cluster=cluster)
    a, _, _ = advance(cfg, ticks=9)  # pushes: about 3 steps, a gradient dropped each
    state = {"rt": a.state_dict(), "p": a.protocol.state_dict()}
    for _ in range(9):
        a.advance(0.05)
    b, _ = simulated_runtime(cfg)
    b.protocol.load_state_dict(state["p"])
    b.load_state_dict(state["rt"])
    for _ in range(9):
        b.advance(0.05)
    assert torch.equal(a.eval_weights(), b.eval_weights())
    assert a.clock_s == b.clock_s and a.protocol.version == b.protocol.version
    assert a.dropped_gradients == b.dropped_gradients > state["rt"]["dropped_gradients"] > 0


def test_the_run_records_count_the_dropped_gradients(tmp_path):
    cfg = small_config(protocol={"num_learners": 2, "backup_learners": 1})
    summary = distsgd.train(cfg, out_dir=tmp_path / "run")
    # even speeds: about one of the three pushes of each step comes late
    assert 0.5 * summary["iterations"] < summary["dropped_gradients"] <= summary["iterations"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["dropped_gradients"] == summary["dropped_gradients"]
    counts = json.loads((tmp_path / "run" / "staleness.json").read_text())["counts"]
    assert counts == {"0": 2 * summary["iterations"]}  # λ = 2 gradients a step, none stale


def test_backups_on_dist_add_one_server_rank():
    cfg = small_config(runtime="dist", protocol={"num_learners": 2, "backup_learners": 1})
    assert required_processes(cfg.protocol, cfg.dist)[0] == 4
    spec = spec_for(cfg.protocol)
    assert [spec.role(r, cfg.dist, cfg.protocol) for r in (0, 1)] == ["server", "learner"]
    fitted = small_config(
        runtime="dist",
        protocol={"num_learners": 2, "backup_learners": 1},
        dist={"num_processes": 6},
    )
    assert fitted.protocol.num_learners == 4  # 6 = 1 server + λ + β
    with pytest.raises(ConfigError, match="dist.num_processes = 2 .*at least"):
        small_config(
            runtime="dist",
            protocol={"num_learners": 2, "backup_learners": 1},
            dist={"num_processes": 2},
        )


def test_served_backups_apply_the_first_lambda_pushes_of_each_version():
    """λ = 2, β = 1 with a forced push order: each version applies the first two pushes
    computed on it (as HardSync.step on those two rows), a late or older push is dropped
    and counted; the state survives a state_dict round trip with a gradient buffered."""
    torch.manual_seed(0)
    w0 = torch.randn(5)
    g = torch.randn(3, 3, 5)  # [version, learner, P]
    p = BackupHardSync(w0, num_learners=2, backup_learners=1, momentum=0.9)
    ref = HardSync(w0, num_learners=2, momentum=0.9)
    assert p.push(2, g[0, 2], 0, 0.1) is None and not p.can_pull(2)
    u = p.push(0, g[0, 0], 0, 0.1)
    assert (u.version, u.clock, u.staleness) == (1, [(2, 0), (0, 0)], [0, 0])
    assert p.can_pull(2) and p.push(1, g[0, 1], 0, 0.1) is None  # late: dropped
    ref.step(g[0, [0, 2]], 0.1)
    assert torch.equal(p.eval_weights(), ref.eval_weights())
    assert p.push(1, g[1, 1], 1, 0.1) is None
    with pytest.raises(RuntimeError, match="already pushed"):
        p.push(1, g[1, 1], 1, 0.1)
    with pytest.raises(ValueError, match="version = 2"):
        p.push(0, g[1, 0], 2, 0.1)
    q = BackupHardSync(torch.zeros(5), num_learners=2, backup_learners=1, momentum=0.9)
    q.load_state_dict(p.state_dict())
    for proto in (p, q):
        assert proto.push(2, g[0, 2], 0, 0.1) is None  # computed on version 0: dropped
        assert proto.push(0, g[1, 0], 1, 0.1).version == 2
        assert proto.push(2, g[1, 2], 1, 0.1) is None  # late for version 1
    ref.step(g[1, [0, 1]], 0.1)
    assert torch.equal(p.eval_weights(), ref.eval_weights())
    assert torch.equal(q.eval_weights(), ref.eval_weights())
    assert p.dropped_gradients == q.dropped_gradients == 3
    assert p.num_gradients == 4 and p.staleness_counts == {0: 4}
    with pytest.raises(ValueError, match="different configuration"):
        BackupHardSync(w0, num_learners=1, backup_learners=2).load_state_dict(p.state_dict())


@pytest.mark.slow
def test_a_killed_backup_learner_does_not_stop_a_dist_run(tmp_path, monkeypatch):
    """λ = 2, β = 1 on 4 processes (rank 0 the server), learner rank 3 killed at its 3rd
    gradient: the run completes with the two others, each step used λ gradients (every
    counted sample belongs to an applied or buffered push), late pushes were dropped and
    counted, and membership.jsonl records the lost learner."""
    from distsgd import api
    from distsgd.runtime.faults import RankFaults

    run = api.run
    faults = RankFaults(kill_at_step={3: 3})
    monkeypatch.setattr(api, "run", lambda *a, **k: run(*a, **{**k, "faults": faults}))
    cfg = small_config(
        runtime="dist",
        data={"num_train": 512},
        protocol={"num_learners": 2, "backup_learners": 1, "batch_size": 16},
        train={"max_epochs": 1, "eval_every_samples": 512, "tensorboard": False},
        dist={"timeout_s": 10.0},
    )
    out = tmp_path / "run"
    summary = distsgd.train(cfg, out_dir=out)
    assert summary["status"] == "completed"
    assert summary["dropped_gradients"] >= 1  # version 0: the third push came late
    steps, b = summary["iterations"], 16
    assert 2 * b * steps <= summary["samples"] <= 2 * b * steps + b
    counts = json.loads((out / "staleness.json").read_text())["counts"]
    assert counts == {"0": 2 * steps}  # λ = 2 gradients per step, none stale
    lost = [json.loads(r) for r in (out / "membership.jsonl").read_text().splitlines()]
    assert [(r["event"], r["worker"], r["ranks"]) for r in lost] == [("lost", 2, [3])]
    assert lost[0]["active_workers"] == [0, 1] and lost[0]["gradients_per_update"] == 2


def test_rank_faults_sleep_a_stragglers_time_and_the_simulators_stalls():
    """RankFaults.straggle: (f − 1) × the compute seconds for a slow rank; stalls drawn as
    the simulated cluster draws them (same seed → the same seconds); ranks outside
    stall_ranks and ranks that are neither slow nor stalling sleep nothing; the faults
    survive the launcher's JSON channel."""
    from distsgd.runtime.faults import RankFaults, draw_stall

    slept = []
    f = RankFaults(slow={1: 2.5}, stall_probability=0.3, stall_seconds=0.2, stall_ranks=(2,))
    assert f.straggle(1, 0.04, slept.append) == pytest.approx(0.06)
    assert f.straggle(0, 0.04, slept.append) == 0.0 and slept == [pytest.approx(0.06)]
    stalls = [f.straggle(2, 0.04, slept.append) for _ in range(2000)]
    rng = torch.Generator().manual_seed(29 + 2)  # stall_seed 0, rank 2
    assert stalls == [draw_stall(rng, 0.3, 0.2, "exponential") for _ in range(2000)]
    hits = [s for s in stalls if s > 0]
    assert 0.25 < len(hits) / 2000 < 0.35 and 0.17 < sum(hits) / len(hits) < 0.23
    assert slept[1:] == hits  # a rank that does not stall does not call sleep
    fixed = RankFaults(stall_probability=1.0, stall_seconds=0.5, stall_distribution="fixed")
    assert [fixed.straggle(r, 0.01, slept.append) for r in (0, 3)] == [0.5, 0.5]
    back = RankFaults.from_json(f.to_json())
    assert (back.slow, back.stall_ranks, back.stall_probability) == ({1: 2.5}, (2,), 0.3)
    with pytest.raises(ValueError, match="slow"):
        RankFaults(slow={0: 0.5})


@pytest.mark.slow
def test_backups_on_dist_stop_at_a_budget_and_resume(tmp_path):
    """λ = 2, β = 1 on 4 processes, stopped by train.max_samples after 256 of 512 samples
    and resumed to its epoch: the resumed run's records continue the first run's
    (evaluations at increasing samples, dropped gradients never decreasing, the
    summary's counts those of the last record), and every step used λ gradients."""
    cfg = small_config(
        runtime="dist",
        data={"num_train": 512},
        protocol={"num_learners": 2, "backup_learners": 1, "batch_size": 16},
        train={"max_epochs": 1, "max_samples": 256, "eval_every_samples": 128},
        dist={"timeout_s": 10.0},
    )
    out = tmp_path / "run"
    first = distsgd.train(cfg, out_dir=out)
    assert first["samples"] == 256
    summary = distsgd.train(resume=out, overrides=["train.max_samples=0"])
    assert summary["status"] == "completed" and summary["samples"] == 512
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [r["samples"] for r in records]
    assert samples == sorted(set(samples)) and samples[-1] == 512 and 256 in samples
    dropped = [r["dropped_gradients"] for r in records]
    assert dropped == sorted(dropped) and dropped[-1] == summary["dropped_gradients"]
    assert dropped[-1] >= first["dropped_gradients"]
    counts = json.loads((out / "staleness.json").read_text())["counts"]
    assert counts == {"0": 2 * summary["iterations"]} and summary["iterations"] == 16
    # every push (used or dropped) and its reply, float32, as the simulated cluster counts
    pushes = summary["samples"] // 16 + summary["dropped_gradients"]
    assert summary["bytes_sent"] == pushes * 2 * 4 * summary["num_parameters"]
    membership = out / "membership.jsonl"
    assert not membership.exists() or membership.read_text() == ""  # nobody was lost
