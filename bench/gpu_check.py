"""Every GPU check of issue 15 in one script of at most 5 minutes, writing one markdown
table that names the device.

1. **Equivalence** (TF32 off): hardsync's first update on the device equals the CPU's to
   1e-4 relative; after N iterations the device's weights are no further from the CPU's
   than N × what a one-ulp change of the start makes on the CPU after N iterations
   (training amplifies float32 rounding: measured 4e-4 relative after 20 iterations from
   one ulp, on the CPU and between H200 and CPU alike); k batched replicas equal the same k one by
   one on the device; bf16-mixed ends within 1 accuracy point of fp32 after the same
   samples. Every protocol runs on the device (a short run each).
2. **Throughput** (samples/s): one learner (``GradientEngine.gradient``) and a plain
   PyTorch loop (forward, loss, backward, ``optimizer.step``) at b = 8, 32, 128, 512,
   beside k × b batched replicas (``GradientEngine.replica_gradients``, its ``auto``
   path) for k = 1 … 64; inputs already on the device for all three.
   Crossbow's premise on a GPU: k batched replicas at b = 8 reach >= 5× one learner's
   throughput at b = 8.
4. **Calibration** (run before 3): the tuner's calibrated device profile (seconds per
   batch and per sample; replica ratios at the SMA batch) against measured seconds per
   iteration.
5. **Replica step without per-step launches** (``--sections 5``):
   :class:`distsgd.replica_step.ReplicaStep` (the whole SMA iteration of k ``cnn``
   replicas at b = 8) eager, captured in a CUDA graph and compiled with
   ``mode="reduce-overhead"``, each checked against eager after 3 steps (1e-4 relative,
   TF32 off), in samples/s against the plain loop at b = 512 (issue 44: >= 0.8×).
6. **Time to target in Crossbow's regime** (``--sections 6``): bench/crossbow_regime.py's
   workload (``REGIME``: ``mlp`` on 12,000 Fashion-MNIST samples to 85%, where b = 1024
   needs ~3× the epochs of b = 64; bench/results/crossbow_regime_cpu.md), the plain loop
   over b = 64 … 2048 with its lr and warm-up against SMA in section 5's fastest mode,
   3 seeds; the ratio of medians SMA / best plain loop (issue 44: <= 0.8).
3. **Time to 90%** on Fashion-MNIST ``cnn`` (training wall seconds, evaluation excluded):
   SMA with ``replicas_per_device = "auto"`` at b = ``--sma-batch`` (the simulated
   runtime on one device, profile from section 4) vs the best of a plain PyTorch loop
   swept over b and its learning rate; the ratio SMA / best plain loop (target <= 0.5).

Each section has its own time cap (a section out of time stops and says so in its
rows). Timings synchronise the device around each timed block. ``--smoke`` runs tiny
sizes (synthetic data; section 3 to a low target) in well under a minute, e.g. on a CPU:

    python bench/gpu_check.py --device cpu --smoke --out /tmp/gpu_check

On the GPU machine, from the repository root (Fashion-MNIST is not on that machine:
copy the four ``.gz`` files into a folder ``.git/info/exclude`` ignores, carry it, and
pass it as ``--data-root``; without it sections 1, 2 and 4 use synthetic data of the
same shape and section 3 is skipped):

    mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/   # here
    echo /.gpu_data/ >> .git/info/exclude                                        # here
    python3 bench/gpu_check.py --data-root .gpu_data --out $OUT    # there, carry .gpu_data

Issue 44's rows, in at most ~5 minutes of device time (sections 4, 5, 6: caps 25 + 100 +
90 s, a run already started finishing past its cap, plus ``reduce-overhead``'s two
compilations in section 5 and start-up; the dry run below took 27–168 s on the shared
2-core CPU, by its load)::

    python3 bench/gpu_check.py --data-root .gpu_data --sections 4,5,6 --out $OUT
    python bench/gpu_check.py --device cpu --smoke --sections 4,5,6 --out /tmp/gc   # dry run

Sections stop at their caps (50 + 50 + 25 + 130 s; a run already started finishes). On
one H200 the whole check took 116 s (sections 23 + 15 + 2 + 75 s), and
``bench/gpu_session.sh`` (this check, the device tests, 2 ranks sharing the GPU) 204 s;
results in ``bench/results/gpu/``.

The table goes to ``<out>/gpu_check_<device>.md`` (and its figures to a ``.json``
beside it); commit it under ``bench/results/gpu/``. Exit status 1 when an equivalence
check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's distsgd
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/crossbow_regime.py

from distsgd import api  # noqa: E402
from distsgd.config import ConfigWarning, DataConfig, RunConfig  # noqa: E402
from distsgd.data import Dataset, DatasetError, load_dataset  # noqa: E402
from distsgd.engine import GradientEngine  # noqa: E402
from distsgd.metrics import load_checked, save_checked  # noqa: E402
from distsgd.models import build_model  # noqa: E402
from distsgd.replica_step import ReplicaStep  # noqa: E402
from distsgd.runtime.sim import calibrate, calibrate_replicas  # noqa: E402

# Crossbow's regime (bench/results/crossbow_regime_cpu.md): the workload, target and
# learning rates established on the CPU; plain runs (b, lr, warm-up epochs), SMA (k, b, lr)
REGIME: dict[str, Any] = {
    "model": "mlp",
    "train_samples": 12_000,
    "test_samples": 2_000,
    "target": 0.85,
    "max_epochs": 12,
    "eval_every": 1_200,
    "plain": (
        (64, 0.02, 0.0),
        (128, 0.03, 0.0),
        (256, 0.05, 0.0),
        (512, 0.08, 1.0),
        (1024, 0.1, 1.0),
        (2048, 0.2, 2.0),
    ),
    "sma": ((4, 16, 0.01), (8, 8, 0.01), (2, 32, 0.02)),
    "seeds": (0, 1, 2),
}
# the cnn in the same regime (one seed on the CPU: b = 1024 did not reach 86% in 6 epochs)
REGIMES: dict[str, dict[str, Any]] = {
    "mlp": REGIME,
    "cnn": {
        **REGIME,
        "model": "cnn",
        "target": 0.86,
        "max_epochs": 8,
        "plain": REGIME["plain"][:5],  # up to b = 1024
        "sma": REGIME["sma"][:2],
    },
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section does; caps in wall seconds."""

    equivalence_steps: int
    bf16_samples: int
    bf16_limit_points: float  # |bf16-mixed - fp32| accuracy allowed, in points
    batches: tuple[int, ...]
    replicas: tuple[int, ...]
    timed_iterations: int
    plain_batches: tuple[int, ...]
    plain_lrs: tuple[float, ...]
    sma_runs: tuple[tuple[int, int | str], ...]  # (b, k): k = "auto" or fixed
    sma_lr: float
    tta_target: float
    tta_run_seconds: float
    eval_every_samples: int
    synthetic_sizes: tuple[int, int]
    calibration_batches: tuple[int, int]
    calibration_repeats: int
    max_replicas_calibrated: int
    step_batch: int
    step_replicas: tuple[int, ...]
    step_modes: tuple[str, ...]
    step_plain_batch: int
    regime: dict[str, Any]
    caps: dict[str, float]


