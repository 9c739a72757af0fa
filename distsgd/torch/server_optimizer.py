"""The parameter server's optimizer under the drop-in: the one the user built.

Every learner describes its ``torch.optim`` optimizer (class and hyperparameters) when
its :class:`~distsgd.torch.DistributedOptimizer` is built; the server rank gathers the
descriptions in :meth:`~distsgd.torch.Context.serve` (through the run's store; every
rank reads them all) and builds the same optimizer over the flat central weights
``[P]``, as ``distsgd train``'s server builds the ``[optimizer]`` section's
(:meth:`distsgd.config.OptimizerConfig.optimizer_factory`). ``torch.optim.SGD`` without
dampening is ``name = "sgd"`` with its momentum, weight decay and Nesterov flag (the
protocols' own SGD); any other class is its import path with its hyperparameters as
``kwargs``. Every rank refuses, with one line naming what differs, optimizers that the
server cannot run as built: parameter groups with different hyperparameters, learners
with different optimizers, or ``init``/config optimizer settings other than the
optimizer's own.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import torch
import torch.distributed as dist

from distsgd.config import ConfigError, OptimizerConfig, RunConfig

__all__ = ["describe", "gather", "server_config"]

_SGD_ONLY = ("momentum", "weight_decay", "nesterov")
_KEY = "drop-in/optimizer"  # the run store's key of a learner's description, /<rank>


def describe(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``[optimizer]`` settings that build ``optimizer`` over one flat vector:
    ``{"name", "lr", "kwargs"}`` (plus ``momentum``, ``weight_decay``, ``nesterov`` for
    plain SGD), or ``{"error": one line}`` when no single optimizer can stand for it."""
    groups = optimizer.param_groups
    keys = [k for k in optimizer.defaults if k != "params"]
    for i, group in enumerate(groups[1:], start=1):
        for k in keys:
            if group.get(k) != groups[0].get(k):
                return {
                    "error": f"param group {i} has {k} = {group.get(k)!r} where group 0 has "
                    f"{groups[0].get(k)!r}: the parameter server steps one flat vector with "
                    "one set of hyperparameters"
                }
    first = groups[0]
    cls = type(optimizer)
    lr = float(first["lr"])
    if cls is torch.optim.SGD and not first.get("dampening") and not first.get("maximize"):
        settings = {k: first[k] for k in _SGD_ONLY}
        return {"name": "sgd", "lr": lr, "kwargs": {}, **settings}
    accepted = _keywords(cls)
    kwargs = {
        k: list(v) if isinstance(v, tuple) else v
        for k in keys
        if k != "lr" and (v := first.get(k)) is not None and (accepted is None or k in accepted)
    }
    module = "torch.optim" if getattr(torch.optim, cls.__name__, None) is cls else cls.__module__
    return {"name": f"{module}:{cls.__qualname__}", "lr": lr, "kwargs": kwargs}


def _keywords(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(...)`` takes (None: any)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def gather(ctx: Any, description: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """Every rank's description (None on a server rank): each learner posts its own on
    the run's store and every rank waits for the learners' for as long as they beat
    (:meth:`~distsgd.runtime.launch.Heartbeats.wait_for`: a learner loading its data
    for longer than ``timeout_s`` is not lost). Without heartbeats (no torchrun), one
    ``all_gather_object``.

    Raises:
        PeerLost: a learner's heartbeat stopped before it posted its optimizer.
    """
    heartbeats = ctx.heartbeats
    if heartbeats is None:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, description)
        return out
    if description is not None:
        heartbeats.post(f"{_KEY}/{ctx.rank}", json.dumps(description, default=repr))
    servers = set(ctx.layout.server_ranks) if ctx.layout is not None else set()
    out = []
    for r in range(ctx.world_size):
        if r in servers:
            out.append(None)
            continue
        heartbeats.wait_for(f"{_KEY}/{r}", r)
        out.append(json.loads(heartbeats.posted(f"{_KEY}/{r}")))
    return out


def server_config(
    cfg: RunConfig, explicit: set[str], descriptions: list[dict[str, Any] | None]
) -> RunConfig:
    """``cfg`` with the ``[optimizer]`` of the learners' optimizer (the same on every rank).

    Args:
        cfg: the run's config.
        explicit: the ``optimizer.*`` settings the user gave through ``init`` or its
            config; each must agree with the optimizer built.
        descriptions: :func:`gather`'s list, one per rank.

    Raises:
        ConfigError: one line naming the first difference (see the module).
    """
    if cfg.protocol.server_optimizer == "adagrad":  # Rudra's AdaGrad server, as configured
        return cfg
    mine = [(r, d) for r, d in enumerate(descriptions) if d is not None]
    if not mine:
        return cfg
    rank, first = mine[0]
    if "error" in first:
        raise ConfigError(
            f"the optimizer of rank {rank} cannot run on the server: {first['error']}"
        )
    for r, d in mine[1:]:
        if d != first:
            raise ConfigError(
                f"the learners built different optimizers: rank {rank} {_show(first)}, rank "
                f"{r} {_show(d)}; the server runs one"
            )
    lr = first["lr"] if first["lr"] > 0 else cfg.optimizer.lr
    fields = {k: v for k, v in first.items() if k != "lr"}
    built = OptimizerConfig(**{**fields, "lr": lr})
    for key in sorted(explicit - {"lr"}):
        configured, theirs = getattr(cfg.optimizer, key), _effective(built, key)
        if configured != theirs:
            raise ConfigError(
                f"optimizer.{key} = {configured!r} is not allowed: the server runs the "
                f"optimizer the learners built ({_show(first)}), whose {key} is {theirs!r}; "
                "leave the setting out or build that optimizer"
            )
    return cfg.replace(optimizer=built)


def _effective(built: OptimizerConfig, key: str) -> Any:
    """The value of ``optimizer.key`` that ``built`` amounts to."""
    if built.is_sgd or key in ("name", "kwargs"):
        return getattr(built, key)
    return built.kwargs.get(key, {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}[key])


def _show(d: dict[str, Any]) -> str:
    if "error" in d:
        return "(" + d["error"] + ")"
    settings = {k: v for k, v in d.items() if k not in ("name", "kwargs", "lr")}
    settings.update(d["kwargs"])
    inner = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return f"{d['name']}(lr={d['lr']!r}{', ' if inner else ''}{inner})"


def explicit_settings(settings: dict[str, Any], cfg: RunConfig) -> set[str]:
    """The ``optimizer.*`` settings the user gave: ``init``'s keywords of that section and
    the config's fields that differ from :class:`OptimizerConfig`'s defaults."""
    given = {k for k in settings if k in _SGD_ONLY}
    default = OptimizerConfig()
    for f in dataclasses.fields(OptimizerConfig):
        if getattr(cfg.optimizer, f.name) != getattr(default, f.name):
            given.add(f.name)
    return given
