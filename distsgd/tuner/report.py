"""The tune report: ``report.md`` and its figures, written from ``tune.json``.

Figures:

* ``tradeoff.png`` — for every configuration shape probed from the initial weights (its
  best probe): seconds per iteration (HE, measured), iterations to the target (SE, from
  the probe's fitted loss curve and the plan's target loss) and their product, the
  predicted time to accuracy, against g and protocol;
* ``probes.png`` — every probe's training-loss curve against the runtime's clock;
* ``extrapolation.png`` — predicted time to accuracy on larger simulated clusters;
* ``verify.png`` — predicted against measured time to accuracy of the plan (after
  ``--verify``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.tuner import perf_model as pm

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from distsgd.tuner.session import TuneSession

__all__ = ["write_report", "write_tune_json", "clean_state", "tune_json"]

_COLORS = {
    "hardsync": "tab:blue",
    "compute_groups": "tab:orange",
    "softsync": "tab:green",
    "sma": "tab:purple",
    "local_sgd": "tab:brown",
    "diloco": "tab:olive",
}


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _shape_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Best initial-snapshot probe of every shape, with HE, SE and predicted time."""
    target_loss = (state.get("prediction") or {}).get("target_loss")
    best: dict[str, dict[str, Any]] = {}
    for p in state["probes"]:
        if p["snapshot"] != "initial" or p["score"] is None:
            continue
        shape = p["label"].rsplit(" η=", 1)[0]
        if shape not in best or p["score"] < best[shape]["score"]:
            best[shape] = p
    rows = []
    for shape, p in best.items():
        se = math.nan
        if target_loss is not None and len(p["losses"]) >= 3:
            try:
                curve = pm.fit_loss_curve(np.array(p["iterations"]), np.array(p["losses"]))
                se = pm.iterations_to_loss(curve, target_loss)
            except ValueError:
                pass
        he = p["seconds_per_iteration"] or math.nan
        rows.append(
            {
                "shape": shape,
                "family": p["candidate"]["family"],
                "g": p["candidate"]["num_groups"]
                if p["candidate"]["family"] == "compute_groups"
                else 1,
                "label": p["label"],
                "score": p["score"],
                "he": he,
                "se": se,
                "predicted": he * se,
            }
        )
    rows.sort(key=lambda r: (list(_COLORS).index(r["family"]), r["g"], r["shape"]))
    return rows


def _subplots(ncols: int = 1, *, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A figure of its own (no pyplot state: the Agg canvas) and its ``ncols`` axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # a second of start-up
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols)


def _save(fig: Figure, out: Path, name: str) -> str:
    """Lay out and write ``out/name``; returns ``name``."""
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    return name


