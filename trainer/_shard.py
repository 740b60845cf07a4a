"""One rank's shard: a safetensors file laid out so that staging it is one copy.

The data section is the staging buffer itself, so saving is: copy tensors into the
buffer (the only part training waits for), hash, write header + buffer. Tensors are
ordered by element size, largest first, so each starts at a multiple of its element size
and loading views them in place, without a copy.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from ._state import DTYPES
from .errors import CheckpointCorrupt

__all__ = ["CHECKSUM", "Layout", "Staging", "as_memoryview", "checksum", "layout", "read_shard"]

CHECKSUM = "xxh3-128"
_ALIGN = 8
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
#: safetensors' own cap on the JSON header.
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # within the data section
    end: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a shard goes."""

    entries: tuple[Entry, ...]
    #: The 8-byte header length and the JSON header, padded so the data is aligned.
    header: bytes
    data_size: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size


def layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> Layout:
    """Plans a shard file for ``(name, tensor)`` pairs."""
    ordered = sorted(tensors, key=lambda nt: -nt[1].element_size())  # stable: keeps order
    entries = []
    described: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in ordered:
        end = offset + t.numel() * t.element_size()
        entries.append(Entry(name, t.dtype, tuple(t.shape), offset, end))
        described[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(described, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return Layout(tuple(entries), struct.pack("<Q", len(raw)) + raw, offset)


def as_memoryview(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without numpy and without a copy."""
    n = buffer.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(buffer.data_ptr())).cast("B")


def checksum(parts: Iterable[bytes | memoryview]) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return f"{CHECKSUM}:{h.hexdigest()}"


class Staging:
    """A host buffer allocated once and reused by every save (pinned for CUDA tensors).

    Fresh memory costs a page fault per 4 KiB on first touch, which on a 1 GiB state is
    most of what ``torch.distributed.checkpoint.async_save`` blocks training for.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pinned = False

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, plan: Layout, tensors: dict[str, torch.Tensor]) -> memoryview:
        """Copies the tensors into the buffer as ``plan`` lays them out.

        Returns:
            The data section, valid until the next call.
        """
        pin = any(t.is_cuda for t in tensors.values())
        if (
            self._buffer is None
            or self._buffer.numel() < plan.data_size
            or (pin and not self._pinned)
        ):
            self._buffer = None  # free the old one first: peak memory is one staging copy
            self._buffer = torch.empty(max(plan.data_size, 1), dtype=torch.uint8, pin_memory=pin)
            self._pinned = pin
        buffer = self._buffer
        for e in plan.entries:
            target = buffer[e.start : e.end].view(e.dtype).view(e.shape)
            target.copy_(tensors[e.name], non_blocking=pin)
        if pin:
            torch.cuda.synchronize()  # non-blocking copies must land before we read
        return as_memoryview(buffer)[: plan.data_size]


def read_shard(data: torch.Tensor, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a shard file held in ``data`` (uint8), as views of it.

    Raises:
        CheckpointCorrupt: The bytes are not a shard this module wrote.
    """
    size = data.numel()
    try:
        if size < 8:
            raise ValueError(f"{size} bytes is too short")
        (n,) = struct.unpack("<Q", bytes(as_memoryview(data[:8])))
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"header length {n} out of range")
        header = json.loads(bytes(as_memoryview(data[8 : 8 + n])))
        base = 8 + n
        tensors = {}
        for name, d in header.items():
            if name == "__metadata__":
                continue
            dtype = _BY_NAME[d["dtype"]]
            start, end = (int(x) for x in d["data_offsets"])
            shape = tuple(int(x) for x in d["shape"])
            count = 1
            for dim in shape:
                count *= dim
            if not 0 <= start <= end <= size - base or end - start != count * dtype.itemsize:
                raise ValueError(f"{name}: offsets {start}..{end} do not fit")
            tensors[name] = data[base + start : base + end].view(dtype).view(shape)
        return tensors
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{what} is not a readable shard: {exc}") from exc
