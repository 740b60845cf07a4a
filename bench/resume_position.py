"""Resuming mid-epoch at a position of ``--batches`` batches: ``ElasticSampler`` side by
side with the HF Trainer's own skip and with iterating and discarding, in one run.

What a resumed job waits for before its first batch, with a map-style dataset of
``--batches`` x ``--batch`` x 2 small items (the position is the middle of the epoch),
shuffled, one process, ``num_workers=0``:

1. ``ElasticSampler``: ``load_state_dict`` of the saved position, then the first batch
   of a ``DataLoader`` over it (the integrations install it). The epoch's permutation is
   drawn once (``torch.randperm``), as any shuffled sampler's; nothing before the
   position is visited.
2. The HF Trainer's skip: accelerate's ``skip_first_batches`` over the loader accelerate
   prepared (``DataLoaderShard``), as ``Trainer._inner_training_loop`` does on resume: it
   iterates the batch sampler's indices up to the position (no item is loaded).
3. Iterate and discard: ``next()`` ``--batches`` times over a plain ``DataLoader``, items
   loaded (what a loop without a skip-aware sampler does, and Trainers before
   ``SkipBatchSampler``). Bounded by ``--discard-limit`` batches and extrapolated
   linearly, since it is the long one.

Each figure is the median of ``--repeat`` rounds; the ratios are to ours.

    python bench/resume_position.py [--batches 100000] [--batch 8] [--repeat 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import skip_first_batches
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler

from rallypoint.trainer import ElasticSampler

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last, as in the other benches
from bench._smoke import parse


class Items(Dataset[dict[str, torch.Tensor]]):
    """Items made from their index: 16 token ids each, as a tiny LM's."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(index, index + 16) % 50_000}


def timed(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100_000, help="the resume position")
    parser.add_argument("--batch", type=int, default=8, help="samples per batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--discard-limit", type=int, default=10_000)
    args = parse(parser, {"batches": 100, "repeat": 1, "discard_limit": 10})
    torch.set_num_threads(1)
    dataset = Items(args.batches * args.batch * 2)
    consumed = args.batches * args.batch
    discard = min(args.batches, args.discard_limit)
    print(
        f"resume at {args.batches:,} batches of {args.batch} "
        f"({consumed:,} of {len(dataset):,} samples), median of {args.repeat}:"
    )
    for shuffle in (True, False):

        def ours(shuffle: bool = shuffle) -> object:
            sampler = ElasticSampler(
                dataset, rank=0, world_size=1, batch_size=args.batch, shuffle=shuffle
            )
            sampler.load_state_dict({**sampler.state_dict(), "consumed": consumed})
            return next(iter(DataLoader(dataset, batch_size=args.batch, sampler=sampler)))

        def trainer_skip(shuffle: bool = shuffle) -> object:
            generator = torch.Generator().manual_seed(0)
            sampler = (
                RandomSampler(dataset, generator=generator)
                if shuffle
                else SequentialSampler(dataset)
            )
            loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
            prepared = prepare_data_loader(loader, put_on_device=False)
            return next(iter(skip_first_batches(prepared, args.batches)))

        def iterate_and_discard(shuffle: bool = shuffle) -> object:
            it = iter(DataLoader(dataset, batch_size=args.batch, shuffle=shuffle))
            for _ in range(discard):
                next(it)
            return next(it)

        rows = [
            ("ElasticSampler (ours)", timed(ours, args.repeat)),
            ("HF Trainer's skip (accelerate skip_first_batches)", timed(trainer_skip, args.repeat)),
            (
                f"iterate and discard ({discard:,} batches, x{args.batches / discard:g})",
                timed(iterate_and_discard, args.repeat) * args.batches / discard,
            ),
        ]
        base = rows[0][1]
        print("shuffled (each pays one randperm of the epoch):" if shuffle else "in order:")
        for name, seconds in rows:
            print(f"  {name:<58} {seconds * 1000:>10.1f} ms  x{seconds / base:,.1f}")


if __name__ == "__main__":
    main()
