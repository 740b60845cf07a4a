"""The save policy as a specification: one typed, validated value that CheckpointManager
and every framework adapter take (no storage, no clock)."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

from rallypoint.trainer import CheckpointManager, SavePolicy

pytestmark = pytest.mark.unit


def test_the_defaults_send_every_version_to_storage_and_overlap_the_copy() -> None:
    policy = SavePolicy()
    assert (policy.persist_every, policy.persist_after, policy.if_busy) == (1, None, "wait")
    assert policy.overlap and policy.progress and policy.attempts == 3
    assert policy.persist_after_s is None


def test_seconds_are_kept_as_a_timedelta() -> None:
    policy = SavePolicy(persist_after=300)
    assert policy.persist_after == timedelta(minutes=5) and policy.persist_after_s == 300.0
    assert SavePolicy(persist_after=timedelta(seconds=1.5)).persist_after_s == 1.5


@pytest.mark.parametrize(
    "fields",
    [
        {"persist_every": 0},
        {"persist_every": True},
        {"persist_after": 0},
        {"persist_after": timedelta(seconds=-1)},
        {"persist_after": "300"},
        {"if_busy": "drop"},
        {"attempts": 0},
    ],
)
def test_a_value_out_of_range_is_refused_when_the_policy_is_made(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SavePolicy(**fields)  # type: ignore[arg-type]


def test_a_policy_is_a_value() -> None:
    policy = SavePolicy(persist_every=10)
    with pytest.raises(AttributeError):
        policy.persist_every = 2  # type: ignore[misc]
    assert policy.replace(if_busy="skip") == SavePolicy(persist_every=10, if_busy="skip")
    with pytest.raises(ValueError):
        policy.replace(persist_every=0)


def test_the_manager_takes_a_policy_or_its_fields_never_both() -> None:
    """The fields one by one are the manager's own interface (a policy built from them);
    both at once would leave one of them silently ignored."""
    parameters = inspect.signature(CheckpointManager).parameters
    fields = set(SavePolicy.__dataclass_fields__)
    assert fields <= set(parameters) and "policy" in parameters
    with pytest.raises(TypeError, match="persist_every"):
        CheckpointManager(object(), policy=SavePolicy(), persist_every=2)  # type: ignore[arg-type]


def test_every_adapter_takes_the_policy_and_none_repeats_its_fields() -> None:
    """The save policy lives in one place: each framework adapter takes ``policy`` (the
    HF Trainer ``checkpoint_policy``, beside the Trainer's own arguments) and none of
    its fields one by one."""
    from rallypoint.trainer import _deepspeed, _lightning, _transformers

    fields = set(SavePolicy.__dataclass_fields__)
    takers = {
        _lightning.Session: "policy",
        _lightning.RallypointCheckpointIO: "policy",
        _lightning.RallypointDDPStrategy: "policy",
        _lightning.RallypointModelParallelStrategy: "policy",
        _deepspeed.install: "policy",
        _transformers.RallypointTrainer: "checkpoint_policy",
    }
    for taker, name in takers.items():
        parameters = inspect.signature(taker).parameters
        assert name in parameters, taker
        assert not fields & set(parameters), taker
