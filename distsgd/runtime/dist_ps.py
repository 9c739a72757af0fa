"""Parameter server over c10d point-to-point (gloo): transport and server/learner loops.

The server ranks run :func:`run_server` with an :class:`~distsgd.protocols.base.
AsynchronousProtocol` (Rudra's :class:`~distsgd.protocols.ParameterServer` in hardsync,
n-softsync or async mode, or Omnivore's :class:`~distsgd.protocols.ComputeGroups`); the
learner ranks run :func:`run_learner`. The protocol object is the very one the simulated
cluster drives (``distsgd.runtime.sim``): the server calls ``push``/``can_pull``/``pull``
in the order messages really arrive, so the staleness and vector clock of every update
(:class:`~distsgd.protocols.base.Update`) are those of the real run; the transport never
recomputes them. ``torch.distributed`` must already be initialised with the gloo backend,
and *every* rank of the default process group must call :func:`run_server` or
:func:`run_learner` (they first create the point-to-point process groups, collectively).

Roles (Rudra: Gupta, Zhang, Wang, ICDM 2016, arXiv:1509.04210, parameter server and
learners; SPEC.md §2). ``PSLayout.worker_groups[w]`` are the learner ranks of protocol
worker ``w``. With one rank each it is a learner of the parameter server; with several it
is an Omnivore compute group (Hadjis et al., arXiv:1606.04487; SPEC.md §3): every member
computes a gradient on the same pulled weights, the gradients are mean-all-reduced in the
group's process subgroup (synchronous inside the group), and only the leader (``[0]``)
talks to the server(s); it broadcasts the pulled weights to the members.

Flow (as ``sim._advance_async``). The server sends WEIGHTS (``protocol.pull``) to every
leader at start. On a PUSH it calls ``protocol.push(worker, grad, version, lr(samples))``,
then replies WEIGHTS at once if ``protocol.can_pull(worker)``, else (hardsync barrier)
when an update releases the worker; only then does the coordinator call ``on_push``, so
learners compute while ``on_push`` runs (evaluation, metrics). When ``on_push`` returns
False, every worker's next PUSH is refused with STOP (not applied), and workers held by
the barrier get LAST (their push was applied). A learner therefore computes one gradient
more than was applied. Which server versions were pulled, and when, is all the protocol
needs: staleness σ = version applied to − version pulled.

Sharding (Rudra-adv, ICDM 2016; SPEC.md §2). With S server ranks, shard ``k`` owns the
slice ``shard_bounds(P, S)[k]`` of the flat parameters and runs its own protocol object
built on that slice; ``server_ranks[0]`` is the coordinator (``on_push``, stop, central
weights). A leader pushes the slices *in shard order*, each after the previous shard's
reply, so that a push the coordinator refused reaches no other shard, and one it applied
(WEIGHTS or LAST) reaches them all: every shard applies exactly the same pushes. Each
shard applies them in its own arrival order, so under async (c = 1) every shard ends at
the same version, but the interleaving of learners, hence σ and the vector clocks, may
differ between shards: the figures given to ``on_push`` (and the run's staleness
histogram) are the coordinator's; the others are kept by each shard's protocol. The
learner computes on the concatenated slices, with the coordinator's version, and pushes
to each shard the version that shard sent it. The cost of the shard order is one more
message latency per shard and push. Only the coordinator refuses pushes; the other
shards apply every push they get. Under the hardsync barrier a stop that falls inside a
round leaves the same gradients buffered on every shard; the other shards release their
held learners with LAST once a learner has said BYE.

Message protocol. Every message is a header, an int64 tensor of :data:`HEADER_LEN`
entries, followed by one flat float32 payload when ``length > 0``; both go with tag
:data:`TAG` over the pair's own process group (gloo keeps them in order):

======  ========  ==========================================================================
index   field     meaning
======  ========  ==========================================================================
0       kind      PUSH, WEIGHTS, STOP, LAST, BYE, GATHER (module constants)
1       version   PUSH: this shard's version the gradient was computed on; WEIGHTS: the
                  version of the weights sent; GATHER: coordinator's push count
2       samples   PUSH: samples behind the gradient (group size × ``num_samples``)
3       losses    PUSH: number of losses after the gradient in the payload (shard 0 only)
4       worker    protocol worker index of the leader concerned
5       length    float32 elements of the payload that follows (0: none)
======  ========  ==========================================================================

* learner → server PUSH, payload ``[n + losses]``: the gradient slice (shape ``[n]``,
  n = the shard's slice length), then the group's losses.
* server → learner WEIGHTS, payload ``[n]``: the weights slice from ``protocol.pull``.
* coordinator → learner STOP: push refused, leave. server → learner LAST: push applied,
  carry it on to the later shards, then leave. learner → server BYE: this worker leaves
  (S > 1).
* coordinator → shard GATHER: answer WEIGHTS with the slice (``eval_weights``) once as
  many pushes as the coordinator had are applied; STOP: the final slice, once every
  learner has left. Compute groups use ``broadcast`` of ``[kind, version, P]`` and of the
  weights, and one ``all_reduce`` (sum) of ``[P + members × losses]``.

Channels. Each (server, leader) and (coordinator, shard) pair has its own two-rank gloo
process group. Measured with torch 2.13: a pending gloo receive can be neither polled
(``is_completed`` turns true only inside ``wait``) nor aborted, and a receive that times
out makes gloo close *every* pair of its process group ("Application timeout caused pair
closure"). One group per pair confines a timeout to the silent learner's channel. The
server waits for each leader in a thread (one blocking receive at a time, armed after
each reply) that hands messages to the server loop through a queue.

Faults (issue 4; Rudra ICDM 2016: under async and n-softsync the server never waits for a
particular learner, under hardsync it waits for all λ; Omnivore: a group is synchronous
inside, so it stands or falls as one):

* A leader whose process dies is seen at once: its TCP connection closes and the pending
  receive fails (measured: 0.03 s after SIGKILL). A leader silent for ``timeout_s`` after
  the server's last reply to it is lost too (its channel closes, so if it wakes up its
  next push fails and it raises :class:`ServerLost`). Without a barrier the server logs
  the rank through ``log`` and goes on; the protocol needs no change: n-softsync keeps
  its threshold c = ⌊λ/n⌋, which the remaining learners fill (a fast learner may
  contribute twice to one update, as in Rudra's 1-softsync), and a lost learner's
  buffered gradient stays in the buffer. Under the hardsync barrier (``protocol.barrier``)
  no update can complete: :class:`LearnerLost` naming the rank. Every worker lost:
  :class:`LearnerLost` as well.
* A group member dies: the group's collective fails in the leader and the members, which
  raise :class:`LearnerLost` naming the group's ranks; the server then loses the leader.
* The server (any shard) dies, or is silent for ``timeout_s`` while a leader waits for
  its reply: the leader raises :class:`ServerLost` naming that server rank (measured:
  0.02 s after SIGKILL), after telling its members, which raise it too. A lost shard
  makes the coordinator raise :class:`ServerLost` naming it.

``timeout_s`` must exceed the longest legitimate silence: the start of the server (the
learners' first wait), one compute plus its group all-reduce, ``on_push`` of the
coordinator, and under the barrier the slowest learner's round. Given ``silence_s``
(the dist runtime passes its heartbeats), a leader waits for a server's reply as long as
that server's heartbeat goes on instead, so a long ``on_push`` (an evaluation) is no
silence; a compute group's other members still wait ``timeout_s`` in the group's
broadcast.

Changes against the design note (``ps_api``): :func:`run_server` takes ``lr`` (the base
learning rate α0 from the schedule as a function of the samples applied before the push,
as the server calls ``protocol.push(..., lr)``); instead of a module-level
``gather_weights``, :class:`PushEvent` carries ``central_weights()`` (all shards' slices,
usable from inside ``on_push``) and :class:`ServerResult` the final ``weights`` on the
coordinator; :class:`PushEvent` also carries the leader's ``rank``; every rank calls
``run_server``/``run_learner`` (collective channel setup); STOP is given to the *next*
push after ``on_push`` returns False, not to the push being handled.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..protocols.base import AsynchronousProtocol, Update

__all__ = [
    "PSLayout",
    "PushEvent",
    "ServerResult",
    "LearnerResult",
    "LearnerLost",
    "ServerLost",
    "shard_bounds",
    "run_server",
    "run_learner",
]

TAG = 7301
HEADER_LEN = 6
PUSH, WEIGHTS, STOP, BYE, LAST, GATHER, SERVER_GONE = 1, 2, 3, 4, 5, 6, 7
_KIND, _VERSION, _SAMPLES, _LOSSES, _WORKER, _LENGTH = range(HEADER_LEN)
_COORDINATOR = -1  # inbox key of the coordinator's messages on the other shards
_FOREVER_S = 7 * 24 * 3600.0  # between server shards: their loss shows as a closed pair


class LearnerLost(RuntimeError):
    """A learner (or a compute group) was lost where the run cannot go on without it.

    Attributes:
        ranks: the global ranks concerned.
    """

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class ServerLost(RuntimeError):
    """A parameter-server rank died or stayed silent past the timeout.

    Attributes:
        rank: the server's global rank.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class PSLayout:
    """Which ranks serve and which learn.

    Attributes:
        server_ranks: >= 1 global ranks; server k owns slice ``shard_bounds(P, S)[k]`` of the
            flat parameters; ``server_ranks[0]`` is the coordinator (calls ``on_push``).
        worker_groups: one list per protocol worker (learner of the parameter server, or
            compute group): its learner ranks, ``[0]`` being the leader.

    Raises:
        ValueError: an empty role, or a rank listed twice.
    """

    server_ranks: list[int]
    worker_groups: list[list[int]]

    def __post_init__(self) -> None:
        if not self.server_ranks:
            raise ValueError("server_ranks = [] is not allowed: expected at least one rank")
        if not self.worker_groups or any(not g for g in self.worker_groups):
            raise ValueError(
                f"worker_groups = {self.worker_groups!r} is not allowed: expected at least "
                "one non-empty group"
            )
        ranks = list(self.server_ranks) + [r for g in self.worker_groups for r in g]
        if len(set(ranks)) != len(ranks) or any(not isinstance(r, int) or r < 0 for r in ranks):
            raise ValueError(
                f"layout server_ranks = {self.server_ranks!r}, worker_groups = "
                f"{self.worker_groups!r} is not allowed: expected distinct ranks >= 0"
            )

    @property
    def num_workers(self) -> int:
        """Protocol workers (learners or compute groups)."""
        return len(self.worker_groups)

    @property
    def leaders(self) -> list[int]:
        """The leader rank of each worker."""
        return [g[0] for g in self.worker_groups]

    def worker_of(self, rank: int) -> int:
        """The worker index whose group holds ``rank``.

        Raises:
            ValueError: ``rank`` is no learner rank.
        """
        for w, g in enumerate(self.worker_groups):
            if rank in g:
                return w
        raise ValueError(f"rank = {rank} is not allowed: expected a learner rank of the layout")