FULL = Sizes(
    equivalence_steps=20,
    bf16_samples=60_000,
    bf16_limit_points=1.0,
    batches=(8, 32, 128, 512),
    replicas=(1, 2, 4, 8, 16, 32, 64),
    timed_iterations=20,
    plain_batches=(1024, 512, 256, 128, 64),
    plain_lrs=(0.1, 0.05),
    sma_runs=((16, "auto"), (16, 16), (8, 64)),
    sma_lr=0.01,
    tta_target=0.9,
    tta_run_seconds=15.0,
    eval_every_samples=10_000,
    synthetic_sizes=(60_000, 10_000),
    calibration_batches=(16, 128),
    calibration_repeats=6,
    max_replicas_calibrated=64,
    step_batch=8,
    step_replicas=(16, 32, 64, 128),
    step_modes=("eager", "cuda-graph", "reduce-overhead"),
    step_plain_batch=512,
    regime=REGIME,
    caps={
        "equivalence": 50.0,
        "throughput": 50.0,
        "calibration": 25.0,
        "tta": 130.0,
        "step": 100.0,
        "regime": 90.0,
    },
)
SMOKE = Sizes(
    equivalence_steps=2,
    bf16_samples=128,
    # 4 of the 64 evaluation samples: after 128 samples both models are near chance, and
    # bf16 kernels round differently between CPUs (one sample is 1.56 points here)
    bf16_limit_points=100 * 4 / 64,
    batches=(8, 32),
    replicas=(1, 2, 4),
    timed_iterations=2,
    plain_batches=(64,),
    plain_lrs=(0.1,),
    sma_runs=((16, "auto"), (8, 4)),
    sma_lr=0.05,
    tta_target=0.5,
    tta_run_seconds=1.5,
    eval_every_samples=128,
    synthetic_sizes=(512, 64),
    calibration_batches=(8, 32),
    calibration_repeats=2,
    max_replicas_calibrated=3,
    step_batch=4,
    step_replicas=(2, 4),
    # "reduce-overhead" compiles for minutes on a CPU; on a GPU it runs as in FULL
    step_modes=("eager", "cuda-graph"),
    step_plain_batch=32,
    regime={
        **REGIME,
        "train_samples": 512,
        "test_samples": 64,
        "target": 0.2,
        "max_epochs": 2,
        "eval_every": 128,
        "plain": ((64, 0.05, 0.0), (256, 0.1, 1.0)),
        "sma": ((2, 8, 0.02),),
        "seeds": (0, 1),
    },
    caps={
        "equivalence": 60.0,
        "throughput": 10.0,
        "calibration": 60.0,
        "tta": 10.0,
        "step": 60.0,
        "regime": 60.0,
    },
)


