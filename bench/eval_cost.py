"""Evaluation cost beside training: the default ``distsgd train`` run (Fashion-MNIST
``cnn``, hardsync 4 × 32, target 90%) and a 2-process dist run of it, before (another
checkout, e.g. main) and after (this tree), with and without ``train.eval_samples``.

Every variant is one ``python3 -m distsgd train --quiet`` process started from its tree
(``PYTHONPATH`` = that tree), one after the other in this one script run; the table takes
``train_wall_s`` and ``eval_wall_s`` from each run's ``summary.json`` and the load average
(``/proc/loadavg``, 1 min) before and after each run. The table is rewritten after every
run, so a run cut short still leaves the variants done. Issue 17's target: evaluation at
most a quarter of the training wall time (ratio ≤ 0.25) in both the sim and the dist run.

    flock /tmp/distsgd-bench.lock python3 bench/eval_cost.py --before /work/main \\
        --out bench/results/eval_cost.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from distsgd.config import RunConfig
from distsgd.data import load_dataset
from distsgd.engine import build_engine, config_for_data

HERE = Path(__file__).resolve().parents[1]
DIST = ["--runtime", "dist", "--num-processes", "2"]

# (label, tree: "after" or "before", extra CLI arguments); run in this order
VARIANTS = [
    ("after, sim, eval_samples default (2000)", "after", []),
    ("before, sim (whole test set)", "before", []),
    ("after, dist 2 proc, eval_samples default (2000)", "after", DIST),
    ("after, sim, eval_samples=0 (whole test set)", "after", ["--set", "train.eval_samples=0"]),
    ("before, dist 2 proc (whole test set)", "before", DIST),
]


def batch_size_table(batch_sizes: list[int], repeats: int) -> str:
    """Seconds of one evaluation of the default run's model (initial weights) on the whole
    test set per ``train.eval_batch_size``, in this process with 2 threads, the batch
    sizes alternating ``repeats`` times (the minimum is kept: load only adds); plus the
    same forward with autograd on (``torch.no_grad`` off, b = 128) for comparison."""
    torch.set_num_threads(2)
    cfg = RunConfig()
    ds = load_dataset(cfg.data, seed=cfg.train.seed)
    cfg = config_for_data(cfg, ds)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg)
    w = engine.initial_weights()

    def with_autograd() -> None:
        engine._load(w)
        engine.model.eval()
        for xb, _ in ds.test.batches(128):
            engine.model(xb)

    runs = {f"b = {b}": (lambda b=b: engine.evaluation_sums(w, ds.test, b)) for b in batch_sizes}
    runs["b = 128, autograd on"] = with_autograd
    best = dict.fromkeys(runs, float("inf"))
    load0 = _load()
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    lines = [
        f"One evaluation of the whole test set ({ds.test.num_samples} samples), model "
        f"`{cfg.model.label}`, 2 threads, minimum of {repeats} alternating repeats; load "
        f"{load0:.1f} → {_load():.1f}.",
        "",
        "| evaluation | seconds | ratio to b = 128 |",
        "|---|---|---|",
    ]
    ref = best.get("b = 128") or next(iter(best.values()))
    lines += [f"| {k} | {v:.2f} | {v / ref:.2f} |" for k, v in best.items()]
    return "\n".join(lines) + "\n"


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_variant(tree: Path, extra: list[str], out: Path, timeout_s: float) -> dict:
    """One ``distsgd train`` run from ``tree``; its summary with the process wall and the
    load average before and after."""
    # no bytecode written into either tree (the before tree may be another's checkout)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    load0, t0 = _load(), time.perf_counter()
    cmd = [sys.executable, "-m", "distsgd", "train", "--quiet", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text()) if proc.returncode == 0 else {}
    return {
        "rc": proc.returncode,
        "stderr": proc.stderr[-400:],
        "process_wall_s": wall,
        "load_before": load0,
        "load_after": _load(),
        "summary": summary,
    }


def _row(label: str, r: dict) -> str:
    s = r["summary"]
    if r["rc"] != 0:
        return f"| {label} | failed (exit {r['rc']}) | | | | | | | {r['load_before']:.1f} → {r['load_after']:.1f} |"
    train, ev = s["train_wall_s"], s["eval_wall_s"]
    records = [json.loads(x) for x in (Path(s["_dir"]) / "metrics.jsonl").open()]
    return (
        f"| {label} | {s['reached']} | {s['samples']} | {len(records)} | {train:.1f} | {ev:.1f} "
        f"| {ev / train:.3f} | {s['final_metric']:.4f} | {r['process_wall_s']:.1f} "
        f"| {r['load_before']:.1f} → {r['load_after']:.1f} |"
    )


def write_table(path: Path, command: str, rows: list[str], note: str) -> None:
    """The markdown file: the runs' table, then ``note`` (the batch-size table)."""
    head = (
        "| variant | reached 90% | samples | evaluations | train wall s | eval wall s "
        "| eval / train | final metric | process wall s | load 1 min before → after |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    text = (
        "# Evaluation cost beside training (issue 17, evaluation)\n\n"
        f"Command: `{command}`\n\n"
        "Machine: 2 cores shared with other engineers' work (load average per run in the "
        "table: figures under load, compare ratios within this one run).\n\n"
        + head
        + "\n".join(rows)
        + "\n\n"
        + note
    )
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the tree to compare with")
    ap.add_argument("--out", type=Path, default=HERE / "bench/results/eval_cost.md")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="variant indices")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[64, 128, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3, help="of the batch-size table")
    args = ap.parse_args()
    command = "python3 bench/eval_cost.py " + " ".join(sys.argv[1:])
    rows: list[str] = []
    note = "## eval_batch_size\n\n" + batch_size_table(args.batch_sizes, args.repeats)
    print(note, flush=True)
    write_table(args.out, command, rows, note)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, which, extra) in enumerate(VARIANTS):
            if args.only is not None and i not in args.only:
                continue
            tree = HERE if which == "after" else args.before.resolve()
            out = Path(tmp) / f"run{i}"
            r = run_variant(tree, extra, out, args.timeout_s)
            r["summary"]["_dir"] = str(out)
            rows.append(_row(label, r))
            print(rows[-1], flush=True)
            if r["rc"] != 0:
                print(r["stderr"], file=sys.stderr)
            write_table(args.out, command, rows, note)


if __name__ == "__main__":
    main()
