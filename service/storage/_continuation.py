"""The tokens a table's pages hand out: opaque to callers, each adapter's own cursor
(where the next page starts) inside."""

from __future__ import annotations

import base64

from ..errors import BadRequest

__all__ = ["continuation_cursor", "continuation_token"]


def continuation_token(cursor: str) -> str:
    """The opaque token a :class:`Page` hands out for an adapter's ``cursor`` (where
    the next page starts, in the adapter's own terms)."""
    return base64.urlsafe_b64encode(cursor.encode()).decode()


def continuation_cursor(token: str) -> str:
    """The adapter's cursor in a token :func:`continuation_token` made.

    Raises:
        BadRequest: ``token`` is not one (a caller's typo, or another adapter's).
    """
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest("malformed continuation token") from exc
