"""Any torch.optim optimizer and any torch.optim.lr_scheduler named in the config.

SGD stays the default bit for bit; another optimizer (AdamW here) runs in every protocol
and equals a single-process reference loop; its state survives state_dict round trips and
Crossbow's regrouping of replicas; a torch scheduler's rate is replayed as a pure function
of training progress; every combination that makes no sense is one ConfigError line.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import tomllib

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler, StepLR

import distsgd
from distsgd.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
    apply_override,
)
from distsgd.layout import build_protocol
from distsgd.protocols import SMA, ComputeGroups, HardSync, LocalSGD, ParameterServer, make_sgd
from distsgd.tuner.tune import tune
from tests.conftest import cli_in_process, small_config

ADAMW = "torch.optim:AdamW"
ADAMW_KWARGS = {"betas": [0.9, 0.95], "weight_decay": 0.01}
P = 7


def adamw(params):
    """The reference optimizer of these tests, as a protocol factory."""
    return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.01)


def gradients(steps: int, rows: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` gradient stacks ``[rows, P]`` of unlike scales per row."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, rows).unsqueeze(1)
    return [torch.randn(rows, P, generator=g) * scale for _ in range(steps)]


def reference_loop(w0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float]) -> torch.Tensor:
    """A plain single-process loop: torch.optim.AdamW on one parameter tensor."""
    w = w0.clone().requires_grad_(True)
    opt = adamw([w])
    for g, lr in zip(grads, lrs, strict=True):
        opt.param_groups[0]["lr"] = lr
        w.grad = g.clone()
        opt.step()
    return w.detach()


W0 = torch.linspace(-1.0, 1.0, P)
LRS = [0.01, 0.01, 0.005, 0.02, 0.01, 0.01]


# ---- (a) SGD stays the default, bit for bit -------------------------------------------


def test_default_sgd_equals_plain_torch_sgd_bit_for_bit():
    grads = gradients(len(LRS), 3)
    proto = HardSync(W0, 3, momentum=0.9, weight_decay=1e-3, nesterov=True)
    w = W0.clone()
    opt = torch.optim.SGD([w], lr=0.0, momentum=0.9, weight_decay=1e-3, nesterov=True)
    for g, lr in zip(grads, LRS, strict=True):
        proto.step(g, lr)
        opt.param_groups[0]["lr"] = lr
        w.grad = g.mean(0)
        opt.step()
    assert torch.equal(proto.eval_weights(), w)
    # the checkpoint configuration of the default is today's: older checkpoints load
    assert set(proto.state_dict()["config"]) == {
        "num_parameters",
        "num_learners",
        "momentum",
        "weight_decay",
        "nesterov",
    }


def test_default_sgd_state_round_trip_equals_torch_sgd():
    """make_sgd's optimizer (torch.optim.SGD without torch.compile's guards) keeps
    torch.optim.SGD's state: a state_dict loaded into a fresh one, or into a plain
    torch.optim.SGD, continues the same trajectory bit for bit."""
    grads = [g[0] for g in gradients(len(LRS), 1)]
    w, ref = W0.clone(), W0.clone()
    opt = make_sgd(w, 0.0, 0.9, 1e-3, nesterov=True)
    plain = torch.optim.SGD([ref], lr=0.0, momentum=0.9, weight_decay=1e-3, nesterov=True)
    for i, (g, lr) in enumerate(zip(grads, LRS, strict=True)):
        if i == 3:  # a restart from the state_dict, into each class
            state = copy.deepcopy(opt.state_dict())
            opt = make_sgd(w, 0.0, 0.9, 1e-3, nesterov=True)
            opt.load_state_dict(state)
            plain_state = copy.deepcopy(plain.state_dict())
            plain = torch.optim.SGD([ref], lr=0.0, momentum=0.9)
            plain.load_state_dict(plain_state)
        for o, p in ((opt, w), (plain, ref)):
            o.param_groups[0]["lr"] = lr
            p.grad = g.clone()
            o.step()
        assert torch.equal(w, ref)
    assert isinstance(opt, torch.optim.SGD)
    assert torch.equal(opt.state[w]["momentum_buffer"], plain.state[ref]["momentum_buffer"])


@pytest.mark.slow
def test_a_protocol_step_does_not_import_torch_dynamo():
    """A rank's default optimizer leaves torch._dynamo unimported (seconds of start-up
    per process); a torch.optim.SGD of its own would import it."""
    code = (
        "import sys, torch\n"
        "from distsgd.protocols import HardSync\n"
        "p = HardSync(torch.zeros(3), 2, momentum=0.9)\n"
        "p.step(torch.ones(2, 3), 0.1)\n"
        "sd = p.state_dict(); p.load_state_dict(sd)\n"
        "print('torch._dynamo' in sys.modules)\n"
        "torch.optim.SGD([torch.zeros(1)], lr=0.1)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]


def test_sgd_by_name_equals_torch_optim_sgd_by_import_path_in_a_run(tmp_path):
    protocol = {"name": "hardsync", "num_learners": 2, "batch_size": 16}
    train = {"max_epochs": 0, "max_samples": 512, "eval_every_samples": 256}
    by_name = small_config(protocol=protocol, train=train)
    by_path = small_config(
        protocol=protocol,
        train=train,
        optimizer={"name": "torch.optim:SGD", "kwargs": {"momentum": 0.9}},
    )
    assert by_name.optimizer.is_sgd and not by_path.optimizer.is_sgd
    distsgd.train(by_name, out_dir=tmp_path / "name")
    distsgd.train(by_path, out_dir=tmp_path / "path")
    a = torch.load(tmp_path / "name" / "checkpoint.pt", weights_only=True)["protocol"]
    b = torch.load(tmp_path / "path" / "checkpoint.pt", weights_only=True)["protocol"]
    assert a["iteration"] == b["iteration"] == 512 // 32
    assert torch.equal(a["weights"], b["weights"])
    assert torch.equal(a["optimizer"][0]["momentum_buffer"], b["optimizer"][0]["momentum_buffer"])


# ---- (b) AdamW in every protocol equals a single-process loop --------------------------


def test_hardsync_with_adamw_equals_the_plain_loop():
    for num_learners in (1, 3):
        grads = gradients(len(LRS), num_learners)
        proto = HardSync(W0, num_learners, make_optimizer=adamw)
        for g, lr in zip(grads, LRS, strict=True):
            proto.step(g, lr)
        expected = reference_loop(W0, [g.mean(0) for g in grads], LRS)
        assert torch.equal(proto.eval_weights(), expected)


def test_parameter_server_and_groups_with_adamw_equal_the_plain_loop():
    grads = gradients(len(LRS), 1)
    expected = reference_loop(W0, [g[0] for g in grads], LRS)
    ps = ParameterServer(W0, 1, softsync=1, make_optimizer=adamw)
    cg = ComputeGroups(W0, 2, num_groups=1, make_optimizer=adamw)
    for g, lr in zip(grads, LRS, strict=True):
        w, v = ps.pull(0)
        ps.push(0, g[0], v, lr)
        w, v = cg.pull(0)
        cg.push(0, g[0], v, lr)  # the group's mean gradient
    assert torch.equal(ps.eval_weights(), expected)
    assert torch.equal(cg.eval_weights(), expected)


def test_sma_one_replica_without_averaging_is_the_plain_loop():
    # SPEC's equivalence: k = 1, α = 0, μ_z = 0 is plain training of the replica
    rising = sorted(LRS)  # a lower rate would reset the replica to z (Crossbow's rule)
    grads = gradients(len(rising), 1)
    sma = SMA(W0, 1, alpha=0.0, central_momentum=0.0, make_optimizer=adamw)
    for g, lr in zip(grads, rising, strict=True):
        sma.step(g, lr)
    expected = reference_loop(W0, [g[0] for g in grads], rising)
    assert torch.equal(sma.learner_weights(0), expected)


def assert_rows_match(stack: torch.Tensor, rows: list[torch.Tensor]) -> None:
    # one optimizer over a [λ, P] stack against λ optimizers of [P] rows: the same
    # elementwise maths, possibly through other vectorised kernels (fused multiply-adds)
    # on some CPUs; a few float32 ulps of the weights (|w| <= 2 here) apart
    for row, expected in zip(stack, rows, strict=True):
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=1e-6)


def test_replica_optimizers_are_per_replica_adamw():
    rates = [0.01] * len(LRS)  # no drop: SMA keeps its replicas
    grads = gradients(len(LRS), 3)
    sma = SMA(W0, 3, alpha=0.0, central_momentum=0.0, make_optimizer=adamw)
    local = LocalSGD(W0, 3, average_every=100, make_optimizer=adamw)
    for g, lr in zip(grads, rates, strict=True):
        sma.step(g, lr)
        local.step(g, lr)
    rows = [reference_loop(W0, [g[j] for g in grads], rates) for j in range(3)]
    assert_rows_match(sma.replicas, rows)
    assert_rows_match(local.replicas, rows)


def test_regrouping_carries_adam_state_like_a_copied_replica():
    """Crossbow's auto-tuner adds a copy of each device's last replica (weights and
    optimizer state) and later removes it; with α = 0 and μ_z = 0 the replicas are
    independent, so each must follow its own AdamW loop, the copy continuing its
    original's moments and step count."""
    devices, k = 2, 2
    sma = SMA(W0, devices * k, k, alpha=0.0, central_momentum=0.0, make_optimizer=adamw)
    local = LocalSGD(
        W0, devices * k, average_every=100, replicas_per_device=k, make_optimizer=adamw
    )
    refs = [W0.clone() for _ in range(devices * k)]
    ref_opts = [adamw([w]) for w in refs]

    def step_all(grads: torch.Tensor) -> None:
        sma.step(grads, 0.01)
        local.step(grads, 0.01)
        for w, opt, g in zip(refs, ref_opts, grads, strict=True):
            w.grad = g.clone()
            opt.step()

    for g in gradients(3, devices * k, seed=1):
        step_all(g)
    sma.add_replica_per_device()
    local.add_replica_per_device()
    # the reference: each device gets a copy of its last replica and of its optimizer
    for d in (1, 0):
        last = d * k + k - 1
        w = refs[last].detach().clone()
        opt = adamw([w])
        opt.load_state_dict(copy.deepcopy(ref_opts[last].state_dict()))
        refs.insert(last + 1, w)
        ref_opts.insert(last + 1, opt)
    assert sma.num_learners == local.num_learners == 6
    assert sma._opt.state[sma.replicas]["exp_avg"].shape == (6, P)
    for g in gradients(3, 6, seed=2):
        step_all(g)
    assert_rows_match(sma.replicas, refs)
    assert_rows_match(local.replicas, refs)
    sma.remove_replica_per_device()
    local.remove_replica_per_device()
    del refs[5], ref_opts[5], refs[2], ref_opts[2]
    for g in gradients(2, 4, seed=3):
        step_all(g)
    assert_rows_match(sma.replicas, refs)
    assert_rows_match(local.replicas, refs)


