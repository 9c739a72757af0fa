"""Issue #12, the local faults: the run directory (one run at a time, a directory that
cannot be one), checkpoints (what distsgd did not write, corruption), a run without
evaluation, process counts this machine cannot hold and contradictory schedules."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.cli import main
from distsgd.control import RunOptions
from distsgd.trainer import Trainer
from tests.conftest import small_config

REPO = str(Path(__file__).resolve().parents[1])


def write_config(tmp_path, name="run.toml", **sections):
    path = tmp_path / name
    path.write_text(small_config(**sections).to_toml())
    return str(path)


def one_line_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("distsgd: error: "), err
    return err


@pytest.fixture
def no_rank_starts(monkeypatch):
    """A dist run refused in the launching process starts no rank."""

    def fail(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("distsgd.launch._launch_local", fail)


# ---- 4: two runs into one --out ------------------------------------------------------------
def test_a_second_run_started_with_the_first_is_refused_naming_the_holder(
    tmp_path, capsys, monkeypatch
):
    """The race made deterministic: the second run starts while the first builds (after
    its directory check, before it writes anything). Before the fix both exited 0 and the
    files mixed both seeds."""
    first = write_config(tmp_path, "first.toml", train={"seed": 1})
    second = write_config(tmp_path, "second.toml", train={"seed": 2})
    out = tmp_path / "run"
    second_status = []
    build = Trainer._build

    def build_while_a_second_run_starts(self):
        if not second_status:
            second_status.append("started")
            second_status.append(main(["train", second, "--out", str(out), "--quiet"]))
            second_status.append(capsys.readouterr().err)
        build(self)

    monkeypatch.setattr(Trainer, "_build", build_while_a_second_run_starts)
    assert main(["train", first, "--out", str(out), "--quiet"]) == 0
    _, status, err = second_status
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "is in use by another run" in err
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in err
    # one run's files only: the first's
    assert "seed = 1" in (out / "config.toml").read_text()
    assert json.loads((out / "summary.json").read_text())["seed"] == 1
    assert not (out / "run.lock").exists()  # released when the run ended


def test_the_claim_is_released_for_resume_and_a_failed_start_leaves_nothing(tmp_path, capsys):
    cfg = write_config(tmp_path)
    out = tmp_path / "a" / "b" / "run"
    assert main(["train", cfg, "--out", str(out), "--quiet"]) == 0
    assert main(["train", "--resume", str(out), "--set", "train.max_epochs=3", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3
    # a start that fails (missing data) removes the claim and the folders it made
    missing = ["--set", "data.dataset=fashion_mnist", "--set", f"data.root={tmp_path / 'no'}"]
    one_line_exit_2(capsys, ["train", cfg, "--out", str(tmp_path / "x" / "y"), *missing])
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_run_in_another_process_holds_the_directory_until_it_ends(tmp_path):
    """Two processes: the second is refused naming the first's pid; once the first has
    ended (SIGTERM: interrupted, checkpoint kept) the lock is gone and --resume works."""
    cfg = write_config(
        tmp_path, train={"max_epochs": 0, "max_samples": 10**9, "eval_every_samples": 1024}
    )
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "distsgd", "train"]
    first = subprocess.Popen([*cli, cfg, "--out", str(out), "--quiet"], env=env)
    try:
        # wait (no time limit on the work, only a generous one on the test) until the
        # first run has written a checkpoint: it holds the directory
        deadline = time.monotonic() + 600
        while not (out / "checkpoint.pt").exists():
            assert first.poll() is None, "the first run ended early"
            assert time.monotonic() < deadline, "the first run wrote no checkpoint"
            time.sleep(0.2)
        second = subprocess.run(
            [*cli, cfg, "--out", str(out), "--quiet"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert second.returncode == 2
        err = second.stderr.strip().splitlines()
        assert len(err) == 1, second.stderr
        assert f"is in use by another run (pid {first.pid} on host" in err[0]
    finally:
        first.terminate()
        first.wait(timeout=600)
    assert first.returncode == 130
    assert not (out / "run.lock").exists()
    resumed = subprocess.run(
        [*cli, "--resume", str(out), "--set", "train.max_samples=4096", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.slow
def test_a_dist_run_is_claimed_by_its_launcher_and_its_rank_0_writes_under_it(
    tmp_path, capsys, monkeypatch
):
    """The launching process holds the directory before any rank starts (a second run is
    refused naming it); rank 0, told the launcher holds it, writes the run; the claim is
    gone when the run has ended."""
    from distsgd import launch

    cfg = write_config(tmp_path, protocol={"num_learners": 2, "batch_size": 16})
    out = tmp_path / "run"
    second = []
    launch_local = launch._launch_local

    def launch_after_a_second_run(*args, **kwargs):
        second.append(main(["train", cfg, "--out", str(out), "--quiet"]))
        second.append(capsys.readouterr().err)
        return launch_local(*args, **kwargs)

    monkeypatch.setattr(launch, "_launch_local", launch_after_a_second_run)
    argv = ["train", cfg, "--runtime", "dist", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    status, err = second
    assert status == 2 and f"is in use by another run (pid {os.getpid()} on host" in err
    assert json.loads((out / "summary.json").read_text())["num_processes"] == 2
    assert not (out / "run.lock").exists()
    assert main(["train", "--resume", str(out), "--set", "train.max_epochs=3", "--quiet"]) == 0


# ---- 6: --out a file or not writable -------------------------------------------------------
@pytest.mark.parametrize("runtime", ["sim", "dist"])
def test_out_that_is_a_file_is_one_line_exit_2(tmp_path, capsys, runtime, no_rank_starts):
    """Before the fix: sim, a traceback; dist, a rank lost on it."""
    cfg = write_config(tmp_path)
    f = tmp_path / "file"
    f.write_text("mine")
    for out, fragment in ((f, "is a file"), (f / "run", "a file")):
        argv = ["train", cfg, "--out", str(out), "--runtime", runtime, "--quiet"]
        err = one_line_exit_2(capsys, argv)
        assert f"--out {str(out)!r}" in err and fragment in err
    assert f.read_text() == "mine"


@pytest.mark.parametrize("runtime", ["sim", "dist"])
def test_out_that_is_not_writable_is_one_line_exit_2(
    tmp_path, capsys, monkeypatch, runtime, no_rank_starts
):
    cfg = write_config(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: this process is told it may not
        real = os.access
        monkeypatch.setattr(
            "distsgd.rundir.os.access", lambda p, m: Path(p) != locked and real(p, m)
        )
    else:
        locked.chmod(0o500)
    argv = ["train", cfg, "--out", str(locked / "run"), "--runtime", runtime, "--quiet"]
    err = one_line_exit_2(capsys, argv)
    assert "is not writable" in err and str(locked) in err
    assert not (locked / "run").exists()


# ---- 7: a checkpoint.pt distsgd did not write ---------------------------------------------
@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "run"
    distsgd.train(small_config(train={"max_epochs": 1}), out_dir=out)
    return out


def _replace_checkpoint(run_dir, obj):
    """A file distsgd did not write: no checksum beside it."""
    torch.save(obj, run_dir / "checkpoint.pt")
    (run_dir / "checkpoint.pt.sha256").unlink(missing_ok=True)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda state: torch.zeros(3), "holds a Tensor, not a checkpoint written by distsgd"),
        (lambda state: [1, 2], "holds a list, not a checkpoint written by distsgd"),
        (
            lambda state: {k: v for k, v in state.items() if k not in ("protocol", "trainer")},
            "not a checkpoint written by distsgd: it lacks protocol, trainer",
        ),
        (  # found by a fresh-clone review: said "has format None, expected 1"
            lambda state: {"weights": torch.zeros(3)},
            "not a checkpoint written by distsgd: it lacks format",
        ),
        (
            lambda state: {**state, "trainer": [0]},
            "not a checkpoint written by distsgd: its 'trainer' is a list",
        ),
        (
            lambda state: {**state, "protocol": {"bogus": 1}},
            "does not hold the state of this run's components",
        ),
    ],
    ids=["tensor", "list", "missing-keys", "foreign-dict", "wrong-type", "wrong-contents"],
)
def test_resume_of_a_checkpoint_distsgd_did_not_write_is_one_line_exit_2(
    finished_run, capsys, make, fragment
):
    """Before the fix: AttributeError / KeyError tracebacks."""
    state = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    _replace_checkpoint(finished_run, make(state))
    err = one_line_exit_2(
        capsys, ["train", "--resume", str(finished_run), "--set", "train.max_epochs=2"]
    )
    assert "cannot resume" in err and fragment in err


# ---- 9: train.evaluate = false -------------------------------------------------------------
def test_a_run_without_evaluation_summarises_none_and_prints(tmp_path, capsys):
    """Before the fix: best_metric 0.0 in summary.json, then a TypeError (exit 1)."""
    cfg = write_config(tmp_path, train={"evaluate": False})
    out = tmp_path / "run"
    assert main(["train", cfg, "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_metric"] is None and summary["final_metric"] is None
    assert summary["reached"] is False
    assert "accuracy      not evaluated (train.evaluate = false)" in capsys.readouterr().out


# ---- 10: more processes than this machine holds -------------------------------------------
def test_dist_process_count_beyond_this_machine_is_one_line_exit_2(
    tmp_path, capsys, monkeypatch, no_rank_starts
):
    """Before the fix: --num-processes 4096 was accepted and started."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = write_config(tmp_path)
    out = tmp_path / "run"
    argv = ["train", cfg, "--runtime", "dist", "--out", str(out), "--quiet"]
    err = one_line_exit_2(capsys, [*argv, "--num-processes", "4096"])
    assert "dist.num_processes = 4096 is not allowed on this machine: expected at most" in err
    assert "4 per CPU core × 2 cores" in err and "MiB per rank" in err
    # with num_processes = 0 the protocol's count is named: the setting behind it
    err = one_line_exit_2(capsys, [*argv, "--set", "protocol.num_learners=64"])
    assert "protocol.num_learners = 64 is not allowed on this machine" in err
    assert "the run needs 64 processes" in err
    assert not out.exists()


