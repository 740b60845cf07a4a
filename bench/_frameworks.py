"""What the framework benchmarks (``frameworks_lightning.py``,
``frameworks_hf_deepspeed.py``) share: their command line (``--device``, ``--bf16``),
the model's layers, the coordinator, memory tier and one-node jobs their runs save
through, naming the last version as the coordinator does at a restart, and the digest
that says whether a restore brought back exactly the state saved. The command line of a
benchmark that measures ``--mib`` MiB of tensors ``--repeat`` times (these,
``export.py``, ``tiers.py``) is here too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench._joined import joined
from bench._smoke import parse
from rallypoint.client import CheckpointInfo, CheckpointPointer, ElasticClient, Heartbeats
from rallypoint.trainer import CheckpointManager
from tests._coordinator import Coordinator

__all__ = [
    "SMOKE",
    "WIDTH",
    "MiB",
    "Timings",
    "checkpoint_mib",
    "command_line",
    "coordinator",
    "described",
    "digest",
    "dtype_of",
    "layers",
    "measuring",
    "name_the_last_version",
    "parsed",
    "synchronize",
]

MiB = 1 << 20
WIDTH = 1024
ROOT = Path(__file__).resolve().parent.parent


def measuring(
    doc: str, mib: int, repeat: int, mib_help: str | None = None
) -> argparse.ArgumentParser:
    """The command line of a benchmark that measures ``--mib`` MiB of tensors, the median
    of ``--repeat`` rounds: add the benchmark's own options, then :func:`parsed`.

    Args:
        doc: The benchmark's docstring; its first paragraph is the description.
        mib: The default ``--mib``.
        repeat: The default ``--repeat``.
        mib_help: ``--mib``'s help, if it says more than its name.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=mib, help=mib_help)
    parser.add_argument("--repeat", type=int, default=repeat)
    return parser


#: What ``--smoke`` sets (``bench/_smoke.py``) in a benchmark of ``--mib`` and ``--repeat``.
SMOKE = {"mib": 1, "repeat": 1}


def parsed(
    parser: argparse.ArgumentParser, smoke: Mapping[str, Any] | None = None
) -> argparse.Namespace:
    """The options read (``--smoke`` among them: :data:`SMOKE` and ``smoke``), and torch
    left one thread (as each measurement here runs)."""
    args = parse(parser, {**SMOKE, **(smoke or {})})
    torch.set_num_threads(1)
    return args


