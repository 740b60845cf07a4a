"""Scoped tokens: the rules (over both backends, with injected clocks), then a real
coordinator pair, the CLI and the status page."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import pytest

from rallypoint.client import ElasticClient, Forbidden, JobSpec, Unauthorized, UnknownToken
from rallypoint.service._tokens import ADMIN, FRESH, PARTITION, Principal, Tokens
from rallypoint.service.errors import UnknownToken as NoSuchToken
from rallypoint.service.storage import Storage

from ..conftest import Clock, Spawn, Start


class Monotonic:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def as_request(tokens: Tokens, token: str | None) -> Principal | None:
    """Who ``token`` makes a request, as the route's dependency awaits it."""
    return asyncio.run(tokens.principal(token))


@pytest.fixture
def tokens(storage: Storage, clock: Clock) -> tuple[Tokens, Monotonic]:
    ticks = Monotonic()
    return Tokens(storage.table("jobs"), "admin-secret", clock, ticks), ticks


def test_a_scoped_token_is_its_job_and_role(tokens: tuple[Tokens, Monotonic]) -> None:
    t, _ = tokens
    reader, secret = t.create("j1", "reader", name="grafana")
    assert (reader.job_id, reader.role, reader.name) == ("j1", "reader", "grafana")
    principal = as_request(t, secret)
    assert principal == Principal("reader", "j1", reader.token_id)
    assert principal.may("read", "j1")
    assert not principal.may("act", "j1")
    assert not principal.may("read", "j2")
    assert not principal.may("admin", None)
    _, trainer_secret = t.create("j1", "trainer")
    trainer = as_request(t, trainer_secret)
    assert trainer is not None
    assert trainer.may("act", "j1") and trainer.may("read", "j1")
    assert not trainer.may("act", "j2") and not trainer.may("admin", None)
    assert as_request(t, "admin-secret") == ADMIN


def test_storage_keeps_a_hash_not_the_token(
    tokens: tuple[Tokens, Monotonic], storage: Storage
) -> None:
    t, _ = tokens
    info, secret = t.create("j1", "trainer")
    row = storage.table("jobs").get(PARTITION, info.token_id)
    assert secret not in json.dumps({k: str(v) for k, v in row.data.items()})
    assert t.list("j1") == [info]
    assert t.list("j2") == []


def test_unknown_forged_and_absent_tokens_are_nobody(tokens: tuple[Tokens, Monotonic]) -> None:
    t, _ = tokens
    _, secret = t.create("j1", "trainer")
    forged = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    for token in (None, "", "admin-secre", forged, "rpt_000000000000_x", "rpt_zz_y", "Bearer x"):
        assert as_request(t, token) is None, token


def test_an_expired_token_is_refused(tokens: tuple[Tokens, Monotonic], clock: Clock) -> None:
    t, _ = tokens
    _, secret = t.create("j1", "reader", expires_in=60)
    assert as_request(t, secret) is not None
    clock.advance(59.9)
    assert as_request(t, secret) is not None
    clock.advance(0.1)
    assert as_request(t, secret) is None


def test_a_revocation_holds_on_another_replica_once_its_read_is_stale(
    tokens: tuple[Tokens, Monotonic], storage: Storage, clock: Clock
) -> None:
    here, ticks = tokens
    there = Tokens(storage.table("jobs"), "admin-secret", clock, ticks)
    info, secret = here.create("j1", "trainer")
    assert as_request(there, secret) is not None  # read and kept for FRESH seconds
    revoked = here.revoke(info.token_id)
    assert revoked.revoked_at == clock.now
    assert as_request(here, secret) is None  # the revoking replica: at once
    ticks.now += FRESH  # the other replica reads again: within a second
    assert as_request(there, secret) is None
    assert here.revoke(info.token_id) == revoked  # again: no change
    with pytest.raises(NoSuchToken):
        here.revoke("0123456789ab")


def test_a_thousand_concurrent_checks_read_storage_once(
    tokens: tuple[Tokens, Monotonic], storage: Storage, clock: Clock
) -> None:
    counted = storage.table("jobs")
    reads = 0
    real_get = counted.get

    def get(partition: str, row: str) -> object:
        nonlocal reads
        if partition == PARTITION:
            reads += 1
        return real_get(partition, row)

    t, _ = tokens
    _, secret = t.create("j1", "trainer")
    fresh = Tokens(counted, "admin-secret", clock, Monotonic())
    counted.get = get  # type: ignore[method-assign]

    async def checks() -> list[Principal | None]:
        return await asyncio.gather(*(fresh.principal(secret) for _ in range(1000)))

    assert all(p is not None and p.job_id == "j1" for p in asyncio.run(checks()))
    assert reads == 1


def test_without_an_admin_token_everyone_is_admin(storage: Storage) -> None:
    open_door = Tokens(storage.table("jobs"), None)
    assert as_request(open_door, None) == ADMIN
    assert as_request(open_door, "anything") == ADMIN


# --- a real coordinator pair ---------------------------------------------------------


def _spec() -> JobSpec:
    return JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0))


