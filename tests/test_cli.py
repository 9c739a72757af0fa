"""The command line as a user meets it: exit codes, one-line errors, the final summary."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tqdm import tqdm

from distsgd.commands import _one_line_config_warning
from distsgd.config import ConfigWarning

from .conftest import cli_in_process

REPO = str(Path(__file__).resolve().parents[1])


def run_cli_process(*args, cwd=None):
    """``distsgd ARGS`` in a real process of this checkout's package, whatever copy is
    installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "distsgd", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "optimizer.lr=-1"], "optimizer.lr = -1"),
        (["--set", "protocol.name=bogus"], "protocol.name = 'bogus'"),
        (
            [
                "--set",
                "protocol.softsync=3",
                "--set",
                "protocol.name=parameter_server",
                "--set",
                "protocol.num_learners=4",
            ],
            "protocol.softsync = 3",
        ),
        (["--set", "optimizer.learning_rate=1"], "optimizer.learning_rate is not a setting"),
        (["missing.toml"], "missing.toml"),
        (["--set", "data.root=/nonexistent/fmnist"], "/nonexistent/fmnist"),
        (["."], "is a directory"),
        (["--set", "train.num_threads=100000"], "train.num_threads = 100000"),
        (["--set", "train.seed=99999999999999999999"], "train.seed"),
        (["--set", "data.num_train=100000000"], "data.num_train = 100000000"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path, args, fragment):
    r = cli_in_process("train", *args, "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("distsgd: error:")
    assert fragment in lines[0]
    assert "Traceback" not in r.stderr


def test_a_user_error_in_a_real_process_is_one_line_exit_2(tmp_path):
    r = run_cli_process("train", "--set", "optimizer.lr=-1", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "distsgd: error: optimizer.lr = -1 is not allowed: expected a number in (0.0, 1000.0]"
    ]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_train_prints_summary_and_writes_run(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        """
[data]
dataset = "synthetic"
num_train = 512
num_test = 128
[model]
name = "mlp"
[protocol]
name = "parameter_server"
mode = "async"
num_learners = 2
batch_size = 32
[cluster]
seconds_per_sample = 1e-4
seconds_per_batch = 1e-3
[train]
target = 0.3
max_epochs = 2
num_threads = 1
"""
    )
    r = run_cli_process("train", str(cfg), "--out", str(tmp_path / "run"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "to target" in r.stdout and "staleness" in r.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reached"] is True
    # resume a finished run with a bigger budget
    r2 = run_cli_process(
        "train",
        "--resume",
        str(tmp_path / "run"),
        "--set",
        "train.max_epochs=3",
        "--set",
        "train.stop_at_target=false",
        "--quiet",
    )
    assert r2.returncode == 0, r2.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epochs"] == pytest.approx(3.0, abs=0.07)


def test_non_utf8_config_and_config_with_resume(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[protocol]")
    r = cli_in_process("train", str(bad))
    assert r.returncode == 2 and "not UTF-8" in r.stderr and str(bad) in r.stderr
    r = cli_in_process("train", str(bad), "--resume", str(tmp_path))
    assert r.returncode == 2 and "do not pass a config" in r.stderr


@pytest.mark.parametrize("args", [["train", "--bogus"], [], ["train", "a.toml", "b.toml"]])
def test_usage_errors_are_one_line(args):
    r = cli_in_process(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr


def test_a_config_warning_prints_on_its_own_line_above_a_progress_bar(capsys):
    """A fresh-user review: ``--tune``'s warnings were printed on its progress bar's line."""
    show = _one_line_config_warning(warnings.showwarning)
    with tqdm(total=10, file=sys.stderr, bar_format="{n}/{total} tune") as bar:
        bar.update(3)
        show(ConfigWarning("probes too short"), ConfigWarning, "x.py", 1)
    err = capsys.readouterr().err
    before, _, after = err.partition("distsgd: warning: probes too short\n")
    assert before.rstrip(" ").endswith(("\r", "\n")) and "3/10 tune" in after


class _InterruptedImport:
    """A meta-path finder that raises Ctrl-C's KeyboardInterrupt when ``name`` is imported
    (as a SIGINT does while torch loads)."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise KeyboardInterrupt
        return None


@pytest.mark.parametrize("argv", [["join", "runs/x"], ["report", "runs/x"], ["train"]])
def test_ctrl_c_while_the_commands_load_is_one_line_exit_130(monkeypatch, capsys, argv):
    import distsgd
    from distsgd import cli

    monkeypatch.delitem(sys.modules, "distsgd.commands")
    monkeypatch.delattr(distsgd, "commands")
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport("distsgd.commands"), *sys.meta_path])
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err == "distsgd: interrupted while starting; nothing was run\n"


def test_the_entry_point_imports_only_the_standard_library():
    """The console script's module loads nothing that takes seconds (torch): an interrupt
    while the commands load is caught in its main."""
    import ast

    from distsgd import cli

    tree = ast.parse(Path(cli.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert names and {m.split(".")[0] for m in names} <= sys.stdlib_module_names | {"__future__"}
