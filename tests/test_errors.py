"""Every package's errors share one shape (:class:`rallypoint.coded.CodedError`): a
machine-readable ``code`` and the ``message`` raised with, and each package's hierarchy
stays its own: catching one package's base never catches another's errors."""

from __future__ import annotations

import pytest

from rallypoint.client.errors import RallypointError, ServerError, TransportError
from rallypoint.coded import CodedError
from rallypoint.service.errors import RallypointServiceError, StaleGeneration
from rallypoint.trainer.errors import CheckpointCorrupt, RallypointTrainerError

MESSAGE = "generation 3 ended"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (TransportError(MESSAGE), "unreachable"),
        (ServerError(MESSAGE, code="job_full", status=409), "job_full"),
        (StaleGeneration(MESSAGE), "stale_generation"),
        (CheckpointCorrupt(MESSAGE), "checkpoint_corrupt"),
    ],
)
def test_an_error_carries_its_code_and_message(error: CodedError, code: str) -> None:
    assert isinstance(error, CodedError)
    assert (error.code, error.message, str(error)) == (code, MESSAGE, MESSAGE)


def test_each_package_keeps_its_own_hierarchy() -> None:
    bases = (RallypointError, RallypointServiceError, RallypointTrainerError)
    errors = (TransportError("x"), StaleGeneration("x"), CheckpointCorrupt("x"))
    for base, error in zip(bases, errors, strict=True):
        assert [isinstance(error, b) for b in bases] == [b is base for b in bases]
