"""Rank processes on this machine: start them, watch them, end them, for every launcher
(``distsgd train --runtime dist`` and :class:`distsgd.launch.RankPool`; ``python -m
distsgd.torch.launch``), and the rank side of their lifecycle: heartbeats, the exit
deadline, the death of the launcher.

**Start.** :func:`start_ranks` starts W ranks with torch's own process layer,
:func:`torch.distributed.elastic.multiprocessing.start_processes` (torchrun's agent's:
spawning, logs, terminating the process groups), each with torchrun's environment
(:func:`rank_environment`: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and the rendezvous store hosted by the launching process
(:func:`distsgd.runtime.rendezvous.rendezvous_store`, on ``master_addr`` only).
:class:`Ranks` holds what was derived once for them (world size, address, port, the
store, the logs' folder) and the processes.

**Watch.** :class:`RankWatch` polls every rank's exit status and its heartbeat in the
store (:class:`Heartbeats`: a counter each rank adds to every ``min(1, timeout_s / 10)``
seconds from a daemon thread, with the rank's ``timeout_s`` beside it). A rank whose
counter does not move for longer than its ``timeout_s`` (stopped by SIGSTOP, stuck
holding the GIL) is killed at once by SIGKILL (SIGTERM does not reach a stopped process)
and named; what that means for the run is the launcher's policy
(:mod:`distsgd.launch`, :mod:`distsgd.torch.launch`). A rank that has not started its
heartbeat yet, or has left its run on purpose, is not judged by it.

**Bounds for a stopped rank** (``kill -STOP``; T = ``dist.timeout_s``; seconds from the
stop, one machine, distsgd's launchers). The stopped rank itself is killed by T + 2 in
every role (T without a heartbeat, plus the heartbeat interval and the watch's poll);
then:

=============================  ====================================================  =======
rank stopped                   what happens                                          ended
=============================  ====================================================  =======
async / n-softsync learner     the server drops it after T of silence and serves     run
                               the others to the stop rule                           goes on
compute group leader           the server drops the group after T; its members see   run goes
                               the leader's connections close. The server's send to  on, or
                               the stopped leader can block for T, and the other     fails by
                               groups' members wait T in their broadcast: they may   2T + 12
                               be lost too, and with every learner lost the run
                               fails naming the stopped rank
compute group member           the group's all-reduce times out (T): the group is    run
                               lost, the server goes on with the others              goes on
server (coordinator, shard)    the learners wait for its heartbeat T, then end       2T + 12
                               (``ServerLost``); the run fails naming it
hardsync-mode PS learner       the server's wait times out (T): ``LearnerLost``      2T + 12
                               ends the run, naming it
hardsync / SMA / local SGD     its peers time out in the collective (T) and name     2T + 12
                               it; the run fails naming it
drop-in rank                   as the same role above                                as above
=============================  ====================================================  =======

"2T + 12": the loss of a rank the run cannot do without starts the launcher's grace of
T + 5 s for the others, after which SIGTERM and, 5 s later, SIGKILL end them; the others
usually end sooner, on the killed rank's closed connections or their own timeout. The
failed run's ``summary.json`` names the stopped rank in ``lost_ranks`` (written by the
launcher where rank 0 could not). Where the launcher itself dies, every rank ends by
itself (:func:`end_with_parent`): SIGTERM from the kernel, and T + 5 s later SIGALRM.

**End.** A rank ends with ``os._exit`` once its outcome is written (:func:`exit_worker`),
so no C++ destructor of a torch.distributed thread runs at interpreter shutdown, where one
destroyed while joinable aborts the process (``terminate called without an active
exception``, SIGABRT). SIGTERM ends a rank as Ctrl-C does (:func:`rank_sigterm`).
:func:`close_ranks` ends whatever still runs: SIGTERM, SIGKILL 5 s later (torch's
``PContext.close``).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from distsgd.runtime.faults import describe_exit
from distsgd.runtime.rendezvous import rendezvous_store, secret_tag

__all__ = [
    "ENV_JOBS",
    "ENV_RUN",
    "Heartbeats",
    "PeerLost",
    "RankWatch",
    "Ranks",
    "arm_exit_deadline",
    "close_ranks",
    "end_with_parent",
    "exit_worker",
    "join_namespace",
    "rank_environment",
    "rank_sigterm",
    "start_ranks",
    "store_namespace",
    "heartbeat_silence",
]

ENV_JOBS = "DISTSGD_JOBS_DIR"  # a distsgd rank's folder of run files (distsgd.launch)
# the number of the run a distsgd rank trains now: its store keys (process group,
# heartbeats) are apart from those of the runs before
ENV_RUN = "DISTSGD_RUN"
POLL_S = 0.1  # how often the watch reads exit statuses
BEAT_POLL_S = 0.5  # how often it reads heartbeats


# ---- the rank side ------------------------------------------------------------------------
def namespace(restart: str = "0", run: str | None = None) -> str:
    """The prefix of a run's keys in the rendezvous store: ``distsgd/<tag><restart>/`` and,
    for the N-th run of a distsgd rank, ``run<N>/`` below it; ``<tag>`` is the run
    secret's (:func:`~distsgd.runtime.rendezvous.secret_tag`, "" without one)."""
    return f"distsgd/{secret_tag()}{restart}/" + (f"run{run}/" if run else "")


