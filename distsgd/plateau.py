"""The steady-state rule: has the training loss flattened?
(:attr:`RunOptions.steady_check_samples <distsgd.control.RunOptions>`)

One function, shared by the layers that need it: the trainer stops a run at the first
check where it is due (``stop_reason = "steady_state"``, the stop ``distsgd train --tune``
sets, :mod:`distsgd.tuner.online`), and the tuner reads the same rule from here. It uses
only the evaluation records it is given up to its decision point, never a later one.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLAT_GAIN", "steady_state_due", "next_check"]

FLAT_GAIN = 0.1  # the loss has flattened: it fell by less than this fraction in a check


def next_check(samples: int, every: int) -> int:
    """The first check point after ``samples``: the next multiple of ``every`` training
    samples since the run's start (strictly above ``samples``)."""
    return (samples // every + 1) * every


def steady_state_due(
    records: list[dict[str, Any]], now_samples: int, window_samples: int
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether to re-optimise at ``now_samples``: the training loss has flattened.

    Uses only evaluation records taken at or before ``now_samples`` (the decision point):
    ``L_then`` = ``train_loss`` of the last record at or before ``now − window_samples``,
    ``L_now`` = that of the last at or before ``now``; due when
    ``(L_then − L_now) / L_then < FLAT_GAIN`` (Omnivore re-optimises once progress slows;
    the threshold is this project's choice).

    Args:
        records: ``metrics.jsonl`` records (``samples``, ``train_loss``), any order.
        now_samples: the decision point, training samples since the run's start.
        window_samples: the comparison's span, samples.

    Returns:
        ``(due, the two records used)``; not due (and ``[]``) without two such records.
    """
    past = sorted(
        (r for r in records if r.get("train_loss") is not None and r["samples"] <= now_samples),
        key=lambda r: r["samples"],
    )
    then = [r for r in past if r["samples"] <= now_samples - window_samples]
    if not then or not past or past[-1] is then[-1]:
        return False, []
    used = [then[-1], past[-1]]
    l_then, l_now = float(used[0]["train_loss"]), float(used[1]["train_loss"])
    if not (math.isfinite(l_then) and math.isfinite(l_now)) or l_then <= 0:
        return False, used
    return (l_then - l_now) / l_then < FLAT_GAIN, used
