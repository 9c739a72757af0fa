"""The dist runtime on this machine: distsgd vs plain PyTorch DDP, async vs hardsync, and
the simulator's prediction of seconds per iteration vs what the processes measure.

Side by side in one run, Fashion-MNIST ``cnn``, one thread per process, the same batch
and learning rate everywhere:

1. **hardsync vs plain DDP** — ``distsgd train --runtime dist`` hardsync with 2 processes
   vs a textbook PyTorch DDP script (this file, ``--plain-ddp-worker``, started by
   torchrun with 2 processes): throughput (training samples per wall second, evaluation
   excluded) and wall seconds of training to the target accuracy, for both; the ratio
   distsgd / plain (target >= 0.95).
2. **async vs hardsync** — the parameter server, async, 2 learner processes + 1 server
   process, same per-learner batch and learning rate: throughput / hardsync's (target >= 0.9).
3. **simulation fidelity** — for hardsync and async with 1 and 2 learners: seconds per
   iteration predicted by the simulated cluster calibrated on this machine (virtual
   seconds / iterations) vs measured on real processes (training wall seconds /
   iterations; for async an iteration is one update, i.e. one push) (target within ±20%).
   Calibration, with one thread per process as the dist runs: the device profile (median
   of 20 repeats) alone, and again while another process computes the same model (the
   2-learner runs compute two at a time on this machine's cores; they are predicted
   with that profile), each with a hardsync learner's work per iteration beyond its
   gradient measured in the same process and condition
   (:func:`distsgd.runtime.dist.calibrate_iteration`: the real hardsync iteration at world
   size 1 minus the gradient; ``cluster.seconds_per_iteration``, charged to the hardsync
   rows); the network by :func:`distsgd.runtime.netcal.calibrate_network`
   (gloo send/recv and all-reduce between two processes on loopback, least squares); the
   parameter server's apply + copy per push (one thread, median of 200 pushes,
   :func:`distsgd.runtime.sim.calibrate_server`, what ``distsgd calibrate`` measures) and
   its whole time per push on real processes (async, one learner at batch 1, minus the
   simulated compute and messages), charged to the async rows as
   ``cluster.seconds_per_push``; unless ``--server-alone``, measured again while the
   row's other λ − 1 learners' worth of processes compute (1 for λ = 2: what a push meets
   there, its own learner waiting for the reply) and charged as
   ``cluster.seconds_per_push_contended``, a wall time with the waits for a core in it,
   which the simulator does not stretch again (``bench/results/dist/overhead_charged``;
   the columns show the prediction with the time measured alone, with the contended time
   stretched again, with it measured while λ processes compute, and without any server
   work). Each
   row's device profile is measured again just before its dist run (the machine's load
   drifts). Every rank runs on this machine, so the simulated rows set ``cluster.cores``
   to its cores (:func:`distsgd.runtime.cluster_model.server_core_stretch`).

    flock /tmp/distsgd-bench.lock python bench/dist_bench.py --out bench/results/dist
    flock /tmp/distsgd-bench.lock python bench/dist_bench.py --skip-to-target  # fidelity only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plain_ddp_worker(args: argparse.Namespace) -> None:
    """A plain PyTorch DDP training loop (one rank under torchrun): model, SGD, DDP, each
    rank its slice of every global batch of a per-epoch permutation; rank 0 evaluates
    every ``eval_every`` samples while the other waits (evaluation time excluded)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from distsgd.config import DataConfig
    from distsgd.data import load_dataset
    from distsgd.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = load_dataset(DataConfig(), seed=args.seed)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model("cnn", ds.input_shape, ds.num_classes))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    b, n = args.batch_size, ds.num_train
    steps_per_epoch = n // (world * b)
    samples, train_s, reached_s, acc = 0, 0.0, None, 0.0
    budget = int(args.max_epochs * n)

    def evaluate() -> float:
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, ds.num_test, 1000):
                logits = model.module(ds.test_x[i : i + 1000])
                correct += int((logits.argmax(1) == ds.test_y[i : i + 1000]).sum())
        model.train()
        return correct / ds.num_test

    next_eval = args.eval_every
    epoch = 0
    done = False
    while not done:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g)
        for s in range(steps_per_epoch):
            idx = perm[s * world * b + rank * b : s * world * b + (rank + 1) * b]
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - t0
            samples += world * b
            if samples >= next_eval or samples >= budget:
                next_eval += args.eval_every
                stop = torch.zeros(1)
                if rank == 0:
                    acc = evaluate()
                    if reached_s is None and acc >= args.target:
                        reached_s = train_s
                    stop[0] = float(samples >= budget or reached_s is not None)
                dist.broadcast(stop, 0)
                if stop.item():
                    done = True
                    break
        epoch += 1
    if rank == 0:
        Path(args.result).write_text(
            json.dumps(
                {
                    "samples": samples,
                    "train_wall_s": train_s,
                    "throughput_samples_per_s": samples / train_s,
                    "time_to_target_s": reached_s,
                    "final_metric": acc,
                }
            )
        )
    dist.destroy_process_group()


