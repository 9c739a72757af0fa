"""The sweep driver used by the benchmarks."""

import json
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from dist_bench import push_overrides  # noqa: E402
from stragglers import combine, marked  # noqa: E402
from sweep import grid_points, run_grid  # noqa: E402
from tune_online_vs_ddp import _median, _ratio, where_time_went  # noqa: E402

from tests.conftest import cli_in_process  # noqa: E402


@pytest.fixture
def runs_in_process(monkeypatch):
    """The sweep's ``python -m distsgd ARGS`` processes run as ``distsgd ARGS`` in this
    process, one after the other in its main thread (the CLI sets signal handlers; the
    CLI's own tests start the real process); the commands are recorded."""
    import sweep

    commands = []

    class InOrder:
        def __init__(self, max_workers):
            assert max_workers == 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            fut = Future()
            fut.set_result(fn(*args))
            return fut

    def run(cmd, **kwargs):
        assert cmd[:3] == [sys.executable, "-m", "distsgd"]
        assert kwargs == {"capture_output": True, "text": True}
        commands.append(cmd[3:])
        return cli_in_process(*cmd[3:])

    monkeypatch.setattr(sweep.subprocess, "run", run)
    monkeypatch.setattr(sweep, "ThreadPoolExecutor", InOrder)
    return commands


def test_grid_points_is_the_cartesian_product():
    pts = grid_points(["protocol.num_learners=1,2", "optimizer.lr=0.1,0.2"])
    assert [name for name, _ in pts] == [
        "num_learners=1_lr=0.1",
        "num_learners=1_lr=0.2",
        "num_learners=2_lr=0.1",
        "num_learners=2_lr=0.2",
    ]
    assert pts[1][1] == ["protocol.num_learners=1", "optimizer.lr=0.2"]


@pytest.mark.slow
def test_run_grid_runs_each_seed_once_and_skips_finished_runs(tmp_path, runs_in_process):
    common = [
        "data.dataset=synthetic",
        "data.num_train=256",
        "data.num_test=64",
        "model.name=mlp",
        "protocol.num_learners=2",
        "protocol.batch_size=16",
        "train.max_epochs=1",
        "train.target=0",
        "train.tensorboard=false",
        "cluster.seconds_per_sample=1e-4",
        "cluster.seconds_per_batch=1e-3",
    ]
    points = grid_points(["protocol.name=hardsync,sma"])
    dirs = run_grid(points, [0, 1], tmp_path, common=common)
    assert [d.name for d in dirs] == [
        "name=hardsync-s0",
        "name=hardsync-s1",
        "name=sma-s0",
        "name=sma-s1",
    ]
    seeds = [json.loads((d / "summary.json").read_text())["seed"] for d in dirs]
    assert seeds == [0, 1, 0, 1]
    assert [c[:1] + c[-3:] for c in runs_in_process] == [
        ["train", "--out", str(d), "--quiet"] for d in dirs
    ]
    assert all(
        f"protocol.name={d.name[5:-3]}" in c for c, d in zip(runs_in_process, dirs, strict=True)
    )
    stamp = (dirs[0] / "summary.json").stat().st_mtime_ns
    run_grid(points, [0, 1], tmp_path, common=common)  # cached: nothing is run again
    assert (dirs[0] / "summary.json").stat().st_mtime_ns == stamp
    assert len(runs_in_process) == 4


@pytest.mark.slow
def test_run_grid_refuses_a_cached_run_with_other_settings(tmp_path, runs_in_process):
    common = [
        "data.dataset=synthetic",
        "data.num_train=128",
        "data.num_test=32",
        "model.name=mlp",
        "protocol.num_learners=1",
        "protocol.batch_size=16",
        "train.max_epochs=1",
        "train.target=0",
        "train.tensorboard=false",
        "cluster.seconds_per_sample=1e-4",
        "cluster.seconds_per_batch=1e-3",
    ]
    run_grid([("p", [])], [0], tmp_path, common=common)
    with pytest.raises(RuntimeError, match="other settings"):
        run_grid([("p", ["optimizer.lr=0.2"])], [0], tmp_path, common=common)


def test_median_of_ratios_with_bounds_says_which_side_it_is_on():
    # "<": the denominator missed the target, the seed's ratio is below its figure
    assert _median([(1.2, "="), (0.9, "="), (1.0, "=")]) == "1.000"
    assert _median([(4.5, ">"), (1.2, "="), (1.3, "=")]) == "1.300"  # bound above: exact
    # every seed a "<" bound: the median of the ratios is below the median of the figures
    # (the bench's (c)/(b), where (b) never reached 90%; it printed "≈ 0.289")
    assert _median([(0.315, "<"), (0.272, "<"), (0.289, "<")]) == "< 0.289"
    assert _median([(0.3, "<"), (0.2, "="), (0.5, "=")]) == "≤ 0.300"  # the median a bound
    assert _median([(0.3, "<"), (0.2, ">"), (0.5, "=")]) == "≈ 0.300"


