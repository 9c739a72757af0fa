"""Datasets and per-learner sharding.

Datasets (selected by :class:`~distsgd.config.DataConfig`):

* ``fashion_mnist`` and ``mnist`` — the four IDX files (``train-images-idx3-ubyte.gz``,
  ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
  ``t10k-labels-idx1-ubyte.gz``, gzip-compressed or plain), images ``[N, 1, 28, 28]``.
* ``cifar10`` — the python pickle batches (``data_batch_1`` … ``data_batch_5``,
  ``test_batch``), images ``[N, 3, 32, 32]``.
* ``synthetic`` — Gaussian class clusters made in memory, images ``[N, 1, 28, 28]``.

Every dataset is returned as float32 tensors normalised per channel with the training
set's mean and standard deviation (the test set with the same statistics), and int64
labels. A missing or corrupt file raises :class:`DatasetError` naming the path and the fix.

Sharding: :class:`ShardedSampler` gives every learner a disjoint slice of a fresh seeded
permutation each epoch, laid out so that λ learners × batch b at step s together draw
exactly the samples that one learner with batch λ·b draws at step s (see
:meth:`ShardedSampler.batch_indices`). :class:`LearnerStream` walks one learner through
it and saves its position in a checkpoint.

Example::

    from distsgd.config import DataConfig
    from distsgd.data import LearnerStream, ShardedSampler, load_dataset

    ds = load_dataset(DataConfig(dataset="synthetic"), seed=0)
    sampler = ShardedSampler(ds.num_train, num_learners=4, batch_size=32, seed=0)
    stream = LearnerStream(sampler, learner=0)
    idx = stream.next_indices()  # LongTensor [32]
    x, y = ds.train_x[idx], ds.train_y[idx]
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import hashlib
import importlib
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset, default_collate

from distsgd.checks import ConfigError, check_int
from distsgd.config import DataConfig
from distsgd.factories import USER_CODE_FAILURES, failure_text, resolve_callable

__all__ = [
    "DatasetError",
    "Dataset",
    "Split",
    "TensorSplit",
    "MapSplit",
    "as_split",
    "BUILTIN_DATASETS",
    "load_dataset",
    "keep_loaded",
    "resolve_root",
    "ShardedSampler",
    "LearnerStream",
    "ElasticShards",
    "iter_eval_batches",
    "DATA_DIR_ENV",
    "DEFAULT_ROOTS",
]

DATA_DIR_ENV = "DISTSGD_DATA_DIR"
"""Environment variable naming the data directory when ``data.root`` is empty."""

DEFAULT_ROOTS: dict[str, str] = {
    "fashion_mnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
    "cifar10": "/usr/share/datasets/cifar-10-batches-py",
}
"""Directory used for each file-backed dataset when neither ``data.root`` nor
``DISTSGD_DATA_DIR`` is set."""

_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "test_batch"

# Synthetic clusters: pixel standard deviation of the class means, relative to unit noise.
# With data.noise = 1 a 784-256-256-10 MLP is ~80% accurate after one epoch of 2048
# samples and ~96% after two; the nearest-mean (Bayes) classifier is ~99% accurate.
_SYNTHETIC_MEAN_STD = 0.175
_SYNTHETIC_CLASSES = 10
_SYNTHETIC_SHAPE = (1, 28, 28)


class DatasetError(ValueError):
    """A dataset's files are missing, unreadable or corrupt.

    The message names the path that was looked at and how to fix it.
    """


class Split:
    """One split of a data set (training or evaluation): samples indexed ``0 … N−1``.

    A batch is a pair ``(inputs, targets)`` of tensors whose leading dimension is the
    number of samples. :class:`TensorSplit` holds tensors (the built-in data sets' fast
    path: a batch is two index operations); :class:`MapSplit` holds a map-style
    ``torch.utils.data.Dataset`` and makes a batch with its collate function.
    """

    num_samples: int

    def batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """The samples ``idx`` (int64, any shape ``S``): inputs ``[*S, ...]`` and targets
        ``[*S, ...]``."""
        raise NotImplementedError

    def batches(
        self, batch_size: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Consecutive batches of ``batch_size`` samples covering ``[start, stop)`` once
        (the last one holds the rest)."""
        check_int("train.eval_batch_size", batch_size, 1)
        stop = self.num_samples if stop is None else stop
        for lo in range(start, stop, batch_size):
            yield self.batch(torch.arange(lo, min(lo + batch_size, stop)))


