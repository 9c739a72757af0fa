"""The simulated cluster against a real network: 2 hosts × 2 processes on the multi-host
test bed (:mod:`distsgd.testbed`), measured vs simulated seconds per iteration and
staleness, side by side in one run.

For each link setting (none, 5 ms + 1 Gbit/s, 20 ms + 100 Mbit/s one way, set on both
hosts' sends) and each protocol (hardsync λ = 4; async parameter server λ = 3 + 1 server;
compute groups λ = 3, g = 1 + 1 server), Fashion-MNIST ``mlp``, b = 32, one thread per
rank (``train.num_threads = 1``):

* **measured:** ``torchrun --nnodes 2 --nproc-per-node 2 -m distsgd train`` on hosts h0
  and h1 for ``--seconds`` wall seconds of training (``train.max_seconds``), no
  evaluation; seconds per iteration = training wall seconds / iterations (an
  asynchronous iteration is one update), staleness = the run's mean;
* **simulated:** the same config with ``runtime = "sim"`` for the same samples, ranks on
  hosts as torchrun places them (``cluster.processes_per_host = 2``), each host's cores
  (``cluster.cores``: the bed gives each host its share of this machine's CPUs), the
  device measured by ``distsgd calibrate`` on host h0 (``cluster.profile``), the local
  terms by ``python -m distsgd.runtime.netcal`` on h0 (two processes), the link by
  ``python -m distsgd.runtime.netcal --rank 0|1`` across h0 and h1 at each setting
  (:func:`distsgd.runtime.netcal.measure_link`), ``cluster.jitter = 0``.

The table gives both, their ratio measured / simulated (target 0.8–1.25) and the
simulated time's terms per iteration (compute, messages or all-reduce, server), so a
miss shows where the time goes; the parameter-server rows are simulated again with the
server's time per push measured on processes (:func:`server_on_processes`) in
place of ``distsgd calibrate``'s apply + copy. Run it alone on the machine's lock::

    flock /tmp/distsgd-bench.lock python bench/multihost.py --out bench/results/multihost.md

Needs root (network namespaces); prints why not otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LINKS = {"none": (0.0, 0.0), "5ms+1Gbit": (5.0, 1000.0), "20ms+100Mbit": (20.0, 100.0)}
PROTOCOLS = {
    "hardsync": {"name": "hardsync", "num_learners": 4},
    "async PS": {"name": "parameter_server", "mode": "async", "num_learners": 3},
    "compute groups": {"name": "compute_groups", "num_learners": 3, "num_groups": 1},
}
PROCESSES_PER_HOST = 2


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split(" ")[:3])


def base_config(protocol: dict[str, Any], seconds: float, seed: int) -> dict[str, Any]:
    return {
        "model": {"name": "mlp"},
        "protocol": {**protocol, "batch_size": 32},
        # small steps: asynchronous learners with staleness ~2 diverge at 0.05 + momentum
        "optimizer": {"lr": 0.01, "momentum": 0.5},
        "train": {
            "num_threads": 1,
            "evaluate": False,
            "max_epochs": 0,
            "max_seconds": seconds,
            "tensorboard": False,
            "checkpoint_every_evals": 0,
            "seed": seed,
        },
        "dist": {"timeout_s": 60},
    }


def write_config(raw: dict[str, Any], path: Path) -> Path:
    from distsgd.config import RunConfig

    path.write_text(RunConfig.from_dict(raw).to_toml())
    return path


def run_on_host(bed: Any, host: int, argv: list[str], timeout: float) -> str:
    """``argv`` on ``host`` to its end; its output (RuntimeError when it fails)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = bed.run(host, argv, cwd=ROOT, env=env, capture_output=True, text=True,
                   timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} on h{host}: {done.stdout}{done.stderr}")
    return done.stdout


def network_table(path: Path) -> dict[str, float]:
    return tomllib.loads(path.read_text())["cluster"]


