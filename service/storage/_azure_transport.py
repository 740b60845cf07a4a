"""The Azure clients' HTTP transport with the coordinator's budget (see ``_budget``).

azure-core lets a client take its transport (``transport=``), and every try of every
operation, retries included, goes through its ``send``: the one place to clamp a try's
timeouts to the caller's deadline, to refuse a try while storage is known to be down, and
to record whether storage answered. The SDK's own retry policy still decides what is
retried; the clients are built with a small retry budget (:data:`RETRIES`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from azure.core.exceptions import (
    ServiceRequestError,
    ServiceRequestTimeoutError,
    ServiceResponseError,
)
from azure.core.pipeline.transport import RequestsTransport

from ._budget import Health, remaining, try_limit

__all__ = ["RETRIES", "BudgetTransport", "blob_options", "table_options"]

#: Retries after a failed try: a few, with backoffs under a second, since the caller
#: (a node's client, the driver's next pass) retries on its own schedule anyway.
RETRIES = 2
#: Seconds to open a connection; a reachable account answers in milliseconds.
CONNECT_TIMEOUT = 2.0
#: Seconds without a byte from an open connection (the coordinator moves small objects).
READ_TIMEOUT = 10.0


def _environment() -> dict[str, Any]:
    """The transport's settings from the environment, read once.

    requests looks into the environment on every request (proxies, a netrc file, a CA
    bundle): 5-8% of the coordinator's CPU in a round of a thousand joins
    (docs/SCALE.md), for what is the same each time. A CA bundle is passed once instead;
    with proxies or a netrc file, requests keeps looking, as it would anyway.
    """
    names = {name.lower() for name in os.environ}
    home = Path.home()
    if names & {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "netrc"} or any(
        (home / name).exists() for name in (".netrc", "_netrc")
    ):
        return {}
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    return {"use_env_settings": False, **({"connection_verify": bundle} if bundle else {})}


class BudgetTransport(RequestsTransport):  # type: ignore[misc]  # Any: requests is untyped
    """A :class:`RequestsTransport` whose tries respect the caller's deadline and the
    process's storage :class:`Health`."""

    def __init__(self, health: Health, **kwargs: Any) -> None:
        super().__init__(**{**_environment(), **kwargs})
        self.health = health

    def send(self, request: Any, **kwargs: Any) -> Any:
        left = remaining()
        if left is not None and left <= 0:
            raise ServiceRequestTimeoutError("storage deadline passed before the try")
        if not self.health.admit():
            raise ServiceRequestError(
                f"storage has not answered for {self.health.down_for():.1f} s (not retried "
                "until a probe gets through)"
            )
        limit = try_limit()
        if limit is not None:
            left = limit if left is None else min(left, limit)
        for name, cap in (("connection_timeout", CONNECT_TIMEOUT), ("read_timeout", READ_TIMEOUT)):
            value = kwargs.get(name, cap)
            kwargs[name] = value if left is None else max(0.05, min(value, left))
        try:
            response = super().send(request, **kwargs)
        except (ServiceRequestError, ServiceResponseError):
            self.health.record(False)
            raise
        # A 5xx is an answer from a struggling service, not silence: the SDK retries it.
        self.health.record(True)
        return response


def table_options(health: Health) -> dict[str, Any]:
    """Keyword arguments for a ``TableServiceClient``: the transport, and a retry budget
    in place of the SDK's (10 retries, backoffs up to 120 s): backoffs of 0.2 and 0.4 s."""
    return {
        "transport": BudgetTransport(
            health, connection_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT
        ),
        "retry_total": RETRIES,
        "retry_backoff_factor": 0.2,
        "retry_backoff_max": 1.0,
    }


def blob_options(health: Health) -> dict[str, Any]:
    """Keyword arguments for a ``BlobServiceClient``: the transport (its own: closing a
    client closes its transport), and a retry budget in place of the SDK's (3 retries,
    15, 18 and 24 s apart): at once, then after a second."""
    from azure.storage.blob import ExponentialRetry

    return {
        "transport": BudgetTransport(
            health, connection_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT
        ),
        "retry_policy": ExponentialRetry(
            initial_backoff=0, increment_base=1, retry_total=RETRIES, random_jitter_range=0
        ),
    }
