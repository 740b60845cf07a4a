"""The package's one TLS context: built once, and verifying as httpx's own default does
(certificates required, host names checked), so sharing it never turns checks off."""

from __future__ import annotations

import ssl

from rallypoint.tls import ssl_context


def test_one_context_that_verifies_certificates_and_host_names() -> None:
    context = ssl_context()
    assert isinstance(context, ssl.SSLContext)
    assert ssl_context() is context
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # a CA bundle is loaded
