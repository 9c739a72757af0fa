"""``init`` and the :class:`Context`: the rank's role in the run, the process group, the
server's loop and the run's state (see :mod:`distsgd.torch`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distsgd.config import ConfigError, RunConfig, fit_layout
from distsgd.engine import GradientEngine
from distsgd.layout import PROTOCOLS, build_protocol, protocols_with, spec_for
from distsgd.metrics import save_checked
from distsgd.protocols.base import AsynchronousProtocol
from distsgd.runtime import ps
from distsgd.runtime.base import TrainingDiverged, check_losses
from distsgd.runtime.dist import (
    Heartbeats,
    ProcessInfo,
    check_same_config,
    end_with_parent,
    join,
    process_group_store,
    process_info,
    refuse_to_join,
)
from distsgd.runtime.network import prepare_rank
from distsgd.torch import server_optimizer
from distsgd.torch.flat import flatten, write_back

__all__ = ["SETTINGS", "Context", "ServeResult", "init", "recalibrate_batchnorm"]

SETTINGS: dict[str, str] = {
    **{
        k: "protocol"
        for k in (
            "batch_size",
            "mode",
            "softsync",
            "staleness_lr",
            "server_optimizer",
            "num_groups",
            "momentum_compensation",
            "alpha",
            "central_momentum",
            "average_every",
            "outer_optimizer",
            "outer_lr",
            "outer_momentum",
            "outer_nesterov",
            "compression",
        )
    },
    "momentum": "optimizer",
    "weight_decay": "optimizer",
    "nesterov": "optimizer",
    "timeout_s": "dist",
    "seed": "train",
}
"""``init``'s keyword settings and the config section each belongs to."""

DIVERGED_KEY = "drop-in/diverged"
"""The run store's key under which the server posts a divergence (its message)."""


@dataclass
class ServeResult:
    """What :meth:`Context.serve` returns when every learner has left.

    Attributes:
        num_updates: updates the server applied (its version).
        num_pushes: pushes applied.
        staleness_counts: ``{σ: gradients applied with staleness σ}`` (Rudra's histogram).
        push_order: ``(worker, pulled version)`` of every applied push, in arrival order.
        push_rates: the base rate α0 each of those pushes carried (the learner's
            optimizer's ``lr`` at its step: its schedule's).
        lost_ranks: learner ranks the server lost (asynchronous protocols go on without).
        train_loss: mean over the learners of the loss each passed to its last
            ``step(loss)`` (NaN when none did).
        bn_batches: batches over which the BatchNorm statistics were recomputed for
            the central weights (0: none, see :meth:`Context.serve`'s ``bn_data``).
    """

    num_updates: int
    num_pushes: int
    staleness_counts: dict[int, int]
    push_order: list[tuple[int, int]] = field(default_factory=list)
    push_rates: list[float] = field(default_factory=list)
    lost_ranks: list[int] = field(default_factory=list)
    train_loss: float = float("nan")
    bn_batches: int = 0


def _raw_config(protocol: str, config: RunConfig | str | Path | None, settings: dict) -> dict:
    if isinstance(config, RunConfig):
        raw = config.to_dict()
    elif config is not None:
        raw = RunConfig.from_toml(config).to_dict()
    else:
        raw = {}
    raw.setdefault("protocol", {})["name"] = (
        protocol if config is None else raw["protocol"].get("name", protocol)
    )
    for key, value in settings.items():
        if key not in SETTINGS:
            raise ConfigError(
                f"{key} = {value!r} is not a setting of distsgd.torch.init; known: "
                + ", ".join(sorted(SETTINGS))
            )
        raw.setdefault(SETTINGS[key], {})[key] = value
    return raw


