"""What a user sees: the progress bar, the end of a run, the run's config.toml (only the
settings that apply to it), the report's accuracy axis, and the package's metadata."""

import dataclasses
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

import distsgd
from distsgd import config as config_module
from distsgd.cli import main
from distsgd.commands import _print_tune, _results_lines
from distsgd.config import DataConfig, ModelConfig, RunConfig, _toml_value
from distsgd.report import load_run, plot_curves
from distsgd.trainer import Trainer, _bar_postfix, _count
from tests.conftest import small_config

REPO = Path(__file__).resolve().parent.parent


def read_back(text: str) -> RunConfig:
    """The config a TOML text gives (as ``from_toml`` reads a file)."""
    return RunConfig.from_dict(tomllib.loads(text))


def final_frame(stderr: str) -> str:
    """The last frame tqdm drew (frames are separated by carriage returns)."""
    frames = [f.strip() for f in re.split(r"[\r\n]", stderr) if "sample" in f]
    return frames[-1]


# ---- the progress bar ---------------------------------------------------------------
def test_bar_closes_at_100_percent_with_the_target_as_its_stop_reason(tmp_path, capsys):
    """The demo's case: the target ends the run long before the sample budget. Before the
    fix the bar stopped at the budget's share ("10%") with the accuracy of an earlier
    evaluation unlabelled."""
    cfg = small_config(
        protocol={"num_learners": 2},
        train={"target": 0.5, "max_epochs": 10, "eval_every_samples": 256},
    )
    summary = Trainer(cfg, tmp_path / "r", progress=True).run()
    assert summary["reached"] and summary["epochs"] < 10  # the target ended it early
    err = capsys.readouterr().err
    assert "/10.2k" in err  # counted towards the budget: 10 epochs of 1024 samples
    last = final_frame(err)
    samples = _count(summary["samples_to_target"])  # e.g. "1.79k"
    assert "100%" in last
    assert f"eval@{samples} accuracy {summary['best_metric']:.4f}" in last
    assert f"target 0.5 reached at {samples}; stopped" in last
    assert "→ 0.5 target" in err  # on the way there


def test_bar_at_the_budget_says_so(tmp_path, capsys):
    cfg = small_config(train={"target": 0.99, "max_epochs": 1, "eval_every_samples": 512})
    summary = Trainer(cfg, tmp_path / "r", progress=True).run()
    assert not summary["reached"]
    last = final_frame(capsys.readouterr().err)
    assert "100%" in last and "1.02k/1.02k" in last
    assert "→ 0.99 target; stopped: sample budget" in last


def record(samples=45000, metric=0.8712, loss=0.3521, staleness=1.25):
    return {
        "samples": samples,
        "eval_metric": metric,
        "eval_loss": loss,
        "staleness_mean": staleness,
    }


def test_bar_postfix_names_the_evaluation_and_the_target():
    cfg = RunConfig()  # hardsync, target 0.9
    assert _bar_postfix(cfg, None, None, -1) == "accuracy → 0.9 target"
    text = _bar_postfix(cfg, record(), 0.879, -1)
    assert text == "eval@45.0k accuracy 0.8712 (best 0.8790) → 0.9 target, loss 0.352"
    reached = _bar_postfix(cfg, record(metric=0.91), 0.91, 44000, "target")
    assert (
        reached == "eval@45.0k accuracy 0.9100 (best 0.9100) target 0.9 reached at 44.0k; stopped"
    )
    no_target = cfg.replace(train=dataclasses.replace(cfg.train, target=0.0, max_epochs=1))
    assert _bar_postfix(no_target, None, None, -1) == ""
    assert _bar_postfix(no_target, None, None, -1, "max_seconds") == "stopped: train.max_seconds"


