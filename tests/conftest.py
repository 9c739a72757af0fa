import pytest
import torch

from distsgd.config import RunConfig
from distsgd.runtime.profiles import CACHE_ENV

# A fixed device profile and network keep virtual time (and so the asynchronous schedule)
# independent of this machine's speed.
FIXED_CLUSTER = {
    "seconds_per_sample": 1e-4,
    "seconds_per_batch": 1e-3,
    "latency_s": 1e-4,
    "bandwidth_gbps": 10.0,
}


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
