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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's distsgd

from distsgd import api  # noqa: E402
from distsgd.config import DataConfig, RunConfig  # noqa: E402
from distsgd.data import Dataset, DatasetError, load_dataset  # noqa: E402
from distsgd.engine import GradientEngine  # noqa: E402
from distsgd.metrics import load_checked, save_checked  # noqa: E402
from distsgd.models import build_model  # noqa: E402
from distsgd.runtime.sim import calibrate, calibrate_replicas  # noqa: E402


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
    caps={"equivalence": 50.0, "throughput": 50.0, "calibration": 25.0, "tta": 130.0},
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
    caps={"equivalence": 60.0, "throughput": 10.0, "calibration": 10.0, "tta": 10.0},
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
        rows.append({"b": b, "predicted_s": predicted, "measured_s": measured})
    return rows, cluster


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


def markdown(meta, equiv, thr, calib, tta) -> str:
    out = [f"# GPU checks on {meta['device_name']}", ""]
    out.append(
        f"`{meta['command']}` · torch {meta['torch']} · data: {meta['data']} · "
        f"{meta['wall_s']:.0f} s in all ("
        + ", ".join(f"section {k}: {v:.0f} s" for k, v in meta["section_s"].items())
        + f") · load average {meta['load_before']} → "
        f"{meta['load_after']}"
    )
    out += ["", "## 1. Equivalence", "", "| check | value | limit | ok |", "|---|---|---|---|"]
    for r in equiv:
        ok = {True: "yes", False: "**NO**", None: "–"}[r.get("ok")]
        out.append(f"| {r['check']} | {r.get('value', '–')} | {r.get('limit', '–')} | {ok} |")
    ks = sorted({k for r in thr for k in r.get("batched", {})})
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
    out += ["", "## 4. Calibrated profile vs measured", ""]
    out += ["| b | predicted s/iteration | measured s/iteration | ratio |", "|---|---|---|---|"]
    for r in calib:
        ratio = r["measured_s"] / r["predicted_s"] if r["predicted_s"] > 0 else None
        out.append(
            f"| {r['b']} | {r['predicted_s']:.3g} | {r['measured_s']:.3g} | {fmt(ratio, '.2f')} |"
        )
    ratios = meta["cluster"].get("replica_ratios") or []
    out.append(f"\nReplica ratios t(k)/t(1) at b={meta['sma_batch']}: {fmt_list(ratios)}")
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
    sma = [r for r in tta if r["run"].startswith("SMA") and r.get("seconds")]
    plain = [r for r in tta if r["run"].startswith("plain") and r.get("seconds")]
    if sma and plain:
        best = min(plain, key=lambda r: r["seconds"])
        for r in sma:
            out.append(
                f"\n{r['run']} / best plain loop ({best['run']}): "
                f"{r['seconds'] / best['seconds']:.2f} (issue 15's target: <= 0.5)."
            )
    return "\n".join(out) + "\n"


def fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) or "–"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, synthetic data")
    ap.add_argument("--data-root", default="", help="folder of the Fashion-MNIST .gz files")
    ap.add_argument("--sma-batch", type=int, default=16)
    ap.add_argument("--out", default="bench/results/gpu")
    args = ap.parse_args(argv)
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

    def section(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        section_s[name] = time.perf_counter() - start
        return result

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        equiv = section("1", lambda: equivalence(args, sizes, data, ds, device, tmp))
        thr = section("2", lambda: throughput(args, sizes, ds, device))
        calib, cluster = section("4", lambda: calibration(args, sizes, ds, device))
        tta = section(
            "3", lambda: time_to_target(args, sizes, data, ds, note, device, cluster, tmp)
        )
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
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", meta["device_name"]).strip("_").lower()
    text = markdown(meta, equiv, thr, calib, tta)
    (out / f"gpu_check_{slug}.md").write_text(text)
    figures = {"meta": meta, "equivalence": equiv, "throughput": thr, "calibration": calib}
    (out / f"gpu_check_{slug}.json").write_text(json.dumps({**figures, "tta": tta}, indent=1))
    print(text)
    return 1 if any(r.get("ok") is False for r in equiv) else 0


if __name__ == "__main__":
    sys.exit(main())
