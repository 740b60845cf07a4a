"""Entity-group transactions without thread pools or the email package.

azure-core prepares the sub-requests of a multipart (batch) request in a
``ThreadPoolExecutor`` it creates for each batch, again for the changeset inside it,
and once more to read the sub-responses: a dozen threads started and joined per
transaction, for a few header policies per sub-request. In the coordinator, where a
join writes a two-operation transaction and heartbeats are written in batches of 100,
starting those threads was the largest cost of a 1,024-node rendezvous on Azurite (a
third of the process's samples). :func:`install` makes azure-core do the same work in
order, in the calling thread: what each policy does to each sub-request and
sub-response is unchanged, only not in parallel.

azure-core also writes the multipart body with :mod:`email`'s generator and reads the
reply with its parser, which took a quarter of the coordinator's CPU while it wrote
1,024 heartbeats a second (ten 100-operation transactions). :func:`install` swaps in a
plain writer of the same bytes and a plain reader of the parts: each sub-request is
still serialized, and each sub-response still parsed, by azure-core.

What is replaced is private to azure-core, so :func:`install` replaces it only on the
releases in :data:`TESTED_AZURE_CORE` (``scripts/test-oldest-azure`` runs the storage
suites on the oldest, the main environment on the newest). On any other release it
logs once and leaves azure-core's own path: slower, never wrong.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import threading
import uuid
from typing import Any

from azure.core.pipeline import Pipeline, PipelineContext, PipelineRequest, PipelineResponse

__all__ = ["TESTED_AZURE_CORE", "install", "installed", "tested", "uninstall"]

#: The azure-core releases the in-order path was tested on: from the first up to, not
#: including, the second. pyproject's service extra bounds azure-core the same way.
TESTED_AZURE_CORE = ((1, 29, 4), (1, 42))

log = logging.getLogger("rallypoint.storage")

# The modules that bound azure-core's helpers by name (sync requests and responses).
_PARTS_USERS = ("azure.core.rest._http_response_impl", "azure.core.pipeline.transport._base")
_BODY_USERS = ("azure.core.rest._helpers", "azure.core.pipeline.transport._base")

# (owner, attribute) -> azure-core's own value, while ours is installed.
_saved: dict[tuple[Any, str], Any] = {}
_lock = threading.Lock()
_refused = False  # logged once


def _prepare_in_order(request: Any) -> None:
    info = request.multipart_mixed_info
    if not info:
        return
    requests, policies, options = info[0], info[1], info[3]
    for sub in requests:
        if sub.multipart_mixed_info:
            _prepare_in_order(sub)  # the changeset's own sub-requests
        pipeline_request = PipelineRequest(sub, PipelineContext(None, **options))
        for policy in policies:
            policy.on_request(pipeline_request)  # sync pipeline: plain calls


def _parts_in_order(response: Any) -> Any:
    if not response.content_type or not response.content_type.startswith("multipart/mixed"):
        raise ValueError("You can't get parts if the response is not multipart/mixed")
    responses = response._get_raw_parts()
    if response.request.multipart_mixed_info:
        policies = response.request.multipart_mixed_info[1]
        for part in responses:
            context = PipelineContext(None)
            pipeline_request = PipelineRequest(part.request, context)
            pipeline_response = PipelineResponse(part.request, part, context=context)
            for policy in policies:
                policy.on_response(pipeline_request, pipeline_response)
    return responses


def _multipart_body(http_request: Any, content_index: int = 0) -> int:
    """azure-core's ``_prepare_multipart_body_helper``, without :mod:`email`: the same
    bytes (a test compares them) for the same parts."""
    info = http_request.multipart_mixed_info
    if not info:
        return 0
    requests, boundary = info[0], info[2] or f"batch_{uuid.uuid4()}"
    delimiter = b"--" + boundary.encode("ascii")
    chunks = []
    for req in requests:
        if req.multipart_mixed_info:
            content_index = req.prepare_multipart_body(content_index=content_index)
            head = b"Content-Type: " + req.headers["Content-Type"].encode("ascii") + b"\r\n"
            payload = req.serialize()
            payload = payload[payload.index(b"--") :]  # its body, without request line
        else:
            head = (
                b"Content-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n"
                b"Content-ID: %d\r\n" % content_index
            )
            payload = req.serialize()
            content_index += 1
        chunks += [delimiter, b"\r\n", head, b"\r\n", payload, b"\r\n"]
    chunks += [delimiter, b"--\r\n"]
    http_request.set_bytes_body(b"".join(chunks))
    http_request.headers["Content-Type"] = "multipart/mixed; boundary=" + boundary
    return content_index


def _boundary(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            return value.strip('"').encode("ascii")
    raise ValueError(f"multipart content type without a boundary: {content_type!r}")


class _Part:
    """The little of :class:`email.message.Message` that azure-core's
    ``_decode_parts_helper`` reads: a part's content type and its payload (bytes, or
    the parts of a nested changeset)."""

    def __init__(self, content_type: str, payload: bytes) -> None:
        self._type = content_type
        self._payload = payload

    def get_content_type(self) -> str:
        return self._type.split(";")[0].strip().lower()

    def get_payload(self, decode: bool = False) -> Any:
        if self.get_content_type() == "multipart/mixed":
            return _split(self._payload, _boundary(self._type))
        return self._payload


def _split(body: bytes, boundary: bytes) -> list[_Part]:
    """The parts of a multipart body (RFC 2046: the line break before a delimiter
    belongs to it; lines end in CRLF, or LF from a lenient server)."""
    parts = []
    for chunk in body.split(b"--" + boundary)[1:]:
        if chunk.startswith(b"--"):
            break  # the close delimiter
        chunk = chunk.partition(b"\n")[2]  # the rest of the delimiter's line
        if chunk.endswith(b"\r\n"):
            chunk = chunk[:-2]
        elif chunk.endswith(b"\n"):
            chunk = chunk[:-1]
        content_type = "text/plain"
        while chunk:
            line, _, chunk = chunk.partition(b"\n")
            line = line.rstrip(b"\r")
            if not line:
                break  # the blank line before the payload
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-type":
                content_type = value.strip()
        parts.append(_Part(content_type, chunk))
    return parts


def _raw_parts(response: Any, http_response_type: Any) -> Any:
    """azure-core's ``_get_raw_parts_helper``, splitting the body without :mod:`email`."""
    message = _Part(response.content_type, response.body())
    requests = response.request.multipart_mixed_info[0]
    return response._decode_parts(message, http_response_type, requests)


