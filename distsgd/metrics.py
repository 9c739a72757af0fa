"""Run-directory outputs: ``metrics.jsonl`` (one JSON object per evaluation) and JSON files.

Keys carry their unit as a suffix: ``_s`` for seconds, ``samples`` for training samples.
Each ``metrics.jsonl`` record has at least: ``eval`` (index), ``samples``, ``epoch``,
``virtual_s`` (simulated seconds), ``wall_s`` (wall seconds of training only, evaluation
excluded), ``eval_wall_s`` (cumulative wall seconds spent evaluating), ``test_accuracy``
(fraction in [0, 1]), ``test_loss``, ``train_loss`` (mean minibatch loss since the previous
evaluation; null at the first), ``lr`` (base learning rate from the schedule),
``staleness_mean`` (mean σ of all gradients applied so far).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "read_metrics", "write_json"]


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
    """Records of a ``metrics.jsonl`` file, in order; a torn last line is ignored."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
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
