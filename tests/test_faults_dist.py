"""Faults of the dist runtime on real processes (issue 12): a hung rank, long solo work,
settings that differ across nodes, the rendezvous store's port and address, a launcher
that dies, a server killed before it could write its summary.

Faults are injected from the test (signals to a rank's pid, read from the pid files of
the rank processes found under the launcher in /proc). Every run is a few seconds of training on
tiny synthetic data; no assert depends on the machine's speed (the bounds on how long a
run may take are far above the work, and only catch a run that would go on forever).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distsgd.api import train
from distsgd.config import ConfigError
from distsgd.launch import DistRunFailed
from distsgd.runtime.faults import RankFaults
from distsgd.runtime.launch import PeerLost
from distsgd.runtime.ps import LearnerLost, ServerLost
from distsgd.runtime.rendezvous import rendezvous_store
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1]
HARDSYNC2 = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
HARDSYNC3 = {"name": "hardsync", "num_learners": 3, "batch_size": 16}
ASYNC = {"name": "parameter_server", "num_learners": 2, "mode": "async", "batch_size": 16}
GENEROUS_S = 120  # a run that has not ended by then never would: far above the work


def config(protocol: dict, timeout_s: float = 20.0, data: dict | None = None, **train_settings):
    t = {"max_epochs": 1, "eval_every_samples": 256, "tensorboard": False, **train_settings}
    return small_config(
        protocol=protocol,
        train=t,
        runtime="dist",
        dist={"timeout_s": timeout_s},
        data=data or {},
    )


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _cli(cfg_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "distsgd", "train", str(cfg_path), "--out", str(out)]
    return subprocess.Popen(
        [*argv, "--quiet", *extra],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK of a rank process the launcher started (``python -m distsgd.worker``)."""
    try:
        if b"distsgd.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _rank_pids(proc: subprocess.Popen, n: int) -> dict[int, int]:
    """The pids of the n ranks the CLI process ``proc`` started (waits for them)."""
    deadline = time.monotonic() + GENEROUS_S
    while time.monotonic() < deadline:
        ranks = {_rank_of(p): p for p in _descendants(proc.pid)}
        if all(r in ranks for r in range(n)):
            return {r: ranks[r] for r in range(n)}
        time.sleep(0.1)
    raise AssertionError(f"the launcher did not start its {n} ranks in {GENEROUS_S} s")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie has ended, it is only not reaped yet
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _wait_for_evaluations(out: Path, count: int) -> None:
    deadline = time.monotonic() + GENEROUS_S
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not write {count} evaluations in {GENEROUS_S} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _external_address() -> str | None:
    """An address of this machine other than loopback (None where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the route
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


# ---- 8, 11: the rendezvous store ----------------------------------------------------------
@pytest.mark.slow
def test_store_listens_on_master_addr_only(tmp_path):
    """A one-machine run's store (dist.master_port fixed, master_addr 127.0.0.1) takes
    connections on loopback and refuses them on the machine's external address (torch's
    TCPStore alone listens on every interface, IPv4 and IPv6)."""
    external = _external_address()
    if external is None:
        pytest.skip("this machine has no address other than loopback")
    out, port = tmp_path / "run", _free_port()
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(HARDSYNC2, max_epochs=1000).to_toml())
    proc = _cli(cfg_path, out, "--set", f"dist.master_port={port}")
    try:
        _rank_pids(proc, 2)  # the ranks are started: the launcher's store is up
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError), socket.socket() as s:
            s.settimeout(5)
            s.connect((external, port))
    finally:
        proc.terminate()  # as Ctrl-C: every rank is stopped
        proc.communicate(timeout=GENEROUS_S)
    store = rendezvous_store("127.0.0.1", 0, world_size=1, timeout_s=5)  # the same, direct
    with pytest.raises(ConnectionRefusedError), socket.socket() as s:
        s.settimeout(5)
        s.connect((external, store.port))
    del store


def test_master_port_in_use_is_one_line_exit_2(tmp_path, capsys):
    from distsgd.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg_path = tmp_path / "run.toml"
        cfg_path.write_text(config(HARDSYNC2).to_toml())
        argv = ["train", str(cfg_path), "--set", f"dist.master_port={port}", "--quiet"]
        assert main([*argv, "--out", str(tmp_path / "run")]) == 2
        with pytest.raises(ConfigError, match=rf"dist.master_port = {port} is not allowed"):
            rendezvous_store("127.0.0.1", port, world_size=1, timeout_s=5)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"dist.master_port = {port} is not allowed: the port is already in use" in err[0]
    assert "or 0 to let distsgd pick one" in err[0]
    assert not (tmp_path / "run" / "summary.json").exists()


# ---- 2: a hung rank -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_stopped_rank_is_named_and_killed(tmp_path):
    """Hardsync on 3 processes, rank 2 stopped by SIGSTOP after the second evaluation:
    ranks 0 and 1 time out and name rank 2 (its heartbeat stopped); the launcher kills it
    as soon as the others have ended instead of waiting out its own deadline; the error
    and summary.json name rank 2 only."""
    out = tmp_path / "run"
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(HARDSYNC3, timeout_s=4, max_epochs=1000).to_toml())
    proc = _cli(cfg_path, out)
    pid2 = None
    try:
        pid2 = _rank_pids(proc, 3)[2]
        _wait_for_evaluations(out, 2)
        os.kill(pid2, signal.SIGSTOP)
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        if pid2 is not None and _running(pid2):
            os.kill(pid2, signal.SIGCONT)
            os.kill(pid2, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert "rank 2 (pid" in err and "stopped making progress (no heartbeat); killing it" in err
    last = err.strip().splitlines()[-1]
    assert "rank 2 (learner) stopped making progress" in last, last
    assert "rank 0" not in last and "rank 1" not in last, last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == [2]


def test_outcome_names_the_hung_rank_and_writes_the_summary_rank_0_could_not(tmp_path):
    """The launcher's verdict: ranks 0 and 1 stopped on a lost peer and named rank 2 as
    silent, the launcher killed rank 2: the error names rank 2 only, and with no
    summary.json from rank 0 the launcher writes one."""
    from distsgd.launch import _outcome

    lost = {"kind": "lost", "message": "lost contact with another rank", "silent_ranks": [2]}
    codes = {0: 3, 1: 3, 2: -9}
    with pytest.raises(DistRunFailed, match=r"^rank 2 \(learner\) stopped making progress"):
        _outcome(config(HARDSYNC3), tmp_path, codes, dict(codes), {0: lost, 1: lost}, hung={2})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == [2]
    assert summary["written_by"] == "launcher" and (tmp_path / "metrics.jsonl").exists()


# ---- 3: rank 0's solo evaluation ----------------------------------------------------------
@pytest.mark.slow
def test_solo_evaluation_longer_than_the_timeout_is_not_silence(tmp_path):
    """resnet20 (BatchNorm: rank 0 evaluates alone) on 2 hardsync ranks with
    dist.timeout_s = 2 and a test set whose evaluation takes longer than that (4000
    samples through resnet20 on one thread: 5.6 s here, several seconds on any CPU).
    Rank 1 waits for the evaluation as long as rank 0's heartbeat goes on: the run
    completes (before, rank 1 timed out in the next collective)."""
    cfg = config(
        HARDSYNC2,
        timeout_s=2,
        data={"num_train": 64, "num_test": 4000},
        eval_every_samples=0,
    )
    cfg = cfg.replace(model=type(cfg.model)(name="resnet20"))
    s = train(cfg, out_dir=tmp_path / "run")
    assert s["status"] == "completed" and s["samples"] == 64
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["samples"] for r in records] == [0, 64]


# ---- 5: settings that differ across torchrun nodes ----------------------------------------
@pytest.mark.slow
def test_torchrun_nodes_with_different_settings_stop_with_one_line(tmp_path):
    """Two torchrun nodes, optimizer.lr 0.05 on one and 0.5 on the other: every rank ends
    at set-up with status 2 and one line naming the setting and both values; nothing is
    written that claims success."""
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(HARDSYNC2).to_toml())
    port, out = _free_port(), tmp_path / "run"
    nodes = []
    for i, lr in enumerate(("0.05", "0.5")):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        torchrun += ["--node-rank", str(i), "--nproc-per-node", "1"]
        torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        run = ["-m", "distsgd", "train", str(cfg_path), "--out", str(out), "--quiet"]
        nodes.append(
            subprocess.Popen(
                [*torchrun, *run, "--set", f"optimizer.lr={lr}"],
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [n.communicate(timeout=GENEROUS_S)[0] for n in nodes]
    assert all(n.returncode != 0 for n in nodes), outputs
    line = "optimizer.lr = 0.05 on rank 0, 0.5 on rank 1"
    for output in outputs:
        errors = [x for x in output.splitlines() if x.startswith("distsgd: error:")]
        assert len(errors) == 1 and line in errors[0], output
        assert "Traceback" not in output.split("distsgd: error:")[0], output
    assert not (out / "summary.json").exists()


# ---- torchrun restarts the workers -----------------------------------------------------------
_TRAIN_KILLED_ONCE = """
import os, sys
from distsgd.api import train
from distsgd.config import RunConfig
from distsgd.runtime.faults import RankFaults

