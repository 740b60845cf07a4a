"""Tensors as bytes, and the checksums every checkpoint file and item carries."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

import torch
import xxhash

__all__ = [
    "CHECKSUM",
    "as_memoryview",
    "checksum",
    "map_private",
    "map_shared",
    "own_storage",
    "tensor_bytes",
]

CHECKSUM = "xxh3-128"


def as_memoryview(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without numpy and without a copy."""
    n = buffer.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(buffer.data_ptr())).cast("B")


def own_storage(raw: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU uint8 tensor as a tensor whose storage is exactly
    them, sharing their memory (nothing is copied).

    A view of a larger buffer (a mapped file, a downloaded span) is not an ordinary
    tensor: ``torch.save`` writes the whole buffer for it, and cannot load it back when
    the buffer's length is not a multiple of the view's element size; two views of one
    buffer as different dtypes cannot be saved together at all. The storage made here
    keeps the buffer alive through numpy's reference to it, so the buffer outlives
    every tensor made of it and no longer.
    """
    n = raw.numel()
    storage = raw.untyped_storage()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    if raw.storage_offset() == 0 and storage.nbytes() == n:
        return raw
    return torch.frombuffer(raw.numpy(), dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, in row-major order (copied only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return as_memoryview(flat)


def checksum(parts: Iterable[bytes | memoryview]) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return f"{CHECKSUM}:{h.hexdigest()}"


def map_private(fd: int) -> torch.Tensor:
    """An open file's bytes as a copy-on-write mapping (``MAP_PRIVATE``), a uint8 tensor:
    nothing is copied, pages come from the page cache as they are read, and writing to
    the tensor never reaches the file. The mapping outlives ``fd``."""
    if os.fstat(fd).st_size == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapped = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def map_shared(fd: int) -> torch.Tensor:
    """An open file's bytes as a shared mapping (``MAP_SHARED``), a uint8 tensor: what is
    written to the tensor is the file's content. Its pages are mapped up front
    (``MAP_POPULATE``), in one call rather than one fault per 4 KiB. The mapping outlives
    ``fd``."""
    if os.fstat(fd).st_size == 0:
        return torch.empty(0, dtype=torch.uint8)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)
