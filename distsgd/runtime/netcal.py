"""Network calibration: the latency and bandwidth of c10d (gloo) between two processes here.

The simulated cluster charges a message of P float32 values
``latency_s + 32 P / (bandwidth_gbps · 1e9)`` seconds and a ring all-reduce over m
participants ``2(m−1) · latency_s + 2(m−1)/m · 32 P / (bandwidth_gbps · 1e9)`` (see
:mod:`distsgd.runtime.sim`; the ring all-reduce cost is Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009, §3).
:func:`calibrate_network` measures both operations on real processes and fits those two
parameters, so that the simulator predicts what the ``dist`` runtime measures on this
machine (or on a network, if the two ranks are started there).

Measurement: two ranks started by torch's launch machinery
(:func:`torch.distributed.elastic.multiprocessing.start_processes`) rendezvous on
loopback (a store listening on ``master_addr`` only,
:func:`distsgd.launch.rendezvous_store`) and join a gloo process group, one torch
thread each. For each message size
(default: 1 value and P/16, P/4, P values of float32) after one warm-up:

* point-to-point: ``repeats`` ping-pongs (rank 0 sends, rank 1 receives and sends back);
  one message is half the round trip;
* all-reduce (sum) of the same buffer by both ranks, after a barrier and ``compute_s``
  (10 ms) of matrix products on each rank: a synchronous iteration's all-reduce follows
  its gradient's computation, and after it an all-reduce takes longer than back to back
  (gloo's threads and the caches are cold, as in a training loop); each
  repeat counts the rank that arrived last (the shorter of the two times: the earlier
  rank's also holds its wait for the other), the figure is their median.

Rank 0 takes the median of the repeats (a run's mean iteration time includes the
ordinary disturbances that the minimum would hide). Model fit: every measurement t of
a buffer of B = 32 P bits gives one row of a linear least-squares problem in
``(latency_s, 1 / bandwidth)``: a message ``t = latency_s + B / bw``, an all-reduce over
m = 2 ``t = 2 latency_s + B / bw``. The messages and the all-reduces are fitted apart
(``cluster.allreduce_latency_s`` / ``allreduce_bandwidth_gbps``): gloo's all-reduce
reduces and copies as it goes, so per byte it costs several sends, which one shared
bandwidth cannot fit (docs/benchmarks.md). Negative solutions are clipped (latency to 0, bandwidth to infinity,
i.e. ``bandwidth_gbps = 0``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from distsgd.runtime.rendezvous import rendezvous_store

__all__ = ["NetworkProfile", "calibrate_network", "default_sizes", "fit_network", "measure_link"]


@dataclass
class NetworkProfile:
    """A fitted network: the simulator's ``cluster.latency_s`` and ``bandwidth_gbps`` (the
    messages') and ``cluster.allreduce_latency_s`` / ``allreduce_bandwidth_gbps``.

    Attributes:
        latency_s: one-way message latency, seconds (>= 0).
        bandwidth_gbps: bandwidth in gigabits per second (0: infinite).
        allreduce_latency_s: the all-reduce's latency term, seconds (None: ``latency_s``).
        allreduce_bandwidth_gbps: the all-reduce's bandwidth, Gbit/s, 0 infinite (None:
            ``bandwidth_gbps``).
        measurements: what was fitted: ``{"op": "send" | "all_reduce", "participants":
            m, "num_values": P, "seconds": t}`` per operation and size (median seconds).
    """

    latency_s: float
    bandwidth_gbps: float
    measurements: list[dict[str, Any]] = field(default_factory=list)
    allreduce_latency_s: float | None = None
    allreduce_bandwidth_gbps: float | None = None

    def overrides(self) -> list[str]:
        """``--set`` items that give the simulator this network."""
        out = [
            f"cluster.latency_s={self.latency_s!r}",
            f"cluster.bandwidth_gbps={self.bandwidth_gbps!r}",
        ]
        if self.allreduce_latency_s is not None:
            out.append(f"cluster.allreduce_latency_s={self.allreduce_latency_s!r}")
        if self.allreduce_bandwidth_gbps is not None:
            out.append(f"cluster.allreduce_bandwidth_gbps={self.allreduce_bandwidth_gbps!r}")
        return out


def _row(m: dict[str, Any]) -> list[float]:
    """The model's coefficients of ``(latency, 1 / bandwidth)`` for one measurement."""
    bits = 32.0 * m["num_values"]
    if m["op"] == "send":
        return [1.0, bits]
    if m["op"] == "all_reduce":
        k = m["participants"]
        return [2.0 * (k - 1), 2.0 * (k - 1) / k * bits]
    raise ValueError(f"unknown op {m['op']!r}: expected 'send' or 'all_reduce'")