first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
faults = RankFaults(kill_at_step={1: int(sys.argv[3])}) if first else None
train(RunConfig.from_toml(sys.argv[1]), out_dir=sys.argv[2], faults=faults)
"""


@pytest.mark.slow
def test_workers_torchrun_restarts_resume_from_the_checkpoint(tmp_path):
    """torchrun --max-restarts 1, rank 1 killed at its 20th iteration (after the checkpoint
    at 512 samples): the restarted workers resume from the checkpoint and finish the run,
    which counts every sample of its epoch once. A second launch into the finished run is
    refused on every attempt."""
    cfg_path, script, out = tmp_path / "run.toml", tmp_path / "train.py", tmp_path / "run"
    cfg_path.write_text(config(HARDSYNC2).to_toml())
    script.write_text(_TRAIN_KILLED_ONCE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--max-restarts", "1", "--master-port", str(_free_port())]
    done = subprocess.run(
        [*torchrun, str(script), str(cfg_path), str(out), "20"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=GENEROUS_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the run's workers were restarted; resuming from" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["samples"] == 1024, summary
    # another torchrun launch into that finished run, with another rate: its restart is
    # refused like its first attempt, not resumed with the new settings
    saved = (out / "config.toml").read_text()
    torchrun[-1] = str(_free_port())
    again = subprocess.run(
        [*torchrun, "-m", "distsgd", "train", str(cfg_path), "--out", str(out), "--quiet"]
        + ["--set", "optimizer.lr=0.5"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=GENEROUS_S,
    )
    assert again.returncode != 0 and "already holds a run" in again.stderr, again.stderr[-3000:]
    assert "resuming from" not in again.stderr
    assert (out / "config.toml").read_text() == saved


# ---- 13: the launcher dies ----------------------------------------------------------------
@pytest.mark.slow
def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """kill -9 of the launcher (the CLI process) during a long run: every rank ends on its
    own (parent-death signal), and no summary claims the run completed."""
    out = tmp_path / "run"
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(HARDSYNC2, max_epochs=1000).to_toml())
    proc = _cli(cfg_path, out)
    pids: dict[int, int] = {}
    try:
        pids = _rank_pids(proc, 2)
        _wait_for_evaluations(out, 1)
        proc.kill()
        proc.communicate()
        deadline = time.monotonic() + GENEROUS_S
        while any(_running(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [r for r, p in pids.items() if _running(p)]
    finally:
        for p in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert left == [], f"ranks {left} went on after their launcher was killed"
    summary = out / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] != "completed"


def _sigterm_when_ready(script: str, *args: str) -> int:
    """Run ``script`` (a rank's ``run_worker`` with a stand-in trainer) in a process,
    SIGTERM it once it prints "ready", and return its exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=GENEROUS_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_STANDIN_RANK = """
import ctypes, os, signal, sys, time
from pathlib import Path
from distsgd import launch
from distsgd.runtime import dist as rdist

def run_rank(on_interrupt):
    class Trainer:  # a rank's run: "ready", then trains until interrupted
        def __init__(self, *args, **kwargs):
            pass

        def run(self, resume, **kwargs):
            try:
                print("ready", flush=True)
                while True:
                    time.sleep(0.02)
            except KeyboardInterrupt:
                on_interrupt()
                raise

    launch.Trainer = Trainer
    launch.RunConfig.from_dict = staticmethod(lambda d: None)
    sys.exit(launch.run_worker("", "", resume=False, progress=False))
"""

# a teardown that never returns and holds the GIL, as a gloo process group's destructor
# did, joining gloo's thread: a C call that keeps the GIL (PyDLL) and waits
_TEARDOWN_HOLDS_THE_GIL = (
    _STANDIN_RANK
    + """
rdist.end_with_parent(float(sys.argv[1]))  # the run's grace: dist.timeout_s + 5
run_rank(lambda: ctypes.PyDLL(None).pause())
"""
)


@pytest.mark.slow
def test_a_rank_whose_teardown_hangs_holding_the_gil_ends_by_its_deadline():
    """Found by a fresh-user review: after kill -9 of the launcher one rank in four hung
    for good (SIGTERM did nothing): its teardown held the GIL in a gloo destructor, and the
    watchdog thread's os._exit waited for the GIL too. SIGTERM's handler now arms SIGALRM,
    whose default action the kernel carries out: the rank ends its grace after SIGTERM."""
    assert _sigterm_when_ready(_TEARDOWN_HOLDS_THE_GIL, "2") == -signal.SIGALRM


@pytest.mark.slow
def test_ctrl_c_of_a_dist_run_says_so_in_one_line(tmp_path):
    """Ctrl-C of the launcher: the run is interrupted, the checkpoint kept, and stderr
    is distsgd's one line (a fresh-user review: torch's launcher added a warning line per
    rank, "Sending process N closing signal SIGTERM")."""
    out = tmp_path / "run"
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(HARDSYNC2, max_epochs=1000).to_toml())
    proc = _cli(cfg_path, out)
    try:
        _rank_pids(proc, 2)
        _wait_for_evaluations(out, 1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    # the launcher's line, once; no torch line per stopped rank (a rank that meets its
    # peer's exit before its own SIGTERM may report that: not what this test is about)
    assert [x for x in lines if x.startswith("distsgd: interrupted")] == lines[-1:], err
    assert not [x for x in lines if "closing signal" in x], err
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


# rank 0 writing its "interrupted" summary when a second SIGTERM comes (the kernel's,
# after the launcher's)
_SECOND_SIGTERM_IN_TEARDOWN = (
    _STANDIN_RANK
    + """
def write_summary():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    Path(sys.argv[1]).write_text("interrupted")

run_rank(write_summary)
"""
)


@pytest.mark.slow
def test_a_second_sigterm_does_not_interrupt_a_ranks_summary(tmp_path):
    """Found by a fresh-user review: after kill -9 of the launcher, a rank got SIGTERM
    from the kernel (parent death) and again from its watchdog thread; the second one
    interrupted rank 0 writing its summary (1 run in 12 had none). Only the first
    SIGTERM interrupts now."""
    summary = tmp_path / "summary"
    assert _sigterm_when_ready(_SECOND_SIGTERM_IN_TEARDOWN, str(summary)) == 130
    assert summary.read_text() == "interrupted"


# ---- 14: the server killed before it could write its summary -------------------------------
@pytest.mark.slow
def test_killed_server_gets_a_failed_summary_that_report_reads(tmp_path, monkeypatch):
    """The coordinating server (rank 0) SIGKILLs itself at its 10th push: it writes
    nothing more, so the launcher writes summary.json (status failed, lost rank 0), and
    ``distsgd report`` reads the run."""
    from distsgd.report import load_run

    out = tmp_path / "run"
    with pytest.raises(DistRunFailed, match=r"rank 0 \(server\) was killed by SIGKILL"):
        train(config(ASYNC, timeout_s=10), out_dir=out, faults=RankFaults(kill_at_step={0: 10}))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == [0]
    assert summary["protocol"] == "parameter_server" and summary["runtime"] == "dist"
    assert "rank 0 (server) was killed by SIGKILL" in summary["error"]
    run = load_run(out)
    assert run.summary["status"] == "failed"
    assert [r["samples"] for r in run.records] == [0]  # the evaluation before the kill


@pytest.mark.slow
def test_coordinator_evaluation_longer_than_the_timeout_is_not_silence(tmp_path, capfd):
    """The parameter server (async, λ = 2) with resnet20, dist.timeout_s = 2 and
    evaluations of 3000 test samples after every 32 (4.2 s each here, several seconds on
    any CPU): the learners wait for the coordinator's reply while it evaluates, as long as
    its heartbeat goes on; the run completes with every learner (before, both learners
    timed out during the evaluation at 32 samples and the server was left alone)."""
    cfg = config(
        ASYNC,
        timeout_s=2,
        data={"num_train": 64, "num_test": 3000},
        eval_every_samples=32,
    )
    cfg = cfg.replace(model=type(cfg.model)(name="resnet20"))
    s = train(cfg, out_dir=tmp_path / "run")
    assert s["status"] == "completed" and s["samples"] >= 64
    assert not any("lost" in e for e in s["events"]), s["events"]
    err = capfd.readouterr().err
    assert "lost" not in err, err


_EXIT_WHILE_BEATING = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from distsgd.runtime.dist import Heartbeats

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
beats = Heartbeats(0, 1, 10.0)
beats.interval_s = 0.0  # the beat thread is (nearly) always inside a store call
time.sleep(0.05)
if sys.argv[1] == "close":
    beats.close()
    assert not beats._thread.is_alive(), "close() returned with the beat thread running"
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "exit"])
def test_exit_while_the_heartbeat_is_in_a_store_call_is_not_an_abort(how):
    """Bug: a rank that closed its run and returned at once could die of SIGABRT
    ("terminate called without an active exception") when the daemon beat thread was
    inside ``TCPStore.add`` as the interpreter exited (the own-loop example under
    torchrun, rank 1, in CI). close() and interpreter exit now join the beat thread."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_BEATING, how],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr


def test_a_rank_lost_while_another_is_judged_silent_is_named_too(monkeypatch):
    """Bug: when a host was cut off and another killed at the same moment, rank 0 named
    the cut-off rank only whenever the killed rank had beaten once more during the one
    heartbeat look (its summary's lost_ranks missed it). Rank 0 of 4, in process, with
    the run's store: rank 1 never beats, rank 2 beats through the first half of the
    first look, then stops, rank 3 left on purpose. Ranks 1 and 2 are named."""
    from datetime import timedelta

    import torch.distributed as tdist

    from distsgd.runtime import launch as rlaunch

    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))  # fmt: skip
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    beats = rlaunch.Heartbeats(0, 4, 2.0)
    store.set(rlaunch._left_key(beats._prefix, 3), "1")  # rank 3 left on purpose
    stop = time.monotonic() + 1.0

    def rank_2() -> None:
        while time.monotonic() < stop:
            store.add(rlaunch._beat_key(beats._prefix, 2), 1)
            time.sleep(0.1)

    beater = threading.Thread(target=rank_2)
    beater.start()
    try:
        silent = beats.silent_ranks()
    finally:
        beater.join()
        beats.close()
    assert silent == [1, 2]


# ---- the launcher's heartbeat watch ------------------------------------------------------------
def test_the_watch_kills_only_a_rank_whose_heartbeat_stopped(monkeypatch):
    """RankWatch over 4 stand-in ranks (no processes; os.kill recorded): rank 0 beats at
    every poll, rank 1 beat once and stopped, rank 2 has not started beating, rank 3
    stopped after leaving its run on purpose. Only rank 1 is killed, by SIGKILL, and
    named; a rank is judged by its own timeout_s, published beside its counter."""
    from types import SimpleNamespace

    from distsgd.runtime import launch as rlaunch

    killed, lines = [], []
    monkeypatch.setattr(rlaunch.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(rlaunch, "BEAT_POLL_S", 0.0)
    store = rendezvous_store("127.0.0.1", 0, world_size=1, timeout_s=5)
    running = SimpleNamespace(poll=lambda: None)
    handlers = {
        r: SimpleNamespace(proc=SimpleNamespace(poll=running.poll, pid=100 + r)) for r in range(4)
    }
    ranks = rlaunch.Ranks(
        4, "127.0.0.1", store.port, store, "", SimpleNamespace(subprocess_handlers=handlers)
    )
    prefix = rlaunch.namespace(run="1")
    for r in range(4):
        store.set(f"{prefix}timeout_s/{r}", "0.2")
    for r in (1, 3):
        store.add(f"{prefix}beat/{r}", 1)
    store.set(f"{prefix}left/3", "1")
    watch = rlaunch.RankWatch(ranks, prefix, lambda r, line: lines.append(line))
    deadline = time.monotonic() + GENEROUS_S
    while not watch.hung and time.monotonic() < deadline:
        store.add(f"{prefix}beat/0", 1)
        watch.poll()
        time.sleep(0.02)
    assert killed == [(101, signal.SIGKILL)] and list(watch.hung) == [1]
    assert lines == [lines[0]] and "rank 1 (pid 101) stopped making progress" in lines[0]
    del store


# ---- lost_ranks under torchrun ----------------------------------------------------------------
@pytest.mark.parametrize(
    "error, lost",
    [
        (PeerLost("lost contact with another rank; rank 1 stopped making progress", [1]), [1]),
        (ServerLost(0, "parameter server rank 0 lost"), [0]),
        (LearnerLost([2, 3], "compute group [2, 3] failed in all-reduce"), [2, 3]),
    ],
)
def test_rank_0_under_torchrun_names_the_lost_ranks_in_its_failed_summary(
    tmp_path, monkeypatch, error, lost
):
    """Under torchrun no distsgd launcher fills lost_ranks: rank 0 names the ranks its
    error names in the failed summary it wrote (before, lost_ranks was null)."""
    from distsgd import launch
    from distsgd.metrics import write_json

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    class Trainer:  # rank 0's run: writes its failed summary, then raises the loss
        def __init__(self, cfg, out, **kwargs):
            self.out = out

        def run(self, resume, **kwargs):
            write_json(self.out / "summary.json", {"status": "failed", "error": str(error)})
            raise error

    monkeypatch.setattr(launch, "Trainer", Trainer)
    with pytest.raises(type(error)):
        launch.run(config(HARDSYNC2), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == lost


# ---- a stopped rank of every role ends (kill -STOP) --------------------------------------------
_TRAIN_WITH_FAULTS = """
import json, sys
from distsgd.api import train
from distsgd.config import RunConfig
from distsgd.runtime.faults import RankFaults

cfg = RunConfig.from_toml(sys.argv[1])
faults = RankFaults(pid_dir=sys.argv[3], stop_at_step=json.loads(sys.argv[4]))
try:
    train(cfg, out_dir=sys.argv[2], faults=faults)
except RuntimeError as e:
    print(f"failed: {e}", file=sys.stderr)
    sys.exit(1)
"""


def _train_stopping(tmp_path: Path, cfg, stop_at_step: dict[int, int]) -> tuple[int, str, dict]:
    """Train ``cfg`` in a child process whose ranks SIGSTOP themselves at
    ``stop_at_step`` (RankFaults); returns (its exit status, its stderr, {rank: pid}).
    Fails if it has not ended within GENEROUS_S; every rank it started is killed after."""
    cfg_path, pids = tmp_path / "run.toml", tmp_path / "pids"
    cfg_path.write_text(cfg.to_toml())
    steps = json.dumps({str(r): n for r, n in stop_at_step.items()})
    argv = [sys.executable, "-c", _TRAIN_WITH_FAULTS, str(cfg_path), str(tmp_path / "run")]
    proc = subprocess.Popen(
        [*argv, str(pids), steps], cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        ranks = {int(f.stem[4:]): int(f.read_text()) for f in pids.glob("rank*.pid")}
        stopped = [r for r, p in ranks.items() if _running(p)]
        for p in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert stopped == [], f"ranks {stopped} were still running after the launcher ended"
    return proc.returncode, err, ranks


@pytest.mark.slow
def test_a_stopped_async_learner_is_killed_and_the_others_complete_the_run(tmp_path):
    """Async parameter server on 3 processes, learner rank 2 stopped (SIGSTOP) at its 3rd
    gradient: the launcher kills it once its heartbeat has been still for dist.timeout_s
    and names it; the server and learner 1 complete the run (before, the launcher waited
    for the stopped rank for good, holding run.lock, and printed nothing more)."""
    code, err, _ = _train_stopping(tmp_path, config(ASYNC, timeout_s=3), {2: 3})
    assert code == 0, err
    assert "rank 2 (pid" in err and "stopped making progress (no heartbeat); killing it" in err
    assert "the server goes on without it" in err
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["samples"] >= 1024  # one epoch
    assert not (out / "run.lock").exists()
    lost = [json.loads(r) for r in (out / "membership.jsonl").read_text().splitlines()]
    assert [(r["event"], r["worker"], r["ranks"]) for r in lost] == [("lost", 1, [2])]
    assert lost[0]["time_s"] > 0 and lost[0]["version"] >= 2


@pytest.mark.slow
def test_a_stopped_server_is_killed_and_named_and_the_run_ends(tmp_path):
    """Async parameter server on 3 processes, the server (rank 0) stopped at its 5th push:
    the learners give up on it after dist.timeout_s; the launcher kills it, names it as
    the cause (not "the server goes on without it"), writes the failed summary rank 0
    could not, and releases the run directory (before, nothing ended)."""
    code, err, _ = _train_stopping(tmp_path, config(ASYNC, timeout_s=3), {0: 5})
    assert code == 1, err
    assert "rank 0 (pid" in err and "killing it" in err
    assert "goes on without it" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("failed: rank 0 (server) stopped making progress"), last
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == [0]
    assert summary["written_by"] == "launcher"
    assert not (out / "run.lock").exists()


@pytest.mark.slow
def test_a_stopped_compute_group_member_is_killed_and_the_other_group_completes(tmp_path):
    """Compute groups (λ = 4, g = 2: ranks 1-2 and 3-4) on 5 processes, member rank 4
    stopped at its 3rd gradient: its group's all-reduce times out and the group is lost,
    the launcher kills rank 4, and the server completes the run with the other group."""
    groups = {"name": "compute_groups", "num_learners": 4, "num_groups": 2, "batch_size": 16}
    code, err, _ = _train_stopping(tmp_path, config(groups, timeout_s=3), {4: 3})
    assert code == 0, err
    assert "rank 4 (pid" in err and "killing it" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
