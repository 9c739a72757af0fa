"""Time to accuracy on a slow link: less communication against hardsync, on 2 hosts.

Two hosts of the multi-host test bed (:mod:`distsgd.testbed`), one process each, every
frame a host sends delayed ``--delay-ms`` (20 ms) and rate-limited to ``--rate-mbit``
(100 Mbit/s). Each method trains Fashion-MNIST's ``mlp`` (269,322 parameters) with
``distsgd train`` under ``torchrun --nnodes 2 --nproc-per-node 1`` (runtime ``dist``,
gloo, one thread per rank) until ``--target`` test accuracy, evaluating every
``--eval-every`` samples (evaluation is not in the training seconds):

* hardsync float32, bf16 (DDP's cast hook), PowerSGD rank 4 (torch's hook): b = 32 per
  learner, SGD η 0.05, μ 0.9;
* local SGD and DiLoCo (H = ``--average-every``; outer Nesterov SGD η 0.7, μ 0.9, the
  paper's) and DiLoCo with int8 pseudo-gradients: b = 32, inner SGD η 0.05, μ 0 (inner
  momentum 0.9 diverged under the paper's outer settings, bench/results/vs_torchft.md).

Reported per method and seed: training wall seconds and samples to the target
(``summary.json``'s ``time_to_target_s``), bytes sent, and each one's ratio to hardsync
float32's. Methods run one after the other per seed, in the order above. Run it alone on
the machine's lock::

    flock /tmp/distsgd-bench.lock python bench/slow_link.py --out bench/results/slow_link.json

Needs root (network namespaces); prints why not otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multihost import torchrun  # noqa: E402 (after the path)

HARD = {"name": "hardsync"}
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
METHODS: dict[str, tuple[dict[str, Any], float]] = {  # protocol settings, inner μ
    "hardsync fp32": (HARD, 0.9),
    "hardsync bf16": ({**HARD, "compression": "bf16"}, 0.9),
    "hardsync PowerSGD r=4": ({**HARD, "compression": "powersgd", "powersgd_rank": 4}, 0.9),
    "local SGD": ({"name": "local_sgd"}, 0.0),
    "DiLoCo": ({"name": "diloco", **OUTER}, 0.0),
    "DiLoCo int8": ({"name": "diloco", **OUTER, "compression": "int8"}, 0.0),
}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split(" ")[:3])


def config(method: str, args: argparse.Namespace, seed: int, path: Path) -> Path:
    from distsgd.config import RunConfig

    protocol, momentum = METHODS[method]
    raw = {
        "runtime": "dist",
        "model": {"name": "mlp"},
        "protocol": {
            **protocol,
            "num_learners": 2,
            "batch_size": 32,
            "average_every": args.average_every,
        },
        "optimizer": {"lr": 0.05, "momentum": momentum},
        "train": {
            "num_threads": 1,
            "target": args.target,
            "max_epochs": 1,
            "max_seconds": args.max_seconds,
            "eval_every_samples": args.eval_every,
            "tensorboard": False,
            "checkpoint_every_evals": 0,
            "seed": seed,
        },
        "dist": {"timeout_s": 120},
    }
    path.write_text(RunConfig.from_dict(raw).to_toml())
    return path


def row(method: str, seed: int, s: dict[str, Any]) -> dict[str, Any]:
    records = [json.loads(x) for x in (Path(s["_dir"]) / "metrics.jsonl").open()]
    hit = next((r for r in records if (r.get("eval_metric") or 0) >= s["target"]), None)
    return {
        "method": method,
        "seed": seed,
        "reached": bool(s["reached"]),
        "seconds_to_target": s["time_to_target_s"],
        "samples_to_target": hit["samples"] if hit else None,
        "bytes_to_target": hit["bytes_sent"] if hit else None,
        "train_wall_s": s["train_wall_s"],
        "samples": s["samples"],
        "bytes_sent": s["bytes_sent"],
        "final_metric": s["final_metric"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    def med(method: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["method"] == method and r[key] is not None]
        return statistics.median(vals) if vals else None

    base_s, base_b = (
        med("hardsync fp32", "seconds_to_target"),
        med("hardsync fp32", "bytes_to_target"),
    )
    out = [
        "| method | reached | s to target | samples to target | MB sent to target "
        "| s ratio to hardsync fp32 | bytes ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        s, n, b = (med(m, k) for k in ("seconds_to_target", "samples_to_target",
                                       "bytes_to_target"))  # fmt: skip
        ratio = f"{s / base_s:.2f}" if s and base_s else "-"
        bratio = f"{b / base_b:.3f}" if b and base_b else "-"
        reached = f"{sum(r['reached'] for r in mine)}/{len(mine)}"
        s_txt = f"{s:.1f}" if s else "-"
        n_txt = f"{n:.0f}" if n else "-"
        b_txt = f"{b / 1e6:.1f}" if b else "-"
        out.append(f"| {m} | {reached} | {s_txt} | {n_txt} | {b_txt} | {ratio} | {bratio} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--average-every", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=2048)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from distsgd import testbed

    if why := testbed.unavailable():
        print(f"bench/slow_link.py: no multi-host bed here: {why}", file=sys.stderr)
        return 2
    loads, rows, port = [load()], [], 29600
    link = testbed.Link(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit)
    with tempfile.TemporaryDirectory(prefix="distsgd-slowlink-") as t, \
            testbed.Bed(2, links={0: link, 1: link}, max_seconds=7200) as bed:  # fmt: skip
        tmp = Path(t)
        for seed in range(args.seeds):
            for m in args.methods:
                port += 1
                out = tmp / f"run-{port}"
                cfg = config(m, args, seed, tmp / f"{port}.toml")
                try:
                    s = torchrun(bed, cfg, out, port, args.max_seconds + 300, processes_per_host=1)
                except RuntimeError as e:
                    print(f"{m} seed {seed}: {str(e)[-3000:]}", file=sys.stderr, flush=True)
                    rows.append({"method": m, "seed": seed, "failed": True})
                    continue
                rows.append(row(m, seed, {**s, "_dir": str(out)}))
                print(json.dumps(rows[-1]), flush=True)
                loads.append(load())
    ok = [r for r in rows if not r.get("failed")]
    print(f"load (1/5/15 min) per run: {loads}")
    print(table(ok))
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "loads": loads, "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