def command_line(doc: str, mib: int, optimizer: str) -> argparse.Namespace:
    """Reads the options every framework benchmark takes: ``--mib`` and ``--repeat``
    (:func:`measuring`, :func:`parsed`, with ``--smoke``), ``--device`` and ``--bf16``.

    Args:
        doc: The benchmark's docstring; its first paragraph is the description.
        mib: The default ``--mib``.
        optimizer: The name of the optimizer the model trains with, for the help.
    """
    parser = measuring(doc, mib, 5, f"parameters, in the dtype trained; {optimizer} adds 2x")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains: the CPU, or one GPU",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bfloat16 parameters and training (else float32)"
    )
    args = parsed(parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    return args


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    """The dtype the model's parameters train in (``--bf16``)."""
    return torch.bfloat16 if args.bf16 else torch.float32


def described(args: argparse.Namespace) -> str:
    """The device and dtype a run trained on, for its header line."""
    if args.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"CPU ({os.cpu_count()} cores)"
    return f"{where}, {str(dtype_of(args)).removeprefix('torch.')}"


def synchronize(device: str) -> None:
    """Waits for the GPU's queued work (on ``cuda``), so that a timer or a digest sees
    only what was asked of it and tensors as they stand."""
    if device == "cuda":
        torch.cuda.synchronize()


def digest(*states: object) -> str:
    """A SHA-256 of every tensor in ``states`` (state dicts, nested in mappings, lists
    and tuples), in a fixed order (mapping keys sorted): each tensor's place, dtype,
    shape and bytes, read on the CPU. Equal digests: the same tensors, bit for bit;
    other values (an optimizer's hyperparameters) are not counted.

    Call :func:`synchronize` first on a GPU.
    """
    hashed = hashlib.sha256()

    def walk(place: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu").contiguous().reshape(-1)
            hashed.update(f"{place} {tensor.dtype} {tuple(value.shape)}\n".encode())
            hashed.update(tensor.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                walk(f"{place}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{place}/{index}", item)

    for index, state in enumerate(states):
        walk(str(index), state)
    return hashed.hexdigest()


class Timings:
    """What a framework benchmark measures of one way to save: how long each save held
    the training loop, how long each restore took, and whether each restore brought back
    the last save's tensors, bit for bit (by :func:`digest`).

    Args:
        repeat: Restores timed after an untimed first one.
        device: Where the model trains; on ``cuda`` every timer starts and stops with the
            GPU idle, so a save is not charged for training work still queued.
    """

    def __init__(self, repeat: int, device: str) -> None:
        self.repeat, self.device = repeat, device
        self.blocked: list[float] = []
        self.restored: list[float] = []
        #: Whether each restore brought back the last save's tensors, bit for bit.
        self.equal: list[bool] = []
        self.saved: tuple[int, str] | None = None  # the last save's step and digest

    def save(
        self,
        step: int,
        last: bool,
        save: Callable[[], None],
        drain: Callable[[], None],
        state: Callable[[], tuple[object, ...]],
    ) -> None:
        """Times ``save`` (the first step's, a warm-up, is not kept), then ``drain``s
        what it left running, untimed; at the ``last`` step, digests ``state``."""
        synchronize(self.device)  # the step's queued work is training's, not the save's
        start = time.perf_counter()
        save()
        blocked = time.perf_counter() - start
        drain()
        if step > 1:
            self.blocked.append(blocked)
        if last:  # the last save: the one restored
            synchronize(self.device)
            self.saved = (step, digest(*state()))

    def restores(
        self, step: int, restore: Callable[[], None], state: Callable[[], tuple[object, ...]]
    ) -> None:
        """Runs ``restore`` ``repeat`` + 1 times (the first untimed), checking after each
        that ``state`` is what the last save held; ``step`` is the one training ended at."""
        assert self.saved is not None
        saved_step, saved = self.saved
        assert saved_step == step, "a step trained after the last save"
        for i in range(self.repeat + 1):
            synchronize(self.device)
            start = time.perf_counter()
            restore()
            synchronize(self.device)
            if i:
                self.restored.append(time.perf_counter() - start)
            self.equal.append(digest(*state()) == saved)


def layers(mib: int, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Bias-free ``WIDTH`` x ``WIDTH`` linear layers, made in float32: as many as ``mib``
    MiB of ``dtype`` holds (one at least), for the run to cast to ``dtype``."""
    count = max(1, mib * MiB // (WIDTH * WIDTH * dtype.itemsize))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(count)))


def checkpoint_mib(model: nn.Module, dtype: torch.dtype) -> int:
    """The MiB a checkpoint of ``model`` trained in ``dtype`` by Adam holds: its
    parameters and Adam's two moments of each."""
    return sum(p.numel() * dtype.itemsize for p in model.parameters()) * 3 // MiB


@contextmanager
def coordinator(*jobs: str) -> Iterator[tuple[Path, dict[str, ElasticClient]]]:
    """A coordinator on local storage under ``build/``, and a memory tier in ``/dev/shm``
    (``RALLYPOINT_MEMORY_DIR``), both removed after.

    Yields:
        A scratch folder, and for each of ``jobs`` (one-node jobs) its node ``n0``,
        joined and beating.
    """
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as tmp:
        work = Path(tmp)
        memory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="rallypoint-bench-"))
        os.environ["RALLYPOINT_MEMORY_DIR"] = str(memory)
        running = Coordinator(["--storage", f"local:{work / 'storage'}"], {}).start()
        nodes: dict[str, tuple[ElasticClient, Heartbeats]] = {}
        try:
            for job in jobs:
                nodes[job] = joined(running.url, job)
            yield work, {job: client for job, (client, _) in nodes.items()}
        finally:
            for _, beats in nodes.values():
                beats.stop()  # before the coordinator: else they retry for minutes, loudly
            running.stop()
            shutil.rmtree(memory, ignore_errors=True)


def name_the_last_version(manager: CheckpointManager) -> CheckpointInfo:
    """As after a restart: the coordinator names the newest version at the seal, in the
    assignment the manager and its client hold alike (the Lightning integration reads a
    version its client's assignment does not name as one to evaluate, not to resume).

    Returns:
        The version named: the last save's, committed.
    """
    info = manager.wait()
    assert info is not None and info.state == "committed", info
    pointer = CheckpointPointer(version=info.version, step=info.step, generation=info.generation)
    manager.assignment = manager.assignment.model_copy(update={"checkpoint": pointer})
    manager.client.assignment = manager.assignment
    return info