def shard_bounds(num_parameters: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous slices ``[lo, hi)`` of P parameters over S server shards (Rudra-adv).

    The first ``P mod S`` shards hold one parameter more than the others.

    Raises:
        ValueError: ``num_servers < 1`` or ``num_servers > num_parameters``.
    """
    if not 1 <= num_servers <= num_parameters:
        raise ValueError(
            f"num_servers = {num_servers} is not allowed: expected 1 <= S <= P = {num_parameters}"
        )
    base, extra = divmod(num_parameters, num_servers)
    bounds, lo = [], 0
    for k in range(num_servers):
        hi = lo + base + (1 if k < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


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
    """

    worker: int
    rank: int
    pulled_version: int
    update: Update | None
    samples: int
    losses: list[float]
    central_weights: Callable[[], Tensor]


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


@dataclass
class LearnerResult:
    """What :func:`run_learner` returns.

    Attributes:
        num_computes: calls of ``compute`` on this rank.
        version: coordinator version of the last weights received.
    """

    num_computes: int = 0
    version: int = 0


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _header(
    kind: int, version: int = 0, samples: int = 0, losses: int = 0, worker: int = 0, length: int = 0
) -> Tensor:
    return torch.tensor([kind, version, samples, losses, worker, length], dtype=torch.int64)


def _send(tensor: Tensor, dst: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    dist.isend(tensor, dst=dst, group=group, tag=TAG).wait(_td(timeout_s))


def _recv(tensor: Tensor, src: int, group: dist.ProcessGroup, timeout_s: float) -> Tensor:
    dist.irecv(tensor, src=src, group=group, tag=TAG).wait(_td(timeout_s))
    return tensor


def _pair_groups(layout: PSLayout, rank: int) -> dict[int, dist.ProcessGroup]:
    """This rank's own gloo process group with each peer it talks to: every (server,
    leader) pair and every (coordinator, shard) pair.

    A timed-out gloo receive closes every pair of its process group (gloo's
    ``signalException``: "Application timeout caused pair closure", measured with torch
    2.13), and a pending gloo receive can be neither polled nor aborted. With one process
    group per pair, the silence timeout of one learner closes that learner's channel
    only. ``new_group`` is collective over the default group (gloo's rendezvous keys
    count the groups a process created, so ``use_local_synchronization`` deadlocks here):
    every rank creates every pair group, in the same order.
    """
    servers = layout.server_ranks
    pairs = [(s, r) for s in servers for r in layout.leaders]
    pairs += [(servers[0], s) for s in servers[1:]]
    groups = {}
    for a, b in pairs:
        group = dist.new_group([a, b])  # setup waits as long as the default group allows
        if rank in (a, b):
            groups[b if rank == a else a] = group
    return groups


# ---- server -----------------------------------------------------------------------------


class _Receiver(threading.Thread):
    """Receives the next message of one leader when armed (after each server reply).

    A gloo receive cannot be polled (``Work.is_completed`` only turns true in ``wait``), so
    each leader gets a thread that blocks in one receive on the pair's own process group,
    with the silence timeout, and hands the message (or the error) to the server's queue.
    """

    def __init__(
        self,
        worker: int,
        rank: int,
        group: dist.ProcessGroup,
        timeout_s: float,
        out: queue.Queue,
        wake: queue.Queue | None = None,
    ):
        super().__init__(name=f"ps-recv-{rank}", daemon=True)
        self.worker, self.rank, self.group, self.timeout_s = worker, rank, group, timeout_s
        self.out, self.wake = out, wake
        self.armed = threading.Event()
        self.closing = False

    def arm(self) -> None:
        self.armed.set()

    def close(self) -> None:
        self.closing = True
        self.armed.set()

    def run(self) -> None:
        while True:
            self.armed.wait()
            self.armed.clear()
            if self.closing:
                return
            try:
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                _recv(header, self.rank, self.group, self.timeout_s)
                payload = None
                if int(header[_LENGTH]) > 0:
                    payload = torch.empty(int(header[_LENGTH]), dtype=torch.float32)
                    _recv(payload, self.rank, self.group, self.timeout_s)
            except RuntimeError as e:
                self.out.put((self.worker, None, None, e))
                if self.wake is not None:
                    self.wake.put(None)
                return
            self.out.put((self.worker, header, payload, None))


def _brief(error: Exception | str) -> str:
    """First line of a c10d error without gloo's source location and advice."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]


def run_server(
    protocol: AsynchronousProtocol,
    layout: PSLayout,
    *,
    on_push: Callable[[PushEvent], bool],
    lr: Callable[[int], float],
    timeout_s: float,
    log: Callable[[str], None],
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

    Returns:
        :class:`ServerResult` (lost leader ranks, pushes applied).

    Raises:
        ValueError: this rank is not in ``layout.server_ranks`` or ``timeout_s <= 0``.
        LearnerLost: a learner was lost under a barrier, or every worker was lost.
    """
    rank = dist.get_rank()
    if rank not in layout.server_ranks:
        raise ValueError(f"rank {rank} is not a server rank of {layout.server_ranks}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r} is not allowed: expected > 0")
    coordinator = rank == layout.server_ranks[0]
    barrier = bool(getattr(protocol, "barrier", False))
    n = protocol.eval_weights().numel()
    leaders = layout.leaders
    inbox: queue.Queue = queue.Queue()
    links = _pair_groups(layout, rank)
    receivers = [_Receiver(w, r, links[r], timeout_s, inbox) for w, r in enumerate(leaders)]
    # shard channel: the coordinator hears every other shard, the others hear the coordinator
    servers = layout.server_ranks
    shard_inbox: queue.Queue = queue.Queue()
    if coordinator:
        peers = {
            k: _Receiver(k, servers[k], links[servers[k]], _FOREVER_S, shard_inbox, inbox)
            for k in range(1, len(servers))
        }
    else:
        peers = {0: _Receiver(_COORDINATOR, servers[0], links[servers[0]], _FOREVER_S, inbox)}
    for t in receivers + list(peers.values()):
        t.start()
    for t in peers.values():
        t.arm()
    result = ServerResult()
    finished = False
    final_requested = False
    gather_target: int | None = None  # other shards: a GATHER waiting for pushes
    live = set(range(layout.num_workers))  # not lost, not done
    waiting: list[int] = []  # held by the barrier, owed a reply
    stopping = False
    samples = 0

    def send_weights(w: int) -> None:
        weights, version = protocol.pull(w)
        link = links[leaders[w]]
        try:
            _send(_header(WEIGHTS, version, worker=w, length=n), leaders[w], link, timeout_s)
            _send(weights.contiguous(), leaders[w], link, timeout_s)
        except RuntimeError as e:  # it died since its push
            lose(w, e)
            return
        receivers[w].arm()

    def send_stop(w: int, kind: int = STOP) -> None:
        live.discard(w)
        try:
            header = _header(kind, protocol.version, worker=w)
            _send(header, leaders[w], links[leaders[w]], timeout_s)
        except RuntimeError as e:  # it died meanwhile; it is done either way
            if leaders[w] not in result.lost_ranks:
                log(f"parameter server rank {rank}: learner rank {leaders[w]} lost ({_brief(e)})")
                result.lost_ranks.append(leaders[w])

    def lose(w: int, error: Exception | str) -> None:
        live.discard(w)
        if w in waiting:
            waiting.remove(w)
        result.lost_ranks.append(leaders[w])
        log(f"parameter server rank {rank}: learner rank {leaders[w]} lost ({_brief(error)})")
        if gather_target is not None:  # the pushes awaited may never come
            answer_coordinator(_header(GATHER, gather_target), None)
        if barrier and not stopping:
            raise LearnerLost(
                [leaders[w]],
                f"learner rank {leaders[w]} lost under the hardsync barrier: no update can "
                f"complete without it ({error})",
            )

    def check_shards() -> None:
        while not shard_inbox.empty():
            k, _, _, error = shard_inbox.get_nowait()
            raise ServerLost(servers[k], f"parameter server shard rank {servers[k]} lost ({error})")

    def central(final: bool = False) -> Tensor:
        """Coordinator: the full weights [P], every shard's slice (shards answer GATHER
        between two messages; STOP asks for the final slice once their learners are done)."""
        if len(servers) == 1:
            return protocol.eval_weights()
        for k in peers:
            try:
                header = _header(STOP if final else GATHER, result.num_pushes)
                _send(header, servers[k], links[servers[k]], timeout_s)
            except RuntimeError as e:
                msg = f"parameter server shard rank {servers[k]} lost ({e})"
                raise ServerLost(servers[k], msg) from e
        parts = {0: protocol.eval_weights()}
        while len(parts) < len(servers):
            try:
                k, header, payload, error = shard_inbox.get(timeout=2 * timeout_s + 5.0)
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
                peers[k].arm()
        return torch.cat([parts[k] for k in range(len(servers))])

    def answer_coordinator(header: Tensor, error: Exception | None, final: bool = False) -> None:
        nonlocal final_requested
        if error is not None:
            raise ServerLost(
                servers[0], f"coordinator parameter server rank {servers[0]} lost ({error})"
            )
        nonlocal gather_target
        if int(header[_KIND]) == STOP:
            final_requested = True
            return
        # GATHER: answer once this shard has applied as many pushes as the coordinator had
        # (learners push here after the coordinator's reply), or at once if one was lost
        target = int(header[_VERSION])
        if result.num_pushes < target and not final and not result.lost_ranks:
            gather_target = target
            return
        gather_target = None
        link = links[servers[0]]
        _send(_header(WEIGHTS, protocol.version, length=n), servers[0], link, timeout_s)
        _send(protocol.eval_weights(), servers[0], link, timeout_s)
        if not final:
            peers[0].arm()

    try:
        for w in range(layout.num_workers):
            send_weights(w)
        while live or not (coordinator or final_requested):
            if coordinator:
                check_shards()
            if not live and (coordinator or final_requested):
                break
            item = inbox.get()
            if item is None:  # a shard's receiver failed: check_shards raises
                continue
            w, header, payload, error = item
            if w == _COORDINATOR:
                answer_coordinator(header, error)
                continue
            if error is not None:
                timed_out = "Timed out" in str(error)
                lose(w, f"silent for {timeout_s:g} s" if timed_out else error)
                continue
            kind = int(header[_KIND])
            if kind == BYE:
                live.discard(w)
                if not coordinator and barrier and not stopping:
                    # the stopping round cannot complete on this shard: release the held
                    # learners (their pushes were applied: LAST) and any still to come
                    stopping = True
                    for v in waiting:
                        send_stop(v, LAST)
                    waiting.clear()
                continue
            assert kind == PUSH, f"unexpected message kind {kind} from rank {leaders[w]}"
            if stopping and coordinator:  # refused: it reaches no other shard
                send_stop(w)
                continue
            # (the other shards apply every push: the coordinator accepted it)
            version, n_samples = int(header[_VERSION]), int(header[_SAMPLES])
            grad = payload[:n]
            update = protocol.push(w, grad, version, lr(samples))
            samples += n_samples
            result.num_pushes += 1
            # reply first (as sim._advance_async), so that the learner carries this push
            # on to the other shards while on_push runs
            if protocol.can_pull(w):
                send_weights(w)
            elif stopping:  # other shard, barrier round that cannot complete
                send_stop(w, LAST)
            else:
                waiting.append(w)
            if update is not None and waiting:
                released = [v for v in sorted(waiting) if protocol.can_pull(v)]
                waiting[:] = [v for v in waiting if v not in released]
                for v in released:
                    send_weights(v)
            if coordinator:
                losses = payload[n:].tolist()
                event = PushEvent(w, leaders[w], version, update, n_samples, losses, central)
                if not on_push(event):
                    # pushes held by the barrier were applied: LAST tells their learners
                    # to carry them on to the other shards before leaving; every other
                    # learner gets STOP on its next push, which is not applied
                    stopping = result.stopped = True
                    for v in waiting:
                        send_stop(v, LAST)
                    waiting.clear()
            elif gather_target is not None and result.num_pushes >= gather_target:
                answer_coordinator(_header(GATHER, gather_target), None)
        if not result.stopped and len(result.lost_ranks) == layout.num_workers:
            raise LearnerLost(list(result.lost_ranks), "every learner was lost")
        if coordinator:
            result.weights = central(final=True)
        else:  # the coordinator asked for the final slice and every learner is done
            answer_coordinator(_header(GATHER), None, final=True)
        finished = True
        return result
    finally:
        for t in receivers + list(peers.values()):
            t.close()
        if finished:  # no receive is pending then; after an error, do not wait for one
            for t in receivers:
                t.join(timeout_s + 1.0)


# ---- learner ----------------------------------------------------------------------------


class _Group:
    """Collectives inside one compute group (leader = ``ranks[0]``), each bounded by the
    timeout; a failure is the loss of the group (Omnivore: synchronous inside a group)."""

    def __init__(self, ranks: list[int], group: dist.ProcessGroup | None, timeout_s: float):
        self.ranks, self.group, self.timeout_s = ranks, group, timeout_s
        self.size = len(ranks)

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(_td(self.timeout_s))
        except RuntimeError as e:
            raise LearnerLost(
                self.ranks, f"compute group {self.ranks} failed in {what} ({e})"
            ) from e

    def broadcast(self, tensor: Tensor, what: str) -> None:
        if self.size > 1:
            work = dist.broadcast(tensor, src=self.ranks[0], group=self.group, async_op=True)
            self._wait(work, what)

    def mean_gradient(self, grad: Tensor, losses: list[float]) -> tuple[Tensor, list[float]]:
        """Mean of the members' gradients ``[P]`` and all members' losses, in group order."""
        if self.size == 1:
            return grad, list(losses)
        m, p = len(losses), grad.numel()
        buf = torch.zeros(p + self.size * m, dtype=torch.float32)
        buf[:p] = grad
        i = self.ranks.index(dist.get_rank())
        buf[p + i * m : p + (i + 1) * m] = torch.tensor(losses, dtype=torch.float32)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait(work, "all-reduce")
        return buf[:p].div_(self.size), buf[p:].tolist()


class _Leader:
    """The leader's side of the server conversation, over every shard in order."""

    def __init__(
        self,
        layout: PSLayout,
        links: dict[int, dist.ProcessGroup],
        worker: int,
        timeout_s: float,
        silence_s: Callable[[int], float] | None = None,
    ):
        self.servers, self.worker, self.timeout_s = layout.server_ranks, worker, timeout_s
        self.links = [links[s] for s in self.servers]
        self.versions = [0] * len(self.servers)
        self.parts: list[Tensor] = [torch.empty(0)] * len(self.servers)
        self.silence_s = silence_s
        # with silence_s: one receiver thread per shard, without a timeout of its own; the
        # reply is awaited as long as the server's heartbeat goes on (_reply)
        self.replies: list[tuple[_Receiver, queue.Queue]] = []
        if silence_s is not None:
            for k, server in enumerate(self.servers):
                inbox: queue.Queue = queue.Queue()
                receiver = _Receiver(k, server, self.links[k], _FOREVER_S, inbox)
                receiver.start()
                self.replies.append((receiver, inbox))

    def _reply(self, k: int) -> tuple[Tensor, Tensor]:
        """Shard k's next reply (header, payload), awaited as long as that server rank's
        heartbeat goes on (its coordinator may evaluate for longer than ``timeout_s``)."""
        assert self.silence_s is not None
        receiver, inbox = self.replies[k]
        receiver.arm()
        server = self.servers[k]
        while True:
            try:
                _, header, payload, error = inbox.get(timeout=min(1.0, self.timeout_s / 10))
            except queue.Empty:
                silent = self.silence_s(server)
                if silent > self.timeout_s:
                    lost = ServerLost(
                        server,
                        f"parameter server rank {server} stopped making progress (no "
                        f"heartbeat for {silent:.0f} s)",
                    )
                    lost.silent_ranks = [server]  # for the launcher (a hung rank)
                    raise lost from None
                continue
            if error is not None:
                raise self._lost(k, error)
            return header, torch.empty(0) if payload is None else payload

    def _lost(self, k: int, e: Exception) -> ServerLost:
        r = self.servers[k]
        return ServerLost(r, f"parameter server rank {r} lost ({e})")

    def send(self, k: int, *tensors: Tensor) -> None:
        try:
            for t in tensors:
                _send(t, self.servers[k], self.links[k], self.timeout_s)
        except RuntimeError as e:
            raise self._lost(k, e) from e

    def receive(self, k: int) -> int:
        """Receive shard k's reply; returns its kind (WEIGHTS: stored in ``parts[k]``)."""
        if self.replies:
            header, payload = self._reply(k)
            kind = int(header[_KIND])
            if kind == WEIGHTS:
                self.versions[k], self.parts[k] = int(header[_VERSION]), payload
            return kind
        try:
            server, link = self.servers[k], self.links[k]
            header = _recv(torch.empty(HEADER_LEN, dtype=torch.int64), server, link, self.timeout_s)
            kind = int(header[_KIND])
            if kind == WEIGHTS:
                self.versions[k] = int(header[_VERSION])
                self.parts[k] = _recv(
                    torch.empty(int(header[_LENGTH]), dtype=torch.float32),
                    server,
                    link,
                    self.timeout_s,
                )
        except RuntimeError as e:
            raise self._lost(k, e) from e
        return kind

    def bye(self, done: set[int]) -> None:
        """Tell every shard not in ``done`` (those that sent STOP or LAST) that we leave."""
        for k in range(len(self.servers)):
            if k not in done:
                self.send(k, _header(BYE, worker=self.worker))

    def first_pull(self) -> int:
        for k in range(len(self.servers)):
            if self.receive(k) != WEIGHTS:
                self.bye({k})
                return STOP
        return WEIGHTS

    def push_pull(self, grad: Tensor, samples: int, losses: list[float]) -> int:
        """Push the gradient slice by slice (coordinator first) and pull each reply.

        A STOP from shard k means the push was refused there (and so must reach no later
        shard); LAST means it was applied and is the last one: it still goes to the later
        shards. Returns WEIGHTS, or STOP once every shard knows we leave.
        """
        lo, done = 0, set()
        for k in range(len(self.servers)):
            n = self.parts[k].numel()
            extra = losses if k == 0 else []
            payload = torch.cat([grad[lo : lo + n], torch.tensor(extra, dtype=torch.float32)])
            header = _header(
                PUSH, self.versions[k], samples, len(extra), self.worker, n + len(extra)
            )
            self.send(k, header, payload)
            lo += n
            kind = self.receive(k)
            if kind in (STOP, LAST):
                done.add(k)
            if kind == STOP:
                break
        if done:
            self.bye(done)
            return STOP
        return WEIGHTS


def run_learner(
    layout: PSLayout,
    rank: int,
    *,
    compute: Callable[[Tensor, int], tuple[Tensor, list[float]]],
    group: dist.ProcessGroup | None,
    num_samples: int,
    timeout_s: float,
    silence_s: Callable[[int], float] | None = None,
) -> LearnerResult:
    """Pull → compute → push until the server says stop (Rudra §3; Omnivore groups).

    Args:
        layout: server and learner ranks; ``rank`` must be a learner rank in it.
        rank: this process's global rank.
        compute: ``(weights [P], version) -> (gradient [P] float32, losses)``; called once
            per round on every member of the group with the same weights (a fresh tensor
            each round); the losses list must have the same length on every call and
            member. ``version`` is the coordinator shard's version.
        group: the compute group's process subgroup (all of ``worker_groups[w]``), or None
            for a group of one.
        num_samples: samples behind one ``compute`` call (the batch size).
        timeout_s: seconds to wait for a reply or a group collective, > 0.
        silence_s: ``silence_s(r)``: seconds since server rank r last showed a heartbeat
            (:class:`distsgd.runtime.dist.Heartbeats`); with it the leader waits for a
            reply as long as that stays <= ``timeout_s`` (the coordinator may evaluate
            for longer), instead of ``timeout_s`` after its push. Group members still
            wait ``timeout_s`` in the group's broadcast.

    Returns:
        :class:`LearnerResult`.

    Raises:
        ValueError: ``rank`` is not a learner rank of ``layout``; a group of several ranks
            without ``group``; ``timeout_s <= 0``.
        ServerLost: a server rank died or was silent for ``timeout_s`` (leader and members).
        LearnerLost: a collective inside the compute group failed (a member died).
    """
    w = layout.worker_of(rank)
    ranks = layout.worker_groups[w]
    if len(ranks) > 1 and group is None:
        raise ValueError(f"worker {w} has ranks {ranks}: expected its process group, got None")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r} is not allowed: expected > 0")
    links = _pair_groups(layout, rank)  # collective: every rank, first
    grp = _Group(ranks, group, timeout_s)
    is_leader = rank == ranks[0]
    leader = _Leader(layout, links, w, timeout_s, silence_s) if is_leader else None
    result = LearnerResult()
    info = torch.zeros(3, dtype=torch.int64)  # [kind, version or server rank, P] in the group

    def tell_group(kind: int, value: int, p: int) -> None:
        info[0], info[1], info[2] = kind, value, p
        grp.broadcast(info, "broadcast")

    def leader_step(action: Callable[[], int]) -> int:
        assert leader is not None
        try:
            return action()
        except ServerLost as e:
            if grp.size > 1:
                try:
                    tell_group(SERVER_GONE, e.rank, 0)
                except LearnerLost:
                    pass
            raise

    assert leader is None or is_leader
    kind = leader_step(leader.first_pull) if leader is not None else WEIGHTS
    while True:
        if leader is not None:
            if kind != WEIGHTS:
                weights = torch.empty(0)
            else:  # a fresh tensor each round (the receive buffers are new each time)
                parts = leader.parts
                weights = parts[0] if len(parts) == 1 else torch.cat(parts)
            tell_group(kind, leader.versions[0], weights.numel())
            version = leader.versions[0]
        else:
            grp.broadcast(info, "broadcast")
            kind, version = int(info[0]), int(info[1])
            if kind == SERVER_GONE:
                raise ServerLost(version, f"parameter server rank {version} lost (from leader)")
            weights = torch.empty(int(info[2]), dtype=torch.float32)
        if kind != WEIGHTS:
            return result
        grp.broadcast(weights, "weights broadcast")
        result.version = version
        grad, losses = compute(weights, version)
        result.num_computes += 1
        grad, losses = grp.mean_gradient(grad.detach().reshape(-1).float(), losses)
        if leader is not None:
            samples = grp.size * num_samples
            kind = leader_step(lambda: leader.push_pull(grad, samples, losses))  # noqa: B023