def _plots(out: Path, state: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    clock = state["clock"]
    figs = []
    if rows:
        fig, axes = _subplots(3, figsize=(16, 4.8))
        x = np.arange(len(rows))
        colors = [_COLORS[r["family"]] for r in rows]
        for ax, key, ylabel in (
            (axes[0], "he", f"{clock} seconds per iteration (HE)"),
            (axes[1], "se", "iterations to target (SE, fitted)"),
            (axes[2], "predicted", f"predicted time to accuracy ({clock} s)"),
        ):
            vals = [r[key] if math.isfinite(r[key]) else 0.0 for r in rows]
            ax.bar(x, vals, color=colors)
            for xi, r in zip(x, rows, strict=True):
                if not math.isfinite(r[key]):
                    ax.text(xi, 0, "n/a", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(x, [r["shape"] for r in rows], rotation=60, ha="right", fontsize=7)
            ax.set_ylabel(ylabel)
            if all(v > 0 for v in vals) and max(vals) > 20 * min(vals):
                ax.set_yscale("log")  # values spanning orders of magnitude
            ax.grid(alpha=0.3, axis="y")
        axes[1].set_title("the tradeoff space: HE × SE = time to accuracy (best η, μ per shape)")
        figs.append(_save(fig, out, "tradeoff.png"))
    fig, ax = _subplots(figsize=(10, 5))
    for p in state["probes"]:
        if not p["losses"]:
            continue
        fam = p["candidate"]["family"]
        ls = "-" if p["snapshot"] == "initial" else ":"
        ax.plot(p["virtual_s"], p["losses"], ls, color=_COLORS[fam], alpha=0.35, lw=0.8)
        if p["diverged"]:
            ax.plot(p["virtual_s"][-1:], [min(p["losses"][-1], 5.0)], "kx")
    for fam, col in _COLORS.items():
        ax.plot([], [], color=col, label=fam)
    ax.plot([], [], "k:", label="steady-state probes (from the long run's snapshot)")
    ax.set_xlabel(f"{clock} seconds since the probe's snapshot")
    ax.set_ylabel("training loss (per tick)")
    ok = [x for p in state["probes"] if not p["diverged"] for x in p["losses"] if x is not None]
    ax.set_ylim(0, 1.05 * max(ok) if ok else None)  # a diverged probe would hide the rest
    ax.set_title(f"every probe's loss curve ({len(state['probes'])} probes; x = diverged)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    figs.append(_save(fig, out, "probes.png"))
    ext = state.get("extrapolation") or []
    if ext:
        fig, ax = _subplots(figsize=(7, 4.5))
        for g in sorted({e["g"] for e in ext}):
            es = [e for e in ext if e["g"] == g]
            ax.plot(
                [e["num_learners"] for e in es],
                [e["predicted_s"] for e in es],
                "o-",
                label=f"g = {g}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("learners λ (simulated devices)")
        ax.set_ylabel(f"predicted time to accuracy ({clock} s)")
        ax.set_title("performance model on larger clusters (plan's b, η, μ)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        figs.append(_save(fig, out, "extrapolation.png"))
    long_run = state.get("long_run")
    if long_run and long_run.get("evals") and state.get("step_runs"):
        key = "virtual_s" if clock == "simulated" else "wall_s"
        fig, ax = _subplots(figsize=(8, 4.8))
        ev = [e for e in long_run["evals"] if e.get(key) is not None]
        ax.plot(
            [e[key] for e in ev],
            [e["eval_metric"] for e in ev],
            "o-",
            color="tab:blue",
            ms=3,
            label=f"long run, η = {long_run['candidate']['lr']:g}",
        )
        step_at = state.get("step_at") or {}
        for r in state.get("step_runs") or []:
            pts = [e for e in r.get("evals") or [] if e.get("clock_s") is not None]
            chosen = r["eval"] == step_at.get("eval")
            ax.plot(
                [r["clock_s"] + e["clock_s"] for e in pts],
                [e["eval_metric"] for e in pts],
                ".-" if chosen else ".:",
                color="tab:red" if chosen else "tab:gray",
                label=f"step at epoch {r['epoch']:.2f}" + (" (plan)" if chosen else ""),
            )
        ax.axhline(state["target"], color="k", lw=0.8, ls="--", label="target")
        accs = [e["eval_metric"] for e in ev[1:]] or [0.0]
        ax.set_ylim(max(min(accs) - 0.02, 0.0), min(state["target"] + 0.03, 1.0))
        ax.set_xlabel(f"{clock} seconds of training")
        ax.set_ylabel("test accuracy")
        ax.set_title("where to step η: runs from the long run's snapshots")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        figs.append(_save(fig, out, "steps.png"))
    v = state.get("verify")
    pred = (state.get("prediction") or {}).get("predicted_s")
    if v and v.get("measured_s") and pred:
        fig, ax = _subplots(figsize=(5, 4.5))
        m = v["measured_s"]
        ax.bar([0, 1], [pred, m], color=["tab:gray", "tab:blue"])
        ax.axhspan(0.75 * m, 1.25 * m, color="tab:blue", alpha=0.1, label="measured ± 25%")
        ax.set_xticks([0, 1], ["predicted", "measured"])
        ax.set_ylabel(f"time to {100 * state['target']:g}% ({clock} s)")
        ax.set_title("plan: predicted vs measured time to accuracy")
        ax.legend(fontsize=8)
        figs.append(_save(fig, out, "verify.png"))
    return figs


def _target_phrase(state: dict[str, Any]) -> str:
    """``90% test accuracy``, or a user metric's ``r2 >= 0.98`` (the tuner covers
    higher-is-better metrics only)."""
    metric = str(state.get("metric") or "accuracy")
    if metric == "accuracy":
        return f"{100 * state['target']:g}% test accuracy"
    return f"evaluation {metric.rsplit(':', 1)[-1]} >= {state['target']:g}"


def _head_lines(state: dict[str, Any]) -> list[str]:
    """The target, the clock, the plan and its predicted time to accuracy."""
    clock = state["clock"]
    pred = state.get("prediction") or {}
    return [
        "# distsgd tune report",
        "",
        f"Target: {_target_phrase(state)} on the `{state['runtime']}` "
        f"runtime, λ = {state['num_learners']} devices; search budget {state['budget_s']:.0f} s, "
        f"tuning took {state['tuning_wall_s']:.1f} wall s.",
        "",
        f"Times are **{clock} seconds**"
        + (
            " (the simulated cluster's virtual clock; probes were equal in simulated time)."
            if clock == "simulated"
            else "."
        ),
        "",
        "## Plan",
        "",
        f"`plan.toml`: **{state.get('plan_name') or state['chosen_label']}**"
        + (
            f" (steady state from the long run's snapshot recommended {state['steady_state']})."
            if state.get("steady_state")
            else "."
        ),
        "",
        f"Predicted time to accuracy: **{_fmt(pred.get('predicted_s'), '.2f')} {clock} s** = "
        f"HE {_fmt((pred.get('seconds_per_iteration') or math.nan) * 1e3, '.3f')} ms per "
        f"iteration × SE {_fmt(pred.get('iterations_to_target'), '.0f')} iterations (target "
        f"training loss {_fmt(pred.get('target_loss'), '.4f')}, from the fitted loss "
        f"curve of the last of {pred.get('segments', 1)} long run(s))."
        + (f" No prediction: {pred['reason']}." if pred.get("reason") else ""),
        "",
        (
            f"The tuner's own runs reached the target after "
            f"{_fmt(pred.get('tuner_measured_s'), '.2f')} {clock} s"
            + (
                f" (the long run up to epoch {state['step_at']['epoch']:.3f}, then η/10"
                " from its snapshot)."
                if state.get("step_at")
                else "."
            )
            if pred.get("tuner_measured_s")
            else "The tuner's own runs did not reach the target within their limits (the "
            "budget, `train.max_epochs`)."
        ),
        "",
    ]


def _verify_lines(state: dict[str, Any]) -> list[str]:
    """Predicted against measured (after ``--verify``), or how to measure it."""
    clock, v = state["clock"], state.get("verify")
    if not v:
        return [
            "Measure it: `distsgd tune --verify-only DIR` trains `plan.toml` into `DIR/verify` "
            "and adds the measured point here (or run `distsgd tune ... --verify`).",
            "",
        ]
    ratio = v.get("ratio_predicted_to_measured")
    return [
        "## Predicted vs measured",
        "",
        f"Training the plan (`{v['run_dir']}`): reached = {v['reached']}, measured time "
        f"to accuracy **{_fmt(v['measured_s'], '.2f')} {clock} s**"
        + (
            f" ({_fmt(v.get('measured_wall_s'), '.1f')} wall s of training)"
            if clock == "simulated"
            else ""
        )
        + f"; predicted / measured = **{_fmt(ratio, '.3f')}**"
        + (
            f" ({'within' if ratio and abs(ratio - 1) <= 0.25 else 'outside'} ±25%)."
            if ratio
            else "."
        ),
        "",
    ]


def _tradeoff_lines(clock: str, rows: list[dict[str, Any]], figs: list[str]) -> list[str]:
    """The best probe of every shape with HE, SE and predicted time, then the figures."""
    lines = [
        "## Tradeoff space (best η, μ of each shape probed from the initial weights)",
        "",
        f"| configuration | score | {clock} s / iteration (HE) | iterations to target (SE) | "
        f"predicted time to accuracy ({clock} s) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['score']:.4f} | {_fmt(r['he'] * 1e3, '.3f')} ms | "
            f"{_fmt(r['se'], '.0f')} | {_fmt(r['predicted'], '.2f')} |"
        )
    lines += [
        "",
        "SE of a short probe is an extrapolation of its fitted loss curve "
        "(L(i) = L_inf + A (i+1)^-β) to the plan's target loss; the equal-time score is what "
        "the search decides on.",
        "",
    ]
    for f in figs:
        lines += [f"![{f}]({f})", ""]
    return lines


def _step_lines(state: dict[str, Any]) -> list[str]:
    """The runs at the lower η from the long run's snapshots (none: no section)."""
    clock, runs = state["clock"], state.get("step_runs") or []
    if not runs:
        return []
    lines = [
        "## Learning-rate step",
        "",
        "Runs at the lower η from snapshots of the long run (each until the target or until "
        "it could no longer beat the soonest so far), in the order tried; "
        + (
            f"the plan steps at epoch {state['step_at']['epoch']:.3f}, where the target "
            "came soonest."
            if state.get("step_at")
            else (
                "none reached the target sooner than the long run by more than the tie "
                "buffer, so the plan does not step."
                if (state["long_run"] or {}).get("summary", {}).get("reached")
                else "none reached the target, so the plan does not step (a step the "
                "tuner did not see reach the target is not planned)."
            )
        ),
        "",
        f"| step at epoch | accuracy there | reached | time to accuracy ({clock} s) | "
        "best accuracy | plan |",
        "|---|---|---|---|---|---|",
    ]
    plan_eval = (state.get("step_at") or {}).get("eval")
    for r in runs:
        lines.append(
            f"| {r['epoch']:.3f} | {r['accuracy']:.4f} | {r['reached']} | "
            f"{_fmt(r['time_to_target_s'], '.2f')} | {_fmt(r['best_metric'], '.4f')} | "
            + ("**plan**" if r["eval"] == plan_eval else "")
            + " |"
        )
    lines.append("")
    return lines


def _probe_lines(state: dict[str, Any]) -> list[str]:
    """Every probe in the order run."""
    lines = [
        "## Probes",
        "",
        "| # | configuration | snapshot | score | ms / iteration | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(state["probes"], 1):
        score = "NaN" if p["diverged"] else _fmt(p["score"], ".4f")
        he = p["seconds_per_iteration"]
        lines.append(
            f"| {i} | {p['label']} | {p['snapshot']} | {score} | "
            f"{_fmt(he * 1e3 if he else None, '.3f')} | {p['wall_s']:.1f} |"
        )
    return lines


def _extrapolation_lines(state: dict[str, Any]) -> list[str]:
    """The plan on larger simulated clusters (none: no section)."""
    clock, ext = state["clock"], state.get("extrapolation") or []
    if not ext:
        return []
    lines = [
        "",
        "## Larger clusters (performance model)",
        "",
        "HE from the simulated cluster's timing model, SE carried from the plan with the "
        f"batch-size law (B_noise = {state['noise_scale']:g} samples).",
        "",
        f"| λ | g | {clock} s / iteration | iterations to target | predicted ({clock} s) |",
        "|---|---|---|---|---|",
    ]
    for e in ext:
        lines.append(
            f"| {e['num_learners']} | {e['g']} | {_fmt(e['seconds_per_iteration'] * 1e3, '.3f')} ms | "
            f"{_fmt(e['iterations_to_target'], '.0f')} | {_fmt(e['predicted_s'], '.2f')} |"
        )
    return lines


def write_report(out_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write ``report.md`` and the figures into ``out_dir`` from the tune ``state`` (what
    ``tune.json`` holds); returns the path of ``report.md``."""
    out = Path(out_dir)
    rows = _shape_rows(state)
    figs = _plots(out, state, rows)
    lines = (
        _head_lines(state)
        + _verify_lines(state)
        + _tradeoff_lines(state["clock"], rows, figs)
        + _step_lines(state)
        + _probe_lines(state)
        + _extrapolation_lines(state)
    )
    lines += ["", "Every decision with its reason: `decisions.jsonl`.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _json_default(o: Any) -> Any:
    """What ``json.dumps`` cannot write: numpy scalars as Python numbers; else str (it
    writes every float itself, NaN and inf as ``NaN``/``Infinity``)."""
    if isinstance(o, np.floating | np.integer):
        return o.item()
    return str(o)


def clean_state(o: Any) -> Any:
    """``o`` with NaN/inf → None (strict JSON) and numpy scalars → Python, in every dict,
    list and tuple."""
    if isinstance(o, dict):
        return {k: clean_state(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [clean_state(v) for v in o]
    if isinstance(o, np.floating | np.integer):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def write_tune_json(out_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write the tune ``state`` to ``out_dir/tune.json`` (indented; what JSON cannot hold
    written as text)."""
    path = Path(out_dir) / "tune.json"
    path.write_text(json.dumps(state, indent=1, default=_json_default))
    return path


def tune_json(session: TuneSession) -> dict[str, Any]:
    """Everything a tune found, as ``tune.json`` keeps it (its keys are a file format:
    ``segments`` are the runs the prediction fits)."""
    fixed, st, costs, cfg = session.fixed, session.state, session.costs, session.cfg
    chosen, plan = st.chosen_candidate, st.plan
    assert plan is not None
    return {
        "config": str(fixed.config.name),
        "runtime": cfg.runtime,
        "clock": session.clock.name,
        "budget_s": session.settings.budget_s,
        "budget_costs": {
            "first_probe_expected_s": costs.first_probe_s,
            "probe_wall_s_max": costs.expected_probe_s(),
            "eval_s": costs.eval_s,
            "slack": "one step's overrun of its expected cost, plus writing the plan and report",
        },
        "tuning_wall_s": costs.elapsed(),
        "target": cfg.train.target,
        "metric": cfg.train.metric,
        "num_learners": fixed.layout.num_learners,
        "num_processes": fixed.layout.num_processes if cfg.runtime == "dist" else None,
        "network": None if fixed.network is None else dataclasses.asdict(fixed.network),
        "device_profile": {
            "seconds_per_batch": cfg.cluster.seconds_per_batch,
            "seconds_per_sample": cfg.cluster.seconds_per_sample,
        },
        "noise_scale": st.noise_scale,
        "chosen": dataclasses.asdict(chosen),
        "chosen_label": chosen.label(),
        "plan_name": plan.name,
        "plan_schedule": dataclasses.asdict(plan.schedule),
        "steady_state": None if st.steady is None else st.steady.label(),
        "prediction": st.prediction,
        "segments": [r.to_json() for r in st.plan_runs],
        "long_run": (
            None
            if st.long_run is None
            else {**st.long_run.result.to_json(), "summary": st.long_run.summary}
        ),
        "step_at": st.step_at,
        "step_runs": st.step_runs,
        "probes": [r.to_json() for r in session.search.results],
        "best_by_g": {str(g): r.candidate.label() for g, r in session.search.best_by_g.items()},
        "ranking": [{"label": c.label(), "predicted_relative": t} for t, c in st.ranked],
        "extrapolation": st.extrapolation,
        "decisions": len(session.log.entries),
    }
