"""The memory tier: each node's copies of its ranks' checkpoint files in host shared memory.

Under a Rallypoint agent (``torchrun --rdzv-backend=rallypoint`` or ``rallypoint run``)
every save writes this node's ranks' files to ``ROOT/JOB/NODE/vVVVVVVVVVV/`` before it
uploads them, then the version's index, ``version.json``: what the version is (step,
generation, world size). Files of a version without an index are never read or served.
A rank writes the index before it reports its files, so a report that names this node
names a copy that can be read, even if every process of the node dies the moment the
version commits. A worker restarted on the same node (torchrun restarts every worker
after one fails) reads them from there instead of from blob storage; every item is
still checked against its checksum, and a file that fails falls back to another copy.

Other nodes' files, copied here by their ranks through this node's replica server
(:mod:`._peers`), live beside them in ``replicas/vVVVVVVVVVV/rank-RRRRR/``.

A save stages its rank's tensors straight into a file of the tier (:meth:`staging_file`,
``staging/``), which becomes the version's data file once the coordinator has named the
version (:meth:`adopt`): one copy from the training state to the tier, and the peer copy
and the upload read from there. The data files of the versions the tier drops are kept
in ``recycle/rank-RRRRR/`` for the next save of the same rank: their pages are already
allocated, and a fresh file costs a page fault per 4 KiB the first time it is written.
A file a process has mapped (:func:`map_file`: a state restored without a template is
made of views of it) is never reused, only unlinked: it holds a shared ``flock`` for as
long as the mapping lives, and a file is reused only under an exclusive one. Writing
over it would change tensors under the process; cutting it shorter makes Linux take
back even the pages the process copied on write (a SIGBUS at the next read).

The agent owns the folder: it creates it, tells its workers where it is
(``RALLYPOINT_MEMORY_DIR``; ``none`` turns the tier off), removes it when it exits, and
at its start removes the folders of agents on this machine that died without doing so.
The node keeps the newest ``RALLYPOINT_MEMORY_KEEP`` (default 2) versions of its own and
as many of the replicas it holds. A copy that cannot be written (shared memory full) is
skipped with a warning: the tier never fails a save.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rallypoint.client import check_id
from rallypoint.client.models import rank_folder

from .._bytes import map_private
from .._pids import alive

__all__ = [
    "INDEX",
    "KEEP",
    "KEEP_ENV",
    "MEMORY_ENV",
    "OFF",
    "NodeMemory",
    "default_root",
    "map_file",
]

log = logging.getLogger("rallypoint.trainer")

#: Where the agent's memory tier is; set by the agent for its workers.
MEMORY_ENV = "RALLYPOINT_MEMORY_DIR"
#: ``RALLYPOINT_MEMORY_DIR=none`` turns the memory tier off.
OFF = "none"
#: Versions a node keeps in memory: of its own, and of the replicas it holds.
KEEP = 2
#: Overrides :data:`KEEP` (set it for the agent; its workers inherit it).
KEEP_ENV = "RALLYPOINT_MEMORY_KEEP"
_OWNER = "owner"
_DONE = "version.json"
#: The name of a version's index (what it is: step, generation, world size): beside a
#: node's own versions, and beside rank 0's files in a standby's replica of them.
INDEX = _DONE
_REPLICAS = "replicas"
_RANK0 = rank_folder(0)
_STAGING = "staging"
_RECYCLE = "recycle"
#: Recycled files kept per rank: one version's worth (the next save takes it).
_RECYCLED_PER_RANK = 1
_SEQUENCE = itertools.count()


def _keep() -> int:
    raw = os.environ.get(KEEP_ENV)
    if not raw:
        return KEEP
    try:
        keep = int(raw)
    except ValueError:
        keep = 0
    if keep < 1:
        raise ValueError(f"{KEEP_ENV} must be a whole number of versions, at least 1: {raw!r}")
    return keep


def default_root() -> Path | None:
    """``/dev/shm/rallypoint`` where shared memory is mounted and writable, else None."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "rallypoint"
    return None


