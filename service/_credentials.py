"""Node credentials: what lets a request act for one node's registration.

``join`` gives each registration of a node a credential, which every request that acts
for the node (heartbeat, wait, leave, assignment, store, checkpoint reports) carries in
``X-Rallypoint-Credential``. The bearer token says who may use the API; the credential
says which node the caller is, so a process holding the job's token cannot heartbeat,
leave or report for a node it is not.

A credential is ``HMAC-SHA256(job's node key, job, node, registration)``: unguessable
without the key, the same for a retried join (same registration, so a lost reply costs
nothing), and another for every new registration (a restarted node's old process is
shut out). Storage keeps only a digest of it, on the node's row and in the sealed
generation's member list, so checking a member's heartbeat reads nothing new; the key
lives in the job's partition (see :mod:`._secrets`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from .errors import InvalidCredential

__all__ = ["MAX_LENGTH", "NODE_KEY", "check", "derive", "digest", "new_registration", "same"]

#: The job's row holding the key credentials are derived from.
NODE_KEY = "nodekey"
#: Longer than any credential issued here (43 characters): a longer one is refused unread.
MAX_LENGTH = 128


def _raw(value: str) -> bytes:
    # A header arrives as text decoded from latin-1, so it may hold any byte, and
    # hmac.compare_digest raises TypeError on text with a non-ASCII character.
    return value.encode("utf-8", "surrogatepass")


def same(secret: str, presented: str) -> bool:
    """Whether ``presented`` is ``secret``, in constant time, compared as bytes: whatever
    characters a caller sends, the answer is yes or no, never an error."""
    return hmac.compare_digest(_raw(secret), _raw(presented))


def new_registration() -> str:
    """A registration id: random, so a node's credentials differ between registrations."""
    return secrets.token_hex(8)


def derive(key: bytes, job_id: str, node_id: str, registration: str) -> str:
    """The credential of one registration of a node (URL-safe base64, 43 characters)."""
    message = f"{job_id}\0{node_id}\0{registration}".encode()
    mac = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def digest(credential: str) -> str:
    """What storage keeps of a credential: 128 bits of its SHA-256, base64url."""
    raw = hashlib.sha256(_raw(credential)).digest()[:16]
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def check(expected: str | None, credential: str | None, node_id: str) -> None:
    """Refuses a request for ``node_id`` unless it carries the credential whose digest
    the node's registration (or generation record) holds.

    Raises:
        InvalidCredential: No credential, another node's, one of an earlier registration
            of this node, or none this coordinator could have issued (non-ASCII, longer
            than :data:`MAX_LENGTH`).
    """
    if not credential:
        raise InvalidCredential(
            f"acting for node {node_id!r} needs its credential (X-Rallypoint-Credential, "
            "from its join)"
        )
    issuable = len(credential) <= MAX_LENGTH and credential.isascii()
    if not issuable or expected is None or not same(expected, digest(credential)):
        raise InvalidCredential(
            f"the credential is not that of node {node_id!r}'s current registration"
        )
