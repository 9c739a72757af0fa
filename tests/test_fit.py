"""The trained model back: ``model.pt`` in every run, ``distsgd export`` and
``distsgd.fit`` with the user's own module (with BatchNorm) and data.

Every check of a metric evaluates the returned or saved model in this process exactly as
the run's evaluation did — the same weights, the same BatchNorm buffers, the same batches
of ``train.eval_batch_size`` samples, one thread — so accuracies (counts of right
predictions over the evaluation set) are compared exactly unless a comment says why not.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import TensorDataset

import distsgd
from distsgd.api import export_model
from distsgd.cli import main as cli_main
from distsgd.config import ConfigError, RunConfig
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine, bn_recalibration_inputs
from distsgd.metrics import read_metrics, save_checked
from distsgd.models import model_from_config
from distsgd.runtime import factory
from distsgd.runtime.sim import TrainingDiverged
from distsgd.trainer import Trainer
from tests.conftest import small_config

NUM_FEATURES, NUM_CLASSES = 8, 3


# ---- the user's project: a tabular model with BatchNorm and its data -------------------------
class TabularNet(nn.Module):
    """A user's classifier of ``[B, 8]`` features into 3 classes, with BatchNorm."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def make_net(hidden: int = 16) -> nn.Module:
    """Model factory by import path: ``tests.test_fit:make_net``."""
    return TabularNet(hidden)


def blobs(num_samples: int, seed: int) -> tuple[Tensor, Tensor]:
    """Three overlapping Gaussian classes (means fixed, samples drawn from ``seed``)."""
    means = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, NUM_CLASSES, (num_samples,), generator=g)
    x = means[y] + 1.5 * torch.randn(num_samples, NUM_FEATURES, generator=g)
    return x, y


class Pairs(TorchDataset):
    """A map-style data set of ``(features [8], label)`` items."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def make_data(num_train: int = 512, num_test: int = 200) -> tuple[TensorDataset, Pairs]:
    """Data factory by import path: ``tests.test_fit:make_data``."""
    return TensorDataset(*blobs(num_train, 1)), Pairs(*blobs(num_test, 2))


def error_rate(outputs: Tensor, targets: Tensor) -> Tensor:
    """A user metric (direction min): the batch's fraction of wrong predictions."""
    return (outputs.argmax(-1) != targets).float().mean()


# ---- helpers ---------------------------------------------------------------------------------
def fit_config(protocol: dict, **train) -> RunConfig:
    """A small run: 2 epochs of 512 samples, an evaluation every 256, one thread."""
    t = {"max_epochs": 2, "eval_every_samples": 256, "tensorboard": False, **train}
    return small_config(protocol=protocol, train=t)


def accuracy_of(model: nn.Module, x: Tensor, y: Tensor, batch_size: int, num_ranks: int = 1):
    """Right predictions / samples of ``model`` in eval mode, in batches of
    ``batch_size`` as the run evaluates (on ``num_ranks`` ranks: each a contiguous
    slice of the evaluation set, cut into its own batches)."""
    model.eval()
    correct, n = 0, len(y)
    with torch.no_grad():
        for r in range(num_ranks):
            lo, hi = n * r // num_ranks, n * (r + 1) // num_ranks
            for start in range(lo, hi, batch_size):
                stop = min(start + batch_size, hi)
                correct += int((model(x[start:stop]).argmax(-1) == y[start:stop]).sum())
    return correct / n