PROTOCOLS = {
    "hardsync": lambda: HardSync(W0, 2, make_optimizer=adamw),
    "parameter_server": lambda: ParameterServer(W0, 2, softsync=2, make_optimizer=adamw),
    "compute_groups": lambda: ComputeGroups(W0, 4, num_groups=2, make_optimizer=adamw),
    "sma": lambda: SMA(W0, 4, 2, make_optimizer=adamw),
    "local_sgd": lambda: LocalSGD(W0, 4, average_every=2, make_optimizer=adamw),
}


def advance(proto, grads: list[torch.Tensor]) -> None:
    for i, g in enumerate(grads):
        if isinstance(proto, HardSync | SMA | LocalSGD):
            proto.step(g, 0.01)
        else:  # asynchronous: worker i mod W pushes on the weights it pulled
            worker = i % proto.num_workers
            _, version = proto.pull(worker)
            proto.push(worker, g[0], version, 0.01)


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_adamw_state_survives_a_state_dict_round_trip(name, tmp_path):
    make = PROTOCOLS[name]
    rows = 4 if name in ("sma", "local_sgd") else 2
    before, after = gradients(3, rows, seed=4), gradients(3, rows, seed=5)
    whole = make()
    advance(whole, before + after)
    half = make()
    advance(half, before)
    torch.save(half.state_dict(), tmp_path / "state.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    advance(resumed, after)
    assert torch.equal(resumed.eval_weights(), whole.eval_weights())
    # the Adam state is in the snapshot, and an SGD protocol refuses it
    state = whole.state_dict()
    inner = state.get("server", state)
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(inner["optimizer"][0])
    assert "AdamW" in inner["config"]["optimizer"]
    sgd_twin = {
        "hardsync": lambda: HardSync(W0, 2),
        "parameter_server": lambda: ParameterServer(W0, 2, softsync=2),
        "compute_groups": lambda: ComputeGroups(W0, 4, num_groups=2),
        "sma": lambda: SMA(W0, 4, 2),
        "local_sgd": lambda: LocalSGD(W0, 4, average_every=2),
    }[name]()
    with pytest.raises(ValueError, match="optimizer"):
        sgd_twin.load_state_dict(state)


def test_build_protocol_passes_the_named_optimizer_everywhere():
    optimizer = {"name": ADAMW, "kwargs": ADAMW_KWARGS}
    for protocol in (
        {"name": "hardsync"},
        {"name": "plain", "num_learners": 1},
        {"name": "parameter_server", "num_learners": 2, "mode": "async"},
        {"name": "compute_groups", "num_learners": 4, "num_groups": 2},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 2},
        {"name": "local_sgd", "num_learners": 4},
    ):
        proto = build_protocol(
            RunConfig.from_dict({"protocol": protocol, "optimizer": optimizer}), W0
        )
        server = proto.server if isinstance(proto, ComputeGroups) else proto
        opt = server._opt
        assert isinstance(opt, torch.optim.AdamW), protocol
        assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.01
        assert server.momentum == 0.0  # the SGD settings do not reach another optimizer


