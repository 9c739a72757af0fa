"""Time to the Fashion-MNIST target under stragglers, on the simulated cluster.

Fashion-MNIST, ``mlp``, λ = 4 learners × b = 32, SGD lr 0.05 momentum 0.9, target 0.80
(evaluated every ``--eval-every`` samples, the run stops at the target). Two straggler
scenarios, each run with hardsync, hardsync + 1 backup learner (5 learners, each step
averages the first 4 gradients), 1-softsync and async (Rudra's parameter server; async with
the α0/n rule, ``staleness_lr = "softsync"``), side by side in one process:

* ``slow``: one learner 2× slower (``cluster.speed_factors`` 0.5 for learner 0);
* ``stalls``: every minibatch stalls with probability ``--stall-p`` for an exponentially
  distributed time of mean ``--stall-factor`` × t(b) (``cluster.stall_*``), t(b) the
  device's compute time of one minibatch.

plus hardsync without stragglers as the reference. Every run uses the device profile
measured on this machine (the profile cache: the first run measures it). Reports the
simulated seconds to the target, the samples to it and the dropped gradients, and the ratio
hardsync + 1 backup / hardsync per scenario (Chen et al. 2016, arXiv:1604.00981).

Real processes are not run by this bench: runtime ``dist`` runs backup learners (one
server rank more, docs/protocols.md "Backup learners") but has no way to make one
learner 2× slower or stall it.

    flock /tmp/distsgd-bench.lock python bench/stragglers.py --out bench/out/stragglers \\
        --results bench/results/stragglers.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import distsgd
from distsgd.runtime.base import TrainingDiverged

LAM, BATCH = 4, 32

PROTOCOLS: dict[str, dict[str, Any]] = {
    "hardsync": {"name": "hardsync"},
    "hardsync + 1 backup": {"name": "hardsync", "backup_learners": 1},
    "1-softsync": {"name": "parameter_server", "mode": "softsync", "softsync": 1},
    # Rudra's α0/n rule: at α0 with momentum 0.9 async λ = 4 diverges
    "async": {"name": "parameter_server", "mode": "async", "staleness_lr": "softsync"},
}


def config(protocol: dict[str, Any], cluster: dict[str, Any], args: argparse.Namespace) -> dict:
    """The run's config: the protocol's section and the scenario's cluster settings."""
    return {
        "data": {"dataset": "fashion_mnist"},
        "model": {"name": "mlp"},
        "protocol": {"num_learners": LAM, "batch_size": BATCH, **protocol},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": cluster,
        "train": {
            "target": args.target,
            "stop_at_target": True,
            "max_epochs": args.max_epochs,
            "eval_every_samples": args.eval_every,
            "seed": args.seed,
            "num_threads": 1,
        },
    }


def run(name: str, cfg: dict, out: Path) -> dict[str, Any]:
    """The run's summary; one that diverges is reported as not reaching the target."""
    t0 = time.perf_counter()
    try:
        s = distsgd.train(cfg, out_dir=out / name.replace(" ", "_").replace("+", "plus"))
    except TrainingDiverged as e:
        s = {"reached": f"diverged ({e})", "time_to_target_virtual_s": None}
        s |= {"samples_to_target": None, "train_wall_s": time.perf_counter() - t0}
    print(f"{name}: {time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    return s


def speeds(protocol: dict[str, Any]) -> list[float]:
    """Learner 0 at half speed, the others at 1 (λ + β of them)."""
    return [0.5] + [1.0] * (LAM - 1 + protocol.get("backup_learners", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.80)
    ap.add_argument("--max-epochs", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-p", type=float, default=0.1)
    ap.add_argument("--stall-factor", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/stragglers"))
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows: list[tuple[str, str, dict[str, Any]]] = []
    base = run("none_hardsync", config(PROTOCOLS["hardsync"], {}, args), args.out)
    rows.append(("none", "hardsync", base))
    prof = base["device_profile"]
    t_b = prof["seconds_per_batch"] + BATCH * prof["seconds_per_sample"]
    stalls = {
        "stall_probability": args.stall_p,
        "stall_seconds": args.stall_factor * t_b,
        "stall_distribution": "exponential",
    }
    for scenario in ("slow", "stalls"):
        for label, protocol in PROTOCOLS.items():
            cluster = {"speed_factors": speeds(protocol)} if scenario == "slow" else stalls
            name = f"{scenario}_{label}"
            rows.append((scenario, label, run(name, config(protocol, cluster, args), args.out)))
    load_after = os.getloadavg()
    text = report(rows, args, t_b, stalls, load_before, load_after)
    print(text)
    if args.results:
        args.results.write_text(text)
    (args.out / "summaries.json").write_text(
        json.dumps([{"scenario": s, "protocol": p, **r} for s, p, r in rows], indent=1)
    )


def _ratio(rows: list[tuple[str, str, dict]], scenario: str) -> str:
    t = {p: r["time_to_target_virtual_s"] for s, p, r in rows if s == scenario}
    a, b = t.get("hardsync + 1 backup"), t.get("hardsync")
    return f"{a / b:.2f}" if a and b else "n/a (a run missed the target)"


def report(
    rows: list[tuple[str, str, dict]],
    args: argparse.Namespace,
    t_b: float,
    stalls: dict[str, Any],
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        "# Time to the Fashion-MNIST target under stragglers (simulated cluster)",
        "",
        "```",
        "flock /tmp/distsgd-bench.lock python bench/stragglers.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        f"Commit {commit}. mlp, λ = {LAM} × b = {BATCH}, SGD lr 0.05 momentum 0.9, target "
        f"{args.target}, evaluation every {args.eval_every} samples, seed {args.seed}; device "
        f"profile measured on this machine (t(b) = {t_b * 1e3:.3f} ms per minibatch), jitter "
        f"0.1. Load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} "
        f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} "
        f"{load_after[2]:.1f} (simulated seconds do not depend on the load; the profile "
        "does, measured once).",
        "",
        "Scenarios: `slow` = learner 0 at speed 0.5 (2× slower); `stalls` = each minibatch "
        f"stalls with probability {stalls['stall_probability']} for an exponential time of "
        f"mean {stalls['stall_seconds'] * 1e3:.3f} ms ({args.stall_factor:g} × t(b)).",
        "",
        "| scenario | protocol | reached | simulated s to target | samples to target "
        "| dropped gradients | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, label, r in rows:
        tt = r["time_to_target_virtual_s"]
        st = r["samples_to_target"]
        lines.append(
            f"| {scenario} | {label} | {r['reached']} | "
            f"{'—' if tt is None else f'{tt:.2f}'} | {'—' if st is None else st} | "
            f"{r.get('dropped_gradients', 0)} | {r['train_wall_s']:.0f} |"
        )
    lines += [
        "",
        "Ratio hardsync + 1 backup / hardsync, simulated seconds to the target "
        "(issue target ≤ 0.7 with one learner 2× slower): "
        f"slow {_ratio(rows, 'slow')}, stalls {_ratio(rows, 'stalls')}.",
        "",
        "Measured on real processes: none (`protocol.backup_learners` is refused on runtime "
        "`dist`), so simulated vs measured is not compared here.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
