"""The one home of argument validation: :class:`ConfigError` and the checks that raise it.

Every check names the setting (a dotted key such as ``protocol.softsync`` for the config,
a bare argument name such as ``momentum`` for a protocol's constructor), the value given
and what is allowed, in one line: ``protocol.softsync = 3 is not allowed: expected a
divisor of protocol.num_learners = 4``. The CLI prints that line and exits with status 2.

This module imports nothing from distsgd, so the sans-IO protocols can use it and still
be lifted out with it alone.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

__all__ = [
    "ConfigError",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "fail",
]


class ConfigError(ValueError):
    """A setting or argument is not allowed. The message names it, its value and what is
    allowed."""


def fail(key: str, value: Any, allowed: str) -> NoReturn:
    """Raise :class:`ConfigError` ``"{key} = {value!r} is not allowed: expected {allowed}"``."""
    raise ConfigError(f"{key} = {value!r} is not allowed: expected {allowed}")


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else :class:`ConfigError`."""
    if value not in choices:
        fail(key, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        hi = "" if maximum is None else f" and <= {maximum}"
        fail(key, value, f"an integer >= {minimum}{hi}")
    return value


def check_float(
    key: str,
    value: Any,
    minimum: float,
    maximum: float = math.inf,
    *,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
) -> float:
    """``float(value)`` if it is a finite number (not a bool) between the bounds."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= minimum if min_inclusive else value > minimum) and (
            value <= maximum if max_inclusive else value < maximum
        )
    if not ok:
        if maximum == math.inf:
            fail(key, value, f"a finite number {'>=' if min_inclusive else '>'} {minimum}")
        lo = "[" if min_inclusive else "("
        hi = "]" if max_inclusive else ")"
        fail(key, value, f"a number in {lo}{minimum}, {maximum}{hi}")
    return float(value)


def check_bool(key: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``."""
    if not isinstance(value, bool):
        fail(key, value, "true or false")
    return value
