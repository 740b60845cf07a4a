"""What regrouping in place does to the process that outlives its generations.

- It calls ``dist.init_process_group`` once per generation, and torch wraps
  ``sys.excepthook`` at each call: uncaught exceptions must still carry one ``[rankN]:``
  prefix, the current generation's. Real process groups (gloo, world 1) in the test's
  process, one after another.
- Between generations it gives the heap's free memory back to the system: the test
  frees 64 MiB below a block that stays, which ``free()`` alone cannot give back. And it
  drops the source lines that formatting an ended generation's tracebacks cached.
"""

from __future__ import annotations

import linecache
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from rallypoint.cli.processes import free_port
from rallypoint.trainer import _regroup
from rallypoint.trainer._regroup import _malloc_trim, _one_excepthook, _release_memory


@pytest.fixture
def hooks() -> Iterator[None]:
    """The interpreter's own hook and no record of one, then the hook and record as they
    were. In-process tests that built a process group earlier in the same process leave
    torch's prefixing hook installed: under four xdist workers the first test below saw
    three prefixes, two of them not its own (two raw ``init_process_group`` calls before
    it reproduce that)."""
    assert not dist.is_initialized()
    original, recorded = sys.excepthook, _regroup._hooks
    sys.excepthook, _regroup._hooks = sys.__excepthook__, None
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook, _regroup._hooks = original, recorded


def generation() -> None:
    with _one_excepthook():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    dist.destroy_process_group()


def uncaught(capsys: pytest.CaptureFixture[str]) -> str:
    """What the installed hook prints for an uncaught ``ValueError``."""
    capsys.readouterr()
    try:
        raise ValueError("boom")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    return capsys.readouterr().err


def test_three_generations_leave_one_rank_prefix(
    hooks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(3):
        generation()
    err = uncaught(capsys)
    assert "[rank0]: ValueError: boom" in err
    assert "[rank0]: [rank0]:" not in err  # torch alone nests one prefix per generation


def test_a_hook_set_between_generations_is_kept(
    hooks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    generation()
    seen: list[Any] = []
    previous = sys.excepthook

    def mine(*args: Any) -> None:
        seen.append(args[0])
        previous(*args)

    sys.excepthook = mine
    generation()
    err = uncaught(capsys)
    assert seen == [ValueError]
    assert "[rank0]: ValueError: boom" in err


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(_malloc_trim() is None, reason="glibc's malloc_trim: Linux with glibc")
def test_the_heaps_free_memory_goes_back_between_generations() -> None:
    page, block = 4096, 64 << 10  # under malloc's mmap threshold: from the heap
    blocks = [bytearray(block) for _ in range(1024)]
    for b in blocks:
        b[::page] = b"\x01" * (block // page)  # every page touched: resident
    above = bytearray(block)  # the heap's top stays in use: free() cannot shrink it
    full = rss_kib()
    del blocks
    freed = rss_kib()
    _release_memory()
    trimmed = rss_kib()
    assert full - trimmed > 48 << 10, (full, freed, trimmed)
    assert freed - trimmed > 32 << 10, (full, freed, trimmed)  # the trim, not free()
    assert above[0] == 0


def test_the_source_lines_tracebacks_cached_go_between_generations() -> None:
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError)) as failed:
        dist.barrier()  # no process group: fails, as an ended generation's collectives do
    traceback.extract_tb(failed.value.__traceback__)  # what DCP does with every rank's failure
    cached = set(linecache.cache)
    assert any(name.endswith("distributed_c10d.py") for name in cached), cached
    _release_memory()
    assert not linecache.cache
    # Only a cache: a traceback formatted later still shows its lines.
    assert linecache.getline(__file__, 1).startswith('"""What regrouping')
