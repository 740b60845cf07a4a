"""Tensors as bytes, and the checksums every checkpoint file and item carries."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch
import xxhash

__all__ = ["CHECKSUM", "as_memoryview", "checksum", "tensor_bytes"]

CHECKSUM = "xxh3-128"


def as_memoryview(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without numpy and without a copy."""
    n = buffer.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(buffer.data_ptr())).cast("B")


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
