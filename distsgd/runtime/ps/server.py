"""The parameter server's loop: pushes applied in arrival order, replies, the barrier, the
coordinator's stop and central weights, lost learners and shards (see
:mod:`distsgd.runtime.ps` for the flow, sharding and faults)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from distsgd.data import ElasticShards
from distsgd.protocols.base import AsynchronousProtocol, Update
from distsgd.runtime.ps.transport import (
    _COORDINATOR,
    _FOREVER_S,
    _JOINER,
    _KIND,
    _SAMPLES,
    _VERSION,
    BYE,
    GATHER,
    LAST,
    PUSH,
    REFUSED,
    STOP,
    WEIGHTS,
    LearnerLost,
    PSLayout,
    ServerLost,
    _brief,
    _header,
    _isend,
    _pair_groups,
    _Receiver,
    _send,
    _td,
    join_channel,
)

__all__ = ["JoinWatch", "PushEvent", "ServerResult", "run_server"]

_JOIN_POLL_S = 0.2  # how often the coordinator looks for learners joining


@dataclass
class PushEvent:
    """One push handled by the coordinator.

    Attributes:
        worker: protocol worker index (learner, or compute group).
        rank: global rank of its leader.
        pulled_version: version the gradient was computed on.
        update: the update this push completed (vector clock, staleness), or None.
        samples: samples behind the gradient (group size × batch).
        losses: the members' training losses, in group order.
        central_weights: returns the full central weights ``[P]`` (a copy; with S > 1 it
            gathers every shard's slice, one round trip): for evaluation and checkpoints
            from inside ``on_push``.
        busy_s: wall seconds this server rank's loop has worked on the pushes before this
            one (from taking each from its inbox to being ready for the next: apply,
            reply, ``on_push``), in total; ``busy_s / (pushes before)`` is its time per
            push as the simulated cluster's ``cluster.seconds_per_push`` means it.
    """

    worker: int
    rank: int
    pulled_version: int
    update: Update | None
    samples: int
    losses: list[float]
    central_weights: Callable[[], Tensor]
    busy_s: float = 0.0


@dataclass
class ServerResult:
    """What :func:`run_server` returns.

    Attributes:
        lost_ranks: leader ranks declared lost, in order of detection.
        num_pushes: pushes this shard applied.
        stopped: the run ended by the coordinator's stop (on the coordinator).
        weights: coordinator: the final central weights ``[P]`` (all shards); None on the
            other shards.
    """

    lost_ranks: list[int] = field(default_factory=list)
    num_pushes: int = 0
    stopped: bool = False
    weights: Tensor | None = None


def run_server(
    protocol: AsynchronousProtocol,
    layout: PSLayout,
    *,
    on_push: Callable[[PushEvent], bool],
    lr: Callable[[int], float],
    timeout_s: float,
    log: Callable[[str], None],
    push_lr: Callable[[list[float]], float] | None = None,
    on_lost: Callable[[int], None] | None = None,
    shards: ElasticShards | None = None,
    joins: JoinWatch | None = None,
    on_join: Callable[[int, int], None] | None = None,
) -> ServerResult:
    """Serve the parameter-server protocol to the learners until the run stops.

    Called on every rank of ``layout.server_ranks``; with S > 1 server ranks, each passes a
    protocol built on its slice ``shard_bounds(P, S)[k]`` (same class and settings). The
    loop mirrors the simulated cluster (``sim._advance_async``): a push goes to
    ``protocol.push(worker, grad, version, lr(samples))`` in arrival order; the worker gets
    ``protocol.pull`` at once if ``can_pull``, else (barrier) when an update releases it.

    Args:
        protocol: the server's protocol object (weights ``[n]`` = this shard's slice).
        layout: server and learner ranks.
        on_push: coordinator only: called after each applied push; return False to stop.
        lr: base learning rate α0 given the samples applied before this push (schedule).
        timeout_s: seconds a learner may stay silent after the server's reply before it is
            declared lost (also the send timeout), > 0.
        log: receives one line per lost learner.
        push_lr: hook for learners that bring their own learning rate (the drop-in
            :mod:`distsgd.torch`): the base rate α0 of a push given the floats the learner
            sent after its gradient (its "losses"), used instead of ``lr``; S = 1 only
            (the other shards get no such floats).
        on_lost: called with the protocol worker index of each leader declared lost
            (after ``log``; the run's ``membership.jsonl``).
        shards: elastic membership (one server rank, learners of one rank, no barrier):
            the learners' data positions (:class:`~distsgd.data.ElasticShards`, one
            stream per worker of ``layout``). A lost learner is then retired
            (``protocol.retire``: λ and c refit) and learners joining through ``joins``
            are admitted; at each change the active learners are re-sharded, each one
            told its new position in its next WEIGHTS header.
        joins: learners joining the running run (:class:`JoinWatch`; with ``shards``).
        on_join: called with the worker index and channel rank of each joiner admitted
            (after the protocol admitted it and the learners were re-sharded).

    Returns:
        :class:`ServerResult` (lost leader ranks, pushes applied).

    Raises:
        ValueError: this rank is not in ``layout.server_ranks`` or ``timeout_s <= 0``.
        LearnerLost: a learner was lost under a barrier, or every worker was lost.
    """
    loop = _ServerLoop(protocol, layout, on_push, lr, timeout_s, log, push_lr, on_lost)
    loop.shards, loop.joins, loop.on_join = shards, joins, on_join or (lambda w, r: None)
    return loop.run()


class JoinWatch(threading.Thread):
    """Learners joining a running run (docs/elastic.md), on the coordinating server.

    A joiner takes an id ``j`` with ``store.add(prefix + "count", 1)`` and makes its side
    of the channel under ``prefix + "<j>/"`` (:func:`~distsgd.runtime.ps.transport.
    join_channel`, rank 1). This thread looks for new ids every 0.2 s while the server
    loop runs, makes the server's side of each one's channel (rank 0; up to ``timeout_s``
    for the joiner to connect, else it is logged and forgotten) and hands it to the server
    loop, which admits it. ``prefix + "open"`` is set while the watch runs: a joiner that
    does not find it is told the run takes no joiners (finished, or another run secret).

    Args:
        connect: a new client of the run's store (c10d TCPStore) at each call; the watch
            takes two (a store client blocks every call of its own while it waits for a
            key, as a channel being made does).
        prefix: the join keys' namespace in it (the run's, which names the run secret).
        timeout_s: seconds a joiner has to connect its channel, > 0.
        log: receives one line per joiner that did not connect.
    """

    def __init__(
        self,
        connect: Callable[[], dist.Store],
        prefix: str,
        timeout_s: float,
        log: Callable[[str], None],
    ) -> None:
        super().__init__(name="ps-join-watch", daemon=True)
        self.connect, self.prefix, self.timeout_s, self.log = connect, prefix, timeout_s, log
        self.store: dist.Store | None = None  # the watch thread's client
        self.control: dist.Store | None = None  # open and close
        self.inbox: queue.Queue | None = None
        self.stopped = threading.Event()
        self.seen = 0

    def open(self, inbox: queue.Queue) -> None:
        """Take joiners from now on into ``inbox`` (the server loop's)."""
        self.inbox = inbox
        self.store, self.control = self.connect(), self.connect()
        self.seen = self.control.add(self.prefix + "count", 0)  # ids taken before: too early
        self.control.set(self.prefix + "open", "1")
        self.start()

    def close(self) -> None:
        """Take no more joiners."""
        self.stopped.set()
        if self.control is None:
            return
        try:
            self.control.delete_key(self.prefix + "open")
        except (RuntimeError, dist.DistError):  # the store is gone with the run
            pass

    def run(self) -> None:
        assert self.inbox is not None and self.store is not None
        while not self.stopped.wait(_JOIN_POLL_S):
            try:
                count = self.store.add(self.prefix + "count", 0)
            except (RuntimeError, dist.DistError):
                return
            while self.seen < count and not self.stopped.is_set():
                self.seen += 1
                try:
                    link = join_channel(self.store, f"{self.prefix}{self.seen}/", 0, self.timeout_s)
                except (RuntimeError, dist.DistError) as e:
                    self.log(f"a learner joining (id {self.seen}) did not connect ({_brief(e)})")
                    continue
                self.inbox.put((_JOINER, None, link, None))


class _ServerLoop:
    """One server rank's loop, its state explicit (see :func:`run_server`).

    State: ``live`` workers (not lost, not done); ``waiting`` workers held by the barrier
    and owed a reply; ``stopping`` once the coordinator's ``on_push`` asked to stop (or, on
    another shard, once a barrier round cannot complete); ``gather_target``, on another
    shard, the coordinator's push count a GATHER waits for; ``final_requested`` once the
    coordinator asked for the final slice; ``samples`` applied so far.
    """

    def __init__(
        self,
        protocol: AsynchronousProtocol,
        layout: PSLayout,
        on_push: Callable[[PushEvent], bool],
        lr: Callable[[int], float],
        timeout_s: float,
        log: Callable[[str], None],
        push_lr: Callable[[list[float]], float] | None = None,
        on_lost: Callable[[int], None] | None = None,
    ) -> None:
        rank = dist.get_rank()
        if rank not in layout.server_ranks:
            raise ValueError(f"rank {rank} is not a server rank of {layout.server_ranks}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s = {timeout_s!r} is not allowed: expected > 0")
        self.protocol, self.layout = protocol, layout
        self.on_push, self.lr, self.timeout_s, self.log = on_push, lr, timeout_s, log
        self.push_lr = push_lr
        self.on_lost = on_lost or (lambda w: None)
        self.rank = rank
        self.coordinator = rank == layout.server_ranks[0]
        self.barrier = protocol.barrier
        self.n = protocol.eval_weights().numel()
        self.leaders = layout.leaders
        self.servers = layout.server_ranks
        self.inbox: queue.Queue = queue.Queue()
        self.shard_inbox: queue.Queue = queue.Queue()
        self.links = _pair_groups(layout, rank)
        self.receivers = [
            _Receiver(w, r, self.links[r], timeout_s, self.inbox)
            for w, r in enumerate(self.leaders)
        ]
        # shard channel: the coordinator hears every other shard, the others hear it
        servers, links = self.servers, self.links
        if self.coordinator:
            self.peers = {
                k: _Receiver(
                    k, servers[k], links[servers[k]], _FOREVER_S, self.shard_inbox, self.inbox
                )
                for k in range(1, len(servers))
            }
        else:
            self.peers = {
                0: _Receiver(_COORDINATOR, servers[0], links[servers[0]], _FOREVER_S, self.inbox)
            }
        self.result = ServerResult()
        self.final_requested = False
        self.gather_target: int | None = None
        self.live = set(range(layout.num_workers))
        self.waiting: list[int] = []
        self.stopping = False
        self.samples = 0
        self.busy_s = 0.0  # wall seconds spent on pushes (PushEvent.busy_s)
        # per worker: the reply whose send is under way (its header's and weights' works)
        self.sending: dict[int, list[dist.Work]] = {}
        # elastic membership (run_server's shards, joins, on_join)
        self.shards: ElasticShards | None = None
        self.joins: JoinWatch | None = None
        self.on_join: Callable[[int, int], None] = lambda w, r: None
        self.positions: dict[int, tuple[int, int, int, int]] = {}  # not yet sent

    # ---- replies -----------------------------------------------------------------------
    def send_weights(self, w: int) -> None:
        """Start the reply to ``w`` (header, then the weights) without waiting for it to
        cross: the server goes on with the next push while the reply travels (a reply to
        another host holds only that learner). The reply is awaited before the next message
        to ``w`` (done by then: ``w`` pushes only once it has its weights) or at the end."""
        weights, version = self.protocol.pull(w)  # a copy: stays as sent
        leader, link = self.leaders[w], self.links[self.leaders[w]]
        if not self.finish_send(w):
            return
        position = self.positions.pop(w, (0, 0, 0, 0))
        header = _header(WEIGHTS, version, worker=w, length=self.n, position=position)
        if self.shards is not None:
            self.shards.draw(w)  # the learner draws its next minibatch once it has these
        try:
            self.sending[w] = [_isend(t, leader, link) for t in (header, weights)]
        except RuntimeError as e:  # it died since its push
            self.lose(w, e)
            return
        self.receivers[w].arm()

    def finish_send(self, w: int) -> bool:
        """Wait for the reply to ``w`` under way, if any (up to ``timeout_s``); False when
        it failed (``w`` is lost)."""
        try:
            for work in self.sending.pop(w, []):
                work.wait(_td(self.timeout_s))
        except RuntimeError as e:  # it died since its push
            self.lose(w, e)
            return False
        return True

    def send_stop(self, w: int, kind: int = STOP) -> None:
        if not self.finish_send(w):
            return
        self.live.discard(w)
        leader = self.leaders[w]
        try:
            header = _header(kind, self.protocol.version, worker=w)
            _send(header, leader, self.links[leader], self.timeout_s)
        except RuntimeError as e:  # it died meanwhile; it is done either way
            if leader not in self.result.lost_ranks:
                self.log(
                    f"parameter server rank {self.rank}: learner rank {leader} lost ({_brief(e)})"
                )
                self.result.lost_ranks.append(leader)
                self.on_lost(w)

    def lose(self, w: int, error: Exception | str) -> None:
        self.sending.pop(w, None)  # a reply under way to it is not awaited
        self.live.discard(w)
        if w in self.waiting:
            self.waiting.remove(w)
        leader = self.leaders[w]
        self.result.lost_ranks.append(leader)
        self.log(f"parameter server rank {self.rank}: learner rank {leader} lost ({_brief(error)})")
        active = self.protocol.active_workers
        if self.shards is not None and not self.stopping and w in active and len(active) > 1:
            self.protocol.retire(w)  # λ and c refit; the others take over its shard
            self.reshard()
        self.on_lost(w)
        if self.gather_target is not None:  # the pushes awaited may never come
            self.answer_coordinator(_header(GATHER, self.gather_target), None)
        if self.barrier and not self.stopping:
            raise LearnerLost(
                [leader],
                f"learner rank {leader} lost under the hardsync barrier: no update can "
                f"complete without it ({error})",
            )
        needed = self.protocol.workers_needed
        if 0 < len(self.live) < needed and not self.stopping:
            raise LearnerLost(
                [leader],
                f"learner rank {leader} lost: {len(self.live)} learners are left and an "
                f"update needs {needed} ({error})",
            )

    def reshard(self) -> None:
        """New data positions for the active workers, sent with their next weights."""
        assert self.shards is not None
        self.positions.update(self.shards.reshard(self.protocol.active_workers))

    def admit(self, link: dist.ProcessGroup) -> None:
        """A learner joins: the protocol admits it, it gets a channel rank (after every
        rank of the run), the learners are re-sharded and it pulls the weights. A joiner
        with whom λ·b would exceed the training set is refused (REFUSED: the run goes on
        as it was); one that comes while the run stops is told STOP."""
        if self.stopping:
            try:
                _send(_header(STOP, self.protocol.version), 0, link, self.timeout_s)
            except RuntimeError:
                pass
            return
        learners = len(self.protocol.active_workers) + 1
        if self.shards is not None and not self.shards.fits(learners):
            n = self.shards.num_samples
            self.log(f"refused a learner joining: {learners} learners would exceed {n} samples")
            try:  # [REFUSED, version, N, 0, λ + 1]: the joiner names the limit
                header = _header(REFUSED, self.protocol.version, n, 0, learners)
                _send(header, 0, link, min(self.timeout_s, 5.0))  # its first pull
            except RuntimeError:
                pass
            return
        w = self.protocol.admit()
        assert w == len(self.leaders), f"joiner got worker {w}, expected {len(self.leaders)}"
        rank = max(self.servers + self.leaders) + 1
        self.leaders.append(rank)
        self.links[rank] = link
        receiver = _Receiver(w, rank, link, self.timeout_s, self.inbox)
        self.receivers.append(receiver)
        receiver.start()
        self.live.add(w)
        self.reshard()
        self.on_join(w, rank)
        self.send_weights(w)

    def release_held(self, kind: int = LAST) -> None:
        """Answer every worker held by the barrier with ``kind`` (their pushes were
        applied: LAST tells them to carry them on to the later shards, then leave)."""
        for v in self.waiting:
            self.send_stop(v, kind)
        self.waiting.clear()

    # ---- shards ------------------------------------------------------------------------
    def check_shards(self) -> None:
        while not self.shard_inbox.empty():
            k, _, _, error = self.shard_inbox.get_nowait()
            s = self.servers[k]
            raise ServerLost(s, f"parameter server shard rank {s} lost ({error})")

    def central(self, final: bool = False) -> Tensor:
        """Coordinator: the full weights [P], every shard's slice (shards answer GATHER
        between two messages; STOP asks for the final slice once their learners are done)."""
        servers = self.servers
        if len(servers) == 1:
            return self.protocol.eval_weights()
        for k in self.peers:
            try:
                header = _header(STOP if final else GATHER, self.result.num_pushes)
                _send(header, servers[k], self.links[servers[k]], self.timeout_s)
            except RuntimeError as e:
                msg = f"parameter server shard rank {servers[k]} lost ({e})"
                raise ServerLost(servers[k], msg) from e
        parts = {0: self.protocol.eval_weights()}
        while len(parts) < len(servers):
            try:
                k, header, payload, error = self.shard_inbox.get(timeout=2 * self.timeout_s + 5.0)
            except queue.Empty:
                k = min(set(range(len(servers))) - set(parts))
                msg = f"parameter server shard rank {servers[k]} did not send its slice"
                raise ServerLost(servers[k], msg) from None
            if error is not None:
                raise ServerLost(
                    servers[k], f"parameter server shard rank {servers[k]} lost ({error})"
                )
            assert int(header[_KIND]) == WEIGHTS
            parts[k] = payload
            if not final:
                self.peers[k].arm()
        return torch.cat([parts[k] for k in range(len(servers))])

    def answer_coordinator(
        self, header: Tensor, error: Exception | None, final: bool = False
    ) -> None:
        """Another shard: a message of the coordinator (GATHER: send the slice once as many
        pushes as it had are applied; STOP: the final slice is wanted)."""
        coordinator = self.servers[0]
        if error is not None:
            raise ServerLost(
                coordinator, f"coordinator parameter server rank {coordinator} lost ({error})"
            )
        if int(header[_KIND]) == STOP:
            self.final_requested = True
            return
        # GATHER: answer once this shard has applied as many pushes as the coordinator had
        # (learners push here after the coordinator's reply), or at once if one was lost
        target = int(header[_VERSION])
        if self.result.num_pushes < target and not final and not self.result.lost_ranks:
            self.gather_target = target
            return
        self.gather_target = None
        link = self.links[coordinator]
        _send(
            _header(WEIGHTS, self.protocol.version, length=self.n),
            coordinator,
            link,
            self.timeout_s,
        )
        _send(self.protocol.eval_weights(), coordinator, link, self.timeout_s)
        if not final:
            self.peers[0].arm()

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> ServerResult:
        finished = False
        threads = self.receivers + list(self.peers.values())
        for t in threads:
            t.start()
        for t in self.peers.values():
            t.arm()
        if self.joins is not None:
            self.joins.open(self.inbox)
        try:
            for w in range(self.layout.num_workers):
                self.send_weights(w)
            while self.live or not (self.coordinator or self.final_requested):
                if self.coordinator:
                    self.check_shards()
                if not self.live and (self.coordinator or self.final_requested):
                    break
                item = self.inbox.get()
                if item is None:  # a shard's receiver failed: check_shards raises
                    continue
                started = time.perf_counter()
                self.handle(*item)
                if item[1] is not None and int(item[1][_KIND]) == PUSH:
                    self.busy_s += time.perf_counter() - started
            # replies still under way (to learners that said BYE since: done by now)
            deadline = time.monotonic() + self.timeout_s
            for w in list(self.sending):
                try:
                    for work in self.sending.pop(w):
                        work.wait(_td(max(deadline - time.monotonic(), 1e-3)))
                except RuntimeError:  # it left meanwhile; its weights were not needed
                    pass
            result = self.result
            if not result.stopped and len(result.lost_ranks) == len(self.leaders):
                raise LearnerLost(list(result.lost_ranks), "every learner was lost")
            if self.coordinator:
                result.weights = self.central(final=True)
            else:  # the coordinator asked for the final slice and every learner is done
                self.answer_coordinator(_header(GATHER), None, final=True)
            finished = True
            return result
        finally:
            if self.joins is not None:
                self.joins.close()
            for t in self.receivers + list(self.peers.values()):
                t.close()
            if finished:  # no receive is pending then; after an error, do not wait for one
                for t in self.receivers:
                    t.join(self.timeout_s + 1.0)

    def handle(
        self, w: int, header: Tensor, payload: Tensor | None, error: Exception | None
    ) -> None:
        """One message from worker ``w``'s leader (or from the coordinator)."""
        if w == _COORDINATOR:
            self.answer_coordinator(header, error)
            return
        if w == _JOINER:
            self.admit(payload)
            return
        if error is not None:
            timed_out = "Timed out" in str(error)
            self.lose(w, f"silent for {self.timeout_s:g} s" if timed_out else error)
            return
        kind = int(header[_KIND])
        if kind == BYE:
            self.live.discard(w)
            if not self.coordinator and self.barrier and not self.stopping:
                # the stopping round cannot complete on this shard: release the held
                # learners (their pushes were applied: LAST) and any still to come
                self.stopping = True
                self.release_held()
            return
        assert kind == PUSH, f"unexpected message kind {kind} from rank {self.leaders[w]}"
        if self.stopping and self.coordinator:  # refused: it reaches no other shard
            self.send_stop(w)
            return
        self.apply_push(w, header, payload)

    def apply_push(self, w: int, header: Tensor, payload: Tensor) -> None:
        """Apply a push (the other shards apply every push: the coordinator accepted it),
        reply, release what the update released, and on the coordinator call on_push."""
        protocol, n = self.protocol, self.n
        version, n_samples = int(header[_VERSION]), int(header[_SAMPLES])
        losses = payload[n:].tolist()
        lr = self.lr(self.samples) if self.push_lr is None else self.push_lr(losses)
        update = protocol.push(w, payload[:n], version, lr)
        self.samples += n_samples
        self.result.num_pushes += 1
        # reply first (as sim._advance_async), so that the learner carries this push on
        # to the other shards while on_push runs
        if protocol.can_pull(w):
            self.send_weights(w)
        elif self.stopping:  # other shard, barrier round that cannot complete
            self.send_stop(w, LAST)
        else:
            self.waiting.append(w)
        if update is not None and self.waiting:
            released = [v for v in sorted(self.waiting) if protocol.can_pull(v)]
            self.waiting[:] = [v for v in self.waiting if v not in released]
            for v in released:
                self.send_weights(v)
        if self.coordinator:
            event = PushEvent(
                w, self.leaders[w], version, update, n_samples, losses, self.central, self.busy_s
            )
            if not self.on_push(event):
                # pushes held by the barrier were applied: LAST tells their learners to
                # carry them on to the other shards before leaving; every other learner
                # gets STOP on its next push, which is not applied
                self.stopping = self.result.stopped = True
                self.release_held()
        elif self.gather_target is not None and self.result.num_pushes >= self.gather_target:
            self.answer_coordinator(_header(GATHER, self.gather_target), None)