def load_state(path: Path) -> dict[str, Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_state(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def module_of_run(run: Path) -> nn.Module:
    """A fresh module of the run's model (from its config.toml) with model.pt loaded."""
    cfg = RunConfig.from_toml(run / "config.toml")
    model = model_from_config(cfg.model)
    model.load_state_dict(load_state(run / "model.pt"))
    return model.eval()


# ---- the engine's state_dict -----------------------------------------------------------------
def test_state_dict_at_places_the_weights_and_copies_the_buffers():
    torch.manual_seed(0)
    engine = GradientEngine(TabularNet())
    weights = torch.randn(engine.num_parameters)
    before = engine.initial_weights()
    state = engine.state_dict_at(weights)
    fresh = TabularNet()
    fresh.load_state_dict(state)  # strict: every key of the module, nothing else
    flat = torch.cat([p.detach().reshape(-1) for p in fresh.parameters()])
    assert torch.equal(flat, weights)
    own = dict(engine.model.named_buffers())
    assert all(torch.equal(state[k], own[k]) for k in own)
    state["body.1.running_mean"].add_(1.0)  # a copy: the engine's buffer is untouched
    assert torch.equal(own["body.1.running_mean"], torch.zeros(16))
    assert torch.equal(engine.initial_weights(), before)  # the engine's weights too
    with pytest.raises(ValueError, match=r"do not fit the model: expected \["):
        engine.state_dict_at(weights[:-1])


# ---- model.pt of a run -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "hardsync", "num_learners": 2, "batch_size": 16},
        # the central model on the server, not any learner's weights
        {"name": "parameter_server", "num_learners": 4, "softsync": 4, "batch_size": 16},
    ],
    ids=["hardsync", "parameter_server"],
)
def test_model_pt_reproduces_the_final_metric_and_export_writes_it(tmp_path, protocol):
    cfg = fit_config(protocol, save_eval_weights=True)
    run = tmp_path / "run"
    summary = distsgd.train(cfg, out_dir=run)
    records = read_metrics(run / "metrics.jsonl")
    assert summary["final_metric"] == records[-1]["eval_metric"]
    model = module_of_run(run)
    data = load_dataset(cfg.data, seed=cfg.train.seed)
    acc = accuracy_of(model, data.test_x, data.test_y, cfg.train.eval_batch_size)
    assert acc == summary["final_metric"]
    # the weights are those of the last evaluation (eval_weights/NNNN.pt, the central model)
    evaluated = torch.load(run / "eval_weights" / f"{len(records) - 1:04d}.pt", weights_only=True)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), evaluated)
    # distsgd export writes the same state from checkpoint.pt
    assert cli_main(["export", str(run), "--out", str(tmp_path / "exported.pt")]) == 0
    assert_same_state(load_state(tmp_path / "exported.pt"), load_state(run / "model.pt"))
    assert (tmp_path / "exported.pt.sha256").exists()


def test_model_pt_holds_the_central_models_recalibrated_batchnorm_statistics(tmp_path):
    """SMA with BatchNorm: the buffers in model.pt are the statistics the evaluation
    recomputed for the central model, not those the replicas' forwards left behind."""
    protocol = {"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 16}
    cfg = fit_config(protocol, bn_recalibration_samples=128)
    result = distsgd.fit(
        "tests.test_fit:make_net",
        "tests.test_fit:make_data",
        config=cfg,
        out_dir=tmp_path / "run",
        progress=False,
    )
    state = load_state(tmp_path / "run" / "model.pt")
    engine = GradientEngine(make_net())
    engine.model.load_state_dict(state)
    saved = engine.buffers_state()
    data = load_dataset(
        RunConfig.from_toml(tmp_path / "run" / "config.toml").data, seed=cfg.train.seed
    )
    recalibration = bn_recalibration_inputs(data, 128, cfg.train.eval_batch_size, cfg.train.seed)
    engine.recalibrate(engine.initial_weights(), *recalibration)
    # the same computation on the same inputs in this process: equal bit for bit
    assert_same_state(engine.buffers_state(), saved)
    assert not torch.equal(saved["body.1.running_mean"], torch.zeros(16))
    assert_same_state(result.model.state_dict(), state)


def test_a_diverged_run_keeps_the_last_evaluated_model(tmp_path):
    cfg = small_config(
        protocol={"name": "parameter_server", "num_learners": 2, "mode": "async"},
        optimizer={"lr": 1000.0, "momentum": 0.0},  # the largest lr allowed
        # no checkpoint before the end: the diverged path itself writes model.pt
        train={"eval_every_samples": 64, "checkpoint_every_evals": 0},
    )
    with pytest.raises(TrainingDiverged):
        Trainer(cfg, tmp_path / "r", progress=False).run()
    run = tmp_path / "r"
    assert not (run / "checkpoint.pt").exists()
    state = load_state(run / "model.pt")
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    model = module_of_run(run)
    data = load_dataset(cfg.data, seed=cfg.train.seed)
    last = read_metrics(run / "metrics.jsonl")[-1]["eval_metric"]
    assert accuracy_of(model, data.test_x, data.test_y, cfg.train.eval_batch_size) == last


def test_a_run_without_evaluation_saves_its_final_weights(tmp_path):
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": 32}, evaluate=False)
    summary = distsgd.train(cfg, out_dir=tmp_path / "r")
    assert summary["final_metric"] is None
    model = module_of_run(tmp_path / "r")
    final = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["protocol"]["weights"]
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), final)


