"""Rudra study (SPEC.md §2; Gupta, Zhang, Wang, ICDM 2016) on the simulated cluster.

Fashion-MNIST ``cnn``, a fixed number of epochs, several seeds: final test accuracy of
hardsync, 1-softsync and λ-softsync for λ ∈ {1, 2, 4, 8, 16}, with per-learner batch
b = 128/λ (the μλ rule) and with b = 128 fixed, λ-softsync with and without the α0/n
learning-rate rule (for hardsync and 1-softsync α0/n = α0, so the rule changes nothing);
measured mean staleness beside n. Writes a markdown table and plots.

    python bench/rudra_study.py --epochs 1 --seeds 0 1 2 --jobs 2 \\
        --out bench/out/rudra --results bench/results/rudra
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import run_grid  # noqa: E402

from distsgd.config import DataConfig  # noqa: E402
from distsgd.data import load_dataset  # noqa: E402
from distsgd.engine import GradientEngine  # noqa: E402
from distsgd.models import build_model  # noqa: E402
from distsgd.runtime.sim import calibrate  # noqa: E402

LAMBDAS = (1, 2, 4, 8, 16)
GLOBAL = 128


def study_points() -> list[tuple[str, list[str], dict]]:
    """(name, overrides, labels) for every distinct configuration of the study."""
    pts = []
    for lam in LAMBDAS:
        for rule in ("mulambda", "fixed"):
            b = GLOBAL // lam if rule == "mulambda" else GLOBAL
            if lam == 1 and rule == "fixed":
                continue  # same as the μλ point
            modes = [("hardsync", 1), ("1-softsync", 1), (f"{lam}-softsync", lam)]
            if lam == 1:
                modes = [("hardsync", 1)]  # all three coincide for one learner
            for mode, n in modes:
                lr_rules = ["softsync", "none"] if n > 1 else ["none"]
                for lr_rule in lr_rules:
                    ov = [
                        "protocol.name=parameter_server",
                        f"protocol.num_learners={lam}",
                        f"protocol.batch_size={b}",
                        f"protocol.staleness_lr={lr_rule}",
                    ]
                    if mode == "hardsync":
                        ov.append("protocol.mode=hardsync")
                    else:
                        ov += ["protocol.mode=softsync", f"protocol.softsync={n}"]
                    family = (
                        "hardsync"
                        if mode == "hardsync"
                        else ("1-softsync" if n == 1 or lam == 1 else "λ-softsync")
                    )
                    name = f"l{lam}_b{b}_{mode}_lr-{lr_rule}"
                    pts.append(
                        (
                            name,
                            ov,
                            {
                                "lambda": lam,
                                "b": b,
                                "batch_rule": rule,
                                "mode": mode,
                                "family": family,
                                "n": n,
                                "lr_rule": lr_rule,
                            },
                        )
                    )
    return pts


def summarise(runs: list[dict]) -> dict:
    accs = [r["final_metric"] for r in runs if r["status"] == "completed"]
    diverged = sum(r["status"] != "completed" for r in runs)
    return {
        "acc_mean": statistics.mean(accs) if accs else None,
        "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0 if accs else None,
        "diverged": diverged,
        "seeds": len(runs),
        "staleness": statistics.mean(r["staleness_mean"] for r in runs),
        "virtual_s": statistics.mean(r["virtual_s"] for r in runs),
    }


def fmt_acc(s: dict) -> str:
    if s["acc_mean"] is None:
        return f"diverged {s['diverged']}/{s['seeds']}"
    text = f"{100 * s['acc_mean']:.2f} ± {100 * s['acc_std']:.2f}"
    if s["diverged"]:
        text += f" ({s['diverged']}/{s['seeds']} diverged)"
    return text


def plot(rows: list[tuple[dict, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    series = [
        ("hardsync", "none"),
        ("1-softsync", "none"),
        ("λ-softsync", "softsync"),
        ("λ-softsync", "none"),
    ]
    for ax, rule, title in (
        (axes[0], "mulambda", "b = 128/λ (μλ rule)"),
        (axes[1], "fixed", "b = 128 fixed"),
    ):
        for family, lr_rule in series:
            xs, ys, es = [], [], []
            for lab, s in rows:
                if lab["lambda"] == 1:
                    ok = (family, lr_rule) == ("hardsync", "none") or lr_rule == "none"
                    ok = ok and lab["batch_rule"] == "mulambda"
                else:
                    ok = (
                        lab["batch_rule"] == rule
                        and lab["family"] == family
                        and lab["lr_rule"] == lr_rule
                    )
                if ok and s["acc_mean"] is not None:
                    xs.append(lab["lambda"])
                    ys.append(100 * s["acc_mean"])
                    es.append(100 * s["acc_std"])
            label = f"{family}" + (", α0/n" if lr_rule == "softsync" else ", α0")
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learners λ")
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for family, marker in (("1-softsync", "s"), ("λ-softsync", "o")):
        pts = [
            (lab["n"], s["staleness"])
            for lab, s in rows
            if lab["family"] == family
            and lab["lambda"] > 1
            and lab["lr_rule"] != "none"
            or (lab["family"] == family and lab["lambda"] > 1 and lab["n"] == 1)
        ]
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=family)
    ns = [1, 2, 4, 8, 16]
    ax.plot(ns, ns, "k--", lw=1, label="σ = n")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (softsync)")
    ax.set_ylabel("measured mean staleness σ (updates)")
    ax.set_title("staleness vs n")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="Rudra study on the simulated cluster")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("bench/out/rudra"))
    ap.add_argument("--results", type=Path, default=Path("bench/results/rudra"))
    args = ap.parse_args()

    # One device profile for every run, measured once with one thread, so that virtual
    # times are comparable across runs that execute in parallel.
    torch.set_num_threads(1)
    ds = load_dataset(DataConfig(), seed=0)
    torch.manual_seed(0)
    prof = calibrate(GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes)), ds)
    print(
        f"device profile: {prof.seconds_per_batch * 1e3:.2f} ms/batch + "
        f"{prof.seconds_per_sample * 1e6:.1f} µs/sample",
        flush=True,
    )
    common = [
        f"optimizer.lr={args.lr}",
        "optimizer.momentum=0.9",
        f"train.max_epochs={args.epochs}",
        "train.stop_at_target=false",
        "train.target=0.9",
        f"train.eval_every_samples={int(args.epochs * ds.num_train)}",
        "train.checkpoint_every_evals=0",
        "train.tensorboard=false",
        f"cluster.seconds_per_sample={prof.seconds_per_sample}",
        f"cluster.seconds_per_batch={prof.seconds_per_batch}",
    ]
    pts = study_points()
    dirs = run_grid([(n, ov) for n, ov, _ in pts], args.seeds, args.out, None, common, args.jobs)
    by_point: dict[str, list[dict]] = {}
    for d in dirs:
        name = d.name.rsplit("-s", 1)[0]
        by_point.setdefault(name, []).append(json.loads((d / "summary.json").read_text()))
    rows = [(lab, summarise(by_point[name])) for name, _, lab in pts]

    args.results.mkdir(parents=True, exist_ok=True)
    plot(rows, args.results / "rudra_study.png")
    lines = [
        f"# Rudra study: Fashion-MNIST cnn, {args.epochs:g} epoch(s), seeds "
        f"{' '.join(map(str, args.seeds))}, α0 = {args.lr}, server momentum 0.9",
        "",
        "Final test accuracy (mean ± std over seeds), measured mean staleness σ beside n, and "
        "simulated seconds for the whole budget.",
        "",
        "| λ | b | protocol | lr rule | n | accuracy (%) | mean σ | simulated s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lab, s in rows:
        lr_text = "α0/n" if lab["lr_rule"] == "softsync" else "α0"
        lines.append(
            f"| {lab['lambda']} | {lab['b']} | {lab['mode']} | {lr_text} | {lab['n']} | "
            f"{fmt_acc(s)} | {s['staleness']:.2f} | {s['virtual_s']:.1f} |"
        )
    lines += ["", "![Rudra study](rudra_study.png)", ""]
    (args.results / "table.md").write_text("\n".join(lines))
    (args.results / "rows.json").write_text(json.dumps([{**lab, **s} for lab, s in rows], indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