def test_a_users_own_task_reports_no_target_nobody_set():
    """The default target 0.9 is the built-in tasks' accuracy: a user's model, data or
    metric without ``train.target`` has none (no "→ 0.9 target", no "NOT reached");
    a target the user gives, and a built-in preset's, stay."""
    zoo = "tests.user_project.zoo"
    own = {"model": {"factory": f"{zoo}:tabular_mlp"}, "data": {"factory": f"{zoo}:tabular"}}
    cfg = RunConfig.from_dict(own)
    assert cfg.train.target == 0.0 and "target" not in _bar_postfix(cfg, record(), 0.9, -1)
    assert RunConfig.from_dict({**own, "train": {"target": 0.8}}).train.target == 0.8
    user_metric = {
        "train": {"metric": "tests.user_project.zoo:error_rate", "metric_direction": "min"}
    }
    assert RunConfig.from_dict(user_metric).train.target == 0.0
    preset = Path(__file__).resolve().parents[1] / "configs" / "hardsync.toml"
    assert RunConfig.from_toml(preset).train.target == 0.9 and RunConfig().train.target == 0.9


def test_bar_postfix_staleness_for_a_parameter_server_and_the_metric_name():
    ps = small_config(protocol={"name": "parameter_server", "mode": "async", "num_learners": 4})
    assert _bar_postfix(ps, record(), 0.9, -1).endswith(", σ 1.25")
    cfg = RunConfig()
    cfg.train.metric = "loss"  # a later setting (train.metric): read when it exists
    text = _bar_postfix(cfg, record(metric=0.35), 0.3, -1)
    assert text.startswith("eval@45.0k loss 0.3500 (best 0.3000)") and ", loss" not in text
    cfg.train.metric = "mypkg.metrics:top5"
    assert _bar_postfix(cfg, record(), 0.9, -1).startswith("eval@45.0k top5 0.8712")


