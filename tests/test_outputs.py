"""What is written to disk is what it claims: a checkpoint and its digest are a pair at
every step of their write, a full disk ends a run in one line with the last good
checkpoint intact, paths the OS refuses are refused before any work, and tensor files
holding more than tensors are refused in one line without running any of them."""

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.cli import main
from distsgd.metrics import load_checkpoint_file, save_checked
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
