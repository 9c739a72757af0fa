"""The learner side of the parameter server: a leader pulls, computes (with its compute
group's members), pushes to every shard in shard order (see :mod:`distsgd.runtime.ps`)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from distsgd.runtime.ps.transport import (
    _FOREVER_S,
    _KIND,
    _LENGTH,
    _POSITION,
    _SAMPLES,
    _VERSION,
    _WORKER,
    BYE,
    HEADER_LEN,
    LAST,
    PUSH,
    REFUSED,
    SERVER_GONE,
    STOP,
    WEIGHTS,
    HostStaging,
    JoinRefused,
    LearnerLost,
    PSLayout,
    ServerLost,
    _header,
    _pair_groups,
    _Receiver,
    _recv,
    _send,
    _td,
)

__all__ = ["LearnerResult", "run_learner"]


@dataclass
class LearnerResult:
    """What :func:`run_learner` returns.

    Attributes:
        num_computes: calls of ``compute`` on this rank.
        version: coordinator version of the last weights received.
    """

    num_computes: int = 0
    version: int = 0


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
        # on the gradient's device: NCCL carries it when the run's backend has NCCL
        buf = torch.zeros(p + self.size * m, dtype=torch.float32, device=grad.device)
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
        # a new data position (λ, slot, epoch, step) the last WEIGHTS carried, else None
        self.position: tuple[int, ...] | None = None
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
            self.refused = int(header[_WORKER]), int(header[_SAMPLES])
            if kind == WEIGHTS:
                self.versions[k], self.parts[k] = int(header[_VERSION]), payload
                self._take_position(header)
            return kind
        try:
            server, link = self.servers[k], self.links[k]
            header = _recv(torch.empty(HEADER_LEN, dtype=torch.int64), server, link, self.timeout_s)
            kind = int(header[_KIND])
            self.refused = int(header[_WORKER]), int(header[_SAMPLES])
            if kind == WEIGHTS:
                self.versions[k] = int(header[_VERSION])
                self._take_position(header)
                self.parts[k] = _recv(
                    torch.empty(int(header[_LENGTH]), dtype=torch.float32),
                    server,
                    link,
                    self.timeout_s,
                )
        except RuntimeError as e:
            raise self._lost(k, e) from e
        return kind

    def _take_position(self, header: Tensor) -> None:
        position = tuple(int(v) for v in header[_POSITION])
        if position[0] > 0:  # λ' = 0: keep drawing where it is
            self.position = position

    def bye(self, done: set[int]) -> None:
        """Tell every shard not in ``done`` (those that sent STOP or LAST) that we leave."""
        for k in range(len(self.servers)):
            if k not in done:
                self.send(k, _header(BYE, worker=self.worker))

    def first_pull(self) -> int:
        """Pull every shard's weights; STOP where a shard said stop.

        Raises:
            JoinRefused: the server refused this joiner (it says nothing more to it).
        """
        for k in range(len(self.servers)):
            kind = self.receive(k)
            if kind == REFUSED:
                raise JoinRefused(*self.refused)
            if kind != WEIGHTS:
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
    compute: Callable[[Tensor, int], tuple[Tensor, list[float]] | None],
    group: dist.ProcessGroup | None,
    num_samples: int,
    timeout_s: float,
    silence_s: Callable[[int], float] | None = None,
    on_position: Callable[[int, int, int, int], None] | None = None,
    links: dict[int, dist.ProcessGroup] | None = None,
) -> LearnerResult:
    """Pull → compute → push until the server says stop (Rudra §3; Omnivore groups).

    Args:
        layout: server and learner ranks; ``rank`` must be a learner rank in it.
        rank: this process's global rank.
        compute: ``(weights [P], version) -> (gradient [P] float32, losses)``; called once
            per round on every member of the group with the same weights (a fresh tensor
            each round); the losses list must have the same length on every call and
            member. ``version`` is the coordinator shard's version. Returning None
            ends this worker's part (hook for the drop-in :mod:`distsgd.torch`, whose
            learners decide when they stop): the leader tells every shard BYE; every
            member of a compute group must return None in the same round.
        group: the compute group's process subgroup (all of ``worker_groups[w]``), or None
            for a group of one.
        num_samples: samples behind one ``compute`` call (the batch size).
        timeout_s: seconds to wait for a reply or a group collective, > 0.
        silence_s: ``silence_s(r)``: seconds since server rank r last showed a heartbeat
            (:class:`distsgd.runtime.dist.Heartbeats`); with it the leader waits for a
            reply as long as that stays <= ``timeout_s`` (the coordinator may evaluate
            for longer), instead of ``timeout_s`` after its push. Group members still
            wait ``timeout_s`` in the group's broadcast.
        on_position: called with ``(λ, slot, epoch, step)`` before ``compute`` when the
            weights came with a new data position (elastic membership: the learners were
            re-sharded, :class:`~distsgd.data.ElasticShards`); learners of one rank.
        links: this leader's channel to each server rank, made already (a learner that
            joined the running run: :func:`~distsgd.runtime.ps.transport.join_channel`);
            None: the pair groups of ``layout`` are made, collectively.

    Returns:
        :class:`LearnerResult`.

    Raises:
        ValueError: ``rank`` is not a learner rank of ``layout``; a group of several ranks
            without ``group``; ``timeout_s <= 0``.
        ServerLost: a server rank died or was silent for ``timeout_s`` (leader and members).
        LearnerLost: a collective inside the compute group failed (a member died).
        JoinRefused: a joiner the server refused (λ·b would exceed the training set).
    """
    w = layout.worker_of(rank)
    ranks = layout.worker_groups[w]
    if len(ranks) > 1 and group is None:
        raise ValueError(f"worker {w} has ranks {ranks}: expected its process group, got None")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r} is not allowed: expected > 0")
    if links is None:
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
    stage = HostStaging()  # one staging buffer for all of this learner's pushes
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
        if leader is not None and leader.position is not None and on_position is not None:
            lam, slot, epoch, step = leader.position
            on_position(lam, slot, epoch, step)
            leader.position = None
        computed = compute(weights, version)
        if computed is None:  # this worker leaves (the drop-in's learner loop ended)
            if leader is not None:
                leader.bye(set())
            return result
        grad, losses = computed
        result.num_computes += 1
        grad, losses = grp.mean_gradient(grad.detach().reshape(-1).float(), losses)
        grad = stage(grad)  # the push travels over gloo from host memory
        if leader is not None:
            samples = grp.size * num_samples
            kind = leader_step(lambda: leader.push_pull(grad, samples, losses))  # noqa: B023
