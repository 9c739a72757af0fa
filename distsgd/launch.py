"""Training on the ``dist`` runtime's processes: on this machine, or as one rank under
torchrun.

**One machine.** :func:`run` starts the ranks (:mod:`distsgd.runtime.launch`: torch's
process layer, the rendezvous store hosted here on ``dist.master_addr`` only, a free port
unless ``dist.master_port`` is set) and hands them the run; :class:`RankPool` keeps the
ranks for run after run. Both give a rank its runs the same way, its one entry path: run
files ``run<N>.json`` (config, directory, resume and progress flags, injected faults) in
a folder named by ``$DISTSGD_JOBS_DIR``, taken in order by :func:`main` (``python -m
distsgd.worker``); a rank ends after a run marked ``last`` (:func:`run`'s), after a run
that does not end well, or when the pool asks it to stop. Each rank sets its torch
threads to its share of the cores (``train.num_threads`` overrides).

**Why not the elastic agent itself.** torchrun's agent (``elastic_launch``) tears down
every worker as soon as one fails; with ``max_restarts = 0`` the run is over. That is
right for the synchronous protocols but wrong for the asynchronous ones, which must lose
a learner and go on (Rudra's server keeps serving the others). So the launcher uses the
agent's process layer and applies its own failure policy:

* a learner rank of ``parameter_server`` (modes ``softsync`` / ``async``) or
  ``compute_groups`` is lost (it dies, or stops making progress and is killed,
  :class:`~distsgd.runtime.launch.RankWatch`): it is reported on stderr and the others go
  on; the server logs the loss and the run completes (listed in ``summary.json`` under
  ``events``);
* any other rank is lost: the other ranks notice it themselves (a c10d error or
  ``dist.timeout_s`` of silence) and stop; whatever is still running ``dist.timeout_s +
  5`` seconds later is terminated (SIGTERM, then SIGKILL). :class:`DistRunFailed` names
  the lost rank; the last checkpoint is kept, and ``--resume`` continues from it;
* a rank that stops making progress (``kill -STOP``, stuck holding the GIL) is killed by
  SIGKILL once its heartbeat has not moved for ``dist.timeout_s`` and named as such; the
  bound for every role is the table of :mod:`distsgd.runtime.launch`.

When rank 0 cannot write the failed run's ``summary.json`` (it was killed, or hung), the
launcher writes it (``status = "failed"``, ``lost_ranks``, the samples of the last
evaluation in ``metrics.jsonl``), so that ``distsgd report`` reads the run. In every
case :func:`run` returns only after every process it started has ended.

A rank reports that it has finished (its outcome file holds ``"kind": "done"``) before
it ends, so a rank that dies by a signal after that point does not fail a run that it had
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

**A launcher that dies.** Every rank ends when its parent dies
(:func:`~distsgd.runtime.launch.end_with_parent`): SIGTERM ends a rank as Ctrl-C does
(rank 0 writes an "interrupted" summary), and a rank still running ``dist.timeout_s + 5``
seconds later ends by SIGALRM (:func:`~distsgd.runtime.launch.arm_exit_deadline`).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from distsgd.config import METRICS, ConfigError, LocalRanks, RunConfig, required_processes
from distsgd.control import RunOptions
from distsgd.data import keep_loaded
from distsgd.layout import spec_for
from distsgd.metrics import OutputWriteError, read_metrics, write_json
from distsgd.objectives import reached as target_reached
from distsgd.rundir import check_new_run_dir
from distsgd.runtime.base import TrainingDiverged
from distsgd.runtime.faults import RankFaults, describe_exit
from distsgd.runtime.launch import (
    ENV_JOBS,
    ENV_RUN,
    PeerLost,
    Ranks,
    RankWatch,
    close_ranks,
    end_with_parent,
    exit_worker,
    namespace,
    rank_sigterm,
    start_ranks,
)
from distsgd.runtime.ps import LearnerLost, ServerLost
from distsgd.trainer import Trainer

__all__ = [
    "DistRunFailed",
    "RankPool",
    "exit_worker",
    "is_process_loss",
    "main",
    "rank_sigterm",
    "run",
    "run_worker",
    "under_launcher",
]

POOL_STOP = "stop"  # the file in the jobs folder that ends the ranks waiting for a run
_POLL_S = 0.1
# a rank's outcome kinds that the launcher raises again as the run's own error (one line)
_RERAISED: dict[str, type[Exception]] = {
    "config": ConfigError,
    "diverged": TrainingDiverged,
    "write": OutputWriteError,
}
_POOL_POLL_S = 0.02  # a pooled run's end: a short run's wall is not padded by the poll


class DistRunFailed(RuntimeError):
    """A process of a dist run was lost where the protocol cannot go on without it."""


def is_process_loss(e: BaseException) -> bool:
    """True for the errors that mean a process of the run was lost (any rank)."""

    return isinstance(e, DistRunFailed | PeerLost | ServerLost | LearnerLost)


def under_launcher() -> bool:
    """True inside a rank started by torchrun (or by :func:`run`)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _role(cfg: RunConfig, rank: int) -> str:
    return spec_for(cfg.protocol).role(rank, cfg.dist, cfg.protocol)


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
    options: RunOptions | None = None,
    dir_claimed: bool = False,
    ranks: LocalRanks | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` (runtime ``dist``) to its stop rule on real processes (``faults``:
    injected into the ranks by tests, :class:`~distsgd.runtime.faults.RankFaults`;
    ``options``: every rank's :class:`~distsgd.control.RunOptions`; ``dir_claimed``: the
    caller holds ``out_dir``'s :class:`~distsgd.rundir.RunDirClaim` for the run, else
    rank 0 claims it).

    Under torchrun this process is one rank: it trains (rank 0 writes ``out_dir``) and
    returns the summary on rank 0, ``{}`` elsewhere. Otherwise it starts the run's ranks
    on this machine (``ranks``, as the caller checked them, or ``required_processes``)
    and returns rank 0's summary.

    Raises:
        ConfigError: a rank stopped on a user error (its message), or ``out_dir``
            already holds a run.
        TrainingDiverged: the loss became NaN or infinite.
        DistRunFailed: a rank was lost and the protocol cannot go on (names the rank).
        KeyboardInterrupt: interrupted; every rank is stopped, the checkpoint kept.
    """

    out = Path(out_dir)
    kw = {"resume": resume, "progress": progress, "faults": faults, "options": options}
    if under_launcher():
        return _run_rank(cfg, out, dir_claimed=dir_claimed, **kw)
    n = ranks.count if ranks is not None else required_processes(cfg.protocol, cfg.dist)[0]
    return _launch_local(cfg, out, n, dir_claimed=dir_claimed, **kw)


def _run_rank(
    cfg: RunConfig,
    out: Path,
    *,
    resume: bool,
    progress: bool,
    faults: RankFaults | None,
    options: RunOptions | None,
    dir_claimed: bool,
) -> dict[str, Any]:
    """This process's rank under torchrun: train; on rank 0, a failed run's
    ``summary.json`` names the ranks it lost (``lost_ranks``), as distsgd's own launcher
    names them. Workers that torchrun restarted (``--max-restarts``,
    ``TORCHELASTIC_RESTART_COUNT > 0``) resume from the run's last checkpoint when the same
    torchrun agent wrote it; a directory that held another run is refused again."""
    rank = int(os.environ["RANK"])
    trainer = Trainer(cfg, out, progress=progress and rank == 0, faults=faults, options=options)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    # torchrun's agent on this host is the parent of every attempt's workers
    launch_id = f"{socket.gethostname()}:{os.getppid()}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    try:
        return trainer.run(
            resume=resume, dir_claimed=dir_claimed, launch_id=launch_id, restarted=restarted
        )
    except RuntimeError as e:
        lost = lost_ranks(e)
        summary_path = out / "summary.json"
        if rank == 0 and lost and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            if summary.get("status") == "failed":
                write_json(summary_path, {**summary, "lost_ranks": lost})
        raise


def lost_ranks(e: BaseException) -> list[int]:
    """The ranks a process-loss error names as lost (``[]`` for any other error):
    :class:`~distsgd.runtime.launch.PeerLost`'s silent ranks, ``ServerLost``'s server,
    ``LearnerLost``'s learners."""
    if isinstance(e, PeerLost):
        return sorted(e.silent_ranks)
    if isinstance(e, ServerLost):
        return [e.rank]
    if isinstance(e, LearnerLost):
        return sorted(e.ranks)
    return []


class _Jobs:
    """A folder of run files for ranks (module docstring): ``run<N>.json``, each written
    whole, and ``run<N>-rank<r>.json``, rank r's outcome of run N."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.number = folder, 0

    def submit(
        self,
        cfg: RunConfig,
        out: Path,
        *,
        resume: bool,
        progress: bool,
        faults: RankFaults | None,
        options: RunOptions | None,
        last: bool,
        dir_claimed: bool = False,
    ) -> Callable[[int], Path]:
        """Hand the next run to the ranks; returns where rank r reports its outcome."""
        self.number += 1
        job = {"config": cfg.to_toml(), "out": str(out.resolve()), "resume": resume}
        job |= {"progress": progress, "last": last, "dir_claimed": dir_claimed}
        job["faults"] = faults.to_json() if faults is not None else ""
        job["options"] = options.to_json() if options is not None else None
        part = self.folder / f"run{self.number}.json.part"
        part.write_text(json.dumps(job))
        part.rename(self.folder / f"run{self.number}.json")
        return lambda r, number=self.number: self.folder / f"run{number}-rank{r}.json"

    def prefix(self) -> str:
        """The store namespace of the last run submitted (the ranks' :data:`ENV_RUN`)."""
        return namespace(run=str(self.number))

    def stop(self) -> None:
        """Ask the ranks waiting for a run to end."""
        (self.folder / POOL_STOP).touch()


def _start(ranks: Ranks, jobs: _Jobs) -> Ranks:
    """Start ``python -m distsgd.worker`` as every rank of ``ranks``, taking its runs
    from ``jobs``."""
    return start_ranks(ranks, ("-m", "distsgd.worker"), lambda r: {ENV_JOBS: str(jobs.folder)})


class _Watch:
    """The launcher's failure policy over one run's ranks (module docstring): polls the
    processes every ``poll_s`` until every rank has ended or, with ``run_done`` (pooled
    ranks, which outlive a run), until it says the run is done; a fatal loss ends the
    watch ``dist.timeout_s + 5`` seconds later at the latest. ``outcome(r)`` is rank r's
    outcome file for this run; ``prefix`` its store namespace (heartbeats)."""

    def __init__(
        self,
        ranks: Ranks,
        cfg: RunConfig,
        outcome: Callable[[int], Path],
        prefix: str,
        poll_s: float = _POLL_S,
    ) -> None:
        self.ranks, self.cfg, self.outcome, self.poll_s = ranks, cfg, outcome, poll_s
        self.beats = RankWatch(ranks, prefix, self._announce_hung)
        self.codes: dict[int, int | None] = {}
        self.lost: dict[int, int] = {}
        self.after_done: dict[int, int] = {}  # ended with an error after reporting "done"
        self.fatal_since: float | None = None
        self.grace_s = cfg.dist.timeout_s + 5

    @property
    def hung(self) -> set[int]:
        """The ranks killed for silence (no heartbeat for their ``timeout_s``)."""
        return set(self.beats.hung)

    def _announce_hung(self, r: int, line: str) -> None:
        goes_on = _tolerates_loss(self.cfg, r) and self.fatal_since is None
        print(
            f"distsgd: {line}" + ("; the server goes on without it" if goes_on else ""),
            file=sys.stderr,
        )

    def _lose(self, r: int, code: int) -> None:
        self.lost[r] = code
        if not _tolerates_loss(self.cfg, r) and self.fatal_since is None:
            self.fatal_since = time.monotonic()

    def poll(self) -> None:
        cfg = self.cfg
        self.codes = self.beats.poll()
        for r, code in self.codes.items():
            if code in (None, 0) or r in self.lost or r in self.after_done:
                continue
            if r in self.beats.hung:
                self._lose(r, code)  # killed here, already reported
                continue
            pid = self.ranks.pid(r)
            report = _read(self.outcome(r))
            if report.get("kind") == "done":
                # its part of the run was done: the run is not affected
                self.after_done[r] = code
                print(
                    f"distsgd: rank {r} ({_role(cfg, r)}, pid {pid}) {describe_exit(code)} "
                    "after it had finished its part of the run",
                    file=sys.stderr,
                )
                continue
            self._lose(r, code)
            if report.get("kind") in _RERAISED:
                continue  # the run's error, printed once by whoever called the launcher
            # a rank that lost a peer itself says so on its own line
            goes_on = self.fatal_since is None and report.get("kind") != "lost"
            print(
                f"distsgd: rank {r} ({_role(cfg, r)}, pid {pid}) {describe_exit(code)}"
                + ("; the server goes on without it" if goes_on else ""),
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
                    if time.monotonic() - self.fatal_since > self.grace_s:
                        return
                time.sleep(self.poll_s)
        except SignalException:
            # start_processes turns SIGINT/SIGTERM into SignalException: an interrupt like
            # Ctrl-C (every rank is stopped by the caller; rank 0 writes its summary)
            raise KeyboardInterrupt from None

    def errors(self) -> dict[int, dict[str, Any]]:
        found = {r: _read(self.outcome(r)) for r in self.codes}
        return {r: e for r, e in found.items() if e}


def _launch_local(
    cfg: RunConfig,
    out: Path,
    n: int,
    *,
    resume: bool,
    progress: bool,
    faults: RankFaults | None,
    options: RunOptions | None = None,
    dir_claimed: bool = False,
) -> dict[str, Any]:
    d = cfg.dist
    with tempfile.TemporaryDirectory(prefix="distsgd-launch-") as tmp:
        # The rendezvous store is hosted here, as torchrun's agent hosts it, so that a free
        # port (master_port = 0) is bound once and no rank can lose it to another program.
        ranks = Ranks.rendezvous(n, d.master_addr, d.master_port, d.timeout_s, f"{tmp}/logs")
        jobs = _Jobs(Path(tmp))
        outcome = jobs.submit(
            cfg,
            out,
            resume=resume,
            progress=progress,
            faults=faults,
            options=options,
            last=True,
            dir_claimed=dir_claimed,
        )
        watch = _Watch(_start(ranks, jobs), cfg, outcome, jobs.prefix())
        try:
            watch.until_done()
        finally:
            # SIGTERM to every rank still running (rank 0 then writes its summary), SIGKILL
            # to any still there 5 s later
            close_ranks(ranks)
        codes = ranks.codes()
        errors = watch.errors()
    return _outcome(cfg, out, codes, watch.lost, errors, hung=watch.hung)


class RankPool:
    """Ranks on this machine kept alive from one ``dist`` run to the next, for a caller
    that trains many short runs with the same number of processes (``distsgd train
    --tune``'s probes and segments, ``distsgd tune``'s probes): a run then costs no
    process start (interpreter, torch, the first optimizer's ``torch._dynamo`` import).

    Each run is :func:`run`'s, rank for rank: every rank joins a fresh process group (its
    store keys under ``run<N>/``, :func:`distsgd.runtime.launch.store_namespace`), trains
    ``cfg`` with :class:`~distsgd.trainer.Trainer` and reports its outcome; the same
    failure policy applies. A run that fails in any way (a rank lost, diverged, a user
    error, an interrupt) ends the pool's processes at once (SIGTERM, then SIGKILL 5 s
    later), as :func:`run` ends its own, and the next run starts fresh ones; so does a
    run whose ``dist.master_addr`` / ``master_port`` / ``timeout_s`` differ from those the
    ranks were started with. Under torchrun (this process is one rank) it is :func:`run`.
    A pooled rank ends itself ``65`` s after its launcher died (in a run: ``dist.timeout_s
    + 5``), and once the pool's folder is gone (a pool dropped without :meth:`close`).

    Args:
        num_processes: the ranks every run must need (``required_processes``).

    Raises (from :meth:`run`): what :func:`run` raises; ``ValueError`` for a run that
    needs another number of processes, or a fault a pooled rank cannot inject
    (``RankFaults.abort_at_exit``).
    """

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes
        self._ranks: Ranks | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._jobs: _Jobs | None = None
        self._started_with: tuple[str, int, float] | None = None

    @property
    def _ctx(self) -> Any:
        """torch's process context of the ranks (None when none run)."""
        return self._ranks.context if self._ranks is not None else None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a pool dropped without close(): end its ranks
        if getattr(self, "_ranks", None) is not None:
            try:
                self._terminate()
            except Exception:  # noqa: BLE001 - at interpreter shutdown; the ranks end alone
                pass

    def _ensure(self, cfg: RunConfig) -> tuple[Ranks, _Jobs]:
        """The ranks, started unless they run already with ``cfg``'s rendezvous settings."""
        d = cfg.dist
        wanted = (d.master_addr, d.master_port, d.timeout_s)
        if self._ranks is not None and self._jobs is not None:
            if self._ranks.alive() and wanted == self._started_with:
                return self._ranks, self._jobs
        self.close()
        self._tmp = tempfile.TemporaryDirectory(prefix="distsgd-pool-")
        tmp = self._tmp.name
        ranks = Ranks.rendezvous(
            self.num_processes, d.master_addr, d.master_port, d.timeout_s, f"{tmp}/logs"
        )
        self._jobs = _Jobs(Path(tmp))  # fresh ranks count their runs from 1
        self._ranks = _start(ranks, self._jobs)
        self._started_with = wanted
        return self._ranks, self._jobs

    def run(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = False,
        faults: RankFaults | None = None,
        options: RunOptions | None = None,
    ) -> dict[str, Any]:
        """Train ``cfg`` (runtime ``dist``) to its stop rule on the pool's ranks; returns
        rank 0's summary (as :func:`run`; ``faults``: injected by tests; ``options``: the
        run's :class:`~distsgd.control.RunOptions`, given to every rank's trainer)."""
        out = Path(out_dir)
        if under_launcher():
            return run(cfg, out, resume=resume, progress=progress, faults=faults, options=options)
        n, why = required_processes(cfg.protocol, cfg.dist)
        if n != self.num_processes:
            raise ValueError(f"the pool has {self.num_processes} ranks, the run needs {n} ({why})")
        if faults is not None and faults.abort_at_exit is not None:
            raise ValueError("RankFaults.abort_at_exit is not injected into pooled ranks")
        if not resume:
            check_new_run_dir(out)  # fail before any rank starts the run
        ranks, jobs = self._ensure(cfg)
        outcome = jobs.submit(
            cfg, out, resume=resume, progress=progress, faults=faults, options=options, last=False
        )
        watch = _Watch(ranks, cfg, outcome, jobs.prefix(), poll_s=_POOL_POLL_S)
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
        return _outcome(cfg, out, ranks.codes(), watch.lost, errors, hung=watch.hung)

    def _run_done(
        self, watch: _Watch, outcome: Callable[[int], Path], grace_s: float, late: list[int]
    ) -> Callable[[], bool]:
        """The watch's end: every rank reported the end of its part or was lost (the
        failure policy decides then); or, with none lost, some reported it and the others
        have not for ``grace_s`` seconds (a rank stuck after its last collective: named in
        ``late``)."""
        first_done: list[float] = []

        def done() -> bool:
            # each rank's outcome file says whether it finished its part of the run
            finished = [_read(outcome(r)).get("kind") == "done" for r in range(self.num_processes)]
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
        if self._ranks is not None and self._jobs is not None:
            self._jobs.stop()
            end = time.monotonic() + 5
            try:
                while time.monotonic() < end and any(
                    c is None for c in self._ranks.codes().values()
                ):
                    time.sleep(_POLL_S)
            finally:
                self._terminate()
        self._terminate()

    def _terminate(self) -> None:
        """SIGTERM to every rank still running, SIGKILL 5 s later; remove the files."""
        if self._ranks is not None:
            ranks, self._ranks = self._ranks, None
            close_ranks(ranks)
        self._jobs = None
        self._started_with = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _read(path: Path) -> dict[str, Any]:
    """A rank's outcome file (``{}`` where it has none, or none readable yet)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _outcome(
    cfg: RunConfig,
    out: Path,
    codes: dict[int, int | None],
    lost: dict[int, int],
    errors: dict[int, dict[str, Any]],
    *,
    hung: set[int] | frozenset[int] = frozenset(),
) -> dict[str, Any]:

    for kind, exc in _RERAISED.items():
        for r in sorted(errors):
            if errors[r]["kind"] == kind:
                raise exc(errors[r]["message"])
    fatal = sorted(r for r in lost if not _tolerates_loss(cfg, r))
    summary_path = out / "summary.json"
    rank0_done = codes.get(0) == 0 or errors.get(0, {}).get("kind") == "done"
    if not fatal and rank0_done and summary_path.exists():
        return json.loads(summary_path.read_text())
    # the lost ranks are those that ended without reporting a lost peer themselves
    # (killed, or failed on their own), and those killed for silence (no heartbeat)
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
            _write_failed_summary(cfg, out, message, causes, num_processes=len(codes))
    except OSError:
        pass
    raise DistRunFailed(message)


def _write_failed_summary(
    cfg: RunConfig, out: Path, error: str, lost_ranks: list[int], *, num_processes: int
) -> None:
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
            "num_processes": num_processes,
            "error": error,
            "lost_ranks": lost_ranks,
            "written_by": "launcher",
        },
    )


def run_worker(
    config_toml: str,
    out_dir: str,
    *,
    resume: bool,
    progress: bool,
    faults: RankFaults | None = None,
    options: RunOptions | None = None,
    outcome: Path | None = None,
    dir_claimed: bool = False,
) -> int:
    """One rank's run: train, and report how it ended (``dir_claimed``: the launcher
    holds the run directory's claim).

    Returns the exit status: 0 done, 1 diverged or another error, 2 a user error, 3 a
    peer lost, 74 a file of the run directory could not be written, 130 stopped by
    SIGTERM. The message of a failure also goes to the file ``outcome`` for the launcher,
    and so does ``{"kind": "done"}`` once this rank's part of the run is finished (its
    outcome written).
    """

    signal.signal(signal.SIGTERM, rank_sigterm)
    rank = os.environ.get("RANK", "?")

    def report(kind: str, e: BaseException, status: int) -> int:
        if outcome is None or kind not in _RERAISED:  # else the launcher prints it once
            print(f"distsgd[rank {rank}]: {kind}: {e}", file=sys.stderr)
        if outcome is not None:
            outcome.write_text(json.dumps({"kind": kind, "message": str(e)}))
        return status

    try:
        cfg = RunConfig.from_dict(tomllib.loads(config_toml))
        trainer = Trainer(cfg, out_dir, progress=progress, faults=faults, options=options)
        trainer.run(resume=resume, dir_claimed=dir_claimed)
        if outcome is not None:
            outcome.write_text(json.dumps({"kind": "done", "message": ""}))
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


_abort_at_exit = False  # the last run's RankFaults.abort_at_exit named this rank


def aborts_at_exit() -> bool:
    """Whether this rank ends by SIGABRT (a fault injected by tests, its last run's)."""
    return _abort_at_exit


def main() -> int:
    """A rank's work (``python -m distsgd.worker``, started by :func:`run` or a
    :class:`RankPool`): train each run of the jobs folder ``$DISTSGD_JOBS_DIR`` (its
    ``run<N>.json``, module docstring) as :func:`run_worker`, in order, until a run marked
    ``last`` ends or one does not end well (that run's status), the pool asks it to stop
    or its folder is gone (status 0)."""
    global _abort_at_exit
    jobs = Path(os.environ[ENV_JOBS])
    rank = os.environ.get("RANK", "?")
    # armed once for all runs (a run's own dist.timeout_s + 5 is set when it joins)
    end_with_parent(65.0)
    number = 0
    try:
        with keep_loaded():  # a built-in data set is read once for all the rank's runs
            while True:
                # what the rank holds between runs (modules, caches) is moved out of the
                # collector's reach, so the full collection that frees a run's DDP wrapper
                # (SyncDistRuntime.close) scans that run's objects only; the last run's
                # garbage is collected first, so none of it is frozen for good
                gc.collect()
                gc.freeze()
                number += 1
                path = jobs / f"run{number}.json"
                while not path.exists():
                    if (jobs / POOL_STOP).exists() or not jobs.is_dir():
                        return 0  # asked to stop, or the pool was dropped without close()
                    time.sleep(0.02)
                job = json.loads(path.read_text())
                faults = RankFaults.from_json(job["faults"])
                _abort_at_exit = str(faults.abort_at_exit) == rank
                os.environ[ENV_RUN] = str(number)
                code = run_worker(
                    job["config"],
                    job["out"],
                    resume=job["resume"],
                    progress=job["progress"] and rank == "0",
                    faults=faults,
                    options=RunOptions.from_json(job["options"]),
                    outcome=jobs / f"run{number}-rank{rank}.json",
                    dir_claimed=job["dir_claimed"],
                )
                if code != 0 or job["last"]:
                    return code
    except KeyboardInterrupt:
        return 130