class TensorSplit(Split):
    """A split held as two tensors: inputs ``x [N, ...]`` and targets ``y [N, ...]``."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{x.shape[0]} inputs but {y.shape[0]} targets")
        self.x, self.y = x, y
        self.num_samples = int(x.shape[0])

    def batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return self.x[idx], self.y[idx]

    def batches(
        self, batch_size: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        stop = self.num_samples if stop is None else stop
        return iter_eval_batches(self.x[start:stop], self.y[start:stop], batch_size)


class MapSplit(Split):
    """A split held as a map-style data set whose items are ``(input, target)`` tensors.

    Args:
        dataset: has ``__len__`` and ``__getitem__(i)`` → ``(input, target)``.
        collate: list of items → ``(inputs, targets)`` batch tensors
            (``torch.utils.data.default_collate`` when None).
        setting: the config setting that named the data (for error messages).

    Raises:
        ConfigError: the data set is empty, or its first items are not pairs of tensors
            or do not make a batch.
    """

    def __init__(
        self, dataset: Any, collate: Callable[[list[Any]], Any] | None, setting: str
    ) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate
        self.setting = setting
        self.num_samples = len(dataset)
        if self.num_samples < 1:
            raise ConfigError(f"{setting}: the data set is empty")
        # fail now, in one line (the rest is read as it trains)
        check_finite(*self.batch(torch.arange(min(2, self.num_samples))), setting)

    def batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        items = [self.dataset[i] for i in idx.reshape(-1).tolist()]
        try:
            made = self.collate(items)
        except (Exception, SystemExit) as e:  # the user's collate (a Ctrl-C interrupts)
            raise ConfigError(
                f"{self.setting}: its items do not make a batch ({type(e).__name__}: {e}); "
                "items must be (input, target) pairs of tensors of one shape, or set "
                "data.collate to a function that batches them"
            ) from None
        if (
            not isinstance(made, tuple | list)
            or len(made) != 2
            or not all(isinstance(t, Tensor) for t in made)
        ):
            raise ConfigError(
                f"{self.setting}: a batch of its items is a {type(made).__name__}, expected "
                "(inputs, targets) tensors: items must be (input, target) pairs of tensors "
                "(or data.collate must return such a pair)"
            )
        x, y = made
        shape = tuple(idx.shape)
        return x.reshape(*shape, *x.shape[1:]), y.reshape(*shape, *y.shape[1:])


def check_finite(x: Tensor, y: Tensor, setting: str) -> None:
    """Refuse inputs ``x [N, ...]`` or targets ``y [N, ...]`` holding NaN or infinity (every
    loss of a batch holding one is NaN, before any update).

    Raises:
        ConfigError: naming ``setting``, the first such sample and the tensor.
    """
    for what, t in (("inputs", x), ("targets", y)):
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ConfigError(
                f"{setting}: sample {i} holds NaN or infinity in its {what} "
                f"({int(bad.sum())} of {t.shape[0]} samples do): expected finite numbers"
            )


def _tensor_split(x: Tensor, y: Tensor, setting: str) -> TensorSplit:
    """A :class:`TensorSplit` of the user's tensors, refused when empty or not finite."""
    try:
        split = TensorSplit(x, y)
    except ValueError as e:
        raise ConfigError(f"{setting}: {e}") from None
    if split.num_samples < 1:
        raise ConfigError(f"{setting}: the data set is empty (0 samples)")
    check_finite(x, y, setting)
    return split


def as_split(data: Any, collate: Callable[[list[Any]], Any] | None, setting: str) -> Split:
    """A :class:`Split` of ``data``: a pair of tensors ``(inputs, targets)``, a
    ``TensorDataset`` of two tensors, or a map-style data set of ``(input, target)`` items.

    Raises:
        ConfigError: ``data`` is none of these, is empty, or holds NaN or infinity (every
            sample of tensors; the first two items of a map-style data set, whose other
            items are read as it trains); the message names ``setting``.
    """
    if (
        isinstance(data, tuple | list)
        and len(data) == 2
        and all(isinstance(t, Tensor) for t in data)
    ):
        return _tensor_split(data[0], data[1], setting)
    if isinstance(data, TensorDataset) and len(data.tensors) == 2 and collate is None:
        return _tensor_split(*data.tensors, setting)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapSplit(data, collate, setting)
    raise ConfigError(
        f"{setting} gave a {type(data).__name__}: expected a map-style torch.utils.data."
        "Dataset of (input, target) pairs or a pair of tensors (inputs, targets)"
    )


def _class_labels(split: Split) -> Tensor | None:
    """A split's integer class labels ``[N]`` when it holds them as a tensor (or a
    map-style data set's ``targets`` attribute), else None."""
    if isinstance(split, TensorSplit):
        y = split.y
    elif isinstance(split, MapSplit) and getattr(split.dataset, "targets", None) is not None:
        try:
            y = torch.as_tensor(split.dataset.targets)
        except (TypeError, ValueError, RuntimeError):
            return None
    else:
        return None
    return y if y.dim() == 1 and not y.is_floating_point() and not y.is_complex() else None


