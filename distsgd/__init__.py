"""distsgd: distributed SGD protocols on a simulated cluster and on torch.distributed.

Protocols: hardsync (S-SGD), Rudra's parameter server (n-softsync, async, hardsync,
staleness-dependent learning rates), Omnivore's compute groups, Crossbow's synchronous
model averaging, local SGD. One call trains and returns the summary::

    import distsgd
    summary = distsgd.train("configs/hardsync.toml")

and one trains the user's own module and data and returns the trained model with it::

    result = distsgd.fit(my_module, (x_train, y_train), (x_test, y_test))
    result.model, result.summary["final_metric"]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distsgd.api import FitResult, export_model, fit, train
    from distsgd.config import ConfigError, RunConfig

__version__ = "0.1.0"
__all__ = ["train", "fit", "FitResult", "export_model", "RunConfig", "ConfigError", "__version__"]

_LAZY = {"train": "api", "fit": "api", "FitResult": "api", "export_model": "api"}
_LAZY.update(RunConfig="config", ConfigError="config")


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (PEP 562): importing a subpackage
    (``distsgd.protocols``, ``distsgd.torch``) loads no trainer, launcher or tuner."""
    if name not in _LAZY:
        raise AttributeError(f"module 'distsgd' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distsgd.{_LAZY[name]}"), name)
