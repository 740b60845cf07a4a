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

__all__ = ["MAX_PACKED", "pack", "unpack"]

_CHUNK = 60 * 1024
#: Compressed bytes one entity can carry beside its other properties.
MAX_PACKED = 14 * _CHUNK


def pack(value: Any) -> dict[str, bytes]:
    """``value`` as JSON, compressed, in properties ``m0``, ``m1``, ..."""
    packed = zlib.compress(json.dumps(value, separators=(",", ":")).encode(), 6)
    return {f"m{i // _CHUNK}": packed[i : i + _CHUNK] for i in range(0, len(packed), _CHUNK)}


def unpack(data: Mapping[str, Value | None]) -> Any:
    """The value :func:`pack` stored in ``data``."""
    chunks = []
    for i in range(len(data)):
        chunk = data.get(f"m{i}")
        if not isinstance(chunk, bytes):
            break
        chunks.append(chunk)
    return json.loads(zlib.decompress(b"".join(chunks)))
