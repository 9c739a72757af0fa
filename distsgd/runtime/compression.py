"""Compressed exchange: the number format of what the learners send (``protocol.compression``).

``"none"`` sends float32. ``"bf16"`` and ``"fp16"`` cast what travels to bfloat16 or
float16 (2 bytes a value instead of 4), as DDP's ``bf16_compress_hook`` /
``fp16_compress_hook`` do (torch.distributed.algorithms.ddp_comm_hooks.default_hooks).
``"int8"`` (DiLoCo's pseudo-gradients only) quantises each process's mean to int8 with
one float32 absmax scale per chunk of :data:`INT8_CHUNK` values, as INTELLECT-1 sent its
pseudo-gradients (Jaghouar et al. 2024, arXiv:2412.01152): :func:`quantize_int8`.

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

int8 is exchanged by an all-gather, not a sum: every process sends its int8 values and
scales to every other (:func:`int8_allgather_bytes`), dequantises all of them to float32
and adds them in process order (:func:`int8_combine`), so each rounding is one
quantisation of one process's mean, and the sum is the same on every process and in the
simulator. With m processes that is m(m − 1)(P + 4⌈P/C⌉) bytes against the float32 ring's
8(m − 1)P: 4× fewer for two processes, fewer for m < 8.

``"powersgd"`` (hardsync on real processes) registers torch's ``powerSGD_hook``
(Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019) on DDP: each gradient matrix n × m is sent as
rank-r factors P (n × r) and Q (m × r) in float32, with error feedback (each process
keeps what its approximation left out and adds it to its next gradient) and warm start;
:func:`powersgd_values` counts what it sends.

Bytes sent are counted with the ring all-reduce's model (:func:`ring_allreduce_bytes`):
what each of m processes sends, summed over them; a parameter-server push or pull is
one message of P values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distsgd.config import COMPRESSIONS
from distsgd.protocols.base import AllReduce

__all__ = [
    "COMPRESSIONS",
    "INT8_CHUNK",
    "all_reduce_compressed",
    "bytes_per_value",
    "compressed_total",
    "dequantize_int8",
    "exchange_bytes",
    "int8_allgather_bytes",
    "int8_combine",
    "POWERSGD_START",
    "powersgd_values",
    "quantize_int8",
    "ring_allreduce_bytes",
    "round_to_wire",
    "wire_dtype",
]

_WIRE = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CAST_WIRES = tuple(_WIRE)  # what wire_dtype knows

INT8_CHUNK = 1024
"""Values that share one int8 scale (the last chunk may be shorter)."""


def wire_dtype(compression: str) -> torch.dtype:
    """The dtype on the wire: float32, bfloat16 or float16.

    Raises:
        ValueError: ``compression`` is not one of :data:`COMPRESSIONS`.
    """
    if compression not in _WIRE:
        raise ValueError(
            f"compression = {compression!r} is not allowed: expected one of "
            + ", ".join(repr(c) for c in _CAST_WIRES)
        )
    return _WIRE[compression]


def bytes_per_value(compression: str) -> int:
    """Bytes one value takes on the wire: 4 (``"none"``), 2 (a 16-bit cast) or 1
    (``"int8"``, its scales apart)."""
    if compression == "int8":
        return 1
    return torch.empty(0, dtype=wire_dtype(compression)).element_size()


def quantize_int8(t: Tensor, chunk: int = INT8_CHUNK) -> tuple[Tensor, Tensor]:
    """Per-chunk absmax int8 quantisation of ``t`` ``[P]`` (float): for each run of
    ``chunk`` values, scale s = max|t| / 127 (float32) and q = round(t / s) in
    [−127, 127] (0 where s = 0).

    Error bound: ``|t − q·s| <= s / 2`` per value (up to float32 rounding of the
    division), i.e. at most 1/254 of the chunk's largest magnitude.

    Returns:
        ``(q, scales)``: int8 ``[P]`` and float32 ``[⌈P / chunk⌉]``.
    """
    n = t.numel()
    x = torch.nn.functional.pad(t.float(), (0, -n % chunk)).view(-1, chunk)
    scales = x.abs().amax(1) / 127
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(x / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_int8(q: Tensor, scales: Tensor, chunk: int = INT8_CHUNK) -> Tensor:
    """``q · s`` per chunk: float32 ``[P]`` from :func:`quantize_int8`'s output."""
    n = q.numel()
    x = torch.nn.functional.pad(q.float(), (0, -n % chunk)).view(-1, chunk)
    return (x * scales[:, None]).view(-1)[:n]


def int8_combine(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """The float32 sum of the processes' quantised values ``[(q, scales), …]``, added in
    the list's (process) order: the same on every process and in the simulator."""
    total = dequantize_int8(*parts[0])
    for q, scales in parts[1:]:
        total = total + dequantize_int8(q, scales)
    return total


def int8_allgather_bytes(participants: int, num_values: int) -> int:
    """Bytes the int8 all-gather of ``num_values`` among m ``participants`` sends, summed
    over them: each sends its ``P`` int8 values and ``⌈P / C⌉`` float32 scales to the
    m − 1 others; 0 for m <= 1."""
    if participants <= 1:
        return 0
    per_process = num_values + 4 * -(-num_values // INT8_CHUNK)
    return participants * (participants - 1) * per_process


POWERSGD_START = 2
"""Iterations of float32 all-reduce before PowerSGD starts (``start_powerSGD_iter``: the
least torch allows with error feedback)."""


def powersgd_values(shapes: list[torch.Size], rank: int) -> int:
    """Values torch's ``powerSGD_hook`` all-reduces per iteration (after
    :data:`POWERSGD_START`) for gradients of ``shapes``: each tensor as a matrix
    n × m (its first dimension by the rest), with r = min(n, m, ``rank``), sends
    r(n + m) values (its factors P and Q) when 2·r(n + m) < nm (``min_compression_rate``
    2), else its nm values (vectors always)."""
    total = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape[1:])
        r = min(n, m, rank)
        total += r * (n + m) if 2 * r * (n + m) < n * m else n * m
    return total


def exchange_bytes(participants: int, num_values: int, compression: str) -> int:
    """Bytes an exchange of ``num_values`` among m ``participants`` sends, summed over them:
    :func:`int8_allgather_bytes` for ``"int8"``, else :func:`ring_allreduce_bytes`."""
    if compression == "int8":
        return int8_allgather_bytes(participants, num_values)
    return ring_allreduce_bytes(participants, num_values, compression)


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
    if compression == "int8":
        return int8_combine([quantize_int8(r) for r in rows])
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
    if compression == "int8":
        return _all_gather_int8(total, group).to(total.dtype)
    wire = total.to(wire_dtype(compression))
    dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    return wire.to(total.dtype)


def _all_gather_int8(total: Tensor, group: Any) -> Tensor:
    """Collective: every rank's ``total`` ``[P]`` quantised (:func:`quantize_int8`),
    its int8 values and the bytes of its scales sent in one all-gather, combined by
    :func:`int8_combine` in rank order."""
    q, scales = quantize_int8(total)
    wire = torch.cat([scales.view(torch.int8), q])  # the scales first: 4-byte aligned
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, wire, group=group)
    c = 4 * scales.numel()
    return int8_combine([(w[c:], w[:c].view(torch.float32)) for w in parts])
