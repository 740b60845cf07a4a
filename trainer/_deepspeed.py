"""A DeepSpeed ``CheckpointEngine`` over :class:`CheckpointManager`: the role Nebula had.

DeepSpeed's ``save_checkpoint`` builds each of this rank's files (the model states on
the data-parallel writer, this rank's ZeRO optimizer partition everywhere) and hands
each to ``checkpoint_engine.save(state_dict, path)``, then calls ``commit``. Here the
files are kept by name until ``commit``, which saves them as one version: files DeepSpeed
reads on every rank (``mp_rank_00_model_states.pt``) in the shared state, each rank's
partition (``zero_pp_rank_R_...``) in its ``rank_state``. The save blocks only for the
staging copy; the upload, the memory tier and the peer copy run in the background.

Loading goes the other way: ``load(path)`` answers by file name from the version the
coordinator named for this generation, whatever directory or tag the path holds.
DeepSpeed itself still lists the model files with ``glob`` and reads the ``latest`` file
with ``open()``, so :func:`load_checkpoint` points it at a scratch directory holding
empty stand-ins for the version's files and the version's tag.

ZeRO's partitions fit only the data-parallel world size that saved them (DeepSpeed
refuses any other with ``ZeRORuntimeException``). When the world size changed, the
stand-in is a DeepSpeed universal checkpoint instead: one rank of each node reads every
old rank's partitions from the version, writes them as DeepSpeed's files and converts
them with DeepSpeed's own ``ds_to_universal``, and the load runs with ``load_universal``
on, which reads each parameter's full fp32 value and optimizer state and keeps this
rank's slice of today's partitioning.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed.comm
import torch
import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from rallypoint.client import ElasticClient

from ._joining import join_first
from ._pack import file_key, name_of, pack, split, unpack
from .checkpoint import CheckpointManager, Restored, SaveHandle, SavePolicy
from .errors import CheckpointError

__all__ = [
    "ENGINE_NAME",
    "RallypointCheckpointEngine",
    "init_distributed",
    "install",
    "installed",
    "load_checkpoint",
]

log = logging.getLogger("rallypoint.trainer")

ENGINE_NAME = "RallypointCheckpointEngine"
#: Top-level key of a version's state and rank_state that holds the tag DeepSpeed saved
#: it under; every other key is a file.
TAG = "tag"
#: The version's metadata key holding the data-parallel world size that saved it.
DP_WORLD_SIZE = "dp_world_size"
#: Files DeepSpeed reads only on the rank that wrote them: ZeRO optimizer partitions
#: (``zero_pp_rank_``, ``bf16_zero_pp_rank_``) and expert-parallel optimizer states.
_PER_RANK = ("zero_pp_rank_", "expp_rank_")


def _per_rank(name: str) -> bool:
    return any(marker in name for marker in _PER_RANK)


def _deepspeed_file(name: str) -> bool:
    """Whether DeepSpeed's converter reads the file (not the HF Trainer's extras)."""
    return name.endswith(("_model_states.pt", "_optim_states.pt"))


class RallypointCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """Saves DeepSpeed checkpoints as Rallypoint versions and loads the coordinator's.

    Made by :func:`install`. See base class for the protocol DeepSpeed drives.

    Attributes:
        checkpoints: The manager every save and load goes through.
        restored: What the last load restored (``bytes_from`` says from where), or None.
        last_save: The last save's handle (its ``blocked`` time and result).
        extra: Files added to every save's shared state (the HF Trainer's
            ``trainer_state.json``), by name.
        extra_rank: Files added to this rank's ``rank_state`` (its RNG state), by name.
        step: The step the next version is saved as; None: the engine's
            ``global_steps``.
    """

    def __init__(self, engine: Any, checkpoints: CheckpointManager) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self.engine = engine
        self.checkpoints = checkpoints
        self.restored: Restored | None = None
        self.last_save: SaveHandle | None = None
        self.extra: dict[str, Any] = {}
        self.extra_rank: dict[str, Any] = {}
        #: More of the version's metadata (JSON), and its metrics, for the next save
        #: (an adapter's: the HF Trainer's model config, its evaluation's metrics).
        self.metadata: dict[str, Any] = {}
        self.metrics: dict[str, float] | None = None
        self.step: int | None = None
        self._files: dict[str, Any] = {}
        self._persist = False
        self._blocking = False
        self._loaded: dict[str, Any] | None = None
        self._scratch: str | None = None
        # The universal checkpoint of a reshard (its tag folder), and the node folder
        # holding it if this rank made it.
        self._universal: str | None = None
        self._converted: str | None = None
        self._load_universal = bool(engine.load_universal_checkpoint())
        #: Seconds this rank spent on the last reshard (reading every old rank's
        #: partitions and converting them, on the converting rank; waiting, elsewhere).
        self.reshard_seconds: float | None = None

    # --- saving -------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """See base class."""
        self._files = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """See base class. The folders are made: DeepSpeed copies its recovery scripts
        (``zero_to_fp32.py``) into the tag's folder with plain ``copyfile``."""
        os.makedirs(path, exist_ok=True)

    def save(self, state_dict: Any, path: str) -> None:
        """See base class. Keeps the file until :meth:`commit`; copies nothing."""
        self._files[split(path)] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """See base class. Saves this rank's files as the version of the engine's step
        (every rank commits in the same ``save_checkpoint``)."""
        shared: dict[str, Any] = {TAG: info.tag}
        own: dict[str, Any] = {TAG: info.tag}
        for name, obj in {**self._files, **self.extra}.items():
            (own if _per_rank(name) else shared)[file_key(name)] = pack(obj)
        for name, obj in self.extra_rank.items():
            own[file_key(name)] = pack(obj)
        self._files = {}
        step = self.step if self.step is not None else int(self.engine.global_steps)
        dp_world_size = int(self.engine.seq_dp_world_size)
        self.last_save = self.checkpoints.save(
            shared,
            step,
            rank_state=own,
            metadata={
                **self.metadata,
                TAG: info.tag,
                "framework": "deepspeed",
                DP_WORLD_SIZE: dp_world_size,
            },
            metrics=self.metrics,
            blocking=self._blocking,
            persist=self._persist,
        )
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        *,
        client_state: dict[str, Any] | None = None,
        persist: bool = False,
        blocking: bool = False,
        **kwargs: Any,
    ) -> SaveHandle | None:
        """``engine.save_checkpoint`` with the manager's options for this one save.

        Args:
            save_dir, tag, client_state: As ``engine.save_checkpoint`` takes them.
            persist: Send this version to blob storage whatever ``persist_every`` says
                (on a preemption notice).
            blocking: Return once the version is committed.

        Returns:
            The save's handle (None if the manager skipped it).
        """
        with self._options(persist=persist, blocking=blocking):
            self.engine.save_checkpoint(save_dir, tag, client_state=client_state or {}, **kwargs)
        return self.last_save

    @contextmanager
    def _options(self, *, persist: bool, blocking: bool) -> Iterator[None]:
        self._persist, self._blocking = persist, blocking
        try:
            yield
        finally:
            self._persist = self._blocking = False

    def wait(self) -> None:
        """Waits for the save in flight (raises what it raised)."""
        self.checkpoints.wait()

    # --- loading ------------------------------------------------------------------------

    def restore(self, restored: Restored | None = None) -> Restored | None:
        """Reads the version the coordinator named for this generation (once), or None
        if the job has none yet. Each rank reads the shared files and its own.

        Args:
            restored: That version, already read through the same manager (the HF
                Trainer reads it before DeepSpeed's engine exists).
        """
        if self.restored is None:
            self.restored = restored or self.checkpoints.load_latest()
            if self.restored is None:
                return None
            files: dict[str, Any] = {}
            for part in (self.restored.state, self.restored.rank_state or {}):
                files.update({name_of(k): v for k, v in part.items() if k != TAG})
            self._loaded = files
        return self.restored

    @property
    def tag(self) -> str | None:
        """The tag the restored version was saved under."""
        if self.restored is None:
            return None
        return str((self.restored.metadata or {}).get(TAG) or self.restored.state[TAG])

    def load(self, path: str, map_location: Any = None) -> Any:
        """See base class. The file named like ``path``'s base name in the coordinator's
        version, wherever ``path`` points.

        Raises:
            CheckpointError: The job has no checkpoint, or the version holds no such
                file for this rank (it was saved by another layout).
        """
        if self.restore() is None:
            raise CheckpointError("the coordinator names no checkpoint for this generation")
        assert self._loaded is not None and self.restored is not None
        name = split(path)
        tag = os.path.basename(os.path.dirname(path))
        if tag and tag != self.tag:
            log.warning(
                "DeepSpeed asked for %s of tag %s; loading the coordinator's v%d (tag %s)",
                name,
                tag,
                self.restored.version,
                self.tag,
            )
        if name not in self._loaded and self._universal is not None:
            converted = os.path.join(self._universal, name)
            if os.path.isfile(converted):  # another old rank's model states file
                return torch.load(converted, map_location=map_location, weights_only=False)
        if name not in self._loaded:
            raise CheckpointError(
                f"checkpoint v{self.restored.version} holds no {name} for rank "
                f"{self.checkpoints.rank} (it has {sorted(self._loaded)})"
            )
        return unpack(self._loaded[name], map_location)

    @property
    def saved_dp_world_size(self) -> int | None:
        """The data-parallel world size that saved the restored version (None: none)."""
        if self.restored is None:
            return None
        saved = (self.restored.metadata or {}).get(DP_WORLD_SIZE)
        return int(saved) if saved is not None else self.restored.world_size

    def needs_reshard(self) -> bool:
        """Whether the restored version's ZeRO partitions were cut for another
        data-parallel world size than today's (see :meth:`stand_in`)."""
        saved = self.saved_dp_world_size
        return (
            saved is not None
            and bool(self.engine.zero_optimization())
            and saved != int(self.engine.seq_dp_world_size)
        )

    def stand_in(self, directory: str | None = None) -> str | None:
        """A folder DeepSpeed's own file checks accept for the restored version: empty
        files under its tag, named as the version's files, and a ``latest`` file naming
        the tag. Nothing is read from them: :meth:`load` answers by name.

        If the version's ZeRO partitions were saved at another data-parallel world size,
        the folder is a universal checkpoint of it, made once per node, and the engine's
        next load reads it with ``load_universal`` on. Every rank must call this then
        (it gathers the ranks of each node); ``engine.load_checkpoint(folder,
        tag=self.tag)`` on every rank follows, as always.

        Args:
            directory: Where to make the folder; default: a temporary one (a
                reshard's, per node, under the system's temporary directory).

        Returns:
            The folder, or None if the job has no checkpoint yet.

        Raises:
            CheckpointError: A reshard failed (on any rank; every rank raises).
        """
        if self.restore() is None:
            return None
        assert self._loaded is not None and self.tag is not None
        # DeepSpeed reads load_universal only from the config given to initialize; no
        # public call turns it on for one load, so the engine's parsed config is set.
        reshard = self.needs_reshard()
        self.engine._config.load_universal_checkpoint = self._load_universal or reshard
        if reshard:
            return self._reshard(directory)
        if directory is None:
            if self._scratch is None:
                self._scratch = tempfile.mkdtemp(prefix="rallypoint-deepspeed-")
            directory = self._scratch
        folder = os.path.join(directory, self.tag)
        os.makedirs(folder, exist_ok=True)
        for name in self._loaded:
            open(os.path.join(folder, name), "wb").close()
        with open(os.path.join(directory, "latest"), "w") as f:
            f.write(self.tag)
        return directory

    def _reshard(self, directory: str | None) -> str:
        """The universal checkpoint of the restored version, in a folder of this node:
        its first rank converts, the others wait for it."""
        assert self.restored is not None and self.tag is not None
        started = time.perf_counter()
        node = self.checkpoints.assignment.node_id
        nodes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node)
        converts = nodes.index(node) == dist.get_rank()
        prefix = os.path.join(
            directory or tempfile.gettempdir(),
            f"rallypoint-deepspeed-{self.checkpoints.assignment.job_id}-{node}-",
        )
        folder = f"{prefix}v{self.restored.version}-g{self.checkpoints.generation}"
        error = None
        if converts:
            # An earlier generation's reshard on this node, its processes gone (killed
            # before close() removed it).
            for old in glob.glob(glob.escape(prefix) + "v*-g*"):
                shutil.rmtree(old, ignore_errors=True)
            try:
                self._convert(folder)
                self._converted = folder
            except Exception as exc:  # every rank raises it, none waits forever
                log.exception("converting v%d to a universal checkpoint", self.restored.version)
                error = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            rank, first = failed[0]
            raise CheckpointError(
                f"resharding checkpoint v{self.restored.version} from a data-parallel "
                f"world of {self.saved_dp_world_size} to {self.engine.seq_dp_world_size} "
                f"failed on rank {rank}: {first}"
            )
        self._universal = os.path.join(folder, self.tag)
        self.reshard_seconds = time.perf_counter() - started
        log.info(
            "checkpoint v%d: ZeRO partitions of %d ranks resharded for %d in %.2f s",
            self.restored.version,
            self.saved_dp_world_size,
            self.engine.seq_dp_world_size,
            self.reshard_seconds,
        )
        return folder

    def _convert(self, folder: str) -> None:
        """Writes every old rank's DeepSpeed files of the restored version and converts
        them into ``folder``/tag, a universal checkpoint."""
        assert self.restored is not None and self.tag is not None
        shutil.rmtree(folder, ignore_errors=True)
        source = os.path.join(folder, "saved", self.tag)
        os.makedirs(source)
        every = self.checkpoints.load(self.restored.version, every_rank=True)
        parts = [every.state, *(every.rank_states or {}).values()]
        for part in parts:
            for key, packed in (part or {}).items():
                name = name_of(key)
                if key != TAG and _deepspeed_file(name):
                    torch.save(unpack(packed), os.path.join(source, name))
        del every, parts
        args = argparse.Namespace(
            input_folder=source,
            output_folder=os.path.join(folder, self.tag),
            num_extract_workers=1,  # in this process: no pool of workers to fork
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # DeepSpeed saves the universal_checkpoint_info ZeRO-1/2's converter
            # requires only for Megatron models; the converter fills it in.
            inject_missing_state=True,
        )
        report = io.StringIO()  # its progress report and bars
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            ds_to_universal.main(args)
        shutil.rmtree(os.path.join(folder, "saved"), ignore_errors=True)

    def close(self) -> None:
        """Waits for the save in flight, frees the manager's staging buffers and removes
        the stand-in folder and the universal checkpoint of a reshard this rank made."""
        self.checkpoints.close()
        for folder in (self._scratch, self._converted):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._scratch = self._converted = None


