"""An elastic parameter-server run on real processes against the same run with a fixed
membership: time to the Fashion-MNIST target, side by side in one run.

Fashion-MNIST, ``mlp``, async parameter server (one server rank), b = 32, SGD lr 0.05
momentum 0.9 with Rudra's α0/λ rule (``staleness_lr = "softsync"``), target 0.85
(evaluated every ``--eval-every`` samples, the run stops at the target; 0.80 is reached
in seconds, before a joiner is in), one thread per process, ``runtime = "dist"``:

* **fixed 2** and **fixed 4**: ``distsgd train`` with λ = 2 (4) learners for the whole run;
* **elastic**: ``distsgd train`` with λ = 2; two joiners start with it (they import
  torch meanwhile) and ``--join-after`` seconds after the run wrote ``join.json`` each
  calls ``distsgd join RUN_DIR`` (the CLI's ``main``; it loads the data, then joins);
  ``--kill-after`` seconds after both joined, one of them is killed with SIGKILL (the
  server retires it; λ = 3 to the end).

On the multi-host test bed (:mod:`distsgd.testbed`, needs root) the run is on host h0
(``dist.master_addr`` = h0's address) and the joiners on h1 and h2, so each join crosses
the bed's network; ``--loopback`` (or no bed) runs everything on this host. Reports wall
seconds to the target (``time_to_target_s``: training seconds, evaluations excluded),
samples to it, pushes per worker (the checkpoint's ``runtime.pushes``), the records of
``membership.jsonl`` and the ratio elastic / fixed 2. Run it alone on the machine's lock::

    flock /tmp/distsgd-bench.lock python bench/elastic.py --results bench/results/elastic.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split(" ")[:3])


def config(num_learners: int, master_addr: str, args: argparse.Namespace) -> str:
    from distsgd.config import RunConfig

    raw = {
        "runtime": "dist",
        "data": {"dataset": "fashion_mnist"},
        "model": {"name": "mlp"},
        "protocol": {
            "name": "parameter_server",
            "mode": "async",
            "num_learners": num_learners,
            "batch_size": 32,
            "staleness_lr": "softsync",
        },
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "dist": {"master_addr": master_addr, "timeout_s": 20.0},
        "train": {
            "target": args.target,
            "stop_at_target": True,
            "max_seconds": args.max_seconds,
            "eval_every_samples": args.eval_every,
            "seed": args.seed,
            "num_threads": 1,
            "tensorboard": False,
        },
    }
    return RunConfig.from_dict(raw).to_toml()


class Hosts:
    """Where processes run: hosts of the bed, or this host for every index."""

    def __init__(self, bed: Any) -> None:
        self.bed = bed

    def popen(self, host: int, argv: list[str], log: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        kw: dict[str, Any] = {"cwd": ROOT, "env": env, "stderr": subprocess.STDOUT}
        kw["stdout"] = log.open("w")
        if self.bed is None:
            return subprocess.Popen(argv, **kw)
        return self.bed.popen(host, argv, **kw)

    def kill(self, host: int, proc: subprocess.Popen) -> None:
        if self.bed is None:
            proc.kill()
        else:
            self.bed.kill_host(host)


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "membership.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run(name: str, hosts: Hosts, cfg: str, tmp: Path, args: argparse.Namespace, elastic: bool):
    """One run on host 0 (with joiners on hosts 1 and 2 where ``elastic``): its row."""
    out, path = tmp / name, tmp / f"{name}.toml"
    path.write_text(cfg)
    train = [sys.executable, "-m", "distsgd", "train", str(path), "--out", str(out), "--quiet"]
    t0 = time.monotonic()
    proc = hosts.popen(0, train, tmp / f"{name}.log")
    joiners = []
    if elastic:  # the joiners import torch meanwhile, then join --join-after s in
        code = (
            "import sys, time, pathlib; from distsgd.cli import main; import torch\n"
            f"p = pathlib.Path({str(out / 'join.json')!r})\n"
            "while not p.exists(): time.sleep(0.05)\n"
            f"time.sleep({args.join_after}); sys.exit(main(['join', {str(out)!r}]))"
        )
        join = [sys.executable, "-c", code]
        joiners = [(h, hosts.popen(h, join, tmp / f"join-h{h}.log")) for h in (1, 2)]
        while not (out / "join.json").exists() and proc.poll() is None:
            time.sleep(0.1)
        while len(records(out)) < 2 and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(args.kill_after)
        if proc.poll() is None:
            hosts.kill(*joiners[1])
    rc = proc.wait(timeout=args.max_seconds + 300)
    for _, p in joiners:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)
    if rc != 0:
        raise RuntimeError(f"{name}: exit {rc}\n{(tmp / f'{name}.log').read_text()[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    pushes = torch.load(out / "checkpoint.pt", weights_only=True)["runtime"]["pushes"]
    print(f"{name}: {time.monotonic() - t0:.0f} s wall, reached {s['reached']}", file=sys.stderr)
    return {
        "name": name,
        "time_to_target_s": s["time_to_target_s"],
        "samples_to_target": s["samples_to_target"],
        "train_wall_s": s["train_wall_s"],
        "samples": s["samples"],
        "final_metric": s["final_metric"],
        "staleness_mean": s["staleness_mean"],
        "pushes": pushes,
        "membership": records(out),
        "joiner_exit": [p.returncode for _, p in joiners],
    }


def table(rows: list[dict[str, Any]], target: float) -> str:
    def f(x: Any, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    lines = [
        f"| run | wall s to {target} | samples to {target} | train wall s | samples | final acc | σ mean "
        "| pushes per worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {f(r['time_to_target_s'], '.1f')} | {f(r['samples_to_target'], 'd')} "
            f"| {r['train_wall_s']:.1f} | {r['samples']} | {f(r['final_metric'], '.4f')} "
            f"| {f(r['staleness_mean'], '.2f')} | {r['pushes']} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, help="write the Markdown table here")
    ap.add_argument("--loopback", action="store_true", help="every process on this host")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--eval-every", type=int, default=8192)
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--join-after", type=float, default=1.0)
    ap.add_argument("--kill-after", type=float, default=3.0)
    ap.add_argument("--fixed4", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from distsgd import testbed

    why = "--loopback" if args.loopback else testbed.unavailable()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [load()]
    with contextlib.ExitStack() as stack:
        tmp = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="elastic-")))
        tmp.mkdir(parents=True, exist_ok=True)
        bed = None if why else stack.enter_context(testbed.Bed(3, max_seconds=3600))
        hosts, addr = Hosts(bed), "127.0.0.1" if bed is None else bed.addresses[0]
        rows = [run("fixed 2", hosts, config(2, addr, args), tmp, args, False)]
        if args.fixed4:
            rows.append(run("fixed 4", hosts, config(4, addr, args), tmp, args, False))
        rows.append(run("elastic", hosts, config(2, addr, args), tmp, args, True))
        loads.append(load())
    fixed, el = rows[0], rows[-1]
    ratio = (
        el["time_to_target_s"] / fixed["time_to_target_s"]
        if el["time_to_target_s"] and fixed["time_to_target_s"]
        else None
    )
    where = f"on this host ({why})" if why else "run on bed host h0, joiners on h1 and h2"
    text = "\n".join(
        [
            "# Elastic parameter server on real processes vs fixed membership",
            "",
            f"Started {started}; load (1/5/15 min) before {loads[0]}, after {loads[1]}; "
            f"{os.cpu_count()} CPUs; {where}.",
            "",
            "```text",
            "flock /tmp/distsgd-bench.lock python " + " ".join(sys.argv),
            "```",
            "",
            table(rows, args.target),
            "",
            f"elastic / fixed 2 wall seconds to the target: "
            f"{'—' if ratio is None else f'{ratio:.2f}'}",
            "",
            "Elastic run's membership.jsonl:",
            "",
            "```text",
            *[json.dumps(r) for r in el["membership"]],
            "```",
            "",
            f"Joiners' exit status (h1, h2; h2's was SIGKILLed): {el['joiner_exit']}",
            "",
        ]
    )
    print(text)
    if args.results:
        args.results.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