# ---- the end of a run ---------------------------------------------------------------
def test_end_of_run_says_where_the_results_are(tmp_path, capsys):
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(small_config(train={"max_epochs": 1}).to_toml())
    out = tmp_path / "my run"
    assert main(["train", str(cfg_path), "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"run directory {out} ") for line in lines)
    assert f"report        distsgd report '{out}'  (writes ./report/report.md" in "\n".join(lines)
    tb_lines = [line for line in lines if line.startswith("tensorboard ")]
    if (out / "tb").is_dir() and any((out / "tb").iterdir()):
        assert tb_lines == [f"tensorboard   tensorboard --logdir '{out / 'tb'}'"]
    else:  # the tensorboard package is not installed: no event files, no line
        assert tb_lines == []
    assert lines[-1].startswith(f"model         {out / 'model.pt'}")
    (out / "model.pt").unlink()  # a run that wrote none: no line for it
    assert not any(line.startswith("model ") for line in _results_lines(out))


def test_end_of_tune_says_how_to_train_the_plan(tmp_path, capsys):
    state = {
        "prediction": {"predicted_s": 12.0},
        "clock": "simulated",
        "chosen_label": "hardsync λ=4 b=32",
        "tuning_wall_s": 30.0,
        "probes": [],
    }
    _print_tune(state, tmp_path / "t")
    out = capsys.readouterr().out
    assert f"train the plan: distsgd train {tmp_path / 't' / 'plan.toml'}" in out


# ---- config.toml: only the settings that apply --------------------------------------
def written(cfg: RunConfig) -> dict:
    return tomllib.loads(cfg.to_toml(applicable_only=True))


def test_fashion_mnist_run_has_no_synthetic_settings():
    fm = written(RunConfig())
    assert fm["data"] == {"dataset": "fashion_mnist", "root": ""}
    synthetic = written(small_config())
    assert {"num_train", "num_test", "noise"} <= set(synthetic["data"])
    assert "root" not in synthetic["data"]
    assert "tune" not in fm and "tune" not in synthetic  # a training run reads no [tune]
    assert "tune" in tomllib.loads(RunConfig().to_toml())  # the full form keeps it


@pytest.mark.parametrize(
    "protocol, present, absent",
    [
        ({"name": "hardsync"}, set(), {"mode", "alpha", "replicas_per_device", "num_groups"}),
        (
            {"name": "parameter_server", "mode": "async"},
            {"mode", "staleness_lr", "server_optimizer"},
            {"softsync", "alpha", "num_groups"},
        ),
        ({"name": "parameter_server", "softsync": 2}, {"mode", "softsync"}, {"average_every"}),
        (
            {"name": "compute_groups", "num_groups": 2},
            {"num_groups", "momentum_compensation", "staleness_lr"},
            {"mode", "softsync", "alpha"},
        ),
        (
            {"name": "sma", "replicas_per_device": 2},
            {"replicas_per_device", "alpha", "central_momentum"},
            {"autotune_threshold", "average_every", "mode"},
        ),
        (
            {"name": "sma", "replicas_per_device": "auto"},
            {"autotune_threshold", "autotune_interval", "autotune_max_replicas", "autotune_rule"},
            set(),
        ),
        ({"name": "local_sgd"}, {"average_every", "replicas_per_device"}, {"alpha"}),
    ],
)
def test_protocol_section_holds_the_protocols_settings(protocol, present, absent):
    cfg = small_config(protocol={"num_learners": 4, **protocol})
    keys = set(written(cfg)["protocol"])
    assert {"name", "num_learners", "batch_size"} | present <= keys
    assert not keys & absent
    assert read_back(cfg.to_toml(applicable_only=True)) == cfg


def test_runtime_sections():
    sim = written(small_config())
    assert "dist" not in sim and "max_virtual_seconds" in sim["train"]
    assert "seconds_per_replica" not in sim["cluster"]  # one learner per device
    sma = written(small_config(protocol={"name": "sma", "num_learners": 2}))
    assert "seconds_per_replica" in sma["cluster"]
    dist = written(small_config(runtime="dist"))
    assert "cluster" not in dist and "max_virtual_seconds" not in dist["train"]
    assert "num_servers" not in dist["dist"] and "num_processes" in dist["dist"]
    ps = small_config(runtime="dist", protocol={"name": "parameter_server", "num_learners": 2})
    assert "num_servers" in written(ps)["dist"]


def test_round_trip_with_defaults_is_equal_and_unread_values_fall_back():
    """Left out = read back as the default: equal where every unread setting holds its
    default; a non-default unread setting falls back to its default, nothing read
    changes, and the text written is a fixed point."""
    for cfg in (RunConfig(), small_config(), RunConfig(runtime="dist")):
        assert read_back(cfg.to_toml(applicable_only=True)) == cfg
    odd = RunConfig.from_dict(
        {
            "data": {"noise": 2.0},  # synthetic only; Fashion-MNIST does not read it
            "protocol": {"alpha": 0.5, "mode": "async"},  # SMA's α, PS's mode: hardsync
            "schedule": {"decay_factor": 0.5},  # constant schedule
            "tune": {"budget_s": 60.0},
        }
    )
    text = odd.to_toml(applicable_only=True)
    back = read_back(text)
    assert back == odd.replace(
        data=DataConfig(),
        protocol=dataclasses.replace(odd.protocol, alpha=0.1, mode="softsync"),
        schedule=dataclasses.replace(odd.schedule, decay_factor=0.1),
        tune=config_module.TuneConfig(),
    )
    assert back.to_toml(applicable_only=True) == text


def test_resume_reads_a_config_toml_without_unread_settings(tmp_path, capsys):
    """A run with non-default unread settings resumes from its config.toml to the end."""
    cfg = small_config(protocol={"alpha": 0.5}, schedule={"decay_factor": 0.5})
    run = tmp_path / "r"
    distsgd.train(cfg, out_dir=run, overrides=["train.max_epochs=1"])
    assert "alpha" not in (run / "config.toml").read_text()
    summary = distsgd.train(resume=run, overrides=["train.max_epochs=2"])
    assert summary["epochs"] == 2.0 and summary["status"] == "completed"


@dataclass
class _LaterModelConfig(ModelConfig):
    """The model section with fields a later change might add."""

    hint: str | None = None
    later: int = 0


def test_unknown_fields_are_written_and_tables_round_trip(monkeypatch):
    monkeypatch.setitem(config_module._SECTIONS, "model", _LaterModelConfig)
    kwargs = {
        "hidden": [64, 32],
        "label": 'say "hi" \\ now\nand\ttab',
        "nested": {"deep": {"x": 1.5, "on": True, "empty": {}}, "list": [[1, 2], ["a"]]},
        "table": {"odd key": "ü"},
    }
    raw = {
        "model": {"factory": "mypkg.models:build", "kwargs": kwargs, "later": 2},
        "data": {"factory": "mypkg.data:load", "noise": 2.0},
    }
    cfg = RunConfig.from_dict(raw)
    text = cfg.to_toml(applicable_only=True)
    assert tomllib.loads(text)["model"] == {
        "factory": "mypkg.models:build",
        "kwargs": kwargs,
        "later": 2,  # a field this writer does not know: written
    }  # name: unread with a factory; hint = None (its default) is left out: TOML has no null
    assert "noise" not in tomllib.loads(text)["data"]  # the user's data: no synthetic settings
    assert read_back(text) == dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, noise=1.0)
    )
    assert read_back(cfg.to_toml()) == cfg
    cfg.model.name = None  # a None where the default is not None cannot be left out
    with pytest.raises(TypeError, match="model.name = None"):
        cfg.to_toml()


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"a": 1, "b": -2.5e-07, "c": float("inf")},
        ['quote " backslash \\ newline \n del \x7f nul \x00', "ünïcode"],
        {"a.b": {"c d": [{"e": 1}, {"f": [True, False]}]}},
    ],
)
def test_toml_values_round_trip(value):
    assert tomllib.loads(f"v = {_toml_value(value)}")["v"] == value