# ---- (c) a short run of every protocol with AdamW on the simulator ---------------------


@pytest.mark.parametrize(
    "protocol",
    [
        {"name": "hardsync", "num_learners": 2},
        {"name": "plain", "num_learners": 1},
        {"name": "parameter_server", "num_learners": 4, "softsync": 2},
        {"name": "compute_groups", "num_learners": 4, "num_groups": 2},
        {"name": "sma", "num_learners": 4, "replicas_per_device": 2},
        {"name": "local_sgd", "num_learners": 4, "replicas_per_device": 2, "average_every": 2},
    ],
    ids=lambda p: p["name"],
)
def test_every_protocol_trains_with_adamw_on_the_simulator(protocol, tmp_path):
    cfg = small_config(
        protocol={**protocol, "batch_size": 16},
        optimizer={"name": ADAMW, "lr": 0.003, "kwargs": ADAMW_KWARGS},
        schedule={"kind": "torch.optim.lr_scheduler:CosineAnnealingLR", "kwargs": {"T_max": 4}},
        train={"max_epochs": 0, "max_samples": 512, "eval_every_samples": 256},
    )
    s = distsgd.train(cfg, out_dir=tmp_path)
    assert s["status"] == "completed" and s["samples"] >= 512
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open()]
    # AdamW at 0.003 on the synthetic clusters: the evaluation loss falls from the start
    assert records[-1]["eval_loss"] < records[0]["eval_loss"]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["protocol"]
    inner = state.get("server", state)
    assert "torch.optim.adamw:AdamW" in inner["config"]["optimizer"]
    assert {"exp_avg", "exp_avg_sq"} <= set(inner["optimizer"][0])
    written = RunConfig.from_toml(tmp_path / "config.toml")
    assert written.optimizer == cfg.optimizer and written.schedule == cfg.schedule


