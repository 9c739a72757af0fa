import contextlib
import io
import os
import signal
import subprocess

import pytest
import torch

from distsgd.config import RunConfig
from distsgd.data import load_dataset
from distsgd.engine import build_engine, config_for_data
from distsgd.runtime.factory import runtime_kind
from distsgd.runtime.profiles import CACHE_ENV

# A fixed device profile and network keep virtual time (and so the asynchronous schedule)
# independent of this machine's speed.
FIXED_CLUSTER = {
    "seconds_per_sample": 1e-4,
    "seconds_per_batch": 1e-3,
    "latency_s": 1e-4,
    "bandwidth_gbps": 10.0,
}


def simulated_runtime(cfg: RunConfig) -> tuple:
    """``cfg``'s simulated runtime built as the trainer builds it (data, device profile,
    engine seeded with 0); returns ``(runtime, engine)``."""
    kind = runtime_kind(cfg)
    ds = load_dataset(cfg.data, seed=0)
    cfg, _ = kind.calibrate(config_for_data(cfg, ds), ds)
    torch.manual_seed(0)
    engine = build_engine(cfg)
    return kind.build(cfg, engine, ds, engine.initial_weights()), engine


def simulate_ticks(cfg: RunConfig, lr: float = 0.05) -> tuple:
    """:func:`simulated_runtime` of ``cfg`` advanced tick by tick at learning rate ``lr``
    until ``cfg.train.max_samples``; returns ``(runtime, engine, ticks)``."""
    rt, engine = simulated_runtime(cfg)
    ticks = 0
    while rt.samples < cfg.train.max_samples:
        rt.advance(lr)
        ticks += 1
    return rt, engine, ticks


def small_config(**sections) -> RunConfig:
    """A fast run: synthetic data, mlp, fixed profile, one thread, no progress."""
    raw = {
        "data": {"dataset": "synthetic", "num_train": 1024, "num_test": 256},
        "model": {"name": "mlp"},
        "protocol": {"name": "hardsync", "num_learners": 1, "batch_size": 32},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": dict(FIXED_CLUSTER),
        "train": {
            "target": 0.0,
            "max_epochs": 2,
            "eval_every_samples": 512,
            "num_threads": 1,
        },
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return RunConfig.from_dict(raw)


def pytest_collection_modifyitems(config, items):
    """The modules with slow tests (processes, end-to-end training) run first, each
    module's tests together and in their order: pytest-xdist hands the tests out in this
    order, so the queue ends with short tests that keep both cores busy to the end rather
    than one long test that leaves a core idle."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    """Simulated runs that calibrate keep their device profiles in a cache: the tests'
    goes to a temporary folder (shared by the session, and by the processes it starts),
    never the user's home."""
    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profile-cache")))
    yield
    patch.undo()


def cli_in_process(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    """``distsgd ARGV`` run by :func:`distsgd.cli.main` in this process, as a finished
    process would report it: exit status, stdout and stderr (an exception that escapes
    ``main`` fails the test, as a traceback would). Cheaper than a process per case, which
    pays torch's import; the suite keeps real processes where the process is the point."""
    from distsgd.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_sigterm = os.getcwd(), signal.getsignal(signal.SIGTERM)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(old_cwd)
        signal.signal(signal.SIGTERM, old_sigterm)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())
