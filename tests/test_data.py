"""Datasets (IDX, CIFAR-10 batches, synthetic), sharding and evaluation batches."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distsgd.config import DataConfig
from distsgd.data import (
    DATA_DIR_ENV,
    DEFAULT_ROOTS,
    DatasetError,
    LearnerStream,
    ShardedSampler,
    iter_eval_batches,
    keep_loaded,
    load_dataset,
    resolve_root,
)

IDX_NAMES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


# ---- helpers -------------------------------------------------------------------------------


def idx_bytes(magic: int, arr: np.ndarray) -> bytes:
    """An IDX file: big-endian magic, one big-endian uint32 per dimension, uint8 data."""
    return struct.pack(f">{1 + arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()


def write_file(path: Path, data: bytes, gz: bool) -> Path:
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def write_idx_dataset(
    root: Path, n_train: int = 20, n_test: int = 7, gz: bool = True, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for key, arr in arrays.items():
        magic = 2051 if key.endswith("images") else 2049
        write_file(root / IDX_NAMES[key], idx_bytes(magic, arr), gz)
    return arrays


def normalised(raw: np.ndarray, train_raw: np.ndarray) -> np.ndarray:
    """Reference normalisation in float64: per channel, with the training statistics."""
    axes = (0, 2, 3)
    mean = train_raw.astype(np.float64).mean(axis=axes, keepdims=True)
    std = train_raw.astype(np.float64).std(axis=axes, keepdims=True)
    return (raw.astype(np.float64) - mean) / std


# ---- IDX -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arrays = write_idx_dataset(tmp_path, gz=gz)
    ds = load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    assert ds.name == "mnist" and ds.num_classes == 10
    assert ds.train_x.shape == (20, 1, 28, 28) and ds.test_x.shape == (7, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert ds.input_shape == (1, 28, 28) and ds.num_train == 20 and ds.num_test == 7
    train_raw = arrays["train_images"][:, None]
    # float32 arithmetic on values of magnitude < 10: 1e-5 absolute is ~100 ulps.
    np.testing.assert_allclose(ds.train_x.numpy(), normalised(train_raw, train_raw), atol=1e-5)
    np.testing.assert_allclose(
        ds.test_x.numpy(), normalised(arrays["test_images"][:, None], train_raw), atol=1e-5
    )
    assert ds.train_y.tolist() == arrays["train_labels"].tolist()
    assert ds.test_y.tolist() == arrays["test_labels"].tolist()


def test_gzip_files_are_unpacked_once_per_process_until_they_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a process that trains many runs (a pooled rank, --tune's probes) gunzips them once
    unpacked = []
    real = gzip.decompress
    monkeypatch.setattr(gzip, "decompress", lambda raw: unpacked.append(1) or real(raw))
    write_idx_dataset(tmp_path, seed=1)
    cfg = DataConfig(dataset="mnist", root=str(tmp_path))
    first = load_dataset(cfg)
    assert len(unpacked) == 4
    want = first.train_x.clone()
    first.train_x.add_(100.0)  # a run that changes its tensors does not change the next's
    again = load_dataset(cfg)
    assert len(unpacked) == 4 and torch.equal(again.train_x, want)
    # rewritten at once (same sizes, maybe the same mtime; random pixels are stored blocks,
    # whose whole-file CRC-32 is the same for any content): read anew, the new values
    changed = write_idx_dataset(tmp_path, seed=2)
    third = load_dataset(cfg)
    assert len(unpacked) == 8
    assert third.train_y.tolist() == changed["train_labels"].tolist()
    assert not torch.equal(third.train_x, want)


def test_keep_loaded_reads_a_builtin_data_set_once_per_block(tmp_path: Path) -> None:
    # a pooled rank or --tune on sim trains many runs: inside keep_loaded() the files are
    # read and normalised once (per name and directory); outside, every load reads anew
    write_idx_dataset(tmp_path / "a", seed=1)
    write_idx_dataset(tmp_path / "b", seed=2)
    cfg_a = DataConfig(dataset="mnist", root=str(tmp_path / "a"))
    cfg_b = DataConfig(dataset="mnist", root=str(tmp_path / "b"))
    assert load_dataset(cfg_a).train_x is not load_dataset(cfg_a).train_x
    with keep_loaded():
        first = load_dataset(cfg_a)
        with keep_loaded():  # nested blocks share the outermost one's data sets
            assert load_dataset(cfg_a).train_x is first.train_x
        assert load_dataset(cfg_a).test_y is first.test_y
        other = load_dataset(cfg_b)
        assert not torch.equal(other.train_x, first.train_x)
        assert load_dataset(DataConfig(dataset="fashion_mnist", root=str(tmp_path / "a"))).name
    assert load_dataset(cfg_a).train_x is not first.train_x  # dropped with the block
    assert torch.equal(load_dataset(cfg_a).train_x, first.train_x)


def test_root_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert resolve_root(DataConfig(dataset="fashion_mnist")) == Path(DEFAULT_ROOTS["fashion_mnist"])
    assert resolve_root(DataConfig(dataset="mnist")) == Path("/usr/share/datasets/mnist")
    assert resolve_root(DataConfig(dataset="cifar10")) == Path(
        "/usr/share/datasets/cifar-10-batches-py"
    )
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "env"))
    assert resolve_root(DataConfig(dataset="mnist")) == tmp_path / "env"
    explicit = DataConfig(dataset="mnist", root=str(tmp_path / "cfg"))
    assert resolve_root(explicit) == tmp_path / "cfg"


def test_env_dir_is_used_for_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_idx_dataset(tmp_path, n_train=5, n_test=3)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert load_dataset(DataConfig(dataset="fashion_mnist")).num_train == 5


def test_missing_directory_names_path_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="fashion_mnist", root=str(missing)))
    msg = str(info.value)
    assert str(missing) in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "data.root" in msg and DATA_DIR_ENV in msg


def test_missing_file_names_path_and_fix(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="fashion_mnist", root=str(tmp_path)))
    msg = str(info.value)
    assert str(tmp_path / "t10k-labels-idx1-ubyte.gz") in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg


def test_truncated_gzip_is_reported_as_corrupt(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="fashion_mnist", root=str(tmp_path)))
    msg = str(info.value)
    assert str(path) in msg and "corrupt" in msg and "re-install" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_garbage_gzip_is_reported_as_corrupt(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(b"this is not gzip data at all")
    with pytest.raises(DatasetError, match="corrupt") as info:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    assert str(path) in str(info.value) and "re-download" in str(info.value)


def test_wrong_magic_number(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path)
    path = write_file(
        tmp_path / IDX_NAMES["train_labels"], idx_bytes(2051, arrays["train_labels"]), gz=True
    )
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    msg = str(info.value)
    assert str(path) in msg and "corrupt" in msg and "magic number 2051" in msg


def test_wrong_data_size(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path)
    data = idx_bytes(2051, arrays["test_images"])[:-5]
    path = write_file(tmp_path / IDX_NAMES["test_images"], data, gz=True)
    with pytest.raises(DatasetError, match="corrupt") as info:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    assert str(path) in str(info.value)


def test_image_label_count_mismatch(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path)
    path = write_file(
        tmp_path / IDX_NAMES["train_labels"], idx_bytes(2049, arrays["train_labels"][:-1]), gz=True
    )
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    msg = str(info.value)
    assert str(path) in msg and "19 labels for the 20 images" in msg


def test_label_out_of_range(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path)
    labels = arrays["test_labels"].copy()
    labels[2] = 10
    path = write_file(tmp_path / IDX_NAMES["test_labels"], idx_bytes(2049, labels), gz=False)
    (tmp_path / (IDX_NAMES["test_labels"] + ".gz")).unlink()
    with pytest.raises(DatasetError, match="label 10") as info:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))
    assert str(path) in str(info.value)


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Fashion-MNIST is not installed")
def test_real_fashion_mnist() -> None:
    ds = load_dataset(DataConfig(dataset="fashion_mnist", root=str(FASHION_DIR)))
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_y.shape == (60000,) and ds.test_y.shape == (10000,)
    assert int(ds.train_y.min()) == 0 and int(ds.train_y.max()) == 9
    assert int(ds.test_y.min()) == 0 and int(ds.test_y.max()) == 9
    # Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
    assert ds.train_y.bincount().tolist() == [6000] * 10
    assert ds.test_y.bincount().tolist() == [1000] * 10
    # Normalised with the training statistics (float32 sums over 47M values).
    assert abs(float(ds.train_x.mean())) < 1e-3 and abs(float(ds.train_x.std()) - 1) < 1e-3


# ---- CIFAR-10 ------------------------------------------------------------------------------


def write_cifar(root: Path, per_batch: int = 4, n_test: int = 3, protocol: int = 2) -> dict:
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", n_test)]:
        batch = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, n).tolist(),
            b"filenames": [f"{name}_{i}.png".encode() for i in range(n)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=protocol))
        batches[name] = batch
    return batches


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10_batches(tmp_path: Path, protocol: int) -> None:
    batches = write_cifar(tmp_path, protocol=protocol)
    ds = load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)))
    assert ds.train_x.shape == (20, 3, 32, 32) and ds.test_x.shape == (3, 3, 32, 32)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    train_raw = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)]).reshape(
        -1, 3, 32, 32
    )
    test_raw = batches["test_batch"][b"data"].reshape(-1, 3, 32, 32)
    # float32 arithmetic on values of magnitude < 10: 1e-5 absolute is ~100 ulps.
    np.testing.assert_allclose(ds.train_x.numpy(), normalised(train_raw, train_raw), atol=1e-5)
    np.testing.assert_allclose(ds.test_x.numpy(), normalised(test_raw, train_raw), atol=1e-5)
    labels = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert ds.train_y.tolist() == labels
    assert ds.test_y.tolist() == batches["test_batch"][b"labels"]


def test_cifar10_missing_batch(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DatasetError) as info:
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)))
    assert str(tmp_path / "data_batch_3") in str(info.value)


def test_cifar10_corrupt_batch(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    path = tmp_path / "test_batch"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DatasetError, match="corrupt") as info:
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)))
    assert str(path) in str(info.value)


class _MakesDirectory:
    """A pickle payload that would create a directory when loaded by plain pickle."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_cifar10_refuses_code_in_pickle(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    marker = tmp_path / "marker"
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": _MakesDirectory(str(marker))}))
    with pytest.raises(DatasetError, match="not allowed"):
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)))
    assert not marker.exists()


