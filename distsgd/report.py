"""Reports over run directories: learning curves, staleness histograms, a markdown table.

``distsgd report RUN_DIR [RUN_DIR ...] [--out DIR]`` calls :func:`make_report`, which
writes into ``DIR`` (default ``report/``):

* ``curves.png`` — the evaluation metric (top row: test accuracy in %, or the runs'
  ``train.metric``) and training loss (bottom row) against wall seconds of training,
  simulated (virtual) seconds and training samples, one line per run, the target as a
  dashed line;
* ``staleness.png`` — for each asynchronous run (``staleness_max > 0``), the fraction of
  gradients applied at each staleness σ (in updates), its mean marked; absent when no run
  is asynchronous;
* ``report.md`` — one table row per run (protocol, layout, global batch, learning rate,
  time to target, throughput, staleness, best metric) and both images.

:func:`load_run` reads one run directory and is meant for benchmark scripts too. The plots
use matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsgd.metrics import read_metrics

__all__ = ["Run", "load_run", "make_report", "plot_curves", "plot_staleness"]

# (record key, axis label) of the curves' x axes, one column each
_X_AXES = (
    ("wall_s", "wall time, training only (s)"),
    ("virtual_s", "simulated time (s)"),
    ("samples", "training samples"),
)
# (record key, axis label, scale to the plotted unit) of the curves' y axes, one row each;
# the metric's row is labelled and scaled by :func:`_metric_axis`
_Y_AXES = (
    ("eval_metric", "evaluation metric", 1.0),
    ("train_loss", "training loss (nats)", 1.0),
)


@dataclass
class Run:
    """One run directory, as read by :func:`load_run`.

    Attributes:
        path: the run directory.
        summary: ``summary.json`` as a dict.
        records: ``metrics.jsonl`` records, in order (possibly empty).
        staleness: gradients applied per staleness σ (updates) from ``staleness.json``;
            empty when the file is missing (an interrupted or diverged run).
        label: a legend label: the summary's ``name``, else protocol, layout and seed.
        membership: records of ``membership.jsonl`` per event (``join``, ``leave``,
            ``lost``); empty when the membership never changed.
    """

    path: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)
    label: str = ""
    membership: dict[str, int] = field(default_factory=dict)

    @property
    def is_asynchronous(self) -> bool:
        """True when some gradient was applied stale (``staleness_max > 0``)."""
        st_max = self.summary.get("staleness_max")
        return isinstance(st_max, int | float) and st_max > 0


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None


def _default_label(summary: dict[str, Any], run_dir: Path) -> str:
    name = summary.get("name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    parts = [str(summary.get("protocol") or run_dir.name)]
    if summary.get("layout"):
        parts.append(str(summary["layout"]))
    if summary.get("seed") is not None:
        parts.append(f"seed={summary['seed']}")
    return " ".join(parts)


# the simulated clock's entries of summary.json (None on real processes, which have none)
_SIMULATED_KEYS = ("virtual_s", "time_to_target_virtual_s", "throughput_virtual_samples_per_s")


# keys of summaries and records written before the metric became general (accuracy only)
_FORMER_KEYS = {
    "target_accuracy": "target",
    "best_accuracy": "best_metric",
    "final_accuracy": "final_metric",
    "time_to_accuracy_s": "time_to_target_s",
    "time_to_accuracy_virtual_s": "time_to_target_virtual_s",
    "samples_to_accuracy": "samples_to_target",
    "epochs_to_accuracy": "epochs_to_target",
    "test_accuracy": "eval_metric",
    "test_loss": "eval_loss",
}


def _upgraded(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its former keys renamed (an accuracy run of an earlier version)."""
    if not any(k in d for k in _FORMER_KEYS):
        return d
    return {_FORMER_KEYS.get(k, k): v for k, v in d.items()}


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory written by ``distsgd train``.

    Args:
        run_dir: a folder holding ``summary.json`` and ``metrics.jsonl`` (``staleness.json``
            is optional).

    Returns:
        The :class:`Run`, labelled with :func:`_default_label` (not yet made unique among
        several runs; :func:`make_report` does that).

    Raises:
        ValueError: the folder does not exist, lacks ``summary.json`` or
            ``metrics.jsonl``, or holds unreadable JSON; the message names the path.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: no such run directory")
    for name in ("summary.json", "metrics.jsonl"):
        if not (path / name).is_file():
            raise ValueError(f"{path}: not a run directory ({name} is missing)")
    summary = _read_json(path / "summary.json")
    if not isinstance(summary, dict):
        raise ValueError(f"{path / 'summary.json'}: expected a JSON object")
    summary = _upgraded(summary)
    if "metric" not in summary:
        summary = {**summary, "metric": "accuracy", "metric_direction": "max"}
    try:
        records = [
            _upgraded(r) for r in read_metrics(path / "metrics.jsonl") if isinstance(r, dict)
        ]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'metrics.jsonl'}: not readable ({e})") from None
    if summary.get("runtime") == "dist":  # older runs wrote wall seconds as "virtual"
        summary = {**summary, **{k: None for k in _SIMULATED_KEYS if k in summary}}
        records = [{**r, "virtual_s": None} if "virtual_s" in r else r for r in records]
    staleness: dict[int, int] = {}
    if (path / "staleness.json").is_file():
        counts = _read_json(path / "staleness.json")
        counts = counts.get("counts", {}) if isinstance(counts, dict) else {}
        try:
            staleness = {int(k): int(v) for k, v in counts.items() if v}
        except (TypeError, ValueError):
            raise ValueError(f"{path / 'staleness.json'}: counts must map σ to a count") from None
    return Run(
        path,
        summary,
        records,
        dict(sorted(staleness.items())),
        _default_label(summary, path),
        _membership_counts(path / "membership.jsonl"),
    )


