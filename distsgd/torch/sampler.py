"""The drop-in's data sharding: a ``torch.utils.data.Sampler`` over one learner's shard."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch

from distsgd.data import ShardedSampler

__all__ = ["Sampler"]


class Sampler(torch.utils.data.Sampler[int]):
    """The sample indices of one learner for one epoch: the trainer's sharding.

    Epoch e permutes the N indices with the seeded generator of
    :class:`distsgd.data.ShardedSampler`; step s of learner l takes
    ``perm[s·λ·b + l·b : s·λ·b + (l+1)·b]`` for s < ⌊N/(λ·b)⌋. So within an epoch no sample
    is seen twice, every learner's shard has the same length ``⌊N/(λ·b)⌋·b`` (ranks never
    wait on an uneven shard: the last ``N mod λ·b`` of the permutation are skipped that
    epoch), and a ``DataLoader(batch_size=b, sampler=...)`` yields exactly the minibatches
    learner l draws in ``distsgd train`` with the same ``train.seed``.

    Args:
        data: the data set (anything with ``len``) or its number of samples N.
        ctx: the :class:`~distsgd.torch.Context` of this rank, or None with
            ``num_learners`` and ``learner`` given. On a server rank (it draws no data)
            the sampler yields nothing (``len`` 0), so a script may build its loaders
            before it asks whether the rank serves.
        batch_size: b, the DataLoader's batch size (the shard is cut in steps of λ·b).
        seed: base seed of the permutations (default: the context's ``seed``, else 0).
        num_learners: λ, without a context.
        learner: l, this learner's index in ``[0, λ)``, without a context.

    Raises:
        ValueError: a count that is not a positive integer, λ·b > N, or ``learner``
            outside ``[0, λ)``.
    """

    def __init__(
        self,
        data: Sized | int,
        ctx: Any = None,
        *,
        batch_size: int = 1,
        seed: int | None = None,
        num_learners: int | None = None,
        learner: int | None = None,
    ) -> None:
        n = data if isinstance(data, int) else len(data)
        self.serves = ctx is not None and ctx.learner is None  # a server rank: no data
        if ctx is not None:
            num_learners = ctx.num_learners
            learner = 0 if self.serves else ctx.learner
            seed = ctx.seed if seed is None else seed
        if num_learners is None or learner is None:
            raise ValueError("Sampler needs ctx, or num_learners and learner")
        self._shards = ShardedSampler(n, num_learners, batch_size, 0 if seed is None else seed)
        if not isinstance(learner, int) or not 0 <= learner < num_learners:
            raise ValueError(
                f"learner = {learner!r} is not allowed: expected an integer in [0, {num_learners})"
            )
        self.learner = learner
        self.epoch = 0

    @property
    def num_learners(self) -> int:
        """λ, the learners the data set is shared among."""
        return self._shards.num_learners

    def set_epoch(self, epoch: int) -> None:
        """Draw the permutation of ``epoch`` (>= 0) next (as ``DistributedSampler``)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch = {epoch!r} is not allowed: expected an integer >= 0")
        self.epoch = epoch

    def __len__(self) -> int:
        """Samples of this learner per epoch: ``⌊N/(λ·b)⌋·b``, equal on every learner
        (0 on a server rank)."""
        if self.serves:
            return 0
        return self._shards.steps_per_epoch * self._shards.batch_size

    def indices(self) -> torch.Tensor:
        """This learner's indices for the current epoch, int64 ``[len(self)]``."""
        s = self._shards
        if self.serves:
            return torch.zeros(0, dtype=torch.int64)
        used = s.permutation(self.epoch)[: s.samples_per_epoch]
        return used.view(s.steps_per_epoch, s.num_learners, s.batch_size)[:, self.learner].reshape(
            -1
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def state_dict(self) -> dict[str, int]:
        """The epoch and the sharding (N, λ, b, seed, learner) it belongs to."""
        s = self._shards
        return {
            "epoch": self.epoch,
            "num_samples": s.num_samples,
            "num_learners": s.num_learners,
            "batch_size": s.batch_size,
            "seed": s.seed,
            "learner": self.learner,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (the epoch).

        Raises:
            ValueError: the state belongs to another sharding (names the first difference).
        """
        mine = self.state_dict()
        for key in ("num_samples", "num_learners", "batch_size", "seed", "learner"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"Sampler state has {key} = {state.get(key)!r}, this sampler "
                    f"{mine[key]!r}: it belongs to another sharding"
                )
        self.set_epoch(int(state["epoch"]))
