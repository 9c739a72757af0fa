"""Time to the Fashion-MNIST target under stragglers: simulated, and on real processes
against the simulator's prediction.

Fashion-MNIST, ``mlp``, b = 32, SGD lr 0.05 momentum 0.9, target 0.80 (evaluated every
``--eval-every`` samples, ``--real-eval-every`` for the real-process rows and their
predictions; the run stops at the target). Every row runs once per seed of ``--seeds``
(``train.seed``: initial weights, data order, stalls) and reports the median across
them: seconds and samples to the target over the seeds that reached it, seconds per
sample as the median of each seed's ratio, dropped gradients over all seeds. Two straggler scenarios, each run
with hardsync, hardsync + 1 backup learner (λ + 1 learners, each step averages the first
λ gradients), 1-softsync and async (Rudra's parameter server; async with the α0/n rule,
``staleness_lr = "softsync"``):

* ``slow``: one learner 2× slower;
* ``stalls``: every minibatch stalls with probability ``--stall-p`` for an exponentially
  distributed time of mean ``--stall-factor`` × t(b), t(b) the device's compute time of
  one minibatch.

Three tables, one process, side by side:

1. **Simulated, λ = 4** (``cluster.speed_factors`` 0.5 for learner 0, ``cluster.stall_*``),
   plus hardsync without stragglers, on the device profile of this machine (the profile
   cache): simulated seconds to the target, samples to it, dropped gradients, and the
   ratio hardsync + 1 backup / hardsync (Chen et al. 2016, arXiv:1604.00981).
2. **Elastic, simulated:** async parameter server starting with 2 learners, 2 more join
   at ``--join-frac`` of the fixed run's time to the target and worker 0 leaves at
   ``--leave-frac`` of it (``cluster.membership``), against 2 learners throughout.
3. **Real processes, λ = ``--real-learners``** (default 2: hardsync + 1 backup is 1
   server + 3 learner processes on this machine's cores), runtime ``dist`` over loopback
   gloo, plus hardsync without stragglers as the calibration's reference. The straggler
   is made by :class:`~distsgd.runtime.faults.RankFaults`: the slow learner sleeps
   (f − 1) = 1 × the wall seconds of each of its gradients (on hardsync: of its DDP
   iteration), and stalls are slept after a minibatch as the simulator charges them.
   Beside each run, the simulator's run of the same config, calibrated here as
   bench/multihost.py does (``distsgd calibrate``, netcal on loopback, ``cluster.cores``
   the machine's, jitter 0, the server's time per push from a 1-learner async run on
   processes). Reports measured seconds to the target (the run's ``time_to_target_s``),
   simulated seconds, their ratio (target 0.75–1.25), samples to the target, dropped
   gradients, and the measured ratio hardsync + 1 backup / hardsync (target ≤ 0.7 with
   the slow learner). ``--no-real`` skips this table.

Run it alone on the machine's lock::

    flock /tmp/distsgd-bench.lock python bench/stragglers.py --out bench/out/stragglers \\
        --results bench/results/stragglers.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import distsgd
from distsgd.config import RunConfig
from distsgd.runtime.base import TrainingDiverged
from distsgd.runtime.faults import RankFaults

LAM, BATCH = 4, 32

PROTOCOLS: dict[str, dict[str, Any]] = {
    "hardsync": {"name": "hardsync"},
    "hardsync + 1 backup": {"name": "hardsync", "backup_learners": 1},
    "1-softsync": {"name": "parameter_server", "mode": "softsync", "softsync": 1},
    # Rudra's α0/n rule: at α0 with momentum 0.9 async λ = 4 diverges
    "async": {"name": "parameter_server", "mode": "async", "staleness_lr": "softsync"},
}


def config(
    protocol: dict[str, Any],
    cluster: dict[str, Any],
    args: argparse.Namespace,
    lam: int = LAM,
    seed: int | None = None,
    eval_every: int | None = None,
) -> dict:
    """The run's config: the protocol's section and the scenario's cluster settings
    (``seed``: default the first of ``--seeds``; ``eval_every``: default
    ``--eval-every``)."""
    return {
        "data": {"dataset": "fashion_mnist"},
        "model": {"name": "mlp"},
        "protocol": {"num_learners": lam, "batch_size": BATCH, **protocol},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": cluster,
        "train": {
            "target": args.target,
            "stop_at_target": True,
            "max_epochs": args.max_epochs,
            "eval_every_samples": eval_every or args.eval_every,
            "seed": args.seeds[0] if seed is None else seed,
            "num_threads": 1,
        },
    }


def run(name: str, cfg: dict, out: Path, faults: RankFaults | None = None) -> dict[str, Any]:
    """The run's summary; one that diverges is reported as not reaching the target."""
    t0 = time.perf_counter()
    try:
        out_dir = out / name.replace(" ", "_").replace("+", "plus")
        s = distsgd.train(cfg, out_dir=out_dir, faults=faults)
    except TrainingDiverged as e:
        s = {"reached": f"diverged ({e})", "time_to_target_virtual_s": None}
        s |= {"samples_to_target": None, "train_wall_s": time.perf_counter() - t0}
    print(f"{name}: {time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    return s


def run_or_fail(name: str, cfg: dict, out: Path, faults: RankFaults | None) -> dict[str, Any]:
    """:func:`run`; a run on real processes that fails is reported as failed."""
    try:
        return run(name, cfg, out, faults)
    except Exception as e:  # noqa: BLE001 - the row is reported as failed
        print(f"{name} failed: {e}", file=sys.stderr, flush=True)
        return {"reached": f"failed ({type(e).__name__})"}


def run_seeds(
    name: str,
    make: Callable[[int], dict],
    out: Path,
    seeds: list[int],
    faults: Callable[[int], RankFaults | None] = lambda seed: None,
) -> dict[str, Any]:
    """One row: the run of ``make(seed)`` for each seed, combined by :func:`combine`."""
    runs = []
    for seed in seeds:
        tag = name if len(seeds) == 1 else f"{name}_seed{seed}"
        runs.append(run_or_fail(tag, make(seed), out, faults(seed)))
    return combine(runs)


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's runs (one per seed) as one summary: ``reached`` as "k/n"; the median
    seconds (virtual and measured) and samples to the target over the runs that reached
    it; ``per_sample_s`` / ``per_sample_virtual_s``, the median of each such run's
    seconds per sample to the target; the median dropped gradients over every run; the
    wall seconds added up; each run's summary in ``per_seed``."""
    hit = [r for r in runs if r.get("reached") is True]
    row: dict[str, Any] = {"reached": f"{len(hit)}/{len(runs)}", "per_seed": runs}
    for key in ("time_to_target_virtual_s", "time_to_target_s", "samples_to_target"):
        row[key] = _median([r.get(key) for r in hit])
    row["per_sample_virtual_s"] = _median([per_sample(r) for r in hit])
    row["per_sample_s"] = _median([per_sample(r, "time_to_target_s") for r in hit])
    row["dropped_gradients"] = _median([r.get("dropped_gradients", 0) for r in runs])
    row["train_wall_s"] = sum(r.get("train_wall_s") or 0.0 for r in runs)
    return row


def speeds(protocol: dict[str, Any], lam: int = LAM) -> list[float]:
    """Learner 0 at half speed, the others at 1 (λ + β of them)."""
    return [0.5] + [1.0] * (lam - 1 + protocol.get("backup_learners", 0))


def calibrate(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The simulated cluster's settings for this machine, as bench/multihost.py fits
    them: the device by ``distsgd calibrate`` (one thread), loopback gloo by
    :func:`~distsgd.runtime.netcal.calibrate_network` (messages and all-reduce), every
    rank on this machine's cores (``cluster.cores``, each process its own host on the
    loopback "link"), no jitter, and the server's time per push as a 1-learner async run
    on processes reports it (``server_seconds_per_push``). Returns (cluster, what was
    measured)."""
    from distsgd.runtime.netcal import calibrate_network
    from distsgd.runtime.profiles import read_profile

    raw = config(PROTOCOLS["async"], {}, args, lam=1)
    cal_cfg = out / "calibrate.toml"
    cal_cfg.write_text(RunConfig.from_dict(raw).to_toml())
    profile = out / "profile.toml"
    subprocess.run([sys.executable, "-m", "distsgd", "calibrate", str(cal_cfg), "--out",
                    str(profile)], check=True, capture_output=True)  # fmt: skip
    prof = read_profile(profile)
    net = calibrate_network(prof.key.num_parameters, repeats=args.net_repeats)
    link = {o.split("=")[0].split(".")[1]: float(o.split("=")[1]) for o in net.overrides()}
    server_raw = {**raw, "runtime": "dist", "dist": {"timeout_s": 60.0}}
    server_raw["train"] = {**raw["train"], "evaluate": False, "max_epochs": 0,
                           "max_seconds": args.server_seconds, "target": 0.0,
                           "stop_at_target": False, "checkpoint_every_evals": 0}  # fmt: skip
    server = run("calibrate_server", server_raw, out)
    cluster = {"profile": str(profile), "jitter": 0.0, "cores": os.cpu_count() or 1,
               "processes_per_host": 0, **link,
               "seconds_per_push": server["server_seconds_per_push"]}  # fmt: skip
    t_b = prof.seconds_per_batch + BATCH * prof.seconds_per_sample
    info = {"t_b": t_b, "per_iteration": prof.seconds_per_iteration or 0.0,
            "calibrate_push": prof.seconds_per_push or 0.0, **link,
            "server_push": server["server_seconds_per_push"]}  # fmt: skip
    return cluster, info


def learner_rank(protocol: dict[str, Any], learner: int) -> int:
    """Learner ``learner``'s rank on runtime ``dist``: rank l for hardsync (DDP), rank
    1 + l where a server rank comes first (parameter server; hardsync with backups)."""
    served = protocol["name"] == "parameter_server" or protocol.get("backup_learners", 0)
    return learner + (1 if served else 0)


REAL_CASES = [("none", "hardsync")] + [(s, p) for s in ("slow", "stalls") for p in PROTOCOLS]


def real_rows(args: argparse.Namespace, out: Path) -> tuple[list[dict[str, Any]], dict]:
    """Each protocol × scenario on real processes (loopback), then the simulator's run of
    the same config on the calibrated cluster."""
    cluster, info = calibrate(args, out)
    print(f"calibration: {info}", file=sys.stderr, flush=True)
    lam, rows, every = args.real_learners, [], args.real_eval_every
    stall_s = args.stall_factor * info["t_b"]
    stall = {"stall_probability": args.stall_p, "stall_seconds": stall_s,
             "stall_distribution": "exponential"}  # fmt: skip
    cases = [(s, p) for s, p in REAL_CASES if not args.real_cases or f"{s}/{p}" in args.real_cases]
    for scenario, label in cases:
        protocol = PROTOCOLS[label]
        extra: dict[str, Any] = {}

        def faults(seed: int, scenario: str = scenario, protocol: dict = protocol) -> RankFaults:
            if scenario == "slow":
                return RankFaults(slow={learner_rank(protocol, 0): 2.0})
            if scenario == "stalls":
                return RankFaults(**stall, stall_seed=seed)
            return RankFaults()

        if scenario == "slow":
            extra = {"speed_factors": speeds(protocol, lam)}
        elif scenario == "stalls":
            extra = stall

        def real_cfg(seed: int, protocol: dict = protocol) -> dict:
            raw = config(protocol, {}, args, lam=lam, seed=seed, eval_every=every)
            raw["train"]["checkpoint_every_evals"] = 0
            return {**raw, "runtime": "dist", "dist": {"timeout_s": 60.0}}

        def sim_cfg(seed: int, protocol: dict = protocol, extra: dict = extra) -> dict:
            return config(protocol, {**cluster, **extra}, args, lam=lam, seed=seed,
                          eval_every=every)  # fmt: skip

        real = run_seeds(f"real_{scenario}_{label}", real_cfg, out, args.seeds, faults)
        sim = run_seeds(f"predicted_{scenario}_{label}", sim_cfg, out, args.seeds)
        rows.append({"scenario": scenario, "protocol": label, "real": real, "sim": sim,
                     "load": " ".join(f"{x:.1f}" for x in os.getloadavg())})  # fmt: skip
    return rows, info


def elastic_rows(args: argparse.Namespace, out: Path) -> list[tuple[str, dict[str, Any]]]:
    """Async parameter server on the simulated cluster: 2 learners throughout; then 2
    learners joined by 2 at ``--join-frac`` of the fixed run's time to the target, of
    which worker 0 leaves at ``--leave-frac`` of it (``cluster.membership``)."""
    fixed = run("elastic_fixed", config(PROTOCOLS["async"], {}, args, lam=2), out)
    t = fixed["time_to_target_virtual_s"] or 1.0
    args.join_at, args.leave_at = args.join_frac * t, args.leave_frac * t
    changes = [{"at_s": args.join_at, "join": 2}, {"at_s": args.leave_at, "leave": [0]}]
    cfg = config(PROTOCOLS["async"], {"membership": changes}, args, lam=2)
    return [("fixed, 2 learners", fixed), ("2, +2, −1", run("elastic_join_leave", cfg, out))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.80)
    ap.add_argument("--max-epochs", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=4000, help="samples between evaluations")
    ap.add_argument(
        "--real-eval-every",
        type=int,
        default=None,
        help="the real-process rows' and their predictions' (default --eval-every)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="train.seed of each run of a row; a row reports the median",
    )
    ap.add_argument("--stall-p", type=float, default=0.1)
    ap.add_argument("--stall-factor", type=float, default=5.0)
    ap.add_argument("--real-learners", type=int, default=2, help="λ of the real-process rows")
    ap.add_argument("--no-real", action="store_true", help="simulated rows only")
    ap.add_argument("--no-sim", action="store_true", help="real-process rows only")
    ap.add_argument(
        "--real-cases",
        nargs="+",
        default=None,
        help='real-process rows to run, as "scenario/protocol" (e.g. "slow/hardsync + 1 '
        'backup"); default: all',
    )
    ap.add_argument("--net-repeats", type=int, default=10)
    ap.add_argument("--server-seconds", type=float, default=6.0)
    ap.add_argument("--join-frac", type=float, default=0.25, help="elastic: 2 learners join")
    ap.add_argument("--leave-frac", type=float, default=0.5, help="elastic: 1 learner leaves")
    ap.add_argument("--out", type=Path, default=Path("bench/out/stragglers"))
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args()
    args.real_eval_every = args.real_eval_every or args.eval_every
    unknown = sorted(set(args.real_cases or []) - {f"{s}/{p}" for s, p in REAL_CASES})
    if unknown:
        ap.error(f"--real-cases = {unknown} is not allowed: expected scenario/protocol, one of "
                 f"{[f'{s}/{p}' for s, p in REAL_CASES]}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows, t_b, stalls = ([], 0.0, {}) if args.no_sim else sim_rows(args)
    elastic = [] if args.no_sim else elastic_rows(args, args.out)
    real, info = ([], {}) if args.no_real else real_rows(args, args.out)
    load_after = os.getloadavg()
    text = ""
    if not args.no_sim:
        text = report(rows, args, t_b, stalls, load_before, load_after) + "\n"
        text += report_elastic(elastic, args)
    text += report_real(real, info, args)
    print(text)
    if args.results:
        args.results.write_text(text)
    (args.out / "summaries.json").write_text(
        json.dumps(
            {
                "simulated": [{"scenario": s, "protocol": p, **r} for s, p, r in rows],
                "elastic": [{"membership": m, **r} for m, r in elastic],
                "real": real,
                "calibration": info,
            },
            indent=1,
            default=str,
        )
    )


def sim_rows(args: argparse.Namespace) -> tuple[list[tuple[str, str, dict]], float, dict]:
    """The simulated table's rows (λ = 4), t(b) of this machine's profile, the stalls."""
    rows: list[tuple[str, str, dict[str, Any]]] = []
    base = run_seeds(
        "none_hardsync",
        lambda seed: config(PROTOCOLS["hardsync"], {}, args, seed=seed),
        args.out,
        args.seeds,
    )
    rows.append(("none", "hardsync", base))
    prof = base["per_seed"][0]["device_profile"]
    t_b = prof["seconds_per_batch"] + BATCH * prof["seconds_per_sample"]
    stalls = {
        "stall_probability": args.stall_p,
        "stall_seconds": args.stall_factor * t_b,
        "stall_distribution": "exponential",
    }
    for scenario in ("slow", "stalls"):
        for label, protocol in PROTOCOLS.items():
            cluster = {"speed_factors": speeds(protocol)} if scenario == "slow" else stalls

            def make(seed: int, protocol: dict = protocol, cluster: dict = cluster) -> dict:
                return config(protocol, cluster, args, seed=seed)

            row = run_seeds(f"{scenario}_{label}", make, args.out, args.seeds)
            rows.append((scenario, label, row))
    return rows, t_b, stalls


def _ratio(rows: list[tuple[str, str, dict]], scenario: str, key: str) -> str:
    t = {p: r[key] for s, p, r in rows if s == scenario}
    a, b = t.get("hardsync + 1 backup"), t.get("hardsync")
    return marked(a / b, hi=0.7) if a and b else "n/a (a run missed the target)"


def marked(ratio: float, lo: float = 0.0, hi: float = float("inf"), digits: int = 3) -> str:
    """``ratio`` printed with ``digits`` decimals, or more where fewer would round it
    across a bound of ``[lo, hi]`` (0.7496 against 0.75 prints as 0.7496), and " ✗" when
    it lies outside (so the mark always agrees with the printed number)."""
    inside = lo <= ratio <= hi
    text = f"{ratio:.{digits}f}"
    while (lo <= float(text) <= hi) != inside and digits < 12:
        digits += 1
        text = f"{ratio:.{digits}f}"
    return text + ("" if inside else " ✗")


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
        "# Time to the Fashion-MNIST target under stragglers",
        "",
        "## Simulated cluster, λ = 4",
        "",
        "```",
        "flock /tmp/distsgd-bench.lock python bench/stragglers.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        f"Commit {commit}. mlp, λ = {LAM} × b = {BATCH}, SGD lr 0.05 momentum 0.9, target "
        f"{args.target}, evaluation every {args.eval_every} samples, seeds "
        f"{' '.join(map(str, args.seeds))} (each row: the median across them); device "
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
        "| ms per sample | dropped gradients | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario, label, r in rows:
        tt, st, ps = (
            r["time_to_target_virtual_s"],
            r["samples_to_target"],
            r["per_sample_virtual_s"],
        )
        lines.append(
            f"| {scenario} | {label} | {r['reached']} | "
            f"{'—' if tt is None else f'{tt:.2f}'} | {'—' if st is None else f'{st:g}'} | "
            f"{'—' if ps is None else f'{ps * 1e3:.3f}'} | {r['dropped_gradients']:g} | "
            f"{r['train_wall_s']:.0f} |"
        )
    lines += [
        "",
        "Ratio hardsync + 1 backup / hardsync, simulated seconds to the target "
        "(issue target ≤ 0.7 with one learner 2× slower): "
        f"slow {_ratio(rows, 'slow', 'time_to_target_virtual_s')}, "
        f"stalls {_ratio(rows, 'stalls', 'time_to_target_virtual_s')}; per sample: "
        f"slow {_ratio(rows, 'slow', 'per_sample_virtual_s')}, "
        f"stalls {_ratio(rows, 'stalls', 'per_sample_virtual_s')}.",
        "",
    ]
    return "\n".join(lines)


def per_sample(summary: dict[str, Any], key: str = "time_to_target_virtual_s") -> float | None:
    """Seconds to the target per sample to it (None: the target was not reached)."""
    t, n = summary.get(key), summary.get("samples_to_target")
    return t / n if t and n else None


def _fit(measured: float | None, simulated: float | None) -> str:
    """measured / simulated, marked ✗ outside 0.75–1.25."""
    if not measured or not simulated:
        return "—"
    return marked(measured / simulated, 0.75, 1.25)


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:g}"


def report_elastic(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        "## Elastic parameter server (simulated cluster)",
        "",
        f"Async parameter server (α0/n rule), starting with 2 learners; the elastic run adds "
        f"2 learners at {args.join_at:.2f} virtual s and loses worker 0 at {args.leave_at:.2f} s "
        f"({args.join_frac:g} and {args.leave_frac:g} of the fixed run's time to the target; "
        "`cluster.membership`); the fixed run keeps 2 learners. Same model, data, seed and "
        "target as above; the device profile of this machine, jitter 0.1.",
        "",
        "| membership | reached | simulated s to target | samples to target | staleness mean |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['reached']} | {_s(r['time_to_target_virtual_s'])} | "
            f"{r['samples_to_target'] or '—'} | {_s(r.get('staleness_mean'))} |"
        )
    return "\n".join(lines) + "\n\n"


def report_real(rows: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> str:
    if not rows:
        return "Real processes: not run (`--no-real`).\n"
    lam = args.real_learners
    lines = [
        f"## Real processes (loopback, λ = {lam}) against the simulator's prediction",
        "",
        f"Runtime `dist` on this machine ({os.cpu_count()} cores, gloo over loopback), λ = "
        f"{lam} × b = {BATCH} (hardsync: {lam} processes; hardsync + 1 backup: 1 server + "
        f"{lam + 1} learners; 1-softsync and async: 1 server + {lam} learners), same "
        f"SGD lr 0.05 momentum 0.9, target {args.target}, seeds "
        f"{' '.join(map(str, args.seeds))} (each row: the median across them), evaluation "
        f"every {args.real_eval_every} samples (the predictions too). `slow`: learner 0 sleeps as long as its "
        "gradient took after each one (`RankFaults(slow={rank: 2.0})`, 2× slower; on "
        "hardsync its whole DDP iteration); `stalls`: every learner rank stalls after a "
        f"minibatch with probability {args.stall_p} for an exponential time of mean "
        f"{args.stall_factor:g} × t(b) = {args.stall_factor * info['t_b'] * 1e3:.2f} ms "
        "(RankFaults' stalls). Measured seconds: the run's `time_to_target_s` (rank 0's wall "
        "seconds of training, evaluations excluded).",
        "",
        "Prediction: the same config on the simulated cluster (`speed_factors` 0.5 for "
        "learner 0, or the same `stall_*`), calibrated here as bench/multihost.py does: "
        f"`distsgd calibrate` (t(b) = {info['t_b'] * 1e3:.3f} ms, "
        f"{info['per_iteration'] * 1e3:.2f} ms per hardsync iteration beyond the gradient), "
        f"netcal on loopback (message {info['latency_s'] * 1e6:.0f} µs + "
        f"{info['bandwidth_gbps']:.2f} Gbit/s; all-reduce "
        f"{info.get('allreduce_latency_s', 0) * 1e6:.0f} µs + "
        f"{info.get('allreduce_bandwidth_gbps', 0):.2f} Gbit/s), `cores` = {os.cpu_count()}, "
        f"jitter 0, server {info['server_push'] * 1e3:.2f} ms per push (a 1-learner async "
        f"run's `server_seconds_per_push`; `distsgd calibrate`: "
        f"{info['calibrate_push'] * 1e3:.2f} ms).",
        "",
        "Per sample: the seconds to the target divided by the samples to it, measured and "
        "simulated: the time model alone, without the evaluation at which each run first "
        "scores the target (which differs between runs whose accuracy hovers near it).",
        "",
        "| scenario | protocol | reached (measured, simulated) | measured s to target "
        "| simulated s | measured / simulated "
        "| samples to target (measured, simulated) | ms per sample (measured, simulated) "
        "| measured / simulated per sample | dropped gradients (measured, simulated) "
        "| load (1, 5, 15 min) after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p = r["real"].get("time_to_target_s"), r["sim"].get("time_to_target_virtual_s")
        ms, ps = r["real"].get("per_sample_s"), r["sim"].get("per_sample_virtual_s")
        lines.append(
            f"| {r['scenario']} | {r['protocol']} | {r['real']['reached']}, "
            f"{r['sim']['reached']} | {_s(m)} | {_s(p)} | {_fit(m, p)} | "
            f"{_g(r['real'].get('samples_to_target'))}, {_g(r['sim'].get('samples_to_target'))} | "
            f"{'—' if ms is None else f'{ms * 1e3:.3f}'}, "
            f"{'—' if ps is None else f'{ps * 1e3:.3f}'} | {_fit(ms, ps)} | "
            f"{_g(r['real'].get('dropped_gradients'))}, {_g(r['sim'].get('dropped_gradients'))} "
            f"| {r['load']} |"
        )
    for scenario in ("slow", "stalls"):
        pick = {r["protocol"]: r["real"] for r in rows if r["scenario"] == scenario}
        hs, bk = pick.get("hardsync"), pick.get("hardsync + 1 backup")
        if hs is None or bk is None:  # not both run (--real-cases)
            continue
        a, b = bk.get("time_to_target_s"), hs.get("time_to_target_s")
        c, d = bk.get("per_sample_s"), hs.get("per_sample_s")
        hi = 0.7 if scenario == "slow" else float("inf")
        lines += [
            "",
            f"Measured hardsync + 1 backup / hardsync, {scenario}"
            + (" (target ≤ 0.7)" if scenario == "slow" else "")
            + f": seconds to the target {marked(a / b, hi=hi) if a and b else 'n/a'}, "
            f"seconds per sample (per step) {marked(c / d, hi=hi) if c and d else 'n/a'}.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
