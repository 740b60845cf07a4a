"""A version out of the job: one safetensors file, a Hugging Face folder, or a torch file.

``export`` reads a committed version through :class:`RallypointReader` (every item checked
against its checksum, from storage or this node's memory tier) on one process, with no
process group: DCP's own no-dist load puts each tensor together from whatever shards
the saving world cut it into (FSDP2/TP DTensors at any world size; DDP's replicated
tensors as they are), into a full tensor of this process.

It streams: the safetensors header is written first, from the shapes and dtypes in DCP's
metadata, then the tensors in header order, loaded a group at a time of at most
``buffer`` bytes (one tensor larger than that is a group of its own). Peak memory is the
largest group, not the model. safetensors' own ``save_file`` takes the whole dict at
once, so the file format is written here (an 8-byte header length, the JSON header, the
bytes); what comes out is checked by ``safetensors.safe_open`` in the tests.

Names are the tensors' paths in the saved state, dot-joined as DCP flattens them
(``model.0.weight``). The integrations' packed files (``pack``: a pickled skeleton and
``t0``, ``t1``, ...) are unpacked to the names of the dicts they held (the HF Trainer's
``model`` is its model's ``state_dict``). ``strip`` drops a prefix (the ``hf`` format
drops ``model.`` and Lightning's ``state_dict.``).

A version DeepSpeed's engine saved holds DeepSpeed's files, not the model's tensors:
its ZeRO partitions are put together by DeepSpeed's own ``zero_to_fp32`` (``_zero.py``),
under the model's ``state_dict`` names. That consolidation holds DeepSpeed's fp32 flat
groups (the fp32 model) while it runs, so ``buffer`` does not bound it.

An ``hf`` folder gets the model's ``config.json`` (and ``generation_config.json``) when
the version carries them: the HF Trainer integration records them in every version.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from rallypoint.client import CheckpointInfo, ElasticClient

from .._pack import from_blob
from .._progress import Progress
from ..errors import CheckpointError
from ._dcp import RallypointReader
from ._zero import LazyTensor, is_deepspeed, whole_model

__all__ = ["ExportFormat", "Exported", "export"]

ExportFormat = Literal["safetensors", "hf", "torch"]

#: What a version's state holds that is not the model's or optimizer's tensors: the
#: manager's per-rank state.
_RESERVED = "__rallypoint__"
_SKELETON = "skeleton"
#: The prefixes the ``hf`` format drops: the HF Trainer's ``model`` and Lightning's
#: ``state_dict`` (the framework's own ``state_dict`` names the rest).
_HF_PREFIXES = ("model.", "state_dict.")

_DTYPES: dict[torch.dtype, str] = {
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
}
_CASTS = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote.

    Attributes:
        version: The version exported.
        step: Its step.
        files: The files written (a Hugging Face folder's shards and index).
        tensors: How many tensors.
        bytes: Their bytes, as written.
        seconds: Wall time.
    """

    version: int
    step: int
    files: list[Path]
    tensors: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class _Tensor:
    name: str  # as exported
    key: str  # DCP's flattened key
    shape: tuple[int, ...]
    saved: torch.dtype
    dtype: torch.dtype  # as exported

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()


