"""A rank's process entry, ``python -m distsgd.worker``, as :func:`distsgd.launch.run`
starts its ranks.

Kept apart from :mod:`distsgd.launch` (which the package imports) so that ``-m`` runs a
module not yet imported; the rank's work is :func:`distsgd.launch.main`, and it ends
through :func:`distsgd.launch.exit_worker`.
"""

from __future__ import annotations

import os

from distsgd.launch import exit_worker, main, rank_faults

if __name__ == "__main__":
    exit_worker(main, abort=rank_faults().abort_at_exit == int(os.environ.get("RANK", "-1")))
