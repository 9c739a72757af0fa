"""Tabular data bundled with scikit-learn (no download): the UCI optical handwritten
digits (``sklearn.datasets.load_digits``: 1 797 rows, 64 features — 8×8 pixel counts in
0…16 — and 10 classes) or the Wisconsin breast-cancer data (``load_breast_cancer``:
569 rows, 30 features, 2 classes).

A stratified, seeded split holds out ``eval_fraction`` of the rows; every feature is
standardised with the training rows' mean and standard deviation (a feature that is
constant on the training rows is only centred).

Example::

    from tabular.data import load

    train, held_out = load("digits")
    x, y = train[0]  # float32 [64], int64 []
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

__all__ = ["DATASETS", "load", "standardise"]

DATASETS = {"digits": load_digits, "breast_cancer": load_breast_cancer}
"""The data sets ``load`` knows, by name: scikit-learn's bundled loaders."""


def standardise(train: np.ndarray, held_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Features of both parts ``[N, F]`` scaled by the training part's per-feature mean
    and standard deviation (a standard deviation of 0 is taken as 1)."""
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std[std == 0.0] = 1.0
    return (train - mean) / std, (held_out - mean) / std


def load(
    name: str = "digits",
    eval_fraction: float = 0.2,
    split_seed: int = 0,
    max_rows: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """The training and held-out rows as map-style data sets.

    Args:
        name: a key of :data:`DATASETS`.
        eval_fraction: share of the rows held out for evaluation (stratified by class).
        split_seed: seed of the split (fixed, so every rank of a dist run gets the same
            split).
        max_rows: keep only the first this many rows before splitting (0: all), for quick
            tests.

    Returns:
        ``(train, held_out)``: ``TensorDataset``s whose items are ``(features, label)``,
        float32 ``[F]`` and an int64 scalar; distsgd's default collate stacks a batch of
        them into ``[B, F]`` and ``[B]``.

    Raises:
        ValueError: an unknown ``name`` or an ``eval_fraction`` outside (0, 1).
    """
    if name not in DATASETS:
        raise ValueError(f"data.kwargs.name = {name!r}: must be one of {sorted(DATASETS)}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"data.kwargs.eval_fraction = {eval_fraction}: must be in (0, 1)")
    bunch = DATASETS[name]()
    features, labels = bunch.data, bunch.target
    if max_rows > 0:
        features, labels = features[:max_rows], labels[:max_rows]
    train_x, eval_x, train_y, eval_y = train_test_split(
        features, labels, test_size=eval_fraction, random_state=split_seed, stratify=labels
    )
    train_x, eval_x = standardise(train_x, eval_x)

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)
        )

    return dataset(train_x, train_y), dataset(eval_x, eval_y)
