"""Which η each steady-state round of ``distsgd train --tune`` runs would pick under three
scores, read back from the run directories' probe ticks.

A round is the ``probes/NNN-steady-…`` probes that started at one sample count. Scores:

* ``own last 10``: each probe's own last 10 training losses (SPEC §3's score; the
  steady state's before the paired score);
* ``paired last 10``: the last 10 of the iterations every probe of the round trained;
* ``paired mean``: the mean over all those iterations (the steady state's score now,
  :func:`distsgd.tuner.omnivore.pair_scores`).

Without the tie buffer. Usage: ``python3 bench/steady_round_scores.py RUN_DIR...``
(e.g. the ``c-*`` directories of ``bench/tune_online_vs_ddp.py --out``).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from statistics import mean


def rounds(run: Path) -> dict[int, list[tuple[float, list[float]]]]:
    """The run's steady-state rounds: start samples -> [(η, losses)]."""
    out: dict[int, list[tuple[float, list[float]]]] = collections.defaultdict(list)
    for probe in sorted(run.glob("probes/*-steady-*")):
        ticks = [json.loads(x) for x in (probe / "ticks.jsonl").read_text().splitlines()]
        if ticks:
            lr = float(probe.name.split("eta=")[1].split("_")[0])
            out[ticks[0]["samples"]].append((lr, [t["loss"] for t in ticks]))
    return out


def picks(probes: list[tuple[float, list[float]]]) -> dict[str, float]:
    """The η each score picks (lowest score)."""
    n = min(len(losses) for _, losses in probes)
    scores = {
        "own last 10": lambda xs: mean(xs[-10:]),
        "paired last 10": lambda xs: mean(xs[max(n - 10, 0) : n]),
        "paired mean": lambda xs: mean(xs[:n]),
    }
    return {name: min(probes, key=lambda p, f=f: f(p[1]))[0] for name, f in scores.items()}


def main(runs: list[str]) -> int:
    kept: collections.Counter[str] = collections.Counter()
    total = 0
    for run in runs:
        for samples, probes in sorted(rounds(Path(run)).items()):
            if len(probes) < 2:
                continue
            incumbent = probes[0][0]  # the incumbent is probed first
            got = picks(probes)
            total += 1
            kept.update(name for name, lr in got.items() if lr == incumbent)
            print(run, samples, " ".join(f"{k}: η {v:g}" for k, v in got.items()))
    print(f"{total} rounds; the incumbent's η kept: " + ", ".join(
        f"{name} {kept[name]}" for name in ("own last 10", "paired last 10", "paired mean")))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
