"""One spec per protocol: everything that depends on *which* protocol a config names.

A :class:`ProtocolSpec` says how the protocol is built from the config, which layout
rules it adds to the per-field checks, how many processes it needs on the ``dist``
runtime and how it fits N of them, which role each rank plays, whether the run survives a
lost rank, the one-line label of its layout, and SMA's α = 0 rule. No other module
dispatches on ``protocol.name``: they ask :func:`spec_for`.

Sources of the rules: docs/protocols.md §1 (hardsync), §2 (Rudra's parameter server: n must divide
λ), §3 (Omnivore's compute groups: g must divide λ), §4 (Crossbow's SMA: k learners per
device, α = 1/λ over all learners), §5 (local SGD).

Example::

    from distsgd.layout import spec_for
    spec = spec_for(cfg.protocol)
    protocol = spec.build(cfg.protocol, cfg.optimizer, initial_weights)
    n, why = spec.processes(cfg.protocol, cfg.dist)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from distsgd.checks import fail
from distsgd.protocols import (
    SMA,
    BackupHardSync,
    ComputeGroups,
    DiLoCo,
    HardSync,
    LocalSGD,
    ParameterServer,
    Protocol,
)

if TYPE_CHECKING:  # the config imports this module: types only
    from distsgd.config import DistConfig, OptimizerConfig, ProtocolConfig, RunConfig

__all__ = [
    "PROTOCOLS",
    "PROTOCOL_SETTINGS",
    "ProtocolSpec",
    "build_protocol",
    "optimizer_arguments",
    "protocols_with",
    "sma_alpha",
    "spec_for",
]


def optimizer_arguments(o: OptimizerConfig) -> dict[str, Any]:
    """The protocol constructor's optimizer arguments for the ``[optimizer]`` section:
    ``momentum``, ``weight_decay`` and ``nesterov`` for ``name = "sgd"`` (torch.optim.SGD,
    today's rule bit for bit), else ``make_optimizer``, the factory of the named class
    (:meth:`~distsgd.config.OptimizerConfig.optimizer_factory`)."""
    make = o.optimizer_factory()
    if make is None:
        return {"momentum": o.momentum, "weight_decay": o.weight_decay, "nesterov": o.nesterov}
    return {"make_optimizer": make}


def sma_alpha(alpha: float, num_learners: int) -> float:
    """SMA's correction weight: ``alpha``, or 1/λ over all learners of all devices when it
    is 0 (docs/protocols.md §4: with μ_z = 0 the new central model is the replicas' mean).

    Args:
        alpha: ``protocol.alpha`` in [0, 1].
        num_learners: λ = devices × k, the learners of the whole run (not one device's k).
    """
    return alpha if alpha > 0 else 1.0 / num_learners


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (>= 1)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


class ProtocolSpec:
    """What a protocol needs of its layout. Subclasses override what differs.

    Attributes:
        name: ``protocol.name``.
        replicated: k learners per device (``protocol.replicas_per_device``, Crossbow).
        has_server: ``dist.num_servers`` server ranks come before the learner ranks.
        drop_in: ``distsgd.torch`` runs it (one model per process).
        reads: the ``protocol.*`` settings (names without the section) that the protocol
            may read; :meth:`settings` narrows them to one config's mode.
    """

    name: ClassVar[str]
    replicated: ClassVar[bool] = False
    has_server: ClassVar[bool] = False
    drop_in: ClassVar[bool] = True
    reads: ClassVar[frozenset[str]] = frozenset(
        {"name", "num_learners", "batch_size", "compression"}
    )

    def settings(self, p: ProtocolConfig) -> frozenset[str]:
        """The ``protocol.*`` settings (names without the section) that a run of ``p``
        reads: what builds, validates, fits and labels it. A setting of another protocol
        is not among them (the run's ``config.toml`` leaves it out)."""
        return self.reads

    def validate(self, p: ProtocolConfig) -> None:
        """Layout rules beyond the per-field checks.

        Raises:
            ConfigError: naming the setting that breaks the rule.
        """

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        """The protocol object, starting from ``initial`` (shape ``[P]``)."""
        raise NotImplementedError

    def check_optimizer(self, p: ProtocolConfig, o: OptimizerConfig) -> None:
        """Rules that tie the optimizer section to the protocol.

        Raises:
            ConfigError: naming the setting that breaks the rule.
        """

    def processes(self, p: ProtocolConfig, dist: DistConfig) -> tuple[int, str]:
        """Processes the ``dist`` runtime needs, and why (one learner per process)."""
        return p.num_learners, f"one learner per process, protocol.num_learners = {p.num_learners}"

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        """The settings that fit the layout to ``n`` processes (λ = n by default)."""
        return {"num_learners": n}

    def role(self, rank: int, dist: DistConfig, p: ProtocolConfig | None = None) -> str:
        """``"server"``, ``"learner"`` or ``"device"`` (k replicas) for ``rank`` (``p``:
        the protocol section, where the layout depends on it)."""
        return "learner"

    def tolerates_loss(self, p: ProtocolConfig, dist: DistConfig, rank: int) -> bool:
        """Whether the run goes on without ``rank`` (an asynchronous protocol's learner)."""
        return False

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        """The layout in one line, e.g. ``"λ=4 b=8"``, with the λ the run holds now."""
        lam = p.num_learners if num_learners is None else num_learners
        return f"λ={lam} b={p.batch_size}"

    def served_on_dist(self, p: ProtocolConfig) -> bool:
        """Whether the ``dist`` runtime runs ``p`` through a parameter server (server
        ranks first, :meth:`build_served`): the protocols with a server, and hardsync with
        backup learners."""
        return self.has_server

    def build_served(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        """The protocol object the ``dist`` runtime's server holds (:meth:`build` unless
        the protocol is served only there)."""
        return self.build(p, o, initial)

    def group_size(self, p: ProtocolConfig) -> int:
        """Learners that compute one push together (a compute group; 1 otherwise)."""
        return 1

    def sync_interval(self, p: ProtocolConfig) -> int:
        """Iterations between two synchronisations of all learners (local SGD: H)."""
        return 1

    def replica_settings(self, p: ProtocolConfig, k: int) -> dict[str, float]:
        """Protocol arguments that follow k when the replicas per device change (the
        auto-tuner, docs/protocols.md §4): to ``protocol.set_replicas_per_device(k, ...)``."""
        return {}


class _HardSync(ProtocolSpec):
    """docs/protocols.md §1: λ learners, one mean gradient per step; DDP on real processes."""

    name = "hardsync"
    reads = ProtocolSpec.reads | {"backup_learners", "powersgd_rank"}

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        return HardSync(
            initial, p.num_learners, backup_learners=p.backup_learners, **optimizer_arguments(o)
        )

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        base = super().label(p, num_learners, replicas)
        return f"{base} +{p.backup_learners} backup" if p.backup_learners else base

    # β backup learners on the dist runtime: one parameter-server rank (rank 0) holds the
    # weights and applies the first λ pushes of each version (BackupHardSync); DDP's
    # all-reduce cannot leave a late or lost learner out
    def served_on_dist(self, p: ProtocolConfig) -> bool:
        return p.backup_learners > 0

    def build_served(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        if not p.backup_learners:
            return self.build(p, o, initial)
        return BackupHardSync(initial, p.num_learners, p.backup_learners, **optimizer_arguments(o))

    def processes(self, p: ProtocolConfig, dist: DistConfig) -> tuple[int, str]:
        if not p.backup_learners:
            return super().processes(p, dist)
        lam, beta = p.num_learners, p.backup_learners
        return lam + beta + 1, (
            f"one parameter-server rank plus protocol.num_learners = {lam} and "
            f"protocol.backup_learners = {beta} learner ranks"
        )

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        if not p.backup_learners:
            return super().fit(p, dist, n)
        if n < p.backup_learners + 2:
            need, why = self.processes(p, dist)
            fail(
                "dist.num_processes",
                n,
                f"at least protocol.backup_learners + 2 = {p.backup_learners + 2} (one "
                f"server rank, β backup learners and λ >= 1), or 0 ({need} processes: {why})",
            )
        return {"num_learners": n - 1 - p.backup_learners}

    def role(self, rank: int, dist: DistConfig, p: ProtocolConfig | None = None) -> str:
        return "server" if p is not None and p.backup_learners and rank == 0 else "learner"

    def tolerates_loss(self, p: ProtocolConfig, dist: DistConfig, rank: int) -> bool:
        return p.backup_learners > 0 and rank > 0


class _Plain(_HardSync):
    """One learner: the plain training loop."""

    name = "plain"
    drop_in = False
    reads = ProtocolSpec.reads

    def validate(self, p: ProtocolConfig) -> None:
        if p.num_learners != 1:
            fail("protocol.num_learners", p.num_learners, "1 for protocol 'plain'")

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        _, why = self.processes(p, dist)
        fail("dist.num_processes", n, f"1 or 0 (protocol 'plain' is one learner, {why})")


class _Served(ProtocolSpec):
    """Learners push to ``dist.num_servers`` server shards (ranks 0 … S−1)."""

    has_server = True
    reads = ProtocolSpec.reads | {"staleness_lr", "server_optimizer"}

    def check_optimizer(self, p: ProtocolConfig, o: OptimizerConfig) -> None:
        """Rudra's AdaGrad server (docs/protocols.md §2) is its own optimizer, no momentum (Rudra
        retunes its learning rate instead).

        Raises:
            ConfigError: ``server_optimizer = "adagrad"`` with ``optimizer.momentum`` > 0
                or with an ``optimizer.name`` other than ``"sgd"``.
        """
        if p.server_optimizer == "adagrad" and not o.is_sgd:
            fail(
                "protocol.server_optimizer",
                p.server_optimizer,
                f"'sgd' with optimizer.name = {o.name!r} (Rudra's AdaGrad server is its own "
                "optimizer; for another one set optimizer.name alone, e.g. "
                "'torch.optim:Adagrad')",
            )
        if p.server_optimizer == "adagrad" and o.momentum != 0:
            fail("optimizer.momentum", o.momentum, "0 when protocol.server_optimizer = 'adagrad'")

    def processes(self, p: ProtocolConfig, dist: DistConfig) -> tuple[int, str]:
        s = dist.num_servers
        return p.num_learners + s, (
            f"dist.num_servers = {s} server ranks plus protocol.num_learners = "
            f"{p.num_learners} learner ranks"
        )

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        s = dist.num_servers
        if n <= s:
            need, why = self.processes(p, dist)
            fail(
                "dist.num_processes",
                n,
                f"more than dist.num_servers = {s} (at least one learner rank), or 0 "
                f"({need} processes: {why})",
            )
        return {"num_learners": n - s}

    def role(self, rank: int, dist: DistConfig, p: ProtocolConfig | None = None) -> str:
        return "server" if rank < dist.num_servers else "learner"


class _ParameterServer(_Served):
    """Rudra's parameter server: n-softsync (n | λ), async or hardsync (docs/protocols.md §2)."""

    name = "parameter_server"
    reads = _Served.reads | {"mode", "softsync"}

    def settings(self, p: ProtocolConfig) -> frozenset[str]:
        """n (``softsync``) is read in mode ``softsync`` only (async: n = λ; hardsync: 1)."""
        return self.reads if p.mode == "softsync" else self.reads - {"softsync"}

    def validate(self, p: ProtocolConfig) -> None:
        lam = p.num_learners
        if p.mode == "softsync" and (p.softsync > lam or lam % p.softsync):
            fail(
                "protocol.softsync",
                p.softsync,
                f"a divisor of protocol.num_learners = {lam} (1 <= n <= λ)",
            )

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        self.check_optimizer(p, o)
        return ParameterServer(
            initial,
            p.num_learners,
            softsync=p.effective_softsync,
            barrier=p.mode == "hardsync",
            staleness_lr=p.staleness_lr,
            optimizer=p.server_optimizer,
            **optimizer_arguments(o),
        )

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        changes = super().fit(p, dist, n)
        if p.mode == "softsync":  # a fully asynchronous n = λ stays n = λ
            lam = changes["num_learners"]
            fully_async = p.softsync == p.num_learners
            changes["softsync"] = lam if fully_async else _largest_divisor(lam, p.softsync)
        return changes

    def tolerates_loss(self, p: ProtocolConfig, dist: DistConfig, rank: int) -> bool:
        return self.role(rank, dist) == "learner" and p.mode != "hardsync"

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        base = super().label(p, num_learners, replicas)
        return f"{base} {p.softsync}-softsync" if p.mode == "softsync" else f"{base} {p.mode}"


class _ComputeGroups(_Served):
    """Omnivore's g compute groups (g divides λ), asynchronous across (docs/protocols.md §3)."""

    name = "compute_groups"
    reads = _Served.reads | {"num_groups", "momentum_compensation"}

    def check_optimizer(self, p: ProtocolConfig, o: OptimizerConfig) -> None:
        """The server's rules, and Omnivore's momentum compensation (docs/protocols.md §3): SGD
        momentum, so it needs SGD.

        Raises:
            ConfigError: as the parameter server's, or ``momentum_compensation`` with an
                ``optimizer.name`` other than ``"sgd"``.
        """
        super().check_optimizer(p, o)
        if p.momentum_compensation and not o.is_sgd:
            fail(
                "protocol.momentum_compensation",
                p.momentum_compensation,
                f"false with optimizer.name = {o.name!r} (Omnivore's compensation lowers "
                "SGD momentum; it needs optimizer.name = 'sgd')",
            )

    def validate(self, p: ProtocolConfig) -> None:
        lam = p.num_learners
        if p.num_groups > lam or lam % p.num_groups:
            fail("protocol.num_groups", p.num_groups, f"a divisor of protocol.num_learners = {lam}")

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        self.check_optimizer(p, o)
        return ComputeGroups(
            initial,
            p.num_learners,
            p.num_groups,
            staleness_lr=p.staleness_lr,
            optimizer=p.server_optimizer,
            momentum_compensation=p.momentum_compensation,
            **optimizer_arguments(o),
        )

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        changes = super().fit(p, dist, n)
        changes["num_groups"] = _largest_divisor(changes["num_learners"], p.num_groups)
        return changes

    def tolerates_loss(self, p: ProtocolConfig, dist: DistConfig, rank: int) -> bool:
        return self.role(rank, dist) == "learner"

    def group_size(self, p: ProtocolConfig) -> int:
        return p.num_learners // p.num_groups

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        return f"{super().label(p, num_learners, replicas)} g={p.num_groups}"


_AUTOTUNE_SETTINGS = frozenset(
    {"autotune_threshold", "autotune_interval", "autotune_max_replicas", "autotune_rule"}
)


class _Replicated(ProtocolSpec):
    """k learners per device (Crossbow, docs/protocols.md §4): one process per device."""

    replicated = True
    reads = ProtocolSpec.reads | {"replicas_per_device"} | _AUTOTUNE_SETTINGS

    def settings(self, p: ProtocolConfig) -> frozenset[str]:
        """The auto-tuner's settings are read with ``replicas_per_device = "auto"`` only."""
        return self.reads if p.auto_replicas else self.reads - _AUTOTUNE_SETTINGS

    def validate(self, p: ProtocolConfig) -> None:
        k, lam = p.initial_replicas_per_device, p.num_learners
        if k > lam or lam % k:
            fail(
                "protocol.replicas_per_device",
                p.replicas_per_device,
                f"a divisor of protocol.num_learners = {lam}",
            )

    def processes(self, p: ProtocolConfig, dist: DistConfig) -> tuple[int, str]:
        return p.num_devices, (
            f"one process per device holding protocol.replicas_per_device = "
            f"{p.replicas_per_device} replicas, protocol.num_learners = {p.num_learners}"
        )

    def fit(self, p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, int]:
        return {"num_learners": n * p.initial_replicas_per_device}

    def role(self, rank: int, dist: DistConfig, p: ProtocolConfig | None = None) -> str:
        return "device"

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        k = f"k={p.replicas_per_device if replicas is None else replicas}"
        if replicas is not None and p.auto_replicas:
            k += " (auto)"
        return f"{super().label(p, num_learners, replicas)} {k}"


class _SMA(_Replicated):
    """docs/protocols.md §4: Crossbow's synchronous model averaging with a central model."""

    name = "sma"
    reads = _Replicated.reads | {"alpha", "central_momentum"}

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        return SMA(
            initial,
            p.num_learners,
            replicas_per_device=p.initial_replicas_per_device,
            alpha=sma_alpha(p.alpha, p.num_learners),
            central_momentum=p.central_momentum,
            **optimizer_arguments(o),
        )

    def replica_settings(self, p: ProtocolConfig, k: int) -> dict[str, float]:
        # α = 0 means 1 / (all learners) = 1 / (devices · k)
        return {"alpha": sma_alpha(p.alpha, p.num_devices * k)}


class _LocalSGD(_Replicated):
    """docs/protocols.md §5: local steps, model averaging every H iterations."""

    name = "local_sgd"
    reads = _Replicated.reads | {"average_every"}

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        return LocalSGD(
            initial,
            p.num_learners,
            average_every=p.average_every,
            replicas_per_device=p.initial_replicas_per_device,
            **optimizer_arguments(o),
        )

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        return f"{super().label(p, num_learners, replicas)} H={p.average_every}"

    def sync_interval(self, p: ProtocolConfig) -> int:
        return p.average_every


class _DiLoCo(_LocalSGD):
    """docs/protocols.md §6: local SGD whose mean pseudo-gradient an outer optimizer applies."""

    name = "diloco"
    reads = _LocalSGD.reads | {"outer_optimizer", "outer_lr", "outer_momentum", "outer_nesterov"}

    def build(self, p: ProtocolConfig, o: OptimizerConfig, initial: Tensor) -> Protocol:
        make_outer = p.outer_optimizer_factory()
        sgd = make_outer is None  # the SGD settings configure the default outer SGD only
        outer = {
            "make_outer_optimizer": make_outer,
            "outer_momentum": p.outer_momentum if sgd else 0.0,
            "outer_nesterov": p.outer_nesterov if sgd else False,
        }
        return DiLoCo(
            initial,
            p.num_learners,
            average_every=p.average_every,
            outer_lr=p.outer_lr,
            replicas_per_device=p.initial_replicas_per_device,
            **outer,
            **optimizer_arguments(o),
        )

    def settings(self, p: ProtocolConfig) -> frozenset[str]:
        """The outer SGD settings are read with ``outer_optimizer = "sgd"`` only."""
        reads = super().settings(p)
        return reads if p.outer_optimizer == "sgd" else reads - {"outer_momentum", "outer_nesterov"}

    def label(self, p: ProtocolConfig, num_learners: int | None, replicas: int | None) -> str:
        return f"{super().label(p, num_learners, replicas)} outer η={p.outer_lr:g}"


_SPECS: dict[str, ProtocolSpec] = {
    s.name: s
    for s in (
        _HardSync(),
        _ParameterServer(),
        _ComputeGroups(),
        _SMA(),
        _LocalSGD(),
        _DiLoCo(),
        _Plain(),
    )
}
PROTOCOLS = tuple(_SPECS)
"""Every ``protocol.name``."""
PROTOCOL_SETTINGS = frozenset().union(*(s.reads for s in _SPECS.values()))
"""The ``protocol.*`` settings some protocol reads (a setting outside it is read by none
that this module knows, e.g. one added later: a run's ``config.toml`` keeps it)."""


def protocols_with(flag: str) -> str:
    """The names of the protocols whose spec sets ``flag`` (e.g. ``"replicated"``), for a
    message: ``"'sma' or 'local_sgd'"``."""
    names = [repr(n) for n, s in _SPECS.items() if getattr(s, flag)]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def spec_for(protocol: ProtocolConfig | str) -> ProtocolSpec:
    """The spec of ``protocol`` (a protocol config section or its name).

    Raises:
        ConfigError: an unknown name.
    """
    name = protocol if isinstance(protocol, str) else protocol.name
    if name not in _SPECS:
        fail("protocol.name", name, "one of " + ", ".join(repr(n) for n in PROTOCOLS))
    return _SPECS[name]


def build_protocol(cfg: RunConfig, initial: Tensor) -> Protocol:
    """The protocol ``cfg.protocol`` names, starting from ``initial`` (shape ``[P]``).

    Mapping: ``hardsync`` / ``plain`` → :class:`HardSync`; ``parameter_server`` →
    :class:`ParameterServer` with ``softsync = cfg.protocol.effective_softsync`` and a
    barrier for mode ``hardsync``; ``compute_groups`` → :class:`ComputeGroups`; ``sma`` →
    :class:`SMA` with α = ``protocol.alpha``, or 1/λ when it is 0 (:func:`sma_alpha`);
    ``local_sgd`` → :class:`LocalSGD`; ``diloco`` → :class:`DiLoCo` with the outer
    optimizer of ``protocol.outer_*``. The protocol's optimizer (server, group server or
    replicas) is :func:`optimizer_arguments`: ``optimizer.momentum``, ``weight_decay`` and
    ``nesterov`` of SGD for ``optimizer.name = "sgd"``, else the factory of the named
    torch.optim class.

    Raises:
        ConfigError: the optimizer rules of :meth:`ProtocolSpec.check_optimizer` (e.g.
            ``protocol.server_optimizer = "adagrad"`` with ``optimizer.momentum`` > 0).
        ValueError: ``initial`` is not a non-empty 1-D floating-point tensor.
    """
    return spec_for(cfg.protocol).build(cfg.protocol, cfg.optimizer, initial)


def fit_changes(p: ProtocolConfig, dist: DistConfig, n: int) -> dict[str, Any]:
    """The settings of ``p`` that differ once its layout is fitted to ``n`` processes."""
    changes = spec_for(p).fit(p, dist, n)
    return {k: v for k, v in changes.items() if getattr(p, k) != v}


def fitted(p: ProtocolConfig, dist: DistConfig, n: int) -> tuple[ProtocolConfig, list[str]]:
    """``p`` fitted to ``n`` processes and one ``"protocol.key old → new"`` note per change."""
    if n == spec_for(p).processes(p, dist)[0]:
        return p, []
    changed = fit_changes(p, dist, n)
    notes = [f"protocol.{k} {getattr(p, k)} → {v}" for k, v in changed.items()]
    return dataclasses.replace(p, **changed), notes
