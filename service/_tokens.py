"""Who is calling: the admin token, or a job-scoped token with a role.

The admin token (``--token``) opens everything, as before. An operator makes
job-scoped tokens from it: ``trainer`` (join the job and act for its nodes, read it) and
``reader`` (read it: GET routes, the status page, the CLI's views). A scoped token is
``rpt_<id>_<secret>``; the ``~tokens`` partition keeps, per id, the job, the role, the
expiry, the revocation and a SHA-256 of the whole token (never the token).

Every replica reads a token's row at most every :data:`FRESH` seconds and checks
expiry at every request, so a revocation holds everywhere within a second, and a
thousand heartbeats a second with one trainer token cost two table reads a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread

from rallypoint.client import TokenInfo

from .errors import AlreadyExists, NotFound, UnknownToken
from .storage import Cond, Entity, Table

__all__ = ["ADMIN", "FRESH", "Need", "Principal", "Role", "Tokens", "presented"]

#: The partition of scoped tokens; ``~`` cannot occur in a job id.
PARTITION = "~tokens"
#: Seconds a replica trusts what it read of a token: revocations hold within this.
FRESH = 0.5
_PREFIX = "rpt_"

Role = Literal["trainer", "reader"]
Need = Literal["read", "act", "admin"]


@dataclass(frozen=True)
class Principal:
    """What a request's token lets it do.

    Attributes:
        role: ``admin`` (the coordinator's token, or no token configured), else the
            scoped token's role.
        job_id: The job a scoped token is for (None for admin).
        token_id: The scoped token's id (None for admin).
    """

    role: Literal["admin", "trainer", "reader"]
    job_id: str | None = None
    token_id: str | None = None

    def may(self, need: Need, job_id: str | None) -> bool:
        """Whether it may ``read`` a job, ``act`` in it (join, act for its nodes, write
        its checkpoints), or do what only the operator does (``admin``)."""
        if self.role == "admin":
            return True
        if need == "admin" or job_id != self.job_id:
            return False
        return need == "read" or self.role == "trainer"


ADMIN = Principal("admin")


def presented(headers: Mapping[str, str]) -> str | None:
    """The token a request carries: ``X-Rallypoint-Token`` (behind a gateway that takes
    ``Authorization`` for its own key), else ``Authorization: Bearer``."""
    alternate = headers.get("x-rallypoint-token")
    if alternate is not None:
        return alternate
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return given if scheme.lower() == "bearer" and given else None


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _info(e: Entity) -> TokenInfo:
    d = e.data
    return TokenInfo(
        token_id=e.row_key,
        job_id=str(d["job_id"]),
        role="trainer" if d["role"] == "trainer" else "reader",
        name=str(d["name"]) if d.get("name") else None,
        created_at=float(str(d["created_at"])),
        expires_at=None if d.get("expires_at") is None else float(str(d["expires_at"])),
        revoked_at=None if d.get("revoked_at") is None else float(str(d["revoked_at"])),
    )


@dataclass(frozen=True)
class _Read:
    entity: Entity | None  # None: no such token
    at: float  # Tokens.monotonic() of the read


class Tokens:
    """The coordinator's tokens: the admin one from settings, scoped ones in the table.

    Args:
        table: Where scoped tokens live (the ``jobs`` table, partition ``~tokens``).
        admin: The admin token; None leaves the coordinator open (every caller is admin).
        clock: Seconds since the epoch (expiry); injectable for tests.
        monotonic: Seconds for the freshness of what was read; injectable for tests.
    """

    def __init__(
        self,
        table: Table,
        admin: str | None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.admin = admin
        self.clock = clock
        self.monotonic = monotonic
        self._reads: dict[str, _Read] = {}
        self._pending: dict[str, asyncio.Future[_Read]] = {}
        self._lock = threading.Lock()

    # --- managing -----------------------------------------------------------------------

    def create(
        self, job_id: str, role: Role, expires_in: float | None = None, name: str | None = None
    ) -> tuple[TokenInfo, str]:
        """Makes a scoped token.

        Returns:
            Its record, and the token itself (shown once: only its hash is kept).
        """
        now = self.clock()
        while True:
            token_id = secrets.token_hex(6)
            token = f"{_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
            data = {
                "job_id": job_id,
                "role": role,
                "name": name,
                "hash": _hash(token),
                "created_at": now,
                "expires_at": None if expires_in is None else now + expires_in,
                "revoked_at": None,
            }
            try:
                stored = self.table.insert(Entity(PARTITION, token_id, data))
            except AlreadyExists:  # 48 random bits met another token's: draw again
                continue
            return _info(stored), token

    def revoke(self, token_id: str) -> TokenInfo:
        """Revokes a scoped token (again: no change).

        Raises:
            UnknownToken: No token has this id.
        """
        try:
            e = self.table.get(PARTITION, token_id)
        except NotFound:
            raise UnknownToken(f"no token {token_id!r}") from None
        if e.data.get("revoked_at") is None:
            e = self.table.upsert(
                Entity(PARTITION, token_id, {**e.data, "revoked_at": self.clock()})
            )
        with self._lock:
            self._reads.pop(token_id, None)
        return _info(e)

    def list(self, job_id: str | None = None) -> list[TokenInfo]:
        """Scoped tokens (all, or one job's), oldest first."""
        where = [] if job_id is None else [Cond("job_id", "eq", job_id)]
        return sorted(
            (_info(e) for e in self.table.query(PARTITION, where)), key=lambda t: t.created_at
        )

    # --- checking -----------------------------------------------------------------------

    async def principal(self, token: str | None) -> Principal | None:
        """Who a request's token makes it; None: no token, or one that is unknown,
        expired or revoked."""
        found = self._admin_or_id(token)
        if isinstance(found, str):  # a scoped token's id: its row says the rest
            return self._judge(await self._read(found), token or "")
        return found

    def _admin_or_id(self, token: str | None) -> Principal | str | None:
        """What needs no storage: admin, nobody (None), or the scoped token's id."""
        if self.admin is None:
            return ADMIN
        if token is None:
            return None
        if hmac.compare_digest(token.encode(), self.admin.encode()):
            return ADMIN
        return _token_id(token)

    def _judge(self, read: _Read, token: str) -> Principal | None:
        e = read.entity
        if e is None or not hmac.compare_digest(str(e.data.get("hash", "")), _hash(token)):
            return None
        info = _info(e)
        if info.revoked_at is not None:
            return None
        if info.expires_at is not None and self.clock() >= info.expires_at:
            return None
        return Principal(info.role, info.job_id, info.token_id)

    def _cached(self, token_id: str) -> _Read | None:
        with self._lock:
            read = self._reads.get(token_id)
        if read is not None and self.monotonic() - read.at < FRESH:
            return read
        return None

    def _fetch(self, token_id: str) -> _Read:
        at = self.monotonic()
        try:
            entity: Entity | None = self.table.get(PARTITION, token_id)
        except NotFound:
            entity = None
        read = _Read(entity, at)
        with self._lock:
            if len(self._reads) > 10_000:  # ids that never existed must not fill memory
                self._reads.clear()
            self._reads[token_id] = read
        return read

    async def _read(self, token_id: str) -> _Read:
        read = self._cached(token_id)
        if read is not None:
            return read
        # One read per token at a time: a thousand beats arriving together wait for it.
        pending = self._pending.get(token_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[_Read] = asyncio.get_running_loop().create_future()
        self._pending[token_id] = future
        try:
            read = await anyio.to_thread.run_sync(self._fetch, token_id)
            future.set_result(read)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning if none waited
            raise
        finally:
            del self._pending[token_id]
        return read


def _token_id(token: str) -> str | None:
    if not token.startswith(_PREFIX):
        return None
    token_id, sep, _ = token[len(_PREFIX) :].partition("_")
    if not sep or len(token_id) != 12 or not all(c in "0123456789abcdef" for c in token_id):
        return None
    return token_id
