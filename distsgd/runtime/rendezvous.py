"""The run's rendezvous: a c10d TCPStore hosted by this process that listens on
``dist.master_addr`` only (torch's own TCPStore listens on every interface); the run
secret and the join every rank of a torchrun run passes before its process group is
made (:func:`join_run`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from distsgd.config import ConfigError
from distsgd.runtime.network import interface_address

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "join_run",
    "post_refusal",
    "rendezvous_store",
    "run_secret",
    "run_store",
    "secret_tag",
]


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


# ---- the run secret and the join ----------------------------------------------------------
ENV_SECRET = "DISTSGD_RUN_SECRET"
ENV_SECRET_FILE = "DISTSGD_RUN_SECRET_FILE"
_POLL_S = 0.2  # how often rank 0 looks for the other ranks' proofs


def run_secret() -> bytes:
    """The run secret: ``DISTSGD_RUN_SECRET``'s value, else the contents of the file
    ``DISTSGD_RUN_SECRET_FILE`` names (surrounding whitespace stripped); ``b""`` when
    neither is set. Never printed.

    Raises:
        ConfigError: the file cannot be read or is empty (names the variable and the host,
            not the contents).
    """
    if value := os.environ.get(ENV_SECRET):
        return value.encode()
    path = os.environ.get(ENV_SECRET_FILE)
    if not path:
        return b""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(
            f"{ENV_SECRET_FILE} = {path!r} is not allowed on host {socket.gethostname()}: "
            f"cannot read it ({e.strerror or e}); expected a readable file holding the run "
            "secret"
        ) from None
    if not secret:
        raise ConfigError(
            f"{ENV_SECRET_FILE} = {path!r} is not allowed on host {socket.gethostname()}: "
            "the file is empty; expected the run secret in it"
        )
    return secret


def secret_tag(secret: bytes | None = None) -> str:
    """The run's key namespace below ``distsgd/``: ``s<HMAC-SHA256(secret)[:32 hex]>/``, or
    ``""`` without a secret (``secret`` None: :func:`run_secret`). Keys under it cannot be
    named without the secret."""
    secret = run_secret() if secret is None else secret
    if not secret:
        return ""
    return "s" + hmac.new(secret, b"distsgd store namespace", hashlib.sha256).hexdigest()[:32] + "/"


def _proof(secret: bytes, nonce: str, rank: int) -> str:
    return hmac.new(secret, f"distsgd join {nonce} {rank}".encode(), hashlib.sha256).hexdigest()


_hosted: TCPStore | None = None  # the run's store where rank 0 hosts it


def run_store(rank: int, timeout_s: float) -> TCPStore:
    """A client of the run's store at ``MASTER_ADDR:MASTER_PORT``, whose waits time out
    after ``timeout_s``. Where no launcher hosts it (``TORCHELASTIC_USE_AGENT_STORE`` is
    not ``True``, as torchrun and distsgd's launchers set it), rank 0 hosts it, as
    torch's ``env://`` rendezvous does, but listening on ``MASTER_ADDR`` only
    (:func:`rendezvous_store`); later calls on rank 0 return that store.

    Raises:
        ConfigError: rank 0 cannot listen on ``MASTER_ADDR:MASTER_PORT``.
    """
    global _hosted
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        if _hosted is None:
            _hosted = rendezvous_store(_bind_address(addr), port, world_size=1, timeout_s=timeout_s)
        _hosted.set_timeout(timedelta(seconds=timeout_s))
        return _hosted
    return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _bind_address(addr: str) -> str:
    """Where rank 0 listens for ``MASTER_ADDR`` = ``addr``: ``addr`` itself, unless it
    resolves to loopback here while ranks run on other hosts (Debian maps the host name to
    127.0.1.1): then the address of gloo's interface (``GLOO_SOCKET_IFNAME``, which
    :func:`~distsgd.runtime.network.prepare_rank` set to the one the others reach)."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= int(
        env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))
    ):
        return addr
    try:
        resolved = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        return addr
    if not ipaddress.ip_address(resolved.split("%")[0]).is_loopback:
        return addr
    return interface_address(env.get("GLOO_SOCKET_IFNAME", "").split(",")[0]) or addr