class Dataset:
    """A data set in memory: a training split and an evaluation split.

    Args:
        name: what it was loaded from (``data.dataset`` or ``data.factory``).
        train: the training split (the sharded samplers index it).
        test: the evaluation split; the training split when the data has none.
        num_classes: number of classes when known (the built-in data sets: 10), else
            None.

    The built-in data sets are float32 inputs normalised per channel with the training
    set's mean and standard deviation, and int64 labels; ``train_x`` … ``test_y`` give
    their tensors.
    """

    def __init__(
        self, name: str, train: Split, test: Split | None = None, num_classes: int | None = None
    ) -> None:
        self.name = name
        self.train = train
        self.test = test if test is not None else train
        self.num_classes = num_classes

    @classmethod
    def of_tensors(
        cls,
        name: str,
        train_x: Tensor,
        train_y: Tensor,
        test_x: Tensor,
        test_y: Tensor,
        num_classes: int | None = None,
    ) -> Dataset:
        """A data set of tensors (the built-in data sets' form)."""
        return cls(name, TensorSplit(train_x, train_y), TensorSplit(test_x, test_y), num_classes)

    def _tensors(self, split: Split) -> TensorSplit:
        if not isinstance(split, TensorSplit):
            raise TypeError(f"data set {self.name!r} is not held as tensors")
        return split

    @property
    def train_x(self) -> Tensor:
        """Training inputs ``[N, ...]`` (tensor-held data sets only)."""
        return self._tensors(self.train).x

    @property
    def train_y(self) -> Tensor:
        """Training targets ``[N, ...]`` (tensor-held data sets only)."""
        return self._tensors(self.train).y

    @property
    def test_x(self) -> Tensor:
        """Evaluation inputs ``[M, ...]`` (tensor-held data sets only)."""
        return self._tensors(self.test).x

    @property
    def test_y(self) -> Tensor:
        """Evaluation targets ``[M, ...]`` (tensor-held data sets only)."""
        return self._tensors(self.test).y

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one training input, e.g. ``(C, H, W)``."""
        x, _ = self.train.batch(torch.zeros(1, dtype=torch.int64))
        return tuple(int(d) for d in x.shape[1:])

    def class_count(self) -> int | None:
        """``num_classes`` when known; else, when the labels are integer class indices
        ``[N]`` held as a tensor (or a map-style data set's ``targets``, torchvision's
        convention), ``max label + 1`` over the training and evaluation labels; else None."""
        if self.num_classes is not None:
            return self.num_classes
        labels = [_class_labels(s) for s in (self.train, self.test) if s is not None]
        if labels[0] is None:
            return None
        return max(int(y.max()) + 1 for y in labels if y is not None and y.numel())

    @property
    def num_train(self) -> int:
        """Number of training samples N."""
        return self.train.num_samples

    @property
    def num_test(self) -> int:
        """Number of evaluation samples M."""
        return self.test.num_samples


# ---- loading -------------------------------------------------------------------------------


def resolve_root(cfg: DataConfig) -> Path:
    """Directory the files of ``cfg.dataset`` are read from.

    ``cfg.root`` if non-empty, else ``$DISTSGD_DATA_DIR`` if set and non-empty, else the
    dataset's entry in :data:`DEFAULT_ROOTS`.

    Raises:
        ValueError: ``cfg.dataset`` is ``synthetic`` (it has no files).
    """
    if cfg.dataset not in DEFAULT_ROOTS:
        raise ValueError(f"data.dataset = {cfg.dataset!r} is not read from files")
    if cfg.root:
        return Path(cfg.root).expanduser()
    env = os.environ.get(DATA_DIR_ENV, "")
    if env:
        return Path(env).expanduser()
    return Path(DEFAULT_ROOTS[cfg.dataset])


_kept: dict[tuple[str, str], tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]] = {}
_keeping = 0  # open keep_loaded() blocks in this process


@contextlib.contextmanager
def keep_loaded() -> Iterator[None]:
    """Inside this block a built-in data set read from files (``fashion_mnist``,
    ``mnist``, ``cifar10``) is read and normalised once per process, per name and
    directory: later :func:`load_dataset` calls share its tensors (distsgd only indexes
    them, never writes them in place). For a process that trains many short runs: a
    :class:`~distsgd.launch.RankPool` rank, ``--tune``'s probes on ``sim``. The kept tensors are dropped when the outermost block ends.
    User factories and ``synthetic`` are loaded every time."""
    global _keeping
    _keeping += 1
    try:
        yield
    finally:
        _keeping -= 1
        if not _keeping:
            _kept.clear()


def _builtin_files(name: str, root: Path) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """A built-in file data set's tensors: kept inside :func:`keep_loaded`."""
    make = BUILTIN_DATASETS[name][0]
    if not _keeping:
        return make(root=str(root))
    key = (name, str(root.resolve()))
    if key not in _kept:
        _kept[key] = make(root=str(root))
    return _kept[key]


def load_dataset(
    cfg: DataConfig,
    seed: int = 0,
    factory: Callable[..., Any] | None = None,
) -> Dataset:
    """Load the data set ``cfg`` describes: the user's factory, or a built-in one.

    The built-in data sets are registered factories (:data:`BUILTIN_DATASETS`) of the
    same kind as a user's: a function of keyword arguments returning ``(train, eval)``.

    Args:
        cfg: ``factory`` + ``kwargs`` (+ ``collate``), else the built-in ``dataset`` and
            its settings (``root``; ``num_train``, ``num_test`` and ``noise`` for
            ``synthetic``).
        seed: seeds the synthetic data set (class means, labels, noise); unused otherwise
            (a user factory runs under the run's ``torch.manual_seed``).
        factory: a data factory object instead of ``cfg.factory`` (the simulated runtime
            in one process only: :func:`distsgd.fit`).

    Returns:
        A :class:`Dataset`: Fashion-MNIST and MNIST 60000/10000 samples of
        ``[1, 28, 28]``, CIFAR-10 50000/10000 of ``[3, 32, 32]``, synthetic
        ``cfg.num_train``/``cfg.num_test`` of ``[1, 28, 28]``, 10 classes each; a user's
        factory's splits as it returns them.

    Raises:
        DatasetError: a built-in data set's file or directory is missing, unreadable or
            corrupt; the message names the path and how to fix it.
        ConfigError: the factory does not import, fails, or returns something that is not
            ``(train, eval)`` data; its items are not tensor pairs or do not collate.
    """
    if factory is None and not cfg.factory:
        make, num_classes = BUILTIN_DATASETS[cfg.dataset]
        if cfg.dataset == "synthetic":
            kwargs = {"num_train": cfg.num_train, "num_test": cfg.num_test, "noise": cfg.noise}
            (train_x, train_y), (test_x, test_y) = make(**kwargs, seed=seed)
        else:
            (train_x, train_y), (test_x, test_y) = _builtin_files(cfg.dataset, resolve_root(cfg))
        return Dataset.of_tensors(cfg.dataset, train_x, train_y, test_x, test_y, num_classes)
    setting = f"data.factory = {cfg.factory!r}" if factory is None else "the data factory"
    make = resolve_callable("data.factory", factory or cfg.factory)
    collate = resolve_callable("data.collate", cfg.collate) if cfg.collate else None
    try:
        made = make(**cfg.kwargs)
    except USER_CODE_FAILURES as e:  # the user's factory failed: one line says how
        raise ConfigError(f"{setting} raised {failure_text(e)}") from None
    if not isinstance(made, tuple | list) or len(made) != 2:
        raise ConfigError(
            f"{setting} returned a {type(made).__name__}: expected a pair (train, eval) of "
            "data sets (eval may be None)"
        )
    train = as_split(made[0], collate, f"{setting} (train)")
    test = None if made[1] is None else as_split(made[1], collate, f"{setting} (eval)")
    return Dataset(cfg.factory or getattr(make, "__name__", "data"), train, test)


