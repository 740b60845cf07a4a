"""Node quarantine (issue 35 item 2): an operator keeps a node out of a job, or the
coordinator does for a node lost too often; a quarantined node's joins are refused and
no round seals it until it is cleared. And the operator's command that clears a
version's ``unrecoverable`` mark. The rules first (no storage, no clock), then on SQLite
and Azurite, then a coordinator at work: the API, the client, the CLI, the page and the
metric.
"""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest

from rallypoint.client import ElasticClient, NodeQuarantined
from rallypoint.client.models import QuarantinedNode, RestoreFailure
from rallypoint.service import _seal as seal
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Node, Rendezvous
from rallypoint.service.errors import NodeQuarantined as ServiceNodeQuarantined

from .._rules import end, pointers, register_all, seal_and_save, seal_with_peers, spec
from .._support import TOKEN, cli, clients, join_all
from .._support import spec as coordinator_spec
from ..conftest import Clock, Start

# --- the rules ---------------------------------------------------------------------------


def test_losses_are_counted_within_the_window_and_forgotten_after() -> None:
    recent = {"a": (10.0, 50.0), "b": (5.0,)}
    assert seal.losses(recent, "a", 100.0, 60.0) == {"a": (50.0, 100.0)}
    assert seal.losses(recent, None, 100.0, 200.0) == recent
    assert seal.losses({}, "c", 1.0, 60.0) == {"c": (1.0,)}
    assert seal.lost_too_often((50.0, 100.0), 2)
    assert not seal.lost_too_often((100.0,), 2)
    assert not seal.lost_too_often((1.0, 2.0, 3.0), None)  # the rule is off


def test_a_round_never_seals_a_quarantined_node() -> None:
    nodes = [Node(n, "h", 1, 2, 0.0, "waiting") for n in ("a", "b", "c")]
    mark = QuarantinedNode(node_id="b", at=1.0, reason="bad NIC", by="operator")
    assert [n.node_id for n in seal.admitted(nodes, [mark])] == ["a", "c"]
    assert seal.admitted(nodes, []) == nodes


# --- on storage --------------------------------------------------------------------------


def test_a_quarantined_member_is_taken_out_refused_and_admitted_once_cleared(
    rdzv: Rendezvous, clock: Clock
) -> None:
    gen, _ = seal_with_peers(rdzv, ["a", "b", "c"])
    job = rdzv.quarantine_node("job", "b", "flaky NIC")
    (mark,) = job.quarantined
    assert (mark.node_id, mark.reason, mark.by) == ("b", "flaky NIC", "operator")
    # Its generation ended at once, as for a removal.
    assert job.status == "open"
    assert rdzv.generation("job", gen).ended_reason == "node b quarantined: flaky NIC"
    with pytest.raises(ServiceNodeQuarantined, match="node b is quarantined in job 'job'"):
        rdzv.register("job", "b", "host-b", 29501)
    # The others regroup without it.
    register_all(rdzv, ["a", "c"])
    clock.advance(1.5)  # past the last call, within the heartbeat timeout
    job, _ = rdzv.tick("job")
    assert job.status == "sealed" and rdzv.sealed("job", job.generation).ranks.keys() == {"a", "c"}
    assert [q.node_id for q in rdzv.summary(job).quarantined_nodes] == ["b"]
    # Quarantining again keeps the first mark; clearing admits it again.
    assert rdzv.quarantine_node("job", "b", "again").quarantined == (mark,)
    assert rdzv.unquarantine_node("job", "b").quarantined == ()
    assert rdzv.register("job", "b", "host-b", 29501).round == job.generation + 1


def test_a_node_that_registered_before_its_quarantine_is_not_sealed(
    rdzv: Rendezvous, clock: Clock
) -> None:
    register_all(rdzv, ["a", "b"], spec(1, 8, last_call=1))
    # A machine that never joined may be marked too; one waiting is taken out.
    rdzv.quarantine_node("job", "never-joined", "")
    job = rdzv.quarantine_node("job", "b", "")
    assert {q.node_id for q in job.quarantined} == {"never-joined", "b"}
    clock.advance(2)
    job, _ = rdzv.tick("job")
    assert job.status == "sealed"
    assert list(rdzv.sealed("job", job.generation).ranks) == ["a"]