def _resolve(raw: dict, world_size: int) -> RunConfig:
    """The run's config with λ fitted to ``world_size`` processes (one model each)."""
    p = raw["protocol"]
    if p["name"] not in PROTOCOLS or not spec_for(p["name"]).drop_in:
        raise ConfigError(
            f"protocol = {p['name']!r} is not allowed: expected {protocols_with('drop_in')}"
        )
    if p.get("replicas_per_device", 1) != 1:
        raise ConfigError(
            f"protocol.replicas_per_device = {p['replicas_per_device']!r} is not allowed: "
            "expected 1 (each process trains one model)"
        )
    if p.get("backup_learners", 0):
        raise ConfigError(
            f"protocol.backup_learners = {p['backup_learners']!r} is not allowed: expected 0 "
            "(the drop-in's hardsync is DDP's all-reduce, which waits for every learner; "
            "backup learners run on the simulated runtime)"
        )
    if raw.get("dist", {}).get("num_servers", 1) != 1:
        raise ConfigError(
            f"dist.num_servers = {raw['dist']['num_servers']!r} is not allowed: expected 1 "
            "(the drop-in serves from one server rank)"
        )
    servers = 1 if spec_for(p["name"]).has_server else 0
    if world_size <= servers:
        raise ConfigError(
            f"protocol = {p['name']!r} needs a server rank and at least one learner rank; "
            f"torchrun started {world_size} process(es): use --nproc-per-node >= 2"
        )
    p["num_learners"] = world_size - servers
    cfg = RunConfig.from_dict(raw)
    fitted, _ = fit_layout(cfg.protocol, cfg.dist, world_size)
    return cfg.replace(protocol=fitted)


def init(
    protocol: str = "hardsync",
    *,
    config: RunConfig | str | Path | None = None,
    **settings: Any,
) -> Context:
    """Join the run (torchrun's environment) and say what this rank does in it.

    Roles (``distsgd.layout``): ``hardsync`` and ``local_sgd``/``diloco``/``sma`` (one model per
    process, k = 1) make every rank a learner; ``parameter_server`` and
    ``compute_groups`` make rank 0 the server and ranks 1 … W−1 learners 0 … W−2
    (compute group g holds learners ``g·λ/G … (g+1)·λ/G − 1``). λ always follows the
    world size; a process started without torchrun is a world of one.

    Args:
        protocol: ``hardsync``, ``local_sgd``, ``diloco``, ``sma``, ``parameter_server``
            or ``compute_groups``.
        config: a :class:`RunConfig` or a TOML file whose ``[protocol]``, ``[optimizer]``,
            ``[dist]`` and ``train.seed`` settings apply (``protocol`` then comes from it).
        **settings: ``batch_size``, ``mode``, ``softsync``, ``staleness_lr``,
            ``server_optimizer``, ``num_groups``, ``momentum_compensation``, ``alpha``,
            ``central_momentum``, ``average_every``, ``outer_optimizer``, ``outer_lr``,
            ``outer_momentum``, ``outer_nesterov``, ``compression`` (as ``protocol.*``);
            ``momentum``, ``weight_decay``, ``nesterov`` (optional: the parameter server
            runs the learners' optimizer and refuses a value that differs); ``timeout_s``;
            ``seed`` (the Sampler's).

    Returns:
        The :class:`Context` of this rank.

    Raises:
        ConfigError: an unknown setting, a bad value, or a layout the world size cannot
            hold (one line naming the setting and what is allowed), on every rank; a
            ``GLOO_SOCKET_IFNAME`` or ``MASTER_ADDR`` this host cannot use
            (:func:`distsgd.runtime.network.prepare_rank`).
    """
    info = process_info()
    world = info.world_size if info is not None else 1
    cfg = _resolve(_raw_config(protocol, config, settings), world)
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if not dist.is_initialized():
        if info is None:
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            end_with_parent(cfg.dist.timeout_s + 5)
            try:
                prepare_rank(None)  # gloo's interface; the user's loop keeps its threads
            except ConfigError as e:
                if not str(e).startswith("MASTER_ADDR"):  # the store answers: tell rank 0
                    refuse_to_join(str(e), cfg.dist.timeout_s)
                raise
            join(cfg.dist.timeout_s, info)
            dist.init_process_group(
                "gloo",
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
                store=process_group_store(info.rank, timeout),
            )
    check_same_config(cfg)
    ctx = Context(cfg, info)
    ctx.optimizer_settings = server_optimizer.explicit_settings(settings, cfg)
    return ctx