def export(
    client: ElasticClient,
    out: str | os.PathLike[str],
    version: int | Literal["latest", "best"] = "latest",
    *,
    format: ExportFormat = "safetensors",
    dtype: Literal["keep", "bf16", "fp16", "fp32"] = "keep",
    only: str | None = None,
    max_shard_size: int = 5 << 30,
    buffer: int = 256 << 20,
    progress: bool = True,
) -> Exported:
    """Writes a committed version's tensors to ``out``, consolidated into full tensors.

    Args:
        client: A client of the job (joined or not: a reader token is enough).
        out: A file (``safetensors``, ``torch``) or a folder (``hf``: ``model.safetensors``,
            or shards ``model-0000k-of-0000n.safetensors`` and their index past
            ``max_shard_size``).
        version: A version number, ``"latest"`` (the job's authoritative latest) or
            ``"best"`` (its best by the ``keep_best`` rule it saves under).
        format: ``safetensors`` (default), ``hf`` or ``torch`` (one ``torch.save`` file).
        dtype: ``keep``, or a floating dtype every floating tensor is cast to.
        only: Export only the tensors whose saved name starts with this (e.g. ``model.``,
            to leave the optimizer out).
        max_shard_size: ``hf``: bytes per shard at most (a larger tensor is a shard of its
            own).
        buffer: Bytes of tensors loaded at a time; the peak memory beyond one tensor
            (not for a DeepSpeed version: its consolidation holds the fp32 model).
        progress: A progress bar on a terminal (log lines otherwise) past one second.

    Returns:
        What was written.

    Raises:
        CheckpointError: The version is not committed, is quarantined or unrecoverable,
            or holds no tensor to export (``only`` matched none).
        UnknownCheckpoint: No such version, it was collected, or the job has no best.
        CheckpointCorrupt: A file fails its checksum in every copy.
    """
    if format not in ("safetensors", "hf", "torch"):
        raise ValueError(f"format must be safetensors, hf or torch, not {format!r}")
    if dtype not in _CASTS:
        raise ValueError(f"dtype must be one of {', '.join(_CASTS)}, not {dtype!r}")
    started = time.monotonic()
    info = client.checkpoint(version)
    _check_exportable(info)
    reader = RallypointReader(client, info.version, progress=False)
    metadata = reader.read_metadata()
    assert reader.summary is not None  # read with the metadata
    user = reader.summary.metadata or {}
    with contextlib.ExitStack() as stack:
        if is_deepspeed(user):
            # DeepSpeed's own files, consolidated by DeepSpeed (see _zero.py).
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="rallypoint-"))
            model = whole_model(metadata, user, lambda s: _load_into(reader, s), scratch)
            tensors = _named(model, _CASTS[dtype])

            def load(group: Sequence[_Tensor], meter: Progress) -> _Loaded:
                return _materialize(model, group, meter)
        else:
            tensors = _tensors(reader, metadata, _CASTS[dtype], strip=format == "hf")

            def load(group: Sequence[_Tensor], meter: Progress) -> _Loaded:
                return _load(reader, group, buffer, meter)

        if only is not None:
            tensors = [t for t in tensors if t.key.startswith(only) or t.name.startswith(only)]
        if not tensors:
            what = f" starting with {only!r}" if only is not None else ""
            raise CheckpointError(f"v{info.version} holds no tensor{what} to export")
        total = sum(t.nbytes for t in tensors)
        meter = Progress(f"export v{info.version}", total, enabled=progress)
        target = Path(out)
        meta = {"format": "pt", "rallypoint_version": str(info.version), "step": str(info.step)}
        try:
            if format == "torch":
                target.parent.mkdir(parents=True, exist_ok=True)
                torch.save({t.name: loaded for t, loaded in load(tensors, meter)}, target)
                files = [target]
            elif format == "safetensors":
                target.parent.mkdir(parents=True, exist_ok=True)
                _write_safetensors(target, tensors, load(tensors, meter), meta)
                files = [target]
            else:
                loader = functools.partial(load, meter=meter)
                files = _write_hf(target, tensors, loader, meta, max_shard_size)
                files += _write_configs(target, user)
        finally:
            meter.close()
    return Exported(info.version, info.step, files, len(tensors), total, time.monotonic() - started)


#: Tensors in order, each full and in its export dtype.
_Loaded = Iterator[tuple["_Tensor", torch.Tensor]]

#: The version metadata's keys for a Hugging Face model's configs, as the HF Trainer
#: integration records them (``config.to_json_string(use_diff=False)``, parsed), and the
#: files ``from_pretrained`` reads them from.
_HF_CONFIGS = {"hf_config": "config.json", "hf_generation_config": "generation_config.json"}


def _write_configs(folder: Path, user: Mapping[str, Any]) -> list[Path]:
    """The model's ``config.json`` (and generation config) the version carries, if any:
    what makes the folder one ``from_pretrained`` loads without the training code."""
    files = []
    for key, name in _HF_CONFIGS.items():
        config = user.get(key)
        if isinstance(config, dict):
            path = folder / name
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            files.append(path)
    return files


def _named(model: Mapping[str, LazyTensor], cast: torch.dtype | None) -> list[_Tensor]:
    """A consolidated model's tensors, by their ``state_dict`` names (kept as they are:
    DeepSpeed's module is the framework's model, ``model.`` prefix and all)."""
    out = []
    for name, t in model.items():
        exported = cast if cast is not None and t.dtype.is_floating_point else t.dtype
        if exported not in _DTYPES:
            raise CheckpointError(f"{name}: safetensors has no dtype for {t.dtype}")
        out.append(_Tensor(name, name, tuple(t.shape), t.dtype, exported))
    return out


def _materialize(
    model: Mapping[str, LazyTensor], tensors: Sequence[_Tensor], meter: Progress
) -> _Loaded:
    for t in tensors:
        whole = model[t.key].contiguous()
        yield t, whole if whole.dtype == t.dtype else whole.to(t.dtype)
        meter.update(t.nbytes)


def _check_exportable(info: CheckpointInfo) -> None:
    if info.state != "committed":
        raise CheckpointError(f"v{info.version} is {info.state}, not committed: nothing to export")
    if info.quarantined:
        raise CheckpointError(f"v{info.version} is quarantined: {info.quarantine_reason or '-'}")
    if info.unrecoverable:
        raise CheckpointError(
            f"v{info.version} is unrecoverable: {info.unrecoverable_reason or '-'}"
        )


