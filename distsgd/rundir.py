"""The run directory: one run owns it for its whole life.

:func:`check_out_dir_writable` refuses a run directory that cannot be one before anything
starts; :class:`RunDirClaim` is the run's exclusive claim on it (an OS lock on
``<out_dir>/run.lock`` naming its holder), so two runs never write one directory;
:func:`enclosing_tuner_dir` finds the tuner's directory whose probes or segments folder
holds a path (they are the tuner's to write).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from distsgd.config import ConfigError

__all__ = [
    "RUN_LOCK",
    "TUNER_FOLDERS",
    "TUNER_MARK",
    "RunDirClaim",
    "check_out_dir_writable",
    "enclosing_tuner_dir",
]

RUN_LOCK = "run.lock"
TUNER_MARK = "decisions.jsonl"  # what a tuner's directory holds (distsgd tune, train --tune)


TUNER_FOLDERS = ("probes", "train")  # a tuner's probes, and the segments of --tune


def enclosing_tuner_dir(path: str | Path) -> Path | None:
    """The directory of ``distsgd tune`` or ``distsgd train --tune`` (it holds
    ``decisions.jsonl``) whose ``probes/`` or ``train/`` folder holds ``path`` at any
    depth (e.g. a probe's run directory); None when there is none."""
    full = Path(path).resolve()
    for parent in full.parents:
        if full.relative_to(parent).parts[0] in TUNER_FOLDERS and (parent / TUNER_MARK).is_file():
            return parent
    return None


def check_out_dir_writable(out_dir: str | Path) -> None:
    """Refuse a run directory that cannot be one, before anything is started or written.

    Raises:
        ConfigError: ``out_dir`` (or a folder on its path) is a file, or the directory
            (or, when it does not exist yet, the nearest existing folder above it) is not
            writable by this process.
    """
    out = Path(out_dir)
    for node in (out, *out.parents):
        if node.exists() or node.is_symlink():
            if not node.is_dir():
                what = "is a file" if node == out else f"lies under {str(node)!r}, a file"
                raise ConfigError(
                    f"--out {str(out)!r} {what}: expected a directory (new, or a run's)"
                )
            if not os.access(node, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"--out {str(out)!r} is not writable: {str(node)!r} does not allow this "
                    "process to create files; choose a writable directory"
                )
            return


class RunDirClaim:
    """One run's exclusive claim on its run directory, held for the run's whole life.

    An OS lock, ``fcntl.flock`` on ``<out_dir>/run.lock`` (released by the kernel when the
    holding process ends, however it ends), with the holder's pid, host and start time
    written in the file so that a refused run can name it. Two runs into one directory:
    the second stops with a :class:`ConfigError` naming the first. The lock file is
    removed when the claim is released, and so is the directory when the claim created
    it and nothing else was written.

    Who holds it: the process that owns the run directory: the one running a ``sim`` run;
    the launching process of a ``dist`` run on one machine (its rank 0 finds the claim
    held by its parent and goes on); rank 0 under torchrun.

    Example::

        claim = RunDirClaim.acquire("runs/r")
        try:
            ...  # write the run
        finally:
            claim.release()
    """

    def __init__(self, out_dir: Path, fd: int, created: list[Path]) -> None:
        self.out_dir = out_dir
        self.path = out_dir / RUN_LOCK
        self._fd: int | None = fd
        self._created = created  # the folders the claim made, deepest first

    @classmethod
    def acquire(cls, out_dir: str | Path, *, parent_may_hold: bool = False) -> RunDirClaim | None:
        """Create ``out_dir`` if missing and claim it.

        Args:
            out_dir: the run directory.
            parent_may_hold: a claim held by this process's parent on this host is the
                run's own (a rank started by the local launcher): return None.

        Raises:
            ConfigError: ``out_dir`` cannot be created or written, or another run holds
                it (the message names its pid and host).
        """
        out = Path(out_dir)
        check_out_dir_writable(out)
        for _ in range(10):  # retried only if the lock file was removed under us
            created = [d for d in (out, *out.parents) if not d.exists()]
            try:
                out.mkdir(parents=True, exist_ok=True)
                fd = os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue  # the folder was removed by a claim ending just now
            except OSError as e:
                raise ConfigError(
                    f"--out {str(out)!r} cannot be written: {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if parent_may_hold and _is_parent(holder):
                    return None
                raise ConfigError(
                    f"output directory {str(out)!r} is in use by another run "
                    f"({_describe_holder(holder)}); wait for it to end or choose another "
                    "output directory (--out)"
                ) from None
            if _same_file(fd, out / RUN_LOCK):
                _write_holder(fd)
                return cls(out, fd, created)
            os.close(fd)  # we locked a lock file that its holder removed: try again
        raise ConfigError(f"output directory {str(out)!r} could not be claimed (lock file churn)")

    def release(self) -> None:
        """End the claim: remove the lock file (and the directory if the claim created it
        and it is empty, with the missing folders above it), then unlock. Idempotent."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            for folder in self._created:
                folder.rmdir()  # only if nothing else was written
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_holder(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": datetime.now().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _is_parent(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getppid() and holder.get("host") == socket.gethostname()


def _describe_holder(holder: dict[str, Any]) -> str:
    if "pid" not in holder:
        return "holder not yet recorded"
    since = f" since {holder['started_at']}" if holder.get("started_at") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{since}"