def distsgd_run(overrides: list[str], out: Path) -> dict[str, Any]:
    import distsgd

    return distsgd.train(None, overrides=overrides, out_dir=out)


def common(args: argparse.Namespace) -> list[str]:
    return [
        "model.name=cnn",
        f"protocol.batch_size={args.batch_size}",
        f"optimizer.lr={args.lr}",
        f"optimizer.momentum={args.momentum}",
        "train.num_threads=1",
        f"train.seed={args.seed}",
        "train.tensorboard=false",
        "train.checkpoint_every_evals=0",
    ]


def to_target(args: argparse.Namespace) -> list[str]:
    return [
        f"train.target={args.target}",
        f"train.max_epochs={args.max_epochs}",
        f"train.eval_every_samples={args.eval_every}",
    ]


HARDSYNC2 = ["runtime=dist", "protocol.name=hardsync", "protocol.num_learners=2"]
ASYNC2 = [
    "runtime=dist",
    "protocol.name=parameter_server",
    "protocol.mode=async",
    "protocol.num_learners=2",
]


def plain_ddp(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    result = tmp / "plain_ddp.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(Path(__file__).resolve()), "--plain-ddp-worker", "--result", str(result),
        "--batch-size", str(args.batch_size), "--lr", str(args.lr),
        "--momentum", str(args.momentum), "--seed", str(args.seed),
        "--target", str(args.target), "--max-epochs", str(args.max_epochs),
        "--eval-every", str(args.eval_every),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads(result.read_text())


def busy_worker() -> None:
    """Compute the cnn's gradients with one thread until terminated (the other learner
    process of a 2-process run, for calibrating the device profile under contention)."""
    import torch

    from distsgd.config import DataConfig
    from distsgd.data import load_dataset
    from distsgd.engine import GradientEngine
    from distsgd.models import build_model

    torch.set_num_threads(1)
    ds = load_dataset(DataConfig())
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    w = engine.initial_weights()
    print("ready", flush=True)
    while True:
        engine.gradient(w, ds.train_x[:64], ds.train_y[:64])


@contextlib.contextmanager
def busy_process(count: int | bool = 1) -> Iterator[None]:
    """While inside, ``count`` other processes compute the cnn's gradients with one thread
    each (:func:`busy_worker`; as the other learners of a run do); True: 1, 0 or False:
    nothing is started."""
    busy = []
    for _ in range(int(count)):
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--busy-worker"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            text=True,
        )
        busy.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    if busy:
        time.sleep(1.0)  # let them reach their steady loop
    try:
        yield
    finally:
        for proc in busy:
            proc.terminate()
            proc.wait()


