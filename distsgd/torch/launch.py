"""``python -m distsgd.torch.launch``: torchrun's one-machine launch, without its
all-or-nothing failure policy, for runs that must survive a lost learner.

    python -m distsgd.torch.launch --nproc-per-node 3 examples/own_loop/train.py --protocol async

starts ``--nproc-per-node`` copies of the script with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
and watches them, as ``distsgd train --runtime dist`` does
(:mod:`distsgd.runtime.launch`: torch's process layer, the rendezvous store hosted here
on ``--master-addr`` only, heartbeats).

**Why not torchrun.** torchrun's agent stops every worker of its node as soon as one
fails: ``SubprocessContext._poll`` (``torch/distributed/elastic/multiprocessing/api.py``)
closes all processes when *any* has failed, and ``SimpleElasticAgent._invoke_run``
(``…/elastic/agent/server/api.py``) then stops the group, or with ``--max-restarts``
restarts the *whole* group (the server included). A learner killed by a signal
(``kill -9``, the OOM killer) therefore ends a ``--nproc-per-node N`` run under any
protocol. One agent per rank (``--nnodes W --nproc-per-node 1``) confines the failure to
the lost rank's agent, but the others then wait in the agent's exit barrier for it, 300 s:
``launch_agent`` (``torch/distributed/launcher/api.py``) builds ``LocalElasticAgent``
without ``exit_barrier_timeout``, and no option or environment variable sets it.

**Policy here.** A rank that ends with a non-zero status is reported on stderr and the
others go on: under ``parameter_server`` (async, n-softsync) and ``compute_groups`` the
server serves the other learners to the end; under the synchronous protocols the other
ranks stop themselves within ``timeout_s`` with ``PeerLost`` naming it. A rank whose
heartbeat (``distsgd.torch.init``'s) stops for longer than its ``timeout_s`` is killed
(SIGKILL) and reported (:class:`~distsgd.runtime.launch.RankWatch`; the bounds are
those of :mod:`distsgd.runtime.launch`). The launcher's exit status is the first
non-zero exit status of a rank that ended on its own (a rank killed by a signal is only
reported), else 0. Ctrl-C stops every rank (SIGTERM, then SIGKILL 5 s later).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException

from distsgd.runtime.faults import describe_exit
from distsgd.runtime.launch import Ranks, RankWatch, close_ranks, namespace, start_ranks

__all__ = ["launch", "main"]

POLL_S = 0.1  # how often the ranks' exit statuses are read
STORE_TIMEOUT_S = 300.0  # the ranks' rendezvous on the store (torchrun's default is 900)
PROG = "distsgd.torch.launch"


def launch(
    script: str,
    script_args: list[str],
    *,
    nproc_per_node: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
) -> int:
    """Run ``script`` (a Python file) on ``nproc_per_node`` ranks of this machine and
    wait for all of them (see the module's policy).

    Args:
        script: path of the training script; ``script_args`` its arguments.
        nproc_per_node: W >= 1, processes (ranks 0 … W−1).
        master_addr: the rendezvous address (loopback by default).
        master_port: its port (0: a free one).

    Returns:
        The first non-zero exit status of a rank that ended on its own, else 0.

    Raises:
        ValueError: ``nproc_per_node`` < 1 or ``script`` is not a file.
        KeyboardInterrupt: on SIGINT/SIGTERM (every rank is stopped first).
    """
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node = {nproc_per_node} is not allowed: expected >= 1")
    if not Path(script).is_file():
        raise ValueError(f"script = {script!r} is not allowed: expected a Python file")
    with tempfile.TemporaryDirectory(prefix="distsgd-torch-launch-") as tmp:
        ranks = Ranks.rendezvous(
            nproc_per_node, master_addr, master_port, STORE_TIMEOUT_S, f"{tmp}/logs"
        )
        start_ranks(ranks, ("-u", script, *script_args), lambda r: {})
        try:
            codes = _wait(RankWatch(ranks, namespace(), _announce))
        except SignalException:
            raise KeyboardInterrupt from None
        finally:
            close_ranks(ranks)
    own = [c for c in codes.values() if c > 0]
    return own[0] if own else 0


def _announce(rank: int, line: str) -> None:
    print(f"{PROG}: {line}; the other ranks go on", file=sys.stderr, flush=True)


def _wait(watch: RankWatch) -> dict[int, int]:
    """Poll the ranks until all have ended; report each that ends with a non-zero
    status once. Returns ``{rank: exit status}`` (negative: killed by that signal)."""
    reported: set[int] = set(watch.hung)
    while True:
        codes = watch.poll()
        for r, code in codes.items():
            if code not in (None, 0) and r not in reported and r not in watch.hung:
                reported.add(r)
                print(
                    f"{PROG}: rank {r} (pid {watch.ranks.pid(r)}) "
                    f"{describe_exit(code)}; the other ranks go on",
                    file=sys.stderr,
                    flush=True,
                )
        if all(c is not None for c in codes.values()):
            return {r: int(c) for r, c in codes.items() if c is not None}
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="torchrun's one-machine launch; a lost rank does not stop the others",
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    parser.add_argument("--master-port", "--master_port", type=int, default=0)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        return launch(
            args.script,
            args.script_args,
            nproc_per_node=args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
