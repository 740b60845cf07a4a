"""The ``torchrun.handlers`` entry point, kept apart from the handler itself.

torch loads every such entry point while ``torch.distributed.elastic.rendezvous`` is
being imported, which ``rallypoint.trainer`` itself does: the creator must not need the
handler's module to be importable yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["plugin"]


def plugin() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """What torch calls for the handler creator of ``--rdzv-backend=rallypoint``."""

    def create(params: RendezvousParameters) -> RendezvousHandler:
        from ._rendezvous import create_handler

        return create_handler(params)

    return create