# ---- synthetic -----------------------------------------------------------------------------


def test_synthetic_is_deterministic() -> None:
    cfg = DataConfig(dataset="synthetic", num_train=256, num_test=64, noise=1.0)
    a, b = load_dataset(cfg, seed=3), load_dataset(cfg, seed=3)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    c = load_dataset(cfg, seed=4)
    assert not torch.equal(a.train_x, c.train_x)
    assert a.train_x.shape == (256, 1, 28, 28) and a.test_x.shape == (64, 1, 28, 28)
    assert a.train_x.dtype == torch.float32 and a.train_y.dtype == torch.int64
    assert a.num_classes == 10 and 0 <= int(a.train_y.min()) and int(a.train_y.max()) <= 9
    # Normalised with the training statistics (float32 over 200k values).
    assert abs(float(a.train_x.mean())) < 1e-4 and abs(float(a.train_x.std()) - 1) < 1e-3


def test_synthetic_test_set_does_not_depend_on_num_train() -> None:
    small = load_dataset(DataConfig(dataset="synthetic", num_train=64, num_test=32), seed=0)
    large = load_dataset(DataConfig(dataset="synthetic", num_train=128, num_test=32), seed=0)
    assert torch.equal(small.test_y, large.test_y)
    assert torch.equal(small.train_y, large.train_y[:64])


