"""Tuned plan vs the DDP baseline: time to 90% test accuracy on Fashion-MNIST ``cnn``,
side by side in one run, with the tuning time next to it.

1. the baseline: plain PyTorch DDP (``bench/ddp_baseline.py``), 2 processes × 1 thread,
   global batch 128, lr 0.05, momentum 0.9, launched with ``torch.distributed.run``;
2. ``distsgd tune CONFIG --budget B`` on the simulated runtime (2 simulated devices with
   this machine's one-thread device profile);
3. ``distsgd train plan.toml``: its time to accuracy in **simulated** seconds (2 devices)
   and the **wall** seconds the one-process simulation took, both reported, labelled.

With ``--runtime dist`` step 2 is ``distsgd tune CONFIG --runtime dist --num-processes 2``
(probes on 2 real processes, wall clock) and step 3 trains the plan on real processes:
plan and DDP are then compared wall seconds against wall seconds (training only, both),
and the plan's predicted time to accuracy is in wall seconds too.

Writes ``RESULTS/README.md`` (table, ratios, predicted vs measured time to accuracy,
machine load) and copies the tune report, its figures, ``plan.toml`` and
``decisions.jsonl`` beside it.

    flock /tmp/distsgd-bench.lock python bench/tune_vs_ddp.py --budget 10m \\
        --out bench/out/tune_vs_ddp --results bench/results/tune_vs_ddp
    flock /tmp/distsgd-bench.lock python bench/tune_vs_ddp.py --runtime dist --budget 10m \\
        --out bench/out/tune_vs_ddp_dist --results bench/results/tune_vs_ddp_dist
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_ddp(out: Path, eval_every: int, target: float = 0.9) -> dict:
    res = out / "ddp.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "bench" / "ddp_baseline.py"), "--batch", "64", "--lr", "0.05",
        "--momentum", "0.9", "--target", str(target), "--eval-every", str(eval_every),
        "--out", str(res),
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
    r = json.loads(res.read_text())
    r["launcher_wall_s"] = time.perf_counter() - t0
    return r


def train_plan(tune_dir: Path, plan_dir: Path, *runtime: str) -> dict:
    """``distsgd train plan.toml`` (again, from scratch); its summary.json."""
    if plan_dir.exists():
        shutil.rmtree(plan_dir)
    subprocess.run(
        [sys.executable, "-m", "distsgd", "train", str(tune_dir / "plan.toml"), *runtime,
         "--out", str(plan_dir), "--quiet"],
        check=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    return json.loads((plan_dir / "summary.json").read_text())


def copy_tune_outputs(tune_dir: Path, results: Path) -> None:
    """The tune's report, plan, decisions, state and figures beside the results."""
    results.mkdir(parents=True, exist_ok=True)
    for f in ("report.md", "plan.toml", "decisions.jsonl", "tune.json"):
        shutil.copy(tune_dir / f, results / f)
    for png in tune_dir.glob("*.png"):
        shutil.copy(png, results / png.name)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def write_results(results: Path, lines: list[str], ddp: dict, **fields: object) -> None:
    """``RESULTS/README.md`` from ``lines`` and ``RESULTS/results.json`` (DDP's result without
    its history, then ``fields``); prints the README."""
    (results / "README.md").write_text("\n".join(lines))
    payload = {"ddp": {k: v for k, v in ddp.items() if k != "history"}, **fields}
    (results / "results.json").write_text(json.dumps(payload, indent=1))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description="tuned plan vs DDP, time to 90%")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tune_fashion_mnist.toml"))
    ap.add_argument("--budget", default="10m")
    ap.add_argument("--eval-every", type=int, default=5000)
    ap.add_argument("--out", type=Path, default=Path("bench/out/tune_vs_ddp"))
    ap.add_argument("--results", type=Path, default=Path("bench/results/tune_vs_ddp"))
    ap.add_argument("--skip-ddp", action="store_true", help="reuse OUT/ddp.json")
    ap.add_argument(
        "--tune-dir",
        default=None,
        help="reuse this finished tune (its tune.json, plan.toml and tuning time) instead of tuning",
    )
    ap.add_argument("--ddp-target", type=float, default=0.9, help="(smoke tests only)")
    ap.add_argument(
        "--runtime",
        choices=("sim", "dist"),
        default="sim",
        help="where the tune's probes and the plan run: sim (simulated devices) or dist "
        "(2 real processes; wall against wall)",
    )
    ap.add_argument(
        "--tune-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--set passed to distsgd tune (e.g. tune.probe_seconds=3)",
    )
    args = ap.parse_args()
    out = args.out
    if out.exists() and not args.skip_ddp:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = _load()

    ddp = (
        json.loads((out / "ddp.json").read_text())
        if args.skip_ddp
        else run_ddp(out, args.eval_every, args.ddp_target)
    )
    print(f"DDP: {ddp['time_to_target_s']} s to {ddp['target']}", flush=True)

    # The simulated devices run at the speed the DDP processes actually ran in this run:
    # the configured one-thread profile scaled so one minibatch of 64 takes DDP's measured
    # seconds per step (which include its all-reduce, so the simulated device is if
    # anything slower than DDP's).
    from distsgd.config import RunConfig  # noqa: PLC0415

    base = RunConfig.from_toml(args.config)
    per_step = ddp["time_to_target_s"] / (ddp["samples_to_target"] / ddp["global_batch"])
    quiet = base.cluster.seconds_per_batch + 64 * base.cluster.seconds_per_sample
    scale = per_step / quiet if quiet > 0 else 1.0
    profile = [
        f"cluster.seconds_per_batch={base.cluster.seconds_per_batch * scale}",
        f"cluster.seconds_per_sample={base.cluster.seconds_per_sample * scale}",
        # probes keep the length in iterations they have on the configured profile
        f"tune.probe_seconds={base.tune.probe_seconds * scale}",
    ]
    print(f"DDP seconds per step {per_step * 1e3:.2f} ms; device profile × {scale:.3f}", flush=True)
    if args.runtime == "dist":
        return dist_main(args, ddp, per_step, load_before)
    if args.tune_dir:  # reuse a finished tune: its plan runs on its own device profile
        tune_dir = Path(args.tune_dir)
        state = json.loads((tune_dir / "tune.json").read_text())
        tuning_wall = state["tuning_wall_s"]
    else:
        tune_dir = out / "tune"
        if tune_dir.exists():
            shutil.rmtree(tune_dir)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "distsgd", "tune", args.config, "--budget", args.budget,
               "--out", str(tune_dir), "--quiet"]  # fmt: skip
        for o in profile:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
        tuning_wall = time.perf_counter() - t0
        state = json.loads((tune_dir / "tune.json").read_text())
    prof = state["device_profile"]
    plan_step = prof["seconds_per_batch"] + 64 * prof["seconds_per_sample"]
    speed = per_step / plan_step  # > 1: DDP's processes were slower than the plan's devices

    plan_dir = out / "plan"
    plan = train_plan(tune_dir, plan_dir)
    load_after = _load()

    ddp_t = ddp["time_to_target_s"]
    sim_t = plan["time_to_target_virtual_s"]
    wall_t = plan["time_to_target_s"]
    pred = (state.get("prediction") or {}).get("predicted_s")

    copy_tune_outputs(tune_dir, args.results)
    lines = [
        "# Tuned plan vs DDP: time to 90% test accuracy, Fashion-MNIST cnn",
        "",
        "Command (one run, side by side):",
        "",
        "    flock /tmp/distsgd-bench.lock python bench/tune_vs_ddp.py "
        + (f"--tune-dir {args.tune_dir}" if args.tune_dir else f"--budget {args.budget}"),
        "",
        f"Machine load (1/5/15 min) before: {load_before}; after: {load_after}.",
        "",
        (
            f"DDP ran at {per_step * 1e3:.2f} ms per step (2 × 64 samples). The plan runs on "
            f"the tune's own device profile ({plan_step * 1e3:.2f} ms per 64 samples, from "
            f"{tune_dir / 'tune.json'}); compare with the speed-adjusted ratio below."
            if args.tune_dir
            else f"DDP ran at {per_step * 1e3:.2f} ms per step (2 × 64 samples); the simulated "
            f"devices were given the config's one-thread profile × {scale:.3f} so that a "
            "minibatch of 64 takes exactly that long (the simulated time is then on devices "
            "as fast as DDP's processes were in this run)."
        ),
        "",
        "| what | reached | time to 90% | samples to 90% | note |",
        "|---|---|---|---|---|",
        f"| DDP baseline, 2 processes × 1 thread, batch 2×64, lr 0.05, μ 0.9 | "
        f"{ddp['reached']} | {fmt(ddp_t)} s wall (training only) | "
        f"{ddp['samples_to_target']} | {ddp['total_wall_s']:.1f} s wall incl. evaluation |",
        f"| tuned plan `{state.get('plan_name') or state['chosen_label']}` on the simulated cluster (2 devices) | "
        f"{plan['reached']} | **{fmt(sim_t, '.2f')} s simulated** | "
        f"{plan['samples_to_target']} | {fmt(wall_t)} s wall of one-process simulation "
        f"(all learners in turn) |",
        f"| tuning (`distsgd tune`, budget {state['budget_s']:.0f} s) | | {tuning_wall:.1f} s wall | | "
        f"{len(state['probes'])} probes + 1 long run |",
        "",
        f"- **Ratio plan / DDP: {ratio(sim_t, ddp_t)}** (simulated seconds of the plan on two "
        "simulated one-thread devices over DDP's wall seconds on two one-thread processes; "
        "target ≤ 0.5).",
        f"- Device speed: DDP ran at {per_step * 1e3:.2f} ms per step of 64 samples per "
        f"process; the plan's simulated devices take {plan_step * 1e3:.2f} ms for 64 samples "
        f"(factor {speed:.3f}). Plan / DDP with the plan's time rescaled to DDP's device "
        f"speed: **{ratio((sim_t or 0) * speed, ddp_t) if sim_t else '-'}** (compute scales "
        "with the factor; the simulated network does not, so this is approximate).",
        f"- Ratio of the one-process simulation's wall time to DDP: {ratio(wall_t, ddp_t)}.",
        f"- Ratio (tuning + plan in simulated time) / DDP: "
        f"{ratio((sim_t or 0) + tuning_wall, ddp_t) if sim_t else '-'} (tuning is wall time).",
        f"- Predicted time to accuracy of the plan: {fmt(pred, '.2f')} simulated s; measured "
        f"{fmt(sim_t, '.2f')}; predicted / measured = **{ratio(pred, sim_t)}** (target within "
        "±25%).",
        "",
        "The tune report (plan, tradeoff space, every probe, decisions): [report.md](report.md).",
        "",
    ]
    write_results(
        args.results,
        lines,
        ddp,
        plan_summary=plan,
        tuning_wall_s=tuning_wall,
        ddp_seconds_per_step=per_step,
        profile_scale=scale,
        speed_factor=speed,
        tune_dir=str(tune_dir),
        predicted_s=pred,
        load_before=load_before,
        load_after=load_after,
    )