def test_a_dist_runs_ranks_and_claim_are_derived_once_and_passed_to_the_launcher(
    tmp_path, capsys, monkeypatch
):
    """``distsgd train --runtime dist --num-processes 3``: the processes are checked once
    on the way down, the launcher starts the count checked, and is told the directory is
    claimed (its ranks take no claim of their own)."""
    from distsgd import api, commands
    from distsgd.config import check_local_processes

    checks, launched = [], {}

    def counted(cfg):
        checks.append(cfg.dist.num_processes)
        return check_local_processes(cfg)

    def launch_local(cfg, out, n, **kwargs):
        launched.update(n=n, claimed=kwargs["dir_claimed"], held=(out / "run.lock").exists())
        raise distsgd.ConfigError("stopped before any rank starts")

    monkeypatch.setattr(commands, "check_local_processes", counted)
    monkeypatch.setattr(api, "check_local_processes", counted)
    monkeypatch.setattr("distsgd.launch._launch_local", launch_local)
    cfg = write_config(tmp_path, protocol={"num_learners": 2, "batch_size": 16})
    out = tmp_path / "run"
    argv = ["train", cfg, "--runtime", "dist", "--num-processes", "3", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 2
    assert "stopped before any rank starts" in capsys.readouterr().err
    assert checks == [3]
    assert launched == {"n": 3, "claimed": True, "held": True}


def test_the_process_limit_counts_the_memory_of_each_ranks_dataset(monkeypatch):
    from distsgd.config import RANK_BASE_MEMORY_BYTES, RunConfig, local_process_limit

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    page = os.sysconf("SC_PAGE_SIZE")
    # exactly 3 ranks of Fashion-MNIST: 70,000 samples × 784 float32 each, plus the base
    per_rank = RANK_BASE_MEMORY_BYTES + 4 * 70000 * 784
    pages = -(-3 * per_rank // page)
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda k: pages if k == "SC_PHYS_PAGES" else real(k))
    assert local_process_limit(RunConfig())[0] == 3


# ---- 12: a corrupted checkpoint ------------------------------------------------------------
def _corrupt_tensor_data(path: Path, nbytes: int = 4096) -> None:
    """Overwrite ``nbytes`` inside the largest tensor record of a torch.save zip file,
    leaving the zip structure intact (torch.load still succeeds)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert info.file_size >= 2 * nbytes
    raw = bytearray(path.read_bytes())
    # local file header: 30 bytes, then the name and the extra field
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    # plausible values (0.5 as float32), so that training goes on and only a checksum
    # can tell
    raw[start : start + nbytes] = torch.full((nbytes // 4,), 0.5).numpy().tobytes()
    path.write_bytes(bytes(raw))
    torch.load(path, weights_only=True)  # still loads


def test_resume_of_a_corrupted_checkpoint_is_refused(finished_run, capsys):
    """Before the fix: exit 0 and a fresh checkpoint written around the garbage."""
    ckpt = finished_run / "checkpoint.pt"
    _corrupt_tensor_data(ckpt)
    corrupted = ckpt.read_bytes()
    err = one_line_exit_2(
        capsys, ["train", "--resume", str(finished_run), "--set", "train.max_epochs=2"]
    )
    assert "cannot resume" in err and "does not match its checksum checkpoint.pt.sha256" in err
    assert ckpt.read_bytes() == corrupted  # nothing written over it


@pytest.fixture
def weights_run(tmp_path):
    src = tmp_path / "src"
    cfg = small_config(train={"max_epochs": 1, "save_eval_weights": True})
    Trainer(cfg, src, progress=False, options=RunOptions(record=True)).run()
    return src


def test_every_tensor_file_has_a_sha256_sidecar(weights_run):
    """``<file>.sha256`` in sha256sum's format, for each file distsgd writes with torch."""
    files = [
        weights_run / "checkpoint.pt",
        weights_run / "final_weights.pt",
        *sorted((weights_run / "eval_weights").glob("*.pt")),
    ]
    assert len(files) == 5  # evaluations at 0, 512 and 1024 samples
    for f in files:
        side = f.with_name(f.name + ".sha256").read_text().split()
        assert side == [hashlib.sha256(f.read_bytes()).hexdigest(), f.name]
    assert not list(weights_run.rglob("*.tmp"))


def test_initial_weights_are_verified_where_a_checksum_exists(tmp_path, capsys, weights_run):
    """A corrupted eval_weights/NNNN.pt is refused as initial weights (before the fix: the
    run started from the garbage); a user's own file without a checksum is accepted."""
    src = weights_run
    weights = src / "eval_weights" / "0001.pt"
    own = tmp_path / "own.pt"
    torch.save(torch.load(weights, weights_only=True), own)  # no checksum beside it
    _corrupt_tensor_data(weights)
    cfg = write_config(tmp_path)
    err = one_line_exit_2(
        capsys,
        ["train", cfg, "--out", str(tmp_path / "r"), "--set", f'train.initial_weights="{weights}"'],
    )
    assert f"train.initial_weights = {str(weights)!r} is not allowed" in err
    assert "does not match its checksum 0001.pt.sha256" in err
    argv = ["train", cfg, "--out", str(tmp_path / "r2"), "--quiet"]
    assert main([*argv, "--set", f'train.initial_weights="{own}"']) == 0


def test_a_checksum_that_is_not_a_digest_is_a_mismatch(finished_run, capsys):
    (finished_run / "checkpoint.pt.sha256").write_text("")
    err = one_line_exit_2(
        capsys, ["train", "--resume", str(finished_run), "--set", "train.max_epochs=2"]
    )
    assert "recorded nothing" in err


# ---- 15: schedule settings the budget contradicts -----------------------------------------
def test_schedule_conflicts_warn_in_one_line_each_and_the_run_goes_on(tmp_path, capsys):
    """Before the fix: accepted silently."""
    cfg = write_config(
        tmp_path,
        schedule={"kind": "step", "warmup_epochs": 5.0, "decay_epochs": [0.5, 5.0]},
        train={"max_epochs": 1},
    )
    assert main(["train", cfg, "--out", str(tmp_path / "run"), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "distsgd: warning: schedule.warmup_epochs = 5.0 with train.max_epochs = 1: the "
        "warm-up does not end before the budget, so the whole run trains at warm-up rates",
        "distsgd: warning: schedule.decay_epochs = [0.5, 5.0] with train.max_epochs = 1: "
        "the decay at epoch(s) [5.0] is never reached",
    ]


def test_schedule_conflicts_warn_from_the_library_and_count_max_samples(tmp_path):
    cfg = small_config(
        schedule={"warmup_epochs": 1.0}, train={"max_epochs": 0, "max_samples": 512}
    )  # 512 of 1024 training samples: half an epoch
    with pytest.warns(UserWarning, match=r"schedule.warmup_epochs = 1.0 with train.max_samp"):
        distsgd.train(cfg, out_dir=tmp_path / "run")


def test_a_schedule_within_the_budget_does_not_warn(tmp_path, recwarn):
    cfg = small_config(
        schedule={"kind": "step", "warmup_epochs": 0.5, "decay_epochs": [1.5]},
        train={"max_epochs": 2},
    )
    distsgd.train(cfg, out_dir=tmp_path / "run")
    assert not [w for w in recwarn if "schedule." in str(w.message)]


def test_a_diloco_run_that_ends_before_its_first_outer_step_warns(recwarn):
    """A DiLoCo run over fewer samples than H · λ · b never moves θ, the model it
    evaluates: the budget is said to contradict protocol.average_every."""
    from distsgd.config import schedule_conflicts

    diloco = {"name": "diloco", "num_learners": 2, "batch_size": 32, "average_every": 8}
    short = small_config(protocol=diloco, train={"max_epochs": 0, "max_samples": 256})
    assert schedule_conflicts(short) == [
        "protocol.average_every = 8 with train.max_samples = 256 (0.25 epochs of 1024 "
        "samples): the run ends before DiLoCo's first outer step (512 samples), so the "
        "evaluated model θ stays the initial weights"
    ]
    assert schedule_conflicts(small_config(protocol=diloco)) == []  # 2 epochs: it steps
    local = small_config(protocol={**diloco, "name": "local_sgd"}, train={"max_samples": 256})
    assert schedule_conflicts(local) == []  # local SGD evaluates the replicas' mean
