"""Your loop, our protocols: distsgd's protocols behind the interface of Horovod and DDP.

A training script of your own (model, DataLoader, loss, logging, schedule), started by
``torchrun``, runs any of distsgd's protocols by changing three lines::

    import distsgd.torch as dsgd

    ctx = dsgd.init("sma", alpha=0.1)                 # 1. join the run: roles, process group
    if ctx.is_server:                                 #    (parameter server / compute groups)
        ctx.serve(model, out_dir="runs/ps", bn_data=DataLoader(data, batch_size=32))
        ctx.close(); raise SystemExit
    loader = DataLoader(data, batch_size=32, sampler=dsgd.Sampler(data, ctx, batch_size=32))
    opt = dsgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, ctx)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step(loss)                            # the protocol's step
    ctx.close()

The protocol objects (:mod:`distsgd.protocols`), the parameter-server transport
(:mod:`distsgd.runtime.ps`), the sharding (:class:`distsgd.data.ShardedSampler`), the
rank roles (:mod:`distsgd.layout`) and the failure handling (heartbeats, one
``PeerLost`` naming the lost rank) are those of ``distsgd train``.
"""

from distsgd.config import ConfigError
from distsgd.torch.context import Context, ServeResult, init, recalibrate_batchnorm
from distsgd.torch.optimizer import DistributedOptimizer
from distsgd.torch.sampler import Sampler

__all__ = [
    "ConfigError",
    "Context",
    "DistributedOptimizer",
    "Sampler",
    "ServeResult",
    "init",
    "recalibrate_batchnorm",
]
