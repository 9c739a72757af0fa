"""Six deterministic simulated tunes (three ``distsgd tune``, three ``distsgd train --tune``)
whose decisions and plans two trees of distsgd must agree on.

Run each tree into its own folder, then compare::

    PYTHONPATH=/tmp/tree_a python bench/tune_equivalence.py run /tmp/eq_a
    PYTHONPATH=/tmp/tree_b python bench/tune_equivalence.py run /tmp/eq_b
    python bench/tune_equivalence.py compare /tmp/eq_a /tmp/eq_b

Every tune runs on the simulated cluster with a fixed device profile, so its probes, scores
and the online runs are deterministic; ``distsgd tune``'s budget is wall seconds, so its
decisions' wall figures (setup time, long-run wall limits) are masked before comparing, and
the budget is large enough that no decision depends on it. Compared: ``decisions.jsonl``
(without its wall stamp), ``plan.toml``, ``tune.json``'s probes and choice (offline), the
run's ``metrics.jsonl`` and simulated-clock summary (online).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch

FIXED_CLUSTER = {
    "seconds_per_sample": 1e-4,
    "seconds_per_batch": 1e-3,
    "latency_s": 1e-4,
    "bandwidth_gbps": 10.0,
}


def _config(seed: int, protocol: dict, train: dict, tune: dict):
    from distsgd.config import RunConfig

    return RunConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "num_train": 1024, "num_test": 256},
            "model": {"name": "mlp"},
            "protocol": {"name": "hardsync", "num_learners": 1, "batch_size": 32, **protocol},
            "optimizer": {"lr": 0.05, "momentum": 0.9},
            "cluster": dict(FIXED_CLUSTER),
            "train": {"seed": seed, "num_threads": 1, "target": 0.0, **train},
            "tune": tune,
        }
    )


OFFLINE = {
    "off-hardsync-s0": (
        0,
        {"num_learners": 2, "batch_size": 16},
        {"target": 0.845, "max_epochs": 6, "eval_every_samples": 128},
        {
            "probe_seconds": 0.03,
            "lrs": [0.1, 0.01],
            "momenta": [0.9],
            "batch_sizes": [16],
            "extra_probes": 0,
            "step_margin": 0.3,
            "max_groups": 1,
            "families": ["hardsync"],
        },
    ),
    "off-groups-s1": (
        1,
        {"num_learners": 4, "batch_size": 16},
        {"target": 0.8, "max_epochs": 4, "eval_every_samples": 256},
        {
            "probe_seconds": 0.03,
            "lrs": [0.1, 0.01],
            "momenta": [0.0, 0.9],
            "batch_sizes": [16, 32],
            "extra_probes": 2,
            "families": ["hardsync", "compute_groups", "softsync"],
        },
    ),
    "off-sma-s2": (
        2,
        {"num_learners": 2, "batch_size": 32},
        {"target": 0.8, "max_epochs": 4, "eval_every_samples": 256},
        {
            "probe_seconds": 0.03,
            "lrs": [0.1, 0.01],
            "momenta": [0.9],
            "batch_sizes": [8, 16],
            "extra_probes": 2,
            "max_groups": 1,
            "families": ["hardsync", "sma"],
        },
    ),
}

ONLINE_TUNE = {
    "lrs": [0.1, 0.01],
    "momenta": [0.0, 0.9],
    "probe_seconds": 0.05,
    "extra_probes": 1,
    "batch_sizes": [16, 32],
    "check_epochs": 1.0,
}
ONLINE = {
    "on-hardsync-s0": (
        0,
        {},
        {"max_epochs": 3, "eval_every_samples": 256},
        ONLINE_TUNE,
    ),
    "on-groups-s1": (
        1,
        {"num_learners": 4, "batch_size": 16},
        {"max_epochs": 3, "eval_every_samples": 256},
        {**ONLINE_TUNE, "families": ["hardsync", "compute_groups"], "steady_promote": 2},
    ),
    "on-budget-s2": (
        2,
        {"num_learners": 2, "batch_size": 16},
        {"max_epochs": 3, "eval_every_samples": 256, "max_virtual_seconds": 2.0},
        {**ONLINE_TUNE, "families": ["hardsync", "sma"], "promote": 2},
    ),
}


def run(out: Path) -> None:
    """Run the six tunes of this tree (``PYTHONPATH``) into ``out``."""
    from distsgd.tuner.online import train_tuned
    from distsgd.tuner.tune import tune

    out.mkdir(parents=True, exist_ok=False)
    for name, (seed, protocol, train, tn) in {**OFFLINE, **ONLINE}.items():
        torch.set_num_threads(1)
        cfg = _config(seed, protocol, train, tn)
        t0 = time.perf_counter()
        if name.startswith("off"):
            tune(cfg, out / name, budget_s=300, progress=False)
        else:
            train_tuned(cfg, out / name, progress=False)
        print(f"{name}: {time.perf_counter() - t0:.1f} s wall", flush=True)


_WALL = [  # wall-clock figures inside decisions of distsgd tune (its budget is wall seconds)
    re.compile(r"[\d.]+(e[-+]?\d+)? ?(s |seconds )?(wall|of the budget left)"),
    re.compile(r"(took|take|expected to take|within) [\d.]+(e[-+]?\d+)? s"),
    re.compile(r"one evaluation [\d.]+ s"),
]


def _decisions(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec.pop("t_wall_s", None)
        for key in ("decision", "reason"):
            for pat in _WALL:
                rec[key] = pat.sub("<wall>", rec.get(key, ""))
        out.append(rec)
    return out


_UNCLOCKED = ("tuning_share", "finished_at", "throughput_samples_per_s")


def _clocked(record: dict) -> dict:
    """``record`` without its wall-clock figures."""
    return {k: v for k, v in record.items() if "wall" not in k and k not in _UNCLOCKED}


def _offline(d: Path) -> dict:
    state = json.loads((d / "tune.json").read_text())
    keep = ("chosen_label", "plan_name", "steady_state", "best_by_g")
    return {
        "decisions": _decisions(d / "decisions.jsonl"),
        "plan.toml": (d / "plan.toml").read_text(),
        "tune.json": {k: state.get(k) for k in keep}
        | {
            "step_at": _clocked(state.get("step_at") or {}),
            "probes": [
                (p.get("label"), p.get("score"), p.get("virtual_s")) for p in state["probes"]
            ],
            "ranking": state["ranking"],
        },
    }


def _online(d: Path) -> dict:
    s = json.loads((d / "summary.json").read_text())
    metrics = [_clocked(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return {
        "decisions": _decisions(d / "decisions.jsonl"),
        "summary": _clocked(s),
        "metrics": metrics,
    }


def compare(a: Path, b: Path) -> int:
    """Print, per tune, whether ``a`` and ``b`` agree; returns the number that differ."""
    bad = 0
    for name in {**OFFLINE, **ONLINE}:
        read = _offline if name.startswith("off") else _online
        ra, rb = read(a / name), read(b / name)
        diff = [k for k in ra if ra[k] != rb[k]]
        n = len(ra["decisions"])
        print(f"{name}: {n} decisions, " + ("identical" if not diff else f"DIFFER in {diff}"))
        for k in diff:
            if k == "decisions":
                for x, y in zip(ra[k], rb[k], strict=False):
                    if x != y:
                        print("  before:", x, "\n  after: ", y)
                        break
        bad += bool(diff)
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(Path(sys.argv[2]))
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
