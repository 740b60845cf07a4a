"""The Azure transport reads the environment once, and only where it can matter."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.service.storage import Health
from rallypoint.service.storage._azure_transport import BudgetTransport

ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "NETRC", "REQUESTS_CA_BUNDLE")


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No proxy, netrc or CA bundle in the environment, and a home without a netrc."""
    for name in (*ENV, "CURL_CA_BUNDLE", *(n.lower() for n in ENV)):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def session_trusts_env(transport: BudgetTransport) -> bool:
    transport.open()
    try:
        return bool(transport.session.trust_env)
    finally:
        transport.close()


def test_without_proxies_requests_does_not_look_at_each_request(bare: pytest.MonkeyPatch) -> None:
    assert not session_trusts_env(BudgetTransport(Health()))


def test_a_ca_bundle_is_passed_once(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    transport = BudgetTransport(Health())
    assert not session_trusts_env(transport)
    assert transport.connection_config.verify == "/etc/ssl/certs/ca-certificates.crt"


@pytest.mark.parametrize("name", ["https_proxy", "HTTPS_PROXY", "NO_PROXY", "NETRC"])
def test_proxies_or_a_netrc_keep_requests_looking(bare: pytest.MonkeyPatch, name: str) -> None:
    bare.setenv(name, "http://proxy.invalid:3128")
    assert session_trusts_env(BudgetTransport(Health()))


def test_a_netrc_file_keeps_requests_looking(bare: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".netrc").write_text("machine example.com login a password b\n")
    assert session_trusts_env(BudgetTransport(Health()))
