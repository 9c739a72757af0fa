"""The parameter server's transport: message headers, two-rank channels, receiver threads,
the rank layout and the errors of a lost peer (see :mod:`distsgd.runtime.ps` for the
message protocol and why each pair has its own process group)."""

from __future__ import annotations

import os
import queue
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "HEADER_LEN",
    "TAG",
    "JoinRefused",
    "LearnerLost",
    "PSLayout",
    "ServerLost",
    "shard_bounds",
    "HostStaging",
    "to_host",
    "join_channel",
]

# Test hook: "1" makes to_host copy CPU tensors too, so the staging path of GPU learners
# runs on CPU-only machines (CI); read at each call, inherited by every rank.
ENV_FORCE_HOST_STAGING = "DISTSGD_FORCE_HOST_STAGING"

TAG = 7301
HEADER_LEN = 10
PUSH, WEIGHTS, STOP, BYE, LAST, GATHER, SERVER_GONE, REFUSED = 1, 2, 3, 4, 5, 6, 7, 8
_KIND, _VERSION, _SAMPLES, _LOSSES, _WORKER, _LENGTH = range(6)
_POSITION = slice(6, 10)  # WEIGHTS: the learner's new data position (λ, slot, epoch, step)
_COORDINATOR = -1  # inbox key of the coordinator's messages on the other shards
_JOINER = -2  # inbox key of a learner joining the running run (its channel)
_FOREVER_S = 7 * 24 * 3600.0  # between server shards: their loss shows as a closed pair


class LearnerLost(RuntimeError):
    """A learner (or a compute group) was lost where the run cannot go on without it.

    Attributes:
        ranks: the global ranks concerned.
    """

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class JoinRefused(Exception):
    """The server refused a joining learner: with it, λ·b would exceed the training set.

    Attributes:
        num_learners: the learners the run would have had with the joiner (λ + 1).
        num_samples: the training samples N (λ·b must stay <= N).
    """

    def __init__(self, num_learners: int, num_samples: int) -> None:
        super().__init__(
            f"the server refused the joiner: {num_learners} learners would exceed the "
            f"{num_samples} training samples"
        )
        self.num_learners, self.num_samples = num_learners, num_samples


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


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _header(
    kind: int,
    version: int = 0,
    samples: int = 0,
    losses: int = 0,
    worker: int = 0,
    length: int = 0,
    position: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> Tensor:
    values = [kind, version, samples, losses, worker, length, *position]
    return torch.tensor(values, dtype=torch.int64)


# join channels (:func:`join_channel`): two-rank gloo groups c10d has not registered, so
# their peer is named by its rank in the pair, not by a global rank
_JOIN_PEERS: dict[Any, int] = {}


def join_channel(store: dist.Store, prefix: str, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """The channel between the coordinating server (``rank`` 0) and a learner joining the
    running run (``rank`` 1): a two-rank ``ProcessGroupGloo`` on the run's store under
    ``prefix``, as :func:`_pair_groups` makes for the learners started with the run.
    Both sides block until the other connects (up to ``timeout_s``).

    Raises:
        RuntimeError / dist.DistError: the peer did not connect within ``timeout_s``.
    """
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, _td(timeout_s))
    _JOIN_PEERS[group] = 1 - rank
    return group


def _peer(group: Any, rank: int, key: str) -> dict[str, int]:
    """``{key: rank}`` (global rank), or on a join channel ``{group_<key>: its pair rank}``."""
    pair_rank = _JOIN_PEERS.get(group)
    return {key: rank} if pair_rank is None else {f"group_{key}": pair_rank}


def _isend(tensor: Tensor, dst: int, group: Any) -> dist.Work:
    return dist.isend(tensor, group=group, tag=TAG, **_peer(group, dst, "dst"))


def _send(tensor: Tensor, dst: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    _isend(tensor, dst, group).wait(_td(timeout_s))


def _recv(tensor: Tensor, src: int, group: dist.ProcessGroup, timeout_s: float) -> Tensor:
    dist.irecv(tensor, group=group, tag=TAG, **_peer(group, src, "src")).wait(_td(timeout_s))
    return tensor


class HostStaging:
    """Stages a learner's pushes in host memory for the gloo transport, reusing one buffer.

    A CUDA tensor is copied into a page-locked (pinned) CPU buffer of its shape and dtype,
    so that the device-to-host copy runs at full PCIe/NVLink-C2C speed and gloo reads plain
    host memory; the buffer is allocated at the first push and reused by every later push
    of that shape and dtype (pinning is a system call and a page-table walk: too slow to
    repeat per push). Reuse is safe because each push's send completes
    (``isend(...).wait()``) before the learner stages the next one. A CPU tensor is
    returned as it is, unless :data:`ENV_FORCE_HOST_STAGING` is ``"1"`` (then it is
    copied, exercising this path without a GPU).
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def __call__(self, tensor: Tensor) -> Tensor:
        """``tensor`` in host memory: the tensor itself (CPU), or the staging buffer
        holding a copy of it (valid until the next call)."""
        if tensor.device.type == "cpu" and os.environ.get(ENV_FORCE_HOST_STAGING) != "1":
            return tensor
        buf = self._buffer
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buf = self._buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        return buf.copy_(tensor)  # synchronous: the tensor is sent right after


def to_host(tensor: Tensor) -> Tensor:
    """``tensor`` staged in host memory in a new buffer (:class:`HostStaging` without
    reuse; a CPU tensor is returned as it is unless :data:`ENV_FORCE_HOST_STAGING` is
    ``"1"``)."""
    return HostStaging()(tensor)


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
        # gloo even when the default group also holds NCCL: messages are staged on the host
        group = dist.new_group([a, b], backend="gloo")  # waits as the default group allows
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
            except Exception as e:  # noqa: BLE001 - any receive error is handed over
                self.out.put((self.worker, None, None, e))
                if self.wake is not None:
                    self.wake.put(None)
                return
            self.out.put((self.worker, header, payload, None))


def _brief(error: Exception | str) -> str:
    """First line of a c10d error without gloo's source location and advice."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
