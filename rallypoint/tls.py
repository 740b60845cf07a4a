"""One TLS context for every HTTP client the package makes.

httpx builds a new ``ssl.SSLContext`` for each ``httpx.Client`` it is not handed one,
loading the CA bundle each time: 32-35 ms of CPU here, the whole of a client's cost
(2.6 ms with a context handed in). The package makes short-lived clients on paths
where that time counts: a worker's fault report after a failed collective, and the
preemption watcher each generation of a worker that regroups in place starts just
before its first step. Shared by the client and the trainer, so it lives at the root.
"""

from __future__ import annotations

import functools
import ssl

import httpx

__all__ = ["ssl_context"]


@functools.cache
def ssl_context() -> ssl.SSLContext | bool:
    """The context httpx would build by default (its CA bundle, ``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` as set when first asked), built once. ``True`` (httpx builds its
    own) with an httpx that does not offer ``create_ssl_context``."""
    create = getattr(httpx, "create_ssl_context", None)
    return create() if create is not None else True
