"""What the framework adapters hand CheckpointManager: the one packer they share.

Framework files as CheckpointManager state: a file's tensors stay tensors (staged and
uploaded as DCP items, nothing serialized on the training thread), the rest of it
(config objects, enums, ``torch.Size``, int-keyed dicts) is one small pickle.

DeepSpeed and the HF Trainer hand over whole "files" (``mp_rank_00_model_states.pt``,
``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ``rng_state_1.pth``) holding objects
``CheckpointManager.save`` refuses on purpose. Here each file becomes a flat dict of
tensors: ``skeleton`` (the pickled object with every tensor replaced by its index, as a
uint8 tensor) and ``t0``, ``t1``, ... Never empty and never int-keyed, so nothing of it
depends on DCP's per-rank flattening fix-ups.

A Lightning checkpoint is one dict of the same two kinds: :func:`pack_checkpoint` keeps
its tensors as DCP keys (DTensors stay sharded) and its bookkeeping as one item.

No framework is imported here.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "BOOKKEEPING",
    "FILES",
    "blob",
    "file_key",
    "from_blob",
    "name_of",
    "pack",
    "pack_checkpoint",
    "split",
    "unpack",
    "unpack_checkpoint",
]

#: The state key under which the packed files live, by file key.
FILES = "files"
_SKELETON = "skeleton"
#: The key of a Lightning checkpoint's bookkeeping in :func:`pack_checkpoint`'s state.
BOOKKEEPING = "lightning"
_TENSORS = ("state_dict", "optimizer_states")


class _Ref:
    """A tensor's place in a skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[_Ref], tuple[int]]:
        return (_Ref, (self.index,))


class _Pickler(pickle.Pickler):
    def __init__(self, out: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        # Plain tensors and parameters only: a subclass may carry state of its own.
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            index = self._seen.get(id(obj))
            if index is None:  # one tensor referenced twice is saved once
                index = self._seen[id(obj)] = len(self._tensors)
                self._tensors.append(obj.detach())
            return index
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(data)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[f"t{int(pid)}"]


def blob(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor (a DCP item, staged like any tensor)."""
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def from_blob(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().numpy().tobytes())


def pack(obj: Any) -> dict[str, torch.Tensor]:
    """``obj`` as ``{"skeleton": uint8 tensor, "t0": tensor, ...}``; the tensors are the
    caller's own (no copy: the manager's staging copies them)."""
    tensors: list[torch.Tensor] = []
    out = io.BytesIO()
    _Pickler(out, tensors).dump(obj)
    packed = {_SKELETON: blob(out.getvalue())}
    packed.update({f"t{i}": t for i, t in enumerate(tensors)})
    return packed


def unpack(packed: Mapping[str, Any], map_location: Any = None) -> Any:
    """The object :func:`pack` packed, its tensors those of ``packed`` (or moved by
    ``map_location``, a device or ``torch.load``'s callable)."""
    tensors: dict[str, torch.Tensor] = {k: v for k, v in packed.items() if k != _SKELETON}
    if map_location is not None and not callable(map_location):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    return _Unpickler(io.BytesIO(from_blob(packed[_SKELETON])), tensors).load()


def file_key(name: str) -> str:
    """A file name as a state key: DCP joins nested keys with dots."""
    return name.replace(".", "%2E")


def name_of(key: str) -> str:
    return key.replace("%2E", ".")


def split(path: str) -> str:
    """The part of a framework's file path that names the file in a version: its base
    name (the directory and tag are the caller's choice of the day, not the file's)."""
    return os.path.basename(path)


def pack_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The state CheckpointManager saves for a Lightning checkpoint dict: the tensors
    (``state_dict``, each optimizer's ``state``) go through DCP as they are (DTensors
    sharded, DDP's replicated ones written once); the bookkeeping (loops, callbacks,
    hyperparameters, schedulers, optimizer ``param_groups``), which may hold any
    picklable object, as one string item that DCP writes once."""
    rest = {k: v for k, v in checkpoint.items() if k not in _TENSORS}
    optimizers = checkpoint.get("optimizer_states", [])
    # param_groups hold whatever an optimizer keeps (tuples, None, its own objects):
    # they go pickled with the bookkeeping; only the tensors go through DCP.
    rest["__param_groups__"] = [o.get("param_groups") for o in optimizers]
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    return {
        "state_dict": checkpoint.get("state_dict", {}),
        "optimizer_states": [{"state": o.get("state", {})} for o in optimizers],
        BOOKKEEPING: base64.b64encode(buffer.getvalue()).decode("ascii"),
    }


def unpack_checkpoint(state: dict[str, Any], weights_only: bool | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict from what :func:`pack_checkpoint` saved."""
    raw = base64.b64decode(state[BOOKKEEPING])
    # The bookkeeping is Lightning's own dict (loops, callbacks, hyperparameters), checked
    # against its checksum on read: trusted as a .ckpt file Lightning wrote would be.
    rest: dict[str, Any] = torch.load(
        io.BytesIO(raw), weights_only=bool(weights_only), map_location="cpu"
    )
    groups = rest.pop("__param_groups__", [])
    checkpoint = dict(rest)
    checkpoint["state_dict"] = state["state_dict"]
    # None loaded (an evaluation, which has no optimizers to load into): none given.
    loaded = state["optimizer_states"]
    checkpoint["optimizer_states"] = [
        {"state": o["state"], "param_groups": g}
        for o, g in zip(loaded, groups if loaded else [], strict=True)
    ]
    return checkpoint