def calibrated_profile(args: argparse.Namespace, concurrent: bool = False) -> dict[str, float]:
    """The device profile of one learner process: 1 thread (as every dist process in this
    benchmark), median of 20 repeats (the measured runs' mean includes the machine's
    ordinary disturbances, which the fastest repeat hides), and the hardsync learner's
    work per iteration beyond its gradient (:func:`calibrate_iteration`, median of 20, in
    the same process). ``concurrent``: while another process computes the same model with
    one thread (as the other learner of a 2-process run does)."""
    import torch

    from distsgd.api import resolve_config
    from distsgd.config import DataConfig
    from distsgd.data import load_dataset
    from distsgd.engine import GradientEngine
    from distsgd.models import build_model
    from distsgd.runtime.dist import calibrate_iteration
    from distsgd.runtime.sim import calibrate

    with busy_process(concurrent):
        torch.set_num_threads(1)
        ds = load_dataset(DataConfig())
        torch.manual_seed(0)
        engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
        prof = calibrate(engine, ds, repeats=20, statistic=statistics.median)
        cfg = resolve_config(None, [*common(args), "protocol.name=hardsync"])
        per_iteration = calibrate_iteration(
            cfg, ds, lambda: GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
        )
    return {
        "seconds_per_sample": prof.seconds_per_sample,
        "seconds_per_batch": prof.seconds_per_batch,
        "seconds_per_iteration": per_iteration,
        "num_parameters": engine.num_parameters,
    }


def server_seconds(args: argparse.Namespace, num_learners: int) -> float:
    """The async parameter server's work per push with one thread (as the server rank),
    on the cnn of ``num_learners`` learners (median of 200 pushes)."""
    import torch

    from distsgd.api import resolve_config
    from distsgd.engine import GradientEngine
    from distsgd.layout import build_protocol
    from distsgd.models import build_model
    from distsgd.runtime.sim import calibrate_server

    torch.set_num_threads(1)
    cfg = resolve_config(
        None, [*common(args), *ASYNC2[1:-1], f"protocol.num_learners={num_learners}"]
    )
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", (1, 28, 28), 10))
    proto = build_protocol(cfg, engine.initial_weights())
    return calibrate_server(proto, args.lr, repeats=200)