def test_resume_with_adamw_and_a_scheduler_equals_the_uninterrupted_run(tmp_path):
    def cfg(epochs: int) -> RunConfig:
        return small_config(
            protocol={"name": "hardsync", "num_learners": 2, "batch_size": 32},
            optimizer={"name": ADAMW, "lr": 0.003, "kwargs": ADAMW_KWARGS},
            schedule={
                "kind": "torch.optim.lr_scheduler:StepLR",
                "kwargs": {"step_size": 1, "gamma": 0.5},
                "steps_per_epoch": 4.0,
            },
            train={"max_epochs": epochs},
        )

    distsgd.train(cfg(2), out_dir=tmp_path / "full")
    distsgd.train(cfg(1), out_dir=tmp_path / "half")
    distsgd.train(resume=tmp_path / "half", overrides=["train.max_epochs=2"])
    full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["protocol"]
    half = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=True)["protocol"]
    assert torch.equal(full["weights"], half["weights"])
    assert torch.equal(full["optimizer"][0]["exp_avg"], half["optimizer"][0]["exp_avg"])


# ---- (d) the parameter server with AdamW on real processes -----------------------------


@pytest.mark.slow
def test_parameter_server_softsync_with_adamw_on_real_processes(tmp_path):
    cfg = small_config(
        runtime="dist",
        protocol={"name": "parameter_server", "num_learners": 2, "softsync": 1, "batch_size": 16},
        optimizer={"name": ADAMW, "lr": 0.003, "kwargs": ADAMW_KWARGS},
        train={
            "max_epochs": 0,
            "max_samples": 512,
            "eval_every_samples": 256,
            "tensorboard": False,
        },
        dist={"timeout_s": 60.0},
    )
    s = distsgd.train(cfg, out_dir=tmp_path)
    assert s["status"] == "completed" and s["runtime"] == "dist" and s["num_processes"] == 3
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["protocol"]
    server = state.get("server", state)
    opt = server["optimizer"][0]
    # AdamW took one step per update of the server (1-softsync: 2 pushes each)
    assert server["version"] == s["iterations"] > 0
    assert int(opt["step"]) == server["version"]
    assert opt["exp_avg"].shape == server["weights"].shape
    assert "AdamW" in server["config"]["optimizer"]


