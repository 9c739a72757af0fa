"""Run-directory outputs: ``metrics.jsonl`` (one JSON object per evaluation) and JSON files.

Keys carry their unit as a suffix: ``_s`` for seconds, ``samples`` for training samples.
Each ``metrics.jsonl`` record has at least: ``eval`` (index), ``samples``, ``epoch``,
``virtual_s`` (simulated seconds), ``wall_s`` (wall seconds of training only, evaluation
excluded), ``eval_wall_s`` (cumulative wall seconds spent evaluating), ``test_accuracy``
(fraction in [0, 1]), ``test_loss``, ``train_loss`` (mean minibatch loss since the previous
evaluation; null at the first), ``lr`` (base learning rate from the schedule),
``staleness_mean`` (mean σ of all gradients applied so far).

:class:`TensorBoardWriter` mirrors the same records as TensorBoard scalars when the
optional ``tensorboard`` package is installed (``pip install -e '.[tensorboard]'``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "TensorBoardWriter", "TENSORBOARD_TAGS", "read_metrics", "write_json"]


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


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
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        record = _clean(record)
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# metrics.jsonl key -> TensorBoard scalar tag; the unit is part of the tag.
TENSORBOARD_TAGS: dict[str, str] = {
    "test_accuracy": "test/accuracy(fraction)",
    "test_loss": "test/loss(nats)",
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
        tb.write({"samples": 512, "test_accuracy": 0.81, "wall_s": 1.2})
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
        """Add one evaluation record's scalars at step ``record["samples"]`` and flush."""
        if self._writer is None:
            return
        step = int(record["samples"])
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
