"""The run's rendezvous: a c10d TCPStore hosted by this process that listens on
``dist.master_addr`` only (torch's own TCPStore listens on every interface)."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

from torch.distributed import TCPStore

from distsgd.config import ConfigError

__all__ = ["rendezvous_store"]


def rendezvous_store(addr: str, port: int, *, world_size: int, timeout_s: float) -> TCPStore:
    """The run's c10d TCPStore, hosted by this process and listening on ``addr:port`` only.

    torch's TCPStore listens on every interface (IPv4 and IPv6) whatever ``addr`` is;
    this binds the socket itself and hands it over (``master_listen_fd``), so a store on
    127.0.0.1 cannot be reached from the network.

    Args:
        addr: ``dist.master_addr``, an address of this machine.
        port: ``dist.master_port``; 0 picks a free port (``store.port`` tells which).
        world_size: ranks that will connect.
        timeout_s: the store's timeout for its clients' waits, seconds.

    Raises:
        ConfigError: the port is in use, or ``addr`` is no address of this machine.
    """
    return TCPStore(
        addr,
        port,
        world_size=world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=_listen_socket(addr, port),
    )


def _listen_socket(addr: str, port: int) -> int:
    """A TCP socket listening on ``addr:port`` only (port 0: a free one); returns its file
    descriptor, owned from then on by the store it is handed to.

    Raises:
        ConfigError: the port is in use, or ``addr`` is no address of this machine.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[
            0
        ]
    except (OSError, UnicodeError) as e:
        raise ConfigError(
            f"dist.master_addr = {addr!r} is not allowed: expected a host name or IP address "
            f"of this machine ({e})"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        sock.bind(sockaddr)
        sock.listen(max(128, socket.SOMAXCONN))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"dist.master_port = {port} is not allowed: the port is already in use on "
                f"{addr}; choose a free port, or 0 to let distsgd pick one"
            ) from None
        raise ConfigError(
            f"dist.master_addr = {addr!r} is not allowed: cannot listen on it "
            f"({e.strerror or e}); expected an address of this machine (127.0.0.1 on one "
            "machine)"
        ) from None
    sock.set_inheritable(False)
    return sock.detach()