@pytest.mark.slow
def test_sma_with_adamw_on_real_processes_equals_the_simulator(tmp_path):
    """The replicas' local AdamW on two device ranks of two replicas each: SMA's schedule is
    deterministic, so the replicas equal the simulator's (SPEC's sim ≡ dist equivalence)."""
    stacks = {}
    for runtime in ("sim", "dist"):
        cfg = small_config(
            runtime=runtime,
            protocol={"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 16},
            optimizer={"name": ADAMW, "lr": 0.003, "kwargs": ADAMW_KWARGS},
            train={"max_epochs": 0, "max_samples": 512, "eval_every_samples": 256},
            dist={"timeout_s": 60.0},
        )
        distsgd.train(cfg, out_dir=tmp_path / runtime)
        state = torch.load(tmp_path / runtime / "checkpoint.pt", weights_only=True)
        ranks = state["runtime"].get("ranks")
        protos = [r["protocol"] for r in ranks] if ranks else [state["protocol"]]
        stacks[runtime] = torch.cat([p["replicas"] for p in protos])
    # each rank applies the same float32 maths to its rows as the simulator's one stack;
    # the bound leaves room for another kernel order on another CPU (measured: equal)
    torch.testing.assert_close(stacks["dist"], stacks["sim"], rtol=0, atol=1e-6)


# ---- (e) refusals: one line each ------------------------------------------------------


def one_line_error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict(raw)
    message = str(info.value)
    assert "\n" not in message and "is not allowed" in message
    return message


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"optimizer": {"name": "adam"}}, ["optimizer.name = 'adam'", "'torch.optim:AdamW'"]),
        ({"optimizer": {"name": "no_such_pkg:Opt"}}, ["optimizer.name", "No module named"]),
        ({"optimizer": {"name": "torch.optim:Nope"}}, ["optimizer.name", "has no 'Nope'"]),
        ({"optimizer": {"name": "torch.nn:Linear"}}, ["optimizer.name", "Optimizer subclass"]),
        ({"optimizer": {"name": "torch.optim:Adafactor"}}, ["optimizer.name", "coordinate-wise"]),
        ({"optimizer": {"name": "torch.optim:LBFGS"}}, ["optimizer.name", "closure"]),
        ({"optimizer": {"name": "torch.optim:SparseAdam"}}, ["optimizer.name", "dense"]),
        ({"optimizer": {"name": "torch.optim:Muon"}}, ["optimizer.name", "2D"]),
        (
            {"optimizer": {"name": ADAMW, "kwargs": {"betas": 3}}},
            ["optimizer.kwargs = {'betas': 3}", "torch.optim:AdamW"],
        ),
        ({"optimizer": {"name": ADAMW, "kwargs": {"lr": 0.1}}}, ["optimizer.kwargs", "'lr'"]),
        ({"optimizer": {"kwargs": {"dampening": 0.1}}}, ["optimizer.kwargs", "'sgd'"]),
        ({"optimizer": {"name": ADAMW, "momentum": 0.5}}, ["optimizer.momentum = 0.5", ADAMW]),
        ({"optimizer": {"name": ADAMW, "nesterov": True}}, ["optimizer.nesterov", ADAMW]),
        (
            {"optimizer": {"name": "torch.optim:Rprop", "weight_decay": 0.1}},
            ["optimizer.weight_decay = 0.1", "no weight_decay"],
        ),
        (
            {"optimizer": {"name": ADAMW, "weight_decay": 0.1, "kwargs": {"weight_decay": 0.2}}},
            ["optimizer.weight_decay = 0.1", "optimizer.kwargs"],
        ),
        (
            {
                "protocol": {"name": "parameter_server", "server_optimizer": "adagrad"},
                "optimizer": {"name": ADAMW},
            },
            ["protocol.server_optimizer = 'adagrad'", "optimizer.name = 'torch.optim:AdamW'"],
        ),
        (
            {
                "protocol": {
                    "name": "compute_groups",
                    "num_groups": 2,
                    "momentum_compensation": True,
                },
                "optimizer": {"name": ADAMW},
            },
            ["protocol.momentum_compensation = True", "optimizer.name = 'torch.optim:AdamW'"],
        ),
        ({"schedule": {"kind": "cosine"}}, ["schedule.kind = 'cosine'", "CosineAnnealingLR"]),
        ({"schedule": {"kind": "no_such_pkg:S"}}, ["schedule.kind", "No module named"]),
        ({"schedule": {"kind": "torch.optim:SGD"}}, ["schedule.kind", "LRScheduler subclass"]),
        (
            {"schedule": {"kind": "torch.optim.lr_scheduler:ReduceLROnPlateau"}},
            ["schedule.kind", "metric"],
        ),
        (
            {"schedule": {"kind": "torch.optim.lr_scheduler:CosineAnnealingLR"}},
            ["schedule.kwargs = {}", "T_max"],
        ),
        ({"schedule": {"kwargs": {"T_max": 3}}}, ["schedule.kwargs", "'constant'"]),
        (
            {"schedule": {"kind": "torch.optim.lr_scheduler:StepLR", "steps_per_epoch": 0}},
            ["schedule.steps_per_epoch = 0"],
        ),
        ({"optimizer": {"kwargs": [1]}}, ["optimizer.kwargs = [1]", "table"]),
    ],
)
def test_bad_optimizer_and_schedule_settings_are_one_line(raw, fragments):
    message = one_line_error(raw)
    for fragment in fragments:
        assert fragment in message


