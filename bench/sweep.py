"""Sweep driver: run a grid of configs, several seeds each, then hand the runs to the report.

Every point of the grid is one ``distsgd train`` process writing its own run directory
``OUT/<point>-s<seed>``; a run whose ``summary.json`` already exists is not run again, so
an interrupted sweep continues where it stopped. Diverged runs are kept (their summary
says so) and reported like the others.

    python bench/sweep.py configs/hardsync.toml \\
        --grid protocol.num_learners=1,2,4 --grid optimizer.lr=0.02,0.05 \\
        --seeds 0 1 2 --set train.max_epochs=1 --jobs 2 --out bench/out/sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

Point = tuple[str, list[str]]


def grid_points(grid: Sequence[str]) -> list[Point]:
    """Cartesian product of ``key=v1,v2,...`` axes as (name, overrides) points."""
    axes = []
    for axis in grid:
        key, _, values = axis.partition("=")
        if not values:
            raise SystemExit(f"--grid {axis!r}: expected KEY=V1,V2,...")
        axes.append([(key, v) for v in values.split(",")])
    points = []
    for combo in itertools.product(*axes):
        name = "_".join(f"{k.split('.')[-1]}={v}" for k, v in combo) or "base"
        points.append((name, [f"{k}={v}" for k, v in combo]))
    return points


def _run_one(config: str | None, overrides: list[str], out: Path, threads: int) -> tuple[Path, str]:
    summary = out / "summary.json"
    stamp = out / "sweep_args.json"  # what the run was started with
    args = {"config": config, "overrides": list(overrides)}
    if summary.exists():
        if stamp.exists() and json.loads(stamp.read_text()) == args:
            return out, "cached"
        raise RuntimeError(
            f"{out} holds a run started with other settings; use another --out or delete it"
        )
    if out.exists():  # a run that stopped before writing its summary: start it again
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "distsgd", "train"]
    if config:
        cmd.append(config)
    for o in [*overrides, f"train.num_threads={threads}"]:
        cmd += ["--set", o]
    cmd += ["--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if out.exists():
        stamp.write_text(json.dumps(args))
    if r.returncode not in (0, 1):  # 1 = diverged, which is a result
        raise RuntimeError(f"run {out} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    status = json.loads(summary.read_text())["status"] if summary.exists() else "failed"
    return out, f"{status} in {took:.0f} s"


def run_grid(
    points: Sequence[Point],
    seeds: Sequence[int],
    out_root: Path,
    config: str | None = None,
    common: Sequence[str] = (),
    jobs: int = 1,
) -> list[Path]:
    """Run every (point, seed); returns the run directories in grid order.

    Args:
        points: (name, overrides) pairs.
        seeds: ``train.seed`` values; each point runs once per seed.
        out_root: parent of the run directories.
        config: base TOML config (None: the default run).
        common: overrides applied to every run before the point's own.
        jobs: runs in parallel; each gets ``cores / jobs`` threads.
    """
    out_root.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))
    tasks = []
    for name, overrides in points:
        for seed in seeds:
            out = out_root / f"{name}-s{seed}"
            tasks.append((config, [*common, *overrides, f"train.seed={seed}"], out, threads))
    total = len(tasks)
    dirs = [t[2] for t in tasks]
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = [pool.submit(_run_one, *t) for t in tasks]
        for i, fut in enumerate(futures, 1):
            out, what = fut.result()
            print(f"[{i}/{total}] {out.name}: {what}", flush=True)
    return dirs


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run a grid of distsgd configs and report them.")
    ap.add_argument("config", nargs="?", default=None, help="base TOML config")
    ap.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="one axis of the grid (repeatable; the grid is the product of the axes)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override applied to every run",
    )
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="train.seed values (default: 0)"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="runs in parallel, cores/jobs threads each (default: 1)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("bench/out/sweep"),
        help="parent of the run directories (default: bench/out/sweep)",
    )
    ap.add_argument("--no-report", action="store_true", help="skip distsgd report at the end")
    args = ap.parse_args(argv)
    dirs = run_grid(grid_points(args.grid), args.seeds, args.out, args.config, args.set, args.jobs)
    if not args.no_report:
        from distsgd.report import make_report

        md = make_report(dirs, args.out / "report")
        print(f"report: {md}")


if __name__ == "__main__":
    main()
