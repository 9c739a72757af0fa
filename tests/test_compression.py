"""Compressed exchange (protocol.compression): what is rounded, what stays float32, the
bytes each run records, and accuracy against float32 after a few hundred samples."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distsgd
from distsgd.config import ConfigError
from distsgd.protocols import AllReduce
from distsgd.runtime.compression import (
    INT8_CHUNK,
    all_reduce_compressed,
    compressed_total,
    dequantize_int8,
    int8_allgather_bytes,
    quantize_int8,
    ring_allreduce_bytes,
    round_to_wire,
)
from tests.conftest import small_config

PROTOCOLS = {
    "hardsync": {"name": "hardsync", "num_learners": 2},
    "sma": {"name": "sma", "num_learners": 4, "replicas_per_device": 2},
    "local_sgd": {"name": "local_sgd", "num_learners": 2, "average_every": 2},
    "diloco": {"name": "diloco", "num_learners": 2, "average_every": 2},
    "parameter_server": {"name": "parameter_server", "num_learners": 2, "mode": "async"},
}


def _run(tmp_path, name: str, compression: str) -> dict:
    protocol = {**PROTOCOLS[name], "compression": compression, "batch_size": 16}
    cfg = small_config(protocol=protocol, train={"max_epochs": 1, "eval_every_samples": 1024})
    return distsgd.train(cfg, out_dir=tmp_path / f"{name}-{compression}")


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_bf16_run_stays_near_float32_and_sends_half_the_bytes(tmp_path, name):
    """One epoch (1024 synthetic samples) in float32 and in bf16 on the simulated cluster:
    the bytes recorded halve exactly, and the final accuracy on the 256 test samples is
    within 0.05 (13 samples) of float32's (bf16 keeps 8 bits of mantissa: each exchange's
    relative rounding is <= 2^-9 of what it carries)."""
    fp32, bf16 = _run(tmp_path, name, "none"), _run(tmp_path, name, "bf16")
    assert fp32["bytes_sent"] > 0 and bf16["bytes_sent"] * 2 == fp32["bytes_sent"]
    assert bf16["bytes_sent_per_sample"] == bf16["bytes_sent"] / bf16["samples"]
    assert bf16["compression"] == "bf16"
    assert bf16["final_metric"] == pytest.approx(fp32["final_metric"], abs=0.05)
    assert bf16["virtual_s"] < fp32["virtual_s"]  # fewer bytes through the same network


def test_compressed_total_rounds_each_device_and_the_sum():
    rows = torch.tensor([[1.0 + 2**-12, 0.0], [1.0, 3.0], [2.0, 1.0], [0.5, 2**-20]])
    exact = AllReduce(rows, lambda t: t)
    assert torch.equal(compressed_total(exact, 2, "none"), rows.sum(0))
    got = compressed_total(exact, 2, "bf16")
    devices = rows.view(2, 2, 2).sum(1).bfloat16().float()
    assert torch.equal(got, devices.sum(0).bfloat16().float())
    mean = compressed_total(AllReduce(rows, lambda t: t, mean=True), 2, "fp16")
    torch.testing.assert_close(mean, rows.mean(0), rtol=1e-3, atol=1e-6)
    assert torch.equal(mean, round_to_wire(mean, "fp16"))  # it came through float16


def test_ring_bytes():
    assert ring_allreduce_bytes(1, 100, "none") == 0
    assert ring_allreduce_bytes(4, 100, "none") == 2 * 3 * 100 * 4
    assert ring_allreduce_bytes(4, 100, "bf16") == 2 * 3 * 100 * 2


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_dist_compressed_all_reduce_matches_the_simulators_total(compression):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = torch.tensor([[1.0 + 2**-12, 7.0, -0.3], [1.0, 3.0, 2e-5]])
        exchange = AllReduce(rows, lambda t: t, mean=True)
        got = all_reduce_compressed(exchange, 1, compression)
        assert torch.equal(got, compressed_total(exchange, 1, compression))
        assert not torch.equal(got, rows.mean(0))  # it was rounded
    finally:
        dist.destroy_process_group()


def test_int8_error_is_at_most_half_a_step_of_each_chunks_scale():
    """|t − q·s| <= s/2 per value, s = the chunk's max|t| / 127; a chunk of zeros stays
    zero; the last, shorter chunk has its own scale."""
    torch.manual_seed(0)
    n = 2 * INT8_CHUNK + 37
    t = torch.randn(n) * torch.logspace(-6, 2, n)
    t[:INT8_CHUNK] = 0.0
    q, scales = quantize_int8(t)
    assert q.dtype == torch.int8 and q.shape == t.shape and scales.shape == (3,)
    err = (t - dequantize_int8(q, scales)).abs()
    chunk_scale = scales.repeat_interleave(INT8_CHUNK)[:n]
    assert torch.all(err <= chunk_scale * (0.5 + 1e-5))
    assert torch.equal(scales, torch.stack([c.abs().max() for c in t.split(INT8_CHUNK)]) / 127)
    assert scales[0] == 0 and torch.all(q[:INT8_CHUNK] == 0)
    assert q.abs().max() == 127


def test_int8_bytes_are_an_all_gather_of_values_and_scales():
    assert int8_allgather_bytes(1, 5000) == 0
    assert int8_allgather_bytes(2, 5000) == 2 * (5000 + 4 * 5)  # 5 chunks of <= 1024
    assert int8_allgather_bytes(3, 1024) == 3 * 2 * (1024 + 4)


def test_int8_diloco_stays_near_float32_and_sends_a_quarter(tmp_path):
    """One epoch of DiLoCo with int8 pseudo-gradients on the simulated cluster (two
    devices): the bytes recorded are the all-gather's, about a quarter of float32's ring
    all-reduce, and the final accuracy on the 256 test samples is within 0.05 of
    float32's (each value rounds by at most 1/254 of its chunk's largest)."""
    fp32, int8 = _run(tmp_path, "diloco", "none"), _run(tmp_path, "diloco", "int8")
    assert fp32["bytes_sent"] < int8["bytes_sent"] * 4 < fp32["bytes_sent"] * 1.02
    assert int8["final_metric"] == pytest.approx(fp32["final_metric"], abs=0.05)
    assert int8["virtual_s"] < fp32["virtual_s"]


@pytest.mark.parametrize("name", ["hardsync", "local_sgd", "sma", "parameter_server"])
def test_int8_outside_diloco_is_one_line(name):
    protocol = {**PROTOCOLS[name], "compression": "int8"}
    with pytest.raises(ConfigError, match=r"^protocol.compression = 'int8' is not allowed"):
        small_config(protocol=protocol)


def test_parameter_server_compression_on_dist_is_one_line():
    protocol = {**PROTOCOLS["parameter_server"], "compression": "bf16"}
    with pytest.raises(ConfigError, match=r"^protocol.compression = 'bf16' is not allowed"):
        small_config(protocol=protocol, runtime="dist")
    with pytest.raises(ConfigError, match="protocol.compression"):
        small_config(protocol={"compression": "int4"})


def test_int8_in_the_drop_in_is_one_line():
    import distsgd.torch as dsgd

    model = torch.nn.Linear(2, 1)
    ctx = dsgd.init("diloco", compression="int8")
    try:
        with pytest.raises(ConfigError, match=r"^protocol.compression = 'int8' is not allowed"):
            dsgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
    finally:
        ctx.close()


@pytest.mark.parametrize("protocol", ["hardsync", "diloco"])
def test_drop_in_exchanges_through_the_wire_format(protocol):
    """The drop-in in a world of one: hardsync's gradient bucket and DiLoCo's
    pseudo-gradient travel as bfloat16, the parameters stay float32."""
    import distsgd.torch as dsgd

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    settings = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
    ctx = dsgd.init(protocol, compression="bf16", average_every=1, **settings)
    try:
        opt = dsgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(8, 5)).pow(2).mean().backward()
        if protocol == "hardsync":
            grad = model.weight.grad
            assert torch.equal(grad, grad.bfloat16().float())  # the bucket came back rounded
        opt.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        if protocol == "diloco":  # θ ← θ − 1·bf16(θ − w): the change is bf16-representable
            change = before[0] - model.weight.detach()
            assert torch.equal(change, change.bfloat16().float())
    finally:
        ctx.close()


def test_powersgd_hook_sends_low_rank_factors_and_we_count_them():
    """torch's powerSGD_hook on DDP in a world of one: float32 for the first
    POWERSGD_START iterations, then a large enough weight matrix's gradient comes back
    as a rank-r approximation, and powersgd_values counts the values the hook reports
    it all-reduced (over its two compressed iterations)."""
    from types import SimpleNamespace

    from distsgd.runtime.compression import POWERSGD_START, powersgd_values
    from distsgd.runtime.dist import _ddp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))
        ddp = _ddp(SimpleNamespace(model=model, device=torch.device("cpu")), "powersgd", 1)
        (_, state), shapes = ddp._comm_hooks[0], [p.shape for p in model.parameters()]
        for it in range(POWERSGD_START + 2):
            model.zero_grad()
            ddp(torch.randn(8, 40)).pow(2).sum().backward()
            # the first layer's gradient has rank 2 (2 outputs), its approximation 1
            rank = torch.linalg.matrix_rank(model[0].weight.grad)
            assert rank == (1 if it >= POWERSGD_START else 2)
        # 40×30 → 1·(40 + 30); the 2×30 matrix (2·32 > 60) and the biases go whole
        assert powersgd_values(shapes, 1) == 70 + 30 + 60 + 2
        assert state.total_numel_after_compression == 2 * powersgd_values(shapes, 1)
    finally:
        dist.destroy_process_group()


def test_powersgd_is_refused_where_it_does_not_run():
    with pytest.raises(ConfigError, match=r"^protocol.compression = 'powersgd' .* runtime 'sim'"):
        small_config(protocol={**PROTOCOLS["hardsync"], "compression": "powersgd"})
    with pytest.raises(ConfigError, match=r"^protocol.compression = 'powersgd' .*'diloco'"):
        small_config(protocol={**PROTOCOLS["diloco"], "compression": "powersgd"}, runtime="dist")