def test_a_scheduler_that_cannot_reach_a_step_is_one_line_when_asked():
    sched = ScheduleConfig(
        kind="torch.optim.lr_scheduler:OneCycleLR", kwargs={"max_lr": 0.1, "total_steps": 3}
    )
    sched.lr_at(0.1, 2.0)
    with pytest.raises(ConfigError, match="schedule.kind .* takes 5 steps") as info:
        sched.lr_at(0.1, 5.0)
    assert "\n" not in str(info.value)


def test_protocols_refuse_sgd_settings_and_rules_with_a_factory():
    with pytest.raises(ValueError, match="momentum = 0.9 is not allowed with make_optimizer"):
        HardSync(W0, 1, momentum=0.9, make_optimizer=adamw)
    with pytest.raises(
        ValueError, match="make_optimizer is not allowed with optimizer = 'adagrad'"
    ):
        ParameterServer(W0, 1, softsync=1, optimizer="adagrad", make_optimizer=adamw)
    with pytest.raises(ValueError, match="momentum_compensation = True is not allowed"):
        ComputeGroups(W0, 2, 2, momentum_compensation=True, make_optimizer=adamw)
    with pytest.raises(ValueError, match="expected a torch.optim.Optimizer"):
        HardSync(W0, 1, make_optimizer=lambda params: params)
    with pytest.raises(ValueError, match="exactly param"):
        HardSync(W0, 1, make_optimizer=lambda params: adamw([torch.zeros(2)]))


