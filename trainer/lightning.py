"""PyTorch Lightning on Rallypoint (``pip install rallypoint[trainer,lightning]``).

Under ``torchrun --rdzv-backend=rallypoint``, a Lightning script changes one argument::

    from rallypoint.trainer import SavePolicy
    from rallypoint.trainer.lightning import RallypointDDPStrategy

    trainer = L.Trainer(
        # or RallypointModelParallelStrategy(policy=...)
        strategy=RallypointDDPStrategy(policy=SavePolicy(persist_every=10)),
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        callbacks=[ModelCheckpoint(every_n_train_steps=50)],
        ...,
    )
    trainer.fit(model)  # resumes from the coordinator's version: no ckpt_path

- ``fit()`` resumes from the version the coordinator named for this generation, the same
  for every rank; ``ckpt_path="last"`` (or a path, once the job has a version) is
  overridden, so a folder holding a newer-looking ``last.ckpt`` changes nothing.
- ``ModelCheckpoint(monitor=..., save_top_k=k)`` becomes the job's ``keep_best`` rule:
  every version carries the monitored values and the coordinator pins the ``k`` best
  from collection; ``validate``/``test``/``predict(ckpt_path="best" | "last")`` load the
  job's best and latest versions, also in a process that never joined the job.
- Every save ``ModelCheckpoint`` decides on goes through :class:`CheckpointManager`:
  staged while training waits, then in the background to this node's memory, a peer
  node's and (every ``persist_every``-th) blob storage; sharded state one file per rank.
- The training loader's sampler becomes an ``ElasticSampler`` (a script's own
  ``ElasticSampler`` is taken over, its order kept): every version holds the epoch and
  the samples trained, and a resumed generation at any world size trains the rest of
  the epoch, in its order, once. The first generation's global batch is kept
  (``plan_batch``: accumulation, else a smaller per-device batch); a world size that
  cannot split it raises ``WorldSizeError`` before training. ``elastic_data=False`` and
  ``keep_global_batch=False`` opt out.
- A preemption notice (Azure Scheduled Events, or SIGTERM) stops every rank at the same
  step with an emergency version in blob storage, then leaves through Lightning's
  ``SIGTERMException`` path.

``import rallypoint.trainer`` never imports this module or Lightning.
"""

from ._lightning import (
    RESUME_SCHEME,
    RallypointCheckpointIO,
    RallypointDDPStrategy,
    RallypointModelParallelStrategy,
    RallypointPreemption,
)

__all__ = [
    "RESUME_SCHEME",
    "RallypointCheckpointIO",
    "RallypointDDPStrategy",
    "RallypointModelParallelStrategy",
    "RallypointPreemption",
]
