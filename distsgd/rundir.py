"""The run directory: one run owns it for its whole life.

:class:`RunDirClaim` is the one guard of a run directory, taken once by the process that
owns the run (a ``sim`` run's process, the launcher of a ``dist`` run on one machine,
rank 0 under torchrun) and held for the run's life: it checks the path
(:func:`check_out_path`), creates the directory, locks ``<out_dir>/run.lock`` (naming its
holder) and, for a new run, refuses a directory that holds one
(:func:`check_new_run_dir`). :func:`check_out_file` checks a file to be written (a
profile, an exported model) before any work; :func:`enclosing_tuner_dir` finds the
tuner's directory whose probes or segments folder holds a path (they are the tuner's to
write).
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
    "RUN_FILES",
    "RunDirClaim",
    "check_new_run_dir",
    "check_out_file",
    "check_out_path",
    "check_path_names",
    "enclosing_tuner_dir",
]

RUN_LOCK = "run.lock"
TUNER_MARK = "decisions.jsonl"  # what a tuner's directory holds (distsgd tune, train --tune)


TUNER_FOLDERS = ("probes", "train")  # a tuner's probes, and the segments of --tune
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoint.pt")  # a directory holding a run


def enclosing_tuner_dir(path: str | Path) -> Path | None:
    """The directory of ``distsgd tune`` or ``distsgd train --tune`` (it holds
    ``decisions.jsonl``) whose ``probes/`` or ``train/`` folder holds ``path`` at any
    depth (e.g. a probe's run directory); None when there is none."""
    full = Path(path).resolve()
    for parent in full.parents:
        if full.relative_to(parent).parts[0] in TUNER_FOLDERS and (parent / TUNER_MARK).is_file():
            return parent
    return None


def _exists(path: Path) -> bool:
    """Whether ``path`` exists (a dangling link too); False for a name the OS refuses."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def check_path_names(path: str | Path, option: str) -> None:
    """Refuse a path (to read or to write) that has a name longer than the file system
    allows, or is too long in all, naming ``option``.

    Raises:
        ConfigError: one line naming ``option``, the name's length and the limit.
    """
    path = Path(path)
    absolute = Path(os.path.abspath(path))
    known = next((p for p in absolute.parents if _exists(p)), Path("/"))
    name_max = _pathconf(known, "PC_NAME_MAX", 255)
    path_max = _pathconf(known, "PC_PATH_MAX", 4096)
    for part in absolute.parts:
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(
                f"{option} {str(path)[:40]!r}… is not allowed: its name {part[:20]!r}… has "
                f"{len(os.fsencode(part))} bytes, the file system allows {name_max} per name"
            )
    if len(os.fsencode(str(absolute))) >= path_max:
        raise ConfigError(
            f"{option} {str(path)[:40]!r}… is not allowed: the path has "
            f"{len(os.fsencode(str(absolute)))} bytes, the system allows {path_max - 1}"
        )


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _probe_create(folder: Path, option: str, out: Path, *, directory: bool) -> None:
    """Create and remove a folder (``directory``) or a file in ``folder``: the one way to
    know that its file system takes new entries (``/proc`` and ``/sys`` refuse them, as
    does a file system mounted read-only)."""
    probe = folder / f".distsgd-probe-{os.getpid()}"
    try:
        if directory:
            os.mkdir(probe)
            os.rmdir(probe)
        else:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{option} {str(out)!r} is not allowed: {str(folder)!r} does not take new "
            f"{'folders' if directory else 'files'} ({e.strerror or e}); choose a folder on "
            "a writable disk"
        ) from None


def check_out_path(out_dir: str | Path, option: str = "--out") -> None:
    """Refuse a run directory that cannot be one, before anything is started or written.

    Raises:
        ConfigError: a name on the path is longer than the file system allows, ``out_dir``
            (or a folder on its path) is a file, or the directory (or, when it does not
            exist yet, the nearest existing folder above it) is not writable by this
            process or takes no new folders (``/proc``, a read-only mount).
    """
    out = Path(out_dir)
    check_path_names(out, option)
    _check_folder(out, out, option, "a directory (new, or a run's)")


def check_out_file(path: str | Path, option: str = "--out") -> None:
    """Refuse a file to be written (a profile, an exported model) that cannot be, before
    any work: the checks of :func:`check_out_path` for its folder, and the file is not a
    directory.

    Raises:
        ConfigError: one line naming ``option`` and ``path``.
    """
    path = Path(path)
    check_path_names(path, option)
    if path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a directory: expected a file name")
    _check_folder(path, path.parent, option, "a file in a directory")


def _check_folder(path: Path, folder: Path, option: str, expected: str) -> None:
    """The nearest existing folder at or above ``folder`` (where ``path`` goes) is a
    directory in which this process can create ``path``'s missing folders or files.

    Raises:
        ConfigError: ``path`` or a folder above it is a file (``expected``: what ``path``
            should be), or that folder is not writable or takes no new entries.
    """
    for node in (folder, *folder.parents):
        if _exists(node):
            if not node.is_dir():
                what = "is a file" if node == path else f"lies under {str(node)!r}, a file"
                raise ConfigError(f"{option} {str(path)!r} {what}: expected {expected}")
            if not os.access(node, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"{option} {str(path)!r} is not writable: {str(node)!r} does not allow "
                    "this process to create files; choose a writable directory"
                )
            _probe_create(node, option, path, directory=node != folder)
            return


def check_new_run_dir(out_dir: str | Path) -> None:
    """Refuse a directory for a new run before any work: :func:`check_out_path`, and a
    directory that holds a run's files (:class:`RunDirClaim` checks both when it claims
    one; this is the check of a caller that starts processes before the claim).

    Raises:
        ConfigError: see :func:`check_out_path`; or ``metrics.jsonl``, ``summary.json``
            or ``checkpoint.pt`` is there (the message says whether ``--resume`` can
            continue it).
    """
    check_out_path(out_dir)
    _refuse_a_run(Path(out_dir))


def _refuse_a_run(out: Path) -> None:
    if any((out / f).exists() for f in RUN_FILES):
        if (out / "checkpoint.pt").exists():
            how = "choose another output directory (--out) or continue it with --resume"
        else:  # nothing to resume: only another directory
            how = "it has no checkpoint to resume from; choose another output directory (--out)"
        raise ConfigError(f"output directory {str(out)!r} already holds a run; {how}")


class RunDirClaim:
    """One run's exclusive claim on its run directory, held for the run's whole life.

    An OS lock, ``fcntl.flock`` on ``<out_dir>/run.lock`` (released by the kernel when the
    holding process ends, however it ends), with the holder's pid, host and start time
    written in the file so that a refused run can name it. Two runs into one directory:
    the second stops with a :class:`ConfigError` naming the first. The lock file is
    removed when the claim is released, and so is the directory when the claim created
    it and nothing else was written.

    Who holds it: the process that owns the run directory: the one running a ``sim`` run;
    the launching process of a ``dist`` run on one machine (it tells its ranks so,
    ``dir_claimed``); rank 0 under torchrun or of ranks whose launcher holds no claim.

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
    def acquire(cls, out_dir: str | Path, *, new_run: bool = False) -> RunDirClaim:
        """Check ``out_dir`` (:func:`check_out_path`), create it if missing and claim it.

        Args:
            out_dir: the run directory.
            new_run: a new run goes there: once claimed, a directory holding a run's
                files is refused (as :func:`check_new_run_dir`; the claim is released).

        Raises:
            ConfigError: ``out_dir`` cannot be created or written, holds a run
                (``new_run``), or another run holds it (the message names its pid and
                host).
        """
        out = Path(out_dir)
        check_out_path(out)
        for _ in range(10):  # retried only if the folder was removed under us
            created = [d for d in (out, *out.parents) if not _exists(d)]
            try:
                out.mkdir(parents=True, exist_ok=True)
                fd = os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError as e:
                if not out.is_dir():
                    continue  # removed by a claim ending just now
                raise ConfigError(f"--out {str(out)!r} cannot be written: {e.strerror}") from None
            except OSError as e:
                raise ConfigError(
                    f"--out {str(out)!r} cannot be written: {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ConfigError(
                    f"output directory {str(out)!r} is in use by another run "
                    f"({_describe_holder(holder)}); wait for it to end or choose another "
                    "output directory (--out)"
                ) from None
            if _same_file(fd, out / RUN_LOCK):
                return cls._claimed(out, fd, created, new_run)
            os.close(fd)  # we locked a lock file that its holder removed: try again
        raise ConfigError(f"output directory {str(out)!r} could not be claimed (lock file churn)")

    @classmethod
    def _claimed(cls, out: Path, fd: int, created: list[Path], new_run: bool) -> RunDirClaim:
        """The claim on ``out`` once locked: its holder written, a new run's directory
        checked (under the lock, so no other run writes it in between)."""
        claim = cls(out, fd, created)
        try:
            _write_holder(fd)
            if new_run:
                _refuse_a_run(out)
        except OSError as e:
            claim.release()
            raise ConfigError(f"--out {str(out)!r} cannot be written: {e.strerror or e}") from None
        except BaseException:
            claim.release()
            raise
        return claim

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


def _describe_holder(holder: dict[str, Any]) -> str:
    if "pid" not in holder:
        return "holder not yet recorded"
    since = f" since {holder['started_at']}" if holder.get("started_at") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{since}"
