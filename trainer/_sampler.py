"""A distributed sampler whose position in the epoch is part of the checkpoint.

``torch.utils.data.DistributedSampler`` deals a fixed permutation out to a fixed number of
ranks and restarts each epoch from the top, so a job that is preempted mid-epoch and resumes
on a different number of machines either repeats the samples it already trained on or, if
the script skips ahead by a batch count, skips samples that the old layout never dealt to
the ranks that survived. :class:`ElasticSampler` instead keeps a *global* position: how
many samples of this epoch's permutation all ranks together have trained on. That number
means the same thing at every world size, so it is checkpointed once (replicated state) and
a resumed job at any world size deals out exactly the samples not yet trained on.

Typical loop::

    sampler = ElasticSampler(dataset, rank=rank, world_size=world, batch_size=bs)
    if checkpoint is not None:
        sampler.load_state_dict(checkpoint["sampler"])
    loader = DataLoader(dataset, batch_size=bs, sampler=sampler)
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)  # keeps the restored position for the restored epoch
        for batch in loader:
            train_step(batch)
            sampler.advance()  # after the optimizer step: every rank trained one batch
            if time_to_checkpoint:
                save({"sampler": sampler.state_dict(), ...})
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["ElasticSampler"]

# The keys of ``state_dict()``; ``load_state_dict`` requires all of them.
_STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "length")


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but ``rank=True`` or ``"epoch": False`` is a bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _in_chunks(share: torch.Tensor, chunk: int = 4096) -> Iterator[int]:
    """The indices of ``share`` (a view of the epoch's permutation) as Python ints, a
    chunk at a time: the first batch of a resumed epoch does not wait for the whole rest
    of the epoch to become a list (60 ms for 800,000 indices here)."""
    for begin in range(0, len(share), chunk):
        yield from share[begin : begin + chunk].tolist()


class ElasticSampler(Sampler[int]):
    """Deals each epoch's permutation out to the ranks, resuming where the job left off.

    Each epoch has a permutation ``perm`` of ``range(len(dataset))`` (a seeded shuffle, or
    the identity when ``shuffle`` is false), the same on every rank. The sampler's state is
    global: the epoch and ``consumed``, the number of samples at the front of ``perm`` that
    all ranks together have trained on. With ``remaining = perm[consumed:]``, rank ``r`` of
    ``world_size`` ranks yields ``remaining[r::world_size]``, truncated so that every rank
    yields the same number of samples, ``len(remaining) // world_size``.

    Dealing round-robin is what makes the position world-size independent: once every rank
    has trained ``k`` batches of ``batch_size``, the samples trained on are exactly the
    prefix ``remaining[: k * batch_size * world_size]``, which :meth:`advance` adds to
    ``consumed``.

    The tail of fewer than ``world_size`` samples left over at the end of an epoch is
    dropped (as ``DistributedSampler(drop_last=True)`` does), because a rank that got one
    sample fewer would run one collective fewer and hang the others. After a resume at a
    different world size the tail is computed for the new world size, so it is at most
    ``world_size - 1`` samples of the epoch.

    Iterating does not move the position: a ``DataLoader`` prefetches ahead of training,
    and only samples that went into an optimizer step count. Call :meth:`advance` for that.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
    ) -> None:
        """Creates a sampler at the start of epoch 0.

        Args:
            dataset: The dataset, or its length. Only its length is used, read once here.
            rank: This process's rank, in ``[0, world_size)``.
            world_size: The number of data-parallel ranks, at least 1.
            shuffle: Whether each epoch is a seeded permutation rather than ``0, 1, ...``.
            seed: The shuffle seed; epoch ``e`` uses ``seed + e``. Must be the same on
                every rank, and the same after a resume.
            batch_size: The per-rank batch size the loader uses; :meth:`advance` counts in
                batches of it.

        Raises:
            ValueError: An argument is out of range.
        """
        super().__init__()
        length = dataset if isinstance(dataset, int) else len(dataset)
        if not _is_int(length) or length < 0:
            raise ValueError(f"dataset length must be an int >= 0, got {length!r}")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._length = length
        self._rank = rank
        self._world_size = world_size
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._batch_size = batch_size
        self._epoch = 0
        self._consumed = 0
        # The shuffled permutation of one epoch, kept because every __iter__ of the epoch
        # needs it and shuffling a large dataset is not free. A tensor, not a list: 8 bytes
        # an index rather than ~36 for a list of Python ints.
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of this epoch's permutation that all ranks together have trained on."""
        return self._consumed

    @property
    def remaining(self) -> int:
        """Samples of this epoch not yet trained on, by all ranks together.

        This includes the tail that :meth:`__iter__` drops, so it can be nonzero when no
        rank has anything left to yield.
        """
        return self._length - self._consumed

    def _shuffled(self) -> torch.Tensor:
        if self._perm_cache is not None and self._perm_cache[0] == self._epoch:
            return self._perm_cache[1]
        # A private generator, so neither the global RNG nor other users of it change the
        # order: every rank, and every resume, must compute the same permutation.
        generator = torch.Generator()
        generator.manual_seed(self._seed + self._epoch)
        perm = torch.randperm(self._length, generator=generator)
        self._perm_cache = (self._epoch, perm)
        return perm

    def __len__(self) -> int:
        """The number of indices this rank yields from the current position to the epoch end."""
        return self.remaining // self._world_size

    def __iter__(self) -> Iterator[int]:
        """Yields this rank's share of the samples not yet trained on in this epoch."""
        # Read the position now, not lazily while yielding: advance() runs while a
        # DataLoader is still drawing from this iterator, and the iterator must keep
        # dealing the layout it started with.
        consumed = self._consumed
        count = (self._length - consumed) // self._world_size
        start = consumed + self._rank
        stop = start + count * self._world_size
        if not self._shuffle:
            return iter(range(start, stop, self._world_size))
        return _in_chunks(self._shuffled()[start : stop : self._world_size])

    def advance(self, batches: int = 1) -> None:
        """Records that every rank has trained ``batches`` more batches of ``batch_size``.

        Call it after each optimizer step (with the number of batches that step consumed,
        for gradient accumulation), on every rank alike. The position never passes the end
        of the epoch: the last, possibly short, batch of an epoch takes it to the end.

        Args:
            batches: How many batches each rank trained since the last call, at least 0.

        Raises:
            ValueError: ``batches`` is negative or not an int.
        """
        if not _is_int(batches) or batches < 0:
            raise ValueError(f"batches must be an int >= 0, got {batches!r}")
        step = batches * self._batch_size * self._world_size
        self._consumed = min(self._length, self._consumed + step)

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``, or stays put if it is the current epoch.

        Staying put is what lets a resumed job call ``set_epoch(epoch)`` at the top of its
        epoch loop, as with ``DistributedSampler``, without losing the restored position.

        Args:
            epoch: The epoch to train next, at least 0.

        Raises:
            ValueError: ``epoch`` is negative or not an int.
        """
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Returns the position, as plain JSON-able values.

        The state is the same on every rank and does not depend on the world size, so save
        it once as replicated state and load it into the samplers of any world size.

        Returns:
            ``{"epoch", "consumed", "seed", "shuffle", "length"}``; the last three only
            check, on load, that the permutation is the one the position refers to.
        """
        return {
            "epoch": self._epoch,
            "consumed": self._consumed,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "length": self._length,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the position saved by :meth:`state_dict`, at any rank and world size.

        Args:
            state: What :meth:`state_dict` returned, possibly through JSON.

        Raises:
            ValueError: A key is missing or malformed, or the state is of a different
                permutation (another dataset length, seed, or shuffle setting), where the
                saved position would silently point at other samples.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(missing)}")
        mine = self.state_dict()
        for key in ("length", "seed", "shuffle"):
            # Compare types too: a JSON "seed": "0" or "shuffle": 1 is not this sampler's.
            theirs = state[key]
            if type(theirs) is not type(mine[key]) or theirs != mine[key]:
                raise ValueError(
                    f"sampler state has {key}={theirs!r} but this sampler has "
                    f"{key}={mine[key]!r}; it was saved for a different dataset or order"
                )
        epoch, consumed = state["epoch"], state["consumed"]
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"sampler state has a bad epoch: {epoch!r}")
        if not _is_int(consumed) or not 0 <= consumed <= self._length:
            raise ValueError(
                f"sampler state has a bad consumed: {consumed!r} (length {self._length})"
            )
        self._epoch = epoch
        self._consumed = consumed
