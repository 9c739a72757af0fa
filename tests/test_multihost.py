"""Runs over several "hosts" (network namespaces of :mod:`distsgd.testbed`): torchrun on
each host with no environment variable set by hand, a partition, a host killed; the
rank's start-up (gloo's interface, threads per rank) and the bed's switch.

The multi-host tests start processes and are skipped where no namespace can be made
(not root, no iproute2); each is small (a few seconds of training, most of the time is
process start-up).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distsgd import testbed
from distsgd.config import ConfigError
from distsgd.runtime import launch, network, rendezvous
from tests.conftest import small_config
from tests.netbed import (  # noqa: F401 (fixture)
    ROOT,
    bed,
    before_exit_barrier,
    clean_env,
    make_bed,
    torchrun,
)

JOIN_S = 240  # a torchrun run's bound on a loaded 2-core machine (imports take most of it)
HARDSYNC = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
ASYNC = {"name": "parameter_server", "num_learners": 1, "mode": "async", "batch_size": 16}


def write_config(tmp_path: Path, protocol: dict, timeout_s: float = 20, **train) -> Path:
    t = {"max_epochs": 1, "eval_every_samples": 256, "tensorboard": False, "num_threads": 0}
    cfg = small_config(protocol=protocol, train={**t, **train}, runtime="dist",
                       dist={"timeout_s": timeout_s})  # fmt: skip
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    return path


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output once it ends (killed past ``timeout`` seconds in all)."""
    end, outputs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n<killed by the test>")
    return outputs


def train_cmd(cfg: Path, out: Path) -> list[str]:
    return ["-m", "distsgd", "train", str(cfg), "--out", str(out), "--quiet"]


# ---- the rank's start-up, in this process ---------------------------------------------


def test_route_to_loopback_is_lo():
    assert network.route_interface("127.0.0.1") == ("lo", "127.0.0.1")


def test_a_wrong_interface_name_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"GLOO_SOCKET_IFNAME = 'nosuch0' .*on host") as e:
        network.prepare_rank(None, log=False)
    assert "\n" not in str(e.value)


def test_unset_interface_is_the_route_to_the_master(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so prepare_rank's is undone
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    net = network.prepare_rank(None, log=False)
    assert net.interface == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_threads_per_rank_share_the_host_cores(monkeypatch):
    monkeypatch.setattr(network, "host_cores", lambda: 16)
    assert network.threads_per_rank(0, 4) == 4
    assert network.threads_per_rank(0, 32) == 1  # never 0
    assert network.threads_per_rank(3, 4) == 3  # train.num_threads wins


# ---- the bed's switch, without namespaces -----------------------------------------------


def test_switch_charges_rate_then_delay_and_bounds_its_queue(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(testbed.time, "monotonic", lambda: now[0])
    port = testbed._Port(fd=-1)
    port.link = testbed.Link(delay_ms=20, rate_mbit=1)
    pending, seq, rng = [], iter(range(10**6)), random.Random(0)
    testbed._accept(port, 0, b"x" * 125_000, pending, seq, rng)  # 1 Mbit: 1 s on the wire
    testbed._accept(port, 0, b"x" * 125_000, pending, seq, rng)  # queued behind it
    assert [round(p[0] - 100.0, 6) for p in pending] == [1.02, 2.02]
    for _ in range(40):  # 4 MiB of queue, then tail drop
        testbed._accept(port, 0, b"x" * 125_000, pending, seq, rng)
    assert port.queued_bytes <= testbed.QUEUE_BYTES and len(pending) == 33
    port.link = testbed.Link(partitioned=True)
    testbed._accept(port, 0, b"x", pending, seq, rng)
    assert len(pending) == 33


def test_link_settings_are_checked():
    with pytest.raises(ValueError, match="loss = 1"):
        testbed.Link(loss=1)
    with pytest.raises(ValueError, match="delay_ms = -1"):
        testbed.Link(delay_ms=-1)


# ---- the bed itself -------------------------------------------------------------------

PROBE = """
import socket, sys, time
t = time.monotonic()
try:
    socket.create_connection((sys.argv[1], 5000), timeout=3).close()
    print(f"connected {time.monotonic() - t:.3f}")
except OSError as e:
    print(f"failed {e}")
"""
LISTEN = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5000)); s.listen(); s.settimeout(60)
for _ in range(2):
    s.accept()[0].close()
