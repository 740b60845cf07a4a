"""DeepSpeed through Rallypoint (``pip install rallypoint[deepspeed]``): ZeRO-1/2/3
checkpoints saved as the coordinator's versions, restored from the one it names.

One line before ``deepspeed.initialize`` and two after, on every rank::

    import rallypoint.trainer.deepspeed as rp_deepspeed

    client = rp_deepspeed.init_distributed()                # joins, then the group
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=config)
    checkpoints = rp_deepspeed.install(engine, client)      # the CheckpointEngine
    rp_deepspeed.load_checkpoint(engine)                    # the coordinator's version
    for step in ...:
        ...
        if step % 50 == 0:
            engine.save_checkpoint("checkpoints")           # a version, saved async

``init_distributed`` joins before the group is built, so a node that joins a running
job (a hot join) waits there until it goes in. ``engine.save_checkpoint`` returns once
this rank's tensors are staged; the version is uploaded to this node's memory tier, a
peer's and (``persist_every``) blob storage in the background. A restart at another
data-parallel world size (a node lost, or one added) reshards ZeRO's partitions through
DeepSpeed's universal checkpoint. On a preemption notice,
``checkpoints.save_checkpoint(dir, persist=True, blocking=True)`` then
``PreemptionWatcher.finish()``. See docs/frameworks/deepspeed.md.

Importing this module imports DeepSpeed; ``import rallypoint.trainer`` does not.
"""

from ._deepspeed import (
    RallypointCheckpointEngine,
    init_distributed,
    install,
    installed,
    load_checkpoint,
)

__all__ = [
    "RallypointCheckpointEngine",
    "init_distributed",
    "install",
    "installed",
    "load_checkpoint",
]
