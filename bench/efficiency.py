"""Hardware efficiency: achieved FLOP/s of training paths against this machine's fp32 peak.

For each model (``--models``) and per-learner batch b (``--batches``), side by side in one
run, interleaved (every round measures every path once; median of ``--repeats`` rounds):

* ``loop`` — a plain PyTorch training loop in this process: the model,
  ``torch.optim.SGD`` (momentum 0.9), cross-entropy, data already in memory;
* ``sim`` — one distsgd learner on the simulated runtime (``protocol.name = "plain"``,
  λ = 1, a fixed device profile so nothing is calibrated, ``train.evaluate = false``);
  samples / ``train_wall_s`` of its summary (training only);
* ``sim_compiled`` — ``sim`` with ``train.compile = "on"`` (``torch.compile``, inductor),
  compilation included: it runs in the first timed step;
* ``dist`` — distsgd hardsync on 2 real processes (``runtime = "dist"``,
  ``train.num_threads = 1`` each); samples / ``train_wall_s`` (rank 0's, training only);
* ``ddp`` — plain PyTorch DDP on 2 processes under torch's launcher, one thread each
  (``bench/ddp_throughput.py``);
* ``replicas`` — k replicas as one batched computation (Crossbow),
  ``GradientEngine.replica_gradients(weights [k, P], x [k, b, ...], y [k, b])`` with the
  path distsgd chooses (``choose_path``: grouped / bmm / vmap, or one by one), for every k
  in ``--replicas``; k·b samples per call, gradients only (no update), one untimed
  warm-up call per measurement.

Every other path is timed from its first step (as ``distsgd train`` counts
``train_wall_s``): the set-up of processes, data and model is excluded. All paths train on
the same data (Fashion-MNIST through ``distsgd.data.load_dataset``, or ``--synthetic``:
distsgd's synthetic set of the same shape, seed 0).

Definitions:

* FLOPs per sample — forward + backward of one training step at batch b counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (2 per multiply-add of matrix products
  and convolutions; elementwise operations, pooling, the loss and the optimizer step are
  not counted), divided by b. The backward of a layer costs twice its forward (input and
  weight gradients) except for the first layer, whose input needs no gradient.
* peak — FLOP/s of a ``--peak-size``² fp32 matrix product (2·n³ FLOPs), median of
  ``--peak-repeats`` timed products after a warm-up, with all cores (``--threads``) and
  with one (``torch.set_num_threads``), measured again in every round (median of rounds).
* achieved FLOP/s = samples/s × FLOPs per sample; fraction of peak = achieved / peak.

    flock /tmp/distsgd-bench.lock python bench/efficiency.py --models mlp cnn lenet \\
        resnet20 --repeats 3 --profile loop:8 --out bench/results/efficiency
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import distsgd
from distsgd.batched import choose_path
from distsgd.data import Dataset, load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import MODELS, build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from ddp_throughput import data_config  # noqa: E402

PATHS = ("loop", "sim", "sim_compiled", "dist", "ddp", "replicas")
IN_PROCESS = ("loop", "sim", "sim_compiled", "replicas")
NUM_PROCESSES = 2  # the dist and ddp paths
LABELS = {
    "loop": "plain PyTorch loop",
    "sim": "distsgd sim, 1 learner",
    "sim_compiled": "distsgd sim, 1 learner, train.compile = on",
    "dist": "distsgd dist hardsync, 2 processes",
    "ddp": "PyTorch DDP, 2 processes",
}


def label(path: str, k: int) -> str:
    """Display name of a path (``replicas`` with its k)."""
    return f"{k} batched replicas" if path == "replicas" else LABELS[path]


# ---- FLOPs and peak ------------------------------------------------------------------------


def training_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """FLOPs of one training step's forward and of its forward + backward (mean
    cross-entropy over the minibatch), per sample, as ``FlopCounterMode`` counts them.

    Args:
        model: in train mode; x: inputs ``[b, C, H, W]``; y: labels ``[b]``.

    Returns:
        (forward FLOPs per sample, forward + backward FLOPs per sample).
    """
    model.train()
    b = y.shape[0]
    with FlopCounterMode(display=False) as fwd:
        logits = model(x)
    with FlopCounterMode(display=False) as bwd:
        F.cross_entropy(logits, y).backward()
    model.zero_grad(set_to_none=True)
    f = fwd.get_total_flops()
    return f / b, (f + bwd.get_total_flops()) / b


def matmul_peak(size: int, repeats: int, threads: int) -> dict[str, float]:
    """fp32 FLOP/s of an n × n matrix product (2·n³ FLOPs) with ``threads`` torch threads.

    Returns:
        ``median`` and ``best`` FLOP/s over ``repeats`` timed products (after two
        untimed), and ``threads``. The caller's thread setting is restored.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=g)
        b = torch.randn(size, size, generator=g)
        c = torch.empty(size, size)
        for _ in range(2):
            torch.mm(a, b, out=c)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    flops = 2.0 * size**3
    return {
        "median": flops / statistics.median(times),
        "best": flops / min(times),
        "threads": threads,
    }


