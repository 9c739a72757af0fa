"""Communication written once: what a synchronous protocol exchanges (its all-reduce)
against how each runtime carries it out, and the import rules that keep it so."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distsgd
import distsgd.torch as dsgd
from distsgd.config import ClusterConfig, DataConfig
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.protocols import SMA, AllReduce, DiLoCo, HardSync, LocalSGD, SynchronousProtocol
from distsgd.runtime.dist import all_reduce
from distsgd.runtime.sim import DeviceProfile, SimRuntime

ROOT = Path(__file__).resolve().parents[1]
P = 10
W0 = torch.randn(P, generator=torch.Generator().manual_seed(3))


def _grads(t: int, lam: int) -> torch.Tensor:
    return torch.randn(lam, P, generator=torch.Generator().manual_seed(100 + t))


def _exchange_between(devices: list[SynchronousProtocol], grads: torch.Tensor, lr: float) -> None:
    """One iteration of ``devices`` as separate processes: each one's exchange step on its
    rows of ``grads``, the all-reduce of their payloads (the sum, or the mean over all
    rows), each one's rule applied to the total."""
    k = grads.shape[0] // len(devices)
    exchanges = [d.exchange_step(grads[i * k : (i + 1) * k], lr) for i, d in enumerate(devices)]
    if exchanges[0] is None:
        assert all(e is None for e in exchanges)
        return
    total = torch.stack([e.payload.sum(0) for e in exchanges]).sum(0)
    if exchanges[0].mean:
        total /= sum(e.payload.shape[0] for e in exchanges)
    for e in exchanges:
        e.apply(total)


def _eval_between(devices: list[SynchronousProtocol]) -> torch.Tensor:
    exchanges = [d.eval_exchange() for d in devices]
    if exchanges[0] is None:
        return devices[0].eval_weights()
    total = torch.stack([e.payload.sum(0) for e in exchanges]).sum(0)
    return exchanges[0].apply(total / sum(e.payload.shape[0] for e in exchanges))


PROTOCOLS = {
    "hardsync": lambda lam, k: HardSync(W0, lam, momentum=0.9),
    "sma": lambda lam, k: SMA(W0, lam, replicas_per_device=k, alpha=0.25, momentum=0.9),
    "local_sgd": lambda lam, k: LocalSGD(W0, lam, average_every=3, replicas_per_device=k),
    "diloco": lambda lam, k: DiLoCo(W0, lam, average_every=3, replicas_per_device=k),
}


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_exchange_over_two_devices_equals_one_process(name):
    """SPEC §1, §4, §5: a protocol split over two devices whose exchanges are all-reduced
    follows the protocol that holds every learner in one process (:meth:`step`)."""
    make = PROTOCOLS[name]
    lam, k = 4, 2
    whole = make(lam, k)
    devices = [make(k, k), make(k, k)]
    for t in range(7):
        grads = _grads(t, lam)
        whole.step(grads, lr=0.1)
        _exchange_between(devices, grads, lr=0.1)
        # the same rows summed as (r0 + r1) + (r2 + r3) instead of one sum of 4 (hardsync's
        # mean gradient, local SGD's mean replica): reordered float32 sums of O(1) values,
        # ~1e-7 per step, carried by momentum over 7 steps: bound 1e-5.
        torch.testing.assert_close(_eval_between(devices), whole.eval_weights(), rtol=0, atol=1e-5)
    assert devices[0].iteration == whole.iteration == 7


def test_sma_reset_on_a_drop_of_the_rate_is_announced_once_per_drop():
    sma = SMA(W0, 2, alpha=0.25, momentum=0.9)
    sma.step(_grads(0, 2), lr=0.1)
    assert not sma.begin_iteration(0.2)  # a rise does not reset
    assert sma.begin_iteration(0.05)
    assert torch.equal(sma.replicas, sma.eval_weights().expand(2, P))
    sma.step(_grads(1, 2), lr=0.05)
    assert not sma.begin_iteration(0.05)


