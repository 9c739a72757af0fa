"""How much can any learning-rate step save on the ``--tune`` bench's job? (issue 18)

Run (a) of ``bench/tune_online_vs_ddp.py`` — hardsync 2 × 64, η 0.05, μ 0.9, Fashion-MNIST
``cnn`` to 90% test accuracy, an evaluation every 15,000 samples — on the simulated
cluster (the same optimisation as on 2 real processes, deterministic), once at constant η
and once per ``--steps`` epoch with one η/10 step there (``schedule.kind = "step"``). Every
step time is known in advance here: the fewest samples over them is what an oracle's
schedule saves against the swept-best constant η, the most that an online rule, which
must choose the step's epoch from the past alone, can save.

For the constant run it also says where ``--tune``'s steady-state rule
(:func:`distsgd.plateau.steady_state_due`: the training loss fell by less than 10% over
a window, checked at each multiple of the window) would first be due, for windows of
``--windows`` epochs. The samples are a property of the optimisation, not of the
machine's load, so this bench needs no quiet machine.

    python bench/step_bound.py --seeds 1 2 3 --steps 0.75 1 1.25 1.5 --jobs 2 \\
        --results bench/results/tune_online
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tune_online_vs_ddp import BASE as TUNE_BENCH_JOB  # bench/, the script's folder
from tune_online_vs_ddp import RUNS

from distsgd.api import resolve_config
from distsgd.metrics import read_metrics
from distsgd.plateau import steady_state_due
from distsgd.trainer import Trainer

NUM_TRAIN = 60_000  # Fashion-MNIST's training set


def one_run(seed: int, step: float | None, eval_every: int, out: str) -> dict:
    """One sim run of (a)'s job at ``seed``, with an η/10 step at epoch ``step`` (None:
    constant η); returns its samples to the target and, for the constant run, its
    evaluation records."""
    sets = [*TUNE_BENCH_JOB, *RUNS["a"], f"train.seed={seed}", "train.num_threads=1"]
    sets += [f"train.eval_every_samples={eval_every}", "train.tensorboard=false"]
    if step is not None:
        sets += ["schedule.kind=step", f"schedule.decay_epochs=[{step}]"]
    run_dir = Path(out) / f"s{seed}-step{step}"
    summary = Trainer(resolve_config(None, sets), run_dir, progress=False).run()
    row = {
        "seed": seed,
        "step_epoch": step,
        "reached": summary["reached"],
        "samples_to_target": summary["samples_to_target"],
        "best_metric": summary["best_metric"],
    }
    if step is None:
        row["records"] = [
            {k: r.get(k) for k in ("samples", "train_loss", "eval_metric")}
            for r in read_metrics(run_dir / "metrics.jsonl")
        ]
    return row


def first_due(records: list[dict], window_epochs: float) -> int | None:
    """Samples at the first check (multiples of the window) where the rule is due."""
    every = int(window_epochs * NUM_TRAIN)
    end = max(r["samples"] for r in records)
    k = 1
    while k * every <= end:
        if steady_state_due(records, k * every, every)[0]:
            return k * every
        k += 1
    return None


def write(rows: list[dict], args: argparse.Namespace, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "step_bound.json").write_text(json.dumps({"rows": rows}, indent=1))
    steps = [None, *args.steps]
    head = ["constant η"] + [f"η/10 at epoch {s:g}" for s in args.steps]
    lines = [
        "# How much can one learning-rate step save on the --tune bench's job? (sim runtime)",
        "",
        f"Command: `python bench/step_bound.py --seeds {' '.join(map(str, args.seeds))} "
        f"--steps {' '.join(f'{s:g}' for s in args.steps)} --eval-every {args.eval_every}`",
        "",
        "Run (a) of `bench/tune_online_vs_ddp.py` (hardsync 2 × 64, η 0.05, μ 0.9, "
        f"Fashion-MNIST cnn, target 90%, an evaluation every {args.eval_every} samples) on the "
        "simulated cluster. Samples to 90% (— : not within the run's 10 epochs):",
        "",
        "| seed | " + " | ".join(head) + " | fewest / constant |",
        "|---|" + "---|" * (len(head) + 1),
    ]
    for seed in args.seeds:
        by = {r["step_epoch"]: r for r in rows if r["seed"] == seed}
        cells = [
            str(by[s]["samples_to_target"]) if s in by and by[s]["reached"] else "—" for s in steps
        ]
        reached = [by[s]["samples_to_target"] for s in steps if s in by and by[s]["reached"]]
        const = by.get(None)
        ratio = (
            f"{min(reached) / const['samples_to_target']:.3f}"
            if reached and const and const["reached"]
            else "—"
        )
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {ratio} |")
    lines += [
        "",
        "Where the steady-state rule (training loss fell < 10% over the window, checked at "
        "each multiple of it) is first due on the constant run, samples:",
        "",
        "| seed | " + " | ".join(f"window {w:g} epoch" for w in args.windows) + " |",
        "|---|" + "---|" * len(args.windows),
    ]
    for seed in args.seeds:
        const = next((r for r in rows if r["seed"] == seed and r["step_epoch"] is None), None)
        if const is None:
            continue
        due = [first_due(const["records"], w) for w in args.windows]
        lines.append(f"| {seed} | " + " | ".join(str(d) if d else "—" for d in due) + " |")
    lines.append("")
    (results / "step_bound.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=float, nargs="+", default=[0.75, 1.0, 1.25, 1.5])
    ap.add_argument("--windows", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--eval-every", type=int, default=15000)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--results", type=Path, default=Path("bench/results/tune_online"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-bound-") as tmp:
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [
                pool.submit(one_run, seed, step, args.eval_every, tmp)
                for seed in args.seeds
                for step in [None, *args.steps]
            ]
            for f in futures:
                rows.append(f.result())
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "records"}), flush=True)
                write(rows, args, args.results)


if __name__ == "__main__":
    main()