# ---- the paths -----------------------------------------------------------------------------


def budget(samples: int, min_steps: int, global_batch: int) -> int:
    """Training samples of one measurement: at least ``samples`` and ``min_steps`` steps,
    rounded up to whole steps of ``global_batch`` samples."""
    steps = max(min_steps, -(-samples // global_batch))
    return steps * global_batch


def plain_loop(ds: Dataset, model_name: str, b: int, samples: int, lr: float) -> float:
    """Samples/s of a textbook loop (SGD momentum 0.9, cross-entropy) over ``samples``
    samples of ``ds`` in batches of b, each epoch a fresh permutation; timed from the
    first step, model and optimizer built outside the timing."""
    torch.manual_seed(0)
    model = build_model(model_name, ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    n = ds.num_train
    per_epoch = n // b
    steps = samples // b
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g)
    t0 = time.perf_counter()
    for step in range(steps):
        s = step % per_epoch
        if s == 0 and step:
            perm = torch.randperm(n, generator=g)
        idx = perm[s * b : (s + 1) * b]
        loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    float(loss.detach())
    return steps * b / (time.perf_counter() - t0)


def distsgd_overrides(args: argparse.Namespace, model_name: str, b: int, samples: int) -> list[str]:
    """Settings common to the ``sim`` and ``dist`` paths: ``samples`` training samples,
    no evaluation, no target, a fixed device profile (no calibration)."""
    data = (
        [
            "data.dataset=synthetic",
            f"data.num_train={args.synthetic_train}",
            f"data.num_test={data_config(args.synthetic_train).num_test}",
        ]
        if args.synthetic
        else ["data.dataset=fashion_mnist"]
    )
    return [
        *data,
        f"model.name={model_name}",
        f"protocol.batch_size={b}",
        f"optimizer.lr={args.lr}",
        "optimizer.momentum=0.9",
        f"train.max_samples={samples}",
        "train.max_epochs=0",
        "train.target=0",
        "train.evaluate=false",
        "train.checkpoint_every_evals=0",
        "train.tensorboard=false",
        "train.seed=0",
        "cluster.seconds_per_sample=1e-4",
        "cluster.seconds_per_batch=1e-3",
    ]


def distsgd_throughput(overrides: list[str]) -> float:
    """Samples / ``train_wall_s`` of one ``distsgd.train`` run (training only)."""
    with tempfile.TemporaryDirectory() as d:
        s = distsgd.train(None, overrides=overrides, out_dir=Path(d) / "run")
    return s["samples"] / s["train_wall_s"]


def sim_path(args: argparse.Namespace, model_name: str, b: int, samples: int) -> float:
    """Samples/s of one distsgd learner on the simulated runtime, ``--threads`` threads."""
    ov = distsgd_overrides(args, model_name, b, samples)
    ov += ["protocol.name=plain", "protocol.num_learners=1", f"train.num_threads={args.threads}"]
    return distsgd_throughput(ov)


def sim_compiled_path(args: argparse.Namespace, model_name: str, b: int, samples: int) -> float:
    """``sim`` with ``train.compile = "on"``: the compilation happens in the first step,
    so it is inside ``train_wall_s`` (what a run of this length pays for it)."""
    ov = distsgd_overrides(args, model_name, b, samples)
    ov += ["protocol.name=plain", "protocol.num_learners=1", f"train.num_threads={args.threads}"]
    return distsgd_throughput([*ov, "train.compile=on"])


def dist_path(args: argparse.Namespace, model_name: str, b: int, samples: int) -> float:
    """Samples/s (global) of distsgd hardsync on 2 processes of ``--dist-threads`` each."""
    ov = distsgd_overrides(args, model_name, b, samples)
    ov += [
        "runtime=dist",
        "protocol.name=hardsync",
        f"protocol.num_learners={NUM_PROCESSES}",
        f"dist.num_processes={NUM_PROCESSES}",
        f"train.num_threads={args.dist_threads}",
    ]
    return distsgd_throughput(ov)


def ddp_path(args: argparse.Namespace, model_name: str, b: int, samples: int) -> float:
    """Samples/s (global) of ``bench/ddp_throughput.py`` under torch's launcher."""
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "ddp.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(NUM_PROCESSES), str(ROOT / "bench" / "ddp_throughput.py"),
            "--model", model_name, "--batch", str(b), "--samples", str(samples),
            "--lr", str(args.lr), "--threads", str(args.dist_threads),
            "--synthetic-train", str(args.synthetic_train if args.synthetic else 0),
            "--out", str(result),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.dist_threads)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(result.read_text())["throughput_samples_per_s"]


def replicas_path(ds: Dataset, model_name: str, k: int, b: int, samples: int) -> tuple[float, str]:
    """Samples/s of k replicas' gradients as ``replica_gradients`` computes them (path
    ``auto``), over ⌈samples / (k·b)⌉ calls on fresh minibatches after one untimed call.

    Returns:
        (samples/s, the path taken: ``grouped``, ``bmm``, ``vmap`` or ``loop``).
    """
    torch.manual_seed(0)
    engine = GradientEngine(build_model(model_name, ds.input_shape, ds.num_classes))
    g = torch.Generator().manual_seed(k * 1000 + b)
    w = engine.initial_weights().expand(k, -1).clone()
    w += 0.01 * torch.randn(w.shape, generator=g)  # replicas differ, as after a few steps
    calls = -(-samples // (k * b))
    idx = torch.randint(0, ds.num_train, (calls + 1, k, b), generator=g)
    engine.replica_gradients(w, ds.train_x[idx[0]], ds.train_y[idx[0]])
    t0 = time.perf_counter()
    for i in range(1, calls + 1):
        engine.replica_gradients(w, ds.train_x[idx[i]], ds.train_y[idx[i]])
    return calls * k * b / (time.perf_counter() - t0), choose_path(engine.model, k, b)


def measure(
    args: argparse.Namespace, ds: Dataset, path: str, model_name: str, b: int, k: int
) -> tuple[float, str]:
    """One measurement of ``path``: (samples/s, a note for the table)."""
    torch.set_num_threads(args.threads)  # distsgd.train sets its own; in-process paths
    processes = NUM_PROCESSES if path in ("dist", "ddp") else 1
    samples = budget(args.samples, args.min_steps, processes * b)
    if path == "loop":
        return plain_loop(ds, model_name, b, samples, args.lr), ""
    if path == "sim":
        return sim_path(args, model_name, b, samples), ""
    if path == "sim_compiled":
        return sim_compiled_path(args, model_name, b, samples), ""
    if path == "dist":
        return dist_path(args, model_name, b, samples), ""
    if path == "ddp":
        return ddp_path(args, model_name, b, samples), ""
    rate, chosen = replicas_path(ds, model_name, k, b, samples)
    return rate, f"path {chosen}"


def cells(args: argparse.Namespace) -> list[tuple[str, int, str, int]]:
    """(model, b, path, k) of every measurement of one round, in round order."""
    out = []
    for m in args.models:
        for b in args.batches:
            for p in args.paths:
                for k in args.replicas if p == "replicas" else [1]:
                    out.append((m, b, p, k))
    return out


def run_rounds(args: argparse.Namespace, ds: Dataset) -> tuple[dict, dict, dict, list]:
    """``--repeats`` interleaved rounds: both peaks, then every cell once.

    Returns:
        (peaks: {"all"|"one": [per-round dicts]}, rates: {cell: [samples/s per round]},
        notes per cell, load averages per round).
    """
    peaks: dict[str, list[dict]] = {"all": [], "one": []}
    rates: dict[tuple, list[float]] = {c: [] for c in cells(args)}
    notes: dict[tuple, str] = {}
    loads = []
    for r in range(args.repeats):
        peaks["all"].append(matmul_peak(args.peak_size, args.peak_repeats, args.threads))
        peaks["one"].append(matmul_peak(args.peak_size, args.peak_repeats, 1))
        print(
            f"round {r + 1}: peak {peaks['all'][-1]['median'] / 1e9:.1f} GFLOP/s all cores, "
            f"{peaks['one'][-1]['median'] / 1e9:.1f} one core",
            flush=True,
        )
        for cell in rates:
            m, b, p, k = cell
            rate, notes[cell] = measure(args, ds, p, m, b, k)
            rates[cell].append(rate)
            print(f"round {r + 1}: {m} b={b} {label(p, k)}: {rate:.0f} samples/s", flush=True)
        loads.append(os.getloadavg())
    return peaks, rates, notes, loads


# ---- compile cost and memory format (one-off side-by-side measurements) --------------------


def batches_of(ds: Dataset, b: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` random minibatches (x, y) of b training samples of ``ds``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, ds.num_train, (count, b), generator=g)
    return [(ds.train_x[i], ds.train_y[i]) for i in idx]


def first_compiled_step(ds: Dataset, model_name: str, b: int, chunks: int, cache: bool) -> float:
    """Seconds of a fresh ``compile = "on"`` engine's first gradient (b samples in
    ``chunks`` learners' chunks): tracing and inductor's compilation, plus one step.
    ``cache = False``: inductor's on-disk caches off (a user's first run); True: on, after
    one compilation of the same graph (every later run on this machine)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(model_name, ds.input_shape, ds.num_classes)
    engine = GradientEngine(model, compile="on")
    (x, y), w = batches_of(ds, b, 1, seed=1)[0], engine.initial_weights()
    with torch._inductor.config.patch(force_disable_caches=not cache):
        t0 = time.perf_counter()
        engine.gradient(w, x, y, num_chunks=chunks)
        seconds = time.perf_counter() - t0
    if not engine.compiled:
        raise RuntimeError("compilation failed (see the warning): nothing to measure")
    return seconds


def compile_cost(ds: Dataset, model_name: str, b: int, chunks: int, steps: int) -> dict:
    """``train.compile`` in a run's terms: the first compiled step (caches off; on) and
    the seconds per gradient of the eager and the compiled engine at b samples, timed
    alternately step by step (same weights, same minibatches) after one warm-up each."""
    cold = first_compiled_step(ds, model_name, b, chunks, cache=False)
    first_cached = first_compiled_step(ds, model_name, b, chunks, cache=True)
    warm = first_compiled_step(ds, model_name, b, chunks, cache=True)
    torch._dynamo.reset()
    engines = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        engines[mode] = GradientEngine(build_model(model_name, ds.input_shape, ds.num_classes),
                                       compile=mode)  # fmt: skip
    w = engines["off"].initial_weights()
    data = batches_of(ds, b, steps + 1, seed=2)
    seconds = {"off": [], "on": []}
    for i, (x, y) in enumerate(data):
        for mode, engine in engines.items():
            t0 = time.perf_counter()
            engine.gradient(w, x, y, num_chunks=chunks)
            if i:  # step 0 is the warm-up (the compiled engine compiles there)
                seconds[mode].append(time.perf_counter() - t0)
    eager, compiled = (statistics.median(seconds[m]) for m in ("off", "on"))
    saving = eager - compiled
    return {
        "model": model_name, "b": b, "chunks": chunks, "steps": steps,
        "first_step_s_cold": cold, "first_step_s_first_cached": first_cached,
        "first_step_s_warm": warm, "eager_s_per_step": eager, "compiled_s_per_step": compiled,
        "eager_s_per_step_mean": statistics.fmean(seconds["off"]),
        "compiled_s_per_step_mean": statistics.fmean(seconds["on"]),
        "break_even_steps_cold": (cold - compiled) / saving if saving > 0 else None,
        "break_even_steps_warm": (warm - compiled) / saving if saving > 0 else None,
    }  # fmt: skip


def channels_last_cost(ds: Dataset, model_name: str, b: int, steps: int) -> dict:
    """Seconds per forward + backward (mean cross-entropy) of the model at b samples with
    model and input contiguous vs ``torch.channels_last``, alternately step by step after
    one warm-up each; the largest gradient difference between the two (float rounding)."""
    models = {}
    for fmt in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = build_model(model_name, ds.input_shape, ds.num_classes)
        if fmt == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        models[fmt] = model
    seconds: dict[str, list[float]] = {f: [] for f in models}
    grads = {}
    for i, (x, y) in enumerate(batches_of(ds, b, steps + 1, seed=3)):
        for fmt, model in models.items():
            xf = x.contiguous(memory_format=torch.channels_last) if fmt == "channels_last" else x
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            F.cross_entropy(model(xf), y).backward()
            if i:
                seconds[fmt].append(time.perf_counter() - t0)
            grads[fmt] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    cont, cl = (statistics.median(seconds[f]) for f in ("contiguous", "channels_last"))
    diff = float((grads["contiguous"] - grads["channels_last"]).abs().max())
    return {
        "model": model_name, "b": b, "steps": steps, "contiguous_s_per_step": cont,
        "channels_last_s_per_step": cl, "speedup": cont / cl,
        "max_abs_grad_difference_last_step": diff,
        "max_abs_grad_last_step": float(grads["contiguous"].abs().max()),
    }  # fmt: skip


# ---- results -------------------------------------------------------------------------------


def flops_table(args: argparse.Namespace, ds: Dataset) -> dict[str, dict]:
    """Per model: parameters and FLOPs per sample (forward, forward + backward) at every b
    of ``--batches`` (they agree: the models have no batch-dependent FLOPs)."""
    out = {}
    for m in args.models:
        torch.manual_seed(0)
        model = build_model(m, ds.input_shape, ds.num_classes)
        per_b = {b: training_flops(model, ds.train_x[:b], ds.train_y[:b]) for b in args.batches}
        out[m] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "forward_flops_per_sample": {b: f for b, (f, _) in per_b.items()},
            "training_flops_per_sample": {b: t for b, (_, t) in per_b.items()},
        }
    return out


def summarise(
    args: argparse.Namespace, peaks: dict, rates: dict, notes: dict, flops: dict
) -> tuple[dict[str, float], list[dict]]:
    """Median peaks and one row per cell: samples/s, FLOP/s, fractions of both peaks."""
    peak = {key: statistics.median(p["median"] for p in v) for key, v in peaks.items()}
    rows = []
    for (m, b, p, k), vals in rates.items():
        sps = statistics.median(vals)
        fps = sps * flops[m]["training_flops_per_sample"][b]
        rows.append(
            {
                "model": m,
                "path": p,
                "label": label(p, k),
                "b": b,
                "k": k,
                "processes": NUM_PROCESSES if p in ("dist", "ddp") else 1,
                "threads_per_process": args.dist_threads if p in ("dist", "ddp") else args.threads,
                "samples_per_s": sps,
                "samples_per_s_rounds": vals,
                "flop_per_s": fps,
                "fraction_all_core_peak": fps / peak["all"],
                "fraction_one_core_peak": fps / peak["one"],
                "note": notes[(m, b, p, k)],
            }
        )
    return peak, rows


def command(argv: list[str]) -> str:
    """The command line of this run, as it can be pasted."""
    return "python bench/efficiency.py " + shlex.join(argv)


def markdown(meta: dict, peak: dict, peaks: dict, flops: dict, rows: list, profiles: dict) -> str:
    """``efficiency.md``: set-up, peaks, FLOPs per sample, the table, the profiles."""
    lb, la = meta["load_before"], meta["load_after"]
    lines = [
        "# Hardware efficiency: achieved FLOP/s against the machine's fp32 peak",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['machine']}, {meta['cpu_count']} CPUs, torch {meta['torch']}; in-process "
        f"paths (loop, sim, replicas) {meta['threads']} threads; dist and DDP "
        f"{NUM_PROCESSES} processes × {meta['dist_threads']} thread(s). Load average "
        f"(1, 5, 15 min) before {lb[0]:.2f}, {lb[1]:.2f}, {lb[2]:.2f}; after {la[0]:.2f}, "
        f"{la[1]:.2f}, {la[2]:.2f}. Data: {meta['data']}. {meta['wall_s']:.0f} s. Median "
        f"of {meta['repeats']} interleaved rounds; at least {meta['samples']} samples and "
        f"{meta['min_steps']} steps per measurement.",
        "",
        "## Peak (fp32 matrix product)",
        "",
        f"{meta['peak_size']}² × {meta['peak_size']}² `torch.mm`, median of "
        f"{meta['peak_repeats']} products per round, median over rounds.",
        "",
        "| threads | GFLOP/s | per round (median; best) |",
        "|---|---|---|",
    ]
    for key in ("all", "one"):
        per = "; ".join(f"{p['median'] / 1e9:.1f} ({p['best'] / 1e9:.1f})" for p in peaks[key])
        lines.append(f"| {peaks[key][0]['threads']} | {peak[key] / 1e9:.1f} | {per} |")
    lines += [
        "",
        "## FLOPs per training sample (FlopCounterMode: matrix products and convolutions)",
        "",
        "| model | parameters | forward MFLOP | forward + backward MFLOP | ratio |",
        "|---|---|---|---|---|",
    ]
    for m, f in flops.items():
        fw = max(f["forward_flops_per_sample"].values())
        tr = max(f["training_flops_per_sample"].values())
        lines.append(
            f"| {m} | {f['parameters']:,} | {fw / 1e6:.2f} | {tr / 1e6:.2f} | {tr / fw:.2f} |"
        )
    lines += [
        "",
        "## Achieved throughput and fraction of peak",
        "",
        "| model | path | b | k | samples/s | GFLOP/s | fraction of all-core peak "
        "| fraction of one-core peak | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['label']} | {r['b']} | {r['k']} | {r['samples_per_s']:.0f} "
            f"| {r['flop_per_s'] / 1e9:.2f} | {r['fraction_all_core_peak']:.3f} "
            f"| {r['fraction_one_core_peak']:.3f} | {r['note']} |"
        )
    lines += ["", "![fraction of peak](efficiency.png)", ""]
    for title, table in profiles.items():
        lines += [f"## Where the time goes: {title}", "", table, ""]
    return "\n".join(lines)


def micro_markdown(micro: dict) -> str:
    """The ``--compile-cost`` and ``--channels-last`` tables (empty when not run)."""
    lines = [""]
    if micro["compile_cost"]:
        lines += [
            "## train.compile: first step and per-step saving (engine gradient)",
            "",
            "`GradientEngine.gradient` at B samples in M learners' chunks (hardsync's fused "
            "step: the default run is 4 × 32 = 128:4); first compiled step of a fresh engine "
            "with inductor's caches off (a user's first run), on (first and second time); "
            "then eager and compiled alternately, median seconds per step (mean beside).",
            "",
            "| model | B:M | first step, caches off s | caches on, 1st s | caches on, 2nd s "
            "| eager ms/step | compiled ms/step | compiled / eager | break-even steps "
            "(cold; warm) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in micro["compile_cost"]:
            be = "; ".join(
                "never" if c[k] is None else f"{c[k]:.0f}"
                for k in ("break_even_steps_cold", "break_even_steps_warm")
            )
            lines.append(
                f"| {c['model']} | {c['b']}:{c['chunks']} | {c['first_step_s_cold']:.1f} "
                f"| {c['first_step_s_first_cached']:.1f} | {c['first_step_s_warm']:.1f} "
                f"| {1e3 * c['eager_s_per_step']:.1f} ({1e3 * c['eager_s_per_step_mean']:.1f}) "
                f"| {1e3 * c['compiled_s_per_step']:.1f} "
                f"({1e3 * c['compiled_s_per_step_mean']:.1f}) "
                f"| {c['compiled_s_per_step'] / c['eager_s_per_step']:.3f} | {be} |"
            )
        lines.append("")
    if micro["channels_last"]:
        lines += [
            "## channels_last vs contiguous (model and input; forward + backward)",
            "",
            "| model | b | contiguous ms/step | channels_last ms/step | speed-up "
            "| max abs gradient difference (largest gradient) |",
            "|---|---|---|---|---|---|",
        ]
        for c in micro["channels_last"]:
            lines.append(
                f"| {c['model']} | {c['b']} | {1e3 * c['contiguous_s_per_step']:.1f} "
                f"| {1e3 * c['channels_last_s_per_step']:.1f} | {c['speedup']:.3f} "
                f"| {c['max_abs_grad_difference_last_step']:.2e} "
                f"({c['max_abs_grad_last_step']:.2e}) |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], models: list[str], out: Path) -> None:
    """Fraction of the all-core peak against b (log2 axis), one line per path, one panel
    per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for name in dict.fromkeys(r["label"] for r in rows if r["model"] == m):
            pts = sorted((r["b"], r["fraction_all_core_peak"]) for r in rows
                         if r["model"] == m and r["label"] == name)  # fmt: skip
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        batches = sorted({r["b"] for r in rows})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("per-learner batch b (samples)")
        ax.set_ylabel("fraction of all-core fp32 peak")
        ax.set_title(m)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ---- profile -------------------------------------------------------------------------------


def parse_chunked(spec: str) -> tuple[int, int]:
    """``B`` or ``B:M`` → (B, M): B samples in M equal chunks (M divides B)."""
    try:
        b, m = (int(x) for x in (spec.split(":") + ["1"])[:2])
    except ValueError:
        b = m = 0
    if b < 1 or m < 1 or b % m:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected B or B:M, M dividing B")
    return b, m


def parse_profile(spec: str) -> tuple[str, int, int]:
    """``PATH:B`` or ``replicas:B:K`` → (path, b, k)."""
    parts = spec.split(":")
    if parts[0] not in IN_PROCESS or len(parts) != (3 if parts[0] == "replicas" else 2):
        raise argparse.ArgumentTypeError(
            f"--profile {spec!r}: expected loop:B, sim:B or replicas:B:K "
            "(only in-process paths can be profiled)"
        )
    nums = [int(x) for x in parts[1:]]
    return parts[0], nums[0], nums[1] if len(nums) > 1 else 1


def profile_table(args: argparse.Namespace, ds: Dataset, model_name: str, top: int = 15) -> str:
    """Markdown table of the ``top`` operators by self CPU time of one untimed run of the
    ``--profile`` path (``torch.profiler``, CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    path, b, k = args.profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        measure(args, ds, path, model_name, b, k)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    lines = [
        "| operator | self CPU ms | self CPU % | CPU total ms | calls |",
        "|---|---|---|---|---|",
    ]
    for e in events[:top]:
        lines.append(
            f"| `{e.key}` | {e.self_cpu_time_total / 1e3:.1f} "
            f"| {100 * e.self_cpu_time_total / total:.1f} | {e.cpu_time_total / 1e3:.1f} "
            f"| {e.count} |"
        )
    setup = "the whole `distsgd.train` call" if path == "sim" else "model and inputs"
    return (
        f"One untimed run of {label(path, k)} at b = {b}, set-up included ({setup}); "
        f"the top {top} operators by self CPU time.\n\n" + "\n".join(lines)
    )


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["cnn"], choices=MODELS)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 512],
                    help="per-learner batch sizes b, samples")  # fmt: skip
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 16],
                    help="k of the batched-replicas path")  # fmt: skip
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--samples", type=int, default=8192,
                    help="training samples per measurement (at least)")  # fmt: skip
    ap.add_argument("--min-steps", type=int, default=8, help="steps per measurement (at least)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the in-process paths and the all-core peak")  # fmt: skip
    ap.add_argument("--dist-threads", type=int, default=1,
                    help="torch threads per process of the dist and ddp paths")  # fmt: skip
    ap.add_argument("--lr", type=float, default=0.01, help="learning rate (momentum 0.9)")
    ap.add_argument("--synthetic", action="store_true",
                    help="distsgd's synthetic data of Fashion-MNIST's shape instead")  # fmt: skip
    ap.add_argument("--synthetic-train", type=int, default=16384,
                    help="training samples of the synthetic set")  # fmt: skip
    ap.add_argument("--peak-size", type=int, default=2048, help="n of the n × n matrix product")
    ap.add_argument("--peak-repeats", type=int, default=10, help="timed products per peak")
    ap.add_argument("--profile", type=parse_profile, default=None, metavar="PATH:B[:K]",
                    help="add a torch.profiler table (top 15 by self CPU) of this path: "
                    "loop:B, sim:B or replicas:B:K, for every model")  # fmt: skip
    ap.add_argument("--compile-cost", type=parse_chunked, nargs="*", default=[],
                    metavar="B[:M]", help="measure train.compile's first step and per-step "
                    "saving at B samples in M learners' chunks (the default run: 128:4)")  # fmt: skip
    ap.add_argument("--channels-last", type=int, nargs="*", default=[], metavar="B",
                    help="time forward + backward at B samples, contiguous vs channels_last")  # fmt: skip
    ap.add_argument("--micro-steps", type=int, default=30,
                    help="timed steps of --compile-cost and --channels-last")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/out/efficiency"))
    args = ap.parse_args(argv)
    for name in ("batches", "replicas"):
        if min(getattr(args, name)) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and write ``efficiency.md``, ``.json`` and ``.png`` to ``--out``;
    returns what the JSON holds."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    load_before = os.getloadavg()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    ds = load_dataset(data_config(args.synthetic_train if args.synthetic else 0), seed=0)
    flops = flops_table(args, ds)
    peaks, rates, notes, loads = run_rounds(args, ds)
    profiles = {}
    if args.profile:
        for m in args.models:
            profiles[f"{m}, {args.profile[0]} b = {args.profile[1]}"] = profile_table(args, ds, m)
    micro = {
        "compile_cost": [
            compile_cost(ds, m, b, chunks, args.micro_steps)
            for m in args.models
            for b, chunks in args.compile_cost
        ],
        "channels_last": [
            channels_last_cost(ds, m, b, args.micro_steps)
            for m in args.models
            for b in args.channels_last
        ],
    }
    peak, rows = summarise(args, peaks, rates, notes, flops)
    meta = {
        "command": command(argv),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.threads,
        "dist_threads": args.dist_threads,
        "data": f"synthetic ({args.synthetic_train} samples)" if args.synthetic else ds.name,
        "repeats": args.repeats,
        "samples": args.samples,
        "min_steps": args.min_steps,
        "peak_size": args.peak_size,
        "peak_repeats": args.peak_repeats,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "load_per_round": loads,
        "wall_s": time.time() - t_start,
    }
    result = {"meta": meta, "peak_flop_per_s": peak, "peaks": peaks, "flops": flops, "rows": rows}
    result.update(micro)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(meta, peak, peaks, flops, rows, profiles) + micro_markdown(micro)
    (args.out / "efficiency.md").write_text(text)
    (args.out / "efficiency.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.models, args.out / "efficiency.png")
    print(f"wrote {args.out}/efficiency.md, .json, .png", flush=True)
    return result


if __name__ == "__main__":
    main()