class Context:
    """This rank's place in the run (returned by :func:`init`).

    Attributes:
        config: the resolved run config (λ fitted to the world size).
        rank: global rank; ``world_size``: processes in the run.
        role: ``"learner"``, ``"server"`` or ``"device"`` (SMA, local SGD).
        learner: learner index l in ``[0, λ)``, None on a server rank.
        num_learners: λ.
        device: where the model computes (``cpu``: the transport is gloo on CPU tensors).
        seed: ``train.seed``, the Sampler's default seed.
    """

    def __init__(self, cfg: RunConfig, info: ProcessInfo | None) -> None:
        self.config = cfg
        p = cfg.protocol
        self.spec = spec_for(p)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.role = self.spec.role(self.rank, cfg.dist)
        servers = cfg.dist.num_servers if self.spec.has_server else 0
        self.learner: int | None = None if self.role == "server" else self.rank - servers
        self.num_learners = p.num_learners
        self.device = torch.device("cpu")
        self.seed = cfg.train.seed
        self.heartbeats = (
            Heartbeats(self.rank, self.world_size, cfg.dist.timeout_s) if info else None
        )
        self.layout: ps.PSLayout | None = None
        self.subgroups: list[dist.ProcessGroup | None] = []
        if self.spec.has_server:
            g = self.spec.group_size(p)  # type: ignore[attr-defined]
            groups = [[servers + i * g + m for m in range(g)] for i in range(p.num_learners // g)]
            self.layout = ps.PSLayout(server_ranks=list(range(servers)), worker_groups=groups)
            # every rank creates every subgroup, in the same order (c10d)
            self.subgroups = [dist.new_group(r) if len(r) > 1 else None for r in groups]
        self.optimizer: Any = None  # the DistributedOptimizer, once built
        self.optimizer_settings: set[str] = set()  # optimizer.* the user set (init)
        self.server_state: dict[str, Any] | None = None  # protocol state after serve
        self._closed = False

    @property
    def protocol(self) -> str:
        """``protocol.name``."""
        return self.config.protocol.name

    @property
    def has_server(self) -> bool:
        """True when the protocol has a server rank (parameter server, compute groups)."""
        return self.spec.has_server

    @property
    def is_server(self) -> bool:
        """True on a parameter-server rank (it calls :meth:`serve` instead of training)."""
        return self.role == "server"

    def log(self, message: str) -> None:
        """One line on stderr, prefixed with the rank."""
        print(f"distsgd[rank {self.rank}]: {message}", file=sys.stderr, flush=True)

    def serve(
        self,
        model: nn.Module | Iterable[Tensor],
        out_dir: str | Path | None = None,
        *,
        bn_data: Iterable[Any] | None = None,
    ) -> ServeResult:
        """Server rank: apply the learners' pushes in arrival order until every learner
        has left (Rudra's parameter server, docs/protocols.md §2, or Omnivore's groups, §3:
        the same protocol object and c10d transport as ``distsgd train``).

        The protocol (``protocol.mode``/``softsync``/``staleness_lr``), with the
        optimizer the learners built (its class and hyperparameters:
        :mod:`distsgd.torch.server_optimizer`; gathered here through the run's
        store from the learners' ``DistributedOptimizer``), starts from ``model``'s parameters, which every learner pulls first, and is restored from
        :meth:`load_state_dict` when one was loaded. Each push carries the base rate α0
        of the learner's optimizer at that moment; the server applies the protocol's
        rule to it (α0/n for ``staleness_lr = "softsync"``, and so on). At the end the
        central weights are copied into ``model``; a module's BatchNorm running
        statistics are then recomputed for them over ``bn_data``
        (:func:`recalibrate_batchnorm`, the trainer's precise-BN rule: the server runs no
        forward, so its buffers belong to no model it serves). With ``out_dir``,
        ``staleness.json`` (``{"counts": {σ: n}}``), ``summary.json`` and, for a module,
        ``model.pt`` (its ``state_dict``, with a ``.sha256`` sidecar, as ``distsgd
        train``'s) are written.

        Args:
            model: the module (or iterable of its parameter tensors) whose parameters are
                the flat vector ``[P]``; it holds the central model at the end.
            out_dir: where to write the files above (None: nothing is written).
            bn_data: batches of training inputs (tensors, or ``(inputs, …)`` tuples such
                as a ``DataLoader`` yields) for the BatchNorm recalibration; a last
                smaller batch is left out. None with a BatchNorm model: the buffers stay
                as given (a warning says so).

        Raises:
            RuntimeError: this rank is not a server rank.
            ValueError: ``bn_data`` holds no batch.
            ps.LearnerLost: a learner was lost under ``mode = "hardsync"``, or all were.
            ConfigError: the learners' optimizer cannot run on the server (one line
                naming what differs; the learners raise it too).
            TrainingDiverged: a learner's loss (or gradient) was NaN or infinite: the
                server stops the run (the learners raise it at their next step).
        """
        if not self.is_server or self.layout is None:
            raise RuntimeError(f"serve() is for server ranks; rank {self.rank} is a {self.role}")
        layout = self.layout
        params = _parameters(model)
        built = server_optimizer.gather(self, None)  # the learners' optimizer
        config = server_optimizer.server_config(self.config, self.optimizer_settings, built)
        protocol = cast(AsynchronousProtocol, build_protocol(config, flatten(params)))
        if self.server_state is not None:
            protocol.load_state_dict(self.server_state)
        order: list[tuple[int, int]] = []
        rates: list[float] = []
        last_loss: dict[int, float] = {}  # learner index: loss of its last push
        steps: dict[int, int] = {}  # learner index: its pushes so far
        diverged: list[str] = []

        def on_push(event: ps.PushEvent) -> bool:
            order.append((event.worker, event.pulled_version))
            rates.append(event.losses[0])
            # each member sent [its rate, the guard's value, what it is: 0 nothing, 1 its
            # loss, 2 its gradient's sum] (DistributedOptimizer.step)
            members = [m - len(layout.server_ranks) for m in layout.worker_groups[event.worker]]
            values, kinds = event.losses[1::3], event.losses[2::3]
            for member, value, kind in zip(members, values, kinds, strict=True):
                steps[member] = steps.get(member, 0) + 1
                if not kind:
                    continue
                if kind == 1:
                    last_loss[member] = value
                what = "training loss" if kind == 1 else "training gradient"
                try:  # the trainer's divergence guard, its message
                    check_losses([member], [value], event.losses[0], None, steps[member], what)
                except TrainingDiverged as e:
                    diverged.append(str(e))
                    if self.heartbeats is not None:  # the learners raise it too
                        self.heartbeats.post(DIVERGED_KEY, str(e))
                    return False
            return True

        result = ps.run_server(
            protocol,
            layout,
            on_push=on_push,
            lr=lambda samples: self.config.optimizer.lr,
            push_lr=lambda floats: floats[0],
            timeout_s=self.config.dist.timeout_s,
            log=self.log,
        )
        if diverged:
            raise TrainingDiverged(diverged[0])
        write_back(protocol.eval_weights(), params)
        self.server_state = protocol.state_dict()
        bn_batches = 0
        if isinstance(model, nn.Module):
            bn_batches = _central_batchnorm(model, bn_data)
        out = ServeResult(
            num_updates=protocol.version,
            num_pushes=result.num_pushes,
            staleness_counts=dict(sorted(protocol.staleness_counts.items())),
            push_order=order,
            push_rates=rates,
            lost_ranks=list(result.lost_ranks),
            train_loss=sum(last_loss.values()) / len(last_loss) if last_loss else float("nan"),
            bn_batches=bn_batches,
        )
        if out_dir is not None:
            _write_outcome(Path(out_dir), self, out)
            if isinstance(model, nn.Module):
                save_checked(model.state_dict(), Path(out_dir) / "model.pt")
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly: the protocol's state (versions,
        vector-clock buffer, staleness histogram, central model, server momentum) on the
        server after :meth:`serve`; the protocol object's and the user optimizer's state
        (iteration, central model, momentum) on a learner."""
        state: dict[str, Any] = {"protocol": self.protocol, "rank": self.rank}
        if self.server_state is not None:
            state["server"] = self.server_state
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank (before :meth:`serve` on a server,
        after the :class:`DistributedOptimizer` is built on a learner).

        Raises:
            ValueError: the state belongs to another protocol or rank.
        """
        for key, mine in (("protocol", self.protocol), ("rank", self.rank)):
            if state.get(key) != mine:
                raise ValueError(
                    f"state has {key} = {state.get(key)!r}, this context {mine!r}: "
                    "load the state this rank saved"
                )
        if "server" in state:
            self.server_state = state["server"]
        if "optimizer" in state and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Leave the run: the learner's optimizer says goodbye to the server, the
        heartbeat stops, the process group is destroyed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.optimizer is not None:
                self.optimizer.close()
        finally:
            if self.heartbeats is not None:
                self.heartbeats.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def _parameters(model: nn.Module | Iterable[Tensor]) -> list[Tensor]:
    """The tensors of ``model`` (a module's parameters, or any iterable of tensors,
    a generator included: it is read once)."""
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    if not params or not all(isinstance(t, Tensor) for t in params):
        raise ValueError(
            "model must be an nn.Module or a non-empty iterable of tensors, got "
            f"{type(model).__name__}"
        )
    return params


def recalibrate_batchnorm(model: nn.Module, batches: Iterable[Any]) -> int:
    """Recompute ``model``'s BatchNorm running statistics for its current weights:
    precise BN, the trainer's rule (:meth:`distsgd.engine.GradientEngine.recalibrate`;
    Wu & Johnson, arXiv:2105.07576): each running mean and variance becomes the mean over
    the batches of the batch mean and unbiased variance, computed with every other layer
    as at evaluation. ``model`` itself only has its buffers changed.

    Args:
        model: any module; one without running statistics is left alone.
        batches: input tensors ``[B, ...]`` or tuples whose first item is one (a
            ``DataLoader``'s ``(x, y)``); batches of another size than the first (a last
            partial one) are left out.

    Returns:
        The number of batches used (0: the model has no running statistics).

    Raises:
        ValueError: ``batches`` holds no batch.
    """
    twin = copy.deepcopy(model)  # the engine re-points its parameters into one buffer
    engine = GradientEngine(twin)
    if not engine.has_running_statistics:
        return 0
    inputs = [b[0] if isinstance(b, tuple | list) else b for b in batches]
    if not inputs:
        raise ValueError("bn_data holds no batch: pass batches of training inputs")
    size = inputs[0].shape[0]
    inputs = [x for x in inputs if x.shape[0] == size]
    engine.recalibrate(engine.initial_weights(), torch.cat(inputs), size)
    with torch.no_grad():
        mine = dict(model.named_buffers())
        for name, buf in twin.named_buffers():
            mine[name].copy_(buf)
    return len(inputs)


def _central_batchnorm(model: nn.Module, bn_data: Iterable[Any] | None) -> int:
    """:func:`recalibrate_batchnorm` over ``bn_data``; a warning when a BatchNorm model
    gets none."""
    if bn_data is not None:
        return recalibrate_batchnorm(model, bn_data)
    if any(
        isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None
        for m in model.modules()
    ):
        warnings.warn(
            "serve(bn_data=None): the model's BatchNorm running statistics stay as given, "
            "not those of the central weights; pass batches of training inputs as bn_data",
            stacklevel=3,
        )
    return 0


def _write_outcome(out_dir: Path, ctx: Context, result: ServeResult) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = result.staleness_counts
    n = sum(counts.values())
    (out_dir / "staleness.json").write_text(
        json.dumps({"counts": {str(k): v for k, v in counts.items()}}, indent=2) + "\n"
    )
    summary = {
        "protocol": ctx.protocol,
        "settings": dataclasses.asdict(ctx.config.protocol),
        "num_processes": ctx.world_size,
        "num_updates": result.num_updates,
        "num_pushes": result.num_pushes,
        "staleness_mean": sum(k * v for k, v in counts.items()) / n if n else 0.0,
        "staleness_max": max(counts, default=0),
        "lost_ranks": result.lost_ranks,
        "train_loss": result.train_loss if math.isfinite(result.train_loss) else None,
        "bn_batches": result.bn_batches,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