def _file_dataset(name: str, root: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    path = Path(root)
    if name == "cifar10":
        arrays = _load_cifar10(path)
    else:
        arrays = _load_idx_dataset(name, path)
    ds = _normalise_uint8(name, *arrays, num_classes=10)
    return (ds.train_x, ds.train_y), (ds.test_x, ds.test_y)


def fashion_mnist(root: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Fashion-MNIST from ``root``'s IDX files: ``((x [60000, 1, 28, 28], y [60000]),
    (x [10000, 1, 28, 28], y [10000]))``, normalised per channel with the training set's
    statistics."""
    return _file_dataset("fashion_mnist", root)


def mnist(root: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """MNIST from ``root``'s IDX files, as :func:`fashion_mnist`."""
    return _file_dataset("mnist", root)


def cifar10(root: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """CIFAR-10 from ``root``'s python batches: ``[50000, 3, 32, 32]`` / ``[10000, 3, 32,
    32]``, normalised per channel."""
    return _file_dataset("cifar10", root)


def synthetic(
    num_train: int, num_test: int, noise: float, seed: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Gaussian class clusters (see :func:`_load_synthetic`)."""
    ds = _load_synthetic(num_train, num_test, noise, seed)
    return (ds.train_x, ds.train_y), (ds.test_x, ds.test_y)


BUILTIN_DATASETS: dict[str, tuple[Callable[..., Any], int]] = {
    "fashion_mnist": (fashion_mnist, 10),
    "mnist": (mnist, 10),
    "cifar10": (cifar10, 10),
    "synthetic": (synthetic, 10),
}
"""The built-in data sets (``data.dataset``): factory and number of classes."""


def _normalise_uint8(
    name: str,
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
) -> Dataset:
    """uint8 ``[N, C, H, W]`` images → float32, per channel (x − mean) / std of train_x."""
    c = train_x.shape[1]
    mean = np.empty(c, dtype=np.float64)
    std = np.empty(c, dtype=np.float64)
    values = np.arange(256, dtype=np.float64)
    for ch in range(c):
        # A histogram of the 256 byte values gives exact moments without a float copy.
        channel = torch.from_numpy(np.ascontiguousarray(train_x[:, ch]).reshape(-1))
        hist = torch.bincount(channel, minlength=256).numpy().astype(np.float64)
        count = hist.sum()
        mean[ch] = (hist @ values) / count
        var = (hist @ (values - mean[ch]) ** 2) / count
        std[ch] = np.sqrt(var) if var > 0 else 1.0
    shift = torch.from_numpy(mean.astype(np.float32)).view(1, c, 1, 1)
    scale = torch.from_numpy((1.0 / std).astype(np.float32)).view(1, c, 1, 1)

    def convert(x: np.ndarray) -> Tensor:
        return torch.from_numpy(x.astype(np.float32)).sub_(shift).mul_(scale)

    return Dataset.of_tensors(
        name,
        convert(train_x),
        torch.from_numpy(train_y.astype(np.int64)),
        convert(test_x),
        torch.from_numpy(test_y.astype(np.int64)),
        num_classes,
    )


# ---- IDX (Fashion-MNIST, MNIST) ------------------------------------------------------------


def _install_hint(dataset: str, root: Path) -> str:
    """How to make ``dataset``'s files appear (for a missing file or directory)."""
    where = f"or set data.root (or {DATA_DIR_ENV}) to the directory that holds the files"
    if dataset == "fashion_mnist":
        return f"install Fashion-MNIST with `apt-get install -y dataset-fashion-mnist`, {where}"
    if dataset == "mnist":
        names = ", ".join(f"{b}.gz" for b in _IDX_FILES.values())
        return f"put the four MNIST IDX files ({names}) in {root}, {where}"
    names = ", ".join((*_CIFAR_TRAIN, _CIFAR_TEST))
    return (
        "extract the CIFAR-10 python version (cifar-10-python.tar.gz) so that "
        f"{root} holds {names}, {where}"
    )


def _corrupt(dataset: str, path: Path, detail: str) -> DatasetError:
    """The error for a file whose contents are wrong."""
    if dataset == "fashion_mnist":
        fix = (
            "re-install it with `apt-get install --reinstall -y dataset-fashion-mnist` "
            "or re-download it"
        )
    else:
        fix = "re-download it"
    return DatasetError(f"{path} is corrupt ({detail}); {fix}")


def _check_dir(dataset: str, root: Path) -> None:
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DatasetError(
            f"{dataset} data directory {root} {what}; {_install_hint(dataset, root)}"
        )


def _find_idx_file(dataset: str, root: Path, base: str) -> Path:
    """``root/base.gz`` if present, else ``root/base``."""
    candidates = (root / f"{base}.gz", root / base)
    for path in candidates:
        if path.is_file():
            return path
    raise DatasetError(
        f"{dataset} file {candidates[0]} (or {candidates[1]}) does not exist; "
        f"{_install_hint(dataset, root)}"
    )


# the gzip files read last, unpacked: a process that trains many runs (a RankPool's rank,
# --tune's probes on sim) gunzips each once (~0.25 s of Fashion-MNIST's 0.4 s load);
# keyed by path and a BLAKE2 digest of the packed bytes, so a rewritten file is read anew
# (not CRC-32: a gzip file ends in its data's CRC-32, and the CRC-32 of data followed by
# its own CRC is a constant, so stored-block files of one length would all collide)
_GUNZIPPED: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
_GUNZIPPED_KEPT = 8


def _gunzip(dataset: str, path: Path, raw: bytes) -> bytes:
    key = (str(path.resolve()), hashlib.blake2b(raw, digest_size=16).digest())
    if key in _GUNZIPPED:
        _GUNZIPPED.move_to_end(key)
        return _GUNZIPPED[key]
    try:
        data = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise _corrupt(dataset, path, f"not a complete gzip file: {e}") from None
    _GUNZIPPED[key] = data
    while len(_GUNZIPPED) > _GUNZIPPED_KEPT:
        _GUNZIPPED.popitem(last=False)
    return data


def _read_file(dataset: str, path: Path) -> bytes:
    """File contents, gunzipped when the name ends in ``.gz`` or the bytes are gzip."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(
            f"cannot read {path} ({e.strerror or e}); check that the file is readable"
        ) from None
    if path.suffix == ".gz" or raw[:2] == b"\x1f\x8b":
        return _gunzip(dataset, path, raw)
    return raw


def _parse_idx(dataset: str, path: Path, data: bytes, magic: int, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX array: big-endian magic, ``ndim`` big-endian uint32 dims, data.

    Returns a uint8 array of the dims in the header.
    """
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise _corrupt(
            dataset, path, f"{len(data)} bytes, shorter than the {header}-byte IDX header"
        )
    found, *dims = struct.unpack(f">{1 + ndim}I", data[:header])
    if found != magic:
        raise _corrupt(dataset, path, f"IDX magic number {found}, expected {magic}")
    size = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != size:
        raise _corrupt(
            dataset,
            path,
            f"header gives dimensions {tuple(dims)} = {size} bytes of data, "
            f"the file holds {len(data) - header}",
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims).copy()


def _load_idx_split(
    dataset: str, root: Path, split: str, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """One split's images ``[N, 1, 28, 28]`` and labels ``[N]`` (uint8)."""
    img_path = _find_idx_file(dataset, root, _IDX_FILES[f"{split}_images"])
    lbl_path = _find_idx_file(dataset, root, _IDX_FILES[f"{split}_labels"])
    images = _parse_idx(dataset, img_path, _read_file(dataset, img_path), _IDX_IMAGES_MAGIC, 3)
    labels = _parse_idx(dataset, lbl_path, _read_file(dataset, lbl_path), _IDX_LABELS_MAGIC, 1)
    if images.shape[0] == 0:
        raise _corrupt(dataset, img_path, "it holds no images")
    if images.shape[1:] != (28, 28):
        raise _corrupt(
            dataset, img_path, f"images are {images.shape[1]}×{images.shape[2]}, expected 28×28"
        )
    if images.shape[0] != labels.shape[0]:
        raise _corrupt(
            dataset,
            lbl_path,
            f"{labels.shape[0]} labels for the {images.shape[0]} images in {img_path}",
        )
    if labels.size and int(labels.max()) >= num_classes:
        raise _corrupt(dataset, lbl_path, f"label {int(labels.max())} outside [0, {num_classes})")
    return images.reshape(-1, 1, 28, 28), labels


def _load_idx_dataset(
    dataset: str, root: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    _check_dir(dataset, root)
    train_x, train_y = _load_idx_split(dataset, root, "train", 10)
    test_x, test_y = _load_idx_split(dataset, root, "test", 10)
    return train_x, train_y, test_x, test_y


# ---- CIFAR-10 python batches ---------------------------------------------------------------


def _numpy_internal(submodule: str, name: str) -> Any:
    """``numpy._core.<submodule>.<name>`` (numpy 2) or ``numpy.core.…`` (numpy 1)."""
    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(importlib.import_module(f"{prefix}.{submodule}"), name)
        except (ImportError, AttributeError):
            continue
    raise pickle.UnpicklingError(f"numpy has no {submodule}.{name}")


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that builds only dicts, lists, strings, numbers and numpy arrays.

    A CIFAR-10 batch needs nothing else; any other global (a function call smuggled into
    the file) is refused instead of executed.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in (
            "_reconstruct",
            "scalar",
        ):
            return _numpy_internal("multiarray", name)
        if module in ("numpy.core.numeric", "numpy._core.numeric") and name == "_frombuffer":
            return _numpy_internal("numeric", name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "_codecs" and name == "encode":
            return codecs.encode
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-10 batch")


def _load_cifar_batch(root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: images uint8 ``[n, 3, 32, 32]`` and labels uint8 ``[n]``."""
    path = root / name
    if not path.is_file():
        raise DatasetError(f"cifar10 file {path} does not exist; {_install_hint('cifar10', root)}")
    try:
        with path.open("rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
    except OSError as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise DatasetError(
                f"cannot read {path} ({e.strerror or e}); check that the file is readable"
            ) from None
        raise _corrupt("cifar10", path, f"not a readable pickle: {e}") from None
    except Exception as e:  # any failure to unpickle means the file is damaged
        raise _corrupt("cifar10", path, f"not a readable pickle: {type(e).__name__}: {e}") from None
    if not isinstance(batch, dict):
        raise _corrupt("cifar10", path, f"holds a {type(batch).__name__}, expected a dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise _corrupt("cifar10", path, "no b'data' or b'labels' entry")
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise _corrupt(
            "cifar10", path, f"data is {data.dtype} {tuple(data.shape)}, expected uint8 [n, 3072]"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise _corrupt("cifar10", path, "labels are not integers") from None
    if labels.shape[0] != data.shape[0]:
        raise _corrupt("cifar10", path, f"{labels.shape[0]} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= 10):
        raise _corrupt("cifar10", path, "labels outside [0, 10)")
    # Rows are 1024 red, 1024 green, 1024 blue values, each 32×32 row-major.
    return data.reshape(-1, 3, 32, 32), labels.astype(np.uint8)


def _load_cifar10(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    _check_dir("cifar10", root)
    train = [_load_cifar_batch(root, name) for name in _CIFAR_TRAIN]
    test_x, test_y = _load_cifar_batch(root, _CIFAR_TEST)
    train_x = np.concatenate([b[0] for b in train])
    train_y = np.concatenate([b[1] for b in train])
    return train_x, train_y, test_x, test_y


# ---- synthetic -----------------------------------------------------------------------------


def _load_synthetic(num_train: int, num_test: int, noise: float, seed: int) -> Dataset:
    """Gaussian class clusters: x = m_y + noise · ε, ε ~ N(0, I), y uniform over 10 classes.

    The class means m_0..m_9 are smooth ``[1, 28, 28]`` patterns (a 7×7 standard normal
    grid, bilinearly upsampled) rescaled to pixel standard deviation 0.175, drawn from a
    ``torch.Generator`` seeded with ``seed``; the training and test samples come from two
    generators seeded from that one, so the test set does not depend on ``num_train``.
    """
    g = torch.Generator().manual_seed(seed)
    grid = torch.randn(_SYNTHETIC_CLASSES, 1, 7, 7, generator=g)
    means = F.interpolate(grid, size=_SYNTHETIC_SHAPE[1:], mode="bilinear", align_corners=False)
    means = means * (_SYNTHETIC_MEAN_STD / means.std())
    train_seed, test_seed = torch.randint(0, 2**62, (2,), generator=g).tolist()

    def draw(n: int, split_seed: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(split_seed)
        y = torch.randint(0, _SYNTHETIC_CLASSES, (n,), generator=gs)
        x = means[y] + noise * torch.randn(n, *_SYNTHETIC_SHAPE, generator=gs)
        return x, y

    train_x, train_y = draw(num_train, train_seed)
    test_x, test_y = draw(num_test, test_seed)
    dims = (0, 2, 3)
    mean = train_x.to(torch.float64).mean(dim=dims, keepdim=True)
    std = train_x.to(torch.float64).std(dim=dims, keepdim=True, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    shift, scale = mean.to(torch.float32), (1.0 / std).to(torch.float32)
    return Dataset.of_tensors(
        "synthetic",
        (train_x - shift) * scale,
        train_y,
        (test_x - shift) * scale,
        test_y,
        _SYNTHETIC_CLASSES,
    )


# ---- sharding ------------------------------------------------------------------------------


class ShardedSampler:
    """Disjoint per-learner minibatches from a fresh seeded permutation every epoch.

    Epoch e shuffles the N sample indices with a ``torch.Generator`` seeded with
    ``seed * 1_000_003 + e`` (mod 2**64). Step s of learner l (0 <= l < λ) takes the
    b indices ``perm_e[s·λ·b + l·b : s·λ·b + (l+1)·b]``, so

    * within an epoch no sample is drawn twice (the last ``N mod λ·b`` of the
      permutation are skipped that epoch);
    * the union over the λ learners of step s is exactly batch s of one learner with
      batch λ·b and the same seed — hardsync over λ learners × b computes the same
      gradient as one learner with batch λ·b (Rudra's μ·λ equivalence, docs/protocols.md).

    The sampler keeps the permutations of the two most recently used epochs (asynchronous
    learners may be one epoch apart) and recomputes any other.

    Args:
        num_samples: N, training samples.
        num_learners: λ.
        batch_size: b, samples per learner per step.
        seed: base seed of the epoch permutations.

    Raises:
        ValueError: a count is not a positive integer, or λ·b > N (no full step fits in an
            epoch); the message names ``protocol.batch_size`` and ``protocol.num_learners``.
    """

    _CACHED_EPOCHS = 2

    def __init__(self, num_samples: int, num_learners: int, batch_size: int, seed: int) -> None:
        check_int("num_samples", num_samples, 1)
        check_int("protocol.num_learners", num_learners, 1)
        check_int("protocol.batch_size", batch_size, 1)
        check_int("seed", seed, 0)
        self.num_samples = num_samples
        self.num_learners = num_learners
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = num_samples // (num_learners * batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"protocol.batch_size = {batch_size} × protocol.num_learners = {num_learners} "
                f"= {batch_size * num_learners} samples per step exceeds the {num_samples} "
                "training samples: reduce protocol.batch_size or protocol.num_learners"
            )
        self._perms: OrderedDict[int, Tensor] = OrderedDict()

    @property
    def global_batch(self) -> int:
        """λ·b, samples drawn by all learners in one step."""
        return self.num_learners * self.batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples drawn per epoch: ``steps_per_epoch · λ · b`` (<= N)."""
        return self.steps_per_epoch * self.global_batch

    def permutation(self, epoch: int) -> Tensor:
        """The permutation of epoch ``epoch``: int64 ``[N]``. Do not modify it.

        Raises:
            ValueError: ``epoch`` is negative.
        """
        check_int("epoch", epoch, 0)
        perm = self._perms.get(epoch)
        if perm is not None:
            self._perms.move_to_end(epoch)
            return perm
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) & 0xFFFF_FFFF_FFFF_FFFF)
        perm = torch.randperm(self.num_samples, generator=g)
        self._perms[epoch] = perm
        while len(self._perms) > self._CACHED_EPOCHS:
            self._perms.popitem(last=False)
        return perm

    def batch_indices(self, learner: int, epoch: int, step: int) -> Tensor:
        """Sample indices of ``learner``'s minibatch at (``epoch``, ``step``): int64 ``[b]``.

        Raises:
            ValueError: ``learner`` not in ``[0, λ)``, ``step`` not in
                ``[0, steps_per_epoch)`` or ``epoch`` negative.
        """
        if not isinstance(learner, int) or not 0 <= learner < self.num_learners:
            raise ValueError(f"learner = {learner!r} is not in [0, {self.num_learners})")
        if not isinstance(step, int) or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step = {step!r} is not in [0, {self.steps_per_epoch})")
        start = step * self.global_batch + learner * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size].clone()


class LearnerStream:
    """One learner's position in a :class:`ShardedSampler`.

    Attributes:
        epoch: epoch of the next minibatch (starts at 0).
        step: step within that epoch of the next minibatch, in ``[0, steps_per_epoch)``.
    """

    def __init__(self, sampler: ShardedSampler, learner: int) -> None:
        """Raises ValueError if ``learner`` is not in ``[0, sampler.num_learners)``."""
        if not isinstance(learner, int) or not 0 <= learner < sampler.num_learners:
            raise ValueError(f"learner = {learner!r} is not in [0, {sampler.num_learners})")
        self.sampler = sampler
        self.learner = learner
        self.epoch = 0
        self.step = 0

    def next_indices(self) -> Tensor:
        """Indices of the next minibatch, int64 ``[b]``; advances to the next step/epoch."""
        idx = self.sampler.batch_indices(self.learner, self.epoch, self.step)
        self.step += 1
        if self.step == self.sampler.steps_per_epoch:
            self.step = 0
            self.epoch += 1
        return idx

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": int, "step": int, "batch_size": int}``: the position of the next
        minibatch and the batch b it steps by."""
        return {"epoch": self.epoch, "step": self.step, "batch_size": self.sampler.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`. A position saved at another
        batch b' (same λ; a run continued with another batch) becomes the first step of
        this batch b at or after the same sample offset of its epoch's permutation (step
        s starts at ``s · λ · b'``), the next epoch's first where none is left in this
        one: no sample of the epoch is drawn twice, and where b does not divide the
        offset fewer than λ · b of it are skipped.

        Raises:
            ValueError: a key is missing, or ``epoch`` < 0, or ``step`` is not in
                ``[0, steps_per_epoch)`` (e.g. a checkpoint of another batch layout).
        """
        for key in ("epoch", "step"):
            if key not in state:
                raise ValueError(f"learner stream state has no {key!r}: {state!r}")
        epoch, step = int(state["epoch"]), int(state["step"])
        saved_b, b = int(state.get("batch_size", self.sampler.batch_size)), self.sampler.batch_size
        if saved_b != b and step >= 0:
            step = -(-step * saved_b // b)  # ceil: the first step at or after the offset
            if step >= self.sampler.steps_per_epoch:
                epoch, step = epoch + 1, 0
        if epoch < 0 or not 0 <= step < self.sampler.steps_per_epoch:
            raise ValueError(
                f"learner stream state {state!r} is not a position of this sampler "
                f"({self.sampler.steps_per_epoch} steps per epoch)"
            )
        self.epoch, self.step = epoch, step


def iter_eval_batches(x: Tensor, y: Tensor, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Consecutive ``(x[i:i+B], y[i:i+B])`` slices covering every sample exactly once.

    Args:
        x: ``[M, ...]`` inputs.
        y: ``[M]`` labels.
        batch_size: B >= 1; the last batch holds the remaining ``M mod B`` samples if any.

    Raises:
        ValueError: ``batch_size`` < 1 or ``x`` and ``y`` differ in length.
    """
    check_int("train.eval_batch_size", batch_size, 1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{x.shape[0]} inputs but {y.shape[0]} labels")
    return _slices(x, y, batch_size)


def _slices(x: Tensor, y: Tensor, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for start in range(0, x.shape[0], batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]


def reshard_streams(
    old: LearnerStream | list[LearnerStream], num_learners: int, learners: list[int]
) -> tuple[ShardedSampler, list[LearnerStream]]:
    """The data streams of ``learners`` after λ changes to ``num_learners``: at a
    synchronisation point (the replicas-per-device auto-tuner, Crossbow §4.3) or when a
    learner joins or leaves a parameter server (docs/elastic.md).

    ``old`` is a stream of the old layout, or every stream of it (asynchronous learners
    stand at different positions: the furthest counts, in the latest epoch any is in).
    The epoch permutation does not depend on λ, so the new layout continues at its first
    step that starts at or after the samples already drawn this epoch (none is drawn
    twice; at most λ·b − 1 are skipped, and what a stream lagging behind the furthest one
    left undrawn this epoch), the next epoch if none is left.

    Raises:
        ValueError: λ·b exceeds the training set, or a learner is not in ``[0, λ)``.
    """
    olds = old if isinstance(old, list) else [old]
    prev = olds[0].sampler
    epoch = max(s.epoch for s in olds)
    drawn = max(s.step for s in olds if s.epoch == epoch) * prev.global_batch
    sampler = ShardedSampler(prev.num_samples, num_learners, prev.batch_size, prev.seed)
    step = -(-drawn // sampler.global_batch)
    if step >= sampler.steps_per_epoch:
        epoch, step = epoch + 1, 0
    streams = [LearnerStream(sampler, lrn) for lrn in learners]
    for st in streams:
        st.epoch, st.step = epoch, step
    return sampler, streams


class ElasticShards:
    """A parameter server's view of where each active learner draws its next minibatch,
    kept so that learners joining or leaving a running run re-shard without drawing a
    sample twice in an epoch (docs/elastic.md).

    A learner draws one minibatch each time it receives weights; the server counts that
    draw when it sends them (:meth:`draw`), so a learner's stream here is at its next
    draw after the one in flight. At a change (:meth:`reshard`) the active learners get
    the layout :func:`reshard_streams` gives for the new λ from these streams; each
    learner takes its new position with its next weights, hence before its next draw.

    Args:
        sampler: the starting layout (λ learners, worker w in slot w).
        drawn: minibatches worker w has drawn so far (its pushes, e.g. from a checkpoint),
            one entry per worker of ``sampler``.

    Raises:
        ValueError: ``drawn`` does not hold one count >= 0 per learner of ``sampler``.
    """

    def __init__(self, sampler: ShardedSampler, drawn: list[int]) -> None:
        if len(drawn) != sampler.num_learners or any(d < 0 for d in drawn):
            raise ValueError(
                f"drawn = {drawn!r} is not allowed: expected {sampler.num_learners} counts >= 0"
            )
        self.streams: dict[int, LearnerStream] = {}
        for w, d in enumerate(drawn):
            st = self.streams[w] = LearnerStream(sampler, w)
            st.epoch, st.step = divmod(d, sampler.steps_per_epoch)

    @classmethod
    def at(
        cls,
        num_samples: int,
        batch_size: int,
        seed: int,
        positions: dict[int, tuple[int, int, int, int]],
    ) -> ElasticShards:
        """The shards with worker w at ``positions[w] = (λ, slot, epoch, step)`` (as
        :meth:`positions` gave them, e.g. from a checkpoint).

        Raises:
            ValueError: no position, or one that is not a position of its layout.
        """
        if not positions:
            raise ValueError("positions = {} is not allowed: expected at least one worker")
        shards = cls.__new__(cls)
        shards.streams = {}
        for w, (lam, slot, epoch, step) in positions.items():
            st = LearnerStream(ShardedSampler(num_samples, lam, batch_size, seed), slot)
            st.load_state_dict({"epoch": epoch, "step": step})
            shards.streams[int(w)] = st
        return shards

    def positions(self) -> dict[int, tuple[int, int, int, int]]:
        """Each worker's next draw ``(λ, slot, epoch, step)``."""
        return {
            w: (st.sampler.num_learners, st.learner, st.epoch, st.step)
            for w, st in self.streams.items()
        }

    def fits(self, num_learners: int) -> bool:
        """Whether ``num_learners`` learners fit the training set: λ·b <= N."""
        sampler = next(iter(self.streams.values())).sampler
        return num_learners * sampler.batch_size <= sampler.num_samples

    @property
    def num_samples(self) -> int:
        """The training samples N the learners share."""
        return next(iter(self.streams.values())).sampler.num_samples

    def draw(self, worker: int) -> None:
        """Count one minibatch drawn by ``worker`` (the server sent it weights)."""
        st = self.streams[worker]
        st.step += 1
        if st.step == st.sampler.steps_per_epoch:
            st.epoch, st.step = st.epoch + 1, 0

    def reshard(self, active: list[int]) -> dict[int, tuple[int, int, int, int]]:
        """Re-shard for the workers ``active`` (in slot order; a joiner among them, a
        leaver not): returns each one's new position ``(λ, slot, epoch, step)``, the
        next minibatch it draws being ``ShardedSampler(N, λ, b, seed).batch_indices(slot,
        epoch, step)``; the streams here follow.

        Raises:
            ValueError: ``active`` is empty, or λ·b exceeds the training set.
        """
        if not active:
            raise ValueError("active = [] is not allowed: expected at least one worker")
        _, streams = reshard_streams(
            list(self.streams.values()), len(active), list(range(len(active)))
        )
        self.streams = dict(zip(active, streams, strict=True))
        return {w: (len(active), st.learner, st.epoch, st.step) for w, st in self.streams.items()}