def measure_link(bed: Any, num_parameters: int, tmp: Path, repeats: int) -> dict[str, float]:
    """The link's fit: netcal's rank 0 on h0, rank 1 on h1."""
    out = tmp / "link.toml"
    argv = [sys.executable, "-m", "distsgd.runtime.netcal", str(num_parameters),
            "--master-addr", bed.addresses[0], "--repeats", str(repeats)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        bed.popen(
            r,
            [*argv, "--rank", str(r), *(["--out", str(out)] if r == 0 else [])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"link measurement failed: {outputs}")
    return network_table(out)


def torchrun(
    bed: Any,
    cfg: Path,
    out: Path,
    port: int,
    timeout: float,
    num_hosts: int | None = None,
    processes_per_host: int = PROCESSES_PER_HOST,
) -> dict[str, Any]:
    """``distsgd train cfg`` by torchrun on the first ``num_hosts`` hosts (default every
    host; rendezvous at h0), ``processes_per_host`` ranks each; rank 0's summary."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"):  # fmt: skip
        env.pop(k, None)
    procs = []
    n = num_hosts or bed.num_hosts
    for i in range(n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
               "--node-rank", str(i), "--nproc-per-node", str(processes_per_host),
               "--master-addr", "h0", "--master-port", str(port),
               "-m", "distsgd", "train", str(cfg), "--out", str(out), "--quiet"]  # fmt: skip
        procs.append(bed.popen(i, cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))  # fmt: skip
    end, outputs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n<killed by the bench>")
    if any(p.returncode for p in procs) or not (out / "summary.json").exists():
        raise RuntimeError("dist run failed:\n" + "\n".join(o[-2000:] for o in outputs))
    return json.loads((out / "summary.json").read_text())


def simulate(raw: dict[str, Any], samples: int, cluster: dict[str, Any], out: Path):
    """The simulated run of ``raw`` for ``samples`` samples; (summary, time terms)."""
    import distsgd
    from distsgd.api import resolve_config

    sim = json.loads(json.dumps(raw))
    sim["runtime"] = "sim"
    sim["train"].update(max_seconds=0, max_samples=samples)
    sim["cluster"] = cluster
    summary = distsgd.train(resolve_config(sim), out_dir=out)
    return summary, terms(resolve_config(sim), summary)


def terms(cfg: Any, summary: dict[str, Any]) -> dict[str, float]:
    """The simulated cycle's terms, seconds: one learner's compute, one message between
    a worker and the server (local, link), the ring all-reduce over the run's devices or
    a compute group (link), a compute group leader's broadcast of the weights to its
    members (link), the server's work."""
    from distsgd.runtime import cluster_model as cm
    from distsgd.runtime.profiles import read_profile

    c, p = cfg.cluster, cfg.protocol
    prof = read_profile(Path(c.profile))
    model = cm.ClusterModel(
        prof.seconds_per_batch,
        prof.seconds_per_sample,
        latency_s=c.latency_s,
        bandwidth_gbps=c.bandwidth_gbps,
        num_parameters=summary["num_parameters"],
        allreduce_latency_s=c.allreduce_network[0],
        allreduce_bandwidth_gbps=c.allreduce_network[1],
    )
    local = cm.ClusterModel(0, 0, c.local_latency_s, c.local_bandwidth_gbps,
                            summary["num_parameters"])  # fmt: skip
    synchronous = p.name == "hardsync"
    group = p.num_learners if synchronous else p.num_learners // max(1, p.num_groups)
    if p.name == "parameter_server":
        group = 1
    return {
        "compute": cm.compute_seconds(p.batch_size, model),
        "per_iteration": (prof.seconds_per_iteration or 0.0) if synchronous else 0.0,
        "message_local": local.message_seconds,
        "message_link": model.message_seconds,
        "allreduce_link": cm.allreduce_seconds(group, model),
        "broadcast_link": (
            cm.broadcast_seconds(group, model) if p.name == "compute_groups" else 0.0
        ),
        "server": 0.0 if synchronous else (prof.seconds_per_push or 0.0),
    }


def server_on_processes(
    bed: Any, raw: dict[str, Any], cluster: dict[str, Any], tmp: Path, port: int
) -> dict[str, float]:
    """The server's time per push on real processes: async, one learner, server and
    learner on h0 (2 processes, no link), as the run reports it (``summary.json``'s
    ``server_seconds_per_push``: its loop's wall seconds per push, from taking the push
    to being ready for the next: apply, start of the reply, hand-over to the training
    loop). This holds what ``distsgd calibrate``'s apply + copy leaves out. Also: the
    run's seconds per push, and what the simulator charges for it without server work
    (the learner's compute and two local messages; ``cluster.cores = 0``)."""
    one = json.loads(json.dumps(raw))
    one["protocol"] = {"name": "parameter_server", "mode": "async", "num_learners": 1,
                       "batch_size": raw["protocol"]["batch_size"]}  # fmt: skip
    cfg = write_config({**one, "runtime": "dist"}, tmp / "server.toml")
    real = torchrun(bed, cfg, tmp / "server-dist", port, timeout=600, num_hosts=1)
    free = {**cluster, "cores": 0, "seconds_per_push": 0.0}
    sim, _ = simulate(one, real["samples"], free, tmp / "server-sim")
    measured = real["train_wall_s"] / real["iterations"]
    without = sim["virtual_s"] / sim["iterations"]
    return {"measured_s": measured, "simulated_without_server_s": without,
            "seconds_per_push": real["server_seconds_per_push"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--seconds", type=float, default=12.0, help="training seconds per run")
    ap.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=list(PROTOCOLS))
    ap.add_argument("--repeats", type=int, default=10, help="netcal repeats per size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from distsgd import testbed

    if why := testbed.unavailable():
        print(f"bench/multihost.py: no multi-host bed here: {why}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [load()]
    rows, nets = [], {}
    with tempfile.TemporaryDirectory(prefix="distsgd-multihost-") as t, \
            testbed.Bed(2, max_seconds=3600) as bed:  # fmt: skip
        tmp = Path(t)
        cores = len(bed.cpus[0])
        first = base_config(PROTOCOLS["async PS"], args.seconds, args.seed)
        profile = tmp / "profile.toml"
        run_on_host(bed, 0, [sys.executable, "-m", "distsgd", "calibrate",
                             str(write_config(first, tmp / "calibrate.toml")),
                             "--out", str(profile)], timeout=900)  # fmt: skip
        from distsgd.runtime.profiles import read_profile

        prof = read_profile(profile)
        p_values = prof.key.num_parameters
        local_file = tmp / "local.toml"
        run_on_host(bed, 0, [sys.executable, "-m", "distsgd.runtime.netcal", str(p_values),
                             "--repeats", str(args.repeats), "--out", str(local_file)],
                    timeout=600)  # fmt: skip
        local = network_table(local_file)
        nets["local (h0, 2 processes)"] = local
        print(f"profile {prof.seconds_per_batch * 1e3:.3f} ms + {prof.seconds_per_sample * 1e6:.1f}"
              f" µs/sample, push {(prof.seconds_per_push or 0) * 1e3:.3f} ms; local {local}",
              flush=True)  # fmt: skip
        port = 29500
        base_cluster = {"profile": str(profile), "jitter": 0.0, "cores": cores,
                        "processes_per_host": PROCESSES_PER_HOST, **local}  # fmt: skip
        server = server_on_processes(bed, first, base_cluster, tmp, port)
        print(f"server on processes: {server}", flush=True)
        for name in args.links:
            delay, rate = LINKS[name]
            for h in range(bed.num_hosts):
                bed.set_link(h, delay_ms=delay, rate_mbit=rate)
            link = measure_link(bed, p_values, tmp, args.repeats)
            nets[name] = link
            print(f"link {name}: {link}", flush=True)
            for proto in args.protocols:
                raw = base_config(PROTOCOLS[proto], args.seconds, args.seed)
                cfg = write_config({**raw, "runtime": "dist"}, tmp / f"{name}-{proto}.toml")
                port += 1
                try:
                    real = torchrun(bed, cfg, tmp / f"dist-{port}", port, timeout=600)
                except RuntimeError as e:  # the row is reported as failed; the others run
                    print(str(e)[-3000:], file=sys.stderr, flush=True)
                    rows.append({"link": name, "protocol": proto, "failed": True})
                    continue
                cluster = {**base_cluster, **link}
                sim, parts = simulate(raw, real["samples"], cluster, tmp / f"sim-{port}")
                served = {**cluster, "seconds_per_push": server["seconds_per_push"]}
                sim2 = sim
                if proto != "hardsync":
                    sim2, _ = simulate(raw, real["samples"], served, tmp / f"sim2-{port}")
                row = {
                    "link": name,
                    "protocol": proto,
                    "iterations": real["iterations"],
                    "sim_iterations": sim["iterations"],
                    "measured_s": real["train_wall_s"] / real["iterations"],
                    "simulated_s": sim["virtual_s"] / sim["iterations"],
                    "measured_staleness": real["staleness_mean"],
                    "simulated_staleness": sim["staleness_mean"],
                    "load": load(),
                    "terms": parts,
                }
                row["ratio"] = row["measured_s"] / row["simulated_s"]
                row["simulated_server_s"] = sim2["virtual_s"] / sim2["iterations"]
                row["ratio_server"] = row["measured_s"] / row["simulated_server_s"]
                rows.append(row)
                loads.append(row["load"])
                print(json.dumps(row), flush=True)
    text = markdown(rows, nets, prof, cores, started, loads, server)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _st(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def markdown(rows, nets, prof, cores, started, loads, server) -> str:
    cmd = "flock /tmp/distsgd-bench.lock python bench/multihost.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    out = [
        "# The simulated cluster against two hosts",
        "",
        f"`{cmd}` ({started}; `bench/multihost.py` explains the method). 2 hosts × 2",
        f"processes on the test bed, {cores} CPU(s) per host; load average (1, 5, 15 min)",
        f"at the start and after each row: {'; '.join(loads)}.",
        "",
        f"Device (`distsgd calibrate` on h0, one thread): {prof.seconds_per_batch * 1e3:.3f} ms"
        f" + {prof.seconds_per_sample * 1e6:.1f} µs/sample (spread {prof.spread:.0%}), "
        f"{(prof.seconds_per_iteration or 0) * 1e3:.2f} ms/iteration beyond the gradient, "
        f"server {(prof.seconds_per_push or 0) * 1e3:.3f} ms/push.",
        "",
        "The server's time per push on processes (async, 1 learner, both on h0; the "
        "run's `server_seconds_per_push`): "
        f"{server['seconds_per_push'] * 1e3:.2f} ms (that run: "
        f"{server['measured_s'] * 1e3:.2f} ms per push, "
        f"{server['simulated_without_server_s'] * 1e3:.2f} ms simulated without server "
        "work); the last columns charge it as `cluster.seconds_per_push` in place of the "
        "apply + copy.",
        "",
        "| network (netcal fit) | latency | bandwidth | all-reduce latency | all-reduce bandwidth |",
        "|---|---|---|---|---|",
    ]
    for name, n in nets.items():
        lat = n.get("latency_s", n.get("local_latency_s"))
        bw = n.get("bandwidth_gbps", n.get("local_bandwidth_gbps"))
        ar_lat, ar_bw = n.get("allreduce_latency_s"), n.get("allreduce_bandwidth_gbps")
        out.append(f"| {name} | {lat * 1e3:.3f} ms | {bw:.3f} Gbit/s | "
                   f"{'–' if ar_lat is None else f'{ar_lat * 1e3:.3f} ms'} | "
                   f"{'–' if ar_bw is None else f'{ar_bw:.3f} Gbit/s'} |")  # fmt: skip
    out += [
        "",
        "| link | protocol | iterations | measured s/it | simulated s/it | measured / "
        "simulated | staleness measured | simulated | terms (ms): compute, message local / "
        "link, all-reduce link, broadcast link, server | simulated s/it, server on "
        "processes | measured / simulated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("failed"):
            out.append(f"| {r['link']} | {r['protocol']} | failed (see the log) |||||||||")
            continue
        t = r["terms"]
        parts = (f"{_ms(t['compute'])}, {_ms(t['message_local'])} / {_ms(t['message_link'])}, "
                 f"{_ms(t['allreduce_link'])}, {_ms(t.get('broadcast_link', 0.0))}, "
                 f"{_ms(t['server'])}")  # fmt: skip
        ok = "" if 0.8 <= r["ratio"] <= 1.25 else " ✗"
        ok2 = "" if 0.8 <= r["ratio_server"] <= 1.25 else " ✗"
        out.append(
            f"| {r['link']} | {r['protocol']} | {r['iterations']} | {_ms(r['measured_s'])} ms "
            f"| {_ms(r['simulated_s'])} ms | {r['ratio']:.2f}{ok} | "
            f"{_st(r['measured_staleness'])} | {_st(r['simulated_staleness'])} | {parts} | "
            f"{_ms(r['simulated_server_s'])} ms | {r['ratio_server']:.2f}{ok2} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