def _least_squares(measurements: list[dict[str, Any]]) -> tuple[float, float]:
    """(latency seconds, bandwidth Gbit/s, 0 infinite) minimising the squared error."""
    a = torch.tensor([_row(m) for m in measurements], dtype=torch.float64)
    ts = torch.tensor([[m["seconds"]] for m in measurements], dtype=torch.float64)
    scale = a.abs().amax(0)  # columns of very different magnitude: scale for lstsq
    sol = torch.linalg.lstsq(a / scale, ts).solution
    latency, inv_bw = (sol[:, 0] / scale).tolist()
    if latency < 0:  # refit the bandwidth alone
        latency = 0.0
        inv_bw = float(torch.linalg.lstsq(a[:, 1:], ts).solution)
    return latency, 0.0 if inv_bw <= 0 else 1.0 / inv_bw / 1e9


def fit_network(measurements: list[dict[str, Any]]) -> NetworkProfile:
    """Least-squares fit of the simulator's network model to measured operation times.

    Messages and all-reduces are fitted apart when each has at least two sizes (gloo's
    all-reduce reduces and copies as it goes: per byte it is not a send); otherwise one
    fit of both gives the messages' parameters and the all-reduce's stay None.

    Args:
        measurements: ``{"op", "participants", "num_values", "seconds"}`` items; ``op``
            is ``send`` (one message) or ``all_reduce`` (ring over ``participants``).

    Returns:
        The profile minimising the squared error of the model's seconds (module docstring).

    Raises:
        ValueError: fewer than two measurements, or an unknown ``op``.
    """
    if len(measurements) < 2:
        raise ValueError("fit_network needs at least two measurements")
    for m in measurements:
        _row(m)  # an unknown op raises
    sends = [m for m in measurements if m["op"] == "send"]
    reduces = [m for m in measurements if m["op"] == "all_reduce"]
    if len(sends) >= 2 and len(reduces) >= 2:
        latency, bandwidth = _least_squares(sends)
        ar_latency, ar_bandwidth = _least_squares(reduces)
        return NetworkProfile(latency, bandwidth, list(measurements), ar_latency, ar_bandwidth)
    latency, bandwidth = _least_squares(measurements)
    return NetworkProfile(latency, bandwidth, list(measurements))


def _compute(seconds: float, a: torch.Tensor) -> None:
    """Matrix products for ``seconds`` (a stand-in for a gradient's computation)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def _worker(
    sizes: list[int], repeats: int, timeout_s: float, compute_s: float
) -> list[dict[str, Any]]:
    """One of the two ranks: time ping-pongs and all-reduces; rank 0 returns medians
    (an all-reduce's: of the later-arriving rank's time in each repeat)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return _measure(sizes, repeats, compute_s)


def _measure(sizes: list[int], repeats: int, compute_s: float) -> list[dict[str, Any]]:
    """The timings of :func:`_worker` in a process group of two ranks already made;
    destroys the group at the end."""
    rank = dist.get_rank()
    other = 1 - rank
    # products of 512 × 512 floats (3 MB in use, as a small model's gradient): the
    # all-reduce then finds the caches cold, as after a gradient (after 128 × 128
    # products, 200 KB, the caches stay warm and it looks faster than in training)
    a = torch.randn(512, 512)
    out: list[dict[str, Any]] = []
    try:
        for p in sizes:
            buf = torch.zeros(p)
            pp, ar = [], []
            for i in range(repeats + 1):  # the first is a warm-up
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, other)
                    dist.recv(buf, other)
                else:
                    dist.recv(buf, other)
                    dist.send(buf, other)
                if i:
                    pp.append((time.perf_counter() - t0) / 2)
            for i in range(repeats + 1):
                dist.barrier()
                _compute(compute_s, a)  # as a synchronous iteration's gradient
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                if i:
                    ar.append(time.perf_counter() - t0)
            both: list[list[float] | None] = [None, None]
            dist.all_gather_object(both, ar)
            # each repeat: the rank that arrived last (the shorter time), whose wait is the
            # all-reduce alone; the earlier one's also holds the other's late arrival
            later = [min(x, y) for x, y in zip(both[0] or [], both[1] or [], strict=True)]
            for op, seconds in (
                ("send", statistics.median(pp)),
                ("all_reduce", statistics.median(later)),
            ):
                out.append({"op": op, "participants": 2, "num_values": p, "seconds": seconds})
    finally:
        dist.destroy_process_group()
    return out if rank == 0 else []