def test_tune_refuses_another_optimizer_or_a_torch_scheduler(tmp_path):
    for raw in (
        {"optimizer": {"name": ADAMW}},
        {"schedule": {"kind": "torch.optim.lr_scheduler:StepLR", "kwargs": {"step_size": 1}}},
    ):
        cfg = RunConfig.from_dict(
            {"data": {"dataset": "synthetic"}, "model": {"name": "mlp"}, **raw}
        )
        with pytest.raises(ConfigError, match="for distsgd tune") as info:
            tune(cfg, tmp_path / "tune", progress=False)
        assert "\n" not in str(info.value)
        assert not (tmp_path / "tune").exists()  # nothing written


def test_cli_bad_optimizer_is_one_line_exit_2(tmp_path):
    argv = ["train", "--set", "optimizer.name=torch.optim:Adafactor", "--out", str(tmp_path / "r")]
    r = cli_in_process(*argv, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distsgd: error: optimizer.name")
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


# ---- settings: TOML, --set, copies ----------------------------------------------------


def test_kwargs_from_set_and_toml_round_trip():
    raw: dict = {}
    for item in (
        f"optimizer.name={ADAMW}",
        "optimizer.kwargs.betas=[0.9, 0.95]",
        "optimizer.kwargs.eps=1e-6",
        "schedule.kind=torch.optim.lr_scheduler:CosineAnnealingLR",
        "schedule.kwargs={T_max = 10, eta_min = 0.001}",
    ):
        apply_override(raw, item)
    cfg = RunConfig.from_dict(raw)
    assert cfg.optimizer.kwargs == {"betas": [0.9, 0.95], "eps": 1e-6}
    assert cfg.schedule.kwargs == {"T_max": 10, "eta_min": 0.001}
    text = cfg.to_toml()
    assert RunConfig.from_dict(tomllib.loads(text)) == cfg
    # copies and pickles of a config whose schedule has been replayed
    cfg.schedule.lr_at(0.1, 3.0)
    assert pickle.loads(pickle.dumps(cfg)).schedule.lr_at(0.1, 3.0) == cfg.schedule.lr_at(0.1, 3.0)
    assert copy.deepcopy(cfg).schedule.lr_at(0.1, 2.0) == cfg.schedule.lr_at(0.1, 2.0)


@pytest.mark.parametrize(
    "name",
    [
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "RMSprop",
        "NAdam",
        "RAdam",
        "Adamax",
        "Adadelta",
        "ASGD",
        "Rprop",
    ],
)
def test_the_coordinate_wise_torch_optimizers_are_accepted(name):
    o = OptimizerConfig(name=f"torch.optim:{name}")
    assert o.optimizer_factory() is not None


def test_weight_decay_maps_to_the_optimizers_argument():
    make = OptimizerConfig(name=ADAMW, lr=0.1, weight_decay=0.05).optimizer_factory()
    opt = make([torch.zeros(3)])
    assert opt.defaults["weight_decay"] == 0.05 and opt.defaults["lr"] == 0.1
    # 0 (the default) leaves the class's own default
    make = OptimizerConfig(name=ADAMW).optimizer_factory()
    assert (
        make([torch.zeros(3)]).defaults["weight_decay"]
        == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]
    )