def test_hardsync_shares_weights_and_others_do_not():
    assert HardSync(W0, 2).shares_weights
    assert not SMA(W0, 2).shares_weights and not LocalSGD(W0, 2, 2).shares_weights
    with pytest.raises(NotImplementedError, match="do not share weights"):
        LocalSGD(W0, 2, 2).apply_mean_gradient(torch.zeros(P), 0.1)


class _HalfPrecisionAveraging(SynchronousProtocol):
    """A protocol no runtime knows: plain SGD replicas averaged every iteration through a
    bfloat16 payload (a compressed exchange)."""

    def __init__(self, initial: torch.Tensor, num_learners: int) -> None:
        self.num_learners = num_learners
        self._replicas = initial.expand(num_learners, -1).clone()
        self._iteration = 0

    def learner_weights(self, learner: int) -> torch.Tensor:
        return self._replicas[learner]

    def exchange_step(self, grads: torch.Tensor, lr: float) -> AllReduce:
        self._replicas.sub_(grads, alpha=lr)
        self._iteration += 1
        return AllReduce(self._replicas.to(torch.bfloat16), self._take, mean=True)

    def _take(self, mean: torch.Tensor) -> None:
        self._replicas.copy_(mean.float().expand_as(self._replicas))

    def eval_weights(self) -> torch.Tensor:
        return self._replicas[0].clone()

    def state_dict(self) -> dict:
        return {"replicas": self._replicas.clone(), "iteration": self._iteration}

    def load_state_dict(self, state: dict) -> None:
        self._replicas.copy_(state["replicas"])
        self._iteration = state["iteration"]


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(DataConfig(dataset="synthetic", num_train=256, num_test=32), seed=0)


def _sim(dataset, make_protocol, lam: int) -> SimRuntime:
    torch.manual_seed(0)
    engine = GradientEngine(build_model("mlp", dataset.input_shape, dataset.num_classes))
    profile = DeviceProfile(seconds_per_batch=1e-3, seconds_per_sample=1e-4)
    cluster = ClusterConfig(
        seconds_per_batch=profile.seconds_per_batch,
        seconds_per_sample=profile.seconds_per_sample,
        latency_s=1e-4,
        bandwidth_gbps=10.0,
        jitter=0.0,
    )
    protocol = make_protocol(engine.initial_weights(), lam)
    return SimRuntime(
        protocol, engine, dataset, batch_size=8, num_learners=lam, profile=profile, cluster=cluster
    )


def test_simulator_charges_an_allreduce_only_when_the_protocol_exchanges(dataset):
    """Local SGD with H = 3 all-reduces once in 3 iterations: the virtual clock charges
    three computations and one ring all-reduce, told by the protocol alone."""
    lam = 2
    rt = _sim(dataset, lambda w, lam: LocalSGD(w, lam, average_every=3), lam)
    for _ in range(3):
        rt.advance(0.01)
    compute = rt.profile.device_seconds(1, 8)
    assert rt.virtual_time == pytest.approx(3 * compute + rt.allreduce_seconds(lam), rel=1e-12)


def test_simulator_runs_a_protocol_it_does_not_know(dataset):
    lam = 3
    rt = _sim(dataset, _HalfPrecisionAveraging, lam)
    before = rt.protocol.learner_weights(0).clone()
    rt.advance(0.05)
    replicas = rt.protocol.replicas
    assert not torch.equal(replicas[0], before)
    assert torch.equal(replicas, replicas[0].expand_as(replicas))  # averaged
    assert torch.equal(replicas[0], replicas[0].bfloat16().float())  # through bfloat16
    assert rt.virtual_time == pytest.approx(
        rt.profile.device_seconds(1, 8) + rt.allreduce_seconds(lam), rel=1e-12
    )


