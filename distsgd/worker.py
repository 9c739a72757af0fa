"""A rank's process entry, ``python -m distsgd.worker``, as :mod:`distsgd.launch` starts
its ranks.

Kept apart from :mod:`distsgd.launch` (which the package imports) so that ``-m`` runs a
module not yet imported; the rank's work is :func:`distsgd.launch.main`, and it ends
through :func:`distsgd.runtime.launch.exit_worker`.
"""

from __future__ import annotations

from distsgd.launch import aborts_at_exit, exit_worker, main

if __name__ == "__main__":
    exit_worker(main, abort=aborts_at_exit)
