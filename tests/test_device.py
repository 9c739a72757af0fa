"""Device placement, collective backend, mixed precision and device-independent files
(issue 15), exercised on the CPU; the GPU-only checks skip without CUDA."""

import collections
import dataclasses
import hashlib
import inspect
import io
import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distsgd import api
from distsgd.cli import main as cli_main
from distsgd.config import (
    ConfigError,
    RunConfig,
    check_device,
    resolve_device,
    resolved_device_setting,
)
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine, build_engine, config_for_data
from distsgd.layout import build_protocol
from distsgd.metrics import digest_path, load_checked, save_checked
from distsgd.models import MLP
from distsgd.protocols.base import AsynchronousProtocol
from distsgd.runtime import profiles, ps
from distsgd.runtime.dist import (
    NCCL_WITH_GLOO,
    ProcessInfo,
    collective_backend,
    ddp_no_forward_buffer_sync,
)
from tests.conftest import cli_in_process, small_config

REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


# ---- settings ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:-1", "CPU", 0])
def test_bad_device_setting_is_one_line(value):
    with pytest.raises(ConfigError, match=r"train.device = .* expected 'auto', 'cpu'"):
        small_config(train={"device": value})


def test_device_resolution_on_a_machine_with_and_without_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu")
    assert resolved_device_setting("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", 3) == torch.device("cuda", 1)  # local rank 3 of 2 GPUs
    assert resolve_device("cuda", 0) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", 0) == torch.device("cuda", 1)
    assert resolve_device("cpu", 1) == torch.device("cpu")
    assert resolved_device_setting("auto") == "cuda"  # the same on every rank


def test_missing_gpu_and_nccl_are_refused_with_what_the_machine_has(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(small_config(train={"device": "cuda:1"}))
    with pytest.raises(ConfigError, match=r"train.device = 'cuda:2' .* 2 CUDA devices"):
        check_device(small_config(train={"device": "cuda:2"}))
    cpu_nccl = small_config(runtime="dist", train={"device": "cpu"}, dist={"backend": "nccl"})
    with pytest.raises(ConfigError, match="dist.backend = 'nccl' .* train.device = 'cpu'"):
        check_device(cpu_nccl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device = 'cuda' .* no CUDA device"):
        check_device(small_config(train={"device": "cuda"}))
    nccl = small_config(runtime="dist", dist={"backend": "nccl"})
    with pytest.raises(ConfigError, match="dist.backend = 'nccl' .* no CUDA device"):
        check_device(nccl)


def test_backend_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def backend(device, backend="auto", ranks_here=2):
        cfg = small_config(
            runtime="dist",
            protocol={"name": "hardsync", "num_learners": 2},
            train={"device": device},
            dist={"backend": backend},
        )
        return collective_backend(cfg, ProcessInfo(0, ranks_here, 0, ranks_here))

    assert backend("auto") == NCCL_WITH_GLOO  # one GPU per rank
    assert backend("cuda") == NCCL_WITH_GLOO
    assert backend("auto", ranks_here=4) == "gloo"  # 4 ranks share 2 GPUs
    assert backend("cuda:0") == "gloo"  # both ranks on GPU 0
    assert backend("cpu") == "gloo"
    assert backend("auto", backend="gloo") == "gloo"
    assert backend("cuda:0", backend="nccl") == NCCL_WITH_GLOO  # asked for: the user's call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend("auto") == "gloo"


# ---- refusals reach the user as one line, nothing written --------------------------------
def _run_cli(tmp_path, *args):
    return cli_in_process("train", *args, "--out", str(tmp_path / "r"), cwd=tmp_path)


@no_cuda
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "train.device=cuda"], "train.device = 'cuda' is not allowed"),
        (["--set", "runtime=dist", "--set", "dist.backend=nccl"], "dist.backend = 'nccl'"),
    ],
)
def test_cli_refuses_cuda_without_cuda(tmp_path, args, fragment):
    r = _run_cli(tmp_path, "--set", "data.dataset=synthetic", *args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], r.stderr
    assert "no CUDA device" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


