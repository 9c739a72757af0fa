"""Starting the ``dist`` runtime's processes: on this machine, or as one rank under torchrun.

**One machine.** :func:`run` starts the ranks with torch's own launch machinery,
:func:`torch.distributed.elastic.multiprocessing.start_processes` (the process layer of
torchrun's elastic agent: spawning, environment, logs, terminating the process groups),
with the rendezvous on loopback (``dist.master_addr``, default 127.0.0.1, and a free port
unless ``dist.master_port`` is set) through a c10d TCPStore hosted by the launching
process, as torchrun's agent hosts it. The launcher binds the store's listening socket
itself, on ``dist.master_addr`` only (torch's TCPStore would listen on every interface),
and hands it to the store: a one-machine run on loopback cannot be reached from the
network, and a port in use is one line naming ``dist.master_port``. Each rank runs
``python -m distsgd.worker`` and sets its torch threads to its share of the cores
(``train.num_threads`` overrides).

**Why not the elastic agent itself.** torchrun's agent (``elastic_launch``) tears down
every worker as soon as one fails; with ``max_restarts = 0`` the run is over. That is
right for the synchronous protocols (hardsync, SMA, local SGD, the parameter server's
hardsync mode) but wrong for the asynchronous ones, which must lose a learner and go on
(Rudra's server keeps serving the others). So this module uses the agent's process layer
and applies its own failure policy, the only part it decides:

* a learner rank of ``parameter_server`` (modes ``softsync`` / ``async``) or
  ``compute_groups`` dies: it is reported on stderr and the others go on; the server
  logs the loss and the run completes (the loss is listed in ``summary.json`` under
  ``events``);
* any other rank dies (a learner of a synchronous protocol, a server rank): the other
  ranks notice it themselves (a c10d error or ``dist.timeout_s`` of silence) and stop;
  whatever is still running ``dist.timeout_s + 5`` seconds later is terminated
  (SIGTERM, then SIGKILL). :class:`DistRunFailed` names the lost rank; the last
  checkpoint is kept, and ``--resume`` continues from it;
* a rank hangs (stopped, e.g. ``kill -STOP``, or stuck): its peers time out after
  ``dist.timeout_s`` and name the ranks whose heartbeat stopped
  (:class:`distsgd.runtime.dist.Heartbeats`); once every other rank has ended, the
  launcher kills the named ones at once (SIGKILL) and :class:`DistRunFailed` names them
  as hung.

When rank 0 cannot write the failed run's ``summary.json`` (it was killed, or hung), the
launcher writes it (``status = "failed"``, ``lost_ranks``, the samples of the last
evaluation in ``metrics.jsonl``), so that ``distsgd report`` reads the run.

In every case :func:`run` returns only after every process it started has ended.

**Ranks kept for many runs.** :class:`RankPool` starts the ranks once and trains run
after run on them (``distsgd train --tune``'s probes and segments): each run is what
:func:`run` trains, with the same failure policy, in a fresh process group whose store
keys are its own; a run that fails ends the ranks, and the next starts fresh ones.

**Ending a rank.** A rank ends with ``os._exit`` once its outcome is known and written
(:func:`exit_worker`: the process group is already destroyed, the streams are flushed),
so no C++ static destructor or thread of torch.distributed (gloo, the store client) runs
at interpreter shutdown, where one destroyed while still joinable aborts the process
(``terminate called without an active exception``, SIGABRT). A rank also reports that it
has finished (its outcome file holds ``"kind": "done"``) before it ends, so a rank that
dies by a signal after that point is reported as such and does not fail a run that it had
completed.

**Several machines.** Start the same entry point on every machine under torchrun::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --master-addr HOST0 --master-port 29500 \\
        -m distsgd train CONFIG --runtime dist --out RUN_DIR

:func:`run` sees torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` and runs this
process's rank instead of launching again; torchrun's agent then owns the processes
(and tears all down when one fails, which suits the synchronous protocols). What such a
run exposes on the network: torchrun's rendezvous store on ``--master-addr:--master-port``
(rank 0's node; any client that reaches it can read and write the run's keys) and gloo's
connections between the ranks, on the address each node resolves for itself. Run it on
a trusted network only.

**A launcher that dies.** Every rank asks the kernel for SIGTERM when its parent (this
launcher, or torchrun's agent) dies (``prctl(PR_SET_PDEATHSIG)`` on Linux) and a watchdog
thread checks the parent pid every second (other systems); SIGTERM ends a rank as Ctrl-C
does (rank 0 writes an "interrupted" summary), and a rank still running ``dist.timeout_s +
5`` seconds after its SIGTERM ends by SIGALRM, which the kernel carries out without the
interpreter, so a teardown stuck holding the GIL cannot keep it (:func:`rank_sigterm`,
:func:`distsgd.runtime.dist.arm_exit_deadline`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import SignalException

from distsgd.config import METRICS, ConfigError, RunConfig, required_processes
from distsgd.data import keep_loaded
from distsgd.layout import spec_for
from distsgd.metrics import OutputWriteError, read_metrics, write_json
from distsgd.objectives import reached as target_reached
from distsgd.rundir import check_new_run_dir
from distsgd.runtime import dist as rdist
from distsgd.runtime.base import TrainingDiverged
from distsgd.runtime.dist import PeerLost
from distsgd.runtime.faults import RankFaults, describe_exit
from distsgd.runtime.rendezvous import rendezvous_store
from distsgd.trainer import Trainer

__all__ = [
    "DistRunFailed",
    "RankPool",
    "exit_worker",
    "is_process_loss",
    "rank_sigterm",
    "run",
    "run_worker",
    "under_launcher",
]

ENV_ERROR_FILE = "DISTSGD_DIST_ERROR_FILE"
ENV_POOL_DIR = "DISTSGD_POOL_DIR"  # a pooled rank's folder of run files (RankPool)
POOL_STOP = "stop"  # the file in that folder that ends the pooled ranks
_POLL_S = 0.1
_POOL_POLL_S = 0.02  # a pooled run's end: a short run's wall is not padded by the poll


class DistRunFailed(RuntimeError):
    """A process of a dist run was lost where the protocol cannot go on without it."""


def is_process_loss(e: BaseException) -> bool:
    """True for the errors that mean a process of the run was lost (any rank)."""

    return isinstance(e, DistRunFailed | PeerLost) or type(e).__name__ in (
        "ServerLost",
        "LearnerLost",
    )


def under_launcher() -> bool:
    """True inside a rank started by torchrun (or by :func:`run`)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _role(cfg: RunConfig, rank: int) -> str:
    return spec_for(cfg.protocol).role(rank, cfg.dist)


