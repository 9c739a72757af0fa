"""Losses and metrics: built-ins, the user's, and how evaluations add them up."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distsgd.checks import ConfigError
from distsgd.data import TensorSplit
from distsgd.engine import GradientEngine
from distsgd.objectives import build_loss, build_metric, reached


def test_cross_entropy_chunks_are_each_learners_mean_and_the_total_their_mean():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(12, 5, generator=g)
    y = torch.randint(0, 5, (12,), generator=g)
    total, chunks = build_loss("cross_entropy").chunk_means(out, y, 3)
    # the same float32 maths in another reduction order: float32 tolerances
    for j in range(3):
        ref = F.cross_entropy(out[4 * j : 4 * j + 4], y[4 * j : 4 * j + 4])
        torch.testing.assert_close(chunks[j], ref)
    assert total == F.cross_entropy(out, y, reduction="none").mean()


def test_sequence_cross_entropy_is_the_mean_over_positions():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(4, 6, 7, generator=g)  # [B, T, C]
    y = torch.randint(0, 7, (4, 6), generator=g)
    loss = build_loss("cross_entropy")
    total, _ = loss.chunk_means(out, y, 1)
    torch.testing.assert_close(total, F.cross_entropy(out.reshape(-1, 7), y.reshape(-1)))
    assert loss.batch_sum(out, y) == pytest.approx(4 * float(total), rel=1e-6)


def test_a_user_loss_per_chunk_and_its_scalar_check():
    mae = build_loss(lambda o, t: (o - t).abs().mean())
    out, t = torch.arange(6.0).view(6, 1), torch.zeros(6, 1)
    total, chunks = mae.chunk_means(out, t, 2)
    assert chunks.tolist() == [1.0, 4.0] and float(total) == 2.5
    bad = build_loss(lambda o, t: (o - t).abs())
    with pytest.raises(ConfigError, match=r"returned \[6, 1\], expected a scalar"):
        bad.chunk_means(out, t, 1)


@pytest.mark.parametrize("batch_size", [1, 3, 7, 64])
def test_evaluation_does_not_depend_on_the_batch_size(batch_size):
    """The metric is a sample-weighted mean and perplexity exp of the mean loss, so any
    cut of the evaluation set into batches gives the same value: accuracy exactly (counts),
    the loss up to float32 rounding of the per-batch sums (1e-6 relative)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    split = TensorSplit(x, y)
    for metric in ("accuracy", "loss", "perplexity"):
        engine = GradientEngine(model, metric=build_metric(metric))
        w = engine.initial_weights()
        value, loss = engine.evaluate(w, split, batch_size)
        ref_value, ref_loss = engine.evaluate(w, split, 20)
        if metric == "accuracy":
            assert value == ref_value
        else:
            assert value == pytest.approx(ref_value, rel=1e-6)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
    with torch.no_grad():
        logits = model(x)
    assert ref_loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)


def test_perplexity_is_exp_of_the_mean_loss_and_accuracy_counts_positions():
    m = build_metric("perplexity")
    assert m.direction == "min" and m.value(0.0, 2.0 * 10, 10) == pytest.approx(math.exp(2.0))
    acc = build_metric("accuracy")
    out = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]])  # [B=2, T=2, C=2]
    y = torch.tensor([[1, 1], [0, 0]])
    assert acc.batch_sum(out, y) == 1.5  # sample 0: half its positions right; sample 1: all


def test_binary_logits_accuracy():
    acc = build_metric("accuracy")
    out = torch.tensor([2.0, -1.0, 0.5, -3.0])
    assert acc.batch_sum(out, torch.tensor([1.0, 0.0, 0.0, 1.0])) == 2.0


def test_directions_and_targets():
    assert reached(0.91, 0.9, "max") and not reached(0.89, 0.9, "max")
    assert reached(2.9, 3.0, "min") and not reached(3.1, 3.0, "min")
    assert not reached(0.0, 0.0, "min")  # target 0: no target
    assert not reached(math.nan, 3.0, "min")
    m = build_metric(lambda o, t: 0.0, "min")
    assert m.better(1.0, 2.0) and not m.better(2.0, 1.0)
    with pytest.raises(ConfigError, match="train.metric_direction = '' is not allowed"):
        build_metric(lambda o, t: 0.0)
    with pytest.raises(ConfigError, match="train.metric_direction = 'min' is not allowed"):
        build_metric("accuracy", "min")


def test_accuracy_refuses_targets_that_are_not_class_labels():
    """Before: a regression scored "accuracy 0.88" as (outputs > 0) == (targets > 0.5)."""
    accuracy = build_metric("accuracy")
    out = torch.tensor([[0.3], [-1.0], [2.0]])
    with pytest.raises(ConfigError, match=r"binary targets of the outputs' shape in \[0, 1\]"):
        accuracy.batch_sum(out, torch.tensor([[0.7], [2.5], [-3.0]]))  # regression values
    with pytest.raises(ConfigError, match=r"integer class indices"):
        accuracy.batch_sum(torch.randn(3, 4), torch.tensor([0.0, 2.0, 3.0]))  # float labels
    # binary targets (soft ones too) and integer labels are scored as before
    assert accuracy.batch_sum(out, torch.tensor([[1.0], [0.0], [0.2]])) == 2.0
    assert accuracy.batch_sum(torch.eye(3), torch.tensor([0, 1, 0])) == 2.0


def test_a_user_metric_must_be_finite_and_may_not_exit():
    nan = build_metric(lambda o, t: float("nan"), "max")
    with pytest.raises(ConfigError, match=r"returned nan on a batch of 3 evaluation samples"):
        nan.batch_sum(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))

    def exits(o, t):
        raise SystemExit(4)

    with pytest.raises(ConfigError, match=r"raised SystemExit: 4 \(it called sys.exit\)"):
        build_metric(exits, "min").batch_sum(torch.zeros(3, 2), torch.zeros(3))
    with pytest.raises(ConfigError, match=r"^train.loss = 'exits' raised SystemExit: 4"):
        build_loss(exits).chunk_means(torch.zeros(3, 2), torch.zeros(3), 1)