def map_file(path: Path) -> torch.Tensor:
    """A file's bytes as a copy-on-write mapping (a uint8 tensor; nothing is copied).

    The file is pinned for as long as the mapping lives (a shared ``flock``, which the
    mapping's reference to the open file keeps): the tier never reuses it.

    Raises:
        FileNotFoundError: The file is gone, or was taken for reuse before the pin.
    """
    with open(path, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        # Taken for reuse between the open and the pin: the name is another file now,
        # or none, and the pages are about to be written over.
        if os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
            raise FileNotFoundError(2, "reused while being opened", str(path))
        return map_private(f.fileno())


def _unmapped(fd: int) -> bool:
    """Whether no process maps the open file (see :func:`map_file`): an exclusive
    ``flock``, which the caller keeps until it closes ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _reusable(path: Path) -> bool:
    """Whether a file just taken from the recycle pool may be written over: a process
    that opened it under its old name before it was recycled may have mapped it since
    (:func:`map_file` then fails its name check, but the pages are its). Such a file is
    unlinked, and the save starts a new one."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if _unmapped(fd):
            return True
    finally:
        os.close(fd)
    path.unlink()
    return False


class NodeMemory:
    """One node's copies of one job's checkpoint versions.

    Args:
        root: The machine's memory-tier folder.
        job_id: The job.
        node_id: This node (every process of the node shares the folder).
        keep: Versions to keep, of its own and of replicas each; defaults to
            ``RALLYPOINT_MEMORY_KEEP``, else 2.
    """

    def __init__(self, root: Path, job_id: str, node_id: str, keep: int | None = None) -> None:
        self.root = root
        self.job_id = check_id(job_id)
        self.node_id = check_id(node_id)
        self.folder = root / self.job_id / self.node_id
        self.keep = _keep() if keep is None else keep

    @classmethod
    def from_env(cls, job_id: str, node_id: str) -> NodeMemory | None:
        """The agent's memory tier for this node, or None if no agent set one up."""
        root = os.environ.get(MEMORY_ENV)
        return cls(Path(root), job_id, node_id) if root and root != OFF else None

    def _version(self, version: int) -> Path:
        return self.folder / f"v{version:010d}"

    def _replica(self, version: int) -> Path:
        return self.folder / _REPLICAS / f"v{version:010d}"

    def write(self, version: int, name: str, parts: Sequence[bytes | memoryview]) -> bool:
        """Writes a file of ``version`` (``name`` may hold one ``/``), whole or not at all.

        Returns:
            False if it could not (shared memory full, as a container's 64 MiB default
            soon is): the save goes on to storage, with a warning.
        """
        return self._write(self._version(version) / name, version, parts)

    def staging_file(self, rank: int, size: int) -> Path | None:
        """A file of ``size`` bytes in the tier for ``rank``'s next save to stage into: a
        recycled data file of the rank's if there is one, else a new one.

        Returns:
            None if shared memory cannot hold it (the save stages into process memory,
            and the tier's copy is skipped or written as before).
        """
        staging = self.folder / _STAGING
        target = staging / f"{rank_folder(rank)}.{os.getpid()}.{next(_SEQUENCE)}"
        try:
            staging.mkdir(parents=True, exist_ok=True)
            self._sweep_staging(staging)
            taken = False
            for old in sorted((self.folder / _RECYCLE / rank_folder(rank)).glob("*")):
                with contextlib.suppress(OSError):  # another process took it first
                    os.rename(old, target)
                    taken = _reusable(target)
                    break
            have = target.stat().st_size if taken else 0
            free = shutil.disk_usage(staging).free
            if size - have > free:
                raise OSError(
                    28, f"{size >> 20} MiB to stage, {free >> 20} MiB of shared memory free"
                )
            with open(target, "ab") as f:
                os.truncate(f.fileno(), size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                target.unlink(missing_ok=True)
            log.warning(
                "no staging file in this node's memory (%s): %s; staging in process memory",
                self.folder,
                exc.strerror or exc,
            )
            return None
        return target

    def _sweep_staging(self, staging: Path) -> None:
        """Removes staging files of processes that died mid-save (the name holds the pid)."""
        for left in staging.glob("rank-*"):
            with contextlib.suppress(ValueError, OSError):
                if not alive(int(left.name.split(".")[1])):
                    left.unlink()

    def adopt(self, version: int, name: str, staged: Path) -> None:
        """Makes a staged file ``name`` of ``version`` (a rename: nothing is copied)."""
        target = self._version(version) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)

    def discard(self, staged: Path) -> None:
        """Returns a staged file that no version adopted (a failed save) for reuse."""
        rank = staged.name.split(".")[0]
        self._recycle(staged, rank)

    def _recycle(self, path: Path, rank: str) -> None:
        """Keeps a data file for the rank's next save, or unlinks it if a process maps it."""
        pool = self.folder / _RECYCLE / rank
        with contextlib.suppress(OSError):  # gone already: another process recycled it
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if not _unmapped(fd):
                    path.unlink()  # its pages must stay as the mapping's holder read them
                    return
                pool.mkdir(parents=True, exist_ok=True)
                os.rename(path, pool / f"{os.getpid()}.{next(_SEQUENCE)}")
            finally:
                os.close(fd)  # the lock goes with it
            held = sorted(pool.iterdir(), key=lambda p: p.stat().st_mtime)
            for extra in held[:-_RECYCLED_PER_RANK]:
                extra.unlink(missing_ok=True)

    def replica_path(self, version: int, name: str) -> Path:
        """Where a file another node's rank copies here goes (the replica server writes
        it, then calls :meth:`prune_replicas`)."""
        return self._replica(version) / name

    def prune_replicas(self) -> None:
        """Drops the replicas of versions beyond the newest ``keep``."""
        held = sorted(int(p.name[1:]) for p in (self.folder / _REPLICAS).glob("v[0-9]*"))
        for number in held[: -self.keep]:
            shutil.rmtree(self._replica(number), ignore_errors=True)

    def _write(self, target: Path, version: int, parts: Sequence[bytes | memoryview]) -> bool:
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        size = sum(len(p) for p in parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(target.parent).free
            if free < size:
                # Checked first: a tmpfs that fills up fails the write part-way, after
                # taking the memory the training process may need.
                raise OSError(
                    28, f"{size >> 20} MiB to write, {free >> 20} MiB of shared memory free"
                )
            with open(partial, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(partial, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            log.warning(
                "checkpoint v%d: no copy in this node's memory (%s): %s; restarts will read "
                "storage. Give the node more shared memory, or set %s=none",
                version,
                self.folder,
                exc.strerror or exc,
                MEMORY_ENV,
            )
            return False
        return True

    def find(self, version: int, name: str) -> Path | None:
        """A file of a version held here: this node's own, once indexed, or a replica
        another node's rank copied here."""
        path = self._version(version) / name
        if (self._version(version) / _DONE).is_file() and path.is_file():
            return path
        replica = self._replica(version) / name
        return replica if replica.is_file() else None

    def summary(self, version: int) -> dict[str, Any] | None:
        """What :meth:`index` recorded of ``version``, if it is held here: of this
        node's own, or of a replica of rank 0's files (a standby's, whose rank 0 copies
        its index with them)."""
        for path in (self._version(version) / _DONE, self._replica(version) / _RANK0 / _DONE):
            try:
                found: dict[str, Any] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            return found
        return None

    def index(self, version: int, summary: dict[str, Any]) -> bool:
        """Writes ``version``'s index (after the files it makes readable: see the module's
        docstring) and drops the versions beyond the newest ``keep``.

        Every process of the node writes the same index; each write is whole, so any
        one of them makes the node's files readable.

        Returns:
            False if it could not be written: this node's copy does not count.
        """
        if not self.write(version, _DONE, [json.dumps(summary).encode()]):
            return False
        done = sorted(int(p.name[1:]) for p in self.folder.glob("v[0-9]*") if (p / _DONE).is_file())
        kept = done[-self.keep :]
        for path in self.folder.glob("v[0-9]*"):
            number = int(path.name[1:])
            if number not in kept and number < kept[0]:
                # Every process of the node prunes: another may remove the folder while
                # this one lists it (a save failed on that, FileNotFoundError).
                with contextlib.suppress(OSError):
                    for data in path.glob("rank-*/data.distcp"):
                        self._recycle(data, data.parent.name)
                shutil.rmtree(path, ignore_errors=True)
        return True

    def claim(self) -> None:
        """Makes this process (the agent) the folder's owner and removes the folders of
        owners on this machine that are gone."""
        for owner in self.root.glob(f"*/*/{_OWNER}"):
            with contextlib.suppress(OSError, ValueError):
                if not alive(int(owner.read_text())):
                    shutil.rmtree(owner.parent, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / _OWNER).write_text(str(os.getpid()))

    def remove(self) -> None:
        """Removes this node's copies (the agent's exit)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()  # the job's folder, if no other node's is left