def _membership_counts(path: Path) -> dict[str, int]:
    """Records of a ``membership.jsonl`` per event; {} without the file.

    Raises:
        ValueError: the file is unreadable or corrupt; the message names it.
    """
    try:
        records = read_metrics(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not readable ({e})") from None
    counts: dict[str, int] = {}
    for r in records:
        if isinstance(r, dict) and isinstance(r.get("event"), str):
            counts[r["event"]] = counts.get(r["event"], 0) + 1
    return counts


def _unique_labels(runs: Sequence[Run]) -> None:
    """Make labels unique in place: add the folder name, then a counter, to repeats."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} ({run.path.name})"
    taken: set[str] = set()
    for run in runs:
        label, i = run.label, 2
        while label in taken:
            label, i = f"{run.label} #{i}", i + 1
        run.label = label
        taken.add(label)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _points(run: Run, xkey: str, ykey: str, scale: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in run.records:
        x, y = _number(r.get(xkey)), _number(r.get(ykey))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y * scale)
    return xs, ys


def _figure(width_in: float, height_in: float) -> Any:
    # imported here: matplotlib costs a command that draws nothing a second of start-up
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _metric_axis(runs: Sequence[Run]) -> tuple[str, float]:
    """The metric's axis label and scale: accuracy in percent when every run measured
    accuracy, else the metric's name (runs of different metrics: "evaluation metric")."""
    names = {str(run.summary.get("metric") or "accuracy") for run in runs}
    if names == {"accuracy"}:
        return "test accuracy (%)", 100.0
    if len(names) == 1:
        return f"evaluation {names.pop().rsplit(':', 1)[-1]}", 1.0
    return "evaluation metric", 1.0


def _target_text(runs: Sequence[Run], targets: list[float]) -> str:
    """The targets as a sentence: accuracy in percent, other metrics with their sense."""
    label, scale = _metric_axis(runs)
    if scale == 100.0:
        return "Target test accuracy: " + ", ".join(f"{t * 100:g}%" for t in targets) + "."
    mins = {run.summary.get("metric_direction") == "min" for run in runs}
    sign = "<= " if mins == {True} else (">= " if mins == {False} else "")
    return f"Target {label}: " + ", ".join(f"{sign}{t:g}" for t in targets) + "."


def _targets(runs: Sequence[Run]) -> list[float]:
    out = set()
    for run in runs:
        t = _number(run.summary.get("target"))
        if t is not None and t != 0:
            out.add(t)
    return sorted(out)


def _scale_loss_axis(ax: Any, drawn: list[float], per_run: list[tuple[str, list[float]]]) -> None:
    """Keep a diverging run from flattening the others: losses above 4x the largest
    first training loss are cut off (the panel names those runs); otherwise a loss range
    wider than 20x goes to a log scale."""
    cap = 4.0 * max(ys[0] for _, ys in per_run)
    off = [label for label, ys in per_run if max(ys) > cap]
    if off and cap > 0:
        ax.set_ylim(bottom=0.0, top=cap)
        names = ", ".join(off[:3]) + (", …" if len(off) > 3 else "")
        ax.set_title(f"off scale (loss > {cap:.3g}): {names}", fontsize=8, color="0.4")
    elif min(drawn) > 0 and max(drawn) / min(drawn) > 20:
        ax.set_yscale("log")


def _metric_limits(drawn: list[float], targets: list[float], scale: float) -> dict[str, float]:
    """The metric's axis: every evaluation drawn in view, the first (untrained model)
    included. Accuracy (percent, ``scale`` 100): 5 points below the lowest and 3 above the
    highest point or target, within [0, 100]; another metric: 5% of its range either
    side of the points and targets."""
    if scale == 100.0:
        top = min(100.0, max(drawn + [t * 100 for t in targets]) + 3)
        return {"bottom": max(0.0, min(drawn) - 5), "top": top}
    lo, hi = min(drawn + targets), max(drawn + targets)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
    return {"bottom": lo - pad, "top": hi + pad}


def plot_curves(runs: Sequence[Run], path: str | Path) -> Path:
    """Draw ``curves.png``: rows the evaluation metric (test accuracy in %, or the runs'
    metric) and training loss (nats), columns wall
    seconds of training, simulated seconds and training samples; one line per run.

    Records without a value for a panel's x or y (``train_loss`` at the first evaluation,
    ``virtual_s`` on a runtime without a virtual clock) are left out of that panel; a panel
    with no data says so. Returns ``path``.
    """
    path = Path(path)
    fig = _figure(15.0, 8.5)
    axes = fig.subplots(len(_Y_AXES), len(_X_AXES), squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    styles = ["-", "--", "-.", ":"]
    handles: dict[str, Any] = {}
    metric_label, metric_scale = _metric_axis(runs)
    for row, (ykey, ylabel, scale) in enumerate(_Y_AXES):
        if ykey == "eval_metric":
            ylabel, scale = metric_label, metric_scale
        for col, (xkey, xlabel) in enumerate(_X_AXES):
            ax = axes[row][col]
            drawn: list[float] = []
            per_run: list[tuple[str, list[float]]] = []
            for i, run in enumerate(runs):
                xs, ys = _points(run, xkey, ykey, scale)
                if not xs:
                    continue
                (line,) = ax.plot(
                    xs,
                    ys,
                    color=colors[i],
                    linestyle=styles[(i // 10) % len(styles)],
                    marker="o",
                    markersize=3,
                    linewidth=1.5,
                    label=run.label,
                )
                handles.setdefault(run.label, line)
                drawn += ys
                per_run.append((run.label, ys))
            if ykey == "eval_metric":
                for t in _targets(runs):
                    line = ax.axhline(
                        t * scale, color="0.3", linestyle="--", linewidth=1.0, zorder=0
                    )
                    unit = "%" if scale == 100.0 else ""
                    handles.setdefault(f"target {t * scale:g}{unit}", line)
            if not drawn:
                ax.text(
                    0.5,
                    0.5,
                    f"no {xlabel.split(' (')[0]} recorded",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="0.4",
                )
            elif ykey == "train_loss":
                _scale_loss_axis(ax, drawn, per_run)
            if row == 0 and drawn:
                lacking = [
                    run.label
                    for run in runs
                    if run.records and all(_number(r.get(xkey)) is None for r in run.records)
                ]
                if lacking:
                    names = ", ".join(lacking[:3]) + (", …" if len(lacking) > 3 else "")
                    ax.set_title(f"not recorded for: {names}", fontsize=8, color="0.4")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if ykey == "eval_metric" and drawn:
                ax.set_ylim(**_metric_limits(drawn, _targets(runs), scale))
            if xkey == "samples":
                ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    fig.suptitle(f"Learning curves: {metric_label.split(' (')[0]} and training loss", fontsize=13)
    ncol = min(4, max(1, len(handles)))
    nrows_legend = math.ceil(len(handles) / ncol) if handles else 0
    bottom = 0.02 + 0.035 * nrows_legend
    if handles:
        fig.legend(
            list(handles.values()),
            list(handles.keys()),
            loc="lower center",
            ncol=ncol,
            frameon=False,
            bbox_to_anchor=(0.5, 0.0),
        )
    fig.tight_layout(rect=(0.0, bottom, 1.0, 0.96))
    fig.savefig(path)
    return path


def plot_staleness(runs: Sequence[Run], path: str | Path) -> list[Run]:
    """Draw ``staleness.png``: one histogram per asynchronous run (``staleness_max > 0``
    and a ``staleness.json``), σ in updates on x, fraction of gradients on y, mean σ as a
    vertical line.

    Returns:
        The runs drawn, in order; nothing is written when there are none.
    """
    indexed = [
        (i, run)
        for i, run in enumerate(runs)
        if run.is_asynchronous and sum(run.staleness.values()) > 0
    ]
    drawn = [run for _, run in indexed]
    if not drawn:
        return []
    ncols = min(3, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    fig = _figure(5.0 * ncols, 3.6 * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, (color, run) in enumerate(indexed):
        ax = axes[i // ncols][i % ncols]
        total = sum(run.staleness.values())
        sigmas = list(run.staleness)
        fractions = [run.staleness[s] / total for s in sigmas]
        mean = sum(s * c for s, c in run.staleness.items()) / total
        ax.bar(sigmas, fractions, width=0.8, color=f"C{color % 10}", alpha=0.8)
        ax.axvline(mean, color="black", linestyle="--", linewidth=1.2, label=f"mean σ = {mean:.2f}")
        ax.set_title(run.label, fontsize=10)
        ax.set_xlabel("staleness σ (updates)")
        ax.set_ylabel("fraction of gradients")
        ax.set_xlim(min(sigmas) - 0.8, max(sigmas) + 0.8)
        if max(sigmas) - min(sigmas) <= 12:
            ax.set_xticks(range(min(sigmas), max(sigmas) + 1))
        ax.legend(loc="upper right", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    for j in range(len(drawn), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.suptitle("Gradient staleness of the asynchronous runs", fontsize=12)
    fig.tight_layout()
    fig.savefig(Path(path))
    return drawn


def _cell(v: Any, fmt: str = "{}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return fmt.format(v).replace("|", "\\|")


def _reached(s: dict[str, Any]) -> str:
    target = _number(s.get("target"))
    if not target:
        text = "no target"
    else:
        text = "yes" if s.get("reached") else "no"
    status = s.get("status")
    if status and status != "completed":
        text += f" ({status})"
    return text


def _row(run: Run) -> list[str]:
    s = run.summary
    st_mean, st_max = _number(s.get("staleness_mean")), s.get("staleness_max")
    return [
        _cell(run.label),
        _cell(s.get("protocol")),
        _cell(s.get("layout")),
        _cell(s.get("global_batch")),
        _cell(_number(s.get("lr")), "{:g}"),
        _reached(s),
        _cell(_number(s.get("time_to_target_s")), "{:.2f}"),
        _cell(_number(s.get("time_to_target_virtual_s")), "{:.2f}"),
        _cell(s.get("samples_to_target")),
        _cell(_number(s.get("throughput_samples_per_s")), "{:.0f}"),
        f"{_cell(st_mean, '{:.2f}')} / {_cell(st_max)}",
        _cell(_number(s.get("best_metric")), "{:.4f}"),
    ]


def _dropped(run: Run) -> int:
    v = _number(run.summary.get("dropped_gradients"))
    return int(v) if v else 0


def _changes(run: Run) -> str:
    m = run.membership
    return f"{m.get('join', 0)} / {m.get('leave', 0)} / {m.get('lost', 0)}"


def _extra_columns(runs: list[Run]) -> list[tuple[str, Any]]:
    """The columns only some runs need, as (header, run → cell): gradients dropped
    (``summary.json``'s ``dropped_gradients``: backup learners' late ones, a leaver's) where
    a run dropped any, and the learners (or compute groups) that joined, left and were lost
    (``membership.jsonl``) where a run's membership changed."""
    columns: list[tuple[str, Any]] = []
    if any(_dropped(run) for run in runs):
        columns.append(("dropped gradients", lambda run: str(_dropped(run))))
    if any(run.membership for run in runs):
        columns.append(("joined / left / lost", _changes))
    return columns


def _times_text(runs: list[Run]) -> str:
    """What the time-to-target columns measure: training only for ordinary runs; for runs
    of ``distsgd train --tune`` (``tuned`` in their summary, :mod:`distsgd.tuner.online`)
    the time from the run's start with the tuning included."""
    tuned = [run for run in runs if run.summary.get("tuned")]
    plain = "wall seconds of training only (evaluation excluded) and simulated seconds of the virtual clock"
    with_tuning = (
        "wall seconds from the start of the run, tuning (setup, every probe) and evaluations "
        "included, and simulated seconds of the continued run plus every probe that did not "
        "continue"
    )
    if not tuned:
        return f"Times to target are {plain}."
    if len(tuned) == len(runs):
        text = f"These are runs of `--tune`: times to target are {with_tuning}."
    else:
        names = ", ".join(_cell(run.label) for run in tuned)
        text = (
            f"Times to target are {plain}, except for the runs of `--tune` ({names}): "
            f"{with_tuning}."
        )
    return text + _tuning_shares(tuned)


def _tuning_shares(tuned: list[Run]) -> str:
    """Each ``--tune`` run's tuning share of its wall time and its number of probes."""
    parts = []
    for run in tuned:
        share = _number(run.summary.get("tuning_share"))
        total = _number(run.summary.get("total_wall_s"))
        if share is None or total is None:
            continue
        probes = run.summary.get("num_probes")
        parts.append(
            f"{_cell(run.label)}: tuning {100 * share:.0f}% of its {total:.1f} s"
            + (f" ({probes} probes)" if probes is not None else "")
        )
    return (
        f" Tuning share (setup and every probe) of each run's wall: {'; '.join(parts)}."
        if parts
        else ""
    )


_HEADER = [
    "run",
    "protocol",
    "layout",
    "global batch",
    "learning rate",
    "reached",
    "time to target (s)",
    "simulated time to target (s)",
    "samples to target",
    "throughput (samples/s)",
    "mean / max staleness",
    "best metric",
]

# markdown column alignment: text left, numbers right
_ALIGN = ["---"] * 3 + ["---:"] * 2 + ["---"] + ["---:"] * 6
#: the simulated device's figures in a run's summary (``device_profile``) that its simulated
#: seconds depend on (an older summary without one reads as None; a negative one, "not
#: measured", is charged as 0), and those of the parameter server (its runs only)
_DEVICE_KEYS = ("seconds_per_sample", "seconds_per_batch", "seconds_per_iteration", "cores")
_SERVER_KEYS = ("seconds_per_push", "seconds_per_push_contended")


def _charged(profile: dict[str, Any], keys: tuple[str, ...]) -> tuple[float | None, ...]:
    values = [profile.get(k) for k in keys]
    return tuple(None if v is None else max(float(v), 0.0) for v in values)


def _devices_differ(runs: list[Run]) -> bool:
    """Whether ``runs`` simulate different devices: their charged device figures differ,
    or those of the runs with a parameter server differ among them (runs on real
    processes simulate nothing: left out)."""
    simulated = [run for run in runs if run.summary.get("runtime", "sim") == "sim"]
    pairs = [(run, run.summary.get("device_profile")) for run in simulated]
    pairs = [(run, p) for run, p in pairs if isinstance(p, dict)]
    devices = {_charged(p, _DEVICE_KEYS) for _, p in pairs}
    # the server's figures are recorded for the runs with a parameter server only
    servers = {_charged(p, _SERVER_KEYS) for _, p in pairs if p.get(_SERVER_KEYS[0]) is not None}
    return len(devices) > 1 or len(servers) > 1


def make_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """Write ``curves.png``, ``staleness.png`` (when a run is asynchronous) and
    ``report.md`` for the given run directories into ``out_dir`` (created if missing).

    Args:
        run_dirs: run directories written by ``distsgd train``, of any runtime; diverged,
            interrupted and single-evaluation runs are fine.
        out_dir: the report folder.

    Returns:
        The path of ``report.md``.

    Raises:
        ValueError: no run directory given, or one that :func:`load_run` rejects (the
            message names its path).
    """
    if not run_dirs:
        raise ValueError("report: give at least one run directory")
    seen: set[Path] = set()
    for d in run_dirs:
        key = Path(d).resolve()
        if key in seen:
            raise ValueError(f"report: run directory {str(d)!r} is given twice")
        seen.add(key)
    runs = [load_run(d) for d in run_dirs]
    _unique_labels(runs)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"report: --out {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(runs, out / "curves.png")
    stale_png = out / "staleness.png"
    stale_png.unlink(missing_ok=True)  # a stale one from an earlier report would mislead
    stale_runs = plot_staleness(runs, stale_png)

    lines = ["# distsgd report", ""]
    extras = _extra_columns(runs)

    def extra(run: Run) -> list[str]:
        return [cell(run) for _, cell in extras]

    targets = _targets(runs)
    if targets:
        lines.append(_target_text(runs, targets))
    else:
        lines.append("No run has a target.")
    lines += [
        f"The metric is {_metric_axis(runs)[0]}. {_times_text(runs)} Staleness σ is in updates.",
        "",
        "| " + " | ".join(_HEADER + [name for name, _ in extras]) + " |",
        "|" + "|".join(_ALIGN + ["---:"] * len(extras)) + "|",
    ]
    lines += ["| " + " | ".join(_row(run) + extra(run)) + " |" for run in runs]
    if _devices_differ(runs):
        lines += [
            "",
            "Note: these runs simulate different device profiles (each calibrated its own, "
            "or was given one), so their simulated times are not comparable. Give every run "
            "the same "
            + ", ".join(f"`cluster.{k}`" for k in _DEVICE_KEYS)
            + " (or one `cluster.profile`), and the runs with a parameter server the same "
            + " and ".join(f"`cluster.{k}`" for k in _SERVER_KEYS)
            + ", to compare them.",
        ]
    lines += ["", "Run directories:", ""]
    lines += [f"- {_cell(run.label)}: `{run.path}`" for run in runs]
    lines += ["", "## Learning curves", "", "![learning curves](curves.png)", ""]
    lines += ["## Staleness", ""]
    if stale_runs:
        names = ", ".join(_cell(run.label) for run in stale_runs)
        lines += [
            f"Asynchronous runs: {names}.",
            "",
            "![staleness histograms](staleness.png)",
            "",
        ]
    drawn_ids = {id(run) for run in stale_runs}
    missing = [run for run in runs if run.is_asynchronous and id(run) not in drawn_ids]
    if missing:
        names = ", ".join(_cell(run.label) for run in missing)
        lines += [f"No staleness histogram (no staleness.json) for: {names}.", ""]
    if not stale_runs and not missing:
        lines += ["No asynchronous run: every gradient was applied with σ = 0.", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md
