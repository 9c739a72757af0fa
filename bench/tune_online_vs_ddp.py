"""``distsgd train --tune`` vs DDP on real processes: total wall time to 90% test accuracy
on Fashion-MNIST ``cnn``, 2 processes, side by side in one run (issue 18).

Per seed, one after the other under the same load:

(a) DDP (``hardsync`` on the dist runtime, 2 processes × 1 thread) at the swept-best
    configuration: 2 × 64, η 0.05, μ 0.9;
(b) DDP at the configuration a user starts from without a sweep: the PyTorch examples'
    MNIST defaults of their SGD version (batch 64 per process, lr 0.01, momentum 0.5);
(c) ``distsgd train --tune --runtime dist --num-processes 2`` (tuning included).

Every run is one ``distsgd train`` command; its wall time is measured from the command's
start to its end (each stops at the target), so process starts, data loading,
evaluations and, for (c), every probe count alike. (d), the offline ``distsgd tune`` +
plan, is not rerun here: its figures are those of ``bench/results/tune_vs_ddp_dist``.

Writes ``RESULTS/README.md`` (table, ratios (c)/(a) and (c)/(b) per seed and their
median, the tuning share of (c), machine load before and after) and ``results.json``.

    flock /tmp/distsgd-bench.lock python bench/tune_online_vs_ddp.py --seeds 1 2 3 \\
        --out bench/out/tune_online --results bench/results/tune_online
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = [
    "data.dataset=fashion_mnist",
    "model.name=cnn",
    "protocol.name=hardsync",
    "protocol.num_learners=2",
    "protocol.batch_size=64",
    "train.target=0.9",
    "train.max_epochs=10",
    "train.num_threads=1",
    "train.eval_batch_size=1000",
]
RUNS = {
    "a": ["optimizer.lr=0.05", "optimizer.momentum=0.9"],
    "b": ["optimizer.lr=0.01", "optimizer.momentum=0.5"],
    # the tuner's own settings for a short job: a small cold start and steady-state grid
    # (probe lengths: the defaults, tune.probe_seconds = 2 and tune.first_rung = 0.5)
    "c": [
        "tune.lrs=[0.1, 0.01, 0.001]",
        "tune.momenta=[0.0, 0.9]",
        "tune.extra_probes=1",
        "tune.batch_sizes=[32, 64]",
    ],
}
LABELS = {
    "a": "DDP swept-best (2 × 64, η 0.05, μ 0.9)",
    "b": "DDP PyTorch-examples defaults (2 × 64, η 0.01, μ 0.5)",
    "c": "distsgd train --tune (2 processes, tuning included)",
}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_one(
    kind: str, seed: int, out: Path, eval_every: int, c_sets: list[str] = (), repeat: int = 1
) -> dict:
    run_dir = out / (f"{kind}-s{seed}" + (f"-r{repeat}" if repeat > 1 else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [*BASE, f"train.seed={seed}", f"train.eval_every_samples={eval_every}", *RUNS[kind]]
    sets += list(c_sets) if kind == "c" else []
    cmd = [sys.executable, "-m", "distsgd", "train", "--runtime", "dist", "--num-processes", "2"]
    cmd += [x for s in sets for x in ("--set", s)] + ["--out", str(run_dir), "--quiet"]
    if kind == "c":
        cmd.append("--tune")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text()) if proc.returncode == 0 else {}
    return {
        "kind": kind,
        "seed": seed,
        "repeat": repeat,
        "run_dir": run_dir.name,
        "returncode": proc.returncode,
        "stderr_tail": proc.stderr[-400:] if proc.returncode else "",
        "command_wall_s": wall,
        "reached": summary.get("reached"),
        "time_to_target_s": summary.get("time_to_target_s"),
        "samples_to_target": summary.get("samples_to_target"),
        "tuning_wall_s": summary.get("tuning_wall_s"),
        "tuning_share": summary.get("tuning_share"),
        "num_probes": summary.get("num_probes"),
        "lr": summary.get("lr"),
        "momentum": summary.get("momentum"),
        "layout": summary.get("layout"),
        "command": " ".join(cmd),
    }


def _runs_of(rows: list[dict], kind: str, seed: int) -> dict | None:
    """A seed's runs of one kind as one: the median wall over its repeats (``--repeats``),
    reached only when every repeat reached the target; None when one is missing or
    failed."""
    mine = [r for r in rows if r["kind"] == kind and r["seed"] == seed]
    if not mine or any(r["returncode"] != 0 for r in mine):
        return None
    wall = statistics.median(r["command_wall_s"] for r in mine)
    return {"command_wall_s": wall, "reached": all(r["reached"] for r in mine)}


def _ratio(rows: list[dict], num: str, den: str, seed: int) -> tuple[float, str] | None:
    """(num / den wall, "=", "<" or ">"), each the median over its repeats: "<" when den
    did not reach the target (its time to it is more than its whole run), ">" when num
    did not (likewise: the ratio is more than the figure); None when neither did or a
    run is missing or failed."""
    n, d = _runs_of(rows, num, seed), _runs_of(rows, den, seed)
    if n is None or d is None:
        return None
    if not n["reached"] and not d["reached"]:
        return None
    mark = "=" if n["reached"] and d["reached"] else ("<" if n["reached"] else ">")
    return n["command_wall_s"] / d["command_wall_s"], mark


def _median(ratios: list[tuple[float, str]]) -> str:
    """The median of the per-seed ratios: exact when every bound lies strictly on its side
    of it (a "> x" above the median, a "< x" below: the median is then a measured seed's);
    else a bound itself when the bounds all point one way (each seed's ratio at or below
    its figure keeps the median at or below theirs: "<" when every seed is a "<", "≤" with
    some "="; likewise ">" / "≥"); else marked "≈"."""
    med = statistics.median(x for x, _ in ratios)
    exact = all(m == "=" or (m == ">" and x > med) or (m == "<" and x < med) for x, m in ratios)
    marks = {m for _, m in ratios}
    if exact:
        return f"{med:.3f}"
    for bound, weak in (("<", "≤"), (">", "≥")):
        if marks <= {bound, "="}:
            return f"{bound if marks == {bound} else weak} {med:.3f}"
    return f"≈ {med:.3f}"


def _run_dir(row: dict) -> str:
    """A row's run directory under --out (rows saved before --repeats: kind-sSEED)."""
    return row.get("run_dir") or f"{row['kind']}-s{row['seed']}"


def where_time_went(run_dir: Path) -> str:
    """One line: wall seconds of (c)'s cold-start and steady-state probes and of its
    training segments, and how much of the probes' wall was their training."""
    parts = {"cold": [0, 0.0, 0.0], "steady": [0, 0.0, 0.0]}
    for probe in sorted((run_dir / "probes").glob("*")):
        # cold2 / cold3: later rungs; joint: a batch probe from a cold first rung
        kind = "steady" if "-steady" in probe.name else "cold"
        resumed = "-cold-" not in probe.name  # continues a snapshot's counters
        note = json.loads((probe / "online_probe.json").read_text())
        ticks = [json.loads(x) for x in (probe / "ticks.jsonl").read_text().splitlines()]
        parts[kind][0] += 1
        parts[kind][1] += note["wall_s"]
        # a probe from a snapshot (steady state, a second rung) continues its counters:
        # its own training is the span of its ticks (less one tick's seconds)
        parts[kind][2] += ticks[-1]["train_wall_s"] - (ticks[0]["train_wall_s"] if resumed else 0.0)
    segs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("train/*/online_segment.json"))]
    seg_wall = sum(x["end_elapsed_s"] - x["begin_elapsed_s"] for x in segs)
    return (
        f"cold start {parts['cold'][0]} probes {parts['cold'][1]:.1f} s wall "
        f"({parts['cold'][2]:.1f} s of it training); steady state {parts['steady'][0]} probes "
        f"{parts['steady'][1]:.1f} s ({parts['steady'][2]:.1f} s training); {len(segs)} "
        f"training segments {seg_wall:.1f} s (probes and segments on one pool of 2 ranks)"
    )