class _Ref:
    """A tensor's place in a packed skeleton: the index of its ``t<i>`` item."""

    def __init__(self, index: int) -> None:
        self.index = index


class _SkeletonReader(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> _Ref:
        return _Ref(int(pid))


def _tensors(
    reader: RallypointReader, metadata: Metadata, cast: torch.dtype | None, *, strip: bool
) -> list[_Tensor]:
    """The version's exportable tensors, in the saved state's order, named."""
    saved = {
        key: m
        for key, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and not key.startswith(_RESERVED)
    }
    packed = sorted(key[: -len(_SKELETON)] for key in saved if key.endswith("." + _SKELETON))
    names: dict[str, str] = {key: key for key in saved}
    for prefix in packed:
        skeleton = saved.pop(prefix + _SKELETON)
        names.pop(prefix + _SKELETON)
        blob = torch.empty(skeleton.size, dtype=torch.uint8)
        _load_into(reader, {prefix + _SKELETON: blob})
        structure = _SkeletonReader(io.BytesIO(from_blob(blob))).load()
        for path, ref in _leaves(structure):
            key = f"{prefix}t{ref.index}"
            if key in names:
                names[key] = prefix + path if path else prefix.rstrip(".")
    out = []
    for key, m in saved.items():
        name = names[key]
        if strip:
            name = next((name[len(p) :] for p in _HF_PREFIXES if name.startswith(p)), name)
        dtype = m.properties.dtype
        exported = cast if cast is not None and dtype.is_floating_point else dtype
        if exported not in _DTYPES:
            raise CheckpointError(f"{key}: safetensors has no dtype for {dtype}")
        out.append(_Tensor(name, key, tuple(m.size), dtype, exported))
    seen: set[str] = set()
    for t in out:
        if t.name in seen:
            raise CheckpointError(f"two tensors would be named {t.name!r}")
        seen.add(t.name)
    return out


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, _Ref]]:
    """Each tensor of a skeleton, by its dot-joined path of keys and indices."""
    if isinstance(value, _Ref):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}.{i}" if path else str(i))


def _load_into(reader: RallypointReader, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # The state is flat already; DCP must not split its dotted keys again.
    dcp_load(
        state,
        storage_reader=reader,
        planner=DefaultLoadPlanner(flatten_state_dict=False),
        no_dist=True,
    )


def _groups(tensors: Sequence[_Tensor], buffer: int) -> Iterator[list[_Tensor]]:
    group: list[_Tensor] = []
    size = 0
    for t in tensors:
        if group and size + t.nbytes > buffer:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.nbytes
    if group:
        yield group


def _load(
    reader: RallypointReader, tensors: Sequence[_Tensor], buffer: int, meter: Progress
) -> _Loaded:
    """Each tensor, full and in its export dtype, in order, a group at a time."""
    for group in _groups(tensors, buffer):
        state = {t.key: torch.empty(t.shape, dtype=t.saved) for t in group}
        _load_into(reader, state)
        for t in group:
            loaded = state.pop(t.key)
            yield t, loaded if loaded.dtype == t.dtype else loaded.to(t.dtype)
            meter.update(t.nbytes)


def _header(tensors: Sequence[_Tensor], meta: Mapping[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(meta)}
    offset = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    # The data starts 8-aligned, as safetensors writes it, so readers may map it.
    return header + b" " * (-len(header) % 8)


def _write_safetensors(
    path: Path,
    tensors: Sequence[_Tensor],
    loaded: _Loaded,
    meta: Mapping[str, str],
) -> None:
    header = _header(tensors, meta)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for _, tensor in loaded:
            # reshape(-1): a 0-d tensor cannot be viewed as bytes of another size.
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)  # a file of this name is whole


def _write_hf(
    folder: Path,
    tensors: Sequence[_Tensor],
    load: Callable[[Sequence[_Tensor]], _Loaded],
    meta: Mapping[str, str],
    max_shard_size: int,
) -> list[Path]:
    """A folder ``from_pretrained`` loads: one ``model.safetensors``, or shards and the
    ``model.safetensors.index.json`` that maps each tensor to its shard."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) == 1:
        path = folder / "model.safetensors"
        _write_safetensors(path, tensors, load(tensors), meta)
        return [path]
    files = []
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(path, shard, load(shard), meta)
        files.append(path)
        weight_map.update({t.name: path.name for t in shard})
    index = folder / "model.safetensors.index.json"
    total = sum(t.nbytes for t in tensors)
    index.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return [*files, index]
