"""``CoordinatorStore``: a ``torch.distributed.Store`` kept by the coordinator."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from torch._C import _DistStoreError as DistStoreError
from torch._C._distributed_c10d import Store

from rallypoint.client import (
    ElasticClient,
    RallypointError,
    StaleGeneration,
    StoreReply,
    StoreRequest,
)

__all__ = ["CoordinatorStore"]

# Each waiting request is held this long by the coordinator before the client asks again
# (and checks whether it should give up).
_WAIT_SLICE = 1.0
# How often a refused check-in asks whether this node left (see CoordinatorStore._op).
_DEPARTED_POLL = 0.05
# The keys of torchrun's exit barrier (torch.distributed.elastic.agent.server.api's
# _TERMINAL_STATE_SYNC_ID, a private name: copied, not imported).
_EXIT_BARRIER = "torchelastic/agent/terminal_state"


def _b64(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def _raw(text: str | None) -> bytes:
    return b"" if text is None else base64.b64decode(text)


class CoordinatorStore(Store):
    """The key-value store of one generation, kept in the coordinator's storage.

    This is what the torchrun plugin hands the agent: it survives the loss of any
    trainer (stock torchrun keeps it in a TCPStore on one of them), and its keys are the
    generation's own, so a restarted round never reads the previous round's keys.

    Args:
        client: A client of the job.
        generation: Whose keys these are.
        timeout: How long :meth:`get` and :meth:`wait` wait for missing keys.
        abort: Called between waits; a returned reason ends the wait with an error at once
            (the plugin's: "the generation ended"), rather than at the timeout.
        release: Called between waits of :meth:`wait`; True ends the wait without an
            error (the plugin's: "this node left the job", so its exit barrier has
            nobody to wait for; torch logs a failed barrier at length).

    A hot standby's agent (generation 0) hands torchrun a store that keeps its keys in
    this process until :meth:`follow` moves it to the generation the node is promoted
    into: torchrun assigns the ranks of the workers it starts ahead of that as the one
    agent of a one-node world, then runs its exit barrier with the generation's agents.
    """

    def __init__(
        self,
        client: ElasticClient,
        generation: int,
        timeout: timedelta = timedelta(seconds=300),
        abort: Callable[[], str | None] | None = None,
        release: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self._client = client
        self.generation = generation
        self._barrier_offset = 0
        self._timeout = timeout
        self._abort = abort
        self._release = release
        #: Whether the agent entered its exit barrier: torchrun's agent does only once
        #: its workers succeeded, so this node leaves as finished.
        self.finished = False
        # Generation 0's keys (a hot standby's, see above), base64 values as sent.
        self._local: dict[str, str | None] | None = {} if generation == 0 else None

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _op(self, request: StoreRequest) -> StoreReply:
        if self._local is not None:
            return _local_op(self._local, request)
        try:
            return self._client.store(self.generation, request)
        except StaleGeneration as exc:
            if request.op in ("set", "add") and self._departed():
                # The coordinator keeps no writes into an ended generation, and this
                # node left the job: its exit barrier's check-in has nobody to count it,
                # and the barrier's wait ends through ``release`` (an add of 0: not the
                # last to check in, so nothing is set for others to wait on).
                return StoreReply(count=0)
            raise DistStoreError(f"rallypoint store: {exc}") from exc
        except RallypointError as exc:
            raise DistStoreError(f"rallypoint store: {exc}") from exc

    def _departed(self) -> bool:
        """Whether this node left the job, once ``release`` can say: the generation
        ended, so the plugin hears why within moments (its heartbeat is a watch). False
        at once if ``abort`` gives another reason first, and at the store's timeout."""
        if self._release is None:
            return False
        deadline = time.monotonic() + self._timeout.total_seconds()
        while not self._release():
            ended = self._abort() if self._abort is not None else None
            if ended is not None or time.monotonic() >= deadline:
                return self._release()  # set before the reason, if it is the reason
            time.sleep(_DEPARTED_POLL)
        return True

    def set(self, key: str, value: str | bytes) -> None:
        self._op(StoreRequest(op="set", keys=[key], values=[_b64(value)]))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set needs one value per key")
        for start in range(0, len(keys), 100):
            chunk = slice(start, start + 100)
            encoded = [_b64(v) for v in values[chunk]]
            self._op(StoreRequest(op="set", keys=list(keys[chunk]), values=encoded))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._get(list(keys), self._timeout)

    def get(self, key: str) -> bytes:
        return self._get([key], self._timeout)[0]

    def _get(self, keys: list[str], timeout: timedelta, *, waiting: bool = False) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            reply = self._op(
                StoreRequest(op="get", keys=keys, wait=max(0.0, min(_WAIT_SLICE, left)))
            )
            values = reply.values or []
            if all(v is not None for v in values):
                return [_raw(v) for v in values]
            if waiting and self._release is not None and self._release():
                return []
            reason = self._abort() if self._abort is not None else None
            if reason is not None:
                raise DistStoreError(f"rallypoint store: {reason}")
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise DistStoreError(
                    f"rallypoint store: keys {missing} of generation {self.generation} "
                    f"missing after {timeout}"
                )

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._get(list(keys), timeout or self._timeout, waiting=True)

    def check(self, keys: list[str]) -> bool:
        return bool(self._op(StoreRequest(op="check", keys=list(keys))).found)

    def follow(self, generation: int, barrier_offset: int) -> None:
        """Moves the store to ``generation``, which the node's workers went into in
        place, its agent unaware (torchrun only knows the generation it started them
        in). The agent's exit barrier then counts to the number of agents it knows:
        ``barrier_offset`` (that number less the new generation's) is added to what
        its check-in counts, so the last agent of the new generation releases it."""
        self.generation = generation
        self._barrier_offset = barrier_offset
        self._local = None

    def add(self, key: str, value: int) -> int:
        if key.startswith(_EXIT_BARRIER):
            self.finished = True
        count = int(self._op(StoreRequest(op="add", keys=[key], amount=value)).count or 0)
        if key.startswith(_EXIT_BARRIER) and count:
            count += self._barrier_offset
        return count

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        request = StoreRequest(
            op="compare_set",
            keys=[key],
            expected=_b64(expected_value),
            desired=_b64(desired_value),
        )
        return _raw(self._op(request).value)

    def delete_key(self, key: str) -> bool:
        return bool(self._op(StoreRequest(op="delete", keys=[key])).found)

    def num_keys(self) -> int:
        return int(self._op(StoreRequest(op="num_keys")).count or 0)


def _local_op(keys: dict[str, str | None], request: StoreRequest) -> StoreReply:
    """``request`` against keys held in this process, as the coordinator answers it
    (values base64; ``add`` counts in decimal text, as torch's stores do)."""
    if request.op == "set":
        keys.update(zip(request.keys, request.values or [], strict=True))
        return StoreReply()
    if request.op == "get":
        return StoreReply(values=[keys.get(k) for k in request.keys])
    if request.op == "check":
        return StoreReply(found=all(k in keys for k in request.keys))
    key = request.keys[0] if request.keys else ""
    if request.op == "add":
        count = int(_raw(keys.get(key)) or b"0") + (request.amount or 0)
        keys[key] = _b64(str(count))
        return StoreReply(count=count)
    if request.op == "compare_set":
        if keys.get(key, _b64(b"")) == request.expected:
            keys[key] = request.desired
        return StoreReply(value=keys.get(key, request.expected))
    if request.op == "delete":
        return StoreReply(found=keys.pop(key, None) is not None)
    return StoreReply(count=len(keys))
