"""The Hugging Face Trainer through Rallypoint (``pip install rallypoint[transformers]``).

Two names change: ``Trainer`` becomes :class:`RallypointTrainer` (and
``resume_from_checkpoint=True`` now means "the version the coordinator named"), and
``TrainingArguments`` :class:`RallypointTrainingArguments`::

    from rallypoint.trainer.transformers import RallypointTrainer, RallypointTrainingArguments

    args = RallypointTrainingArguments(output_dir="out", ...)  # was: TrainingArguments
    trainer = RallypointTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=True)

``RallypointTrainingArguments`` join the job before they build the process group, so a
node that joins a running job (a hot join) waits there until it goes in.

Saves (``save_steps``) become versions: model, optimizer, scheduler, each rank's RNG
and ``trainer_state``, staged and uploaded in the background through the memory tier,
a peer and blob storage. With ``deepspeed=`` in the arguments, DeepSpeed's own save and
load go through :mod:`rallypoint.trainer.deepspeed`. A preemption notice stops every
rank at one step, saves with ``persist=True`` and leaves.

The Trainer's best-model arguments act on the coordinator's versions:
``metric_for_best_model`` keeps the best version (``keep_best``) and each version
carries its step's evaluation; ``save_total_limit`` is the job's ``keep_last``;
``load_best_model_at_end`` loads ``best``; ``save_model()`` (and ``push_to_hub``) writes
the version the model in memory holds, exported in ``hf`` format. See
docs/frameworks/transformers.md.

Importing this module imports transformers; ``import rallypoint.trainer`` does not.
"""

from ._transformers import PreemptionCallback, RallypointTrainer, RallypointTrainingArguments

__all__ = ["PreemptionCallback", "RallypointTrainer", "RallypointTrainingArguments"]
