"""What is written to disk is what it claims: a checkpoint and its digest are a pair at
every step of their write, a full disk ends a run in one line with the last good
checkpoint intact, paths the OS refuses are refused before any work, and tensor files
holding more than tensors are refused in one line without running any of them."""

import errno
import json
import os
import shutil
import signal
import subprocess
import types
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.cli import main
from distsgd.metrics import load_checkpoint_file, save_checked, write_json
from tests.conftest import small_config


def one_line(capsys, argv, status=2, prefix="distsgd: error: "):
    assert main(argv) == status
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(prefix), err
    return err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run (its checkpoint and model, each with its digest), copied by tests
    that change it."""
    out = tmp_path_factory.mktemp("runs") / "run"
    distsgd.train(small_config(train={"max_epochs": 1}), out_dir=out)
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


# ---- a checkpoint and its digest: a pair at every step of the write ---------------------
_OPS = ("open", "write", "close", "replace")


def _save_killed_at(step: int, obj, path: Path) -> bool:
    """``save_checked(obj, path)`` in a forked child that SIGKILLs itself before its
    ``step``-th file-system operation (os.open / write / close / replace; a write is cut
    after half its bytes). Returns whether the kill came (False: the write had fewer
    steps and finished)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            done = [0]

            def killing(fn, name):
                def op(*args, **kwargs):
                    if done[0] == step:
                        if name == "write":
                            fd, data = args
                            fn(fd, bytes(data)[: len(data) // 2])
                        os.kill(os.getpid(), signal.SIGKILL)
                    done[0] += 1
                    return fn(*args, **kwargs)

                return op

            for name in _OPS:
                setattr(os, name, killing(getattr(os, name), name))
            save_checked(obj, path)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.slow
def test_a_kill_at_any_step_of_a_checkpoint_write_leaves_a_resumable_pair(
    finished_run, tmp_path, capsys
):
    """Before the fix the digest was renamed before the data: a kill between the two
    renames left the old checkpoint beside the new digest, and --resume refused it ("does
    not match its checksum") after the run had said "continue with --resume"."""
    old = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    new = {**old, "trainer": {**old["trainer"], "train_wall_s": -1.0}}  # told apart
    seen = []
    for step in range(50):
        out = tmp_path / f"killed-{step}"
        shutil.copytree(finished_run, out)
        killed = _save_killed_at(step, new, out / "checkpoint.pt")
        state = load_checkpoint_file(out / "checkpoint.pt", "resume")
        seen.append(state["trainer"]["train_wall_s"] == -1.0)
        if not killed:
            break
    # the old pair up to the data's rename, the new one from it on, and the write ends
    assert not killed and seen[0] is False and seen[-1] is True, seen
    flips = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert len(flips) == 1, seen
    # the run the issue saw: killed just after the data's rename, before the digest's
    between = tmp_path / f"killed-{flips[0]}"
    assert (between / "checkpoint.pt.sha256.tmp").exists()
    argv = ["train", "--resume", str(between), "--set", "train.max_epochs=2", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    assert not list(between.glob("*.tmp"))


def test_a_kill_during_the_first_write_leaves_no_file_or_a_checked_one(finished_run, tmp_path):
    """No previous pair: the file appears with its complete pending digest, which is
    checked (a flipped byte is refused, not loaded unchecked)."""
    state = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    for step in range(50):
        path = tmp_path / f"first-{step}" / "checkpoint.pt"
        path.parent.mkdir()
        killed = _save_killed_at(step, state, path)
        if path.exists():
            assert load_checkpoint_file(path, "resume")["trainer"] == state["trainer"]
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
            with pytest.raises(ValueError, match="does not match its checksum"):
                load_checkpoint_file(path, "resume")
        if not killed:
            break
    assert not killed


def test_a_digest_that_matches_neither_name_is_still_refused(run_copy, capsys):
    """The pending digest is accepted only when it is the file's own."""
    ckpt = run_copy / "checkpoint.pt"
    (run_copy / "checkpoint.pt.sha256.tmp").write_text("0" * 64 + "  checkpoint.pt\n")
    raw = bytearray(ckpt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(raw))
    err = one_line(capsys, ["train", "--resume", str(run_copy), "--set", "train.max_epochs=2"])
    assert "does not match its checksum checkpoint.pt.sha256" in err


# ---- files torch.load(weights_only=True) refuses: one line of ours -----------------------
class _Runs:
    """Unpickling this runs a shell command (what weights_only=True must refuse)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _code_file(path: Path, marker: Path) -> Path:
    torch.save({"weights": torch.zeros(3), "payload": _Runs(marker)}, path)
    return path


def _assert_ours(err: str, marker: Path) -> None:
    assert "holds a Python object (posix.system)" in err, err
    assert "weights_only" in err and "False" not in err and "safe_globals" not in err
    assert not marker.exists()  # nothing of the file ran


def test_resume_of_a_checkpoint_holding_code_is_one_line(run_copy, tmp_path, capsys):
    """Before the fix: torch's multi-line advice (rerun with weights_only=False, ...)."""
    marker = tmp_path / "ran"
    _code_file(run_copy / "checkpoint.pt", marker)
    (run_copy / "checkpoint.pt.sha256").unlink()
    err = one_line(capsys, ["train", "--resume", str(run_copy), "--set", "train.max_epochs=2"])
    assert err.startswith(f"distsgd: error: cannot resume: {run_copy / 'checkpoint.pt'} holds")
    _assert_ours(err, marker)


def test_export_of_a_checkpoint_holding_code_is_one_line(run_copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    _code_file(run_copy / "checkpoint.pt", marker)
    (run_copy / "checkpoint.pt.sha256").unlink()
    out = tmp_path / "model.pt"
    err = one_line(capsys, ["export", str(run_copy), "--out", str(out)])
    assert "cannot export" in err
    _assert_ours(err, marker)
    assert not out.exists()


def test_initial_weights_holding_code_are_one_line(tmp_path, capsys):
    marker = tmp_path / "ran"
    weights = _code_file(tmp_path / "w.pt", marker)
    cfg = tmp_path / "run.toml"
    cfg.write_text(small_config().to_toml())
    argv = ["train", str(cfg), "--out", str(tmp_path / "r"), "--quiet"]
    err = one_line(capsys, [*argv, "--set", f'train.initial_weights="{weights}"'])
    assert f"train.initial_weights = {str(weights)!r} is not allowed" in err
    _assert_ours(err, marker)
    assert not (tmp_path / "r").exists()


# ---- a full disk -------------------------------------------------------------------------
def _disk_full_after(monkeypatch, nbytes: int) -> None:
    """distsgd.metrics' writes fail with ENOSPC once ``nbytes`` more bytes were written
    (the write that crosses the limit writes what fits first, as a full disk does)."""
    room = [nbytes]

    def write(fd, data):
        n = min(len(data), room[0])
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        room[0] -= n
        return os.write(fd, bytes(data)[:n])

    monkeypatch.setattr("distsgd.metrics.os", types.SimpleNamespace(**{**vars(os), "write": write}))


def test_a_full_disk_leaves_the_previous_pair_and_no_temporary_file(run_copy, monkeypatch):
    ckpt = run_copy / "checkpoint.pt"
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    state = torch.load(ckpt, weights_only=True)
    _disk_full_after(monkeypatch, ckpt.stat().st_size // 2)
    with pytest.raises(OSError) as e:
        save_checked(state, ckpt)
    assert e.value.errno == errno.ENOSPC and e.value.filename == f"{ckpt}.tmp"
    with pytest.raises(OSError):
        write_json(run_copy / "summary.json", {"status": "failed"})
    after = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    assert after == before  # nothing half-written, no temporary file left


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size_bytes)`` mounts a tmpfs of that size on a new folder and returns it;
    every mount is undone at the end (skipped where this process may not mount)."""
    mounted = []

    def mount(size_bytes: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _full_disk_run(tmp_path, tmpfs, capsys, runtime: str):
    """A run whose second checkpoint does not fit its disk (sized after a run of the same
    config on an ample one): exit 74, one line naming the file and the directory, the
    first checkpoint intact, no temporary file left; then (sim) --resume on a larger
    disk."""
    cfg = tmp_path / "run.toml"
    budget = {"max_epochs": 1, "eval_every_samples": 256}
    config = small_config(protocol={"num_learners": 2, "batch_size": 16}, train=budget)
    cfg.write_text(config.to_toml())
    sizes = tmp_path / "sizes"
    assert main(["train", str(cfg), "--out", str(sizes), "--quiet"]) == 0
    ckpt, model = (sizes / "checkpoint.pt").stat().st_size, (sizes / "model.pt").stat().st_size
    capsys.readouterr()
    disk = tmpfs(ckpt + model + ckpt // 2)  # one checkpoint and its model, not a second
    out = disk / "run"
    argv = ["train", str(cfg), "--out", str(out), "--runtime", runtime, "--quiet"]
    if runtime == "dist":
        argv += ["--set", "dist.timeout_s=10"]
    assert main(argv) == 74
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"distsgd: error: could not write checkpoint.pt in {str(out)!r}: No space left on "
        f"device; the last checkpoint is kept (continue with --resume {out} once the "
        "directory can be written)"
    )
    if runtime == "sim":
        assert len(err.strip().splitlines()) == 1, err
    state = load_checkpoint_file(out / "checkpoint.pt", "resume")  # the first, intact
    assert state["trainer"]["evals"] == 1
    assert not list(out.rglob("*.tmp"))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["stop_reason"]) == ("failed", "write_failed")
    if runtime == "dist":  # resumes as the simulated run does (shown there; ranks are slow)
        return
    subprocess.run(["mount", "-o", f"remount,size={4 * (ckpt + model)}", str(disk)], check=True)
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_a_full_disk_ends_a_sim_run_in_one_line_keeping_its_checkpoint(tmp_path, tmpfs, capsys):
    """Before the fix: an OSError traceback, checkpoint.pt.tmp filling the disk, no
    summary."""
    _full_disk_run(tmp_path, tmpfs, capsys, "sim")


@pytest.mark.slow
def test_a_full_disk_ends_a_dist_run_in_one_line_keeping_its_checkpoint(tmp_path, tmpfs, capsys):
    """Before the fix: a traceback from rank 0, another from the launcher writing its
    summary, and an empty summary.json.tmp."""
    _full_disk_run(tmp_path, tmpfs, capsys, "dist")


# ---- paths the OS refuses: one line, exit 2, before any work -----------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Nothing is measured, built or started: a refused path is refused first."""

    def fail(*args, **kwargs):
        raise AssertionError("work started before the path was checked")

    monkeypatch.setattr("distsgd.launch._launch_local", fail)
    monkeypatch.setattr("distsgd.api.measure_device", fail)
    monkeypatch.setattr("distsgd.trainer.Trainer._build", fail)


def _proc_refuses() -> None:
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")


@pytest.mark.parametrize("runtime", ["sim", "dist"])
@pytest.mark.parametrize("where", ["long-name", "proc"])
def test_an_out_the_os_refuses_is_one_line_exit_2(tmp_path, capsys, no_work, runtime, where):
    """Before the fix: OSError: File name too long (a traceback); /proc: "could not be
    claimed (lock file churn)" after ten tries."""
    if where == "proc":
        _proc_refuses()
    out = tmp_path / ("a" * 300) if where == "long-name" else Path("/proc/distsgd-run")
    cfg = tmp_path / "run.toml"
    cfg.write_text(small_config().to_toml())
    err = one_line(capsys, ["train", str(cfg), "--out", str(out), "--runtime", runtime])
    fragment = (
        "has 300 bytes, the file system allows 255"
        if where == "long-name"
        else ("'/proc' does not take new folders")
    )
    assert "--out " in err and fragment in err
    assert os.listdir(tmp_path) == ["run.toml"]


def test_calibrate_checks_where_it_writes_before_measuring(tmp_path, capsys, no_work, monkeypatch):
    """Before the fix: a traceback after the whole measurement (24 s)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(small_config().to_toml())
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    monkeypatch.setenv("DISTSGD_PROFILE_CACHE", str(a_file))
    err = one_line(capsys, ["calibrate", str(cfg)])
    assert f"DISTSGD_PROFILE_CACHE = {str(a_file)!r} is not allowed" in err
    monkeypatch.setenv("DISTSGD_PROFILE_CACHE", str(tmp_path / "cache"))
    err = one_line(capsys, ["calibrate", str(cfg), "--out", str(tmp_path / ("p" * 300))])
    assert "--out " in err and "file system allows 255" in err
    _proc_refuses()
    err = one_line(capsys, ["calibrate", str(cfg), "--out", "/proc/p.toml"])
    assert err.endswith(
        "--out '/proc/p.toml' is not allowed: '/proc' does not take new files (No such file "
        "or directory); choose a folder on a writable disk"
    )
    assert a_file.read_text() == "mine" and not (tmp_path / "cache").exists()


def test_export_and_resume_check_their_paths_first(run_copy, tmp_path, capsys):
    long = tmp_path / ("r" * 300)
    err = one_line(capsys, ["train", "--resume", str(long)])
    assert "--resume " in err and "file system allows 255" in err
    err = one_line(capsys, ["export", str(long)])
    assert "RUN_DIR " in err and "file system allows 255" in err
    _proc_refuses()
    err = one_line(capsys, ["export", str(run_copy), "--out", "/proc/model.pt"])
    assert "'/proc' does not take new files" in err


def test_the_launchers_failed_summary_on_a_full_disk_leaves_the_error_alone(tmp_path, monkeypatch):
    """Rank 0 killed and the disk full: the launcher's summary.json cannot be written; the
    run ends on the lost rank (before the fix: an OSError traceback from the launcher)."""
    from distsgd import launch

    def full(path, obj):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("distsgd.launch.write_json", full)
    cfg = small_config(protocol={"num_learners": 2, "batch_size": 16}, runtime="dist")
    errors = {1: {"kind": "lost", "message": "lost contact with another rank"}}
    with pytest.raises(launch.DistRunFailed, match="rank 0 .* killed"):
        launch._outcome(cfg, tmp_path, {0: -9, 1: 3}, {0: -9, 1: 3}, errors)


def test_a_full_disk_under_tensorboard_names_its_events(tmp_path, monkeypatch):
    """TensorBoard writes in its own thread and raises the error, naming no file, at the
    next write or close: named as the run directory holds it."""
    from distsgd.metrics import OutputWriteError, TensorBoardWriter

    tb = TensorBoardWriter(tmp_path / "tb")
    if not tb.enabled:
        pytest.skip("tensorboard is not installed")

    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tb._writer, "flush", full)
    with pytest.raises(OSError) as e:
        tb.write({"samples": 1, "eval_metric": 0.5})
    assert str(OutputWriteError.of(e.value, tmp_path)) == (
        f"could not write tb/events.out.tfevents in {str(tmp_path)!r}: No space left on device"
    )
    tb.close()
