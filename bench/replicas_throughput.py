"""Throughput of k replicas as one batched computation vs k separate learners vs one learner.

Fashion-MNIST ``cnn`` (SPEC.md §4, Crossbow: several learners per device recover the
efficiency small batches lose). For every per-replica batch b and k replicas, measured
side by side in one process, interleaved, ``--repeats`` times each (median kept):

* **batched**: ``GradientEngine.replica_gradients`` on the batched path (grouped
  convolutions + batched matrix products, :mod:`distsgd.batched`), forced for every
  (k, b) so that the rule of ``choose_path`` can be read off the table;
* **separate**: the same k replicas one by one (what k learners sharing the device cost);
* **one learner**: k = 1 at batch b, k consecutive iterations per timing.

Ratios are of samples per second. Rounds 0..S−1 (``--seeds``) repeat the whole grid with
other model initialisations and data. Then the replicas-per-device auto-tuner
(:mod:`distsgd.replicas`) runs for ``--tune-batch`` b on measured wall throughput
(the same batched path a run uses, ``path="auto"``), once per seed, and its choice is
compared with the k of the highest measured throughput in the sweep.

    flock /tmp/distsgd-bench.lock python bench/replicas_throughput.py --threads 2 \\
        --seeds 0 1 2 --out bench/results/replicas_throughput.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from distsgd.batched import choose_path
from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.replicas import ReplicaAutoTuner


def _inputs(ds, engine: GradientEngine, k: int, b: int, seed: int):
    g = torch.Generator().manual_seed(seed * 7 + k * 131 + b)
    idx = torch.randperm(ds.num_train, generator=g)[: k * b]
    w = engine.initial_weights().expand(k, -1).clone()
    w += 0.01 * torch.randn(w.shape, generator=g)  # replicas differ, as after a few steps
    x = ds.train_x[idx].reshape(k, b, *ds.input_shape)
    return w, x, ds.train_y[idx].reshape(k, b)


def sweep(ds, ks, batches, seed, repeats, batched_path) -> dict:
    torch.manual_seed(seed)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    rows = {}
    for b in batches:
        w1, x1, y1 = _inputs(ds, engine, 1, b, seed)
        for k in ks:
            w, x, y = _inputs(ds, engine, k, b, seed)
            fns = {
                "one": (w1, x1, y1, "loop"),
                "separate": (w, x, y, "loop"),
                "batched": (w, x, y, batched_path),
            }
            for ww, xx, yy, path in fns.values():  # warm-up
                engine.replica_gradients(ww, xx, yy, path=path)
            times = {name: [] for name in fns}
            for _ in range(repeats):  # interleaved: drift of the machine hits all alike
                for name, (ww, xx, yy, path) in fns.items():
                    # one learner runs k consecutive iterations (as it does in training:
                    # warm caches), so every timing covers k·b samples
                    calls = k if name == "one" else 1
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        engine.replica_gradients(ww, xx, yy, path=path)
                    times[name].append(time.perf_counter() - t0)
            n = {"one": k * b, "separate": k * b, "batched": k * b}
            rows[(k, b)] = {name: n[name] / statistics.median(t) for name, t in times.items()}
            print(
                f"seed {seed} k={k:2d} b={b:2d} "
                + " ".join(f"{name}={v:7.0f}/s" for name, v in rows[(k, b)].items()),
                flush=True,
            )
    return rows


def autotune(ds, b, seed, interval, threshold, max_replicas, rule) -> ReplicaAutoTuner:
    """The tuner fed with measured wall throughput of the run's path (``auto``)."""
    torch.manual_seed(seed)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    tuner = ReplicaAutoTuner(threshold, interval, max_replicas, warmup=1, rule=rule)
    while not tuner.done:
        w, x, y = _inputs(ds, engine, tuner.k, b, seed)
        t0 = time.perf_counter()
        engine.replica_gradients(w, x, y)
        decision = tuner.observe(tuner.k * b, time.perf_counter() - t0)
        if decision is not None:
            print(f"seed {seed} b={b} {rule}: {decision.line()}", flush=True)
    return tuner