def write_results(
    rows: list[dict],
    seeds: list[int],
    results: Path,
    loads: tuple,
    out: Path | None = None,
    command: str = "",
) -> None:
    results.mkdir(parents=True, exist_ok=True)
    saved = {"rows": rows, "load": loads, "command": command}
    (results / "results.json").write_text(json.dumps(saved, indent=1))
    repeats = max((r.get("repeat", 1) for r in rows), default=1)
    lines = [
        "# distsgd train --tune vs DDP on 2 real processes: Fashion-MNIST cnn to 90%",
        "",
        f"Command: `{command}` (one run, side by side"
        + (f"; each seed's runs {repeats} times, in turn" if repeats > 1 else "")
        + ").",
        "",
        f"Machine load (1/5/15 min) before: {loads[0]}; after: {loads[1]} (2 cores).",
        "",
        "Wall seconds of each whole `distsgd train` command (process starts, data loading, "
        "evaluations and for (c) every probe included; each stops at the target)"
        + ("; a seed's ratio is that of the medians over its repeats." if repeats > 1 else "."),
        "",
        "| run | seed | reached | command wall | samples to 90% | final η, μ | tuning share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{100 * r['tuning_share']:.0f}%" if r.get("tuning_share") is not None else ""
        again = f" (repeat {r['repeat']})" if r.get("repeat", 1) > 1 else ""
        lines.append(
            f"| ({r['kind']}) {LABELS[r['kind']]} | {r['seed']}{again} | {r['reached']} | "
            f"{r['command_wall_s']:.1f} s | {r['samples_to_target']} | "
            f"{r['lr']}, {r['momentum']} | {share} |"
        )
    lines.append("")
    for num, den, goal in (("c", "a", "≤ 1.0, goal 0.8"), ("c", "b", "≤ 0.6")):
        ratios = [_ratio(rows, num, den, s) for s in seeds]
        ok = [x for x in ratios if x is not None]
        med = _median(ok) if ok else "n/a"
        each = ", ".join(
            "n/a" if x is None else f"{'' if x[1] == '=' else x[1] + ' '}{x[0]:.3f}" for x in ratios
        )
        lines.append(f"- ({num})/({den}): per seed {each}; median **{med}** (target {goal}).")
    lines.append(
        '  ("<": the denominator did not reach 90% within 10 epochs, so its time to 90% '
        'is more than its whole run and the ratio is below the figure; ">": the numerator '
        "did not, and the ratio is above it.)"
    )
    for r in rows:
        if r["kind"] == "c" and r["reached"]:
            lines.append(
                f"- (c) seed {r['seed']}"
                + (f" (repeat {r['repeat']})" if r.get("repeat", 1) > 1 else "")
                + f": {r['num_probes']} probes; tuning (setup and every "
                f"probe) {r['tuning_wall_s']:.1f} s of {r['command_wall_s']:.1f} s "
                f"({100 * r['tuning_share']:.0f}% of the run's own wall)"
                + (
                    ": " + where_time_went(out / _run_dir(r)) + "."
                    if out is not None and (out / _run_dir(r) / "probes").exists()
                    else "."
                )
            )
    lines += [
        "- (d) the offline `distsgd tune` + plan: not rerun; see "
        "[../tune_vs_ddp_dist/README.md](../tune_vs_ddp_dist/README.md) (451.6 s of tuning, "
        "plan 78.5 s training wall, (tuning + plan) / DDP 7.9).",
        "",
    ]
    (results / "README.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--runs", default="acb", help="which of a, b, c to run, in order")
    ap.add_argument("--eval-every", type=int, default=15000, help="samples between evaluations")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each seed's runs this many times, in turn (a seed's ratio: of the medians)",
    )
    ap.add_argument("--out", default="bench/out/tune_online")
    ap.add_argument("--results", default="bench/results/tune_online")
    ap.add_argument(
        "--c-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further setting of run (c) (after its own; repeatable)",
    )
    ap.add_argument(
        "--rewrite", action="store_true", help="only rewrite README.md from results.json"
    )
    args = ap.parse_args()
    if args.rewrite:
        saved = json.loads((Path(args.results) / "results.json").read_text())
        loads = tuple(saved["load"])
        write_results(
            saved["rows"], args.seeds, Path(args.results), loads, Path(args.out),
            saved.get("command", ""),
        )  # fmt: skip
        return 0
    command = "python3 bench/tune_online_vs_ddp.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before, rows = _load(), []
    for seed in args.seeds:
        for repeat in range(1, args.repeats + 1):
            for kind in args.runs:
                rows.append(run_one(kind, seed, out, args.eval_every, args.c_set, repeat))
                print(json.dumps({k: rows[-1][k] for k in ("kind", "seed", "repeat",
                      "reached", "command_wall_s", "tuning_share")}), flush=True)  # fmt: skip
                write_results(rows, args.seeds, Path(args.results), (before, _load()), out, command)
    write_results(rows, args.seeds, Path(args.results), (before, _load()), out, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