class Cap:
    """A section's wall-clock budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    @property
    def over(self) -> bool:
        return time.perf_counter() >= self.end


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any], iterations: int) -> float:
    """Median wall seconds of one call of ``fn`` (one warm-up call; the device is
    synchronised before and after each call)."""
    fn()
    times = []
    for _ in range(iterations):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- data and runs ----------------------------------------------------------------------
def load_data(args: argparse.Namespace, sizes: Sizes) -> tuple[dict[str, Any], Dataset, str]:
    """The data table of the runs, the dataset, and a note on where it came from."""
    if not args.smoke:
        table = {"dataset": "fashion_mnist", "root": args.data_root}
        try:
            return table, load_dataset(DataConfig(**table)), "Fashion-MNIST"
        except DatasetError as e:
            note = f"synthetic (Fashion-MNIST not found: {str(e).splitlines()[0]})"
    else:
        note = "synthetic (smoke)"
    n_train, n_test = sizes.synthetic_sizes
    table = {"dataset": "synthetic", "num_train": n_train, "num_test": n_test}
    return table, load_dataset(DataConfig(**table)), note


def run(
    data: dict[str, Any], device: str, out: Path, protocol: dict[str, Any], **train: Any
) -> dict[str, Any]:
    """One simulated-runtime run (``cnn``, fixed cluster profile unless given); its
    summary plus the final central weights on the CPU."""
    cluster = train.pop("cluster", None) or {
        "seconds_per_sample": 1e-4,
        "seconds_per_batch": 1e-3,
        "latency_s": 1e-4,
        "bandwidth_gbps": 10.0,
    }
    raw = {
        "data": data,
        "model": {"name": "cnn"},
        "protocol": protocol,
        "optimizer": {"lr": train.pop("lr", 0.05), "momentum": 0.9},
        "cluster": cluster,
        "train": {
            "device": device,
            "target": 0.0,
            "tensorboard": False,
            "checkpoint_every_evals": 0,
            "num_threads": 0,
            **train,
        },
    }
    summary = api.run(RunConfig.from_dict(raw), out, progress=False)
    state = load_checked(out / "checkpoint.pt")["protocol"]
    return {**summary, "weights": state.get("weights", state.get("central"))}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---- 1. equivalence ---------------------------------------------------------------------
PROTOCOLS = (  # each runs briefly on the device (--smoke: every other one)
    {"name": "sma", "num_learners": 4, "replicas_per_device": 4, "batch_size": 16},
    {"name": "local_sgd", "num_learners": 2, "average_every": 2, "batch_size": 16},
    {"name": "parameter_server", "num_learners": 2, "mode": "softsync", "batch_size": 16},
    {"name": "compute_groups", "num_learners": 4, "num_groups": 2, "batch_size": 16},
)


def equivalence(args, sizes, data, ds, device, tmp: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cap = Cap(sizes.caps["equivalence"])
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 kernels on both sides
    torch.backends.cudnn.allow_tf32 = False
    b, lam = 32, 2
    hard = {"name": "hardsync", "num_learners": lam, "batch_size": b}
    steps = sizes.equivalence_steps
    # every run starts from the same file; the reference's start moves each weight by one
    # float32 unit in the last place
    torch.manual_seed(0)
    w0 = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes)).initial_weights()
    signs = torch.randn(w0.shape, generator=torch.Generator().manual_seed(2)).sign()
    starts = {"w0": w0, "w0_ulp": torch.nextafter(w0, w0 + signs)}
    for name, w in starts.items():
        save_checked(w, tmp / f"{name}.pt")

    def hardsync(device_name: str, start: str, iterations: int) -> torch.Tensor:
        out = Path(tempfile.mkdtemp(prefix=f"hard_{start}_{iterations}_", dir=tmp)) / "run"
        budget = {"max_samples": iterations * lam * b, "eval_every_samples": 0, "max_epochs": 0}
        init = str(tmp / f"{start}.pt")
        return run(data, device_name, out, hard, initial_weights=init, **budget)["weights"]

    # one iteration: the update itself (w1 − w0) on the device vs on the CPU
    cpu1, dev1 = hardsync("cpu", "w0", 1), hardsync(args.device, "w0", 1)
    diff = relative_difference(dev1 - w0, cpu1 - w0)
    # float32 sums in another order (cuDNN/cuBLAS vs the CPU's kernels): ~1e-6 relative
    rows.append(row(f"hardsync λ=2 b=32, the first update: {device} vs CPU", diff, 1e-4))
    # N iterations: training amplifies float32 rounding, so the limit is what a one-ulp
    # change of the weights at each of the N iterations would give: N × the difference
    # that one ulp at the start makes on the CPU after N iterations
    cpu_n = hardsync("cpu", "w0", steps)
    reference = relative_difference(hardsync("cpu", "w0_ulp", steps), cpu_n)
    diff = relative_difference(hardsync(args.device, "w0", steps), cpu_n)
    label = (
        f"hardsync λ=2 b=32, {steps} iterations: {device} vs CPU (limit: {steps} × "
        f"{reference:.2e}, one ulp at the start, on the CPU)"
    )
    rows.append(row(label, diff, max(steps * reference, 1e-6)))

    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes), device=device)
    k, rb = 8, 8
    x, y = ds.train.batch(torch.arange(k * rb).view(k, rb))
    w = engine.initial_weights().expand(k, -1).clone()
    w += 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(device)
    batched, _ = engine.replica_gradients(w, x, y, path="grouped")
    loop, _ = engine.replica_gradients(w, x, y, path="loop")
    diff = relative_difference(batched, loop)
    # grouped convolutions and batched matmuls vs one by one: float32 summation order
    rows.append(row(f"k={k} batched replicas (grouped) vs one by one, b={rb}", diff, 1e-4))

    accuracy = {}
    for precision in ("fp32", "bf16-mixed"):
        if cap.over:
            break
        summary = run(
            data,
            args.device,
            tmp / f"prec_{precision}",
            {"name": "hardsync", "num_learners": 1, "batch_size": 64},
            precision=precision,
            max_samples=sizes.bf16_samples,
            max_epochs=0,
            eval_every_samples=0,
        )
        accuracy[precision] = summary["final_metric"]
    if len(accuracy) == 2:
        gap = 100 * abs(accuracy["bf16-mixed"] - accuracy["fp32"])
        label = (
            f"bf16-mixed vs fp32 accuracy after {sizes.bf16_samples} samples "
            f"({100 * accuracy['bf16-mixed']:.2f}% vs {100 * accuracy['fp32']:.2f}%), points"
        )
        rows.append(row(label, gap, sizes.bf16_limit_points))
    else:
        rows.append({"check": "bf16-mixed vs fp32", "value": "–", "limit": "–", "ok": None})
    for protocol in PROTOCOLS[:: 2 if args.smoke else 1]:
        if cap.over:
            rows.append({"check": f"{protocol['name']} runs", "value": "out of time"})
            continue
        summary = run(
            data,
            args.device,
            tmp / f"proto_{protocol['name']}",
            protocol,
            max_samples=16 * 4 * steps,
            max_epochs=0,
            eval_every_samples=0,
        )
        ok = summary["status"] == "completed" and math.isfinite(summary["final_metric"])
        value = f"{100 * summary['final_metric']:.1f}% after {summary['samples']} samples"
        rows.append({"check": f"{protocol['name']} runs on {device}", "value": value, "ok": ok})
    torch.backends.cudnn.allow_tf32 = True  # back to torch's defaults for the timings
    return rows


def row(check: str, value: float, limit: float) -> dict[str, Any]:
    return {"check": check, "value": f"{value:.2e}", "limit": f"{limit:g}", "ok": value <= limit}


# ---- 2. throughput ----------------------------------------------------------------------
def plain_loop_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def throughput(args, sizes, ds, device) -> list[dict[str, Any]]:
    cap = Cap(sizes.caps["throughput"])
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes), device=device)
    model = build_model("cnn", ds.input_shape, ds.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rows = []
    n = sizes.timed_iterations
    for b in sizes.batches:
        if cap.over:
            rows.append({"b": b, "note": "out of time"})
            continue
        x, y = (t.to(device) for t in ds.train.batch(torch.arange(b)))
        w = engine.initial_weights()
        one = b / timed(device, lambda: engine.gradient(w, x, y), n)  # noqa: B023
        plain = b / timed(device, lambda: plain_loop_step(model, opt, x, y), n)  # noqa: B023
        batched = {}
        for k in sizes.replicas:
            if cap.over or k * b > ds.num_train or k * b > 32_768:
                continue
            xk, yk = (t.to(device) for t in ds.train.batch(torch.arange(k * b).view(k, b)))
            wk = w.expand(k, -1).clone()
            secs = timed(device, lambda: engine.replica_gradients(wk, xk, yk), n)  # noqa: B023
            batched[k] = k * b / secs
        rows.append({"b": b, "one_learner": one, "plain_loop": plain, "batched": batched})
    return rows


# ---- 4. calibration ---------------------------------------------------------------------
def calibration(args, sizes, ds, device) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cap = Cap(sizes.caps["calibration"])
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes), device=device)
    # gradient() and replica_gradients() return their losses as floats: synchronised
    profile = calibrate(engine, ds, sizes.calibration_batches, sizes.calibration_repeats)
    # the same fit from the medians of the repeats (what a measured median step is)
    median_profile = calibrate(
        engine, ds, sizes.calibration_batches, sizes.calibration_repeats, statistics.median
    )
    ratios, _ = calibrate_replicas(
        engine, ds, args.sma_batch, sizes.max_replicas_calibrated, sizes.calibration_repeats
    )
    cluster = {
        "seconds_per_batch": profile.seconds_per_batch,
        "seconds_per_sample": profile.seconds_per_sample,
        "replica_ratios": ratios,
        "latency_s": 1e-5,
        "bandwidth_gbps": 100.0,
    }
    rows = []
    w = engine.initial_weights()
    for b in (*sizes.calibration_batches, 4 * sizes.calibration_batches[1], 2048):
        if cap.over:
            break
        if b > ds.num_train:
            continue
        x, y = ds.train.batch(torch.arange(b))
        iterations = sizes.calibration_repeats
        measured = timed(device, lambda: engine.gradient(w, x, y), iterations)  # noqa: B023
        predicted = profile.seconds_per_batch + b * profile.seconds_per_sample
        median_predicted = median_profile.seconds_per_batch + b * median_profile.seconds_per_sample
        rows.append(
            {
                "b": b,
                "predicted_s": predicted,
                "median_predicted_s": median_predicted,
                "measured_s": measured,
            }
        )
    return rows, cluster


# ---- 5. the replica step without launch overhead ------------------------------------------
def replica_step(args, sizes, ds, device) -> dict[str, Any]:
    """ReplicaStep at b = ``step_batch`` for each k and mode (samples/s, median of
    ``timed_iterations`` steps after its compilation or capture) against the plain loop
    at b = ``step_plain_batch``; each mode's state after 3 steps against eager's (TF32
    off). ``reduce-overhead`` compiles for tens of seconds per shape, so it runs at the k
    where the fastest other mode was fastest."""
    cap = Cap(sizes.caps["step"])
    b, n, k0 = sizes.step_batch, sizes.timed_iterations, sizes.step_replicas[0]
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes), device=device)
    w0 = engine.initial_weights()
    model = build_model("cnn", ds.input_shape, ds.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pb = sizes.step_plain_batch
    x, y = (t.to(device) for t in ds.train.batch(torch.arange(pb)))
    plain = pb / timed(device, lambda: plain_loop_step(model, opt, x, y), n)

    def inputs(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randperm(ds.num_train, generator=torch.Generator().manual_seed(seed))
        return tuple(t.to(device) for t in ds.train.batch(idx[: k * b].view(k, b)))

    def make(k: int, mode: str) -> ReplicaStep:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)  # the row names the fallback
            return ReplicaStep(engine, w0, k, b, 1 / k, mode=mode)

    equivalence = []
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    states = {}
    for mode in sizes.step_modes:
        step = make(k0, mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            for i in range(3):
                step.step(*inputs(k0, i), 0.05)
        states[mode] = (step.mode, step.fallback_reason, torch.cat([step.replicas[0], step.z]))
    for mode, (ran, reason, state) in states.items():
        if mode == "eager":
            continue
        diff = relative_difference(state, states["eager"][2])
        label = f"replica step k={k0} b={b}, 3 steps: {mode} vs eager"
        if ran != mode:
            label += f" (ran {ran}: {reason})"
        equivalence.append(row(label, diff, 1e-4))
    torch.backends.cudnn.allow_tf32 = True  # torch's defaults for the timings

    def throughput_of(k: int, mode: str) -> dict[str, Any]:
        step = make(k, mode)
        xk, yk = inputs(k, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            sync(device)
            t0 = time.perf_counter()
            step.warm_up(xk, yk)
            sync(device)
            prepare = time.perf_counter() - t0
            secs = timed(device, lambda: step.step(xk, yk, 0.01), n)
        return {
            "k": k,
            "mode": mode,
            "ran": step.mode,
            "samples_per_s": k * b / secs,
            "prepare_s": prepare,
        }

    rows = []
    for k in sizes.step_replicas:
        for mode in sizes.step_modes:
            if mode == "reduce-overhead":
                continue
            if cap.over:
                rows.append({"k": k, "mode": mode, "note": "out of time"})
                continue
            rows.append(throughput_of(k, mode))
    timed_rows = [r for r in rows if "samples_per_s" in r]
    if "reduce-overhead" in sizes.step_modes and timed_rows:
        k_best = max(timed_rows, key=lambda r: r["samples_per_s"])["k"]
        if cap.over:
            rows.append({"k": k_best, "mode": "reduce-overhead", "note": "out of time"})
        else:
            rows.append(throughput_of(k_best, "reduce-overhead"))
    return {"plain": plain, "plain_batch": pb, "batch": b, "rows": rows, "equivalence": equivalence}


def best_step_mode(step: dict[str, Any]) -> str:
    """Eager or ``cuda-graph``, whichever was faster and ran as asked: section 6 builds a
    new step per run, and ``reduce-overhead`` would compile for each."""
    ran = [
        r
        for r in step["rows"]
        if r.get("ran") == r.get("mode") and r.get("mode") in ("eager", "cuda-graph")
    ]
    return max(ran, key=lambda r: r["samples_per_s"])["mode"] if ran else "eager"


# ---- 6. time to target in Crossbow's regime -----------------------------------------------
def regime(args, sizes, ds, note, device, mode: str) -> list[dict[str, Any]]:
    """bench/crossbow_regime.py's runs (plain loop over b with its lr and warm-up; SMA
    with ``mode``'s step) for each seed, seeds interleaved so that a cap leaves whole
    seeds; training seconds exclude evaluation and the step's compilation."""
    if not args.smoke and note != "Fashion-MNIST":
        return [{"run": "skipped", "note": "needs Fashion-MNIST (--data-root)"}]
    import crossbow_regime as cr  # bench/, beside this script

    cap = Cap(sizes.caps["regime"])
    r = sizes.regime if args.smoke else REGIMES[args.regime]
    opts = argparse.Namespace(
        model=r["model"],
        target=r["target"],
        eval_every=r["eval_every"],
        max_epochs=r["max_epochs"],
        mode=mode,
    )
    n = min(r["train_samples"], ds.num_train)
    xs, ys = (t.to(device) for t in ds.train.batch(torch.arange(n)))
    test = tuple(
        t.to(device) for t in ds.test.batch(torch.arange(min(r["test_samples"], ds.num_test)))
    )
    rows = []
    for seed in r["seeds"]:
        for b, lr, warm in r["plain"]:
            if cap.over:
                rows.append(
                    {
                        "run": f"plain b={b} lr={lr} warmup={warm}",
                        "seed": seed,
                        "note": "out of time",
                    }
                )
                continue
            res = cr.plain_run(ds, xs, ys, test, device, b, lr, warm, opts, seed)
            rows.append({**res, "seed": seed})
        for k, b, lr in r["sma"]:
            if cap.over:
                rows.append(
                    {"run": f"SMA k={k} b={b} lr={lr}", "seed": seed, "note": "out of time"}
                )
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConfigWarning)
                res = cr.sma_run(ds, xs, ys, test, device, k, b, lr, opts, seed)
            rows.append({**res, "seed": seed})
    return rows