def _azure_core_version() -> str:
    try:
        return importlib.metadata.version("azure-core")
    except importlib.metadata.PackageNotFoundError:  # vendored, without its metadata
        return "of unknown release"


def tested(version: str | None = None) -> bool:
    """Whether ``version`` (by default the installed azure-core's) is in
    :data:`TESTED_AZURE_CORE`; a pre-release counts as its release."""
    if version is None:
        version = _azure_core_version()
    found = re.match(r"\d+(?:\.\d+)*", version)
    if found is None:
        return False
    release = tuple(int(n) for n in found.group().split("."))
    low, high = TESTED_AZURE_CORE
    return low <= release < high


def _targets() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every part of azure-core replaced."""
    targets: list[tuple[Any, str, Any]] = [
        (Pipeline, "_prepare_multipart_mixed_request", staticmethod(_prepare_in_order))
    ]
    swaps = (
        (_PARTS_USERS, "_parts_helper", _parts_in_order),
        (_PARTS_USERS, "_get_raw_parts_helper", _raw_parts),
        (_BODY_USERS, "_prepare_multipart_body_helper", _multipart_body),
    )
    for modules, name, replacement in swaps:
        for module_name in modules:
            targets.append((importlib.import_module(module_name), name, replacement))
    return targets


def install() -> bool:
    """Makes azure-core handle batch sub-requests and sub-responses in order, if its
    release is one :func:`tested` (idempotent).

    Returns:
        Whether the in-order path is installed; if it is not, a warning said why, once.
    """
    global _refused
    with _lock:
        if _saved:
            return True
        version = _azure_core_version()
        targets = _targets() if tested(version) else []
        missing = [
            f"{owner.__name__}.{name}" for owner, name, _ in targets if name not in vars(owner)
        ]
        if targets and not missing:
            for owner, name, replacement in targets:
                _saved[owner, name] = vars(owner)[name]
                setattr(owner, name, replacement)
            return True
        if not _refused:
            _refused = True
            low, high = (".".join(map(str, release)) for release in TESTED_AZURE_CORE)
            log.warning(
                "azure-core %s is not a release the batch path was tested on (>=%s,<%s)%s: "
                "table transactions take azure-core's own, slower path",
                version,
                low,
                high,
                f", it lacks {', '.join(missing)}" if missing else "",
            )
        return False


def installed() -> bool:
    """Whether :func:`install` replaced azure-core's batch path."""
    return bool(_saved)


def uninstall() -> None:
    """Puts azure-core's own batch path back (benchmarks and tests)."""
    with _lock:
        for (owner, name), original in _saved.items():
            setattr(owner, name, original)
        _saved.clear()
