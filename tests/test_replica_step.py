"""ReplicaStep: the whole SMA iteration of k replicas as one function ≡ SMA's local_step +
apply_central over GradientEngine.replica_gradients (eager: to 1e-6; compiled, captured:
to 1e-5 relative), the fallback of a mode that cannot run, bad arguments."""

import warnings

import pytest
import torch

from distsgd.config import ConfigWarning
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.protocols import SMA
from distsgd.replica_step import ReplicaStep

K, B, SHAPE = 3, 4, (1, 8, 8)


def engine(name: str = "cnn", device: str = "cpu") -> GradientEngine:
    torch.manual_seed(0)
    return GradientEngine(build_model(name, SHAPE, 3), device=device)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(K, B, *SHAPE, generator=g), torch.randint(0, 3, (K, B), generator=g))
        for _ in range(n)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm())


def reference_and_step(name: str, mode: str, steps: int, device: str = "cpu"):
    """The same steps by the SMA protocol (eager engine) and by a ReplicaStep."""
    eng = engine(name)
    w0 = eng.initial_weights()
    sma = SMA(w0, num_learners=K, alpha=1 / K, central_momentum=0.9, momentum=0.9)
    step = ReplicaStep(engine(name, device), w0, K, B, alpha=1 / K, mode=mode)
    for i, (x, y) in enumerate(batches(steps)):
        lr = (0.05, 0.1, 0.05, 0.05)[i]  # a rise, then a drop of γ: a reset in both
        sma.begin_iteration(lr)  # the reset first, as the drop-in optimizer does
        grads, losses = eng.replica_gradients(sma.replicas, x, y)
        sma.step(grads, lr=lr)
        got = step.step(x, y, lr)
        assert rel(got, torch.tensor(losses)) < 1e-5
    return sma, step


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_eager_step_is_sma_over_the_batched_gradients(name):
    sma, step = reference_and_step(name, "eager", steps=4)
    assert rel(step.replicas, sma.replicas) < 1e-6
    assert rel(step.z, sma.eval_weights()) < 1e-6
    # the replicas moved: the comparison is not between two unchanged starts
    assert rel(step.replicas[0], step.replicas[1]) > 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_cuda_graph_without_cuda_warns_once_and_runs_eagerly():
    with pytest.warns(ConfigWarning, match="'cuda-graph' cannot run .*not cuda"):
        sma, step = reference_and_step("cnn", "cuda-graph", steps=2)
    assert step.mode == "eager" and "not cuda" in step.fallback_reason
    assert rel(step.z, sma.eval_weights()) < 1e-6


def test_failed_compilation_falls_back_with_its_reason(monkeypatch):
    def failing(fn, **kwargs):
        def run(*args):
            raise RuntimeError("inductor: C++ compile error\nsecond line")

        return run

    monkeypatch.setattr(torch, "compile", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sma, step = reference_and_step("mlp", "compile", steps=2)
    lines = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(lines) == 1 and "C++ compile error" in lines[0] and "second" not in lines[0]
    assert step.mode == "eager"
    assert rel(step.z, sma.eval_weights()) < 1e-6


def test_warm_up_leaves_the_state_unchanged(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # runs the function
    eng = engine("mlp")
    step = ReplicaStep(eng, eng.initial_weights(), K, B, 1 / K, mode="compile")
    step.step(*batches(1)[0], 0.05)  # momentum buffers and z_prev become non-trivial
    before = [t.clone() for t in (step.replicas, step.momentum_buffers, step.z, step.z_prev)]
    step.warm_up(*batches(2)[1])
    after = (step.replicas, step.momentum_buffers, step.z, step.z_prev)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert step.mode == "compile"


def test_bad_arguments_are_refused():
    eng = engine()
    w0 = eng.initial_weights()
    with pytest.raises(ValueError, match="mode = 'fast'"):
        ReplicaStep(eng, w0, K, B, 0.5, mode="fast")
    with pytest.raises(ValueError, match="alpha = 1.5 is not allowed: expected 0 <= alpha <= 1"):
        ReplicaStep(eng, w0, K, B, 1.5)
    with pytest.raises(ValueError, match="central_momentum = 1.0 .* < 1"):
        ReplicaStep(eng, w0, K, B, 0.5, central_momentum=1.0)
    torch.manual_seed(0)
    resnet = GradientEngine(build_model("resnet20", (1, 8, 8), 3))
    with pytest.raises(ValueError, match="ResNet20 has no batched replica path"):
        ReplicaStep(resnet, resnet.initial_weights(), K, B, 0.5)


@pytest.mark.slow
def test_compiled_step_matches_the_eager_step():
    # inductor on the CPU (needs a C++ compiler); minutes for the cnn, so the mlp
    sma, step = reference_and_step("mlp", "compile", steps=3)
    assert step.mode == "compile"
    assert rel(step.replicas, sma.replicas) < 1e-5
    assert rel(step.z, sma.eval_weights()) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("mode", ["cuda-graph", "reduce-overhead"])
def test_captured_step_on_cuda_matches_the_cpu(mode):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    sma, step = reference_and_step("cnn", mode, steps=3, device="cuda")
    assert step.mode == mode
    assert rel(step.replicas, sma.replicas) < 1e-4
    assert rel(step.z, sma.eval_weights()) < 1e-4
