"""Compressed exchange: the number format of what the learners send (``protocol.compression``).

``"none"`` sends float32. ``"bf16"`` and ``"fp16"`` cast what travels to bfloat16 or
float16 (2 bytes a value instead of 4), as DDP's ``bf16_compress_hook`` /
``fp16_compress_hook`` do (torch.distributed.algorithms.ddp_comm_hooks.default_hooks):

* an all-reduce (hardsync's gradients, SMA's corrections, local SGD's and DiLoCo's
  averages): each process sums its own rows in float32, divides by the rows of the run
  for a mean (before the cast, so float16 does not overflow), casts the result to the
  wire format; the processes' values are summed in that format; every process casts the
  total back to float32 (:func:`compressed_total`, :func:`all_reduce_compressed`);
* the parameter server (simulated): the gradient a learner pushes and the weights it
  pulls are rounded to the wire format.

What stays float32: every protocol's state — the weights and replicas each process
holds (the master weights), optimizer state, SMA's central model, DiLoCo's outer model,
the parameter server's weights — and evaluation. Only the values in flight are rounded.

Bytes sent are counted with the ring all-reduce's model (:func:`ring_allreduce_bytes`):
what each of m processes sends, summed over them; a parameter-server push or pull is
one message of P values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distsgd.config import COMPRESSIONS
from distsgd.protocols.base import AllReduce

__all__ = [
    "COMPRESSIONS",
    "all_reduce_compressed",
    "bytes_per_value",
    "compressed_total",
    "ring_allreduce_bytes",
    "round_to_wire",
    "wire_dtype",
]

_WIRE = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(compression: str) -> torch.dtype:
    """The dtype on the wire: float32, bfloat16 or float16.

    Raises:
        ValueError: ``compression`` is not one of :data:`COMPRESSIONS`.
    """
    if compression not in _WIRE:
        raise ValueError(
            f"compression = {compression!r} is not allowed: expected one of "
            + ", ".join(repr(c) for c in COMPRESSIONS)
        )
    return _WIRE[compression]


def bytes_per_value(compression: str) -> int:
    """Bytes one value takes on the wire: 4 (``"none"``) or 2."""
    return torch.empty(0, dtype=wire_dtype(compression)).element_size()


def ring_allreduce_bytes(participants: int, num_values: int, compression: str) -> int:
    """Bytes a ring all-reduce of ``num_values`` among m ``participants`` sends, summed over
    them: each sends 2(m − 1)/m of the vector (reduce-scatter, then all-gather), so
    ``2 (m − 1) · P · bytes_per_value``; 0 for m <= 1."""
    if participants <= 1:
        return 0
    return 2 * (participants - 1) * num_values * bytes_per_value(compression)


def round_to_wire(t: Tensor, compression: str) -> Tensor:
    """``t`` as it arrives after a trip in the wire format (``t`` itself for ``"none"``,
    else a new tensor of ``t``'s dtype)."""
    dtype = wire_dtype(compression)
    if dtype == t.dtype:
        return t
    return t.to(dtype).to(t.dtype)


def compressed_total(exchange: AllReduce, num_devices: int, compression: str) -> Tensor:
    """The run's total of ``exchange`` when one process holds every device (the simulated
    cluster), as :func:`all_reduce_compressed` over ``num_devices`` processes gives it:
    the payload's rows in ``num_devices`` consecutive groups, each summed in float32
    (and divided by the rows for a mean), rounded to the wire format, summed, and the
    sum rounded again. Equal to the real all-reduce for two devices; for more, the ring
    rounds each partial sum, which this rounds once. ``"none"``:
    :meth:`AllReduce.reduce_here`.

    Returns:
        shape ``[P]``, the payload's dtype.
    """
    if compression == "none":
        return exchange.reduce_here()
    payload = exchange.payload
    rows = payload.view(num_devices, -1, payload.shape[-1]).sum(1)
    if exchange.mean:
        rows.div_(payload.shape[0])
    return round_to_wire(round_to_wire(rows, compression).sum(0), compression)


def all_reduce_compressed(
    exchange: AllReduce, world_size: int, compression: str, group: Any = None
) -> Tensor:
    """Collective: ``exchange``'s total over the ranks of ``group`` (None: all), each
    holding as many rows, in the wire format of ``compression`` (module docstring).
    Returns a new tensor ``[P]`` of the payload's dtype and device."""
    total = exchange.payload.sum(0)
    if exchange.mean:
        total.div_(exchange.payload.shape[0] * world_size)
    wire = total.to(wire_dtype(compression))
    dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    return wire.to(total.dtype)
