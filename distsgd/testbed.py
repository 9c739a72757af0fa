"""Several "hosts" on one Linux machine, for multi-host tests, benches and trials.

Each host is a network namespace with one interface, ``eth0`` (a TAP device, MTU
65000), address ``10.213.0.<i+1>/24``, host name ``h<i>`` (resolving to 127.0.1.1 on
itself, as on Debian, and to its address on the others; no DNS server) and its own share
of the machine's CPUs (:func:`split_cpus`, set with ``taskset``). A user-space switch (one
process, :func:`relay`) joins the hosts' interfaces: it learns MAC addresses like a
bridge and applies, per host, to the frames that host sends, a one-way delay, a rate
limit (serialisation at ``rate_mbit``, a 4 MiB queue, tail drop) and a loss probability;
a partitioned host's frames are dropped both ways. A user-space switch because this
kernel has no ``netem`` and no iptables; it touches no interface, address or route of
the machine's own namespace, so the bed's traffic cannot leave its namespaces.

Use from Python::

    with Bed(2, links={1: Link(delay_ms=20, rate_mbit=100)}) as bed:
        p = bed.popen(1, ["python", "-m", "distsgd", ...])
        bed.set_link(1, partitioned=True)

or from a shell (the bed lives while the command runs; ``NETBED_NS<i>``,
``NETBED_ADDR<i>`` and ``NETBED_EXEC<i>`` name each host)::

    python distsgd/testbed.py --hosts 2 --delay-ms 20 --rate-mbit 100 -- \\
        sh -c '$NETBED_EXEC1 hostname'

(``python -m distsgd.testbed`` works too, after importing distsgd and torch).

Needs root and ``ip`` (iproute2); :func:`unavailable` says why a bed cannot be made.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import fcntl
import heapq
import itertools
import json
import os
import random
import secrets
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

__all__ = ["Bed", "Link", "unavailable"]

PREFIX = "dsgdbed-"
SUBNET = "10.213.0"  # exists inside the bed's namespaces only
MTU = 65000
QUEUE_BYTES = 4 << 20  # a host's send queue under a rate limit; tail drop beyond it
_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Link:
    """What a host's link does to the frames the host sends.

    Attributes:
        delay_ms: one-way delay added to every frame the host sends, milliseconds.
        rate_mbit: the host's send rate, Mbit/s (0: unlimited).
        loss: probability that a frame the host sends is dropped, in [0, 1).
        partitioned: drop every frame to and from the host.
    """

    delay_ms: float = 0.0
    rate_mbit: float = 0.0
    loss: float = 0.0
    partitioned: bool = False

    def __post_init__(self) -> None:
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms = {self.delay_ms!r} is not allowed: expected >= 0")
        if not self.rate_mbit >= 0:
            raise ValueError(f"rate_mbit = {self.rate_mbit!r} is not allowed: expected >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss = {self.loss!r} is not allowed: expected in [0, 1)")


def unavailable() -> str | None:
    """Why no bed can be made here (a line), or None when one can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the bed needs `ip` (iproute2) and `unshare` (util-linux)"
    if not os.path.exists("/dev/net/tun"):
        return "the bed needs /dev/net/tun"
    name = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Bed:
    """``num_hosts`` network namespaces joined by a user-space switch (see the module).

    Names are unique per bed (owner pid and a random token); :meth:`close` (also at exit,
    and on leaving the ``with`` block) kills what runs in the namespaces and deletes them;
    the switch ends with its owner. A bed left by a killed owner is removed by the next
    bed made on the machine.

    Args:
        num_hosts: hosts, 1 to 200.
        links: a :class:`Link` per host index (others: a plain link).
        max_seconds: the switch ends by itself after this many seconds.

    Raises:
        ValueError: ``num_hosts`` out of range, a host index out of range.
        RuntimeError: the namespaces or the switch could not be made.
    """

    def __init__(
        self, num_hosts: int, links: dict[int, Link] | None = None, *, max_seconds: float = 1800
    ) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts = {num_hosts!r} is not allowed: expected 1 to 200")
        self.num_hosts = num_hosts
        self.links = [Link()] * num_hosts
        for host, link in (links or {}).items():
            self.links[self._check(host)] = link
        token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.namespaces = [f"{PREFIX}{token}-h{i}" for i in range(num_hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(num_hosts)]
        self.hostnames = [f"h{i}" for i in range(num_hosts)]
        self.max_seconds = max_seconds
        self.cpus = split_cpus(num_hosts)
        self._dir = tempfile.mkdtemp(prefix=f"{PREFIX}{token}-")
        self._relay: subprocess.Popen[str] | None = None
        self._closed = False

    def _check(self, host: int) -> int:
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host = {host!r} is not allowed: expected 0 to {self.num_hosts - 1}")
        return host

    def __enter__(self) -> Bed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the namespaces and start the switch (RuntimeError where it fails)."""
        sweep_stale()
        atexit.register(self.close)
        try:
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(self._hosts_file(i))
                with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
                    f.write("nameserver 127.0.0.1\n")  # refused at once: no DNS in the bed
                with open(self.exec_script(i), "w") as f:
                    f.write("#!/bin/sh\nexec " + shlex.join(self.command(i, [])) + ' "$@"\n')
                os.chmod(self.exec_script(i), 0o755)
            # the file itself, not -m: the switch needs no torch, only this module
            argv = [sys.executable, os.path.abspath(__file__), "relay", "--max-seconds"]
            argv += [str(self.max_seconds), *self.namespaces]
            self._relay = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
            self._expect_ok()
            for i, ns in enumerate(self.namespaces):
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up")
                self.set_link(i, **asdict(self.links[i]))
        except BaseException:
            self.close()
            raise

    def _hosts_file(self, i: int) -> str:
        # its own name first on loopback (Debian's 127.0.1.1), then every host's address
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {self.hostnames[i]}"]
        lines += [f"{a} {h}" for a, h in zip(self.addresses, self.hostnames, strict=True)]
        return "\n".join(lines) + "\n"

    def _expect_ok(self) -> None:
        assert self._relay is not None and self._relay.stdout is not None
        line = self._relay.stdout.readline().strip()
        if line != "ok":
            raise RuntimeError(f"the bed's switch failed: {line or 'it ended'}")

    def set_link(self, host: int, **settings: object) -> None:
        """Change host ``host``'s :class:`Link` settings (``delay_ms``, ``rate_mbit``,
        ``loss``, ``partitioned``) from the next frame on.

        Raises:
            ValueError: an unknown setting or a bad value.
        """
        link = replace(self.links[self._check(host)], **settings)  # type: ignore[arg-type]
        assert self._relay is not None and self._relay.stdin is not None
        self._relay.stdin.write(json.dumps({"host": host, **asdict(link)}) + "\n")
        self._relay.stdin.flush()
        self._expect_ok()
        self.links[host] = link

    def partition(self, host: int, partitioned: bool = True) -> None:
        """Cut host ``host`` off (or join it again)."""
        self.set_link(host, partitioned=partitioned)

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``host`` (its namespace, its host name)."""
        ns, name = self.namespaces[self._check(host)], self.hostnames[host]
        cpus = ",".join(map(str, self.cpus[host]))
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "taskset", "-c", cpus, "sh",
                "-c", 'hostname "$0" && exec "$@"', name, *argv]  # fmt: skip

    def popen(self, host: int, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` (``subprocess.Popen``'s keyword arguments)."""
        return subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def run(self, host: int, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``host`` to its end (``subprocess.run``'s arguments)."""
        return subprocess.run(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process in host ``host``'s namespace; returns their pids."""
        return _kill_namespace(self.namespaces[self._check(host)])

    def exec_script(self, host: int) -> str:
        """A script that runs its arguments on host ``host`` (in the bed's own temporary
        folder)."""
        return os.path.join(self._dir, f"exec-h{self._check(host)}")

    def environment(self) -> dict[str, str]:
        """``NETBED_NS<i>``, ``NETBED_ADDR<i>`` and ``NETBED_EXEC<i>`` (:meth:`exec_script`)
        for every host."""
        env = {}
        for i in range(self.num_hosts):
            env[f"NETBED_NS{i}"] = self.namespaces[i]
            env[f"NETBED_ADDR{i}"] = self.addresses[i]
            env[f"NETBED_EXEC{i}"] = self.exec_script(i)
        return env

    def close(self) -> None:
        """Kill what runs on the hosts, stop the switch, delete the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for ns in self.namespaces:
            _remove_namespace(ns)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._relay is not None:
            with contextlib.suppress(OSError, ValueError):
                self._relay.stdin.close()  # type: ignore[union-attr]
            try:
                self._relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._relay.kill()
                self._relay.wait()
            with contextlib.suppress(OSError, ValueError):
                self._relay.stdout.close()  # type: ignore[union-attr]
        atexit.unregister(self.close)


def split_cpus(num_hosts: int) -> list[list[int]]:
    """The CPUs of each host: this process's CPUs split into ``num_hosts`` equal parts
    (hosts share them all where there are fewer CPUs than hosts)."""
    mine = sorted(os.sched_getaffinity(0))
    share = len(mine) // num_hosts
    if share == 0:
        return [mine] * num_hosts
    return [mine[i * share : (i + 1) * share] for i in range(num_hosts)]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _kill_namespace(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _remove_namespace(ns: str) -> None:
    for _ in range(3):  # processes started while killing, bounded
        if not _kill_namespace(ns):
            break
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces of beds whose owner process is gone; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for ns in (line.split()[0] for line in out.splitlines() if line.strip()):
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            _remove_namespace(ns)
            gone.append(ns)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- the switch (own process)


def _open_tap(ns: str, libc: ctypes.CDLL, home: int) -> int:
    """A TAP device ``eth0`` made inside namespace ``ns``; returns its file descriptor."""
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", b"eth0", _IFF_TAP | _IFF_NO_PI))
    finally:
        os.close(target)
        if libc.setns(home, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns home")
    return fd


class _Port:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.link = Link()
        self.busy_until = 0.0  # when the rate limiter's last frame has left
        self.queued_bytes = 0


def relay(namespaces: list[str], max_seconds: float) -> None:
    """The bed's switch: a TAP ``eth0`` in each namespace, frames forwarded between them
    with each sender's :class:`Link` applied; settings arrive on stdin as JSON lines
    (answered ``ok``). Ends at stdin's end, when its parent dies, or after
    ``max_seconds``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        ports = [_Port(_open_tap(ns, libc, home)) for ns in namespaces]
    except OSError as e:
        print(f"cannot make the hosts' interfaces: {e}", flush=True)
        return
    print("ok", flush=True)
    by_fd = {p.fd: i for i, p in enumerate(ports)}
    macs: dict[bytes, int] = {}
    pending: list[tuple[float, int, int, bytes]] = []  # (due, seq, from port, frame)
    seq = itertools.count()
    rng = random.Random(0)
    stdin = sys.stdin.fileno()
    end = time.monotonic() + max_seconds
    while (now := time.monotonic()) < end:
        wait = min(end - now, 1.0, max(0.0, pending[0][0] - now) if pending else 1.0)
        ready, _, _ = select.select([stdin, *by_fd], [], [], wait)
        for fd in ready:
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    return
                msg = json.loads(line)
                host = msg.pop("host")
                ports[host].link = Link(**msg)
                print("ok", flush=True)
                continue
            i = by_fd[fd]
            for _ in range(64):  # a burst, bounded
                try:
                    frame = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                _accept(ports[i], i, frame, pending, seq, rng)
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, i, frame = heapq.heappop(pending)
            ports[i].queued_bytes -= len(frame)
            _deliver(ports, i, frame, macs)


def _accept(port: _Port, i: int, frame: bytes, pending: list, seq: object, rng: random.Random):
    link = port.link
    if link.partitioned or (link.loss and rng.random() < link.loss):
        return
    now = time.monotonic()
    due = now
    if link.rate_mbit:
        if port.queued_bytes + len(frame) > QUEUE_BYTES:
            return
        port.busy_until = max(now, port.busy_until) + len(frame) * 8 / (link.rate_mbit * 1e6)
        due = port.busy_until
    port.queued_bytes += len(frame)
    heapq.heappush(pending, (due + link.delay_ms / 1e3, next(seq), i, frame))  # type: ignore[call-overload]


def _deliver(ports: list[_Port], i: int, frame: bytes, macs: dict[bytes, int]) -> None:
    if len(frame) < 14:
        return
    macs[frame[6:12]] = i
    dst = macs.get(frame[0:6])
    targets = [dst] if dst is not None and not frame[0] & 1 else range(len(ports))
    for j in targets:
        if j != i and not ports[j].link.partitioned:
            with contextlib.suppress(OSError):
                os.write(ports[j].fd, frame)


def main(argv: list[str] | None = None) -> int:
    """``python -m distsgd.testbed``: run a command beside a bed (or the switch itself)."""
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["relay"]:
        p = argparse.ArgumentParser(prog="distsgd.testbed relay")
        p.add_argument("--max-seconds", type=float, required=True)
        p.add_argument("namespaces", nargs="+")
        a = p.parse_args(args[1:])
        relay(a.namespaces, a.max_seconds)
        return 0
    p = argparse.ArgumentParser(
        prog="python -m distsgd.testbed",
        description="Make HOSTS network namespaces joined by a switch with the given link "
        "on every host, run COMMAND (in this namespace, with NETBED_NS<i>, NETBED_ADDR<i> "
        "and NETBED_EXEC<i> set), then remove them.",
    )
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--max-seconds", type=float, default=3600)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(args)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("a COMMAND is needed after --")
    if why := unavailable():
        print(f"distsgd.testbed: {why}", file=sys.stderr)
        return 2
    try:
        link = Link(a.delay_ms, a.rate_mbit, a.loss)
    except ValueError as e:
        print(f"distsgd.testbed: {e}", file=sys.stderr)
        return 2
    with Bed(a.hosts, {i: link for i in range(a.hosts)}, max_seconds=a.max_seconds) as bed:
        return subprocess.run(command, env={**os.environ, **bed.environment()}).returncode


if __name__ == "__main__":
    sys.exit(main())
