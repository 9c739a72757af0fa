"""Reports over run directories (curves, staleness histograms, markdown) and TensorBoard
event files written during training."""

import json
import shutil
from pathlib import Path

import pytest
from matplotlib.image import imread

import distsgd
from distsgd.cli import main
from distsgd.config import ConfigError
from distsgd.metrics import TENSORBOARD_TAGS, TensorBoardWriter, read_metrics
from distsgd.report import load_run, make_report, plot_staleness
from tests.conftest import cli_in_process, small_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROTOCOLS = {
    "hs": {"name": "hardsync", "num_learners": 2, "batch_size": 32},
    "ps": {"name": "parameter_server", "mode": "async", "num_learners": 4, "batch_size": 32},
    "sma": {"name": "sma", "num_learners": 4, "replicas_per_device": 2, "batch_size": 32},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 2-epoch runs on synthetic data: hardsync, asynchronous PS (λ=4), SMA."""
    root = tmp_path_factory.mktemp("runs")
    for name, protocol in PROTOCOLS.items():
        cfg = small_config(protocol=protocol, train={"target": 0.5, "stop_at_target": False})
        distsgd.train(cfg, out_dir=root / name)
    return {name: root / name for name in PROTOCOLS}


def table_rows(md: str) -> list[list[str]]:
    """Cells of the markdown table's body rows."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:]]


def check_png(path: Path, min_height: int, min_width: int) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    height, width, channels = image.shape
    assert channels in (3, 4)
    assert height >= min_height and width >= min_width
    assert image[..., :3].std() > 0.01  # not a blank canvas
    return height, width


@pytest.fixture
def no_drawing(monkeypatch):
    """Figures are built but not rendered (an empty file is written): for tests of the
    report's text, which drawing does not change; rendering is most of a report's time."""
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **k: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, fname, *a, **k: Path(fname).touch())


def test_report_of_three_protocols(runs, tmp_path):
    out = tmp_path / "report"
    md_path = make_report([runs["hs"], runs["ps"], runs["sma"]], out)
    assert md_path == out / "report.md"
    md = md_path.read_text()

    _, curves_width = check_png(out / "curves.png", 400, 800)
    _, stale_width = check_png(out / "staleness.png", 200, 300)
    # one histogram panel (the async run) is narrower than the 3-column curves grid
    assert stale_width < curves_width

    rows = table_rows(md)
    assert len(rows) == 3
    assert [r[1] for r in rows] == ["hardsync", "parameter_server", "sma"]
    assert all(len(r) == 12 for r in rows)
    ps_row = rows[1]
    mean, st_max = (v.strip() for v in ps_row[10].split("/"))
    assert float(mean) > 0 and int(st_max) > 0
    assert rows[0][10] == "0.00 / 0" and rows[2][10] == "0.00 / 0"
    assert "![learning curves](curves.png)" in md
    assert "![staleness histograms](staleness.png)" in md
    # the staleness section names the asynchronous run only
    async_line = next(line for line in md.splitlines() if line.startswith("Asynchronous runs:"))
    assert "parameter_server" in async_line
    assert "hardsync" not in async_line and "sma" not in async_line


def test_staleness_figure_covers_asynchronous_runs_only(runs, tmp_path):
    loaded = [load_run(runs[name]) for name in ("hs", "ps", "sma")]
    drawn = plot_staleness(loaded, tmp_path / "s.png")
    assert [r.summary["protocol"] for r in drawn] == ["parameter_server"]
    none = plot_staleness([loaded[0], loaded[2]], tmp_path / "none.png")
    assert none == [] and not (tmp_path / "none.png").exists()


def test_load_run(runs):
    run = load_run(runs["ps"])
    assert run.summary["protocol"] == "parameter_server"
    assert [r["samples"] for r in run.records] == [0, 512, 1024, 1536, 2048]
    # 2 epochs x 1024 samples in minibatches of 32: 64 gradients, each with its σ
    assert sum(run.staleness.values()) == 64
    assert max(run.staleness) == run.summary["staleness_max"] > 0
    assert run.label == "parameter_server λ=4 b=32 async seed=0"
    assert run.is_asynchronous and not load_run(runs["hs"]).is_asynchronous


def test_labels_are_made_unique(runs, tmp_path, no_drawing):
    copy = tmp_path / "again"
    shutil.copytree(runs["hs"], copy)
    copy2 = tmp_path / "more"
    shutil.copytree(runs["hs"], copy2)
    md = make_report([runs["hs"], copy, copy2], tmp_path / "r").read_text()
    labels = [r[0] for r in table_rows(md)]
    assert len(set(labels)) == 3
    assert labels[1] == "hardsync λ=2 b=32 seed=0 (again)"


def test_same_run_twice_and_out_that_is_a_file_are_errors(runs, tmp_path, no_drawing):
    with pytest.raises(ValueError, match="given twice"):
        make_report([runs["hs"], Path(str(runs["hs"]) + "/")], tmp_path / "r")
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        make_report([runs["hs"]], afile)