@no_cuda
@pytest.mark.parametrize("command", ["calibrate", "tune"])
def test_calibrate_and_tune_refuse_cuda_without_cuda(tmp_path, command, capsys, monkeypatch):
    """Found by a fresh user: both measured or probed first and ended in a traceback
    (ZeroDivisionError: no GPUs to take the local rank modulo)."""
    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "out"
    config = str(Path(__file__).resolve().parents[1] / "configs" / "hardsync.toml")
    args = [command, config, "--set", "train.device=cuda"]
    code = cli_main([*args, "--out", str(out / "p.toml" if command == "calibrate" else out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.device = 'cuda' is not allowed" in err
    assert not out.exists() and not (tmp_path / "cache").exists()


@no_cuda
def test_dist_run_refuses_a_missing_gpu_before_ranks_start(tmp_path):
    cfg = small_config(runtime="dist", train={"device": "cuda:3"})
    with pytest.raises(ConfigError, match="train.device = 'cuda:3' is not allowed: this"):
        api.run(cfg, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


@no_cuda
def test_fit_refuses_cuda_without_cuda(tmp_path):
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with pytest.raises(ConfigError, match="train.device = 'cuda' is not allowed") as e:
        api.fit(
            torch.nn.Linear(4, 2),
            (x, y),
            overrides=["train.device=cuda", "train.max_epochs=1"],
            out_dir=tmp_path / "r",
            progress=False,
        )
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


# ---- placement ---------------------------------------------------------------------------
def _final_weights(run_dir: Path) -> torch.Tensor:
    return load_checked(run_dir / "checkpoint.pt")["protocol"]["weights"]


def test_explicit_cpu_equals_auto_here_and_is_recorded(tmp_path):
    """On a machine without CUDA, auto is the CPU: the same run bit for bit; the run's
    config.toml records the resolved device."""
    cfg = small_config(train={"max_epochs": 1, "eval_every_samples": 0})
    api.run(cfg, tmp_path / "auto", progress=False)
    api.run(
        cfg.replace(train=dataclasses.replace(cfg.train, device="cpu")),
        tmp_path / "cpu",
        progress=False,
    )
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    toml = (tmp_path / "auto" / "config.toml").read_text()
    assert f'device = "{expected}"' in toml
    if not torch.cuda.is_available():
        assert torch.equal(_final_weights(tmp_path / "auto"), _final_weights(tmp_path / "cpu"))


@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "hardsync", "num_learners": 2},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 2},
        {"name": "local_sgd", "num_learners": 2, "average_every": 2},
        {"name": "parameter_server", "num_learners": 2, "mode": "softsync", "softsync": 1},
        {"name": "parameter_server", "num_learners": 2, "server_optimizer": "adagrad"},
        {"name": "compute_groups", "num_learners": 4, "num_groups": 2},
    ],
)
def test_protocol_state_follows_the_weights_device(protocol):
    """Every state tensor is made from the weights: on the ``meta`` device (no memory, no
    maths) a ``torch.zeros(P)`` or ``torch.tensor`` without a device would show up as a
    CPU tensor."""
    momentum = 0.0 if protocol.get("server_optimizer") == "adagrad" else 0.9
    cfg = small_config(protocol=protocol, optimizer={"momentum": momentum})
    p = 7
    proto = build_protocol(cfg, torch.zeros(p, device="meta"))
    for _ in range(3):
        if isinstance(proto, AsynchronousProtocol):
            for w in range(proto.num_workers):
                _, version = proto.pull(w)
                proto.push(w, torch.zeros(p, device="meta"), version, lr=0.1)
        else:
            proto.step(torch.zeros(proto.num_learners, p, device="meta"), lr=0.1)
    # torch.optim keeps its step counters as 0-d CPU tensors on any device, by design
    tensors = [t for t in _tensors(proto.state_dict()) if t.dim() > 0]
    assert tensors and all(t.device.type == "meta" for t in tensors), [t.device for t in tensors]


