"""The ``with`` protocol of objects that hold resources until :meth:`Closing.close`.

Shared by the client (:class:`rallypoint.client.ElasticClient`) and the trainer
(:class:`rallypoint.trainer.CheckpointManager`): it lives at the root of the package,
which both import, rather than in either side's private modules.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

_Self = TypeVar("_Self", bound="Closing")


class Closing:
    """A resource that a ``with`` block closes on leaving, however it leaves.

    Subclasses define :meth:`close`; entering returns the object itself, and leaving
    never suppresses the exception that left the block.

    Example::

        with ElasticClient.from_env() as client:
            client.join()
    """

    def close(self) -> None:
        """Frees what the object holds; a subclass must define it."""
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