def test_a_node_lost_too_often_is_quarantined_by_the_coordinator(
    rdzv: Rendezvous, clock: Clock
) -> None:
    strict = Rendezvous(rdzv.table, clock, node_losses=(2, 600.0))
    for loss in (1, 2):
        seal_with_peers(strict, ["a", "b"])
        clock.advance(1)
        strict.record_beats("job", ["a"])
        clock.advance(3)  # b is silent past the 3 s heartbeat timeout
        strict.record_beats("job", ["a"])
        strict.tick("job")
        job = strict.get_job("job")
        assert job.status == "open", loss
    (mark,) = job.quarantined
    assert (mark.node_id, mark.by, mark.reason) == ("b", "losses", "lost 2 times within 600 s")
    assert "b" not in job.losses  # counted afresh once cleared
    with pytest.raises(ServiceNodeQuarantined):
        strict.register("job", "b", "host-b", 29501)
    # The default coordinator counts nothing.
    assert rdzv.node_losses is None


def test_recover_clears_an_unrecoverable_mark_and_the_latest_comes_back(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [5, 10], every=1)
    end(rdzv, gen, ["b"], creds)
    gen2, creds = seal_with_peers(rdzv, nodes)
    failed = RestoreFailure(node_id="a", generation=gen2, rank=1, reason="a peer was down")
    ckpts.unreadable("job", bad, failed, creds["a"])
    assert pointers(rdzv) == (good, good)
    # Its generation is no longer the job's: the version is good again, no pointer moves.
    info = ckpts.recover("job", bad)
    assert not info.unrecoverable and info.unrecoverable_reason is None
    assert pointers(rdzv) == (good, good)
    assert ckpts.recover("job", bad) == info  # idempotent
    # A version that carries both marks is good only once both are cleared.
    ckpts.quarantine("job", bad, "suspect")
    gen3, creds = seal_with_peers(rdzv, nodes)
    ckpts.unreadable("job", good, failed.model_copy(update={"generation": gen3}), creds["a"])
    assert not ckpts.recover("job", good).unrecoverable
    assert ckpts.get("job", bad).quarantined


# --- a coordinator at work ---------------------------------------------------------------


@pytest.mark.e2e  # the command runs as a process
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_the_operator_quarantines_a_node_through_the_api_and_the_command(start: Start) -> None:
    url = start("--token", TOKEN).url
    a, b = clients(url, ["a", "b"], token=TOKEN)
    join_all([a, b], coordinator_spec(2, 2))
    operator = ElasticClient(url, "job", "operator", token=TOKEN)
    done = cli("nodes", "quarantine", "job", "b", "--reason", "ECC errors", "--url", url,
               "--token", TOKEN)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "node b is quarantined in job job" in done.stdout and "ECC errors" in done.stdout
    status = operator.membership()
    assert [(q.node_id, q.by) for q in status.quarantined_nodes] == [("b", "operator")]
    assert status.history[-1].ended_reason == "node b quarantined: ECC errors"
    # b's join is refused with the code; the reason names the command that clears it.
    with pytest.raises(NodeQuarantined, match="rallypoint nodes unquarantine job b"):
        ElasticClient(url, "job", "b", token=TOKEN).join(
            "127.0.0.1", 30009, timeout=timedelta(seconds=5)
        )
    shown = cli("status", "job", "--url", url, "--token", TOKEN)
    assert "quarantined (not admitted)" in shown.stdout and "ECC errors" in shown.stdout
    page = httpx.get(f"{url}/jobs/job", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert "quarantined-nodes" in page.text and "ECC errors" in page.text
    metrics = httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ).text
    assert 'rallypoint_nodes_quarantined{job="job"} 1.0' in metrics
    # Only the admin token may; a reader may not.
    reader = operator.create_token("reader").token
    reply = httpx.put(
        f"{url}/v1/jobs/job/nodes/a/quarantine",
        headers={"Authorization": f"Bearer {reader}"},
        json={"reason": "x"},
        timeout=10,
    )
    assert reply.status_code == 403 and reply.json()["code"] == "forbidden"
    assert operator.unquarantine_node("b") == []
    done = cli("nodes", "unquarantine", "job", "b", "--url", url, "--token", TOKEN)
    assert done.returncode == 0 and "node b is admitted in job job" in done.stdout
