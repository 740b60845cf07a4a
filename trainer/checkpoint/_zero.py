"""A DeepSpeed version's model, whole: its ZeRO partitions put together by DeepSpeed.

A version the DeepSpeed engine saved (``rallypoint.trainer.deepspeed``, alone or under
the HF Trainer) holds DeepSpeed's own files, packed: the model states every rank reads
and each rank's ZeRO optimizer partition. Under ZeRO-3 the model states hold empty
placeholders; the weights are in the partitions' fp32 flat groups, cut for the world
that saved them. DeepSpeed's ``zero_to_fp32`` is the well-kept consolidation of exactly
these files (stages 1-3, shared and frozen parameters, padding), so the export writes
the version's files into a scratch folder, one file at a time, and lets it read them.

Its lazy mode returns a pseudo-tensor per parameter that is put together only when
asked for, so the exporter holds one full parameter at a time beside DeepSpeed's fp32
flat groups (every rank's: the fp32 model, once); the optimizer's moments are dropped
as each file is parsed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._pack import name_of, unpack
from ..errors import CheckpointError

__all__ = ["LazyTensor", "is_deepspeed", "whole_model"]

log = logging.getLogger("rallypoint.trainer")

#: The version metadata's key for the tag DeepSpeed saved under (``_deepspeed.TAG``).
_TAG = "tag"
_SKELETON = "skeleton"
_MODEL_STATES = "_model_states.pt"
_OPTIM_STATES = "_optim_states.pt"


class LazyTensor(Protocol):
    """A parameter as DeepSpeed's lazy mode gives it (or a plain tensor)."""

    @property
    def shape(self) -> torch.Size: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def contiguous(self) -> torch.Tensor: ...


def is_deepspeed(metadata: Mapping[str, Any] | None) -> bool:
    """Whether the version's (user) metadata says DeepSpeed's engine saved it."""
    return (metadata or {}).get("framework") == "deepspeed"


def whole_model(
    metadata: Metadata,
    version_metadata: Mapping[str, Any],
    load_into: Callable[[dict[str, torch.Tensor]], None],
    scratch: str,
) -> dict[str, LazyTensor]:
    """The model's full parameters and buffers by ``state_dict`` name, lazily.

    Args:
        metadata: DCP's metadata of the version.
        version_metadata: What rank 0 saved as the version's metadata (the tag).
        load_into: Loads the named items of the version into the given tensors.
        scratch: An empty folder for DeepSpeed's files (as large as the version).

    Raises:
        CheckpointError: The version holds no DeepSpeed model states file.
    """
    tag = str(version_metadata.get(_TAG) or "rallypoint")
    folder = os.path.join(scratch, tag)
    os.makedirs(folder, exist_ok=True)
    names = _write_files(metadata, load_into, folder)
    if not any(n.endswith(_MODEL_STATES) for n in names):
        raise CheckpointError("the version holds no DeepSpeed model states to export")
    with open(os.path.join(scratch, "latest"), "w") as f:
        f.write(tag)
    if not any(n.endswith(_OPTIM_STATES) for n in names):
        # No ZeRO partitions (stage 0): the model states hold the whole module.
        model_states = sorted(n for n in names if n.endswith(_MODEL_STATES))[0]
        saved = torch.load(os.path.join(folder, model_states), weights_only=False)
        module: dict[str, LazyTensor] = dict(saved["module"])
        return module
    # Imported here: DeepSpeed is needed only for its versions, and slow to import.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state: dict[str, LazyTensor] = get_fp32_state_dict_from_zero_checkpoint(
        scratch, tag, lazy_mode=True
    )
    return state


def _write_files(
    metadata: Metadata, load_into: Callable[[dict[str, torch.Tensor]], None], folder: str
) -> list[str]:
    """Writes each packed DeepSpeed file of the version (shared ones and every rank's)
    into ``folder`` as ``torch.save`` made it, one at a time; returns their names."""
    items = metadata.state_dict_metadata
    prefixes = sorted(k[: -len(_SKELETON)] for k in items if k.endswith("." + _SKELETON))
    written = []
    for prefix in prefixes:
        # The last dotted part of the prefix is the file's key (its own dots escaped).
        name = name_of(prefix.rstrip(".").rsplit(".", 1)[-1])
        if not name.endswith((_MODEL_STATES, _OPTIM_STATES)):
            continue  # the HF Trainer's extras (trainer state, scheduler, RNG)
        state: dict[str, torch.Tensor] = {}
        for key, m in items.items():
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata):
                state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        load_into(state)
        packed = {key[len(prefix) :]: tensor for key, tensor in state.items()}
        torch.save(unpack(packed), os.path.join(folder, name))
        del state, packed
        written.append(name)
    log.info("DeepSpeed files of the version written: %s", ", ".join(written))
    return written
