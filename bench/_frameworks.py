"""What the framework benchmarks (``frameworks_lightning.py``,
``frameworks_hf_deepspeed.py``) share: the model's layers, the coordinator, memory tier
and one-node jobs their runs save through, and naming the last version as the
coordinator does at a restart. The command line of a benchmark that measures ``--mib``
MiB of tensors ``--repeat`` times (these, ``export.py``, ``tiers.py``) is here too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from bench._joined import joined
from rallypoint.client import CheckpointPointer, ElasticClient
from rallypoint.trainer import CheckpointManager
from tests._coordinator import Coordinator

__all__ = [
    "WIDTH",
    "MiB",
    "command_line",
    "coordinator",
    "layers",
    "measuring",
    "name_the_last_version",
    "parsed",
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


def parsed(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options read, and torch left one thread (as each measurement here runs)."""
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args


def command_line(doc: str, mib: int, optimizer: str) -> argparse.Namespace:
    """Reads ``--mib`` and ``--repeat``, the options every framework benchmark takes
    (:func:`measuring`, :func:`parsed`).

    Args:
        doc: The benchmark's docstring; its first paragraph is the description.
        mib: The default ``--mib``.
        optimizer: The name of the optimizer the model trains with, for the help.
    """
    return parsed(measuring(doc, mib, 5, f"parameters; {optimizer} adds 2x"))


def layers(mib: int) -> nn.Sequential:
    """Bias-free ``WIDTH`` x ``WIDTH`` linear layers: ``mib`` MiB of float32 (one at least)."""
    count = max(1, mib * MiB // (WIDTH * WIDTH * 4))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(count)))


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
        try:
            yield work, {job: _joined(running.url, job) for job in jobs}
        finally:
            running.stop()
            shutil.rmtree(memory, ignore_errors=True)


def _joined(url: str, job: str) -> ElasticClient:
    client, _ = joined(url, job)
    return client


def name_the_last_version(manager: CheckpointManager) -> None:
    """As after a restart: the coordinator names the newest version at the seal."""
    info = manager.wait()
    assert info is not None and info.state == "committed", info
    pointer = CheckpointPointer(version=info.version, step=info.step, generation=info.generation)
    manager.assignment = manager.assignment.model_copy(update={"checkpoint": pointer})