def store_namespace() -> str:
    """This rank's :func:`namespace`: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 under
    distsgd's launchers) and the run number :data:`ENV_RUN`."""
    return namespace(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get(ENV_RUN))


def join_namespace() -> str:
    """The prefix of the join's keys (:func:`~distsgd.runtime.rendezvous.join_run`):
    ``distsgd/join/<restart>/``, the same for every secret."""
    return f"distsgd/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class PeerLost(RuntimeError):
    """A peer process died or stayed silent longer than ``dist.timeout_s``.

    Attributes:
        silent_ranks: the ranks whose heartbeat had stopped when this rank lost contact
            (hung or dead; :class:`Heartbeats`), ``[]`` when every peer was alive or
            nobody could tell.
    """

    def __init__(self, message: str, silent_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.silent_ranks = list(silent_ranks or [])


def _beat_key(prefix: str, rank: int) -> str:
    return f"{prefix}beat/{rank}"


def heartbeat_silence(store: dist.Store, prefix: str) -> Callable[[int], float]:
    """``silence_s(r)``, as :meth:`Heartbeats.silence_s`, for a process outside the run's
    ranks (a learner that joined it) that reads the heartbeats of the run with key
    namespace ``prefix`` from the run's ``store``."""
    seen: dict[int, tuple[int, float]] = {}

    def silence_s(rank: int) -> float:
        try:
            count = int(store.add(_beat_key(prefix, rank), 0))
        except (RuntimeError, dist.DistError):
            return math.inf
        now = time.monotonic()
        if rank not in seen or seen[rank][0] != count:
            seen[rank] = (count, now)
            return 0.0
        return now - seen[rank][1]

    return silence_s


def _left_key(prefix: str, rank: int) -> str:
    return f"{prefix}left/{rank}"


def _timeout_key(prefix: str, rank: int) -> str:
    return f"{prefix}timeout_s/{rank}"


class Heartbeats:
    """Per-rank liveness through the run's rendezvous store (the c10d TCPStore at
    ``MASTER_ADDR:MASTER_PORT``, hosted by the launcher or torchrun's agent).

    A daemon thread adds 1 to this rank's counter every ``interval_s`` seconds
    (``min(1, timeout_s / 10)``). It goes on while the rank computes, evaluates or waits
    in a collective (torch and gloo release the GIL), and stops when the process is
    stopped (SIGSTOP), dies, or hangs holding the GIL. So when a collective times out,
    the ranks whose counter does not move for a few intervals are the ones that stopped
    making progress (:meth:`silent_ranks`); a rank waiting for another rank's long solo
    work (rank 0 evaluating) waits as long as that rank beats (:meth:`wait_for`), not
    ``timeout_s``; and the launcher kills a rank silent for longer than its
    ``timeout_s`` (:class:`RankWatch`). A second daemon thread ends this rank (one line,
    status 1) once the store has not answered a beat for ``timeout_s``: its host is cut
    off from the master's, where the store lives (:meth:`_watch_store`).

    Keys: ``<namespace>beat/<rank>``, ``…/timeout_s/<rank>`` (this rank's ``timeout_s``,
    for the launcher), ``…/left/<rank>`` (the rank ended its part on purpose), ``…/<name>``
    of :meth:`post`; ``<namespace>`` is :func:`store_namespace`.

    Raises:
        PeerLost: from :meth:`wait_for`, the awaited rank's heartbeat stopped for
            ``timeout_s``.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self._prefix = store_namespace()
        self._store = self._client()  # the main thread's
        self._store.set(_timeout_key(self._prefix, rank), repr(float(timeout_s)))
        self._seen: dict[int, tuple[int, float]] = {}  # rank: (count, when it moved)
        self._stop = threading.Event()
        self._last_ack = time.monotonic()  # when the store last answered a beat
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
        self._thread.start()
        threading.Thread(target=self._watch_store, daemon=True, name="store-watchdog").start()
        # A daemon thread still inside a store call when the interpreter exits aborts the
        # process ("terminate called without an active exception", SIGABRT: its return
        # to Python unwinds through pybind11's noexcept GIL guard): stop it before then.
        atexit.register(self._stop_beating)

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=self.timeout_s),
        )

    def _beat(self) -> None:
        try:
            store = self._client()
            key = _beat_key(self._prefix, self.rank)
            while not self._stop.is_set():
                store.add(key, 1)
                self._last_ack = time.monotonic()
                self._stop.wait(self.interval_s)
        except (RuntimeError, dist.DistError):  # the store is gone: the watchdog ends us
            return

    def _watch_store(self) -> None:
        """End this rank (status 1, one line) once the store has not answered a beat for
        ``timeout_s``: this host is cut off from the run's master host (a partition, the
        master host gone), so every peer across the cut is lost too, and a collective
        across it could wait until the cut heals. ``os._exit``: nothing of the run is
        left to write on this side of the cut (rank 0 shares the store's host)."""
        while not self._stop.wait(self.interval_s):
            silence = time.monotonic() - self._last_ack
            if silence > self.timeout_s and not self._stop.is_set():
                host = socket.gethostname()
                master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                print(
                    f"distsgd[rank {self.rank}]: lost the run's store at {master} from host "
                    f"{host} (no answer for {silence:.0f} s, dist.timeout_s = "
                    f"{self.timeout_s:g}); its peers are unreachable: stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    def _count(self, rank: int) -> int:
        return int(self._store.add(_beat_key(self._prefix, rank), 0))

    def silent_ranks(self) -> list[int]:
        """The other ranks whose heartbeat does not move for ``max(2, 3 · interval_s)``
        seconds and which did not leave on purpose (blocks that long). Where one is
        silent, the others are watched for as long again: a rank lost at the same moment
        (a second host killed while the first was cut off) may have beaten once in the
        first look, and is named too (blocks twice as long then)."""
        window = max(2.0, 3 * self.interval_s)
        try:
            silent = self._still([r for r in range(self.world_size) if r != self.rank], window)
            if silent:
                others = [r for r in range(self.world_size) if r not in (self.rank, *silent)]
                silent += self._still(others, window)
            return sorted(silent)
        except (RuntimeError, dist.DistError):
            return []

    def _still(self, ranks: list[int], window_s: float) -> list[int]:
        """Those of ``ranks`` whose counter does not move in ``window_s`` seconds and
        which did not leave on purpose."""
        if not ranks:
            return []
        before = {r: self._count(r) for r in ranks}
        time.sleep(window_s)
        left = {r for r in ranks if self._store.check([_left_key(self._prefix, r)])}
        return [r for r in ranks if r not in left and self._count(r) == before[r]]

    def silence_s(self, rank: int) -> float:
        """Seconds since this rank saw ``rank``'s heartbeat move (0.0 at the first look;
        infinite when the store is gone). One store round trip."""
        try:
            count = self._count(rank)
        except (RuntimeError, dist.DistError):
            return math.inf
        now = time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return 0.0
        return now - seen[1]

    def post(self, name: str, value: str = "1") -> None:
        """Mark ``name`` as done (for the ranks in :meth:`wait_for`), with ``value``."""
        self._store.set(self._prefix + name, value)

    def posted(self, name: str) -> str | None:
        """The value :meth:`post`-ed under ``name`` by any rank, None when none was (or
        the store is gone). One or two store round trips."""
        try:
            if self._store.check([self._prefix + name]):
                return self._store.get(self._prefix + name).decode()
        except (RuntimeError, dist.DistError):
            pass
        return None

    def wait_for(self, name: str, rank: int) -> None:
        """Wait until ``rank`` has :meth:`post`-ed ``name``, for as long as it beats.

        Raises:
            PeerLost: ``rank``'s heartbeat did not move for ``timeout_s`` seconds.
        """
        key = self._prefix + name
        try:
            count, since = self._count(rank), time.monotonic()
            while not self._store.check([key]):
                time.sleep(self.interval_s)
                now = self._count(rank)
                if now != count:
                    count, since = now, time.monotonic()
                elif time.monotonic() - since > self.timeout_s:
                    raise PeerLost(
                        f"rank {rank} stopped making progress (no heartbeat for "
                        f"{self.timeout_s:g} s)",
                        [rank],
                    )
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(f"lost the run's store while waiting for rank {rank} ({e})") from e

    def close(self) -> None:
        """Say that this rank leaves on purpose, and stop beating (the beat thread is
        joined: at most one store round trip, bounded by ``timeout_s``)."""
        try:
            self._store.set(_left_key(self._prefix, self.rank), "1")
        except (RuntimeError, dist.DistError):
            pass
        self._stop_beating()
        atexit.unregister(self._stop_beating)

    def _stop_beating(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_watching_parent = False
_exit_grace_s = 65.0  # a rank's grace after SIGTERM (end_with_parent sets its run's)
_exit_armed = False


def arm_exit_deadline(grace_s: float | None = None) -> None:
    """End this process ``grace_s`` seconds from now (default: the grace
    :func:`end_with_parent` set, ``dist.timeout_s + 5``) unless it has ended by then.

    SIGALRM, whose default action (terminate) the kernel carries out without the
    interpreter: a teardown that holds the GIL and never returns (a gloo process group's
    destructor joining gloo's thread, which waits for the GIL) cannot block it, where a
    watchdog thread's ``os._exit`` or SIGTERM's handler would wait for the GIL. Armed
    once; no effect on systems without SIGALRM or where SIGALRM has a handler of its own.
    """
    global _exit_armed
    alarm = getattr(signal, "SIGALRM", None)
    if _exit_armed or alarm is None or signal.getsignal(alarm) not in (signal.SIG_DFL, None):
        return
    _exit_armed = True
    signal.alarm(max(1, math.ceil(_exit_grace_s if grace_s is None else grace_s)))


def end_with_parent(grace_s: float) -> None:
    """End this rank when its parent (distsgd's launcher, torchrun's agent) dies.

    On Linux the kernel sends SIGTERM at the parent's death (``prctl(PR_SET_PDEATHSIG)``
    through ctypes); a daemon thread also checks the parent pid every second and, once it
    changed, sends SIGTERM itself (other systems). SIGTERM ends a rank as Ctrl-C does
    (rank 0 writes an "interrupted" summary); its handler arms :func:`arm_exit_deadline`,
    so a rank still running ``grace_s`` seconds later ends (SIGALRM), as it does with the
    watchdog thread's deadline. Called again (a distsgd rank's next run), it only sets
    the grace.
    """
    global _watching_parent, _exit_grace_s
    _exit_grace_s = grace_s
    if _watching_parent:
        return
    _watching_parent = True
    parent = os.getppid()
    kernel_signals = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            kernel_signals = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        print(
            f"distsgd[rank {os.environ.get('RANK', '?')}]: the launcher (pid {parent}) "
            "died; stopping",
            file=sys.stderr,
        )
        arm_exit_deadline()
        if not kernel_signals:  # else the kernel sent SIGTERM already: one is enough (a
            os.kill(os.getpid(), signal.SIGTERM)  # second interrupted rank 0's summary)
        time.sleep(_exit_grace_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


_terminating = False  # a rank's SIGTERM came: later ones do not interrupt its teardown


def rank_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM's handler in a rank: it ends as Ctrl-C does (``KeyboardInterrupt``; rank 0
    writes an "interrupted" summary), and at the latest ``dist.timeout_s + 5`` seconds
    later whatever its teardown does (:func:`arm_exit_deadline`). Only the first SIGTERM
    interrupts: a second (the launcher's and the kernel's at the launcher's death) would
    interrupt rank 0 writing its summary."""
    global _terminating
    arm_exit_deadline()
    if _terminating:
        return
    _terminating = True
    raise KeyboardInterrupt


def exit_worker(main: Callable[[], int], *, abort: bool | Callable[[], bool] = False) -> NoReturn:
    """End a rank process with ``main()``'s exit status without interpreter shutdown.

    Runs ``main`` (an uncaught exception prints its traceback, status 1), flushes stdout
    and stderr and calls ``os._exit``: the run's outcome is already written and the
    process group destroyed, and skipping the shutdown keeps C++ destructors of
    torch.distributed threads from aborting the process (module docstring). ``abort``
    (or its value after ``main``; a fault injected by tests,
    :attr:`~distsgd.runtime.faults.RankFaults.abort_at_exit`) ends it by ``os.abort()``
    instead (SIGABRT after finishing, as that shutdown abort would).
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
    if abort() if callable(abort) else abort:
        os.abort()
    os._exit(code)


# ---- the launcher side --------------------------------------------------------------------
def rank_environment(ranks: Ranks, rank: int) -> dict[str, str]:
    """torchrun's environment of ``rank`` on this machine, with this package importable
    (``PYTHONPATH``) and every rank a client of the launcher's store."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding distsgd/
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {
        "MASTER_ADDR": ranks.master_addr,
        "MASTER_PORT": str(ranks.master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(ranks.world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(ranks.world_size),
        "PYTHONPATH": pythonpath,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


@dataclass
class Ranks:
    """W rank processes on this machine and their rendezvous, derived once.

    Attributes:
        world_size: W >= 1 ranks, ``0 … W−1``.
        master_addr: the store's address (an address of this machine).
        master_port: the store's port (the one bound when 0 was asked for).
        store: the c10d TCPStore hosted here; the ranks are its clients.
        log_dir: where torch's process layer keeps the ranks' logs.
        context: torch's ``PContext`` of the processes (None before :func:`start_ranks`).
    """

    world_size: int
    master_addr: str
    master_port: int
    store: dist.TCPStore
    log_dir: str
    context: Any = None

    @classmethod
    def rendezvous(cls, world_size: int, addr: str, port: int, timeout_s: float, log_dir: str):
        """Bind the store on ``addr:port`` (0: a free port) for ``world_size`` ranks whose
        waits on it time out after ``timeout_s``.

        Raises:
            ConfigError: the port is in use, or ``addr`` is no address of this machine.
        """
        store = rendezvous_store(addr, port, world_size=world_size, timeout_s=timeout_s)
        return cls(world_size, addr, store.port, store, log_dir)

    def pid(self, rank: int) -> int:
        return int(self.context.subprocess_handlers[rank].proc.pid)

    def codes(self) -> dict[int, int | None]:
        """Each rank's exit status (None: running; negative: killed by that signal)."""
        return {r: h.proc.poll() for r, h in self.context.subprocess_handlers.items()}

    def alive(self) -> bool:
        return self.context is not None and all(c is None for c in self.codes().values())


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def start_ranks(
    ranks: Ranks, args: tuple[str, ...], extra_env: Callable[[int], dict[str, str]]
) -> Ranks:
    """Start ``python <args>`` as every rank of ``ranks`` (torch's process layer) with
    :func:`rank_environment` and ``extra_env(rank)``; returns ``ranks``, started.

    torch's ``start_processes`` leaves handlers behind that turn SIGINT and SIGTERM into
    its ``SignalException`` for the rest of this process's life; they are replaced by
    ones that raise ``KeyboardInterrupt``, which the launchers and their callers handle."""
    n = ranks.world_size
    ranks.context = start_processes(
        name="distsgd",
        entrypoint=sys.executable,
        args={r: args for r in range(n)},
        envs={r: {**rank_environment(ranks, r), **extra_env(r)} for r in range(n)},
        logs_specs=DefaultLogsSpecs(log_dir=ranks.log_dir),
        start_method="spawn",
    )
    if threading.current_thread() is threading.main_thread():  # where torch set its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)
    return ranks


def close_ranks(ranks: Ranks) -> None:
    """SIGTERM to every rank still running, SIGKILL 5 s later (torch's ``PContext.close``),
    without torch's warning line per rank: the launcher says in its own line why the run
    ended."""
    if ranks.context is None:
        return
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        ranks.context.close(timeout=5)
    finally:
        log.setLevel(level)


class RankWatch:
    """Exit statuses and heartbeats of started ranks (module docstring).

    Args:
        ranks: the started ranks.
        prefix: the store namespace of the run watched (:func:`namespace`).
        announce: ``announce(rank, line)``: says that ``rank`` was killed for silence
            (``line`` names it, its pid and the silence); the launcher's policy adds
            what it means for the run.

    Attributes:
        codes: each rank's exit status at the last :meth:`poll`.
        hung: ``{rank: seconds of silence}`` of the ranks killed here for silence.
    """

    def __init__(self, ranks: Ranks, prefix: str, announce: Callable[[int, str], None]) -> None:
        self.ranks, self.prefix, self.announce = ranks, prefix, announce
        self.codes: dict[int, int | None] = {}
        self.hung: dict[int, float] = {}
        self._seen: dict[int, tuple[int, float]] = {}  # rank: (count, when it moved)
        self._timeout_s: dict[int, float] = {}
        self._next_beat_check = 0.0

    def poll(self) -> dict[int, int | None]:
        """Read every rank's exit status and, every :data:`BEAT_POLL_S`, its heartbeat;
        kill the ranks silent for longer than their ``timeout_s``. Returns ``codes``."""
        self.codes = self.ranks.codes()
        now = time.monotonic()
        if now >= self._next_beat_check:
            self._next_beat_check = now + BEAT_POLL_S
            for r, code in self.codes.items():
                if code is None and r not in self.hung:
                    self._judge(r, now)
        return self.codes

    def _judge(self, rank: int, now: float) -> None:
        store, p = self.ranks.store, self.prefix
        try:
            count = int(store.add(_beat_key(p, rank), 0))
            if count == 0 or store.check([_left_key(p, rank)]):
                self._seen.pop(rank, None)  # not started beating, or left on purpose
                return
            if rank not in self._timeout_s:
                self._timeout_s[rank] = float(store.get(_timeout_key(p, rank)))
        except (RuntimeError, dist.DistError, ValueError):
            return
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return
        silence = now - seen[1]
        if silence > self._timeout_s[rank]:
            self.hung[rank] = silence
            pid = self.ranks.pid(rank)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            self.announce(
                rank,
                f"rank {rank} (pid {pid}) stopped making progress (no heartbeat); killing "
                f"it (silent for {silence:.0f} s, its timeout_s = {self._timeout_s[rank]:g})",
            )

    def describe(self, rank: int, code: int) -> str:
        """How ``rank`` ended, in words (killed here for silence, or its exit status)."""
        if rank in self.hung:
            return "stopped making progress (no heartbeat) and was killed"
        return describe_exit(code)