def _tolerates_loss(cfg: RunConfig, rank: int) -> bool:
    """Whether the run goes on without ``rank`` (an asynchronous protocol's learner)."""
    return spec_for(cfg.protocol).tolerates_loss(cfg.protocol, cfg.dist, rank)


def run(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = False,
    faults: RankFaults | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` (runtime ``dist``) to its stop rule on real processes (``faults``:
    injected into the ranks by tests, :class:`~distsgd.runtime.faults.RankFaults`).

    Under torchrun this process is one rank: it trains (rank 0 writes ``out_dir``) and
    returns the summary on rank 0, ``{}`` elsewhere. Otherwise it starts
    ``required_processes`` ranks on this machine and returns rank 0's summary.

    Raises:
        ConfigError: a rank stopped on a user error (its message), or ``out_dir``
            already holds a run.
        TrainingDiverged: the loss became NaN or infinite.
        DistRunFailed: a rank was lost and the protocol cannot go on (names the rank).
        KeyboardInterrupt: interrupted; every rank is stopped, the checkpoint kept.
    """

    out = Path(out_dir)
    if under_launcher():
        rank = int(os.environ["RANK"])
        trainer = Trainer(cfg, out, progress=progress and rank == 0, faults=faults)
        return trainer.run(resume=resume)
    return _launch_local(cfg, out, resume=resume, progress=progress, faults=faults)


def _rank_envs(
    n: int, addr: str, port: int, extra: Callable[[int], dict[str, str]]
) -> dict[int, dict[str, str]]:
    """The environment of each of ``n`` ranks on this machine (``extra``: per rank)."""
    package_root = str(Path(__file__).resolve().parents[1])  # the folder holding distsgd/
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {
        r: {
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(n),
            "PYTHONPATH": pythonpath,
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank a client of the store
            **extra(r),
        }
        for r in range(n)
    }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _start(n: int, envs: dict[int, dict[str, str]], tmp: str) -> Any:
    """Start ``python -m distsgd.worker`` as ``n`` ranks (torch's process layer).

    torch's ``start_processes`` leaves handlers behind that turn SIGINT and SIGTERM into
    its ``SignalException`` for the rest of this process's life; they are replaced by
    ones that raise ``KeyboardInterrupt``, which the CLI and the callers handle (a Ctrl-C
    between two runs of a :class:`RankPool`, or while it closes, is an interrupt too)."""
    ctx = start_processes(
        name="distsgd",
        entrypoint=sys.executable,
        args={r: ("-m", "distsgd.worker") for r in range(n)},
        envs=envs,
        logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp) / "logs")),
        start_method="spawn",
    )
    if threading.current_thread() is threading.main_thread():  # where torch set its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)
    return ctx


class _Watch:
    """The launcher's failure policy over one run's ranks (module docstring): polls the
    processes every ``poll_s`` until every rank has ended or, with ``run_done`` (pooled
    ranks, which outlive a run; polled every ``_POOL_POLL_S``: a probe's end is noticed
    sooner), until it says the run is done; a fatal loss ends the
    watch ``dist.timeout_s + 5`` seconds later at the latest. ``outcome(r)`` is rank r's
    outcome file for this run."""

    def __init__(
        self, ctx: Any, cfg: RunConfig, outcome: Callable[[int], Path], poll_s: float = _POLL_S
    ) -> None:
        self.ctx, self.cfg, self.outcome, self.poll_s = ctx, cfg, outcome, poll_s
        self.codes: dict[int, int | None] = {}
        self.lost: dict[int, int] = {}
        self.after_done: dict[int, int] = {}  # ended with an error after reporting "done"
        self.hung: set[int] = set()  # named silent by their peers, killed here
        self.fatal_since: float | None = None

    def poll(self) -> None:
        cfg = self.cfg
        self.codes = {r: h.proc.poll() for r, h in self.ctx.subprocess_handlers.items()}
        for r, code in self.codes.items():
            if code in (None, 0) or r in self.lost or r in self.after_done:
                continue
            if r in self.hung:
                self.lost[r] = code  # killed here (_kill_hung), already reported
                continue
            pid = self.ctx.subprocess_handlers[r].proc.pid
            if _finished(self.outcome(r)):
                # its part of the run was done: the run is not affected
                self.after_done[r] = code
                print(
                    f"distsgd: rank {r} ({_role(cfg, r)}, pid {pid}) {describe_exit(code)} "
                    "after it had finished its part of the run",
                    file=sys.stderr,
                )
                continue
            self.lost[r] = code
            if not _tolerates_loss(cfg, r) and self.fatal_since is None:
                self.fatal_since = time.monotonic()
            print(
                f"distsgd: rank {r} ({_role(cfg, r)}, pid {pid}) {describe_exit(code)}"
                + ("; the server goes on without it" if self.fatal_since is None else ""),
                file=sys.stderr,
            )

    def until_done(self, run_done: Callable[[], bool] | None = None) -> None:
        try:
            while True:
                self.poll()
                if all(c is not None for c in self.codes.values()):
                    return
                if run_done is not None and run_done():
                    return
                if self.fatal_since is not None:
                    _kill_hung(self.ctx, self.codes, self.outcome, self.hung)
                    if time.monotonic() - self.fatal_since > self.cfg.dist.timeout_s + 5:
                        running = {r for r, c in self.codes.items() if c is None}
                        self.hung.update(running & _named_silent(self.codes, self.outcome))
                        return
                time.sleep(self.poll_s)
        except SignalException:
            # start_processes turns SIGINT/SIGTERM into SignalException: an interrupt like
            # Ctrl-C (every rank is stopped by the caller; rank 0 writes its summary)
            raise KeyboardInterrupt from None

    def errors(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in self.ctx.subprocess_handlers:
            f = self.outcome(r)
            if f.exists():
                out[r] = json.loads(f.read_text())
        return out


def _launch_local(
    cfg: RunConfig, out: Path, *, resume: bool, progress: bool, faults: RankFaults | None
) -> dict[str, Any]:

    n, _ = required_processes(cfg.protocol, cfg.dist)
    addr = cfg.dist.master_addr
    # The rendezvous store is hosted here, as torchrun's agent hosts it, so that a free
    # port (master_port = 0) is bound once and no rank can lose it to another program.
    store = rendezvous_store(addr, cfg.dist.master_port, world_size=n, timeout_s=cfg.dist.timeout_s)
    with tempfile.TemporaryDirectory(prefix="distsgd-launch-") as tmp:

        def outcome(r: int) -> Path:
            return Path(tmp) / f"rank{r}.json"

        envs = _rank_envs(
            n,
            addr,
            store.port,
            lambda r: {
                rdist.ENV_CONFIG: cfg.to_toml(),
                rdist.ENV_OUT: str(out.resolve()),
                rdist.ENV_RESUME: "1" if resume else "0",
                rdist.ENV_PROGRESS: "1" if progress and r == 0 else "0",
                rdist.ENV_FAULTS: faults.to_json() if faults is not None else "",
                ENV_ERROR_FILE: str(outcome(r)),
            },
        )
        ctx = _start(n, envs, tmp)
        watch = _Watch(ctx, cfg, outcome)
        try:
            watch.until_done()
        finally:
            # SIGTERM to every rank still running (rank 0 then writes its summary), SIGKILL
            # to any still there 5 s later
            _close_ranks(ctx)
        codes = {r: h.proc.poll() for r, h in ctx.subprocess_handlers.items()}
        errors = watch.errors()
    del store  # the ranks have ended
    return _outcome(cfg, out, codes, watch.lost, errors, hung=watch.hung)


class RankPool:
    """Ranks on this machine kept alive from one ``dist`` run to the next, for a caller
    that trains many short runs with the same number of processes (``distsgd train
    --tune``'s probes and segments, ``distsgd tune``'s probes): a run then costs no
    process start (interpreter, torch, the first optimizer's ``torch._dynamo`` import:
    4–6 s a launch on 2 cores).

    Each run is :func:`run`'s, rank for rank: every rank joins a fresh process group (its
    store keys under ``run<N>/``, :func:`distsgd.runtime.dist.store_namespace`), trains
    ``cfg`` with :class:`~distsgd.trainer.Trainer` and reports its outcome; the same
    failure policy applies. A run that fails in any way (a rank lost, diverged, a user
    error, an interrupt) ends the pool's processes at once (SIGTERM, then SIGKILL 5 s
    later), as :func:`run` ends its own, and the next run starts fresh ones; so does a
    run whose ``dist.master_addr`` / ``master_port`` / ``timeout_s`` differ from those the
    ranks were started with. Under torchrun (this process is one rank) it is :func:`run`.
    A pooled rank ends itself ``65`` s after its launcher died (:func:`run`'s ranks:
    ``dist.timeout_s + 5``), and once the pool's folder is gone (a pool dropped without
    :meth:`close`).

    Args:
        num_processes: the ranks every run must need (``required_processes``).

    Raises (from :meth:`run`): what :func:`run` raises; ``ValueError`` for a run that
    needs another number of processes, or a fault a pooled rank cannot inject
    (``RankFaults.abort_at_exit``).
    """

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes
        self._ctx: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store: Any = None
        self._started_with: tuple[str, int, float] | None = None
        self._runs = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a pool dropped without close(): end its ranks
        if getattr(self, "_ctx", None) is not None:
            try:
                self._terminate()
            except Exception:  # noqa: BLE001 - at interpreter shutdown; the ranks end alone
                pass

    def _ensure(self, cfg: RunConfig) -> None:
        """Start the ranks unless they run already, with ``cfg``'s rendezvous settings."""
        d = cfg.dist
        wanted = (d.master_addr, d.master_port, d.timeout_s)
        alive = self._ctx is not None and all(
            h.proc.poll() is None for h in self._ctx.subprocess_handlers.values()
        )
        if alive and wanted == self._started_with:
            return
        self.close()
        n = self.num_processes
        self._runs = 0  # fresh ranks count their runs from 1
        self._tmp = tempfile.TemporaryDirectory(prefix="distsgd-pool-")
        tmp = self._tmp.name
        self._store = rendezvous_store(
            d.master_addr, d.master_port, world_size=n, timeout_s=d.timeout_s
        )
        envs = _rank_envs(n, d.master_addr, self._store.port, lambda r: {ENV_POOL_DIR: tmp})
        self._ctx = _start(n, envs, tmp)
        self._started_with = wanted

    def run(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = False,
        faults: RankFaults | None = None,
    ) -> dict[str, Any]:
        """Train ``cfg`` (runtime ``dist``) to its stop rule on the pool's ranks; returns
        rank 0's summary (as :func:`run`; ``faults``: injected by tests)."""
        out = Path(out_dir)
        if under_launcher():
            return run(cfg, out, resume=resume, progress=progress, faults=faults)
        n, why = required_processes(cfg.protocol, cfg.dist)
        if n != self.num_processes:
            raise ValueError(f"the pool has {self.num_processes} ranks, the run needs {n} ({why})")
        if faults is not None and faults.abort_at_exit is not None:
            raise ValueError("RankFaults.abort_at_exit is not injected into pooled ranks")
        if not resume:
            check_new_run_dir(out)  # fail before any rank starts the run
        self._ensure(cfg)
        outcome = self._submit(cfg, out, resume, progress, faults)
        ctx = self._ctx
        watch = _Watch(ctx, cfg, outcome, poll_s=_POOL_POLL_S)
        late: list[int] = []
        try:
            watch.until_done(self._run_done(watch, outcome, cfg.dist.timeout_s + 5, late))
        except BaseException:
            self._terminate()  # Ctrl-C: every rank is stopped (rank 0 writes its summary)
            raise
        for r in late:
            print(
                f"distsgd: rank {r} ({_role(cfg, r)}) did not report the end of its part "
                f"{cfg.dist.timeout_s + 5:g} s after the others had; the pool's ranks are "
                "restarted",
                file=sys.stderr,
            )
        errors = watch.errors()
        if watch.lost or late or any(e["kind"] != "done" for e in errors.values()):
            self._terminate()  # a failed run ends the pool's ranks, as run() ends its own
        codes = {r: h.proc.poll() for r, h in ctx.subprocess_handlers.items()}
        return _outcome(cfg, out, codes, watch.lost, errors, hung=watch.hung)

    def _submit(
        self, cfg: RunConfig, out: Path, resume: bool, progress: bool, faults: RankFaults | None
    ) -> Callable[[int], Path]:
        """Hand the run to the ranks (``run<N>.json``, written whole); returns where rank
        r reports its outcome."""
        assert self._tmp is not None
        self._runs += 1
        tmp, number = Path(self._tmp.name), self._runs
        job = {"config": cfg.to_toml(), "out": str(out.resolve()), "resume": resume}
        job |= {"progress": progress, "faults": faults.to_json() if faults is not None else ""}
        part = tmp / f"run{number}.json.part"
        part.write_text(json.dumps(job))
        part.rename(tmp / f"run{number}.json")

        def outcome(r: int) -> Path:
            return tmp / f"run{number}-rank{r}.json"

        return outcome

    def _run_done(
        self, watch: _Watch, outcome: Callable[[int], Path], grace_s: float, late: list[int]
    ) -> Callable[[], bool]:
        """The watch's end: every rank reported the end of its part or was lost (the
        failure policy decides then); or, with none lost, some reported it and the others
        have not for ``grace_s`` seconds (a rank stuck after its last collective: named in
        ``late``)."""
        first_done: list[float] = []

        def done() -> bool:
            finished = [_finished(outcome(r)) for r in range(self.num_processes)]
            if all(f or r in watch.lost for r, f in enumerate(finished)):
                return True
            if watch.lost or not any(finished):
                return False
            first_done[:] = first_done or [time.monotonic()]
            if time.monotonic() - first_done[0] <= grace_s:
                return False
            late[:] = [r for r, f in enumerate(finished) if not f]
            return True

        return done

    def close(self) -> None:
        """End the ranks and remove the pool's files: ranks waiting for a run are asked to
        stop (up to 5 s); any still running then get SIGTERM, and SIGKILL 5 s later. A
        Ctrl-C meanwhile skips the wait and is raised once the ranks are ended."""
        if self._ctx is not None:
            assert self._tmp is not None
            (Path(self._tmp.name) / POOL_STOP).touch()
            end = time.monotonic() + 5
            handlers = self._ctx.subprocess_handlers.values()
            try:
                while time.monotonic() < end and any(h.proc.poll() is None for h in handlers):
                    time.sleep(_POLL_S)
            finally:
                self._terminate()
        self._terminate()

    def _terminate(self) -> None:
        """SIGTERM to every rank still running, SIGKILL 5 s later; remove the files."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            _close_ranks(ctx)
        self._store = None
        self._started_with = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _close_ranks(ctx: Any) -> None:
    """SIGTERM to every rank of ``ctx`` still running, SIGKILL 5 s later (torch's
    ``PContext.close``), without torch's warning line per rank ("Sending process N closing
    signal SIGTERM"): distsgd says in its own line why the run ended."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        ctx.close(timeout=5)
    finally:
        log.setLevel(level)


def _kill_hung(
    ctx: Any, codes: dict[int, int | None], outcome: Callable[[int], Path], hung: set[int]
) -> None:
    """SIGKILL the ranks still running that every other rank has left, if the ranks that
    stopped on a lost peer named them as silent (no heartbeat): they hang (stopped or
    stuck), and waiting for them would only delay the end of the run."""
    running = {r for r, c in codes.items() if c is None}
    if not running or not running <= _named_silent(codes, outcome):
        return
    for r in sorted(running - hung):
        hung.add(r)
        pid = ctx.subprocess_handlers[r].proc.pid
        print(
            f"distsgd: rank {r} (pid {pid}) stopped making progress (no heartbeat); killing it",
            file=sys.stderr,
        )
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _named_silent(codes: dict[int, int | None], outcome: Callable[[int], Path]) -> set[int]:
    """The ranks that the ended ranks' outcome files name as silent (no heartbeat when
    they lost contact)."""
    named: set[int] = set()
    for r, code in codes.items():
        if code is None:
            continue
        try:
            found = json.loads(outcome(r).read_text())
            named.update(int(x) for x in found.get("silent_ranks", []))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return named


def _finished(path: Path) -> bool:
    """Whether a rank's outcome file says it finished its part of the run."""
    try:
        return json.loads(path.read_text()).get("kind") == "done"
    except (OSError, ValueError):
        return False


def _outcome(
    cfg: RunConfig,
    out: Path,
    codes: dict[int, int | None],
    lost: dict[int, int],
    errors: dict[int, dict[str, Any]],
    *,
    hung: set[int] | frozenset[int] = frozenset(),
) -> dict[str, Any]:

    for kind, exc in (
        ("config", ConfigError),
        ("diverged", TrainingDiverged),
        ("write", OutputWriteError),
    ):
        for r in sorted(errors):
            if errors[r]["kind"] == kind:
                raise exc(errors[r]["message"])
    fatal = sorted(r for r in lost if not _tolerates_loss(cfg, r))
    summary_path = out / "summary.json"
    rank0_done = codes.get(0) == 0 or errors.get(0, {}).get("kind") == "done"
    if not fatal and rank0_done and summary_path.exists():
        return json.loads(summary_path.read_text())
    # the lost ranks are those that ended without reporting a lost peer themselves
    # (killed, or failed on their own), and those that hung: named silent by the others
    # (hung: named silent by the others, killed here)
    silent = set(hung) - {r for r in errors if errors[r].get("kind") in ("lost", "done")}
    causes = sorted({r for r in fatal if errors.get(r, {}).get("kind") != "lost"} | silent)
    causes = causes or fatal

    def describe(r: int) -> str:
        if r in silent:
            return (
                f"rank {r} ({_role(cfg, r)}) stopped making progress (no heartbeat for "
                f"dist.timeout_s = {cfg.dist.timeout_s:g} s); it was killed"
            )
        return f"rank {r} ({_role(cfg, r)}) {describe_exit(lost[r])}"

    what = "; ".join(describe(r) for r in causes) or "a rank stopped without finishing the run"
    keep = (
        f"the last checkpoint in {out} is kept (continue with --resume {out})"
        if (out / "checkpoint.pt").exists() and cfg.dist.num_servers == 1
        else f"the last checkpoint in {out} is kept (runs with dist.num_servers > 1 "
        "cannot be resumed yet)"
        if (out / "checkpoint.pt").exists()
        else "no checkpoint was written yet"
    )
    message = f"{what}; every process of the run has stopped; {keep}"
    try:  # a full disk leaves the summary as rank 0 wrote it, or none
        if summary_path.exists():  # rank 0 wrote it without knowing which rank was lost
            summary = json.loads(summary_path.read_text())
            if summary.get("status") == "failed":
                summary["error"] = message
                summary["lost_ranks"] = causes
                write_json(summary_path, summary)
        elif out.is_dir():  # rank 0 could not write it (killed, hung): the report needs one
            _write_failed_summary(cfg, out, message, causes)
    except OSError:
        pass
    raise DistRunFailed(message)


def _write_failed_summary(cfg: RunConfig, out: Path, error: str, lost_ranks: list[int]) -> None:
    """``summary.json`` of a run whose rank 0 could not write it (and an empty
    ``metrics.jsonl`` if it had none): what the config and the evaluations written so far
    say; training counters only rank 0 knew are left out."""

    metrics = out / "metrics.jsonl"
    try:
        records = read_metrics(metrics) if metrics.exists() else []
    except (OSError, ValueError):
        records = []
    if not metrics.exists():
        metrics.touch()
    last = records[-1] if records else {}
    values = [r["eval_metric"] for r in records if r.get("eval_metric") is not None]
    t = cfg.train
    direction = t.metric_direction or METRICS[t.metric]
    best = (max if direction == "max" else min)(values, default=None)
    p = cfg.protocol
    write_json(
        out / "summary.json",
        {
            "name": cfg.name,
            "status": "failed",
            "stop_reason": "process_lost",
            "protocol": p.name,
            "runtime": cfg.runtime,
            "layout": spec_for(cfg.protocol).label(cfg.protocol, None, None),
            "model": cfg.model.label,
            "dataset": cfg.data.label,
            "num_learners": p.num_learners,
            "batch_size": p.batch_size,
            "lr": cfg.optimizer.lr,
            "seed": cfg.train.seed,
            "metric": t.metric,
            "metric_direction": direction,
            "target": t.target,
            "best_metric": best,
            "final_metric": last.get("eval_metric"),
            "reached": best is not None and target_reached(best, t.target, direction),
            "samples": last.get("samples", 0),
            "num_processes": required_processes(cfg.protocol, cfg.dist)[0],
            "error": error,
            "lost_ranks": lost_ranks,
            "written_by": "launcher",
        },
    )


_terminating = False  # a rank's SIGTERM came: later ones do not interrupt its teardown


def rank_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM's handler in a rank: it ends as Ctrl-C does (``KeyboardInterrupt``; rank 0
    writes an "interrupted" summary), and at the latest ``dist.timeout_s + 5`` seconds
    later whatever its teardown does (:func:`distsgd.runtime.dist.arm_exit_deadline`).
    Only the first SIGTERM interrupts: a second (the launcher's and the kernel's at the
    launcher's death) interrupted rank 0 writing its summary, which was then missing."""
    global _terminating
    rdist.arm_exit_deadline()
    if _terminating:
        return
    _terminating = True
    raise KeyboardInterrupt


def run_worker(
    config_toml: str,
    out_dir: str,
    *,
    resume: bool,
    progress: bool,
    faults: RankFaults | None = None,
) -> int:
    """One rank started by :func:`run`: train, and report how it ended.

    Returns the exit status: 0 done, 1 diverged or another error, 2 a user error, 3 a
    peer lost, 74 a file of the run directory could not be written, 130 stopped by SIGTERM. The message of a failure also goes to the file
    ``$DISTSGD_DIST_ERROR_FILE`` for the launcher, and so does ``{"kind": "done"}`` once
    this rank's part of the run is finished (its outcome written).
    """

    signal.signal(signal.SIGTERM, rank_sigterm)
    rank = os.environ.get("RANK", "?")

    def report(kind: str, e: BaseException, status: int) -> int:
        print(f"distsgd[rank {rank}]: {kind}: {e}", file=sys.stderr)
        path = os.environ.get(ENV_ERROR_FILE)
        if path:
            outcome = {"kind": kind, "message": str(e)}
            silent = getattr(e, "silent_ranks", None)
            if silent:  # peers whose heartbeat had stopped when this rank lost contact
                outcome["silent_ranks"] = list(silent)
            Path(path).write_text(json.dumps(outcome))
        return status

    try:
        cfg = RunConfig.from_dict(_toml(config_toml))
        Trainer(cfg, out_dir, progress=progress, faults=faults).run(resume=resume)
        path = os.environ.get(ENV_ERROR_FILE)
        if path:
            Path(path).write_text(json.dumps({"kind": "done", "message": ""}))
        return 0
    except TrainingDiverged as e:
        return report("diverged", e, 1)
    except OutputWriteError as e:
        return report("write", e, e.exit_status)
    except ValueError as e:
        return report("config", e, 2)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        if is_process_loss(e):
            return report("lost", e, 3)
        raise


def exit_worker(main: Callable[[], int], *, abort: bool = False) -> NoReturn:
    """End a rank process with ``main()``'s exit status without interpreter shutdown.

    Runs ``main`` (an uncaught exception prints its traceback, status 1), flushes stdout
    and stderr and calls ``os._exit``: the run's outcome is already written and the
    process group destroyed (:meth:`Trainer.run`), and skipping the shutdown keeps C++
    destructors of torch.distributed threads from aborting the process (module
    docstring). ``abort`` (a fault injected by tests,
    :attr:`~distsgd.runtime.faults.RankFaults.abort_at_exit`) ends it by ``os.abort()``
    here instead (SIGABRT after finishing, as that shutdown abort would).
    """
    try:
        code = main()
    except SystemExit as e:  # as the interpreter: None is 0, a message is printed and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report any failure as status 1, as Python does
        traceback.print_exc()
        code = 1
    logging.shutdown()  # flush log handlers: os._exit skips atexit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if abort:
        os.abort()
    os._exit(code)


def _toml(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


def rank_faults() -> RankFaults:
    """The faults :func:`run` was given for its ranks (its channel to them)."""
    return RankFaults.from_json(os.environ.get(rdist.ENV_FAULTS, ""))


def pooled_ranks_main(pool_dir: Path) -> int:
    """A rank of a :class:`RankPool`: train each run the pool writes (``run<N>.json``:
    config, directory, resume and progress flags, faults) as :func:`run_worker`, in
    order, until the pool asks it to stop or its folder is gone (status 0), or a run does
    not end well (that run's status)."""
    rank = os.environ.get("RANK", "?")
    # armed once for all runs (a run's own dist.timeout_s + 5 is not known yet)
    rdist.end_with_parent(65.0)
    number = 0
    try:
        with keep_loaded():  # a built-in data set is read once for all the pool's runs
            while True:
                # what the rank holds between runs (modules, caches) is moved out of the
                # collector's reach, so the full collection that frees a run's DDP wrapper
                # (SyncDistRuntime.close) scans that run's objects only (0.18 s a run -> ~0);
                # the last run's garbage is collected first (a scan of its objects only), so
                # none of it is frozen for good
                gc.collect()
                gc.freeze()
                number += 1
                path = pool_dir / f"run{number}.json"
                while not path.exists():
                    if (pool_dir / POOL_STOP).exists() or not pool_dir.is_dir():
                        return 0  # asked to stop, or the pool was dropped without close()
                    time.sleep(0.02)
                job = json.loads(path.read_text())
                os.environ[rdist.ENV_POOL_RUN] = str(number)
                os.environ[ENV_ERROR_FILE] = str(pool_dir / f"run{number}-rank{rank}.json")
                code = run_worker(
                    job["config"],
                    job["out"],
                    resume=job["resume"],
                    progress=job["progress"] and rank == "0",
                    faults=RankFaults.from_json(job["faults"]),
                )
                if code != 0:
                    return code
    except KeyboardInterrupt:
        return 130


def main() -> int:
    """A rank's work (``python -m distsgd.worker``, started by :func:`run`): the run's
    config, directory, resume flag and injected faults come from the environment the
    launcher set for it (a :class:`RankPool`'s ranks: from its run files)."""
    pool = os.environ.get(ENV_POOL_DIR)
    if pool:
        return pooled_ranks_main(Path(pool))
    return run_worker(
        os.environ[rdist.ENV_CONFIG],
        os.environ[rdist.ENV_OUT],
        resume=os.environ.get(rdist.ENV_RESUME) == "1",
        progress=os.environ.get(rdist.ENV_PROGRESS) == "1",
        faults=rank_faults(),
    )