# ---- distsgd export: bad input ---------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": 32}, max_epochs=1)
    distsgd.train(cfg, out_dir=run)
    return run


def _copy_run(run: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("config.toml", "checkpoint.pt", "checkpoint.pt.sha256", "summary.json"):
        (dest / name).write_bytes((run / name).read_bytes())
    return dest


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distsgd: error: "), err
    assert "Traceback" not in err and not out
    return lines[0]


def test_export_writes_model_pt_into_the_run_by_default(tmp_path, finished_run, capsys):
    run = _copy_run(finished_run, tmp_path / "r")  # without model.pt
    assert cli_main(["export", str(run)]) == 0
    assert f"model written to {run / 'model.pt'}" in capsys.readouterr().out
    assert_same_state(load_state(run / "model.pt"), load_state(finished_run / "model.pt"))


def test_a_checkpoint_before_export_still_resumes(tmp_path, finished_run):
    run = _copy_run(finished_run, tmp_path / "r")
    (run / "metrics.jsonl").write_bytes((finished_run / "metrics.jsonl").read_bytes())
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["eval_model"]
    save_checked(state, run / "checkpoint.pt")
    summary = distsgd.train(resume=run, overrides=["train.max_epochs=1.5"])
    assert summary["status"] == "completed" and summary["epochs"] == 1.5
    model = module_of_run(run)
    cfg = RunConfig.from_toml(run / "config.toml")
    data = load_dataset(cfg.data, seed=cfg.train.seed)
    acc = accuracy_of(model, data.test_x, data.test_y, cfg.train.eval_batch_size)
    assert acc == summary["final_metric"]


def test_export_of_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    line = _one_line_exit_2(["export", str(tmp_path)], capsys)
    assert "is not a run directory (it has no config.toml)" in line
    assert not (tmp_path / "model.pt").exists()


def test_export_without_a_checkpoint_is_one_line(tmp_path, finished_run, capsys):
    run = _copy_run(finished_run, tmp_path / "r")
    (run / "checkpoint.pt").unlink()
    line = _one_line_exit_2(["export", str(run)], capsys)
    assert "checkpoint.pt does not exist" in line
    assert not (run / "model.pt").exists()


def test_export_of_a_checkpoint_before_export_is_one_line(tmp_path, finished_run, capsys):
    run = _copy_run(finished_run, tmp_path / "r")
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["eval_model"]
    save_checked(state, run / "checkpoint.pt")
    line = _one_line_exit_2(["export", str(run)], capsys)
    assert "predates distsgd export (it holds no evaluated model)" in line


def test_export_when_the_factory_no_longer_imports_is_one_line(tmp_path, finished_run, capsys):
    run = _copy_run(finished_run, tmp_path / "r")
    cfg = RunConfig.from_toml(run / "config.toml")
    gone = cfg.model.__class__(factory="no_such_package.models:build")
    (run / "config.toml").write_text(cfg.replace(model=gone).to_toml())
    line = _one_line_exit_2(["export", str(run), "--out", str(tmp_path / "m.pt")], capsys)
    assert "model.factory = 'no_such_package.models:build' does not import" in line
    assert not (tmp_path / "m.pt").exists()


def test_export_of_a_corrupt_checkpoint_is_one_line(tmp_path, finished_run, capsys):
    run = _copy_run(finished_run, tmp_path / "r")
    data = bytearray((run / "checkpoint.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run / "checkpoint.pt").write_bytes(bytes(data))
    line = _one_line_exit_2(["export", str(run)], capsys)
    assert "does not match its checksum" in line


def test_export_to_a_directory_is_one_line(tmp_path, finished_run, capsys):
    line = _one_line_exit_2(["export", str(finished_run), "--out", str(tmp_path)], capsys)
    assert "is a directory: expected a file name" in line


# ---- distsgd.fit -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "hardsync", "num_learners": 2, "batch_size": 16},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 16},
        {"name": "parameter_server", "num_learners": 2, "softsync": 1, "batch_size": 16},
    ],
    ids=["hardsync", "sma", "parameter_server"],
)
def test_fit_with_objects_returns_the_evaluated_model(tmp_path, protocol):
    torch.manual_seed(3)
    net = TabularNet()
    untouched = copy.deepcopy(net.state_dict())
    x_train, y_train = blobs(512, 1)
    x_test, y_test = blobs(200, 2)
    result = distsgd.fit(
        net,
        TensorDataset(x_train, y_train),
        Pairs(x_test, y_test),  # map-style: items collated into batches
        config=fit_config(protocol),
        out_dir=tmp_path / "run",
        progress=False,
    )
    assert_same_state(net.state_dict(), untouched)  # the user's instance is not trained
    model = result.model
    assert type(model) is TabularNet and model is not net and not model.training
    assert result.run_dir == tmp_path / "run" and result.summary["model"] == "(object)"
    # config.toml says its [model] and [data] did not train (it named the default cnn)
    head = (result.run_dir / "config.toml").read_text().splitlines()[0]
    assert head.startswith("# [model] and [data]: Python objects given to distsgd.fit")
    assert len(result.metrics) == 5 and result.summary["final_metric"] > 0.5
    batch = fit_config(protocol).train.eval_batch_size
    assert accuracy_of(model, x_test, y_test, batch) == result.summary["final_metric"]
    assert_same_state(model.state_dict(), load_state(result.run_dir / "model.pt"))
    # export of a run whose model was an object: the checkpoint's state as saved
    assert_same_state(
        load_state(export_model(result.run_dir, tmp_path / "x.pt")),
        load_state(result.run_dir / "model.pt"),
    )


def test_fit_with_import_paths_and_a_user_metric(tmp_path):
    result = distsgd.fit(
        "tests.test_fit:make_net",
        "tests.test_fit:make_data",
        metric=error_rate,
        metric_direction="min",
        config=fit_config({"name": "hardsync", "num_learners": 2, "batch_size": 16}),
        overrides=["model.kwargs.hidden=12"],
        out_dir=tmp_path / "run",
        progress=False,
    )
    assert type(result.model) is TabularNet and result.model.body[0].out_features == 12
    recorded = RunConfig.from_toml(tmp_path / "run" / "config.toml")
    assert recorded.model.factory == "tests.test_fit:make_net"
    assert recorded.data.factory == "tests.test_fit:make_data"
    assert recorded.train.metric == "tests.test_fit:error_rate"
    assert result.summary["metric"] == "error_rate"
    assert result.summary["metric_direction"] == "min"
    x_test, y_test = blobs(200, 2)
    acc = accuracy_of(result.model, x_test, y_test, recorded.train.eval_batch_size)
    # the error rate sums per-batch float32 means times the batch size: each term is an
    # integer count up to float32 rounding of count/B (relative 6e-8), far below 1e-6
    assert result.summary["final_metric"] == pytest.approx(1 - acc, abs=1e-6)


def test_fit_with_objects_on_the_dist_runtime_is_refused_in_one_line(tmp_path):
    cfg = fit_config({"name": "hardsync", "num_learners": 2, "batch_size": 16})
    with pytest.raises(ConfigError) as e:
        distsgd.fit(
            TabularNet(),
            "tests.test_fit:make_data",
            config=cfg,
            overrides=["runtime=dist"],
            out_dir=tmp_path / "run",
        )
    message = str(e.value)
    assert message == (
        "model = <TabularNet object> cannot reach the processes of runtime 'dist': give an "
        "import path 'module:function'"
    )
    assert not (tmp_path / "run").exists()  # nothing written


def test_fit_refuses_arguments_of_the_wrong_kind(tmp_path):
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": 32})
    data = blobs(64, 1)
    cases = [
        (dict(model=42, train_data=data), "model = <int object> is not allowed"),
        (dict(model="not a path", train_data=data), "model = 'not a path' is not allowed"),
        (
            dict(model=make_net, train_data="tests.test_fit:make_data", eval_data=data),
            "eval_data = <tuple object> is not allowed with train_data",
        ),
        (dict(model=make_net, train_data=data, loss=3.0), "loss = <float object> is not"),
        (
            dict(model=make_net, train_data=data, metric=error_rate),
            "train.metric_direction = '' is not allowed",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            distsgd.fit(**kwargs, config=cfg, out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_fit_names_an_object_model_that_does_not_fit_the_data_by_its_class(tmp_path):
    """Found by a fresh user: an object model's failing forward was reported as
    ``model.name = 'cnn'`` (the default of a setting fit() does not use)."""
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": 32})
    wrong = torch.nn.Sequential(torch.nn.Linear(5, 3))  # the blobs have 8 features
    with pytest.raises(ConfigError, match=r"^the model \(a Sequential object\): its forward") as e:
        distsgd.fit(wrong, blobs(64, 1), config=cfg, out_dir=tmp_path / "run", progress=False)
    assert "cnn" not in str(e.value)
    assert not (tmp_path / "run").exists()


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(NUM_FEATURES, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).detach()  # no gradient reaches the weights


class _FailsWhenTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(NUM_FEATURES, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            raise RuntimeError("not in training mode, please")
        return self.linear(x)


def _too_few_outputs() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))


def _first_labels_zero() -> tuple[Tensor, Tensor]:
    x, y = blobs(64, 1)
    y[:2] = 0  # what the two-sample try-run sees fits two outputs
    return x, y


@pytest.mark.parametrize(
    "model, data, batch_size, message",
    [
        (_Detached, None, 32, r"a training step .* raised RuntimeError: element 0 of tensors"),
        (_FailsWhenTraining, None, 32, r"a training step .* not in training mode, please"),
        (
            lambda: nn.Sequential(nn.Linear(NUM_FEATURES, 16), nn.BatchNorm1d(16)),
            None,
            1,
            r"on a batch of protocol.batch_size = 1 samples .* Expected more than 1 value",
        ),
        (_too_few_outputs, _first_labels_zero, 32, r"it gives 2 outputs per sample but the "),
    ],
)
def test_a_model_that_fails_only_when_training_is_one_line_before_calibration(
    tmp_path, monkeypatch, model, data, batch_size, message
):
    """Found by a fresh user: the eval-mode try-run on two samples let these through, and
    they raised from inside the device calibration or the first step (a traceback, and a
    run directory left behind)."""
    monkeypatch.setattr(factory, "calibrate", lambda *a, **k: pytest.fail("calibrated first"))
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": batch_size})
    cfg = cfg.replace(
        cluster=dataclasses.replace(cfg.cluster, seconds_per_sample=-1, seconds_per_batch=-1)
    )
    train_data = data() if data else blobs(64, 1)
    with pytest.raises(ConfigError, match=message) as e:
        distsgd.fit(model(), train_data, config=cfg, out_dir=tmp_path / "run", progress=False)
    assert "\n" not in str(e.value) and str(e.value).startswith(("the model (a ", "the model"))
    assert not (tmp_path / "run").exists()


class _SortedByClass(TorchDataset):
    """Map-style data ordered by class, as ``ImageFolder`` orders its samples; with
    ``targets`` (torchvision's convention) or without."""

    def __init__(self, num_classes: int, per_class: int, with_targets: bool) -> None:
        self.y = torch.arange(num_classes).repeat_interleave(per_class)
        self.x = torch.randn(len(self.y), NUM_FEATURES, generator=torch.Generator().manual_seed(0))
        if with_targets:
            self.targets = self.y.tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def _two_outputs() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize(
    "train_data, eval_data, message",
    [
        # the evaluation labels go further than the training labels (tensors)
        (
            (torch.randn(64, NUM_FEATURES), torch.randint(0, 2, (64,))),
            (torch.randn(16, NUM_FEATURES), torch.arange(16) % 4),
            r"it gives 2 outputs per sample but the labels of the data go up to 3",
        ),
        # map-style, sorted by class, with targets: the class count comes from them
        (
            _SortedByClass(4, 64, with_targets=True),
            None,
            r"it gives 2 outputs per sample but the labels of the data go up to 3",
        ),
        # map-style without targets: the first batches fit, the calibration's larger do not
        (
            _SortedByClass(4, 32, with_targets=False),  # b = 128 reaches class 3
            None,
            r"a training step on the first \d+ training samples, while measuring the device",
        ),
    ],
)
def test_labels_beyond_the_models_outputs_are_one_line_before_anything_is_written(
    tmp_path, monkeypatch, train_data, eval_data, message
):
    """Found by a fresh user: labels the first samples do not show (data sorted by class,
    or evaluation labels beyond the training ones) raised from inside the calibration or
    the first evaluation, after the run directory was written."""
    monkeypatch.setenv("DISTSGD_PROFILE_CACHE", str(tmp_path / "cache"))
    cfg = fit_config({"name": "hardsync", "num_learners": 1, "batch_size": 32})
    cfg = cfg.replace(
        cluster=dataclasses.replace(cfg.cluster, seconds_per_sample=-1, seconds_per_batch=-1)
    )
    with pytest.raises(ConfigError, match=message) as e:
        distsgd.fit(
            _two_outputs(),
            train_data,
            eval_data,
            config=cfg,
            out_dir=tmp_path / "run",
            progress=False,
        )
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_dist_run_writes_a_model_pt_that_reproduces_its_final_metric(tmp_path):
    cfg = small_config(
        protocol={"name": "hardsync", "num_learners": 2, "batch_size": 16},
        train={"max_epochs": 1, "eval_every_samples": 256, "tensorboard": False},
        runtime="dist",
        dist={"timeout_s": 60.0},
    )
    result = distsgd.fit(
        "tests.test_fit:make_net",
        "tests.test_fit:make_data",
        config=cfg,
        overrides=["dist.num_processes=2"],
        out_dir=tmp_path / "run",
        progress=False,
    )
    s = result.summary
    assert s["runtime"] == "dist" and s["num_processes"] == 2 and s["status"] == "completed"
    assert_same_state(result.model.state_dict(), load_state(tmp_path / "run" / "model.pt"))
    x_test, y_test = blobs(200, 2)
    acc = accuracy_of(result.model, x_test, y_test, cfg.train.eval_batch_size, num_ranks=2)
    # the ranks evaluated the same weights and buffers on the same two slices in the same
    # batches, but in processes whose thread count may differ from this one's: a logit
    # near a tie may round the other way, so one sample of the 200 may differ
    assert abs(acc - s["final_metric"]) <= 1 / 200
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_metric"] == s["final_metric"]
