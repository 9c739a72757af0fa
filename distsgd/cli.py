"""Entry point of the ``distsgd`` console script: imports only the standard library, so
that Ctrl-C while the commands load (torch and the rest, seconds) ends with one line.

The commands, their arguments and exit statuses are in :mod:`distsgd.commands`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``distsgd COMMAND ...`` (``argv``: the arguments after the program name; None:
    ``sys.argv[1:]``); returns the exit status. An interrupt while the commands are
    imported (torch) prints one line and returns 130; parsing and running are
    :func:`distsgd.commands.main`'s, which ends an interrupt with its own line."""
    try:
        from distsgd import commands
    except KeyboardInterrupt:
        return interrupted_while_starting()
    return int(commands.main(argv))


def interrupted_while_starting() -> int:
    """Print the one line of an interrupt before any command ran; returns 130."""
    print("distsgd: interrupted while starting; nothing was run", file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
