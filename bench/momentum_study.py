"""Momentum study (SPEC.md §3; Hadjis et al., arXiv:1606.04487, and Mitliagkas et al.,
arXiv:1605.09774, "asynchrony begets momentum") on the simulated cluster.

Fashion-MNIST ``cnn``, λ = 8 learners × b = 16 in g ∈ {1, 2, 4, 8} compute groups, one
fixed learning rate, explicit momentum μ ∈ {0, 0.3, 0.6, 0.9} (``optimizer.momentum`` must
lie in [0, 1), so the negative momentum the theory allows is not probed), a short fixed
budget of training samples, several seeds. For each g the best μ is the one with the
lowest training loss over the last evaluation interval (mean over seeds); Omnivore's
finding is that it falls as the implicit momentum 1 − 1/g rises. Writes a table, the rows
and a plot.

    flock /tmp/distsgd-bench.lock python bench/momentum_study.py --seeds 0 1 --jobs 2 \\
        --out bench/out/momentum --results bench/results/momentum
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import run_grid  # noqa: E402

GROUPS = (1, 2, 4, 8)
MOMENTA = (0.0, 0.3, 0.6, 0.9)
# The device profile measured once with one thread on this machine (bench/results/rudra):
# fixed here so that simulated times are comparable across runs that execute in parallel.
SECONDS_PER_BATCH = 0.90e-3
SECONDS_PER_SAMPLE = 486e-6


def points() -> list[tuple[str, list[str], dict]]:
    pts = []
    for g in GROUPS:
        for mu in MOMENTA:
            ov = [f"protocol.num_groups={g}", f"optimizer.momentum={mu}"]
            pts.append((f"g{g}_mu{mu}", ov, {"g": g, "momentum": mu}))
    return pts


def last_train_loss(run: Path) -> float | None:
    """Mean training loss over the run's last evaluation interval (None if diverged)."""
    summary = json.loads((run / "summary.json").read_text())
    if summary["status"] != "completed":
        return None
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return recs[-1]["train_loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description="best explicit momentum per number of groups")
    ap.add_argument("--samples", type=int, default=45000, help="training samples per run")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/momentum"))
    ap.add_argument("--results", type=Path, default=Path("bench/results/momentum"))
    args = ap.parse_args()
    common = [
        "protocol.name=compute_groups",
        "protocol.num_learners=8",
        "protocol.batch_size=16",
        "protocol.staleness_lr=none",
        f"optimizer.lr={args.lr}",
        "schedule.kind=constant",
        f"train.max_samples={args.samples}",
        "train.max_epochs=0",
        "train.stop_at_target=false",
        f"train.eval_every_samples={args.samples // 3}",
        "train.checkpoint_every_evals=0",
        "train.tensorboard=false",
        f"cluster.seconds_per_sample={SECONDS_PER_SAMPLE}",
        f"cluster.seconds_per_batch={SECONDS_PER_BATCH}",
    ]
    pts = points()
    dirs = run_grid([(n, ov) for n, ov, _ in pts], args.seeds, args.out, None, common, args.jobs)
    by_point: dict[str, list[Path]] = {}
    for d in dirs:
        by_point.setdefault(d.name.rsplit("-s", 1)[0], []).append(d)
    rows = []
    for name, _, lab in pts:
        losses = [last_train_loss(d) for d in by_point[name]]
        ok = [x for x in losses if x is not None]
        accs = [
            json.loads((d / "summary.json").read_text())["final_metric"]
            for d in by_point[name]
            if last_train_loss(d) is not None
        ]
        rows.append(
            {
                **lab,
                "loss_mean": statistics.mean(ok) if ok else None,
                "loss_std": statistics.stdev(ok) if len(ok) > 1 else 0.0,
                "acc_mean": statistics.mean(accs) if accs else None,
                "diverged": len(losses) - len(ok),
                "seeds": len(losses),
            }
        )
    best = {}
    for g in GROUPS:
        cand = [r for r in rows if r["g"] == g and r["loss_mean"] is not None]
        best[g] = min(cand, key=lambda r: r["loss_mean"])["momentum"] if cand else None
    args.results.mkdir(parents=True, exist_ok=True)
    plot(rows, best, args.results / "momentum_study.png")
    seq = [best[g] for g in GROUPS]
    falls = all(
        a is not None and b is not None and b <= a for a, b in zip(seq, seq[1:], strict=False)
    )
    strictly = falls and seq[-1] < seq[0]
    verdict = (
        "the best explicit momentum falls (never rises) as 1 − 1/g rises — Omnivore's finding holds"
        if strictly
        else "the best explicit momentum does NOT fall monotonically as 1 − 1/g rises here"
    )
    lines = [
        f"# Momentum study: compute groups, λ = 8 × b = 16, lr = {args.lr}, "
        f"{args.samples} samples, seeds {' '.join(map(str, args.seeds))}",
        "",
        "Training loss over the last evaluation interval (mean ± std over seeds; lower is "
        "better) and final test accuracy, for each number of groups g and explicit momentum μ.",
        "",
        "| g | 1 − 1/g | μ | train loss | test accuracy (%) | diverged |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = "-" if r["loss_mean"] is None else f"{r['loss_mean']:.4f} ± {r['loss_std']:.4f}"
        acc = "-" if r["acc_mean"] is None else f"{100 * r['acc_mean']:.2f}"
        mark = " **best**" if best[r["g"]] == r["momentum"] else ""
        lines.append(
            f"| {r['g']} | {1 - 1 / r['g']:.3f} | {r['momentum']}{mark} | {loss} | {acc} | "
            f"{r['diverged']}/{r['seeds']} |"
        )
    lines += [
        "",
        "Best μ per g: " + ", ".join(f"g={g}: {best[g]}" for g in GROUPS),
        "",
        f"Verdict: {verdict}.",
        "",
        "![momentum study](momentum_study.png)",
        "",
    ]
    (args.results / "table.md").write_text("\n".join(lines))
    (args.results / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


def plot(rows: list[dict], best: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for g in GROUPS:
        rs = [r for r in rows if r["g"] == g and r["loss_mean"] is not None]
        a1.errorbar(
            [r["momentum"] for r in rs],
            [r["loss_mean"] for r in rs],
            yerr=[r["loss_std"] for r in rs],
            marker="o",
            capsize=3,
            label=f"g = {g} (1 − 1/g = {1 - 1 / g:.2f})",
        )
    a1.set_xlabel("explicit momentum μ")
    a1.set_ylabel("training loss, last interval")
    a1.set_title("loss vs explicit momentum")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    gs = [g for g in GROUPS if best[g] is not None]
    a2.plot([1 - 1 / g for g in gs], [best[g] for g in gs], "o-", label="best explicit μ")
    xs = [0, 0.875]
    a2.plot(xs, [0.9 - x for x in xs], "k--", lw=1, label="0.9 − (1 − 1/g)")
    a2.set_xlabel("implicit momentum 1 − 1/g")
    a2.set_ylabel("best explicit μ")
    a2.set_title("best explicit momentum vs asynchrony")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
