"""Character-level language-model data from a text file that ships with the OS.

The text is read as bytes (the licence texts are ASCII, so one byte is one character) and
cut into a training part (the first ``1 - eval_fraction`` of the bytes) and a held-out
evaluation part (the tail). Each part becomes windows of ``seq_len + 1`` bytes: the first
``seq_len`` are the inputs, the last ``seq_len`` (shifted by one) the next-character
targets, as in every character-level language model since Karpathy's char-rnn.

Example::

    from charlm.data import load

    (train_x, train_y), (eval_x, eval_y) = load(seq_len=64)
    train_x.shape  # [N, 64], int64 byte values in [0, 256)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

__all__ = ["CANDIDATE_PATHS", "VOCAB_SIZE", "find_text", "load", "windows"]

VOCAB_SIZE = 256
"""Token ids are byte values, so the vocabulary is every byte."""

CANDIDATE_PATHS = (
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/GPL-2",
    "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/common-licenses/Apache-2.0",
)
"""Texts that Debian's and Ubuntu's ``base-files`` package installs, tried in this order
when no ``path`` is given (GPL-3: 35 149 bytes)."""


def find_text(path: str = "") -> Path:
    """The text file to train on: ``path`` if given, else the first of
    :data:`CANDIDATE_PATHS` that exists.

    Raises:
        FileNotFoundError: ``path`` does not exist, or none of the candidates does.
    """
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.kwargs.path = {path!r}: no such file")
        return Path(path)
    for candidate in CANDIDATE_PATHS:
        if Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError(
        f"none of {', '.join(CANDIDATE_PATHS)} exists: set data.kwargs.path to a text file"
    )


def windows(tokens: Tensor, seq_len: int, stride: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets of every window of ``tokens``.

    Args:
        tokens: int64 ``[L]``.
        seq_len: window length T.
        stride: offset between consecutive windows' starts (``stride < seq_len``
            overlaps them).

    Returns:
        ``(inputs, targets)``, both int64 ``[N, T]`` with
        ``N = (L - T - 1) // stride + 1`` and ``targets[:, t] = inputs[:, t + 1]``
        inside a window (targets[:, -1] is the byte after the window).

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens, or ``seq_len`` / ``stride`` < 1.
    """
    if seq_len < 1 or stride < 1:
        raise ValueError(f"seq_len = {seq_len}, stride = {stride}: both must be >= 1")
    if tokens.numel() < seq_len + 1:
        raise ValueError(f"{tokens.numel()} tokens are fewer than seq_len + 1 = {seq_len + 1}")
    chunks = tokens.unfold(0, seq_len + 1, stride)  # [N, T + 1]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


def load(
    path: str = "",
    seq_len: int = 64,
    stride: int = 8,
    eval_fraction: float = 0.1,
    max_bytes: int = 0,
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Training windows of the text's head and evaluation windows of its tail.

    Args:
        path: the text file; "" tries :data:`CANDIDATE_PATHS` in order.
        seq_len: characters per window (T).
        stride: characters between the starts of consecutive training windows (the
            evaluation windows do not overlap: stride T there, so every held-out
            character is predicted once).
        eval_fraction: share of the text, at its end, held out for evaluation (0 < f < 1).
        max_bytes: read only the first this many bytes (0: the whole file), for quick
            tests.

    Returns:
        ``((train_inputs, train_targets), (eval_inputs, eval_targets))``, int64 tensors
        ``[N, T]`` of byte values in ``[0, 256)`` — the tensor form distsgd's data factories
        accept.

    Raises:
        FileNotFoundError: see :func:`find_text`.
        ValueError: ``eval_fraction`` outside (0, 1), or a part shorter than one window.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"data.kwargs.eval_fraction = {eval_fraction}: must be in (0, 1)")
    data = find_text(path).read_bytes()
    if max_bytes > 0:
        data = data[:max_bytes]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(len(tokens) * (1.0 - eval_fraction))
    train = windows(tokens[:split], seq_len, stride)
    held_out = windows(tokens[split:], seq_len, seq_len)
    return train, held_out
