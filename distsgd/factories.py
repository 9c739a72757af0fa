"""User code named by import path in a config: ``"package.module:function"``.

A model, a data set, a loss, a metric or a collate function that a run uses is named by
its import path, not passed as an object, because every rank of a run on real processes
starts a fresh interpreter and must find the same code (a closure cannot cross a process
start). Paths resolve like ``python -m``: against ``sys.path`` with the current directory
first, so ``cd my_project && distsgd train run.toml`` finds ``my_project/model.py`` as
``model:build``; ``PYTHONPATH`` reaches every rank the launcher starts.

Example::

    from distsgd.factories import resolve_callable

    build = resolve_callable("model.factory", "torch.nn:Linear")
    module = build(in_features=4, out_features=2)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from distsgd.checks import ConfigError

__all__ = [
    "USER_CODE_FAILURES",
    "failure_text",
    "is_import_path",
    "resolve",
    "resolve_callable",
    "search_current_directory",
]

USER_CODE_FAILURES: tuple[type[BaseException], ...] = (Exception, SystemExit, KeyboardInterrupt)
"""What a call into the user's code (importing its module, a factory, a collate function,
a loss, a metric) may raise that is a failure of that code: any exception, and
``SystemExit`` (``sys.exit()`` in a factory or a module's body) and ``KeyboardInterrupt``
raised by it, which would otherwise end the run silently or as an interruption."""


def search_current_directory() -> None:
    """Put the current directory first on ``sys.path`` unless it (or ``""``) is there, so
    that a user's import path resolves against it whether distsgd was started as
    ``python -m distsgd`` (which puts it there) or as the ``distsgd`` console script
    (which puts the script's folder there instead)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def failure_text(error: BaseException) -> str:
    """What the user's code raised, on one line: ``"Type: message"``, with
    ``"(it called sys.exit)"`` after a ``SystemExit``."""
    text = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(":")
    return text + " (it called sys.exit)" if isinstance(error, SystemExit) else text


def is_import_path(value: Any) -> bool:
    """True when ``value`` has the form ``"module.path:attribute"``."""
    if not isinstance(value, str) or value.count(":") != 1:
        return False
    module, attr = value.split(":")
    parts = module.split(".") + attr.split(".")
    return all(p.isidentifier() for p in parts)


def resolve(setting: str, path: str) -> Any:
    """The object that ``path`` (``"module.path:attribute.path"``) names.

    Args:
        setting: the config setting that holds ``path`` (for the error message).
        path: an import path.

    Raises:
        ConfigError: ``path`` is malformed, its module does not import (the message says
            why, e.g. the missing module, and that the current directory and PYTHONPATH
            are searched; a module that raises ``SystemExit`` while importing does not
            import either), or the module has no such attribute.
    """
    if not is_import_path(path):
        raise ConfigError(
            f"{setting} = {path!r} is not allowed: expected an import path "
            '"package.module:function" (a module on sys.path, the current directory or '
            "PYTHONPATH, a colon, then the function or class)"
        )
    module_name, attr = path.split(":")
    search_current_directory()
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{setting} = {path!r} does not import: no module named {e.name!r} (searched "
            "the current directory, PYTHONPATH and the installed packages)"
        ) from None
    except USER_CODE_FAILURES as e:  # the user's module failed while importing
        raise ConfigError(
            f"{setting} = {path!r} does not import: importing {module_name!r} raised "
            f"{failure_text(e)}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{setting} = {path!r} is not allowed: {module_name!r} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    return obj


def resolve_callable(setting: str, value: str | Callable[..., Any]) -> Callable[..., Any]:
    """``value`` itself if it is callable, else the callable its import path names.

    Raises:
        ConfigError: as :func:`resolve`, or the object is not callable.
    """
    obj = value if callable(value) else resolve(setting, value)
    if not callable(obj):
        raise ConfigError(
            f"{setting} = {value!r} is not allowed: it names a {type(obj).__name__}, "
            "expected a function or class"
        )
    return obj