def post_refusal(prefix: str, rank: int, message: str, timeout_s: float) -> None:
    """Tell rank 0 why this rank does not join (``message``, one line), where the store at
    ``MASTER_ADDR:MASTER_PORT`` accepts a connection within ``timeout_s`` seconds (rank 0
    may not host it yet); else nothing. A plain socket tries first: c10d's client logs
    every failed try."""
    with contextlib.suppress(RuntimeError, ValueError, KeyError, OSError):
        addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        end = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(addr, timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > end:
                    return
                time.sleep(_POLL_S)
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=min(5.0, timeout_s)),
        )
        store.set(f"{prefix}refused/{rank}", f"{socket.gethostname()} {message}")


def join_run(prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
    """The run's join, before the process group is made: every rank proves the run secret
    (:func:`run_secret`) to rank 0, which admits the run only when every rank did.

    Rank 0 posts a fresh nonce under ``prefix`` (a namespace every rank can name, secret or
    not); rank r answers ``HMAC(secret, nonce, r)`` with its host name; rank 0 waits up to
    ``timeout_s`` seconds for every answer (or a refusal, :func:`post_refusal`) and posts a
    verdict per rank. The secret itself never crosses the network.

    Raises:
        ConfigError: one line, on every rank that can be told: a rank with another secret
            (named with its host), a rank that refused its own settings, a rank that did
            not join within ``timeout_s`` (a host started late, or one that cannot reach
            ``MASTER_ADDR``), no answer from rank 0.
    """
    secret, host = run_secret(), socket.gethostname()
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = run_store(rank, 2 * timeout_s + 5)
        if rank == 0:
            _admit(store, prefix, secret, world_size, timeout_s)
            return
        nonce = store.get(f"{prefix}nonce").decode()
        store.set(f"{prefix}proof/{rank}", f"{host} {_proof(secret, nonce, rank)}")
        verdict = store.get(f"{prefix}verdict/{rank}").decode()
        store.set(f"{prefix}read/{rank}", "1")  # rank 0 may close the store now
    except (RuntimeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        whom = "the run's store" if rank == 0 else "rank 0"
        raise ConfigError(
            f"dist.timeout_s = {timeout_s:g} was not enough for rank {rank} on host {host} "
            f"to join: no answer from {whom} at MASTER_ADDR:MASTER_PORT = {master} within "
            f"2 × timeout_s + 5 s; start every host's torchrun within timeout_s of each other"
        ) from None
    if verdict != "ok":
        raise ConfigError(verdict)


def _admit(store: TCPStore, prefix: str, secret: bytes, world_size: int, timeout_s: float) -> None:
    """Rank 0's side of :func:`join_run`."""
    nonce = secrets.token_hex(16)
    store.set(f"{prefix}nonce", nonce)
    pending, problems, verdicts = set(range(1, world_size)), [], {}
    answered = []  # the ranks that wait for their verdict
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            for kind in ("refused", "proof"):
                if store.check([f"{prefix}{kind}/{r}"]):
                    other, text = store.get(f"{prefix}{kind}/{r}").decode().split(" ", 1)
                    pending.discard(r)
                    if kind == "proof":
                        answered.append(r)
                    if kind == "refused":
                        problems.append(f"rank {r} on host {other} refused to start: {text}")
                    elif not hmac.compare_digest(text, _proof(secret, nonce, r)):
                        verdicts[r] = (
                            f"{ENV_SECRET} is not allowed on host {other} (rank {r}): rank 0 "
                            f"refused its proof of the run secret; expected the secret of "
                            f"rank 0's host (set {ENV_SECRET} or {ENV_SECRET_FILE} alike on "
                            "every host)"
                        )
                        problems.append(
                            f"rank {r} on host {other} has another run secret than rank 0 "
                            f"({ENV_SECRET} / {ENV_SECRET_FILE}); it was refused"
                        )
                    break
        if pending:
            time.sleep(_POLL_S)
    if pending:
        late = ", ".join(map(str, sorted(pending)))
        problems.append(
            f"dist.timeout_s = {timeout_s:g} was not enough: rank(s) {late} did not join "
            f"within it (a host started late, or cannot reach MASTER_ADDR); start every "
            "host's torchrun within timeout_s of each other"
        )
    why = "; ".join(problems)
    for r in range(1, world_size):
        verdicts.setdefault(r, f"rank 0 refused the run: {why}" if problems else "ok")
        store.set(f"{prefix}verdict/{r}", verdicts[r])
    if problems:  # the store may be this process's: let the others read their verdict
        keys = [f"{prefix}read/{r}" for r in answered]
        end = time.monotonic() + min(5.0, timeout_s)
        while keys and not store.check(keys) and time.monotonic() < end:
            time.sleep(_POLL_S)
        raise ConfigError(why)