def test_diverged_single_record_run_without_virtual_time(runs, tmp_path):
    """A diverged run with one record, no staleness.json and no virtual clock (as another
    runtime writes it), next to a synchronous run: no crash, no staleness figure."""
    odd = tmp_path / "odd"
    shutil.copytree(runs["ps"], odd)
    first = read_metrics(odd / "metrics.jsonl")[0]
    first["virtual_s"] = None
    (odd / "metrics.jsonl").write_text(json.dumps(first) + "\n")
    (odd / "staleness.json").unlink()
    summary = json.loads((odd / "summary.json").read_text())
    summary.update(status="diverged", name="odd run", reached=False, time_to_target_virtual_s=None)
    (odd / "summary.json").write_text(json.dumps(summary))

    out = tmp_path / "r"
    (out).mkdir()
    (out / "staleness.png").write_bytes(b"old")  # an earlier report's figure goes away
    md = make_report([odd, runs["hs"]], out).read_text()
    check_png(out / "curves.png", 400, 800)
    assert not (out / "staleness.png").exists()
    rows = table_rows(md)
    assert rows[0][0] == "odd run" and rows[0][5] == "no (diverged)"
    assert "no staleness.json" in md and "odd run" in md.split("## Staleness")[1]


@pytest.mark.parametrize("setup", ["missing", "no_summary", "no_metrics"])
def test_bad_run_directory_is_a_value_error_naming_it(runs, tmp_path, setup):
    bad = tmp_path / "bad"
    if setup != "missing":
        shutil.copytree(runs["hs"], bad)
        (bad / ("summary.json" if setup == "no_summary" else "metrics.jsonl")).unlink()
    with pytest.raises(ValueError, match=str(bad)):
        make_report([runs["hs"], bad], tmp_path / "out")


def test_cli_report_default_out_and_missing_dir(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(runs["hs"]), str(runs["ps"])]) == 0
    assert (tmp_path / "report" / "report.md").exists()
    assert (tmp_path / "report" / "curves.png").exists()
    assert "report.md" in capsys.readouterr().out

    missing = tmp_path / "no-such-run"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = cli_in_process("report", str(missing), cwd=cwd)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "Traceback" not in proc.stderr
    assert not (cwd / "report").exists()  # nothing written for a failed report