@pytest.fixture
def solo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dist_all_reduce_sums_rows_and_divides_a_mean_by_every_rank_rows(solo_group):
    rows = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert torch.equal(all_reduce(AllReduce(rows, lambda t: t), 1), torch.tensor([4.0, 8.0]))
    mean = all_reduce(AllReduce(rows, lambda t: t, mean=True), 1)
    assert torch.equal(mean, torch.tensor([2.0, 4.0]))
    assert torch.equal(rows, torch.tensor([[1.0, 2.0], [3.0, 6.0]]))  # payload untouched


@pytest.mark.parametrize("protocol", ["sma", "local_sgd"])
def test_drop_in_protocol_starts_from_the_weights_rank_0_broadcast(protocol, monkeypatch):
    """The protocol object (SMA's z, local SGD's replica) is built after every rank took
    rank 0's parameters, so all ranks hold the same central model."""

    def rank0_weights(self):  # a world of one: stands for another rank's weights
        for p in self.params:
            p.data.fill_(0.5)

    monkeypatch.setattr(dsgd.DistributedOptimizer, "broadcast_from_rank0", rank0_weights)
    model = nn.Linear(3, 2)
    ctx = dsgd.init(protocol, average_every=2)
    try:
        opt = dsgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
        assert torch.equal(opt.eval_weights(), torch.full((8,), 0.5))
    finally:
        ctx.close()


def test_package_names_load_on_first_use():
    from distsgd import api

    assert distsgd.train is api.train and distsgd.ConfigError is distsgd.config.ConfigError
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        distsgd.nope  # noqa: B018


@pytest.mark.slow
def test_importing_protocols_or_the_drop_in_loads_no_upper_floor():
    upper = ("distsgd.api", "distsgd.trainer", "distsgd.launch", "distsgd.tuner", "distsgd.cli")
    upper += ("distsgd.commands",)
    code = (
        "import sys, distsgd.protocols, distsgd.torch\n"
        f"print(sorted(m for m in sys.modules if m.startswith({upper!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_protocols_contract_forbids_every_other_module():
    """The sans-IO rule names every module of distsgd but ``checks``: a module added later
    must be added there too."""
    (contract,) = [c for n, c in _contracts().items() if n.startswith("Protocols are sans-IO")]
    modules = {
        f"distsgd.{m.name}"
        for m in pkgutil.iter_modules(distsgd.__path__)
        if m.name not in ("checks", "protocols", "__main__")
    }
    assert contract["source_modules"] == ["distsgd.protocols"]
    assert set(contract["forbidden_modules"]) == modules


def test_protocol_interface_contract_names_every_protocol_module():
    """Runtimes, the drop-in and the trainer may import ``protocols.base`` only: every
    other module of ``distsgd.protocols`` (a protocol added later too) is forbidden."""
    (contract,) = [c for n, c in _contracts().items() if "by their interface" in n]
    import distsgd.protocols as protocols

    modules = {
        f"distsgd.protocols.{m.name}"
        for m in pkgutil.iter_modules(protocols.__path__)
        if m.name not in ("base", "_util")
    }
    assert set(contract["forbidden_modules"]) == modules


@pytest.mark.parametrize(
    "name", ["hardsync", "plain", "sma", "local_sgd", "parameter_server", "compute_groups"]
)
def test_each_protocol_declares_the_family_its_spec_lays_out(name):
    """A runtime picks lock step or a parameter server by what the protocol declares
    (``served``): it must agree with its spec's layout (server ranks or none), and the
    protocol's progress (``iteration``) starts at 0 in both families."""
    from distsgd.layout import build_protocol, spec_for
    from tests.conftest import small_config

    lam = 4
    cfg = small_config(protocol={"name": name, "num_learners": 1 if name == "plain" else lam})
    proto = build_protocol(cfg, W0.clone())
    assert proto.served == spec_for(name).has_server
    assert proto.iteration == 0
