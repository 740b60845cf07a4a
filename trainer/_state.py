"""Nested training state split into tensors and a JSON tree that refers to them.

A state dict (model, optimizer, scheduler, RNG, data position, plain values) becomes a
list of tensors, which go into safetensors files, and a JSON-able tree in which every
tensor is a ``{"__tensor__": NAME}`` reference, which goes into the manifest's metadata.
Types JSON cannot tell apart survive the round trip: tuples, dicts with non-string keys
(optimizer state is keyed by int), non-finite floats.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["DTYPES", "balance", "flatten", "unflatten"]

#: torch dtypes and their safetensors names.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"


def flatten(state: Any, prefix: str) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Separates tensors from everything else.

    Args:
        state: Nested dicts, lists and tuples of tensors and plain values.
        prefix: Tensor names are ``prefix`` plus their position in traversal order.

    Returns:
        The JSON-able tree, and the tensors as ``(name, tensor)`` in traversal order.

    Raises:
        TypeError: A value is neither a tensor, a container nor a JSON scalar; the
            message names where it is.
    """
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dtype not in DTYPES:
                raise TypeError(f"{path}: safetensors cannot hold {value.dtype}")
            if value.is_sparse or value.layout != torch.strided:
                raise TypeError(f"{path}: only dense (strided) tensors can be saved")
            name = f"{prefix}{len(tensors)}"
            tensors.append((name, value.detach()))
            return {_TENSOR: name}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            return {_DICT: [[walk(k, path), walk(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        if isinstance(value, tuple):  # torch.Size included
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        raise TypeError(
            f"{path}: cannot checkpoint a {type(value).__name__}; use tensors, dicts, lists, "
            "tuples, str, int, float, bool or None"
        )

    return walk(state, "state"), tensors


def unflatten(tree: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Rebuilds what :func:`flatten` took apart; ``tensor`` resolves a tensor name.

    Raises:
        KeyError: ``tensor`` does not know a name.
    """
    if isinstance(tree, list):
        return [unflatten(v, tensor) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((key, value),) = tree.items()
        if key == _TENSOR:
            return tensor(value)
        if key == _TUPLE:
            return tuple(unflatten(v, tensor) for v in value)
        if key == _DICT:
            return {_hashable(unflatten(k, tensor)): unflatten(v, tensor) for k, v in value}
        if key == _FLOAT:
            return float(value)
    return {k: unflatten(v, tensor) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def balance(sizes: Sequence[int], bins: int) -> list[int]:
    """Assigns items to ``bins`` so that each holds about ``sum(sizes) / bins`` bytes.

    Greedy, largest first, ties by index: every rank computes the same assignment from
    the same shapes without talking to the others.

    Returns:
        The bin of each item.
    """
    heap = [(0, b) for b in range(bins)]  # (bytes so far, bin): the lightest, lowest first
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)
        owner[i] = b
        heapq.heappush(heap, (load + sizes[i], b))
    return owner