def test_tensorboard_events_mirror_metrics(runs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["ps"] / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(TENSORBOARD_TAGS.values())
    records = read_metrics(runs["ps"] / "metrics.jsonl")
    steps = [r["samples"] for r in records]
    for key, tag in TENSORBOARD_TAGS.items():
        events = acc.Scalars(tag)
        expected = [(r["samples"], r[key]) for r in records if r.get(key) is not None]
        assert [e.step for e in events] == [s for s, _ in expected]
        # TensorBoard stores scalars as float32: compare to float32 precision
        assert [e.value for e in events] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [e.step for e in acc.Scalars("test/accuracy(fraction)")] == steps
    assert [e.step for e in acc.Scalars("train/loss(nats)")] == steps[1:]  # null at first


def test_tensorboard_resume_hides_repeated_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardWriter(tmp_path / "tb")
    for samples, accuracy in [(0, 0.1), (512, 0.5), (1024, 0.6)]:
        first.write({"samples": samples, "eval_metric": accuracy})
    first.close()
    first.close()  # idempotent
    # the checkpoint covered samples 512; the resumed run evaluates 1024 again
    resumed = TensorBoardWriter(tmp_path / "tb", purge_step=513)
    resumed.write({"samples": 1024, "eval_metric": 0.7})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("test/accuracy(fraction)")
    assert [(e.step, round(e.value, 6)) for e in events] == [(0, 0.1), (512, 0.5), (1024, 0.7)]


def test_tensorboard_off(tmp_path):
    tb = TensorBoardWriter(tmp_path / "tb", enabled=False)
    assert not tb.enabled
    tb.write({"samples": 0, "eval_metric": 0.1})
    tb.close()
    assert not (tmp_path / "tb").exists()
    assert small_config(train={"tensorboard": False}).train.tensorboard is False
    with pytest.raises(ConfigError, match="train.tensorboard"):
        small_config(train={"tensorboard": "yes"})


def test_report_of_a_lower_is_better_metric_names_it(tmp_path):
    """A perplexity run's report speaks of perplexity and its target's sense, not of
    accuracy in percent."""
    run = tmp_path / "run"
    run.mkdir()
    summary = {
        "protocol": "hardsync",
        "metric": "perplexity",
        "metric_direction": "min",
        "target": 7.0,
        "reached": True,
        "best_metric": 6.8,
        "time_to_target_s": 1.5,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    records = [
        {"samples": 0, "wall_s": 0.0, "eval_metric": 250.0, "eval_loss": 5.5},
        {"samples": 100, "wall_s": 1.5, "eval_metric": 6.8, "eval_loss": 1.9, "train_loss": 2.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    md = make_report([run], tmp_path / "rep").read_text()
    assert "Target evaluation perplexity: <= 7." in md
    assert "accuracy" not in md and "%" not in md.split("|")[0]
    assert (tmp_path / "rep" / "curves.png").stat().st_size > 0


def test_report_header_says_a_tuning_runs_times_include_the_tuning(runs, tmp_path, no_drawing):
    # issue 18: a run of --tune (74.73 s to target from its start, tuning included) was
    # headed "wall seconds of training only (evaluation excluded)"
    tuned = tmp_path / "tuned"
    shutil.copytree(runs["hs"], tuned)
    summary = json.loads((tuned / "summary.json").read_text())
    tuning = {"tuned": True, "tuning_share": 0.4187, "total_wall_s": 74.73, "num_probes": 12}
    (tuned / "summary.json").write_text(json.dumps({**summary, **tuning}))
    md = make_report([runs["hs"], tuned], tmp_path / "rep").read_text()
    header = next(line for line in md.splitlines() if line.startswith("The metric is"))
    # the copy's label is the original's made unique by its folder name, "… (tuned)"
    assert "training only" in header and "except for the runs of `--tune` (" in header
    assert "(tuned)):" in header
    assert "tuning (setup, every probe) and evaluations included" in header
    # and how much of the run the tuning took
    assert "(tuned): tuning 42% of its 74.7 s (12 probes)." in header
    only = make_report([tuned], tmp_path / "rep2").read_text()
    assert "training only" not in only and "runs of `--tune`" in only


def test_runs_charged_another_work_per_iteration_are_flagged_as_not_comparable(
    runs, tmp_path, no_drawing
):
    # the summary records every device figure the simulated seconds depend on (found by
    # fresh-user reviews: seconds_per_iteration, the server's figures and cores were
    # missing, and the note named two figures)
    summary = json.loads((runs["hs"] / "summary.json").read_text())
    device = summary["device_profile"]
    assert {"seconds_per_iteration", "seconds_per_push", "cores"} <= set(device)
    assert device["seconds_per_push"] is None  # no server: not recorded
    ps = json.loads((runs["ps"] / "summary.json").read_text())["device_profile"]
    assert ps["seconds_per_push"] is not None and "seconds_per_push_contended" in ps

    def report_of(edits: dict, base: str = "hs", **summary_edits) -> str:
        changed = json.loads((runs[base] / "summary.json").read_text())
        changed["device_profile"].update(edits)
        changed.update(summary_edits)
        other = tmp_path / f"other{len(list(tmp_path.iterdir()))}"
        shutil.copytree(runs[base], other)
        (other / "summary.json").write_text(json.dumps(changed))
        return make_report([runs[base], other], other / "report").read_text()

    note = "different device profiles"
    assert note not in report_of({})
    # "not measured" (-1) is charged as 0: the same device as 0 given
    assert note not in report_of({"seconds_per_iteration": 0.0})
    md = report_of({"seconds_per_iteration": 1e-3})
    assert note in md and "`cluster.seconds_per_iteration`" in md
    assert note in report_of({"cores": 2})
    assert note in report_of({"seconds_per_push_contended": 2e-3}, base="ps")
    # a run on real processes simulates nothing (a fresh-user review: a sim run beside a
    # dist run was said to "simulate different device profiles")
    assert note not in report_of({"seconds_per_iteration": 1e-3}, runtime="dist")
    # hardsync beside a parameter server: the server's figures are the server runs' own
    md = make_report([runs["hs"], runs["ps"], runs["sma"]], tmp_path / "three").read_text()
    assert note not in md


def test_dropped_gradients_and_membership_changes_appear_only_where_a_run_has_them(
    runs, tmp_path, no_drawing
):
    plain = make_report([runs["hs"], runs["ps"]], tmp_path / "plain").read_text()
    assert "dropped gradients" not in plain and "joined / left / lost" not in plain
    backups = tmp_path / "backups"
    shutil.copytree(runs["hs"], backups)
    summary = json.loads((backups / "summary.json").read_text())
    assert summary["dropped_gradients"] == 0  # the key every run's summary has
    (backups / "summary.json").write_text(json.dumps({**summary, "dropped_gradients": 7}))
    elastic = tmp_path / "elastic"
    shutil.copytree(runs["ps"], elastic)
    events = ["join", "join", "leave", "lost"]
    (elastic / "membership.jsonl").write_text(
        "".join(
            json.dumps({"time_s": i, "event": e, "worker": i}) + "\n" for i, e in enumerate(events)
        )
    )
    md = make_report([runs["hs"], backups, elastic], tmp_path / "r").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| run "))
    assert header.endswith("| dropped gradients | joined / left / lost |")
    rows = {r[0]: r for r in table_rows(md)}
    assert [r[-2:] for r in rows.values()] == [
        ["0", "0 / 0 / 0"],
        ["7", "0 / 0 / 0"],
        ["0", "2 / 1 / 1"],
    ]
    assert load_run(elastic).membership == {"join": 2, "leave": 1, "lost": 1}