def init_distributed(client: ElasticClient | None = None, **kwargs: Any) -> ElasticClient:
    """Joins the job, then builds the process group with ``deepspeed.init_distributed``.

    Call it first on every rank, before ``deepspeed.initialize``, which otherwise builds
    the group from torchrun's variables as it starts::

        client = rallypoint.trainer.deepspeed.init_distributed()
        engine, *_ = deepspeed.initialize(model=model, config=config)
        rallypoint.trainer.deepspeed.install(engine, client)

    A worker of a node that joins a running job (a hot join, ``rallypoint run``'s
    default) starts in a placeholder world: it waits in the join until its node goes
    in, and the group is built from its assignment's rank, world size and master
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, which the join sets and
    DeepSpeed reads). Any other worker of an agent takes the agent's assignment (no
    round).

    Args:
        client: The node's client; defaults to ``ElasticClient.from_env()``.
        **kwargs: ``deepspeed.init_distributed``'s (``dist_backend``, ``timeout``, ...).

    Returns:
        The client, joined: hand it to :func:`install`.
    """
    client = join_first(client)
    deepspeed.comm.init_distributed(**kwargs)
    return client


def install(
    engine: Any,
    client: ElasticClient | None = None,
    *,
    checkpoints: CheckpointManager | None = None,
    policy: SavePolicy | None = None,
) -> RallypointCheckpointEngine:
    """Routes ``engine.save_checkpoint`` and ``engine.load_checkpoint`` through Rallypoint.

    Call it once after ``deepspeed.initialize`` on every rank::

        engine, *_ = deepspeed.initialize(model=model, config=config)
        rallypoint_engine = rallypoint.trainer.deepspeed.install(engine)
        load_path, client_state = rallypoint.trainer.deepspeed.load_checkpoint(engine)

    Args:
        engine: The ``DeepSpeedEngine``.
        client: The node's client; defaults to ``ElasticClient.from_env()``, joined (the
            agent's assignment under torchrun).
        checkpoints: A manager to use; else one is made with ``policy``.
        policy: How versions are saved (:class:`~rallypoint.trainer.SavePolicy`:
            ``persist_every``, ``if_busy``, ...), for the manager made here.

    Returns:
        The installed checkpoint engine (also ``engine.checkpoint_engine``).

    Raises:
        ValueError: The engine uses MoE layers (DeepSpeed loads experts with a
            ``TorchCheckpointEngine`` of its own) or ZeRO's elastic checkpoints (every
            rank reads every partition).
    """
    if getattr(engine, "has_moe_layers", False):
        raise ValueError(
            "MoE engines are not supported: DeepSpeed loads expert files with a "
            "TorchCheckpointEngine of its own, not engine.checkpoint_engine"
        )
    if engine.zero_optimization() and engine.zero_elastic_checkpoint():
        raise ValueError(
            "zero_optimization.elastic_checkpoint makes every rank read every partition"
        )
    if isinstance(engine.checkpoint_engine, RallypointCheckpointEngine):
        return engine.checkpoint_engine
    if checkpoints is None:
        checkpoints = CheckpointManager(join_first(client), policy=policy)
    elif policy is not None:
        raise TypeError("pass either checkpoints= or policy=: a manager has its policy")
    if engine.checkpoint_engine is not None and engine.checkpoint_engine.is_decoupled():
        engine.checkpoint_engine.cleanup()  # its writer process would outlive it
    ours = RallypointCheckpointEngine(engine, checkpoints)
    engine.checkpoint_engine = ours
    return ours


def installed(engine: Any) -> RallypointCheckpointEngine:
    """The engine's Rallypoint checkpoint engine.

    Raises:
        ValueError: :func:`install` was not called on it.
    """
    ours = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ours, RallypointCheckpointEngine):
        raise ValueError("call rallypoint.trainer.deepspeed.install(engine) first")
    return ours


def load_checkpoint(engine: Any, **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint`` of the version the coordinator named for this
    generation, never of what a directory's ``latest`` file says.

    Args:
        engine: The engine :func:`install` was called on.
        **kwargs: ``engine.load_checkpoint``'s options (``load_optimizer_states``, ...).

    Returns:
        What ``engine.load_checkpoint`` returns (the load path and the client state), or
        ``(None, None)`` if the job has no checkpoint yet (a fresh start).
    """
    ours = installed(engine)
    # What fails (a reshard, DeepSpeed's own checks) is reported: the job does not loop.
    with ours.checkpoints.loading():
        folder = ours.stand_in()
        if folder is None:
            return None, None
        load_path, client_state = engine.load_checkpoint(folder, tag=ours.tag, **kwargs)
    return load_path, client_state