def steady_sweep(ds, max_k, b, seed, iterations, rounds) -> dict[int, float]:
    """Samples/s of k = 1..max_k batched replicas measured as training and the tuner see
    them: ``iterations`` consecutive iterations at a fixed k, fresh inputs each, median
    iteration; the ks are cycled ``rounds`` times (median over rounds) so drift of the
    machine hits every k alike."""
    torch.manual_seed(seed)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    per_k: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
    for _ in range(rounds):
        for k in per_k:
            times = []
            for _ in range(iterations + 1):  # the first of a new shape is not counted
                w, x, y = _inputs(ds, engine, k, b, seed)
                t0 = time.perf_counter()
                engine.replica_gradients(w, x, y)
                times.append(time.perf_counter() - t0)
            per_k[k].append(k * b / statistics.median(times[1:]))
    out = {k: statistics.median(v) for k, v in per_k.items()}
    print(f"seed {seed} steady sweep b={b}: " + " ".join(f"{k}:{v:.0f}" for k, v in out.items()))
    return out


def _ms(values: list[float]) -> str:
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--path", default="grouped", help="batched path to force (grouped, vmap)")
    ap.add_argument("--tune-batch", type=int, default=8)
    ap.add_argument("--tune-interval", type=int, default=30)
    ap.add_argument("--threshold", type=float, default=0.10)
    ap.add_argument(
        "--rules", nargs="+", default=["crossbow", "marginal"], help="auto-tuner stopping rules"
    )
    ap.add_argument(
        "--steady-rounds", type=int, default=3, help="rounds of the training-like sweep"
    )
    ap.add_argument("--out", default="bench/results/replicas_throughput.md")
    args = ap.parse_args()
    if args.tune_batch not in args.batches:
        ap.error(f"--tune-batch {args.tune_batch} must be one of --batches {args.batches}")
    torch.set_num_threads(args.threads)
    ds = load_dataset(DataConfig(), seed=0)
    load_before = os.getloadavg()
    t_start = time.time()
    per_seed = [sweep(ds, args.ks, args.batches, s, args.repeats, args.path) for s in args.seeds]
    # per seed, the rules one after the other: (seed, rule, tuner)
    tuners = [
        (
            s,
            rule,
            autotune(
                ds, args.tune_batch, s, args.tune_interval, args.threshold, max(args.ks), rule
            ),
        )
        for s in args.seeds
        for rule in args.rules
    ]
    steady = [
        steady_sweep(ds, max(args.ks), args.tune_batch, s, args.tune_interval, args.steady_rounds)
        for s in args.seeds
    ]
    load_after = os.getloadavg()

    def ratios(k, b, num, den):
        return [r[(k, b)][num] / r[(k, b)][den] for r in per_seed]

    lines = [
        "# k batched replicas vs k separate learners vs one learner (Fashion-MNIST cnn)",
        "",
        f"Command: `flock /tmp/distsgd-bench.lock python bench/replicas_throughput.py "
        f"--threads {args.threads} --seeds {' '.join(map(str, args.seeds))} "
        f"--repeats {args.repeats} --path {args.path} "
        f"--ks {' '.join(map(str, args.ks))} --batches {' '.join(map(str, args.batches))} "
        f"--tune-batch {args.tune_batch} --tune-interval {args.tune_interval} --out {args.out}`",
        "",
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads; load average before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f} (1 min; other work shared the machine); "
        f"{time.time() - t_start:.0f} s. Median of {args.repeats} interleaved timings per "
        f"cell and seed; mean ± std over seeds {args.seeds}. Samples per second ratios.",
        "",
        f"## batched ({args.path}) ÷ one learner at batch b",
        "",
        "| k \\ b | " + " | ".join(str(b) for b in args.batches) + " |",
        "|---|" + "---|" * len(args.batches),
    ]
    for k in args.ks:
        lines.append(
            f"| {k} | "
            + " | ".join(_ms(ratios(k, b, "batched", "one")) for b in args.batches)
            + " |"
        )
    lines += [
        "",
        "## k separate learners (one by one) ÷ one learner at batch b",
        "",
        "| k \\ b | " + " | ".join(str(b) for b in args.batches) + " |",
        "|---|" + "---|" * len(args.batches),
    ]
    for k in args.ks:
        lines.append(
            f"| {k} | "
            + " | ".join(_ms(ratios(k, b, "separate", "one")) for b in args.batches)
            + " |"
        )
    lines += [
        "",
        f"## batched ({args.path}) ÷ k separate learners",
        "",
        "| k \\ b | " + " | ".join(str(b) for b in args.batches) + " |",
        "|---|" + "---|" * len(args.batches),
    ]
    for k in args.ks:
        lines.append(
            f"| {k} | "
            + " | ".join(_ms(ratios(k, b, "batched", "separate")) for b in args.batches)
            + " |"
        )
    lines += [
        "",
        "## absolute throughput, samples/s (mean over seeds)",
        "",
        "| k | b | one learner | separate | batched |",
        "|---|---|---|---|---|",
    ]
    for b in args.batches:
        for k in args.ks:
            v = {
                n: statistics.mean(r[(k, b)][n] for r in per_seed)
                for n in ("one", "separate", "batched")
            }
            lines.append(
                f"| {k} | {b} | {v['one']:.0f} | {v['separate']:.0f} | {v['batched']:.0f} |"
            )

    b = args.tune_batch
    # what a run computes at each k: the path of the rule (choose_path)
    model = build_model("cnn", ds.input_shape, ds.num_classes)
    column = {k: "batched" if choose_path(model, k, b) != "loop" else "separate" for k in args.ks}
    best_rule = {k: statistics.mean(r[(k, b)][column[k]] for r in per_seed) for k in args.ks}
    k_best = max(best_rule, key=best_rule.get)
    within = [abs(math.log2(t.k) - math.log2(k_best)) <= 1 for _, _, t in tuners]
    headline = ratios(16, 8, "batched", "one") if (16, 8) in per_seed[0] else None
    lines += [
        "",
        f"## auto-tuner at b = {b}",
        "",
        f"The tuner (rules {', '.join(args.rules)}: see `distsgd.replicas`; threshold "
        f"{args.threshold:.0%}, {args.tune_interval} iterations per "
        "measurement, one warm-up iteration after each change; throughput = samples / "
        "(median seconds per iteration × iterations)) ran on measured wall "
        'throughput of `replica_gradients(path="auto")`. Sweep argmax: the k of the highest '
        f"throughput, per k, of the path the rule of `choose_path` takes (the table above: **k = {k_best}** "
        f"({best_rule[k_best]:.0f} samples/s). Within one step of the sweep's grid "
        "means |log2 k_tuner − log2 k_best| <= 1.",
        "",
        "| seed | rule | tuner's k | within one step | decisions |",
        "|---|---|---|---|---|",
    ]
    for (s, rule, t), ok in zip(tuners, within, strict=True):
        dec = "; ".join(f"k={d.k_before} {d.throughput:.0f}/s → {d.action}" for d in t.decisions)
        lines.append(f"| {s} | {rule} | {t.k} | {'yes' if ok else 'no'} | {dec} |")
    for rule in args.rules:
        hits = [ok for (_, r, _), ok in zip(tuners, within, strict=True) if r == rule]
        lines.append("")
        lines.append(f"- {rule}: within one step for {sum(hits)} of {len(hits)} seeds.")
    # the training-like sweep: consecutive iterations at fixed k, as the tuner measures
    grid = {k: statistics.mean(st[k] for st in steady) for k in args.ks}
    k_steady = max(grid, key=grid.get)
    every = {k: statistics.mean(st[k] for st in steady) for k in steady[0]}
    k_every = max(every, key=every.get)
    lines += [
        "",
        f"### training-like sweep at b = {b}",
        "",
        f"Every k = 1..{max(args.ks)} batched, {args.tune_interval} consecutive iterations "
        "with fresh inputs (median iteration), as a training run and the tuner see them; "
        f"the ks cycled {args.steady_rounds} times (median), mean over seeds. Its argmax on "
        f"the grid {args.ks}: **k = {k_steady}**; over every k: k = {k_every}.",
        "",
        "| k | samples/s | ÷ best |",
        "|---|---|---|",
    ]
    for k, v in every.items():
        lines.append(f"| {k} | {v:.0f} | {v / every[k_every]:.2f} |")
    lines += [
        "",
        "| seed | rule | tuner's k | within one step of k = "
        f"{k_steady} | its throughput ÷ best (this seed's sweep) |",
        "|---|---|---|---|---|",
    ]
    for (s, rule, t), st in zip(tuners, [st for st in steady for _ in args.rules], strict=True):
        ok = abs(math.log2(t.k) - math.log2(k_steady)) <= 1
        lines.append(
            f"| {s} | {rule} | {t.k} | {'yes' if ok else 'no'} | {st[t.k] / max(st.values()):.2f} |"
        )
    if headline:
        lines += [
            "",
            f"**Headline: 16 replicas × batch 8 batched ÷ one learner at batch 8 = "
            f"{_ms(headline)}** (target >= 1.2).",
        ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    raw = {
        "args": vars(args),
        "load_before": load_before,
        "load_after": load_after,
        "rows": [{f"{k},{b}": v for (k, b), v in r.items()} for r in per_seed],
        "tuners": [{"seed": s, "rule": r, **t.to_json()} for s, r, t in tuners],
        "k_best": k_best,
        "steady": [{str(k): v for k, v in st.items()} for st in steady],
    }
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