"""


@pytest.mark.slow
def test_bed_delays_partitions_and_cleans_up():
    """A TCP connect from h1 to h0 takes at least h1's one-way delay (its SYN); it fails
    while h1 is partitioned, succeeds again after; after close no namespace is left."""
    b = make_bed(2, links={1: testbed.Link(delay_ms=150)})
    try:
        server = b.popen(0, [sys.executable, "-c", LISTEN])
        time.sleep(1.0)
        probe = [sys.executable, "-c", PROBE, "h0"]
        first = b.run(1, probe, capture_output=True, text=True, timeout=60).stdout
        assert first.startswith("connected"), first
        assert float(first.split()[1]) >= 0.15  # the SYN waited 150 ms in h1's link
        b.partition(1)
        cut = b.run(1, probe, capture_output=True, text=True, timeout=60).stdout
        assert cut.startswith("failed"), cut
        b.partition(1, False)
        healed = b.run(1, probe, capture_output=True, text=True, timeout=60).stdout
        assert healed.startswith("connected"), healed
        server.wait(timeout=30)
    finally:
        b.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in b.namespaces)


# ---- torchrun over two hosts -------------------------------------------------------------


@pytest.mark.slow
def test_two_hosts_train_with_no_variable_set(bed, tmp_path):  # noqa: F811
    """torchrun --nnodes 2 on h0 and h1 (the async parameter server; hardsync runs in the
    fault test below), --master-addr h0 (which h0 itself resolves to 127.0.1.1), no
    GLOO_SOCKET_IFNAME: gloo takes eth0 on both hosts, each says so in one line with one
    thread per rank (one core per host), rank 0 writes the summary."""
    cfg, out = write_config(tmp_path, ASYNC), tmp_path / "run"
    procs = torchrun(bed, train_cmd(cfg, out))
    outputs = finish(procs, JOIN_S)
    assert [p.returncode for p in procs] == [0, 0], outputs
    for host, text in enumerate(outputs):
        assert f"dist: host h{host}, interface eth0 (10.213.0.{host + 1})" in text, text
        run_text = before_exit_barrier(text)
        assert "Traceback" not in run_text and "connectFullMesh" not in run_text, text
    per_core = max(1, len(bed.cpus[0]))
    assert f"{per_core} thread(s) per rank × 1 rank(s)" in outputs[1], outputs[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runtime"] == "dist" and summary["num_processes"] == 2


@pytest.mark.slow
def test_drop_in_example_across_two_hosts(bed, tmp_path):  # noqa: F811
    """examples/own_loop under torchrun on h0 and h1 (hardsync), no variable set."""
    script = [str(ROOT / "examples" / "own_loop" / "train.py"), "--protocol", "hardsync"]
    script += ["--epochs", "1", "--target", "0.5", "--out", str(tmp_path / "out")]
    procs = torchrun(bed, script)
    outputs = finish(procs, JOIN_S)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "reached" in outputs[0], outputs
    assert "Traceback" not in "".join(before_exit_barrier(o) for o in outputs), outputs


# ---- faults on a real network -----------------------------------------------------------

TIMEOUT_S = 5.0
END_SLACK_S = 20.0  # torchrun's agent noticing its rank's end, on a loaded machine


def start_long_hardsync(bed, tmp_path, protocol: dict, env: dict[str, str]):  # noqa: F811
    """Hardsync on every host of ``bed`` that would train for minutes; returns once rank 0
    has written a first evaluation (every host is in the run)."""
    cfg = write_config(tmp_path, protocol, timeout_s=TIMEOUT_S, max_epochs=500)
    out = tmp_path / "run"
    procs = torchrun(bed, train_cmd(cfg, out), env=env)
    end = time.monotonic() + JOIN_S
    metrics = out / "metrics.jsonl"
    while time.monotonic() < end and not (metrics.exists() and metrics.read_text().strip()):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    assert all(p.poll() is None for p in procs), finish(procs, 30)
    return procs, out


def ended_after(procs, t0: float, bound: float) -> tuple[list[float], list[str]]:
    """Seconds from ``t0`` to each process's end (polled; killed past ``bound``), outputs."""
    ends: list[float | None] = [None] * len(procs)
    while time.monotonic() - t0 < bound and None in ends:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.monotonic() - t0
        time.sleep(0.2)
    outputs = finish(procs, 30)
    return [e if e is not None else float("inf") for e in ends], outputs


