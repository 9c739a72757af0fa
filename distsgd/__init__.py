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

from distsgd.api import FitResult, export_model, fit, train
from distsgd.config import ConfigError, RunConfig

__version__ = "0.1.0"
__all__ = ["train", "fit", "FitResult", "export_model", "RunConfig", "ConfigError", "__version__"]
