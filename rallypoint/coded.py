"""The shape every Rallypoint error shares: a message, and a machine-readable ``code``.

Each package keeps its own hierarchy (:mod:`rallypoint.client.errors`,
:mod:`rallypoint.trainer.errors`, :mod:`rallypoint.service.errors`); their bases derive
from :class:`CodedError`, which lives at the root of the package, which all three
import, rather than in one side's private modules.
"""

from __future__ import annotations

__all__ = ["CodedError"]


class CodedError(Exception):
    """An error with a machine-readable ``code`` (a class attribute each subclass sets)
    and its ``message``, the text it was raised with.

    Example::

        >>> class Late(CodedError):
        ...     code = "late"
        >>> e = Late("the version expired")
        >>> (e.code, e.message, str(e))
        ('late', 'the version expired', 'the version expired')
    """

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
