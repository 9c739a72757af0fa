"""A rank's place on the network: the interface gloo uses and the threads it computes with.

gloo, left alone, takes the address its host name resolves to, and falls back to
loopback where that address is not on the machine (Debian maps the host name to
127.0.1.1): the rank then tells its peers on other hosts to reach it at 127.0.0.1, and
the run fails in ``connectFullMesh`` or hangs. :func:`prepare_rank` instead chooses the
interface that routes to the master address and sets ``GLOO_SOCKET_IFNAME`` to it
before the process group is made, or refuses in one line naming ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

from distsgd.config import ConfigError

__all__ = ["RankNetwork", "host_cores", "interface_address", "prepare_rank", "route_interface"]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR, _SIOCGIFFLAGS, _IFF_UP = 0x8915, 0x8913, 0x1


@dataclass(frozen=True)
class RankNetwork:
    """What :func:`prepare_rank` chose for this rank.

    Attributes:
        host: this machine's host name.
        interface: the interface(s) gloo uses (``GLOO_SOCKET_IFNAME``'s value).
        address: this host's address on that interface ('' where the user named it).
        threads: intra-op threads of this rank (``torch.set_num_threads``).
        ranks_on_host: ranks sharing this host's cores (``LOCAL_WORLD_SIZE``).
    """

    host: str
    interface: str
    address: str
    threads: int
    ranks_on_host: int

    def line(self) -> str:
        """The start-up line: host, interface and threads per rank."""
        at = f" ({self.address})" if self.address else ""
        return (
            f"dist: host {self.host}, interface {self.interface}{at}, {self.threads} "
            f"thread(s) per rank × {self.ranks_on_host} rank(s) on this host"
        )


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_rank(num_threads: int, ranks_on_host: int) -> int:
    """``num_threads`` when set (> 0), else this host's cores divided by the ranks on it
    (at least 1)."""
    if num_threads > 0:
        return num_threads
    return max(1, host_cores() // max(1, ranks_on_host))


def _interface_addresses() -> dict[str, tuple[str, bool]]:
    """Each interface's IPv4 address and whether it is up (interfaces without one left out)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)[20:24])
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, packed)[16:18])
            except OSError:
                continue
            found[name] = (addr, bool(flags[0] & _IFF_UP))
    return found


def _ipv6_interfaces() -> dict[str, str]:
    """Each IPv6 address of this machine (compressed) → its interface (/proc/net/if_inet6)."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                addr = ipaddress.IPv6Address(int(fields[0], 16)).compressed
                found[addr] = fields[5]
    return found


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (None: no such interface, or none set)."""
    found = _interface_addresses().get(name)
    return found[0] if found else None


def route_interface(master_addr: str) -> tuple[str, str]:
    """The interface and local address this host sends from to reach ``master_addr``.

    A UDP ``connect`` asks the kernel's routing table and sends nothing.

    Raises:
        ConfigError: ``master_addr`` does not resolve, no route leads to it, or its
            local address belongs to no interface (set ``GLOO_SOCKET_IFNAME``).
    """
    host = socket.gethostname()
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    except (OSError, UnicodeError) as e:
        raise ConfigError(
            f"MASTER_ADDR = {master_addr!r} is not allowed on host {host}: it does not "
            f"resolve ({e}); expected a host name or address of rank 0's machine"
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as e:
            if e.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
                raise
            raise ConfigError(
                f"MASTER_ADDR = {master_addr!r} is not allowed on host {host}: no route to "
                f"it ({e.strerror}); expected an address of rank 0's machine that this host "
                "reaches"
            ) from None
        local = s.getsockname()[0]
    if family == socket.AF_INET6:
        name = _ipv6_interfaces().get(ipaddress.IPv6Address(local.split("%")[0]).compressed)
    else:
        name = next((n for n, (a, _) in _interface_addresses().items() if a == local), None)
    if name is None:
        raise ConfigError(
            f"{GLOO_IFNAME} is unset and host {host} sends to MASTER_ADDR = {master_addr!r} "
            f"from {local}, an address of no interface distsgd can see; set "
            f"{GLOO_IFNAME} to the interface that reaches rank 0's machine"
        )
    return name, local


def _outward_interface(host: str) -> tuple[str, str]:
    """The interface other hosts reach this one on, where the master address is this
    machine's loopback but ranks run on other hosts: the only interface up with an IPv4
    address besides loopback.

    Raises:
        ConfigError: none or several such interfaces (names ``GLOO_SOCKET_IFNAME``).
    """
    up = {n: a for n, (a, on) in _interface_addresses().items()
          if on and not ipaddress.IPv4Address(a).is_loopback}  # fmt: skip
    if len(up) == 1:
        return next(iter(up.items()))
    raise ConfigError(
        f"{GLOO_IFNAME} is unset and host {host}'s ranks cannot tell which interface the "
        f"other hosts reach: MASTER_ADDR routes to loopback here and the interfaces up are "
        f"{', '.join(sorted(up)) or 'none'}; set {GLOO_IFNAME} to one of them (and pass "
        "--master-addr an address the other hosts reach)"
    )


def _check_named(names: str, host: str) -> None:
    known = [n for _, n in socket.if_nameindex()]
    for name in names.split(","):
        if name not in known:
            raise ConfigError(
                f"{GLOO_IFNAME} = {names!r} is not allowed on host {host}: no interface "
                f"{name!r} here; expected one of {', '.join(known)} (or unset it: distsgd "
                "then uses the interface that routes to MASTER_ADDR)"
            )


def prepare_rank(num_threads: int | None, *, log: bool = True) -> RankNetwork:
    """Set this rank's gloo interface and threads before its process group is made.

    ``GLOO_SOCKET_IFNAME`` when set names the interface(s) (each must exist here); else
    it is set to the interface that routes to ``MASTER_ADDR`` (on the master's own host
    in a run over several hosts, where that is loopback: the one interface up besides
    it). Threads: ``num_threads`` (``train.num_threads``) when > 0, else this host's
    cores divided by ``LOCAL_WORLD_SIZE``; None leaves torch's setting as it is (the
    drop-in: the user's loop owns it). In a run over several hosts
    (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``), local rank 0 prints :meth:`RankNetwork.line`
    on stderr when ``log``.

    Raises:
        ConfigError: ``MASTER_ADDR`` unresolvable or unreachable, a
            ``GLOO_SOCKET_IFNAME`` naming no interface here, or no way to tell the
            interface (one line naming ``GLOO_SOCKET_IFNAME`` and this host).
    """
    import torch

    env = os.environ
    host = socket.gethostname()
    ranks_on_host = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    several_hosts = int(env.get("WORLD_SIZE", "1")) > ranks_on_host
    if env.get(GLOO_IFNAME):
        _check_named(env[GLOO_IFNAME], host)
        interface, address = env[GLOO_IFNAME], ""
    else:
        interface, address = route_interface(env.get("MASTER_ADDR", "127.0.0.1"))
        if several_hosts and ipaddress.ip_address(address.split("%")[0]).is_loopback:
            interface, address = _outward_interface(host)
        env[GLOO_IFNAME] = interface
    if num_threads is not None:
        torch.set_num_threads(threads_per_rank(num_threads, ranks_on_host))
    threads = torch.get_num_threads()
    net = RankNetwork(host, interface, address, threads, ranks_on_host)
    if log and several_hosts and env.get("LOCAL_RANK", "0") == "0":
        print(net.line(), file=sys.stderr, flush=True)
    return net