# ---- the report's accuracy axis -----------------------------------------------------
def test_curves_keep_the_first_evaluation_in_view(tmp_path, monkeypatch):
    """Before the fix the accuracy axis started 5 points below the second evaluation, so
    the first (the untrained model, ~10%) was cut off."""
    run = tmp_path / "r"
    distsgd.train(small_config(train={"max_epochs": 2}), out_dir=run)
    loaded = load_run(run)
    first = loaded.records[0]["eval_metric"] * 100
    assert first < min(r["eval_metric"] for r in loaded.records[1:]) * 100 - 5
    figures = []
    real_figure = distsgd.report._figure
    monkeypatch.setattr(
        distsgd.report, "_figure", lambda *a: figures.append(real_figure(*a)) or figures[-1]
    )
    plot_curves([loaded], tmp_path / "curves.png")
    accuracy_axes = figures[0].axes[:3]  # the top row
    for ax in accuracy_axes:
        if ax.lines:
            bottom, top = ax.get_ylim()
            assert bottom <= first <= top


# ---- packaging ----------------------------------------------------------------------
def test_torch_is_a_range_in_the_metadata_and_pinned_in_setup(tmp_path):
    """The built metadata asks torch>=2.3 (``pip install -e .`` keeps a user's torch);
    scripts/setup.sh pins the CPU build the project is tested with."""
    src = tmp_path / "src"
    (src / "distsgd").mkdir(parents=True)
    (src / "distsgd" / "__init__.py").write_text("")
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_text((REPO / name).read_text())
    code = (
        "import sys, setuptools.build_meta as b; "
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    )
    info = tmp_path / done.stdout.strip().splitlines()[-1] / "METADATA"
    requires = [
        line.split(":", 1)[1].strip()
        for line in info.read_text().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert [r for r in requires if re.match(r"torch\b(?!ft)", r)] == ["torch>=2.3"]
    # a peer measured against is a bench-only extra, never a dependency of distsgd
    assert [r for r in requires if "torchft" in r] == ['torchft==0.2.0; extra == "bench"']
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "'torch==2.13.0'" in setup