def test_engine_moves_batches_and_keeps_buffers_on_its_device():
    torch.manual_seed(0)
    engine = GradientEngine(MLP((1, 4, 4), 3), device="cpu")
    assert engine.device == torch.device("cpu") and engine.initial_weights().device.type == "cpu"
    (x,) = engine.to_device(torch.ones(2))
    assert x.device == engine.device


def test_forced_host_staging_copies(monkeypatch):
    t = torch.arange(5.0)
    assert ps.to_host(t) is t  # a CPU tensor is sent as it is
    monkeypatch.setenv(ps.transport.ENV_FORCE_HOST_STAGING, "1")
    staged = ps.to_host(t)
    assert staged is not t and staged.data_ptr() != t.data_ptr()
    assert torch.equal(staged, t) and staged.dtype == t.dtype


def test_host_staging_reuses_its_buffer(monkeypatch):
    """A learner stages every push into one buffer (allocated once per shape and dtype),
    each call's copy holding that call's values."""
    monkeypatch.setenv(ps.transport.ENV_FORCE_HOST_STAGING, "1")
    stage = ps.HostStaging()
    a, b = torch.arange(5.0), torch.arange(5.0) * -2
    first = stage(a)
    assert torch.equal(first, a) and first.data_ptr() != a.data_ptr()
    second = stage(b)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, b)
    third = stage(torch.ones(3, dtype=torch.float64))  # another shape: a new buffer
    assert third.shape == (3,) and third.dtype == torch.float64
    assert torch.equal(third, torch.ones(3, dtype=torch.float64))
    monkeypatch.delenv(ps.transport.ENV_FORCE_HOST_STAGING)
    assert stage(a) is a  # a CPU tensor is sent as it is


@pytest.mark.slow  # spawns 3 ranks (~15 s on 2 loaded cores)
def test_parameter_server_trains_with_forced_host_staging(tmp_path, monkeypatch):
    """Learners stage every push through a host copy (the GPU path) and the run still
    equals the simulator's hardsync-mode parameter server, which is deterministic."""
    monkeypatch.setenv(ps.transport.ENV_FORCE_HOST_STAGING, "1")
    cfg = small_config(
        runtime="dist",
        protocol={"name": "parameter_server", "num_learners": 2, "mode": "hardsync"},
        train={"device": "cpu", "max_epochs": 1, "eval_every_samples": 0},
        dist={"timeout_s": 120.0},
    )
    api.run(cfg, tmp_path / "dist", progress=False)
    api.run(cfg.replace(runtime="sim"), tmp_path / "sim", progress=False)
    dist_w, sim_w = _final_weights(tmp_path / "dist"), _final_weights(tmp_path / "sim")
    # the server averages the same gradients in the same order: float32 sums of two
    # gradients are exact in either order, so the two runs agree to rounding only
    assert torch.allclose(dist_w, sim_w, rtol=0, atol=1e-6)


# ---- mixed precision ---------------------------------------------------------------------
def _engine(precision: str) -> GradientEngine:
    torch.manual_seed(0)
    return GradientEngine(MLP((1, 8, 8), 4), precision=precision)


