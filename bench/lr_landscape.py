"""What a short probe can tell about time to target: the learning-rate landscape of the
``--tune`` bench's job, on the simulated cluster (issue 18).

For each seed and each η (hardsync, 2 learners × 64, μ 0.9, Fashion-MNIST ``cnn``, the
job of ``bench/tune_online_vs_ddp.py``), one run on the ``sim`` runtime trains to 90%
test accuracy with an evaluation every ``--eval-every`` samples and records:

* **samples to the target**: what decides the run's time once η is chosen (the layout,
  and so the seconds per sample, is the same for every η);
* at each ``--probe-samples`` point (a probe of that length from the initial model is the
  prefix of this run: the simulated cluster is deterministic), the **probe score** of
  ``--tune`` (mean of the last ``tune.score_window`` = 10 training losses) and the
  **held-out loss**: the cross-entropy of the model at that point on a fixed slice of
  ``--slice`` training samples (the same samples for every η: a paired comparison
  without minibatch noise).

The table then says which η each rule would pick per seed (lowest value; the tune's tie
buffer of 1% prefers the larger η, as ``pick_best``) against the η with the fewest samples
to the target. The samples are a property of the optimisation, not of the machine, so
this bench needs no quiet machine (only the sim's clock uses the device profile).

    python bench/lr_landscape.py --seeds 1 2 3 --lrs 0.1 0.05 0.01 \\
        --results bench/results/tune_online
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tune_online_vs_ddp import BASE as TUNE_BENCH_JOB  # bench/, the script's folder

from distsgd.api import resolve_config
from distsgd.data import load_dataset
from distsgd.models import model_from_config, with_data_shape
from distsgd.trainer import Trainer

# the job of bench/tune_online_vs_ddp.py (its runs stop at the target well before its
# max_epochs), at μ 0.9; later settings override it
BASE = [*TUNE_BENCH_JOB, "optimizer.momentum=0.9"]
SCORE_WINDOW = 10  # tune.score_window's default
TIE_BUFFER = 0.01  # tune.tie_buffer's default


def heldout_loss(model: torch.nn.Module, weights: torch.Tensor, x, y) -> float:
    """Mean cross-entropy of ``weights`` ``[P]`` (``model.parameters()`` order) on ``x``,
    ``y``, with ``model`` a separate copy of the run's architecture in evaluation mode."""
    torch.nn.utils.vector_to_parameters(weights.detach().clone(), model.parameters())
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x[i : i + 1024]) for i in range(0, len(x), 1024)])
    return F.cross_entropy(out.float(), y).item()


def one_run(seed: int, lr: float, args: argparse.Namespace, model, x, y, out: Path) -> dict:
    sets = [*BASE, f"train.seed={seed}", f"optimizer.lr={lr}"]
    sets += [f"train.eval_every_samples={args.eval_every}", f"train.num_threads={args.threads}"]
    cfg = resolve_config(None, sets)
    losses: list[float] = []
    at: dict[int, dict] = {}
    todo = sorted(args.probe_samples)

    def on_tick(tick, trainer: Trainer) -> None:
        if tick.losses:
            losses.append(sum(tick.losses) / len(tick.losses))
        while todo and trainer.runtime.samples >= todo[0]:
            point = todo.pop(0)
            tail = losses[-SCORE_WINDOW:]
            at[point] = {
                "samples": trainer.runtime.samples,
                "score": sum(tail) / len(tail),
                "heldout_loss": heldout_loss(model, trainer.runtime.eval_weights(), x, y),
            }

    run_dir = out / f"s{seed}-lr{lr:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    summary = Trainer(cfg, run_dir, progress=False, on_tick=on_tick).run()
    return {
        "seed": seed,
        "lr": lr,
        "reached": summary["reached"],
        "samples_to_target": summary["samples_to_target"],
        "at": {str(k): v for k, v in at.items()},
        "wall_s": time.perf_counter() - t0,
    }


def pick(rows: list[dict], value) -> float:
    """The η a rule picks: lowest value, ties within TIE_BUFFER prefer the larger η."""
    best = min(value(r) for r in rows)
    return max(r["lr"] for r in rows if value(r) <= best + TIE_BUFFER * abs(best))


def write(rows: list[dict], args: argparse.Namespace, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "lr_landscape.json").write_text(json.dumps({"rows": rows}, indent=1))
    points = sorted(args.probe_samples)
    lines = [
        "# The learning-rate landscape of the --tune bench's job (sim runtime)",
        "",
        "Command: `python bench/lr_landscape.py --seeds "
        + " ".join(map(str, args.seeds))
        + " --lrs "
        + " ".join(f"{x:g}" for x in args.lrs)
        + f" --probe-samples {' '.join(map(str, points))} --eval-every {args.eval_every}`",
        "",
        "hardsync 2 × 64, μ 0.9, Fashion-MNIST cnn, target 90% test accuracy, evaluated every "
        f"{args.eval_every} samples; score = mean of the last {SCORE_WINDOW} training losses "
        f"(--tune's probe score); held-out = cross-entropy on {args.slice} fixed training "
        "samples of the model at that point.",
        "",
        "| seed | η | samples to 90% | "
        + " | ".join(f"score @{p} | held-out @{p}" for p in points)
        + " |",
        "|---|---|---|" + "---|---|" * len(points),
    ]
    for r in rows:
        cells = [
            f"{r['at'][str(p)]['score']:.4f} | {r['at'][str(p)]['heldout_loss']:.4f}"
            for p in points
        ]
        lines.append(
            f"| {r['seed']} | {r['lr']:g} | {r['samples_to_target']} | " + " | ".join(cells) + " |"
        )
    lines += ["", "Which η each rule picks (ties within 1% prefer the larger η):", ""]
    lines.append(
        "| seed | fewest samples | "
        + " | ".join(f"score @{p} | held-out @{p}" for p in points)
        + " |"
    )
    lines.append("|---|---|" + "---|---|" * len(points))
    for seed in args.seeds:
        mine = [r for r in rows if r["seed"] == seed and r["reached"]]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["samples_to_target"])["lr"]
        cells = []
        for p in points:
            for key in ("score", "heldout_loss"):
                cells.append(f"{pick(mine, lambda r, p=p, k=key: r['at'][str(p)][k]):g}")
        lines.append(f"| {seed} | {best:g} | " + " | ".join(cells) + " |")
    lines.append("")
    (results / "lr_landscape.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.05, 0.01])
    ap.add_argument("--probe-samples", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--eval-every", type=int, default=5120)
    ap.add_argument("--slice", type=int, default=4096, help="held-out training samples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", type=Path, default=Path("bench/results/tune_online"))
    args = ap.parse_args()
    cfg = resolve_config(None, BASE)
    data = load_dataset(cfg.data)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(data.num_train, generator=g)[: args.slice]
    x, y = data.train.batch(idx)
    model = model_from_config(
        with_data_shape(cfg.model, data.input_shape, data.num_classes, cfg.data.label)
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="lr-landscape-") as tmp:
        for seed in args.seeds:
            for lr in args.lrs:
                rows.append(one_run(seed, lr, args, model, x, y, Path(tmp)))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "at"}), flush=True)
                write(rows, args, args.results)


if __name__ == "__main__":
    main()