def test_a_seeds_ratio_over_repeats_is_that_of_the_medians():
    def row(kind, wall, reached=True, repeat=1, rc=0):
        return {"kind": kind, "seed": 1, "repeat": repeat, "command_wall_s": wall,
                "reached": reached, "returncode": rc}  # fmt: skip

    rows = [row("a", 40.0), row("c", 50.0), row("a", 44.0, repeat=2), row("c", 42.0, repeat=2)]
    rows += [row("a", 48.0, repeat=3), row("c", 46.0, repeat=3)]
    assert _ratio(rows, "c", "a", 1) == (46.0 / 44.0, "=")
    assert _ratio(rows[:2], "c", "a", 1) == (50.0 / 40.0, "=")  # one run each
    # a repeat that missed the target makes the kind's time a bound; a failed run: none
    missed = rows + [row("a", 60.0, reached=False, repeat=4)]
    assert _ratio(missed, "c", "a", 1)[1] == "<"
    assert _ratio(rows + [row("c", 1.0, repeat=4, rc=1)], "c", "a", 1) is None


def test_where_time_went_counts_joint_and_later_rungs_in_the_cold_start(tmp_path):
    """A joint probe continues a cold first rung (``NNN-joint-…``): cold start, not steady
    state (the summary lines of three bench runs had it as a third steady-state probe)."""
    names = ["001-cold-x", "002-cold2-x", "003-joint-y", "004-cold3-y", "005-steady-x"]
    for i, name in enumerate(names):
        d = tmp_path / "probes" / name
        d.mkdir(parents=True)
        (d / "online_probe.json").write_text(json.dumps({"wall_s": 1.5}))
        start = 0.0 if "-cold-" in name else 10.0 * i  # a continuation's counters go on
        ticks = [{"train_wall_s": start + 0.25}, {"train_wall_s": start + 1.25}]
        (d / "ticks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ticks))
    line = where_time_went(tmp_path)
    assert line.startswith("cold start 4 probes 6.0 s wall (4.2 s of it training)")
    assert "steady state 1 probes 1.5 s (1.0 s training)" in line


_ALONE, _CONTENDED = 3e-3, 12e-3


def test_the_bench_charges_async_rows_the_contended_time_apart():
    # the server's work alone, then (async rows) its contended time, charged unstretched
    assert push_overrides("hardsync", _ALONE, _CONTENDED) == []
    assert push_overrides("async", _ALONE, None) == [f"cluster.seconds_per_push={_ALONE!r}"]
    assert push_overrides("async", _ALONE, _CONTENDED) == [
        f"cluster.seconds_per_push={_ALONE!r}",
        f"cluster.seconds_per_push_contended={_CONTENDED!r}",
    ]


def test_a_ratio_prints_enough_digits_for_its_mark():
    """Bug: 0.7496 against the bound 0.75 printed as "0.750 ✗"."""
    assert marked(0.7496, 0.75, 1.25) == "0.7496 ✗"
    assert marked(1.2504, 0.75, 1.25) == "1.2504 ✗"
    assert marked(0.7504, 0.75, 1.25) == "0.750"
    assert marked(0.70004, hi=0.7) == "0.70004 ✗" and marked(0.5, hi=0.7) == "0.500"


def test_a_stragglers_row_is_the_median_across_seeds():
    runs = [
        {
            "reached": True,
            "time_to_target_s": 3.0,
            "samples_to_target": 12000,
            "dropped_gradients": 4,
        },
        {
            "reached": True,
            "time_to_target_s": 4.0,
            "samples_to_target": 16000,
            "dropped_gradients": 6,
        },
        {
            "reached": True,
            "time_to_target_s": 9.0,
            "samples_to_target": 20000,
            "dropped_gradients": 5,
        },
        {
            "reached": False,
            "time_to_target_s": None,
            "samples_to_target": None,
            "dropped_gradients": 9,
        },
    ]
    row = combine(runs)
    assert row["reached"] == "3/4" and row["time_to_target_s"] == 4.0
    assert row["samples_to_target"] == 16000 and row["dropped_gradients"] == 5.5
    assert row["per_sample_s"] == pytest.approx(4.0 / 16000)  # of 2.5e-4, 2.5e-4, 4.5e-4
