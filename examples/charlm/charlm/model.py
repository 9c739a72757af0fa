"""A character-level LSTM language model (char-rnn: Karpathy, "The Unreasonable
Effectiveness of Recurrent Neural Networks", 2015; LSTM: Hochreiter & Schmidhuber, 1997).

Embedding → dropout → LSTM → dropout → linear read-out to next-character logits. The
dropout keeps the model from memorising a 35 kB text within the first epochs, so that the
held-out perplexity keeps falling (measured in a plain loop, batch 32, lr 1.0: without
dropout it turned up after about 13k training windows, from 7.2; with 0.2 it fell to 6.1
at 32k).

Example::

    import torch
    from charlm.model import build

    model = build(hidden=128)
    logits = model(torch.randint(0, 256, (8, 64)))  # [8, 64, 256]
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from charlm.data import VOCAB_SIZE

__all__ = ["CharLSTM", "build", "perplexity"]


class CharLSTM(nn.Module):
    """Next-character logits of a byte sequence.

    Args:
        vocab_size: number of token ids (256: every byte).
        embed: embedding width.
        hidden: LSTM hidden units per layer.
        layers: stacked LSTM layers.
        dropout: dropout probability on the embedding and on the LSTM's output (and
            between stacked layers).

    Shapes: ``forward(tokens [B, T] int64) -> logits [B, T, vocab_size]`` float32, one
    prediction per position for the character that follows it (the state starts at zero
    for every window).
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        embed: int = 32,
        hidden: int = 128,
        layers: int = 1,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(
            embed, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0
        )
        self.dropout = nn.Dropout(dropout)
        self.readout = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        states, _ = self.lstm(self.dropout(self.embedding(tokens)))
        return self.readout(self.dropout(states))


def build(
    vocab_size: int = VOCAB_SIZE,
    embed: int = 32,
    hidden: int = 128,
    layers: int = 1,
    dropout: float = 0.2,
) -> CharLSTM:
    """The model factory named in the configs (``model.factory = "charlm.model:build"``,
    its arguments in ``[model.kwargs]``); see :class:`CharLSTM` for the arguments and
    shapes.

    Raises:
        ValueError: a size below 1 or a dropout outside [0, 1).
    """
    if min(vocab_size, embed, hidden, layers) < 1:
        raise ValueError(
            f"model.kwargs: vocab_size = {vocab_size}, embed = {embed}, hidden = {hidden}, "
            f"layers = {layers}: each must be >= 1"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.kwargs.dropout = {dropout}: must be in [0, 1)")
    return CharLSTM(vocab_size, embed, hidden, layers, dropout)


def perplexity(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    """exp of the mean next-character cross-entropy (nats per character) of ``model`` on
    ``inputs``/``targets`` int64 ``[N, T]``: the metric the configs name (``perplexity``).
    Puts ``model`` in evaluation mode (no dropout) and leaves it there."""
    model.eval()
    with torch.no_grad():
        logits = model(inputs)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
    return float(torch.exp(loss))
