"""distsgd: distributed SGD protocols on a simulated cluster and on torch.distributed.

Protocols: hardsync (S-SGD), Rudra's parameter server (n-softsync, async, hardsync,
staleness-dependent learning rates), Omnivore's compute groups, Crossbow's synchronous
model averaging, local SGD. One call trains and returns the summary::

    import distsgd
    summary = distsgd.train("configs/hardsync.toml")
"""

from distsgd.api import train
from distsgd.config import ConfigError, RunConfig

__version__ = "0.1.0"
__all__ = ["train", "RunConfig", "ConfigError", "__version__"]