def regime_summary(rows: list[dict[str, Any]], seeds: int) -> list[dict[str, Any]]:
    """Per run: median over the seeds of training seconds and samples to the target
    (None unless every seed ran and reached it)."""
    out = []
    for name in dict.fromkeys(r["run"] for r in rows if "note" not in r):
        runs = [r for r in rows if r["run"] == name and "note" not in r]
        secs = [r["train_s_to_target"] for r in runs]
        samples = [r["samples_to_target"] for r in runs]
        whole = len(runs) == seeds and all(v is not None for v in secs)
        out.append(
            {
                "run": name,
                "seeds": len(runs),
                "reached": sum(v is not None for v in secs),
                "median_s": statistics.median(secs) if whole else None,
                "median_samples": statistics.median(samples) if whole else None,
                "best": max(r["best"] for r in runs),
            }
        )
    return out


# ---- 3. time to 90% ---------------------------------------------------------------------
def plain_loop_tta(ds, device, b: int, lr: float, sizes: Sizes) -> dict:
    """A plain PyTorch loop to the target test accuracy: data on the device, a new
    permutation each epoch, evaluation every ``sizes.eval_every_samples`` (its time
    excluded), at most ``sizes.tta_run_seconds`` of training."""
    target, seconds, every = sizes.tta_target, sizes.tta_run_seconds, sizes.eval_every_samples
    torch.manual_seed(0)
    model = build_model("cnn", ds.input_shape, ds.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    xs, ys = (t.to(device) for t in ds.train.batch(torch.arange(ds.num_train)))
    test_x, test_y = (t.to(device) for t in ds.test.batch(torch.arange(ds.num_test)))
    train_s, samples, next_eval, best = 0.0, 0, every, 0.0
    while train_s < seconds:
        order = torch.randperm(ds.num_train, device=device)
        for start in range(0, ds.num_train - b + 1, b):
            sync(device)
            t0 = time.perf_counter()
            idx = order[start : start + b]
            plain_loop_step(model, opt, xs[idx], ys[idx])
            sync(device)
            train_s += time.perf_counter() - t0
            samples += b
            if samples >= next_eval:
                next_eval += every
                with torch.no_grad():
                    model.eval()
                    right = sum(
                        int((model(test_x[i : i + 500]).argmax(1) == test_y[i : i + 500]).sum())
                        for i in range(0, ds.num_test, 500)
                    )
                    model.train()
                best = max(best, right / ds.num_test)
                if best >= target:
                    return {"b": b, "lr": lr, "seconds": train_s, "samples": samples, "acc": best}
            if train_s >= seconds:
                break
    return {"b": b, "lr": lr, "seconds": None, "samples": samples, "acc": best}


def time_to_target(args, sizes, data, ds, note, device, cluster, tmp) -> list[dict[str, Any]]:
    if not args.smoke and note != "Fashion-MNIST":
        return [{"run": "skipped", "note": "needs Fashion-MNIST (--data-root)"}]
    cap = Cap(sizes.caps["tta"])
    rows = []
    for b, k in sizes.sma_runs:
        if cap.over:
            rows.append({"run": f"SMA b={b} k={k}", "note": "out of time"})
            continue
        auto = k == "auto"
        summary = run(
            data,
            args.device,
            tmp / f"tta_sma_{b}_{k}",
            {
                "name": "sma",
                "num_learners": 1 if auto else k,
                "replicas_per_device": k,
                "batch_size": b,
                "alpha": 0.0,
                # the marginal rule follows a rising throughput curve (replicas.py)
                "autotune_rule": "marginal",
                "autotune_interval": 50,
                "autotune_max_replicas": sizes.replicas[-1],
            },
            lr=sizes.sma_lr,
            cluster=cluster,
            target=sizes.tta_target,
            stop_at_target=True,
            max_seconds=sizes.tta_run_seconds,
            eval_every_samples=sizes.eval_every_samples,
            max_epochs=0,
        )
        name = f"SMA b={b} k=" + (
            f"auto (ended at k={summary['replicas_per_device']})" if auto else str(k)
        )
        rows.append(
            {
                "run": name,
                "seconds": summary["time_to_target_s"] if summary["reached"] else None,
                "simulated": summary["time_to_target_virtual_s"],
                "samples": summary["samples_to_target"] or summary["samples"],
                "acc": summary["best_metric"],
            }
        )
    for b in sizes.plain_batches:
        for lr in sizes.plain_lrs:
            if cap.over:
                rows.append({"run": f"plain loop b={b} lr={lr}", "note": "out of time"})
                continue
            r = plain_loop_tta(ds, device, b, lr, sizes)
            rows.append({"run": f"plain loop b={b} lr={lr}", **r})
    return rows


# ---- report -----------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def fmt(v: Any, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def markdown(meta, equiv, thr, calib, tta, step=None, regime_rows=()) -> str:
    out = [f"# GPU checks on {meta['device_name']}", ""]
    out.append(
        f"`{meta['command']}` · torch {meta['torch']} · data: {meta['data']} · "
        f"{meta['wall_s']:.0f} s in all ("
        + ", ".join(f"section {k}: {v:.0f} s" for k, v in meta["section_s"].items())
        + f") · load average {meta['load_before']} → "
        f"{meta['load_after']}"
    )
    blocks: dict[str, list[str]] = {}  # per section; those that ran are printed
    head, out = out, blocks.setdefault("1", [])
    out += ["", "## 1. Equivalence", "", "| check | value | limit | ok |", "|---|---|---|---|"]
    for r in equiv:
        ok = {True: "yes", False: "**NO**", None: "–"}[r.get("ok")]
        out.append(f"| {r['check']} | {r.get('value', '–')} | {r.get('limit', '–')} | {ok} |")
    ks = sorted({k for r in thr for k in r.get("batched", {})})
    out = blocks.setdefault("2", [])
    out += ["", "## 2. Throughput (samples/s)", ""]
    out.append(
        "| b | one learner | plain loop | " + " | ".join(f"k={k} batched" for k in ks) + " |"
    )
    out.append("|---" * (3 + len(ks)) + "|")
    for r in thr:
        if "note" in r:
            out.append(f"| {r['b']} | {r['note']} |")
            continue
        cells = [fmt(r["batched"].get(k), ".0f") for k in ks]
        out.append(
            f"| {r['b']} | {r['one_learner']:.0f} | {r['plain_loop']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    small = next((r for r in thr if r.get("b") == min(t["b"] for t in thr)), None)
    if small and small.get("batched"):
        k_best = max(small["batched"], key=small["batched"].get)
        ratio = small["batched"][k_best] / small["one_learner"]
        out.append(
            f"\nBest batched at b={small['b']}: k={k_best}, {ratio:.1f}× one learner "
            f"(issue 15 asks for >= 5×)."
        )
    out = blocks.setdefault("4", [])
    out += ["", "## 4. Calibrated profile vs measured", ""]
    out += [
        "| b | predicted s/iteration (fastest repeats) | measured s/iteration (median) | "
        "measured / predicted | predicted (median fit) | predicted / measured (target "
        "0.85–1.15) |",
        "|---|---|---|---|---|---|",
    ]
    for r in calib:
        ratio = r["measured_s"] / r["predicted_s"] if r["predicted_s"] > 0 else None
        med = r.get("median_predicted_s")
        med_ratio = None if med is None else med / r["measured_s"]
        out.append(
            f"| {r['b']} | {r['predicted_s']:.3g} | {r['measured_s']:.3g} | {fmt(ratio, '.2f')} "
            f"| {fmt(med)} | {fmt(med_ratio, '.2f')} |"
        )
    ratios = meta["cluster"].get("replica_ratios") or []
    out.append(f"\nReplica ratios t(k)/t(1) at b={meta['sma_batch']}: {fmt_list(ratios)}")
    out = blocks.setdefault("3", [])
    out += ["", "## 3. Time to target", ""]
    out += [
        "| run | training seconds to target | simulated seconds (section 4's profile) "
        "| samples | best accuracy |",
        "|---|---|---|---|---|",
    ]
    for r in tta:
        if "note" in r:
            out.append(f"| {r['run']} | {r['note']} | | | |")
            continue
        out.append(
            f"| {r['run']} | {fmt(r['seconds'])} | {fmt(r.get('simulated'))} | "
            f"{fmt(r['samples'], 'd')} | "
            f"{100 * r['acc']:.2f}% |"
        )
    blocks["5"] = step_markdown(step)
    blocks["6"] = regime_markdown(regime_rows, meta)
    sma = [r for r in tta if r["run"].startswith("SMA") and r.get("seconds")]
    plain = [r for r in tta if r["run"].startswith("plain") and r.get("seconds")]
    if sma and plain:
        best = min(plain, key=lambda r: r["seconds"])
        for r in sma:
            out.append(
                f"\n{r['run']} / best plain loop ({best['run']}): "
                f"{r['seconds'] / best['seconds']:.2f} (issue 15's target: <= 0.5)."
            )
    for name in meta["section_s"]:
        head += blocks[name]
    return "\n".join(head) + "\n"


def step_markdown(step: dict[str, Any] | None) -> list[str]:
    if not step:
        return []
    out = ["", "## 5. Replica step without per-step launches (cnn)", ""]
    out += ["| check | value | limit | ok |", "|---|---|---|---|"]
    for r in step["equivalence"]:
        out.append(
            f"| {r['check']} | {r['value']} | {r['limit']} | {'yes' if r['ok'] else '**NO**'} |"
        )
    b, pb, plain = step["batch"], step["plain_batch"], step["plain"]
    out += [
        "",
        f"| k × b={b} | mode | ran | samples/s | / plain loop at b={pb} ({plain:.0f}) | "
        "compile/capture s |",
        "|---|---|---|---|---|---|",
    ]
    for r in step["rows"]:
        if "note" in r:
            out.append(f"| {r['k']} | {r['mode']} | {r['note']} | | | |")
            continue
        out.append(
            f"| {r['k']} | {r['mode']} | {r['ran']} | {r['samples_per_s']:.0f} | "
            f"{r['samples_per_s'] / plain:.2f} | {r['prepare_s']:.1f} |"
        )
    timed_rows = [r for r in step["rows"] if "samples_per_s" in r]
    if timed_rows:
        best = max(timed_rows, key=lambda r: r["samples_per_s"])
        out.append(
            f"\nBest at b={b}: k={best['k']} {best['ran']}, {best['samples_per_s'] / plain:.2f}× "
            f"the plain loop at b={pb} (issue 44's target: >= 0.8)."
        )
    return out


def regime_markdown(rows, meta) -> list[str]:
    if not rows:
        return []
    r0 = meta["regime"]
    out = ["", "## 6. Time to target in Crossbow's regime", ""]
    out.append(
        f"{r0['model']} on the first {r0['train_samples']} training samples ({meta['data']}), "
        f"target {100 * r0['target']:.1f}% on the first {r0['test_samples']} test samples, "
        f"seeds {list(r0['seeds'])}; SMA's step mode: {meta['regime_mode']}."
    )
    if any(r.get("note") == "needs Fashion-MNIST (--data-root)" for r in rows):
        return [*out, "", "Skipped: needs Fashion-MNIST (--data-root)."]
    summary = regime_summary(rows, len(r0["seeds"]))
    out += [
        "",
        "| run | seeds reached | median training s to target | median samples | best acc |",
        "|---|---|---|---|---|",
    ]
    for r in summary:
        out.append(
            f"| {r['run']} | {r['reached']}/{r['seeds']} | {fmt(r['median_s'])} | "
            f"{fmt(r['median_samples'], '.0f')} | {100 * r['best']:.2f}% |"
        )
    missing = sorted({r["run"] for r in rows if "note" in r})
    if missing:
        out.append(f"\nOut of time: {', '.join(missing)}.")
    sma = [r for r in summary if r["run"].startswith("SMA") and r["median_s"]]
    plain = [r for r in summary if r["run"].startswith("plain") and r["median_s"]]
    if sma and plain:
        best_p = min(plain, key=lambda r: r["median_s"])
        best_s = min(sma, key=lambda r: r["median_s"])
        out.append(
            f"\nSMA / best plain loop, median of the seeds: {best_s['run']} / {best_p['run']} "
            f"= {best_s['median_s'] / best_p['median_s']:.2f} (issue 44's target: <= 0.8)."
        )
    return out


def fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) or "–"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, synthetic data")
    ap.add_argument("--data-root", default="", help="folder of the Fashion-MNIST .gz files")
    ap.add_argument("--sma-batch", type=int, default=16)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument(
        "--sections",
        default="1,2,4,3",
        help="comma-separated sections to run, in this order (default 1,2,4,3; issue 44's "
        "rows: 4,5,6; section 6 runs SMA in the mode section 5 found fastest, eager "
        "without it)",
    )
    ap.add_argument(
        "--regime",
        default="mlp",
        choices=sorted(REGIMES),
        help="section 6's workload (default mlp: 3 seeds on the CPU; cnn: 1 seed)",
    )
    args = ap.parse_args(argv)
    wanted = args.sections.split(",")
    if not wanted or any(w not in ("1", "2", "3", "4", "5", "6") for w in wanted):
        print(f"gpu_check: --sections {args.sections}: expected numbers 1 to 6", file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused below
    if device.type not in ("cpu", "cuda"):
        print(f"gpu_check: --device {args.device}: expected cpu, cuda or cuda:N", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device}: this machine has no CUDA device", file=sys.stderr
        )
        return 2
    sizes = SMOKE if args.smoke else FULL
    t0, load_before = time.perf_counter(), os.getloadavg()
    data, ds, note = load_data(args, sizes)
    section_s: dict[str, float] = {}

    def section(name: str, fn: Callable[[], Any], empty: Any = ()) -> Any:
        if name not in wanted:
            return empty
        start = time.perf_counter()
        result = fn()
        section_s[name] = time.perf_counter() - start
        return result

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        equiv = section("1", lambda: equivalence(args, sizes, data, ds, device, tmp), [])
        thr = section("2", lambda: throughput(args, sizes, ds, device), [])
        calib, cluster = section(
            "4", lambda: calibration(args, sizes, ds, device), ([], {"replica_ratios": []})
        )
        tta = section(
            "3", lambda: time_to_target(args, sizes, data, ds, note, device, cluster, tmp), []
        )
        step = section("5", lambda: replica_step(args, sizes, ds, device), None)
        mode = best_step_mode(step) if step else "eager"
        regime_rows = section("6", lambda: regime(args, sizes, ds, note, device, mode), [])
    regime_sizes = sizes.regime if args.smoke else REGIMES[args.regime]
    meta = {
        "device_name": device_name(device),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "data": note,
        "wall_s": time.perf_counter() - t0,
        "load_before": " ".join(f"{v:.2f}" for v in load_before),
        "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "cluster": cluster,
        "sma_batch": args.sma_batch,
        "section_s": section_s,
        "regime": {**regime_sizes, "seeds": list(regime_sizes["seeds"])},
        "regime_mode": mode,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", meta["device_name"]).strip("_").lower()
    text = markdown(meta, equiv, thr, calib, tta, step, regime_rows)
    (out / f"gpu_check_{slug}.md").write_text(text)
    figures = {"meta": meta, "equivalence": equiv, "throughput": thr, "calibration": calib}
    figures.update(tta=tta, replica_step=step, regime=regime_rows)
    (out / f"gpu_check_{slug}.json").write_text(json.dumps(figures, indent=1))
    print(text)
    failed = [*equiv, *(step["equivalence"] if step else [])]
    return 1 if any(r.get("ok") is False for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
