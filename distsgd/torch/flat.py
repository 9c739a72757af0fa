"""Flat vectors of a list of tensors, and back: the communication helpers of the drop-in
(one contiguous buffer per collective or push, no per-parameter loop)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["flatten", "flatten_grads", "write_back"]


def flatten(tensors: list[Tensor]) -> Tensor:
    """A new float32 vector ``[Σ numel]`` holding ``tensors`` in order (detached)."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def flatten_grads(params: list[Tensor]) -> Tensor:
    """The gradients of ``params`` as one float32 vector ``[P]`` (zeros for a missing one)."""
    return torch.cat(
        [
            (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in params
        ]
    )


def write_back(vector: Tensor, tensors: list[Tensor]) -> None:
    """Copy ``vector`` ``[Σ numel]`` into ``tensors`` in order, in place."""
    with torch.no_grad():
        for t, v in zip(tensors, vector.split([t.numel() for t in tensors]), strict=True):
            t.copy_(v.view_as(t))