def calibrate_network(
    num_parameters: int,
    *,
    sizes: list[int] | None = None,
    repeats: int = 20,
    master_addr: str = "127.0.0.1",
    timeout_s: float = 60.0,
    compute_s: float = 0.01,
) -> NetworkProfile:
    """Measure gloo between two processes on this machine and fit the network model.

    Args:
        num_parameters: P, float32 values of the model's flattened parameters (the size
            of a gradient message).
        sizes: message sizes in float32 values; default ``[1, P//16, P//4, P]``.
        repeats: timed repeats per operation and size (after one warm-up).
        master_addr: rendezvous address (loopback by default).
        timeout_s: c10d timeout of the two ranks, seconds.
        compute_s: seconds of computation (matrix products) on each rank before every
            timed all-reduce, as a synchronous iteration's all-reduce follows its
            gradient (module docstring); 0: back to back.

    Returns:
        The fitted :class:`NetworkProfile` with its measurements.

    Raises:
        RuntimeError: a rank failed (its error is in the message).
        ConfigError: ``master_addr`` is no address of this machine.
    """
    if sizes is None:
        sizes = default_sizes(num_parameters)
    # hosted here, as torchrun's agent hosts it, listening on master_addr only (launch.py)
    store = rendezvous_store(master_addr, 0, world_size=2, timeout_s=timeout_s)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="distsgd-netcal-") as tmp:
        envs = {
            r: {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(store.port),
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "PYTHONPATH": pythonpath,
                "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
            for r in range(2)
        }
        ctx = start_processes(
            name="distsgd-netcal",
            entrypoint=_worker,
            args={r: (sizes, repeats, timeout_s, compute_s) for r in range(2)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=tmp),
            start_method="spawn",
        )
        try:
            result = ctx.wait()
        finally:
            ctx.close()
        if result is None or result.is_failed():
            failures = {} if result is None else result.failures
            raise RuntimeError(f"network calibration failed: {failures}")
        measurements = result.return_values[0]
    del store
    return fit_network(measurements)


def default_sizes(num_parameters: int) -> list[int]:
    """Message sizes timed by default: 1 value and P/16, P/4, P values of float32."""
    sizes = sorted({1, max(1, num_parameters // 16), max(1, num_parameters // 4)})
    return sorted({*sizes, num_parameters})


def measure_link(
    rank: int,
    master_addr: str,
    num_parameters: int,
    *,
    port: int = 29400,
    sizes: list[int] | None = None,
    repeats: int = 20,
    timeout_s: float = 60.0,
    compute_s: float = 0.01,
) -> NetworkProfile | None:
    """Measure the link between two hosts: run this with ``rank`` 0 on the host whose
    address is ``master_addr`` and with ``rank`` 1 on the other (one process each, one
    torch thread); the same operations and fit as :func:`calibrate_network`.

    Rank 0 hosts the rendezvous store on ``master_addr:port`` only; gloo's interface is
    the one that routes to ``master_addr`` (:func:`distsgd.runtime.network.prepare_rank`).

    Returns:
        Rank 0: the fitted :class:`NetworkProfile` (``cluster.latency_s``,
        ``bandwidth_gbps``, ``allreduce_*`` of the simulated cluster's link); rank 1: None.

    Raises:
        ValueError: ``rank`` not 0 or 1.
        ConfigError: ``master_addr`` unreachable, or not an address of rank 0's host.
        RuntimeError: from gloo, when the other rank does not join within ``timeout_s``.
    """
    from distsgd.runtime.network import prepare_rank

    if rank not in (0, 1):
        raise ValueError(f"rank = {rank!r} is not allowed: expected 0 or 1")
    os.environ.update(MASTER_ADDR=master_addr, WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    prepare_rank(1, log=False)
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = rendezvous_store(master_addr, port, world_size=2, timeout_s=timeout_s)
    else:
        store = dist.TCPStore(master_addr, port, world_size=2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    found = _measure(sizes or default_sizes(num_parameters), repeats, compute_s)
    return fit_network(found) if rank == 0 else None


def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual use
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m distsgd.runtime.netcal",
        description="Fit the simulated cluster's network: two processes on this machine "
        "(the local terms), or with --rank one process on each of two hosts (the link).",
    )
    ap.add_argument("num_parameters", nargs="?", type=int, default=431_080, metavar="P")
    ap.add_argument("--rank", type=int, default=None, help="0 or 1: measure a link")
    ap.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address")
    ap.add_argument("--port", type=int, default=29400)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the fit as a [cluster] TOML table")
    a = ap.parse_args(argv)
    if a.rank is None:
        prof = calibrate_network(a.num_parameters, repeats=a.repeats, master_addr=a.master_addr)
    else:
        found = measure_link(
            a.rank, a.master_addr, a.num_parameters, port=a.port, repeats=a.repeats
        )
        if found is None:
            return
        prof = found
    _print(prof)
    if a.out:
        keys = [o.replace("cluster.", "", 1).replace("=", " = ", 1) for o in prof.overrides()]
        if a.rank is None:  # two processes on one machine: a host's local terms
            keys = [f"local_{k}" for k in keys[:2]]
        with open(a.out, "w") as f:
            f.write("[cluster]\n" + "\n".join(keys) + "\n")


def _print(prof: NetworkProfile) -> None:  # pragma: no cover - manual use
    for m in prof.measurements:
        print(f"{m['op']:10s} {m['num_values']:>9d} values {m['seconds'] * 1e3:8.3f} ms")
    print(f"latency {prof.latency_s * 1e6:.1f} µs, bandwidth {prof.bandwidth_gbps:.3f} Gbit/s")
    if prof.allreduce_latency_s is None or prof.allreduce_bandwidth_gbps is None:
        print("all-reduce: as the messages (not fitted apart)")
    else:
        print(
            f"all-reduce: latency {prof.allreduce_latency_s * 1e6:.1f} µs, bandwidth "
            f"{prof.allreduce_bandwidth_gbps:.3f} Gbit/s"
        )


if __name__ == "__main__":  # pragma: no cover - python -m distsgd.runtime.netcal --help
    _main()
