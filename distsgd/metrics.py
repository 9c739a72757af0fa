"""Run-directory outputs: ``metrics.jsonl`` (one JSON object per evaluation) and JSON files.

Keys carry their unit as a suffix: ``_s`` for seconds, ``samples`` for training samples.
Each ``metrics.jsonl`` record has at least: ``eval`` (index), ``samples``, ``epoch``,
``virtual_s`` (simulated seconds), ``wall_s`` (wall seconds of training only, evaluation
excluded), ``eval_wall_s`` (cumulative wall seconds spent evaluating), ``eval_metric``
(fraction in [0, 1]), ``eval_loss``, ``eval_samples`` (test samples the evaluation scored:
the ``train.eval_samples`` subset, or the whole test set for the final evaluation and for
one whose subset reached the target), ``train_loss`` (mean minibatch loss since the previous
evaluation; null at the first), ``lr`` (base learning rate from the schedule),
``staleness_mean`` (mean σ of all gradients applied so far).

:class:`TensorBoardWriter` mirrors the same records as TensorBoard scalars when the
optional ``tensorboard`` package is installed (``pip install -e '.[tensorboard]'``).

Tensor files (``checkpoint.pt``, ``eval_weights/NNNN.pt``, ``final_weights.pt``) are written
by :func:`save_checked`: serialised with ``torch.save`` to bytes, hashed with SHA-256 and
written atomically, with the digest in a sidecar ``<file>.sha256`` in ``sha256sum``'s
format (``<hex digest>  <file name>``, so ``sha256sum -c checkpoint.pt.sha256`` checks it
too). :func:`load_checked` verifies the digest where a sidecar exists.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import math
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distsgd.checks import ConfigError

__all__ = [
    "ChecksumMismatch",
    "MetricsWriter",
    "OutputWriteError",
    "TensorBoardWriter",
    "TENSORBOARD_TAGS",
    "UnsafeContents",
    "digest_path",
    "first_line",
    "load_checked",
    "load_checkpoint_file",
    "read_metrics",
    "save_checked",
    "write_atomic",
    "write_json",
]

DIGEST_SUFFIX = ".sha256"


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class OutputWriteError(OSError):
    """An output file could not be written (a full disk, a quota, a file system gone
    read-only): one line naming the file and the directory. What was being written is
    removed; the files written before it are left as they were. ``distsgd`` exits with
    :attr:`exit_status` (74, ``EX_IOERR`` of sysexits.h) on it."""

    exit_status = 74

    @classmethod
    def of(cls, e: OSError, out_dir: str | Path) -> OutputWriteError:
        """``e`` (raised writing in ``out_dir``) as one line naming the file and why."""
        if isinstance(e, OutputWriteError):
            return e
        name = "a file"
        if e.filename:  # as the run directory holds it (eval_weights/0003.pt)
            full, base = os.path.abspath(e.filename), os.path.abspath(out_dir)
            inside = os.path.commonpath([full, base]) == base
            name = (os.path.relpath(full, base) if inside else full).removesuffix(".tmp")
        why = e.strerror or str(e) or type(e).__name__
        return cls(f"could not write {name} in {str(out_dir)!r}: {why}")


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to the file ``path`` (created or truncated); on an error the file is
    removed and the ``OSError`` names ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        e.filename = e.filename or str(path)
        raise
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except BaseException as e:
        path.unlink(missing_ok=True)
        if isinstance(e, OSError):
            e.filename = e.filename or str(path)
        raise


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``<file>.tmp`` renamed over it; the temp
    file is removed when the write fails).

    Raises:
        OSError: the file cannot be written (``filename``: the temp file).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    _write_new(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (:func:`write_atomic`)."""
    write_atomic(path, (json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n").encode())


class ChecksumMismatch(ValueError):
    """A tensor file does not match the SHA-256 digest distsgd wrote beside it."""


def digest_path(path: str | Path) -> Path:
    """The SHA-256 sidecar of a tensor file: ``<file>.sha256``."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def _on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples on the CPU (a CPU tensor
    is kept as it is, not copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict | list):  # a shallow copy keeps the container's own type
        out = copy.copy(obj)
        for key, value in obj.items() if isinstance(obj, dict) else enumerate(obj):
            out[key] = _on_cpu(value)
        return out
    if isinstance(obj, tuple):
        items = [_on_cpu(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def save_checked(obj: Any, path: str | Path) -> str:
    """``torch.save`` ``obj`` to ``path`` atomically, with its SHA-256 digest beside it.

    The steps: the bytes to ``<file>.tmp``, the digest (``<hex>  <name>``) to
    ``<file>.sha256.tmp``, ``<file>.tmp`` renamed over ``path``, then ``<file>.sha256.tmp``
    over the sidecar ``<file>.sha256``. A write cut at any step (SIGKILL, power lost
    before a rename) leaves the previous file with its sidecar, or the new file beside a
    complete pending digest ``<file>.sha256.tmp``, which :func:`load_checked` accepts: the
    pair is never one file's bytes beside another's digest. A write that fails (a full
    disk) removes its temporary files and leaves the previous pair as it was.

    Tensors are saved from host memory (a CUDA tensor is copied to the CPU first), so the
    file loads on any machine, with or without a GPU.

    Returns:
        The hex SHA-256 digest of the file's bytes.

    Raises:
        OSError: a file cannot be written (``filename``: the file).
    """
    path = Path(path)
    buf = io.BytesIO()
    torch.save(_on_cpu(obj), buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    tmp = path.with_name(path.name + ".tmp")
    side = digest_path(path)
    pending = _pending_digest_path(path)
    try:
        _write_new(tmp, data)
        _write_new(pending, f"{digest}  {path.name}\n".encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        pending.unlink(missing_ok=True)
        raise
    os.replace(pending, side)  # the new file's digest is complete in either name
    return digest


def _pending_digest_path(path: Path) -> Path:
    """The digest of a file being written, before its rename: ``<file>.sha256.tmp``."""
    side = digest_path(path)
    return side.with_name(side.name + ".tmp")


def load_checkpoint_file(path: Path, action: str, missing: str = "") -> dict[str, Any]:
    """The dict a checkpoint file holds, for ``action`` (``"resume"``, ``"export"``).

    Raises:
        ConfigError: ``cannot <action>: …`` in one line — the file does not exist
            (followed by ``missing``), does not match its checksum, cannot be unpickled, or
            holds no dict.
    """
    if not path.is_file():
        raise ConfigError(f"cannot {action}: {path} does not exist{missing}")
    try:
        state = load_checked(path)
    except (ChecksumMismatch, UnsafeContents) as e:
        raise ConfigError(f"cannot {action}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means corrupt
        raise ConfigError(
            f"cannot {action}: {path} is not a readable checkpoint ({first_line(e)})"
        ) from None
    if not isinstance(state, dict):
        raise ConfigError(
            f"cannot {action}: {path} holds a {type(state).__name__}, not a checkpoint "
            "written by distsgd (a dict of the run's state)"
        )
    return state


def load_checked(path: str | Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` after checking the file's
    SHA-256 digest against its sidecar ``<file>.sha256`` (or against the pending digest
    ``<file>.sha256.tmp`` of a :func:`save_checked` cut between its two renames); a file
    without a sidecar (a user's own weights, a checkpoint of an older distsgd) is loaded
    unchecked. Nothing of the file is executed: only tensors and plain containers load.

    Raises:
        OSError: the file cannot be read.
        ChecksumMismatch: the sidecar exists and the file's digest differs from it (the
            file is corrupt or was changed after distsgd wrote it), or the sidecar is not
            a digest.
        UnsafeContents: the file holds objects other than tensors and plain containers
            (``torch.load(weights_only=True)`` refuses them).
        Exception: whatever ``torch.load`` raises for bytes it cannot unpickle.
    """
    path = Path(path)
    data = path.read_bytes()
    sides = [p for p in (digest_path(path), _pending_digest_path(path)) if p.exists()]
    if sides:
        actual = hashlib.sha256(data).hexdigest()
        recorded = [_recorded_digest(p) for p in sides]
        if actual not in recorded:
            raise ChecksumMismatch(
                f"{path} does not match its checksum {sides[0].name} (sha256 {actual[:16]}…, "
                f"recorded {recorded[0][:16] or 'nothing'}…): the file is corrupt or was "
                "changed after distsgd wrote it"
            )
    return _load_weights_only(data, path)


def _recorded_digest(side: Path) -> str:
    """The hex digest a sidecar records ('' when it is missing or empty)."""
    try:
        words = side.read_text(errors="replace").split()
    except OSError:
        return ""
    return words[0].lower() if words else ""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none)."""
    lines = str(e).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


class UnsafeContents(ValueError):
    """A file holds objects that ``torch.load(weights_only=True)`` refuses to build."""


def _load_weights_only(data: bytes, path: Path) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (read from ``path``) onto the CPU,
    its refusal of the file's contents in one line (torch's advice to load it unsafely is
    not passed on)."""
    # tensors land on the CPU whatever device wrote them (a GPU run resumes on a CPU-only
    # machine); their users copy them onto their own device
    try:
        with warnings.catch_warnings():  # torch's note on the pickle protocol of a file
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower():
            raise
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = (
            f"a Python object ({found.group(1)}), not only tensors and plain containers"
            if found
            else "pickled data other than tensors and plain containers"
        )
        raise UnsafeContents(
            f"{path} holds {what}: distsgd reads tensor files with "
            "torch.load(weights_only=True) and never runs code from a file"
        ) from None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file, in order.

    A torn last line (a write cut short) is ignored.

    Raises:
        ValueError: a line other than the last is not JSON (the file is corrupt).
    """
    p = Path(path)
    if not p.exists():
        return []
    lines = [(i, line.strip()) for i, line in enumerate(p.read_text().splitlines(), 1)]
    lines = [(i, line) for i, line in lines if line]
    records = []
    for n, (i, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break
            raise ValueError(f"{p} is corrupt: line {i} is not JSON") from None
    return records


class MetricsWriter:
    """Appends evaluation records to ``metrics.jsonl``, flushed after each record.

    Args:
        path: the JSONL file.
        keep_evals: when resuming, keep only the first ``keep_evals`` records already in
            the file (those covered by the checkpoint) and append after them; None starts
            a new file.
    """

    def __init__(self, path: str | Path, keep_evals: int | None = None) -> None:
        self.path = Path(path)
        kept = read_metrics(self.path)[:keep_evals] if keep_evals is not None else []
        self.records: list[dict[str, Any]] = list(kept)
        self._failed = False
        with _naming(self.path):
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` and flush it.

        Raises:
            OSError: it cannot be written (``filename``: the file); a torn last line is
                what :func:`read_metrics` skips.
        """
        record = _clean(record)
        self.records.append(record)
        try:
            with _naming(self.path):
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        except OSError:
            self._failed = True
            raise

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                if not self._failed:  # a failed write was raised already
                    raise


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An ``OSError`` raised inside names ``path`` when it names no file (a write or a
    flush of an open file)."""
    try:
        yield
    except OSError as e:
        e.filename = e.filename or str(path)
        raise


# metrics.jsonl key -> TensorBoard scalar tag; the unit is part of the tag.
TENSORBOARD_TAGS: dict[str, str] = {
    "eval_metric": "test/accuracy(fraction)",
    "eval_loss": "test/loss(nats)",
    "eval_samples": "test/scored(samples)",
    "train_loss": "train/loss(nats)",
    "lr": "lr",
    "staleness_mean": "staleness/mean(updates)",
    "wall_s": "time/wall(s)",
    "virtual_s": "time/virtual(s)",
    "epoch": "progress/epoch(epochs)",
}


class TensorBoardWriter:
    """Writes evaluation records as TensorBoard scalars, global step = training samples.

    Tags are the values of :data:`TENSORBOARD_TAGS`; a record key that is missing or null
    (``train_loss`` at the first evaluation, ``virtual_s`` on a runtime without a virtual
    clock) is skipped. The writer is ``torch.utils.tensorboard.SummaryWriter``, imported
    only here, so the core install does not need TensorBoard: without the ``tensorboard``
    package, or with ``enabled=False``, every method is a no-op.

    Args:
        log_dir: folder of the event files (created if missing); a resumed run appends a
            new event file to the same folder.
        enabled: False turns the writer off (``train.tensorboard = false``).
        purge_step: when resuming, the first training-sample step not covered by the
            checkpoint: TensorBoard hides the older events at or after it (those of
            evaluations the resumed run repeats). None for a new run.

    Example::

        tb = TensorBoardWriter("runs/r/tb")
        tb.write({"samples": 512, "eval_metric": 0.81, "wall_s": 1.2})
        tb.close()
    """

    def __init__(
        self, log_dir: str | Path, enabled: bool = True, purge_step: int | None = None
    ) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        if not enabled or importlib.util.find_spec("tensorboard") is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a tensorboard too old or broken for torch: stay off
            return
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    @property
    def enabled(self) -> bool:
        """Whether event files are being written."""
        return self._writer is not None

    def write(self, record: dict[str, Any]) -> None:
        """Add one evaluation record's scalars at step ``record["samples"]`` and flush.

        Raises:
            OSError: the events cannot be written (``filename``: under ``log_dir``).
        """
        if self._writer is None:
            return
        step = int(record["samples"])
        with _naming(self.log_dir / "events.out.tfevents"):  # the writer's thread's error
            for key, tag in TENSORBOARD_TAGS.items():
                value = record.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._writer.add_scalar(tag, float(value), global_step=step)
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent).

        Raises:
            OSError: the last events cannot be written (``filename``: under ``log_dir``).
        """
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with _naming(self.log_dir / "events.out.tfevents"):
                writer.close()
