"""ElasticSampler: every sample of an epoch trained once, across resumes at any world size."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from rallypoint.trainer._sampler import ElasticSampler


def _ranks(length: int, world: int, **kwargs: Any) -> list[ElasticSampler]:
    return [ElasticSampler(length, rank=r, world_size=world, **kwargs) for r in range(world)]


def _train(samplers: list[ElasticSampler], steps: int, batch_size: int) -> list[int]:
    """Every rank trains ``steps`` batches from a fresh iterator; returns the samples seen."""
    seen: list[int] = []
    for sampler in samplers:
        seen += itertools.islice(iter(sampler), steps * batch_size)
    for sampler in samplers:
        sampler.advance(steps)
    return seen


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("length", "world", "batch"), [(24, 4, 3), (60, 5, 2), (7, 1, 7)])
def test_epoch_covers_every_index_once(shuffle: bool, length: int, world: int, batch: int) -> None:
    samplers = _ranks(length, world, shuffle=shuffle, seed=3, batch_size=batch)
    shares = [list(s) for s in samplers]
    assert {len(share) for share in shares} == {length // world}
    assert all(len(s) == length // world for s in samplers)
    everything = [i for share in shares for i in share]
    assert sorted(everything) == list(range(length))
    if not shuffle:
        assert shares[0][:2] == [0, world]


def test_tail_shorter_than_world_is_dropped() -> None:
    samplers = _ranks(10, 4, seed=1)
    everything = [i for s in samplers for i in s]
    assert len(everything) == 8 == len(set(everything))
    assert all(len(s) == 2 for s in samplers)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("new_world", [1, 3, 4, 5, 7])
@pytest.mark.parametrize(("new_batch", "steps"), [(2, 5), (3, 0), (1, 12)])
def test_resume_at_other_world_size(
    shuffle: bool, new_world: int, new_batch: int, steps: int
) -> None:
    length, batch = 103, 2
    before = _ranks(length, 4, shuffle=shuffle, seed=11, batch_size=batch)
    trained = _train(before, steps, batch)
    states = [s.state_dict() for s in before]
    # Replicated state: every rank saved the same thing, and it survives JSON.
    assert all(state == states[0] for state in states)
    assert states[0]["consumed"] == steps * batch * 4
    state = json.loads(json.dumps(states[0]))

    after = _ranks(length, new_world, shuffle=shuffle, seed=11, batch_size=new_batch)
    for sampler in after:
        sampler.load_state_dict(state)
        sampler.set_epoch(0)  # what the epoch loop of a resumed script does first
    rest = [i for s in after for i in s]

    union = trained + rest
    assert len(union) == len(set(union)), "a sample was trained twice"
    dropped = set(range(length)) - set(union)
    assert len(dropped) < new_world
    assert len(dropped) == (length - steps * batch * 4) % new_world


def test_chain_of_resumes_covers_the_epoch() -> None:
    """4 ranks, then 3, then 6, then 2, each checkpointing mid-epoch."""
    length, seed = 200, 5
    trained: list[int] = []
    state: dict[str, Any] | None = None
    world = 0
    for world, batch, steps in [(4, 4, 3), (3, 2, 5), (6, 1, 4), (2, 5, 1000)]:
        samplers = _ranks(length, world, seed=seed, batch_size=batch)
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        steps = min(steps, -(-len(samplers[0]) // batch))  # the last batch may be short
        trained += _train(samplers, steps, batch)
        state = samplers[0].state_dict()
    assert state is not None and state["consumed"] == length
    assert len(trained) == len(set(trained))
    assert len(set(range(length)) - set(trained)) < world


def test_same_permutation_on_every_rank_new_one_each_epoch() -> None:
    a = ElasticSampler(50, rank=0, world_size=1, seed=7)
    b = ElasticSampler(50, rank=0, world_size=1, seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    first = list(a)
    torch.manual_seed(456)
    assert list(b) == first
    assert first != list(range(50))

    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(second) == list(range(50))
    assert list(ElasticSampler(50, rank=0, world_size=1, seed=8)) != first

    # Ranks deal the same permutation: rank r of 5 gets every 5th entry from r.
    for rank in range(5):
        s = ElasticSampler(50, rank=rank, world_size=5, seed=7)
        s.set_epoch(1)
        assert list(s) == second[rank::5]


def test_set_epoch_keeps_position_only_within_the_epoch() -> None:
    s = ElasticSampler(40, rank=0, world_size=2, batch_size=3)
    s.advance()
    assert (s.epoch, s.consumed, s.remaining, len(s)) == (0, 6, 34, 17)
    s.set_epoch(0)
    assert s.consumed == 6
    s.set_epoch(1)
    assert (s.epoch, s.consumed, s.remaining) == (1, 0, 40)
    s.advance(2)
    s.set_epoch(1)
    assert s.consumed == 12
    s.set_epoch(0)  # going back is a new start too
    assert s.consumed == 0


def test_advance_caps_at_epoch_end() -> None:
    s = ElasticSampler(10, rank=1, world_size=3, batch_size=2)
    s.advance(0)
    assert s.consumed == 0
    s.advance()
    assert s.consumed == 6
    s.advance()  # the short last batch ends the epoch
    assert (s.consumed, s.remaining, len(s), list(s)) == (10, 0, 0, [])
    s.advance(100)
    assert s.consumed == 10
    with pytest.raises(ValueError, match="batches"):
        s.advance(-1)


def test_iteration_does_not_move_the_position() -> None:
    s = ElasticSampler(30, rank=1, world_size=3, batch_size=2)
    it = iter(s)
    expected = list(s)
    assert s.consumed == 0
    got = [next(it), next(it)]
    s.advance()  # a live iterator keeps the layout it started with
    got += list(it)
    assert got == expected
    assert list(s) == expected[2:]


@pytest.mark.parametrize(
    ("key", "value"),
    [("length", 41), ("seed", 1), ("shuffle", False), ("seed", "0"), ("shuffle", 1)],
)
def test_load_refuses_other_permutation(key: str, value: object) -> None:
    s = ElasticSampler(40, rank=0, world_size=2, seed=0)
    state = s.state_dict() | {key: value, "consumed": 8}
    with pytest.raises(ValueError, match=key):
        s.load_state_dict(state)
    assert s.consumed == 0


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0, "seed": 0, "shuffle": True, "length": 40},
        {"epoch": -1, "consumed": 0, "seed": 0, "shuffle": True, "length": 40},
        {"epoch": 0, "consumed": 41, "seed": 0, "shuffle": True, "length": 40},
        {"epoch": 0, "consumed": "2", "seed": 0, "shuffle": True, "length": 40},
    ],
)
def test_load_refuses_malformed_state(state: dict[str, Any]) -> None:
    s = ElasticSampler(40, rank=0, world_size=2, seed=0)
    with pytest.raises(ValueError, match="sampler state"):
        s.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 0, "world_size": 1, "batch_size": 0}, "batch_size"),
        ({"rank": True, "world_size": 2}, "rank"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ElasticSampler(10, **kwargs)


def test_invalid_length_and_epoch() -> None:
    with pytest.raises(ValueError, match="length"):
        ElasticSampler(-1, rank=0, world_size=1)
    s = ElasticSampler([], rank=0, world_size=1)
    assert (len(s), list(s)) == (0, [])
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)


def test_with_dataloader() -> None:
    dataset = TensorDataset(torch.arange(48) * 10)
    world, batch = 3, 4
    samplers = [
        ElasticSampler(dataset, rank=r, world_size=world, batch_size=batch, seed=2)
        for r in range(world)
    ]
    loaders = [DataLoader(dataset, batch_size=batch, sampler=s) for s in samplers]
    assert [len(loader) for loader in loaders] == [4] * world

    # One step on every rank, then a checkpoint and a resume on two ranks.
    seen: list[int] = []
    for loader in loaders:
        (values,) = next(iter(loader))
        assert values.shape == (batch,)
        seen += (values // 10).tolist()
    for sampler in samplers:
        sampler.advance()
    state = samplers[0].state_dict()

    resumed = [
        ElasticSampler(dataset, rank=r, world_size=2, batch_size=batch, seed=2) for r in range(2)
    ]
    for sampler in resumed:
        sampler.load_state_dict(state)
        for (values,) in DataLoader(dataset, batch_size=batch, sampler=sampler):
            seen += (values // 10).tolist()
    assert sorted(seen) == list(range(48))


@pytest.mark.parametrize("make", [DataLoader, StatefulDataLoader], ids=["DataLoader", "Stateful"])
def test_loader_worker_processes_resume_exactly(make: Any) -> None:
    """With ``num_workers`` > 0 (the sampler runs in the training process; the workers
    only fetch the indices it deals) and under torchdata's ``StatefulDataLoader`` alike:
    3 ranks train 3 steps, 2 ranks resume and finish the epoch, every item once."""
    dataset = TensorDataset(torch.arange(96))
    world, batch = 3, 4
    samplers = [
        ElasticSampler(dataset, rank=r, world_size=world, batch_size=batch, seed=5)
        for r in range(world)
    ]
    seen: list[int] = []
    for sampler in samplers:
        batches = iter(make(dataset, batch_size=batch, sampler=sampler, num_workers=2))
        for _ in range(3):
            seen += next(batches)[0].tolist()
        del batches  # its workers stop
    for sampler in samplers:
        sampler.advance(3)
    state = json.loads(json.dumps(samplers[0].state_dict()))
    for rank in range(2):
        sampler = ElasticSampler(dataset, rank=rank, world_size=2, batch_size=batch, seed=5)
        sampler.load_state_dict(state)
        for (values,) in make(dataset, batch_size=batch, sampler=sampler, num_workers=2):
            seen += values.tolist()
    assert sorted(seen) == list(range(96))