def test_synthetic_is_learnable_by_a_small_mlp() -> None:
    ds = load_dataset(DataConfig(dataset="synthetic", num_train=2048, num_test=512), seed=0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = ShardedSampler(ds.num_train, 1, 64, seed=0)
    stream = LearnerStream(sampler, 0)
    for _ in range(2 * sampler.steps_per_epoch):
        idx = stream.next_indices()
        loss = F.cross_entropy(net(ds.train_x[idx]), ds.train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (net(ds.test_x).argmax(1) == ds.test_y).float().mean().item()
    assert acc > 0.6  # chance is 0.1


# ---- sharding ------------------------------------------------------------------------------


def test_union_of_learners_equals_single_large_batch() -> None:
    n, lam, b = 1000, 4, 8
    multi = ShardedSampler(n, lam, b, seed=7)
    single = ShardedSampler(n, 1, lam * b, seed=7)
    assert multi.steps_per_epoch == single.steps_per_epoch == 1000 // 32
    for epoch in (0, 1, 5):
        for step in range(multi.steps_per_epoch):
            union = torch.cat([multi.batch_indices(lr, epoch, step) for lr in range(lam)])
            assert torch.equal(union, single.batch_indices(0, epoch, step))


def test_shards_are_disjoint_within_an_epoch() -> None:
    sampler = ShardedSampler(1000, 4, 8, seed=0)
    drawn = torch.cat(
        [
            sampler.batch_indices(learner, 2, step)
            for step in range(sampler.steps_per_epoch)
            for learner in range(4)
        ]
    )
    assert drawn.numel() == sampler.samples_per_epoch == 992
    assert drawn.unique().numel() == drawn.numel()
    assert int(drawn.min()) >= 0 and int(drawn.max()) < 1000


def test_epoch_orders_differ_and_seed_reproduces() -> None:
    a = ShardedSampler(500, 2, 10, seed=1)
    b = ShardedSampler(500, 2, 10, seed=1)
    c = ShardedSampler(500, 2, 10, seed=2)
    assert not torch.equal(a.permutation(0), a.permutation(1))
    assert torch.equal(a.permutation(0), b.permutation(0))
    assert torch.equal(a.permutation(3), b.permutation(3))
    assert not torch.equal(a.permutation(0), c.permutation(0))
    assert torch.equal(a.permutation(0).sort().values, torch.arange(500))


def test_permutation_recomputed_after_eviction() -> None:
    sampler = ShardedSampler(300, 1, 10, seed=5)
    first = sampler.permutation(0).clone()
    for epoch in (1, 2, 3):
        sampler.permutation(epoch)
    assert torch.equal(sampler.permutation(0), first)


def test_steps_per_epoch_and_too_large_batch() -> None:
    assert ShardedSampler(1000, 3, 32, seed=0).steps_per_epoch == 1000 // 96
    assert ShardedSampler(96, 3, 32, seed=0).steps_per_epoch == 1
    with pytest.raises(ValueError, match="protocol.batch_size = 32.*protocol.num_learners = 4"):
        ShardedSampler(100, 4, 32, seed=0)


def test_batch_indices_rejects_bad_positions() -> None:
    sampler = ShardedSampler(100, 2, 10, seed=0)
    with pytest.raises(ValueError, match="learner"):
        sampler.batch_indices(2, 0, 0)
    with pytest.raises(ValueError, match="step"):
        sampler.batch_indices(0, 0, 5)
    with pytest.raises(ValueError, match="epoch"):
        sampler.batch_indices(0, -1, 0)


def test_learner_stream_walks_epochs_and_round_trips() -> None:
    sampler = ShardedSampler(100, 2, 10, seed=0)  # 5 steps per epoch
    stream = LearnerStream(sampler, learner=1)
    for step in range(5):
        assert torch.equal(stream.next_indices(), sampler.batch_indices(1, 0, step))
    assert stream.state_dict() == {"epoch": 1, "step": 0, "batch_size": 10}
    stream.next_indices()
    stream.next_indices()
    saved = stream.state_dict()
    assert saved == {"epoch": 1, "step": 2, "batch_size": 10}
    expected = [stream.next_indices() for _ in range(6)]
    restored = LearnerStream(sampler, learner=1)
    restored.load_state_dict(saved)
    assert (restored.epoch, restored.step) == (1, 2)
    for want in expected:
        assert torch.equal(restored.next_indices(), want)
    with pytest.raises(ValueError, match="not a position"):
        restored.load_state_dict({"epoch": 0, "step": 5})
    with pytest.raises(ValueError, match="learner"):
        LearnerStream(sampler, learner=2)


# ---- evaluation batches --------------------------------------------------------------------


@pytest.mark.parametrize(("m", "batch"), [(103, 10), (100, 10), (7, 50), (1, 1)])
def test_eval_batches_cover_every_sample_once(m: int, batch: int) -> None:
    x = torch.arange(m, dtype=torch.float32).view(m, 1, 1, 1)
    y = torch.arange(m)
    parts = list(iter_eval_batches(x, y, batch))
    assert len(parts) == -(-m // batch)
    assert all(px.shape[0] == py.shape[0] <= batch for px, py in parts)
    assert torch.equal(torch.cat([py for _, py in parts]), y)
    assert torch.equal(torch.cat([px for px, _ in parts]), x)


def test_eval_batches_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="eval_batch_size"):
        iter_eval_batches(torch.zeros(3, 1), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="labels"):
        iter_eval_batches(torch.zeros(3, 1), torch.zeros(4), 2)
