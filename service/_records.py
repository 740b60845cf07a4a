"""What the rendezvous reads from storage, as records: the job, a generation and its
members, a node's registration.

They are plain immutable values, apart from what a generation caches about itself
(its members' JSON, their digest, credentials already verified). The rules that decide
from them (:mod:`._seal`) and the code that reads and writes them (:mod:`._rendezvous`)
both import them from here, so neither imports the other's module for its types.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from rallypoint.client.models import CheckpointPointer, JobSpec, LoadFailure, QuarantinedNode

from . import _credentials as credentials
from .errors import UnknownNode

__all__ = ["Generation", "Job", "Member", "Node", "Status"]


Status = Literal["open", "sealed"]


@dataclass(frozen=True)
class Job:
    """A snapshot of the job entity."""

    job_id: str
    spec: JobSpec
    generation: int  # the latest sealed generation; 0 before the first
    status: Status  # "open": round generation+1 gathers; "sealed": generation runs
    world_size: int
    created_at: float
    changed_at: float
    etag: str
    #: The authoritative latest checkpoint; the next seal names it if it can still be
    #: recovered from the new members or from blob storage.
    checkpoint: CheckpointPointer | None = None
    #: The newest checkpoint whose every file is in blob storage.
    durable: CheckpointPointer | None = None
    #: The generations just before now that ended failing to load their checkpoint, in a
    #: row (the same version at the same world size): the seal reads it
    #: (:func:`._seal.load_blocked`) so that a job does not loop on a load that fails.
    load_failure: LoadFailure | None = None
    #: Nodes the job does not admit, and its members' recent losses (by node, the
    #: times), which may quarantine a node lost too often (:func:`._seal.lost_too_often`).
    quarantined: tuple[QuarantinedNode, ...] = ()
    losses: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    #: The generation that ended last and why, for its members' heartbeats
    #: (:func:`._seal.end_reason`).
    last_end: tuple[int, str] | None = None
    #: The last hang found: its generation, node and rank (its node's heartbeat is told,
    #: so that its agent takes the rank's stacks before stopping it).
    last_hang: tuple[int, str, int] | None = None
    #: Each node's recent hangs (the times), which quarantine one that hangs too often
    #: (:func:`._health.hung_too_often`).
    hangs: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    #: Generations in a row that ended for a fault without progress, the best step any
    #: generation reached, and the last such ends' reasons (:func:`._health.stalled`).
    stalls: int = 0
    best_step: int = -1
    stall_reasons: tuple[str, ...] = ()
    #: The world sizes (nodes) its workers reported it can take (a ``WorldSizeError``),
    #: from ``min_nodes`` to ``max_nodes``; None: none reported. With the spec's own
    #: (``spec.world_sizes``) they make the sizes a round seals (:func:`._seal.sizes`).
    learned_sizes: tuple[int, ...] | None = None

    def quarantine_of(self, node_id: str) -> QuarantinedNode | None:
        return next((q for q in self.quarantined if q.node_id == node_id), None)

    @property
    def round(self) -> int:
        """The round a node joining now registers for."""
        return self.generation + 1


@dataclass(frozen=True)
class Member:
    node_id: str
    rank: int
    addr: str
    port: int
    #: The node agent's replica server, if it runs one.
    peer: str | None = None
    #: The digest of the credential of the registration that was sealed.
    cred: str | None = None


@dataclass(frozen=True)
class Generation:
    generation: int
    members: tuple[Member, ...]
    sealed_at: float
    ended_at: float | None
    ended_reason: str | None
    checkpoint: CheckpointPointer | None
    etag: str
    #: Set when a rank could not load ``checkpoint``, which ended the generation.
    load_failure: LoadFailure | None = field(default=None, compare=False)
    #: Where the members are when they did not fit the generation's row: the seal's id
    #: and the number of part rows (``gen:NNN~SEAL~0``, ...).
    parts: tuple[str, int] | None = field(default=None, compare=False)

    @functools.cached_property
    def ranks(self) -> dict[str, int]:
        """Node id to rank, for constant-time membership checks on every heartbeat."""
        return {m.node_id: m.rank for m in self.members}

    @functools.cached_property
    def members_json(self) -> bytes:
        """The members as the wire's JSON list, made once per generation (the members
        route serves it; assignments carry only its digest)."""
        return json.dumps(
            [
                {"node_id": m.node_id, "rank": m.rank, "addr": m.addr, "port": m.port}
                | ({"peer": m.peer} if m.peer else {})
                for m in self.members
            ],
            separators=(",", ":"),
        ).encode()

    @functools.cached_property
    def members_digest(self) -> str:
        """``sha256:<hex>`` of :attr:`members_json`: the assignments' and its ETag."""
        return "sha256:" + hashlib.sha256(self.members_json).hexdigest()

    @functools.cached_property
    def _verified(self) -> dict[str, str]:
        return {}

    def check_credential(self, node_id: str, credential: str | None) -> None:
        """Refuses a request of a member that does not carry its credential.

        A member sends the same credential every second: once its digest matched, the
        credential itself is kept (this record is immutable, and cached), so the next
        beats cost a string comparison rather than a hash.

        Raises:
            UnknownNode: The node is not a member.
            InvalidCredential: Not the member's credential.
        """
        rank = self.ranks.get(node_id)
        if rank is None:
            raise UnknownNode(f"node {node_id!r} is not a member of generation {self.generation}")
        known = self._verified.get(node_id)
        if known is not None and credential is not None and credentials.same(known, credential):
            return
        credentials.check(self.members[rank].cred, credential, node_id)
        self._verified[node_id] = credential or ""

    def assignment_json(self, job_id: str, node_id: str) -> bytes:
        """A member's :class:`Assignment` as JSON: O(1) bytes at any number of members
        (each of N replies listing all N members made a round move O(N^2) bytes)."""
        head = {
            "job_id": job_id,
            "node_id": node_id,
            "generation": self.generation,
            "rank": self.ranks[node_id],
            "world_size": len(self.members),
            "master_addr": self.members[0].addr,
            "master_port": self.members[0].port,
            "checkpoint": self.checkpoint.model_dump(mode="json") if self.checkpoint else None,
            "members_digest": self.members_digest,
        }
        return json.dumps(head, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Node:
    node_id: str
    addr: str
    port: int
    round: int
    joined_at: float
    state: Literal["waiting", "left"]
    join_id: str | None = None
    peer: str | None = None
    #: This registration's id, which its credential derives from.
    registration: str | None = None
    #: The digest of the registration's credential.
    cred: str | None = None
    #: The credential itself: only in what :meth:`Rendezvous.register` returns, never
    #: stored.
    credential: str | None = field(default=None, compare=False, repr=False)
    #: The stored row's ETag (None for a node that was never read or written here).
    etag: str | None = field(default=None, compare=False, repr=False)
    #: Whether the registration parks as a standby: only in what
    #: :meth:`Rendezvous.register` returns, never stored.
    parked: bool = field(default=False, compare=False, repr=False)
    #: Whether :meth:`Rendezvous.register` wrote the registration with a first beat
    #: (not a retry it found registered): only in what it returns, never stored.
    beat: bool = field(default=False, compare=False, repr=False)
    #: A hot join (``JoinRequest.warm``): kept, so that a node that missed its round
    #: registers for the next as it joined (parked while its workers start).
    warm: bool = False