def gradient_seconds(batch_size: int, repeats: int = 200) -> float:
    """Median seconds of one gradient of the cnn at ``batch_size`` with one thread, timed
    directly (the profile's line, fitted at b = 16 and 128, misses b = 1 by ms: its
    intercept is the fit's noise)."""
    import torch

    from distsgd.config import DataConfig
    from distsgd.data import load_dataset
    from distsgd.engine import GradientEngine
    from distsgd.models import build_model

    torch.set_num_threads(1)
    ds = load_dataset(DataConfig())
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    w = engine.initial_weights()
    x, y = ds.train.batch(torch.arange(batch_size))
    for _ in range(10):
        engine.gradient(w, x, y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.gradient(w, x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def server_seconds_on_processes(
    args: argparse.Namespace,
    tmp: Path,
    profile: dict[str, float],
    network_overrides: list[str],
    busy: int = 0,
) -> dict[str, float]:
    """The server's whole time per push on real processes, as a learner waits for it:
    async with one learner at batch 1 (its compute is a few ms), ``pushes`` pushes;
    measured seconds per push minus what the simulator charges for the same run without
    any server work (the learner's compute at b = 1, timed directly by
    :func:`gradient_seconds` just before, and the two messages). This includes what
    :func:`server_seconds` leaves out: receiving the push and sending the reply in the
    server's threads, the hand-over to the training loop, the learner's own work around
    its gradient (drawing the batch, staging the push). ``profile`` is unused (kept for
    the caller); the b = 1 compute is not taken from the profile's line. ``busy``: the
    dist run while that many other processes compute (:func:`busy_process`): for a run of
    λ learners, λ − 1, what a push meets there (its own learner waits for the reply while
    the other λ − 1 compute), so its messages and the server's handling wait for a core as
    they do in the run; the result is a wall time with those waits in it, charged as
    ``cluster.seconds_per_push_contended`` (not stretched again;
    ``bench/results/dist/overhead_charged``).
    """
    pushes = 400
    base = [
        *common(args),
        *ASYNC2[1:-1],
        "protocol.num_learners=1",
        "protocol.batch_size=1",
        "train.target=0",
        "train.max_epochs=0",
        f"train.max_samples={pushes}",
        f"train.eval_every_samples={pushes}",
    ]
    t1 = gradient_seconds(1)
    with busy_process(busy):
        real = distsgd_run([*base, "runtime=dist"], tmp / f"server-dist-{busy}")
    sim = distsgd_run(
        [
            *base,
            *network_overrides,
            f"cluster.seconds_per_batch={t1!r}",
            "cluster.seconds_per_sample=0",
            "runtime=sim",
            "cluster.jitter=0",
            "cluster.seconds_per_push=0",
        ],
        tmp / f"server-sim-{busy}",
    )
    measured = real["train_wall_s"] / real["iterations"]
    free = sim["virtual_s"] / sim["iterations"]
    return {
        "gradient_s_at_batch_1": t1,
        "measured_s_per_push": measured,
        "predicted_without_server_s_per_push": free,
        "seconds_per_push": max(measured - free, 0.0),
    }


def profile_overrides(profile: dict[str, float], synchronous: bool = True) -> list[str]:
    """The simulated device of ``profile``; a synchronous protocol's learners are also
    charged their work per iteration beyond the gradient (a parameter server's learners
    are not: the update is the server's, in ``cluster.seconds_per_push``)."""
    per_iteration = profile.get("seconds_per_iteration", 0.0)
    return [
        f"cluster.seconds_per_sample={profile['seconds_per_sample']!r}",
        f"cluster.seconds_per_batch={profile['seconds_per_batch']!r}",
        *([f"cluster.seconds_per_iteration={per_iteration!r}"] if synchronous else []),
    ]


def push_overrides(protocol: str, push_s: float, contended_s: float | None) -> list[str]:
    """The server's charge of an async row: ``cluster.seconds_per_push`` (its work
    measured alone: its demand for a core, stretched where the cores are shared) and,
    where measured (the default; not with ``--server-alone``),
    ``cluster.seconds_per_push_contended`` (its time per push measured while the row's
    other λ − 1 learners compute: charged as measured, not stretched again). Hardsync
    rows: none."""
    if protocol != "async":
        return []
    out = [f"cluster.seconds_per_push={push_s!r}"]
    if contended_s is not None:
        out.append(f"cluster.seconds_per_push_contended={contended_s!r}")
    return out


def fidelity(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Predicted vs measured seconds per iteration; the simulator calibrated on this
    machine: device profile alone and under contention, network by gloo measurement."""
    from distsgd.runtime.netcal import calibrate_network

    alone = calibrated_profile(args)
    contended = calibrated_profile(args, concurrent=True)
    network = calibrate_network(int(alone["num_parameters"]))
    measured_profiles = []
    apply_s = {lam: server_seconds(args, lam) for lam in (1, 2)}
    on_processes = server_seconds_on_processes(args, tmp, alone, network.overrides())
    push_s = {lam: on_processes["seconds_per_push"] for lam in (1, 2)}
    contended_s: dict[int, float] = {}  # cluster.seconds_per_push_contended per λ
    contended_server = contended_server_all = None
    if not args.server_alone:
        # what a push meets in a run of λ learners: the other λ − 1 compute (λ = 1: none,
        # the measurement alone; with 1 learner + server on 2 cores nothing stretches)
        contended_s[1] = on_processes["seconds_per_push"]
        contended_server = server_seconds_on_processes(
            args, tmp, contended, network.overrides(), busy=1
        )
        contended_s[2] = contended_server["seconds_per_push"]
        # a diagnostic, not charged: with as many computing processes as λ = 2 has learners
        contended_server_all = server_seconds_on_processes(
            args, tmp, contended, network.overrides(), busy=2
        )
    calibration = {
        "seconds_per_push": {str(k): v for k, v in push_s.items()},
        "seconds_per_push_contended": {str(k): v for k, v in contended_s.items()},
        "apply_seconds_per_push": {str(k): v for k, v in apply_s.items()},
        "server_on_processes": on_processes,
        "server_on_processes_contended": contended_server,
        "server_on_processes_contended_lambda_busy": contended_server_all,
        "profile_alone": alone,
        "profile_contended": contended,
        "contention_factor_batch": (
            (contended["seconds_per_batch"] + args.batch_size * contended["seconds_per_sample"])
            / (alone["seconds_per_batch"] + args.batch_size * alone["seconds_per_sample"])
        ),
        "network": {
            "latency_s": network.latency_s,
            "allreduce_latency_s": network.allreduce_latency_s,
            "allreduce_bandwidth_gbps": network.allreduce_bandwidth_gbps,
            "bandwidth_gbps": network.bandwidth_gbps,
            "measurements": network.measurements,
        },
    }
    print(json.dumps(calibration), flush=True)
    rows = []
    for name, proto in (
        ("hardsync", ["protocol.name=hardsync"]),
        ("async", ["protocol.name=parameter_server", "protocol.mode=async"]),
    ):
        for lam in (1, 2):
            layout = [*proto, f"protocol.num_learners={lam}"]
            budget = [
                "train.target=0",
                "train.max_epochs=0",
                f"train.max_samples={args.fidelity_samples}",
                f"train.eval_every_samples={args.fidelity_samples}",
            ]
            base = common(args) + layout + budget
            sim_base = [
                *base,
                *network.overrides(),
                "runtime=sim",
                "cluster.jitter=0",
                f"cluster.cores={os.cpu_count()}",  # every rank runs on this machine
            ]
            # one learner computes alone; two learner processes compute at the same time.
            # Measured again just before the row's dist run: the machine's load (shared
            # with other work) drifts within minutes, and the row is predicted with the
            # load of its own moment
            alone = calibrated_profile(args)
            profiles = {"alone": alone}
            if lam == 2:
                profiles["contended"] = contended = calibrated_profile(args, concurrent=True)
            measured_profiles.append({"row": f"{name} λ={lam}", "load": load(), **profiles})
            push = push_overrides(name, push_s[lam], contended_s.get(lam))
            predicted = {}
            for key, prof in profiles.items():
                sync = name == "hardsync"
                sim = distsgd_run(
                    [*sim_base, *profile_overrides(prof, sync), *push],
                    tmp / f"sim-{name}{lam}{key}",
                )
                predicted[key] = sim["virtual_s"] / sim["iterations"]
            used = "alone" if lam == 1 else "contended"
            # the same row with other server charges (async only; None: as predicted)
            variants: dict[str, list[str] | None] = {
                "server_alone": None,  # its work measured alone, stretched (``--server-alone``)
                "server_stretched_again": None,  # the contended time, stretched again
                "server_lambda_busy": None,  # measured while λ processes compute
                "server_free": None,
            }
            if name == "async":
                variants["server_free"] = ["cluster.seconds_per_push=0"]
                if lam in contended_s and lam > 1:
                    variants["server_alone"] = push_overrides(name, push_s[lam], None)
                    variants["server_stretched_again"] = push_overrides(
                        name, contended_s[lam], None
                    )
                    assert contended_server_all is not None
                    variants["server_lambda_busy"] = push_overrides(
                        name, push_s[lam], contended_server_all["seconds_per_push"]
                    )
            other: dict[str, float | None] = {}
            for key, overrides in variants.items():
                # not measured (a row without a contended time): no figure
                applies = key in ("server_alone", "server_free")
                other[key] = predicted[used] if applies else None
                if overrides is not None:
                    sim = distsgd_run(
                        [
                            *sim_base,
                            *profile_overrides(profiles[used], synchronous=name == "hardsync"),
                            *overrides,
                        ],
                        tmp / f"sim-{name}{lam}{key}",
                    )
                    other[key] = sim["virtual_s"] / sim["iterations"]
            real = distsgd_run([*base, "runtime=dist"], tmp / f"dist-{name}{lam}")
            measured = real["train_wall_s"] / real["iterations"]
            rows.append(
                {
                    "protocol": name,
                    "num_learners": lam,
                    "iterations": real["iterations"],
                    "profile": used,
                    "predicted_s_per_iteration": predicted[used],
                    "predicted_alone_s_per_iteration": predicted["alone"],
                    "measured_s_per_iteration": measured,
                    "ratio_measured_over_predicted": measured / predicted[used],
                    "ratio_measured_over_predicted_alone": measured / predicted["alone"],
                    **{f"predicted_{k}_s_per_iteration": v for k, v in other.items()},
                    **{
                        f"ratio_measured_over_predicted_{k}": None if v is None else measured / v
                        for k, v in other.items()
                    },
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    calibration["profiles_per_row"] = measured_profiles
    return {"calibration": calibration, "rows": rows}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split(" ")[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plain-ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--busy-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=64, help="per learner")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--max-epochs", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=10000, help="samples")
    ap.add_argument("--fidelity-samples", type=int, default=12800)
    ap.add_argument(
        "--skip-to-target",
        action="store_true",
        help="only the fidelity part; the to-target part of <out>/results.json is kept",
    )
    ap.add_argument(
        "--server-alone",
        action="store_true",
        help="async rows: charge only the server's time per push measured alone, stretched by "
        "the share of the cores (the model before the contended time was charged); "
        "default: also its time measured while the row's other λ − 1 learners' worth of "
        "processes compute, charged as measured (cluster.seconds_per_push_contended)",
    )
    # the default since bench/results/dist/overhead_charged's contended runs; kept so that
    # the commands recorded there still run
    ap.add_argument("--server-contended", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/dist")
    args = ap.parse_args()
    if args.plain_ddp_worker:
        plain_ddp_worker(args)
        return
    if args.busy_worker:
        busy_worker()
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": vars(args), "load_before": load()}
    previous = out / "results.json"
    if args.skip_to_target and previous.exists():  # keep the earlier to-target figures
        old = json.loads(previous.read_text())
        if "to_target" in old:
            keep = ("to_target", "ratio_hardsync_over_plain_ddp", "ratio_async_over_hardsync")
            report["to_target_run"] = old.get("to_target_run") or {
                "load_before": old["load_before"],
                "load_after": old["load_after"],
            }
            report.update({k: old[k] for k in keep})
    with tempfile.TemporaryDirectory(prefix="dist-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.skip_to_target:
            runs = {}
            t = common(args) + to_target(args)
            runs["distsgd_hardsync"] = distsgd_run([*t, *HARDSYNC2], tmp / "hardsync")
            print("distsgd hardsync", runs["distsgd_hardsync"]["throughput_samples_per_s"])
            runs["plain_ddp"] = plain_ddp(args, tmp)
            print("plain DDP", runs["plain_ddp"]["throughput_samples_per_s"])
            runs["distsgd_async"] = distsgd_run([*t, *ASYNC2], tmp / "async")
            print("distsgd async", runs["distsgd_async"]["throughput_samples_per_s"])
            keys = ("samples", "train_wall_s", "throughput_samples_per_s", "time_to_target_s")
            report["to_target"] = {k: {x: r.get(x) for x in keys} for k, r in runs.items()}
            h = runs["distsgd_hardsync"]["throughput_samples_per_s"]
            report["ratio_hardsync_over_plain_ddp"] = (
                h / runs["plain_ddp"]["throughput_samples_per_s"]
            )
            report["ratio_async_over_hardsync"] = (
                runs["distsgd_async"]["throughput_samples_per_s"] / h
            )
        report["fidelity"] = fidelity(args, tmp)
    report["load_after"] = load()
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(markdown(report))
    (out / "fidelity.md").write_text(fidelity_markdown(report))
    print(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    """The results as markdown (what ``<out>/README.md`` holds)."""
    s = r["settings"]
    lines = [
        "# dist runtime benchmark (bench/dist_bench.py)",
        "",
        f"Fashion-MNIST `cnn`, batch {s['batch_size']} per learner, lr {s['lr']}, momentum "
        f"{s['momentum']}, one thread per process, {os.cpu_count()} cores. Load average "
        f"(1, 5, 15 min) before: {r['load_before']}; after: {r['load_after']}.",
        "",
    ]
    if "to_target" in r:
        lines += [
            f"## To {s['target']:.0%} test accuracy (at most {s['max_epochs']} epochs, "
            f"evaluated every {s['eval_every']} samples)",
            "",
        ]
        if "to_target_run" in r:
            t = r["to_target_run"]
            lines += [
                "(From an earlier run of the full benchmark; load average before: "
                f"{t['load_before']}; after: {t['load_after']}.)",
                "",
            ]
        lines += [
            "| run | samples | training wall s | throughput samples/s | time to target s |",
            "|---|---|---|---|---|",
        ]
        for k, v in r["to_target"].items():
            tta = v["time_to_target_s"]
            lines.append(
                f"| {k} | {v['samples']} | {v['train_wall_s']:.1f} | "
                f"{v['throughput_samples_per_s']:.0f} | {'-' if tta is None else f'{tta:.1f}'} |"
            )
        lines += [
            "",
            "- throughput distsgd hardsync / plain DDP: "
            f"**{r['ratio_hardsync_over_plain_ddp']:.3f}** (target >= 0.95)",
            "- throughput distsgd async (2 learners + server) / distsgd hardsync: "
            f"**{r['ratio_async_over_hardsync']:.3f}** (target >= 0.9)",
            "",
        ]
    return "\n".join(lines) + fidelity_markdown(r)


def _server_on_processes_text(sp: dict[str, float] | None, condition: str = "") -> str:
    if not sp:
        return ""
    g1 = sp.get("gradient_s_at_batch_1")
    with_g1 = "" if g1 is None else f" (its gradient at batch 1 timed directly: {g1 * 1e3:.3f} ms)"
    return (
        "; the server's whole time per push on real processes (async, one learner at batch 1, "
        f"400 pushes{condition}): {sp['measured_s_per_push'] * 1e3:.3f} ms per push measured − "
        f"{sp['predicted_without_server_s_per_push'] * 1e3:.3f} ms simulated without server "
        f"work{with_g1} = {sp['seconds_per_push'] * 1e3:.3f} ms"
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt_profile(p: dict[str, float]) -> str:
    text = f"{p['seconds_per_batch'] * 1e3:.2f} + {p['seconds_per_sample'] * 1e3:.3f}"
    if "seconds_per_iteration" in p:
        text += f"; {p['seconds_per_iteration'] * 1e3:.2f}"
    return text


def fidelity_markdown(r: dict[str, Any]) -> str:
    """The simulation-fidelity part of the results as markdown (``<out>/fidelity.md``)."""
    s = r["settings"]
    fid = r["fidelity"]
    cal = fid["calibration"]
    push = cal.get("seconds_per_push", {})
    net = cal["network"]
    a, c = cal["profile_alone"], cal["profile_contended"]
    lines = [
        f"## Simulation fidelity ({s['fidelity_samples']} samples per run)",
        "",
        f"Load average (1, 5, 15 min) before: {r['load_before']}; after: {r['load_after']}; "
        f"{os.cpu_count()} cores. Command: `flock /tmp/distsgd-bench.lock python "
        "bench/dist_bench.py --skip-to-target"
        + (" --server-alone" if s.get("server_alone") else "")
        + "`.",
        "",
        "Calibration at the start (one thread per process, as in the dist runs; medians): "
        "device profile alone "
        f"{a['seconds_per_batch'] * 1e3:.2f} ms + {a['seconds_per_sample'] * 1e3:.3f} ms/sample; "
        "while another process computes the same model "
        f"{c['seconds_per_batch'] * 1e3:.2f} ms + {c['seconds_per_sample'] * 1e3:.3f} ms/sample "
        f"(×{cal['contention_factor_batch']:.2f} at batch {s['batch_size']}); a hardsync "
        "learner's work per iteration beyond its gradient (distsgd.runtime.dist."
        "calibrate_iteration, charged to the hardsync rows): "
        f"{a.get('seconds_per_iteration', math.nan) * 1e3:.2f} ms alone, "
        f"{c.get('seconds_per_iteration', math.nan) * 1e3:.2f} ms contended; network "
        "(gloo, 2 processes on loopback, median of 20, least-squares fit, "
        "distsgd.runtime.netcal): "
        f"messages: latency {net['latency_s'] * 1e6:.0f} µs, bandwidth "
        f"{net['bandwidth_gbps']:.2f} Gbit/s"
        + (
            f"; all-reduce (fitted apart): latency {net['allreduce_latency_s'] * 1e6:.0f} µs, "
            f"bandwidth {net['allreduce_bandwidth_gbps']:.2f} Gbit/s; "
            if net.get("allreduce_latency_s") is not None
            else "; "
        )
        + "parameter server's apply + copy per push (one thread, median of 200, "
        "distsgd.runtime.sim.calibrate_server): "
        + ", ".join(
            f"{float(v) * 1e3:.3f} ms at λ = {k}"
            for k, v in cal.get("apply_seconds_per_push", {}).items()
        )
        + _server_on_processes_text(cal.get("server_on_processes"))
        + _server_on_processes_text(
            cal.get("server_on_processes_contended"), " while 1 other process computes"
        )
        + _server_on_processes_text(
            cal.get("server_on_processes_contended_lambda_busy"),
            " while 2 other processes compute (not charged)",
        )
        + "; charged to the async rows as cluster.seconds_per_push: "
        + ", ".join(f"{float(v) * 1e3:.3f} ms at λ = {k}" for k, v in push.items())
        + (
            "; as cluster.seconds_per_push_contended (not stretched): "
            + ", ".join(
                f"{float(v) * 1e3:.3f} ms at λ = {k}"
                for k, v in cal.get("seconds_per_push_contended", {}).items()
            )
            if cal.get("seconds_per_push_contended")
            else ""
        )
        + ".",
        "",
        "| operation | float32 values | median ms |",
        "|---|---|---|",
    ]
    for m in net["measurements"]:
        lines.append(f"| {m['op']} | {m['num_values']} | {m['seconds'] * 1e3:.3f} |")
    lines += [
        "",
        "Each row's device profile is measured again just before its dist run (alone; "
        "for λ = 2 also while another process computes):",
        "",
        "| row | load average then | alone: ms + ms/sample; ms/iteration beyond the gradient "
        "| contended: the same |",
        "|---|---|---|---|",
        *(
            f"| {p['row']} | {p['load']} | {_fmt_profile(p['alone'])} | "
            f"{_fmt_profile(p['contended']) if 'contended' in p else '-'} |"
            for p in cal.get("profiles_per_row", [])
        ),
        "",
        "| protocol | λ | iterations | device profile | predicted s/iteration (sim) | "
        "measured s/iteration (dist) | measured / predicted | measured / predicted with "
        "the profile alone | measured / predicted with the server's time measured alone | "
        "measured / predicted with the server's contended time stretched again | "
        "measured / predicted with the server's time measured while λ processes compute | "
        "measured / predicted with the server's work free |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in fid["rows"]:
        lines.append(
            f"| {f['protocol']} | {f['num_learners']} | {f['iterations']} | {f['profile']} | "
            f"{f['predicted_s_per_iteration']:.4f} | {f['measured_s_per_iteration']:.4f} | "
            f"**{f['ratio_measured_over_predicted']:.2f}** | "
            f"{f['ratio_measured_over_predicted_alone']:.2f} | "
            f"{_ratio(f.get('ratio_measured_over_predicted_server_alone'))} | "
            f"{_ratio(f.get('ratio_measured_over_predicted_server_stretched_again'))} | "
            f"{_ratio(f.get('ratio_measured_over_predicted_server_lambda_busy'))} | "
            f"{f.get('ratio_measured_over_predicted_server_free', math.nan):.2f} |"
        )
    lines += ["", "Target: measured within ±20% of predicted (ratio 0.8–1.2).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