def dist_main(args: argparse.Namespace, ddp: dict, per_step: float, load_before: str) -> None:
    """Tune on 2 real processes and train the plan there: wall against wall."""
    out = args.out
    if args.tune_dir:
        tune_dir = Path(args.tune_dir)
        state = json.loads((tune_dir / "tune.json").read_text())
        tuning_wall = state["tuning_wall_s"]
    else:
        tune_dir = out / "tune"
        if tune_dir.exists():
            shutil.rmtree(tune_dir)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "distsgd", "tune", args.config, "--runtime", "dist",
               "--num-processes", "2", "--budget", args.budget, "--out", str(tune_dir),
               "--quiet"]  # fmt: skip
        for o in args.tune_set:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
        tuning_wall = time.perf_counter() - t0
        state = json.loads((tune_dir / "tune.json").read_text())
    plan_dir = out / "plan"
    plan = train_plan(tune_dir, plan_dir, "--runtime", "dist")
    load_after = _load()
    ddp_t = ddp["time_to_target_s"]
    wall_t = plan["time_to_target_s"]
    pred = (state.get("prediction") or {}).get("predicted_s")

    copy_tune_outputs(tune_dir, args.results)
    extra = " ".join(f"--tune-set {o}" for o in args.tune_set)
    lines = [
        "# Tuned plan vs DDP on real processes: time to 90% test accuracy, Fashion-MNIST cnn",
        "",
        "Command (one run, side by side):",
        "",
        "    flock /tmp/distsgd-bench.lock python bench/tune_vs_ddp.py --runtime dist "
        + (f"--tune-dir {args.tune_dir}" if args.tune_dir else f"--budget {args.budget}")
        + (f" {extra}" if extra else ""),
        "",
        f"Machine load (1/5/15 min) before: {load_before}; after: {load_after}.",
        "",
        f"The tune probed on 2 real processes (gloo, wall clock); DDP ran at "
        f"{per_step * 1e3:.2f} ms per step (2 × 64 samples). Both times are wall seconds of "
        "training (evaluation excluded).",
        "",
        "| what | reached | time to 90% | samples to 90% | note |",
        "|---|---|---|---|---|",
        f"| DDP baseline, 2 processes × 1 thread, batch 2×64, lr 0.05, μ 0.9 | "
        f"{ddp['reached']} | {fmt(ddp_t)} s wall | {ddp['samples_to_target']} | "
        f"{ddp['total_wall_s']:.1f} s wall incl. evaluation |",
        f"| tuned plan `{state.get('plan_name') or state['chosen_label']}`, "
        f"{plan.get('num_processes')} processes | {plan['reached']} | **{fmt(wall_t)} s wall** | "
        f"{plan['samples_to_target']} | {plan['train_wall_s'] + plan['eval_wall_s']:.1f} s "
        "wall incl. evaluation |",
        f"| tuning (`distsgd tune --runtime dist`, budget {state['budget_s']:.0f} s) | | "
        f"{tuning_wall:.1f} s wall | | {len(state['probes'])} probes |",
        "",
        f"- **Ratio plan / DDP: {ratio(wall_t, ddp_t)}** (wall / wall; target ≤ 0.5).",
        f"- Ratio (tuning + plan) / DDP: "
        f"{ratio((wall_t or 0) + tuning_wall, ddp_t) if wall_t else '-'}.",
        f"- Predicted time to accuracy of the plan: {fmt(pred, '.2f')} wall s; measured "
        f"{fmt(wall_t, '.2f')} wall s; predicted / measured = **{ratio(pred, wall_t)}** "
        "(target within ±25%).",
        "",
        "The tune report (plan, tradeoff space, every probe, decisions): [report.md](report.md).",
        "",
    ]
    write_results(
        args.results,
        lines,
        ddp,
        runtime="dist",
        plan_summary=plan,
        tuning_wall_s=tuning_wall,
        ddp_seconds_per_step=per_step,
        tune_dir=str(tune_dir),
        predicted_s=pred,
        load_before=load_before,
        load_after=load_after,
    )


if __name__ == "__main__":
    main()