FOREIGN_CLIENT = """
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("h0", 29500, is_master=False, timeout=timedelta(seconds=20))
plain = ["distsgd/0/beat/0", "distsgd/0/beat/1", "distsgd/0/timeout_s/0", "distsgd/0/left/0"]
print("found", [k for k in plain if s.check([k])])
for rank in (1, 2):  # were they the run's keys: "rank r left on purpose"
    s.set(f"distsgd/0/left/{rank}", "1")
print("wrote", flush=True)
"""


@pytest.mark.slow
def test_a_partitioned_host_and_a_killed_host_end_the_run_within_the_timeout(tmp_path):
    """Hardsync over h0, h1, h2 with a run secret on every host, no other variable set:
    each host says its interface (eth0) and threads in one line. A client on h2 without
    the secret finds none of the run's keys under the names they have without it, and
    its writes there (ranks 1 and 2 "left on purpose") do not reach the run. Then h1 is
    cut off for good and everything on h2 is killed (kill -9): h0 and h1 end within
    timeout_s + 5 s (+ the agents' slack); h1's rank says it lost the store; h0's names
    ranks 1 and 2, and its summary.json lists them in lost_ranks (which the writes, had
    they reached the run, would have emptied)."""
    b = make_bed(3)
    try:
        env = {**clean_env(), "DISTSGD_RUN_SECRET": "s3"}
        procs, out = start_long_hardsync(b, tmp_path, {**HARDSYNC, "num_learners": 3}, env)
        probe = b.run(2, [sys.executable, "-c", FOREIGN_CLIENT], env=clean_env(),
                      capture_output=True, text=True, timeout=JOIN_S)  # fmt: skip
        assert "found []" in probe.stdout and "wrote" in probe.stdout, probe
        b.partition(1)
        b.kill_host(2)
        t0 = time.monotonic()
        ends, outputs = ended_after(procs[:2], t0, TIMEOUT_S + 5 + END_SLACK_S + 5)
        finish(procs[2:], 10)
    finally:
        b.close()
    print("partition + host killed: seconds to end on h0, h1", ends)
    for host, text in enumerate(outputs):
        assert f"dist: host h{host}, interface eth0 (10.213.0.{host + 1})" in text, text
    per_core = max(1, len(b.cpus[1]))
    assert f"{per_core} thread(s) per rank × 1 rank(s)" in outputs[1], outputs[1]
    assert ends[0] <= TIMEOUT_S + 5 + END_SLACK_S, outputs[0]
    assert "ranks 1, 2 stopped making progress" in outputs[0], outputs[0]
    assert ends[1] <= TIMEOUT_S + 5 + END_SLACK_S, outputs[1]
    assert "lost the run's store at h0:29500 from host h1" in outputs[1], outputs[1]
    assert "s3" not in "".join(outputs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary.get("lost_ranks") == [1, 2], summary


# ---- bad input on a host ----------------------------------------------------------------


def start_rank(bed, host: int, rank: int, world: int, cmd: list[str], **variables):  # noqa: F811
    """``cmd`` as rank ``rank`` of ``world`` (one per host) on ``host``, with torchrun's
    variables but no agent: rank 0 hosts the run's store on h0:29500."""
    env = {**clean_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29500", **variables}  # fmt: skip
    return bed.popen(host, [sys.executable, *cmd], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    """The lines of a rank's stderr but its start-up line and c10d's warnings (a bed host
    has no reverse DNS: ``[W… socket.cpp] The hostname of the client socket …``)."""
    return [line for line in stderr.splitlines()
            if not line.startswith(("dist: host", "[W"))]  # fmt: skip


@pytest.mark.slow
def test_the_join_names_each_rank_it_refuses_and_leaves_none_running(tmp_path):
    """Four ranks over three hosts (torchrun's variables, no agent): rank 1 with another run
    secret, rank 2 with an interface its host lacks, rank 3 with a master address no
    route leads to (the bed has no default route), so it never joins, as a host started
    late. Every rank exits 2 with one line and no traceback: rank 0 names the three
    (rank and host), rank 1 that its secret was refused, rank 2 its interface, rank 3
    the master address; neither secret is printed, nothing is written."""
    b = make_bed(3)
    try:
        cfg = write_config(tmp_path, {**HARDSYNC, "num_learners": 4}, timeout_s=8)
        out = tmp_path / "run"
        cmd = train_cmd(cfg, out)
        procs = [
            start_rank(b, 0, 0, 4, cmd, DISTSGD_RUN_SECRET="secret-of-h0"),
            start_rank(b, 1, 1, 4, cmd, DISTSGD_RUN_SECRET="secret-of-h1"),
            start_rank(
                b, 2, 2, 4, cmd, DISTSGD_RUN_SECRET="secret-of-h0", GLOO_SOCKET_IFNAME="eth9"
            ),
            start_rank(b, 1, 3, 4, cmd, DISTSGD_RUN_SECRET="secret-of-h0", MASTER_ADDR="192.0.2.1"),
        ]
        done = [p.communicate(timeout=JOIN_S) for p in procs]
    finally:
        b.close()
    codes = [p.returncode for p in procs]
    errors = [error_lines(err) for _, err in done]
    assert codes == [2, 2, 2, 2], done
    assert all(len(lines) == 1 for lines in errors), errors
    text = "".join(out + err for out, err in done)
    assert "Traceback" not in text and "secret-of" not in text, text
    zero, one, two, three = (lines[0] for lines in errors)
    assert "rank 1 on host h1 has another run secret than rank 0" in zero, zero
    assert "rank 2 on host h2 refused to start: GLOO_SOCKET_IFNAME = 'eth9'" in zero, zero
    assert "rank(s) 3 did not join" in zero, zero
    assert "DISTSGD_RUN_SECRET is not allowed on host h1 (rank 1)" in one, one
    assert "GLOO_SOCKET_IFNAME = 'eth9' is not allowed on host h2" in two, two
    assert "MASTER_ADDR = '192.0.2.1' is not allowed on host h1: no route" in three, three
    assert not out.exists()


# ---- the run secret, in this process ------------------------------------------------------


def test_the_run_secret_comes_from_the_variable_or_the_file(monkeypatch, tmp_path):
    monkeypatch.delenv(rendezvous.ENV_SECRET, raising=False)
    monkeypatch.delenv(rendezvous.ENV_SECRET_FILE, raising=False)
    assert rendezvous.run_secret() == b"" and rendezvous.secret_tag() == ""
    assert launch.namespace() == "distsgd/0/"
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv(rendezvous.ENV_SECRET_FILE, str(path))
    assert rendezvous.run_secret() == b"from-file"
    tag = rendezvous.secret_tag()
    assert launch.namespace() == f"distsgd/{tag}0/" and "from-file" not in tag
    monkeypatch.setenv(rendezvous.ENV_SECRET, "from-variable")  # the variable wins
    assert rendezvous.run_secret() == b"from-variable" and rendezvous.secret_tag() != tag


@pytest.mark.parametrize("contents", [None, ""], ids=["missing", "empty"])
def test_an_unusable_secret_file_is_refused_in_one_line(monkeypatch, tmp_path, contents):
    path = tmp_path / "secret"
    if contents is not None:
        path.write_text(contents)
    monkeypatch.delenv(rendezvous.ENV_SECRET, raising=False)
    monkeypatch.setenv(rendezvous.ENV_SECRET_FILE, str(path))
    with pytest.raises(ConfigError, match=r"DISTSGD_RUN_SECRET_FILE = .* on host") as e:
        rendezvous.run_secret()
    assert "\n" not in str(e.value)
