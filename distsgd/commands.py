"""The commands of the command line (:mod:`distsgd.cli` is its light entry point):
``distsgd train [CONFIG.toml] [--set key=value ...] [--out DIR]``,
``distsgd report RUN_DIR [RUN_DIR ...] [--out DIR]``,
``distsgd export RUN_DIR [--out model.pt]`` and
``distsgd calibrate [CONFIG.toml] [--out profile.toml]``.

User errors (bad settings, missing or corrupt data, an occupied run directory) print one
line ``distsgd: error: ...`` and exit with status 2, never a traceback. A diverged run
exits with status 1 after writing its summary. A file of the run that cannot be written (a
full disk) stops it with one line naming the file and the directory, exit status 74
(``EX_IOERR``); its partial file is removed and the last checkpoint kept. Settings that contradict one another
(:class:`~distsgd.config.ConfigWarning`) print one line ``distsgd: warning: ...`` and the
run goes on.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from tqdm import tqdm

from distsgd import api
from distsgd.config import ConfigWarning, check_local_processes
from distsgd.launch import is_process_loss, rank_sigterm, under_launcher
from distsgd.metrics import OutputWriteError
from distsgd.report import make_report
from distsgd.runtime.sim import TrainingDiverged
from distsgd.tuner import tune as tuning

__all__ = ["main"]


def _fmt_s(v: Any) -> str:
    return "-" if v is None else f"{v:.1f} s"


def _fmt_metric(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _print_summary(s: dict[str, Any], out_dir: Path) -> None:
    target = s["target"]
    metric = str(s.get("metric") or "accuracy")
    name = metric.rsplit(":", 1)[-1]  # a user metric "module:function": its function
    if target != 0:
        sign = "<=" if s.get("metric_direction") == "min" else ">="
        outcome = f"target {sign} {target:.4g}: {'reached' if s['reached'] else 'NOT reached'}"
    else:
        outcome = "no target"
    if s["best_metric"] is None:
        value = "not evaluated (train.evaluate = false)"
    else:
        best, final = _fmt_metric(s["best_metric"]), _fmt_metric(s["final_metric"])
        value = f"best {best}, final {final} ({outcome})"
    lines = [
        f"protocol      {s['protocol']} ({s['layout']}) on the {s['runtime']} runtime",
        f"{name:<13} {value}" if len(name) <= 13 else f"{name} {value}",
    ]
    if s["reached"]:
        lines.append(
            f"to target     {_fmt_s(s['time_to_target_s'])} wall "
            + ("(from the start, tuning included), " if s.get("tuned") else "(training only), ")
            + (
                f"{_fmt_s(s['time_to_target_virtual_s'])} simulated, "
                if s["runtime"] == "sim"
                else ""
            )
            + f"{s['samples_to_target']} samples ({s['epochs_to_target']:.2f} epochs)"
        )
    tput = s["throughput_samples_per_s"]
    lines += [
        f"trained       {s['samples']} samples ({s['epochs']:.2f} epochs) in "
        f"{_fmt_s(s['train_wall_s'])} wall + {_fmt_s(s['eval_wall_s'])} evaluation"
        + (f", {s['virtual_s']:.1f} s simulated" if s["runtime"] == "sim" else ""),
        f"throughput    {tput:.0f} samples/s wall" if tput else "throughput    -",
        f"staleness     mean {s['staleness_mean']:.2f}, max {s['staleness_max']}",
    ]
    if s.get("tuned"):
        lines.append(
            f"tuning        {_fmt_s(s['tuning_wall_s'])} wall of {_fmt_s(s['total_wall_s'])} "
            f"({100 * (s['tuning_share'] or 0):.0f}%), {s['num_probes']} "
            f"probe{'' if s['num_probes'] == 1 else 's'} "
            "(decisions.jsonl, probes/)"
        )
    print("\n".join(lines + _results_lines(out_dir)))


def _results_lines(out_dir: Path) -> list[str]:
    """Where a finished run's results are and how to look at them: the run directory,
    ``distsgd report`` (what it writes), TensorBoard on ``RUN_DIR/tb`` when event files
    were written there, and the trained model ``RUN_DIR/model.pt`` when the run wrote
    one. Paths are quoted for a POSIX shell, so each command can be pasted as is."""
    run = shlex.quote(str(out_dir))
    lines = [
        f"run directory {out_dir} (summary.json, metrics.jsonl, config.toml, checkpoint.pt)",
        f"report        distsgd report {run}  (writes ./report/report.md: learning curves, "
        "staleness, a table)",
    ]
    tb = out_dir / "tb"
    if tb.is_dir() and any(tb.iterdir()):
        lines.append(f"tensorboard   tensorboard --logdir {shlex.quote(str(tb))}")
    model = out_dir / "model.pt"
    if model.is_file():
        lines.append(
            f"model         {model}  (model.load_state_dict(torch.load(path, weights_only=True)))"
        )
    return lines


def _check_num_processes(num_processes: int | None, runtime: str) -> None:
    """``--num-processes`` starts real processes: refuse it on the simulated runtime
    rather than ignore it."""
    if num_processes is not None and runtime != "dist":
        raise ValueError(
            f"--num-processes {num_processes} is not allowed with runtime = {runtime!r}: it "
            "starts real processes (add --runtime dist)"
        )


def _cmd_train(args: argparse.Namespace) -> int:
    if args.runtime:
        if args.resume:
            raise ValueError("--runtime cannot be used with --resume (the run keeps its runtime)")
        args.set = [f"runtime={args.runtime}", *args.set]
    if args.num_processes is not None and args.resume:
        raise ValueError(
            "--num-processes cannot be used with --resume (a run resumes on the "
            "processes it was started with)"
        )
    if args.resume:
        if args.tune:
            raise ValueError("--tune cannot be used with --resume (a run of --tune resumes as one)")
        if args.out:
            raise ValueError("--out cannot be used with --resume (the run continues in place)")
        if args.config:
            raise ValueError(
                f"--resume continues the run from {args.resume}/config.toml; "
                f"do not pass a config ({args.config}) as well"
            )
        out_dir = Path(args.resume)
        summary = api.train(resume=args.resume, overrides=args.set, progress=not args.quiet)
    else:
        cfg = api.resolve_config(args.config, args.set, num_processes=args.num_processes)
        _check_num_processes(args.num_processes, cfg.runtime)
        ranks = None
        if cfg.runtime == "dist" and not under_launcher():  # before the layout is announced
            ranks = check_local_processes(cfg)
            if args.tune:  # and the tuner's own limit on processes: one line, nothing else
                tuning.tune_layout(cfg)
        if cfg.layout_changes and os.environ.get("RANK", "0") == "0":  # once under torchrun
            print(
                f"dist: fitted the layout to {cfg.dist.num_processes} processes: "
                + ", ".join(cfg.layout_changes),
                file=sys.stderr,
            )
        out_dir = Path(args.out) if args.out else api.default_out_dir(cfg)
        args.out_dir = out_dir
        summary = api.run(cfg, out_dir, progress=not args.quiet, tune=args.tune, ranks=ranks)
    if summary:  # a dist rank other than 0 under torchrun returns {}
        _print_summary(summary, out_dir)
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.verify_only:
        if args.config or args.out or args.verify:
            raise ValueError("--verify-only DIR takes no config, --out or --verify")
        args.out_dir = Path(args.verify_only)
        state = tuning.verify_plan(args.out_dir, progress=not args.quiet)
        _print_tune(state, Path(args.verify_only))
        return 0
    if args.config is None:
        raise ValueError("distsgd tune needs a CONFIG.toml (or --verify-only DIR)")
    budget = tuning.parse_budget(args.budget) if args.budget is not None else None
    overrides = list(args.set)
    if args.runtime:
        overrides.append(f"runtime={args.runtime}")
    cfg = api.resolve_config(args.config, overrides, num_processes=args.num_processes)
    _check_num_processes(args.num_processes, cfg.runtime)
    out = Path(args.out) if args.out else Path("runs") / ("tune-" + Path(args.config).stem)
    args.out_dir = out
    state = tuning.tune(cfg, out, budget_s=budget, progress=not args.quiet, verify=args.verify)
    _print_tune(state, out)
    return 0


def _print_tune(state: dict[str, Any], out: Path) -> None:
    pred = state["prediction"].get("predicted_s")
    clock = state["clock"]
    lines = [
        f"plan          {state.get('plan_name') or state['chosen_label']} ({out / 'plan.toml'})",
        f"predicted     time to accuracy {_fmt_s(pred)} {clock}",
        f"tuning        {state['tuning_wall_s']:.1f} s wall, {len(state['probes'])} probes",
    ]
    v = state.get("verify")
    if v:
        lines.append(
            f"measured      time to accuracy {_fmt_s(v['measured_s'])} {clock} "
            f"(reached: {v['reached']}; predicted/measured "
            + (
                f"{v['ratio_predicted_to_measured']:.3f})"
                if v["ratio_predicted_to_measured"]
                else "-)"
            )
        )
    lines.append(f"report        {out / 'report.md'}")
    lines.append(
        f"results       {out} (decisions.jsonl, probes/); train the plan: distsgd train "
        + shlex.quote(str(out / "plan.toml"))
    )
    print("\n".join(lines))


def _tune_kept(out: Path) -> str:
    """What an interrupted tune left in ``out``: its probe runs and whether a plan."""
    probes = out / "probes"
    n = sum(1 for p in probes.iterdir() if p.is_dir()) if probes.is_dir() else 0
    plan = f"plan in {out / 'plan.toml'}" if (out / "plan.toml").exists() else "no plan"
    log = f", decisions in {out / 'decisions.jsonl'}" if (out / "decisions.jsonl").exists() else ""
    return f"{n} probe run(s) in {probes}{log}, {plan}"


def _one_line_config_warning(show: Any) -> Any:
    """A ``warnings.showwarning`` printing a :class:`ConfigWarning` as one line
    ``distsgd: warning: ...`` on stderr (above a progress bar of this process, which is
    drawn again below it: ``tqdm.write``), and any other warning as ``show`` does."""

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        if issubclass(category, ConfigWarning):
            tqdm.write(f"distsgd: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _cmd_calibrate(args: argparse.Namespace) -> int:
    path, prof = api.calibrate(args.config, args.set, args.out)
    push = prof.seconds_per_push or 0.0
    per_iteration = prof.seconds_per_iteration or 0.0
    print(
        f"device profile {prof.seconds_per_batch * 1e3:.3f} ms/batch + "
        f"{prof.seconds_per_sample * 1e6:.1f} µs/sample (spread {prof.spread:.0%} over "
        f"{prof.repeats} measurements), {per_iteration * 1e3:.3f} ms/iteration beyond the "
        f"gradient, server {push * 1e3:.3f} ms/push, "
        f"{prof.key.num_threads} thread(s), written to {path}"
        + (
            ""
            if args.out is None
            else f"; use it with --set cluster.profile={shlex.quote(str(path))}"
        )
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    path = api.export_model(args.run_dir, args.out)
    print(
        f"model written to {path} (a state_dict: "
        f"model.load_state_dict(torch.load({str(path)!r}, weights_only=True)))"
    )
    return 0


def _cmd_join(args: argparse.Namespace) -> int:
    done = api.join(args.run_dir)
    print(
        f"distsgd: left the run in {args.run_dir} when it stopped: {done['num_computes']} "
        f"gradients computed, last weights of version {done['version']}",
        file=sys.stderr,
    )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    md = make_report([Path(d) for d in args.runs], Path(args.out))
    print(f"report written to {md} (figures in {md.parent})")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the house rule for user errors: one line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_set(parser: argparse.ArgumentParser, text: str = "override a setting") -> None:
    """``--set KEY=VALUE`` (repeatable) on a subcommand's parser."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="distsgd",
        description="Distributed SGD: parameter server (Rudra), compute groups (Omnivore), "
        "SMA (Crossbow) and baselines, on a simulated cluster or real processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a model and report time to accuracy")
    t.add_argument(
        "config",
        nargs="?",
        default=None,
        help="TOML config (default: Fashion-MNIST cnn, hardsync, target 90%%)",
    )
    _add_set(t, "override a setting, e.g. --set optimizer.lr=0.05 (repeatable)")
    t.add_argument("--out", default=None, help="run directory (default runs/<time>-<protocol>)")
    t.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint",
    )
    t.add_argument(
        "--runtime",
        choices=("sim", "dist"),
        default=None,
        help="sim: simulated cluster in this process (default); dist: real processes "
        "through torch.distributed (same as --set runtime=dist)",
    )
    t.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="dist runtime: processes to start (same as --set dist.num_processes=N); "
        "the layout is fitted to N (λ = N for hardsync, N·k for SMA and local SGD, "
        "N - dist.num_servers for the parameter server and compute groups; per-learner "
        "batch and learning rate kept) and the changes printed",
    )
    t.add_argument(
        "--tune",
        action="store_true",
        help="tune while training: Omnivore's cold start (η, μ, groups; family and batch "
        "where the layout allows) from the initial model by successive halving (first "
        "rungs of tune.first_rung × tune.probe_seconds, the best continue to the full "
        "length), the winning probe continues as the run, re-optimised when the training "
        "loss flattens (a check every tune.check_epochs); the time to the target counts "
        "every probe ([tune] settings; decisions.jsonl, probes/; the docs' tuning page, "
        "docs/tuning.md)",
    )
    t.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar and no decision lines (the auto-tuner's stay in autotune.json, "
        "--tune's in decisions.jsonl)",
    )
    t.set_defaults(func=_cmd_train)
    j = sub.add_parser(
        "join",
        help="join a running dist run (parameter server, mode async or softsync) as one more "
        "learner on this machine, until the run stops",
    )
    j.add_argument("run_dir", metavar="RUN_DIR", help="run directory of the running distsgd train")
    j.set_defaults(func=_cmd_join)
    r = sub.add_parser(
        "report", help="plot learning curves and staleness of runs and tabulate them"
    )
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories of distsgd train")
    r.add_argument(
        "--out", default="report", help="report folder (default report/, created if missing)"
    )
    r.set_defaults(func=_cmd_report)
    e = sub.add_parser(
        "export",
        help="write a run's trained model (the last evaluated model) as a plain state_dict "
        "from its checkpoint",
    )
    e.add_argument("run_dir", metavar="RUN_DIR", help="run directory of distsgd train")
    e.add_argument("--out", default=None, help="file to write (default RUN_DIR/model.pt)")
    e.set_defaults(func=_cmd_export)
    c = sub.add_parser(
        "calibrate",
        help="measure the simulated cluster's device profile of a config on this machine "
        "(e.g. the GPU node being planned for) and write it",
    )
    c.add_argument("config", nargs="?", default=None, help="TOML config (default: the default run)")
    c.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="profile file to write, for cluster.profile = FILE in a config (default: this "
        "machine's profile cache, replacing its entry: recalibration)",
    )
    _add_set(c)
    c.set_defaults(func=_cmd_calibrate)
    u = sub.add_parser(
        "tune",
        help="search protocol, layout, batch size, learning rate and momentum for the least "
        "time to accuracy (Omnivore's optimizer and a performance model)",
    )
    u.add_argument("config", nargs="?", default=None, help="base TOML config ([tune] settings)")
    u.add_argument(
        "--budget", default=None, help="search budget, e.g. 90s, 10m, 1h (default tune.budget_s)"
    )
    u.add_argument(
        "--runtime", default=None, help="runtime the probes run on: sim (default) or dist"
    )
    u.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="--runtime dist: processes each probe runs on (same as --set "
        "dist.num_processes=N; 0 or omitted: what the config's protocol needs; at most "
        "the CPU cores of this machine)",
    )
    u.add_argument("--out", default=None, help="tune directory (default runs/tune-<config>)")
    _add_set(u)
    u.add_argument(
        "--verify", action="store_true", help="train the plan afterwards and add the measured point"
    )
    u.add_argument(
        "--verify-only",
        default=None,
        metavar="TUNE_DIR",
        help="train TUNE_DIR/plan.toml and add its measured time to accuracy to the report",
    )
    u.add_argument("--quiet", action="store_true", help="no progress bar or decision lines")
    u.set_defaults(func=_cmd_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distsgd`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (a scheduler stopping the job) ends the run like Ctrl-C: summary written,
    # last checkpoint kept (a rank under torchrun: also ends by a deadline, rank_sigterm).
    signal.signal(signal.SIGTERM, rank_sigterm if under_launcher() else _raise_keyboard_interrupt)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_config_warning(warnings.showwarning)
            return int(args.func(args))
    except TrainingDiverged as e:
        print(f"distsgd: training diverged: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if not is_process_loss(e):
            raise
        print(f"distsgd: run failed: {e}", file=sys.stderr)
        return 1
    except OutputWriteError as e:  # a full disk: the last checkpoint is kept
        print(f"distsgd: error: {e}", file=sys.stderr)
        return e.exit_status
    except ValueError as e:  # ConfigError, DatasetError and other user mistakes
        print(f"distsgd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "join":
            print("distsgd: interrupted; the run goes on without this learner", file=sys.stderr)
            return 130
        out_dir = getattr(args, "out_dir", None) or getattr(args, "resume", None)
        if args.command == "tune" and out_dir:
            print(f"distsgd: interrupted: {_tune_kept(Path(out_dir))}", file=sys.stderr)
            return 130
        if out_dir and (Path(out_dir) / "checkpoint.pt").exists():
            msg = f"the last checkpoint in {out_dir} is kept (continue with --resume {out_dir})"
        elif out_dir and api.is_tuning_run(out_dir):
            msg = f"the probes so far are kept in {out_dir} (continue with --resume {out_dir})"
        else:
            msg = "no checkpoint was written yet"
        print(f"distsgd: interrupted; {msg}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
