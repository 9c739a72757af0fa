"""The pytest side of :mod:`distsgd.testbed`: a ``bed`` fixture (two hosts) and helpers that
start ``torchrun`` on the bed's hosts with no environment variable set by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distsgd import testbed

ROOT = Path(__file__).resolve().parents[1]
PORT = 29500  # free by construction: each bed host is a fresh network namespace


def make_bed(num_hosts: int, **kwargs) -> testbed.Bed:
    """A started bed, or the test skipped with the reason no bed can be made here."""
    if why := testbed.unavailable():
        pytest.skip(f"no multi-host bed here: {why}")
    bed = testbed.Bed(num_hosts, max_seconds=600, **kwargs)
    bed.start()
    return bed


@pytest.fixture
def bed():
    """Two hosts, ``h0`` (10.213.0.1) and ``h1``; removed whatever the test does."""
    b = make_bed(2)
    try:
        yield b
    finally:
        b.close()


_EXIT_BARRIER = "Error waiting on exit barrier"


def before_exit_barrier(text: str) -> str:
    """A torchrun node's output up to its agent's exit barrier. The agent that hosts
    torchrun's store may leave the barrier and close the store while another node's agent
    still waits in it: that agent then logs a C++ and a Python traceback after every
    worker has ended with status 0 (torch's own race, pytorch/pytorch#69520), which is
    not the run's output."""
    if _EXIT_BARRIER not in text:
        return text
    cut = text.index(_EXIT_BARRIER)
    store_error = text.rfind("recvValueWithTimeout failed", 0, cut)
    return text[: text.rfind("\n", 0, store_error if store_error >= 0 else cut) + 1]


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher or gloo variable (a user's shell)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"):  # fmt: skip
        env.pop(k, None)
    return env


def torchrun(
    bed: testbed.Bed,
    script: list[str],
    *,
    nproc: int = 1,
    master: str = "h0",
    env: dict[str, str] | None = None,
    nnodes: int | None = None,
) -> list[subprocess.Popen]:
    """``torchrun --nnodes N --node-rank i`` of ``script`` on every host i of ``bed``,
    rendezvous at ``master`` (a host name, as a user types it); stdout+stderr piped."""
    n = nnodes or bed.num_hosts
    procs = []
    for i in range(bed.num_hosts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n)]
        cmd += ["--node-rank", str(i), "--nproc-per-node", str(nproc)]
        cmd += ["--master-addr", master, "--master-port", str(PORT), *script]
        procs.append(
            bed.popen(
                i,
                cmd,
                cwd=ROOT,
                env=env or clean_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs
