"""What every storage port holds open: a table or a container that answers a readiness
probe and is closed with the storage that opened it."""

from __future__ import annotations

import abc

__all__ = ["Port"]


class Port(abc.ABC):
    """A table or container of a storage backend, opened once and shared."""

    name: str

    @abc.abstractmethod
    def ping(self) -> None:
        """Checks that the table or container answers (readiness).

        Raises:
            StorageUnavailable: It does not.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most adapters hold nothing
        """Releases connections; the table or container is unusable afterwards."""
