"""The default ``distsgd train`` run (Fashion-MNIST ``cnn``, hardsync 4 × 32, target 90%,
simulated cluster) from two trees, alternating, side by side in one script run: training
and evaluation wall seconds before (another checkout, e.g. main before a change) and
after (this tree), and after with extra settings (``--after-variant``, e.g.
``train.memory_format=contiguous`` to separate a change's parts).

Each run is one ``python3 -m distsgd train --quiet`` process from its tree
(:func:`eval_cost.run_variant`: ``PYTHONPATH`` = that tree, the load average before and
after); rounds alternate the variants in a fixed order. The table (markdown, rewritten
after every run) gives per run the samples to the target, ``train_wall_s`` and
``eval_wall_s`` of its ``summary.json``, training samples per wall second, and the ratio
of each after-variant's median to the before median.

    flock /tmp/distsgd-bench.lock python3 bench/default_run_ab.py --before /tmp/before \\
        --after-variant train.memory_format=contiguous --rounds 2 --out DIR/default_run.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "bench"))

from eval_cost import run_variant  # noqa: E402


def _row(label: str, r: dict) -> str:
    s = r["summary"]
    load = f"{r['load_before']:.1f} → {r['load_after']:.1f}"
    if r["rc"] != 0:
        return f"| {label} | failed (exit {r['rc']}) | | | | | | {load} |"
    return (
        f"| {label} | {s['reached']} | {s['samples']} | {s['train_wall_s']:.1f} "
        f"| {s['eval_wall_s']:.1f} | {s['samples'] / s['train_wall_s']:.0f} "
        f"| {s['final_metric']:.4f} | {load} |"
    )


def _ratios(results: dict[str, list[dict]]) -> list[str]:
    """Median of each variant's train wall, eval wall and samples/s over the before
    median."""

    def med(label: str, key: str) -> float | None:
        ok = [r["summary"] for r in results[label] if r["rc"] == 0]
        if not ok:
            return None
        if key == "rate":
            return statistics.median(s["samples"] / s["train_wall_s"] for s in ok)
        return statistics.median(s[key] for s in ok)

    lines = ["| variant | train wall / before | eval wall / before | samples/s / before |",
             "|---|---|---|---|"]  # fmt: skip
    for label in results:
        if label == "before":
            continue
        cells = []
        for key in ("train_wall_s", "eval_wall_s", "rate"):
            a, b = med(label, key), med("before", key)
            cells.append(f"{a / b:.3f}" if a is not None and b else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write(path: Path, command: str, rows: list[str], results: dict[str, list[dict]]) -> None:
    head = [
        "| run | reached 90% | samples | train wall s | eval wall s | train samples/s "
        "| final metric | load 1 min before → after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    text = [
        "# The default run, before vs after (side by side, alternating)",
        "",
        f"Command: `{command}`",
        "",
        *head,
        *rows,
        "",
        "Medians over rounds, after / before:",
        "",
        *_ratios(results),
        "",
    ]
    path.write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the tree to compare with")
    ap.add_argument("--after-variant", action="append", default=[], metavar="KEY=VALUE",
                    help="also run this tree with --set KEY=VALUE (repeatable)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument("--out", type=Path, default=HERE / "bench/out/default_run.md")
    args = ap.parse_args()
    command = "python3 bench/default_run_ab.py " + " ".join(sys.argv[1:])
    variants = [("before", args.before.resolve(), []), ("after", HERE, [])]
    variants += [(f"after, {kv}", HERE, ["--set", kv]) for kv in args.after_variant]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    rows: list[str] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label, tree, extra in variants:
                out = Path(tmp) / f"{len(rows)}"
                r = run_variant(tree, extra, out, args.timeout_s)
                results[label].append(r)
                rows.append(_row(f"{label} (round {i + 1})", r))
                print(rows[-1], flush=True)
                if r["rc"] != 0:
                    print(r["stderr"], file=sys.stderr)
                write(args.out, command, rows, results)


if __name__ == "__main__":
    main()