# ---- (f) lr_at replays a torch scheduler ---------------------------------------------


def scheduler_sequence(cls, kwargs: dict, base_lr: float, steps: int) -> list[float]:
    """The rates a plain loop sees: the optimizer's rate before each of ``steps`` epochs,
    ``scheduler.step()`` at the end of each."""
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=base_lr)
    sched = cls(opt, **kwargs)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        w.grad = torch.zeros(1)
        opt.step()
        sched.step()
    return rates


def test_lr_at_equals_the_scheduler_in_a_plain_loop_and_after_going_back():
    kwargs = {"T_max": 6, "eta_min": 0.001}
    sched = ScheduleConfig(kind="torch.optim.lr_scheduler:CosineAnnealingLR", kwargs=kwargs)
    expected = scheduler_sequence(CosineAnnealingLR, kwargs, 0.1, 15)
    # one step per epoch: every fraction of epoch e has the rate of epoch e
    assert [sched.lr_at(0.1, e + 0.5) for e in range(15)] == expected
    assert [sched.lr_at(0.1, float(e)) for e in range(15)] == expected
    # a resumed run asks for an earlier epoch: replayed from scratch
    assert sched.lr_at(0.1, 4.25) == expected[4]
    assert sched.lr_at(0.1, 12.0) == expected[12]
    # another base rate scales it
    assert sched.lr_at(0.2, 3.0) == scheduler_sequence(CosineAnnealingLR, kwargs, 0.2, 4)[3]


def test_steps_per_epoch_and_warmup_compose():
    kwargs = {"step_size": 3, "gamma": 0.5}
    sched = ScheduleConfig(
        kind="torch.optim.lr_scheduler:StepLR",
        kwargs=kwargs,
        steps_per_epoch=4.0,
        warmup_epochs=1.0,
    )
    expected = scheduler_sequence(StepLR, kwargs, 0.1, 40)
    for samples in range(0, 10 * 1000, 125):  # a 1000-sample epoch, 250 samples per step
        epoch = samples / 1000
        warmup = 0.1 + 0.9 * epoch if epoch < 1 else 1.0
        assert sched.lr_at(0.1, epoch) == expected[samples // 250] * warmup


class CountingLR(LRScheduler):
    """A linear decay that counts its constructions and steps (the replay's cost)."""

    built = 0
    steps = 0

    def __init__(self, optimizer, total: int) -> None:
        self.total = total
        CountingLR.built += 1
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        CountingLR.steps += 1
        factor = max(0.0, 1 - self.last_epoch / self.total)
        return [base * factor for base in self.base_lrs]


def test_monotone_queries_replay_each_step_once():
    sched = ScheduleConfig(kind="tests.test_optimizers:CountingLR", kwargs={"total": 100})
    CountingLR.built = CountingLR.steps = 0
    rates = [sched.lr_at(1.0, e / 10) for e in range(1000)]  # 100 epochs, 10 queries each
    assert rates[::10] == [pytest.approx(max(0.0, 1 - e / 100)) for e in range(100)]
    # one construction (its initial get_lr) and one get_lr per step to epoch 99
    assert CountingLR.built == 1 and CountingLR.steps == 1 + 99
    sched.lr_at(1.0, 50.0)  # backwards: one replay from scratch
    assert CountingLR.built == 2 and CountingLR.steps == 100 + 1 + 50
