"""JSON values stored zlib-compressed across binary properties of one table entity.

Azure caps a property at 64 KiB and an entity at 1 MiB, so a value that may grow (a
thousand members, a rank's checkpoint metadata) is split into ``m0``, ``m1``, ...
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

from .storage import Value

__all__ = ["MAX_PACKED", "pack", "pack_rows", "unpack", "unpack_rows"]

_CHUNK = 60 * 1024
#: Compressed bytes one entity can carry beside its other properties.
MAX_PACKED = 14 * _CHUNK


def pack(value: Any) -> dict[str, bytes]:
    """``value`` as JSON, compressed, in properties ``m0``, ``m1``, ..."""
    return _properties(_compressed(value))


def pack_rows(value: Any) -> list[dict[str, bytes]]:
    """:func:`pack`, split over as many entities as it needs (one for most values), each
    with at most :data:`MAX_PACKED` bytes: a value that may outgrow one entity (the
    members of a 10,000-node generation) is stored across rows rather than refused."""
    packed = _compressed(value)
    return [_properties(packed[i : i + MAX_PACKED]) for i in range(0, len(packed), MAX_PACKED)]


def _compressed(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":")).encode(), 6)


def _properties(packed: bytes) -> dict[str, bytes]:
    return {f"m{i // _CHUNK}": packed[i : i + _CHUNK] for i in range(0, len(packed), _CHUNK)}


def unpack(data: Mapping[str, Value | None]) -> Any:
    """The value :func:`pack` stored in ``data``."""
    return unpack_rows([data])


def unpack_rows(rows: list[Mapping[str, Value | None]]) -> Any:
    """The value :func:`pack_rows` stored in ``rows``, in their order."""
    chunks = []
    for data in rows:
        for i in range(len(data)):
            chunk = data.get(f"m{i}")
            if not isinstance(chunk, bytes):
                break
            chunks.append(chunk)
    return json.loads(zlib.decompress(b"".join(chunks)))
