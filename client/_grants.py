"""Peer grants: the coordinator's signed permission to move one version's files between
two nodes' memory tiers, checked by the receiving node's replica server.

The bytes go between nodes, never through the coordinator; the coordinator decides who
may touch what, as it does with storage URLs. A grant names the job, the generation it
was issued in, the node (and that node's replica server, so a restarted agent, with a
new URL, refuses grants made for the one before it), the version, the operation, and
for writes the global ranks; it expires with the version's upload URLs.

Ed25519 rather than an HMAC: the replica servers verify with the job's public key, so a
node that can check grants cannot make them.

Format: ``base64url(JSON claims) "." base64url(signature)``.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from .errors import SignedUrlError

__all__ = ["GrantClaims", "new_signing_key", "public_key", "sign_grant", "verify_grant"]

#: The longest token accepted: a write grant names ranks, at most a node's worth.
MAX_TOKEN = 4096


@dataclass(frozen=True)
class GrantClaims:
    """What a grant allows."""

    job: str
    #: The generation the grant was issued in.
    gen: int
    #: The node whose replica server it is for, and that server's URL.
    node: str
    peer: str
    version: int
    op: Literal["read", "write"]
    #: Expiry, epoch seconds.
    exp: float
    #: For writes: the global ranks whose files may be written.
    ranks: list[int] = field(default_factory=list)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_signing_key() -> bytes:
    """A fresh Ed25519 private key (its 32 raw bytes)."""
    return secrets.token_bytes(32)


def public_key(private: bytes) -> str:
    """The base64url public key of a private key from :func:`new_signing_key`."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.from_private_bytes(private).public_key()
    return _b64(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def sign_grant(private: bytes, claims: GrantClaims) -> str:
    """The token for ``claims``, signed with ``private``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    body = json.dumps(asdict(claims), separators=(",", ":"), sort_keys=True).encode()
    signature = Ed25519PrivateKey.from_private_bytes(private).sign(body)
    return f"{_b64(body)}.{_b64(signature)}"


def verify_grant(public: str, token: str, *, now: float | None = None) -> GrantClaims:
    """The claims of ``token`` if the key behind ``public`` signed it and it has not
    expired.

    Raises:
        SignedUrlError: The token is malformed, altered, signed by another key, or
            expired. The caller still checks that the claims cover the request.
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(token) > MAX_TOKEN or token.count(".") != 1:
        raise SignedUrlError("malformed peer grant")
    body_text, signature_text = token.split(".")
    try:
        body, signature = _unb64(body_text), _unb64(signature_text)
        Ed25519PublicKey.from_public_bytes(_unb64(public)).verify(signature, body)
    except (InvalidSignature, ValueError) as exc:
        raise SignedUrlError("peer grant fails its signature") from exc
    try:
        claims = GrantClaims(**json.loads(body))
    except (TypeError, ValueError) as exc:
        raise SignedUrlError(f"peer grant holds unknown claims: {exc}") from exc
    if claims.exp < (time.time() if now is None else now):
        raise SignedUrlError("peer grant expired")
    return claims