def test_fp32_gradient_is_plain_pytorch_bit_for_bit():
    engine = _engine("fp32")
    torch.manual_seed(1)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    grad, _ = engine.gradient(engine.initial_weights(), x, y)
    torch.manual_seed(0)
    model = MLP((1, 8, 8), 4)
    F.cross_entropy(model(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(grad, expected)


def test_bf16_mixed_gradients_are_fp32_and_close_to_fp32():
    torch.manual_seed(1)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    fp32, bf16 = _engine("fp32"), _engine("bf16-mixed")
    g32, _ = fp32.gradient(fp32.initial_weights(), x, y)
    g16, _ = bf16.gradient(bf16.initial_weights(), x, y)
    assert g16.dtype == torch.float32 and bf16.initial_weights().dtype == torch.float32
    assert not torch.equal(g16, g32)  # autocast did run in bfloat16
    # bfloat16 keeps 8 significant bits (relative error 2^-8 per rounding, a few roundings
    # through two layers): the gradients agree to a few percent of their size
    assert (g16 - g32).norm() <= 0.05 * g32.norm()


def test_bf16_mixed_run_trains_and_keeps_fp32_state(tmp_path):
    cfg = small_config(
        protocol={"name": "sma", "num_learners": 2, "replicas_per_device": 2},
        train={"precision": "bf16-mixed", "max_epochs": 2, "eval_every_samples": 0},
    )
    summary = api.run(cfg, tmp_path / "r", progress=False)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").open()]
    losses = [r["train_loss"] for r in records if r.get("train_loss") is not None]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert summary["final_metric"] > 0.5  # 4 synthetic classes: chance is 0.25
    state = load_checked(tmp_path / "r" / "checkpoint.pt")["protocol"]
    assert all(t.dtype == torch.float32 for t in _tensors(state))


# ---- device-independent files ------------------------------------------------------------
def _claim_cuda(path: Path) -> None:
    """Rewrite a ``torch.save`` file so that its tensors say they were saved on cuda:0
    (what a GPU run's file says); the digest sidecar is rewritten to match."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    found = 0
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):  # pickle protocol 2: X <len> <utf-8>
                found += data.count(b"X\x03\x00\x00\x00cpu")
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info.filename, data)
    assert found, "no tensor location found to rewrite"
    path.write_bytes(out.getvalue())
    side = digest_path(path)
    if side.exists():
        side.write_text(hashlib.sha256(path.read_bytes()).hexdigest() + "\n")


@no_cuda
def test_gpu_checkpoint_resumes_on_cpu(tmp_path):
    """A run whose checkpoint and config come from a GPU resumes on a CPU-only machine
    with ``train.device = "cpu"`` (a config saying cuda is refused in one line)."""
    run = tmp_path / "r"
    cfg = small_config(
        protocol={"name": "parameter_server", "num_learners": 2, "mode": "softsync"},
        train={"max_epochs": 1, "eval_every_samples": 512},
    )
    api.run(cfg, run, progress=False)
    state = load_checked(run / "checkpoint.pt")
    assert state["cuda_rng"] is None  # a CPU run has no CUDA generator state
    state["cuda_rng"] = torch.zeros(16, dtype=torch.uint8)  # as a GPU run writes it
    save_checked(state, run / "checkpoint.pt")
    _claim_cuda(run / "checkpoint.pt")
    with pytest.raises(RuntimeError, match="CUDA"):  # what a load without map_location does
        torch.load(run / "checkpoint.pt", weights_only=True)
    toml = run / "config.toml"
    toml.write_text(toml.read_text().replace('device = "cpu"', 'device = "cuda"'))
    with pytest.raises(ConfigError, match="train.device = 'cuda' is not allowed"):
        api.train(resume=run, overrides=["train.max_epochs=2"], progress=False)
    summary = api.train(
        resume=run, overrides=["train.max_epochs=2", "train.device=cpu"], progress=False
    )
    assert summary["samples"] >= 2 * 1024


def test_saved_files_keep_their_structure(tmp_path):
    """save_checked moves tensors to the CPU (a no-op here) without changing containers."""
    state = {
        "a": collections.OrderedDict(w=torch.ones(2)),
        "b": (torch.zeros(1), 3),
        "c": [torch.arange(3)],
    }
    save_checked(state, tmp_path / "s.pt")
    again = load_checked(tmp_path / "s.pt")
    assert type(again["a"]) is collections.OrderedDict and type(again["b"]) is tuple
    assert torch.equal(again["a"]["w"], state["a"]["w"]) and again["b"][1] == 3
    assert torch.equal(again["c"][0], state["c"][0])


@pytest.mark.slow  # the whole GPU check at tiny sizes, in one process (~1-2 min loaded)
def test_gpu_check_smoke_runs_end_to_end_on_cpu(tmp_path):
    cmd = [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--smoke"]
    cmd += ["--sections", "1,2,4,3,5,6", "--out", str(tmp_path)]
    # far above the work: its sections stop at their own caps
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    (table,) = tmp_path.glob("gpu_check_*.md")
    text = table.read_text()
    for heading in ("## 1. Equivalence", "## 2. Throughput", "## 3. Time to target", "## 4."):
        assert heading in text
    assert "## 5. Replica step" in text and "## 6. Time" in text
    assert "hardsync λ=2 b=32" in text and "**NO**" not in text
    # without CUDA the captured step says it ran eagerly, and why
    assert "cuda-graph vs eager (ran eager: the engine's device is cpu" in text
    assert "the plain loop at b=32" in text and "SMA / best plain loop" in text


# ---- on a GPU ----------------------------------------------------------------------------
@needs_cuda
def test_gpu_engine_matches_cpu_engine():
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    cpu = _engine("fp32")
    torch.manual_seed(0)
    gpu = GradientEngine(MLP((1, 8, 8), 4), device="cuda")
    g_cpu, _ = cpu.gradient(cpu.initial_weights(), x, y)
    g_gpu, _ = gpu.gradient(gpu.initial_weights(), x, y)
    assert g_gpu.device.type == "cuda"
    # different kernels (cuBLAS, TF32 off by default for fp32 matmul): float32 rounding
    assert torch.allclose(g_gpu.cpu(), g_cpu, rtol=1e-4, atol=1e-6)


@needs_cuda
def test_gpu_run_keeps_state_on_the_gpu(tmp_path):
    cfg = small_config(
        protocol={"name": "sma", "num_learners": 4, "replicas_per_device": 4},
        train={"device": "cuda", "max_epochs": 1},
    )
    cfg = config_for_data(cfg, load_dataset(cfg.data))  # the model's input shape
    engine = build_engine(cfg)
    proto = build_protocol(cfg, engine.initial_weights())
    assert all(t.device.type == "cuda" for t in _tensors(proto.state_dict()))
    start = tmp_path / "start.pt"
    save_checked(engine.initial_weights(), start)  # read back onto the CPU, moved to the GPU
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, initial_weights=str(start)))
    api.run(cfg, tmp_path / "r", progress=False)
    state = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)  # no map_location
    assert all(t.device.type == "cpu" for t in _tensors(state))


def test_dataclass_round_trip_keeps_new_settings():
    cfg = small_config(train={"device": "cpu", "precision": "bf16-mixed"})
    again = RunConfig.from_dict(tomllib.loads(cfg.to_toml()))
    assert dataclasses.asdict(again.train) == dataclasses.asdict(cfg.train)


def test_ddp_buffer_switch_follows_the_installed_torch():
    """torch 2.13 renamed DDP's ``broadcast_buffers`` to ``forward_sync_buffers``; a GPU
    machine with torch 2.11 refused the new name (found on an H200)."""

    def before_2_13(self, module, device_ids=None, broadcast_buffers=True): ...

    def since_2_13(self, module, broadcast_buffers=None, forward_sync_buffers=None): ...

    assert ddp_no_forward_buffer_sync(before_2_13) == {"broadcast_buffers": False}
    assert ddp_no_forward_buffer_sync(since_2_13) == {"forward_sync_buffers": False}
    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__
    assert set(ddp_no_forward_buffer_sync(ddp_init)) <= set(inspect.signature(ddp_init).parameters)
