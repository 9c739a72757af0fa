"""The dist runtime on real processes (gloo on CPU): every protocol, sim/dist equivalence,
torchrun across two "nodes" on 127.0.0.1, lost processes and resume.

Each run starts 2–3 Python processes (one thread each) on tiny synthetic data and the
mlp, so a run costs a few seconds, most of it process start-up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from distsgd.config import ConfigError
from distsgd.trainer import train
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1]

HARDSYNC = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
SMA = {"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 16}
LOCAL_SGD = {
    "name": "local_sgd",
    "num_learners": 4,
    "replicas_per_device": 2,
    "average_every": 3,
    "batch_size": 16,
}
GROUPS_G1 = {"name": "compute_groups", "num_learners": 2, "num_groups": 1, "batch_size": 16}


def config(protocol: dict, runtime: str, **train_settings):
    t = {"max_epochs": 1, "eval_every_samples": 256, "tensorboard": False, **train_settings}
    return small_config(protocol=protocol, train=t, runtime=runtime)


def protocol_state(run_dir: Path, key: str) -> torch.Tensor:
    """``key`` of the protocol state in a run's checkpoint; for a dist run the ranks'
    replica stacks are concatenated in rank order (learner l = rank·k + j)."""
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    if "ranks" not in state["runtime"]:
        proto = state["protocol"]
        return proto["server"][key] if "server" in proto else proto[key]
    ranks = [r["protocol"] for r in state["runtime"]["ranks"]]
    if key == "replicas":
        return torch.cat([r[key] for r in ranks])
    return ranks[0][key]


def no_process_left(pid_dir: Path) -> None:
    pids = [int(f.read_text()) for f in pid_dir.glob("rank*.pid")]
    assert pids, "the test hook recorded no pid"
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie is gone as a process but not yet reaped: it holds no resources
        stat = Path(f"/proc/{pid}/stat")
        assert stat.exists() and stat.read_text().split()[2] == "Z", f"pid {pid} still runs"


@pytest.mark.parametrize(
    ("protocol", "keys"),
    [(HARDSYNC, ["weights"]), (SMA, ["replicas", "central"]), (LOCAL_SGD, ["replicas"])],
    ids=["hardsync", "sma", "local_sgd"],
)
def test_sync_protocols_match_the_simulator(tmp_path, protocol, keys):
    """Same seed => same weights as the simulated cluster after 32 iterations.

    Tolerance 1e-6 absolute (weights are O(0.1)): the simulator averages the learners'
    gradients as one batch (hardsync) or with torch.mean over the replica stack (local
    SGD), the dist runtime with a c10d all-reduce whose summation order differs, so
    results may differ in the last float32 bits (about 1e-7 was seen). SMA with two
    devices sums two per-device corrections, which is order-independent: equal bits.
    """
    sim = train(config(protocol, "sim"), out_dir=tmp_path / "sim")
    real = train(config(protocol, "dist"), out_dir=tmp_path / "dist")
    assert real["runtime"] == "dist" and real["status"] == "completed"
    assert real["samples"] == sim["samples"]
    assert real["num_processes"] == 2
    for key in keys:
        a, b = protocol_state(tmp_path / "sim", key), protocol_state(tmp_path / "dist", key)
        assert a.shape == b.shape
        tol = 0.0 if protocol is SMA else 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=tol)
    sim_records = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").open()]
    real_records = [json.loads(x) for x in (tmp_path / "dist" / "metrics.jsonl").open()]
    assert [r["samples"] for r in real_records] == [r["samples"] for r in sim_records]
    for r_sim, r_real in zip(sim_records, real_records, strict=True):
        # accuracy on 256 test samples: a 1e-6 weight difference flips no prediction
        assert r_real["test_accuracy"] == r_sim["test_accuracy"]
        assert r_real["virtual_s"] == r_real["virtual_s"]  # measured, not NaN
    for f in ("config.toml", "metrics.jsonl", "summary.json", "staleness.json", "checkpoint.pt"):
        assert (tmp_path / "dist" / f).exists()


def test_wrong_number_of_processes_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"dist.num_processes = 3 .*expected 2"):
        train(config(HARDSYNC, "dist"), overrides=["dist.num_processes=3"], out_dir=tmp_path)
