"""Name and size rules shared by every adapter, checked before a request is sent.

Both adapters enforce Azure's limits so that code which works on the embedded local
storage cannot fail for the first time in production.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from ..errors import BadRequest, InvalidName, LimitExceeded

__all__ = [
    "MAX_BATCH_OPS",
    "check_blob_name",
    "check_blob_prefix",
    "check_entity",
    "check_key",
    "check_property_name",
    "entity_size",
]

MAX_KEY_BYTES = 1024  # PartitionKey and RowKey, counted in UTF-16 as Azure does
MAX_PROPERTY_BYTES = 64 * 1024  # one string (UTF-16) or binary property
MAX_ENTITY_BYTES = 1024 * 1024
MAX_PROPERTIES = 252  # custom properties, besides PartitionKey, RowKey and Timestamp
MAX_BATCH_OPS = 100
MAX_BLOB_NAME = 1024
MAX_SEGMENT_BYTES = 255  # one path segment is one file name on the local backend
INT64 = (-(2**63), 2**63 - 1)

# Control characters are refused everywhere; Azure also refuses these in table keys.
_KEY_FORBIDDEN = re.compile(r"[/\\#?\x00-\x1f\x7f-\x9f]")
# `%` would let an encoded `/` or `..` (`%2F`, `%2e%2e`) reach a server that decodes it.
_BLOB_FORBIDDEN = re.compile(r"[\\%?#\x00-\x1f\x7f-\x9f]")
_PROPERTY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_RESERVED_PROPERTIES = {"PartitionKey", "RowKey", "Timestamp", "ETag"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass"))


def check_key(kind: str, key: object) -> str:
    """Checks a PartitionKey or RowKey and returns it."""
    if not isinstance(key, str):
        raise InvalidName(f"{kind} must be a string, not {type(key).__name__}")
    if not key:
        raise InvalidName(f"{kind} must not be empty")
    if _KEY_FORBIDDEN.search(key) or _SURROGATE.search(key):
        raise InvalidName(f"{kind} {key!r} holds / \\ # ? or a control character")
    if _utf16_len(key) > MAX_KEY_BYTES:
        raise InvalidName(f"{kind} is over {MAX_KEY_BYTES} bytes (UTF-16)")
    return key


def check_property_name(name: object) -> str:
    if not isinstance(name, str) or not _PROPERTY_NAME.fullmatch(name):
        raise InvalidName(
            f"property name {name!r} is not an identifier of 1 to 255 ASCII letters, "
            "digits and underscores"
        )
    if name in _RESERVED_PROPERTIES or name.lower().startswith("odata"):
        raise InvalidName(f"property name {name!r} is reserved by Azure Table storage")
    return name


def _value_size(name: str, value: object) -> int:
    """Bytes one property takes in Azure's entity-size formula; checks its type."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        if not INT64[0] <= value <= INT64[1]:
            raise LimitExceeded(f"property {name!r}: {value} does not fit in 64 bits")
        return 8
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRequest(f"property {name!r}: {value} is not a finite number")
        return 8
    if isinstance(value, str):
        if value.isascii():  # most of what is stored (progress rows): no scan, no encoding
            size = 2 * len(value)
        elif _SURROGATE.search(value):
            raise InvalidName(f"property {name!r} holds an unpaired surrogate")
        else:
            size = _utf16_len(value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        size = len(value)
    else:
        raise BadRequest(
            f"property {name!r} has type {type(value).__name__}; a table stores "
            "str, int, float, bool and bytes"
        )
    if size > MAX_PROPERTY_BYTES:
        raise LimitExceeded(
            f"property {name!r} holds {size} bytes; Azure takes at most {MAX_PROPERTY_BYTES}"
        )
    return size + 4


def entity_size(partition_key: str, row_key: str, data: Mapping[str, object]) -> int:
    """The entity's size by Azure's published formula."""
    size = 4 + _utf16_len(partition_key) + _utf16_len(row_key)
    for name, value in data.items():
        if value is not None:
            size += 8 + 2 * len(name) + _value_size(name, value)
    return size


def check_entity(partition_key: object, row_key: object, data: Mapping[str, object]) -> None:
    """Checks keys, property names, types and sizes of one entity."""
    check_key("PartitionKey", partition_key)
    check_key("RowKey", row_key)
    present = [name for name, value in data.items() if value is not None]
    for name in present:
        check_property_name(name)
    if len(present) > MAX_PROPERTIES:
        raise LimitExceeded(
            f"entity has {len(present)} properties; Azure takes at most {MAX_PROPERTIES}"
        )
    size = entity_size(str(partition_key), str(row_key), data)
    if size > MAX_ENTITY_BYTES:
        raise LimitExceeded(f"entity is {size} bytes; Azure takes at most {MAX_ENTITY_BYTES}")


def check_blob_name(name: object) -> str:
    """Checks a blob name and returns it."""
    if not isinstance(name, str):
        raise InvalidName(f"blob name must be a string, not {type(name).__name__}")
    if not name:
        raise InvalidName("blob name must not be empty")
    if len(name) > MAX_BLOB_NAME:
        raise InvalidName(f"blob name is over {MAX_BLOB_NAME} characters")
    if _BLOB_FORBIDDEN.search(name) or _SURROGATE.search(name):
        raise InvalidName(f"blob name {name!r} holds \\ % ? # or a control character")
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidName(
                f"blob name {name!r} has an empty, '.' or '..' segment (or starts or ends with '/')"
            )
        if segment.endswith("."):
            raise InvalidName(f"blob name {name!r} has a segment ending in '.'")
        if len(segment.encode()) > MAX_SEGMENT_BYTES:
            raise InvalidName(f"blob name {name!r} has a segment over {MAX_SEGMENT_BYTES} bytes")
    return name


def check_blob_prefix(prefix: object, *, folder: bool = False) -> str:
    """Checks a listing prefix: empty, or a valid name optionally ending in ``/``.

    Args:
        prefix: The prefix.
        folder: Require a non-empty prefix ending in ``/``.
    """
    if not isinstance(prefix, str):
        raise InvalidName(f"prefix must be a string, not {type(prefix).__name__}")
    if folder and not prefix.endswith("/"):
        raise InvalidName(f"prefix {prefix!r} must be a folder ending in '/'")
    if prefix:
        stem = prefix[:-1] if prefix.endswith("/") else prefix
        if not stem:
            raise InvalidName("prefix '/' is not a folder name")
        check_blob_name(stem)
    return prefix