def test_scoped_tokens_on_two_replicas(start: Start) -> None:
    a = start("--token", "adm").url
    b = start("--token", "adm").url
    admin = ElasticClient(a, "j1", "ops", "adm")
    reader = admin.create_token("reader", name="dash")
    trainer = admin.create_token("trainer", expires_in=timedelta(hours=1))
    assert trainer.expires_at is not None and trainer.expires_at > trainer.created_at
    assert [t.token_id for t in admin.tokens()] == [reader.token_id, trainer.token_id]

    # The trainer token joins its job and acts for the node it joined as, on either replica.
    node = ElasticClient(b, "j1", "n0", trainer.token)
    assert node.join(spec=_spec()).generation == 1
    assert node.heartbeat().action == "continue"
    with pytest.raises(Forbidden):
        ElasticClient(a, "j2", "n0", trainer.token).join(spec=_spec())
    with pytest.raises(Forbidden):
        ElasticClient(a, "j1", "x", trainer.token).create_token("reader")

    # The reader reads its job, and nothing else.
    look = ElasticClient(a, "j1", "viewer", reader.token)
    assert look.membership().generation == 1
    assert look.checkpoints() == []
    admin_of_j3 = ElasticClient(a, "j3", "ops", "adm")
    admin_of_j3.create_job(1, 1)
    assert {j.job_id for j in admin.jobs()} == {"j1", "j3"}
    assert [j.job_id for j in look.jobs()] == ["j1"]
    with pytest.raises(Forbidden):
        look.join(spec=_spec())
    h = {"Authorization": f"Bearer {reader.token}"}
    refused = httpx.put(f"{a}/v1/jobs/j1", json=_spec().model_dump(mode="json"), headers=h)
    assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
    assert httpx.get(f"{a}/v1/jobs/other", headers=h).status_code == 403
    assert httpx.get(f"{a}/metrics", headers=h).status_code == 403
    assert httpx.get(f"{a}/v1/tokens", headers=h).status_code == 403
    # The operator's routes: not even the job's trainer token.
    t = {"Authorization": f"Bearer {trainer.token}"}
    for method, path in (
        ("PUT", "/v1/jobs/j1/checkpoints/1/quarantine"),
        ("DELETE", "/v1/jobs/j1/checkpoints/1/quarantine"),
        ("DELETE", "/v1/jobs/j1/nodes/n0"),
    ):
        for headers in (h, t):
            refused = httpx.request(method, f"{a}{path}", headers=headers, json={})
            assert (refused.status_code, refused.json()["code"]) == (403, "forbidden"), path
    assert node.heartbeat().action == "continue"  # the node was not removed

    # Revoked on one replica: the other refuses it within a second.
    ElasticClient(b, "j1", "viewer", reader.token).membership()  # b has read it now
    revoked_at = time.monotonic()
    assert admin.revoke_token(reader.token_id).revoked_at is not None
    while True:
        try:
            ElasticClient(b, "j1", "viewer", reader.token).membership()
        except Unauthorized:
            break
        assert time.monotonic() - revoked_at < 1.0, "replica b still takes a revoked token"
    with pytest.raises(UnknownToken):
        admin.revoke_token("0123456789ab")


def test_the_status_page_shows_a_reader_its_job_only(start: Start) -> None:
    url = start("--token", "adm").url
    for job in ("mine", "theirs"):
        ElasticClient(url, job, "ops", "adm").create_job(1, 1)
    reader = ElasticClient(url, "mine", "ops", "adm").create_token("reader")
    h = {"Authorization": f"Bearer {reader.token}"}
    page = httpx.get(f"{url}/", headers=h)
    assert page.status_code == 200
    assert "/jobs/mine" in page.text and "/jobs/theirs" not in page.text
    assert httpx.get(f"{url}/jobs/mine", headers=h).status_code == 200
    assert httpx.get(f"{url}/jobs/theirs", headers=h).status_code == 403
    login = httpx.post(f"{url}/login", data={"token": reader.token})
    assert login.status_code == 303 and "rallypoint_token" in login.headers["set-cookie"]
    assert httpx.post(f"{url}/login", data={"token": "rpt_nope"}).status_code == 401


def test_the_cli_creates_lists_and_revokes(spawn: Spawn) -> None:
    url = spawn("--token", "adm").url

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rallypoint", "token", *args, "--url", url, "--token", "adm"],
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = cli("create", "j9", "--role", "trainer", "--expires", "2h", "--name", "ci")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("rpt_") and "shown only now" in made.stderr
    listed = json.loads(cli("list", "j9", "--json").stdout)
    assert [(t["role"], t["name"], t["revoked_at"]) for t in listed] == [("trainer", "ci", None)]
    assert listed[0]["expires_at"] - listed[0]["created_at"] == pytest.approx(7200)
    assert ElasticClient(url, "j9", "n0", token).create_job(1, 1).job_id == "j9"
    revoked = cli("revoke", listed[0]["token_id"])
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            ElasticClient(url, "j9", "n0", token).membership()
        except Unauthorized:
            break
    else:
        pytest.fail("a revoked token still reads its job after 1 s")
    assert cli("create", "j9", "--role", "admin").returncode == 2  # argparse refuses it
    wrong = subprocess.run(
        [sys.executable, "-m", "rallypoint", "token", "list", "--url", url, "--token", token],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 1 and "unrevoked" in wrong.stderr  # 401, as it was revoked


def test_a_held_heartbeat_needs_a_token_that_covers_its_job(start: Start) -> None:
    url = start("--token", "adm").url
    admin = ElasticClient(url, "hb", "ops", "adm")
    other = ElasticClient(url, "other", "ops", "adm").create_token("trainer")
    node = ElasticClient(url, "hb", "n0", admin.create_token("trainer").token)
    node.join(spec=_spec())
    assert node.credential is not None
    h = {"Authorization": f"Bearer {other.token}", "X-Rallypoint-Credential": node.credential}
    beat = httpx.post(f"{url}/v1/jobs/hb/nodes/n0/heartbeat", json={"generation": 1}, headers=h)
    assert (beat.status_code, beat.json()["code"]) == (403, "forbidden")
    assert node.heartbeat().action == "continue"
