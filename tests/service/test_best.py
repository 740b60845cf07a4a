"""The best version (issue 34): versions carry metrics, a job's ``keep_best`` rule keeps
its best from collection, and ``best`` names the first of them wherever a version is
named. First the rules as specifications (no storage, no clock), then on SQLite and
Azurite, then a coordinator at work: the API, the trainer, export, the CLI and the page.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rallypoint.client import (
    CREDENTIAL_HEADER,
    ElasticClient,
    Forbidden,
    KeepBest,
    UnknownCheckpoint,
)
from rallypoint.service import _retention as rules
from rallypoint.service._checkpoints import Checkpoints, Version
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import UnknownCheckpoint as ServiceUnknownCheckpoint
from rallypoint.trainer import CheckpointManager, SavePolicy, export

from .._rules import commit, seal_with_peers
from .._support import FILE, TOKEN, cli, clients, join_all, managers
from .._support import spec as coordinator_spec
from ..conftest import Start

LOSS = KeepBest(metric="eval_loss", mode="min")


def row(
    number: int,
    loss: float | None = None,
    keep: KeepBest | None = LOSS,
    *,
    state: str = "committed",
    quarantined: bool = False,
    last: int | None = None,
) -> Version:
    return Version(
        "job",
        number,
        1,
        number * 10,
        2,
        state,  # type: ignore[arg-type]
        0.0,
        1.0,
        quarantined_at=1.0 if quarantined else None,
        metrics={} if loss is None else {"eval_loss": loss},
        keep_best=keep,
        keep_last=last,
    )


# --- the rules ---------------------------------------------------------------------------


def test_the_best_is_the_good_version_with_the_lowest_or_highest_metric() -> None:
    rows = [row(1, 0.9), row(2, 0.4), row(3, 0.6), row(4, 0.7)]
    assert [v.version for v in rules.best(rows)] == [2]
    top3 = KeepBest(metric="eval_loss", mode="min", count=3)
    assert [v.version for v in rules.best(rows, top3)] == [2, 3, 4]
    most = KeepBest(metric="eval_loss", mode="max", count=2)
    assert [v.version for v in rules.best(rows, most)] == [1, 4]
    assert rules.places([*rows[:3], row(4, 0.7, top3)]) == {2: 1, 3: 2, 4: 3}


def test_a_tie_goes_to_the_older_version_which_reached_the_value_first() -> None:
    assert [v.version for v in rules.best([row(3, 0.5), row(1, 0.5), row(2, 0.5)])] == [1]


def test_only_good_committed_versions_that_carry_the_metric_are_candidates() -> None:
    rows = [
        row(1, 0.1, quarantined=True),
        row(2, 0.2, state="pending"),
        row(3, 0.3, state="deleting"),
        row(4),  # saved without the metric
        row(5, 0.9),
    ]
    assert [v.version for v in rules.best(rows)] == [5]
    assert rules.best([row(1), row(2)]) == []


def test_the_rule_is_the_newest_committed_versions() -> None:
    accuracy = KeepBest(metric="acc", mode="max")
    assert rules.rule([row(1, keep=LOSS), row(2, keep=accuracy)]) == accuracy
    # A pending version says nothing yet; a job that stopped asking keeps no best.
    assert rules.rule([row(1, keep=LOSS), row(2, keep=accuracy, state="pending")]) == LOSS
    assert rules.rule([row(1, 0.1, keep=LOSS), row(2, 0.5, keep=None)]) is None
    assert rules.best([row(1, 0.1, keep=LOSS), row(2, 0.5, keep=None)]) == []
    assert rules.rule([]) is None


def test_how_many_newest_are_kept_is_the_newest_versions_else_the_coordinators() -> None:
    assert rules.keep_last([row(1, last=2), row(2, last=5)], 3) == 5
    assert rules.keep_last([row(1, last=2), row(2)], 3) == 3
    assert rules.keep_last([row(1, last=2), row(2, last=7, state="pending")], 3) == 2
    assert rules.keep_last([], 3) == 3


# --- on storage --------------------------------------------------------------------------


def commit_scored(
    ckpts: Checkpoints,
    nodes: list[str],
    gen: int,
    step: int,
    creds: dict[str, str],
    metrics: dict[str, float] | None,
    keep: KeepBest | None = LOSS,
    last: int | None = None,
) -> int:
    """A durable version of ``step`` whose rank 0 reported ``metrics`` and ``keep``
    (every rank sends them; the coordinator keeps rank 0's)."""
    return commit(ckpts, nodes, gen, step, creds, metrics=metrics, keep_best=keep, keep_last=last)


def test_the_best_survives_collection_as_the_metric_improves_then_worsens(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds = seal_with_peers(rdzv, nodes)
    losses = [1.0, 0.5, 0.8, 0.9, 0.95, 0.97]
    numbers = [
        commit_scored(ckpts, nodes, gen, 10 * (i + 1), creds, {"eval_loss": x})
        for i, x in enumerate(losses)
    ]
    kept = ckpts.versions("job")
    # keep=3: the newest three, and the best (v2) however old; v1 was collected.
    assert [v.version for v in kept] == [numbers[1], *numbers[3:]]
    assert (kept[0].version, kept[0].best_place, kept[0].metrics) == (
        numbers[1],
        1,
        {"eval_loss": 0.5},
    )
    assert all(v.best_place is None for v in kept[1:])
    best = ckpts.best("job")
    assert best.version == numbers[1] and best.urls and best.best_place == 1
    assert ckpts.get("job").version == numbers[-1]  # the latest is still the newest
    # The manifest carries the metrics, for whoever reads the files alone.
    manifest = ckpts.blobs.get(f"job/v{numbers[1]:010d}/manifest.json")
    assert b'"eval_loss": 0.5' in manifest

    # A quarantined best is no longer best: the next one is, and is kept from then on.
    ckpts.quarantine("job", numbers[1], "eval set leaked")
    assert ckpts.best("job").version == numbers[3]  # 0.9, v3 (0.8) was collected
    commit_scored(ckpts, nodes, gen, 70, creds, {"eval_loss": 0.99})
    commit_scored(ckpts, nodes, gen, 80, creds, {"eval_loss": 0.99})
    assert numbers[3] in [v.version for v in ckpts.versions("job")]


def test_a_job_keeps_as_many_newest_as_its_newest_version_says(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a"]
    gen, creds = seal_with_peers(rdzv, nodes)
    losses = [0.5, 0.9, 0.8, 0.7, 0.6]
    v = [
        commit_scored(ckpts, nodes, gen, 10 * (i + 1), creds, {"eval_loss": x}, last=1)
        for i, x in enumerate(losses)
    ]
    assert [x.version for x in ckpts.versions("job")] == [v[0], v[4]]  # the best, the latest
    # A restart that asks for more keeps more from its next version on.
    more = [
        commit_scored(ckpts, nodes, gen, 60 + i, creds, {"eval_loss": 1.0}, last=4)
        for i in range(4)
    ]
    assert [x.version for x in ckpts.versions("job")] == [v[0], *more]


def test_no_best_until_a_version_carries_the_metric_and_none_once_the_rule_is_dropped(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a"]
    gen, creds = seal_with_peers(rdzv, nodes)
    commit_scored(ckpts, nodes, gen, 10, creds, None)
    with pytest.raises(ServiceUnknownCheckpoint, match="no good version carries 'eval_loss'"):
        ckpts.best("job")
    scored = commit_scored(ckpts, nodes, gen, 20, creds, {"eval_loss": 0.3})
    assert ckpts.best("job").version == scored
    commit_scored(ckpts, nodes, gen, 30, creds, {"eval_loss": 0.1}, keep=None)
    with pytest.raises(ServiceUnknownCheckpoint, match="keeps no best version"):
        ckpts.best("job")


# --- a coordinator at work ---------------------------------------------------------------


@pytest.mark.e2e  # the command runs as a process
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_best_is_named_everywhere_a_version_is(start: Start, tmp_path: Path) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.close()
    m = CheckpointManager(
        m.client, policy=SavePolicy(progress=False, keep_best=("eval_loss", "min"))
    )
    reader = ElasticClient(url, "job", "reader")
    with pytest.raises(UnknownCheckpoint):
        reader.checkpoint("best")  # nothing saved yet
    weights = {}
    for step, loss in ((1, 0.7), (2, 0.2), (3, float("nan")), (4, 0.4), (5, 0.6), (6, 0.8)):
        weights[step] = torch.full((3,), float(step))
        m.save(
            {"w": weights[step]}, step, metrics={"eval_loss": loss, "epoch": step}, blocking=True
        )
    versions = reader.checkpoints()
    by_step = {v.step: v for v in versions}
    assert 1 not in by_step and 3 not in by_step  # collected (keep 3; v3's NaN was left out)
    assert by_step[2].best_place == 1 and by_step[2].metrics == {"eval_loss": 0.2, "epoch": 2.0}

    # The API, the trainer's load and export all resolve "best" to step 2's version.
    best = httpx.get(f"{url}/v1/jobs/job/checkpoints/best", timeout=10).json()
    assert best["step"] == 2 and best["best_place"] == 1
    assert torch.equal(m.load("best").state["w"], weights[2])
    assert torch.equal(m.load("latest").state["w"], weights[6])
    done = export(reader, tmp_path / "best.safetensors", "best", progress=False)
    assert done.step == 2 and torch.equal(load_file(tmp_path / "best.safetensors")["w"], weights[2])
    # A version collected is refused by number, with the reason.
    with pytest.raises(UnknownCheckpoint, match=r"collected|no checkpoint version"):
        export(reader, tmp_path / "gone.safetensors", 1, progress=False)

    # The command marks it, shows the metrics, and exports it by name.
    listed = cli("checkpoints", "job", "--url", url)
    assert listed.returncode == 0, listed.stderr
    line = next(
        r for r in listed.stdout.splitlines() if r.split()[:2] == [str(best["version"]), "2"]
    )
    assert "best" in line and "eval_loss=0.2" in line
    out = tmp_path / "cli.safetensors"
    done_cli = cli("checkpoints", "export", "job", "best", "--out", str(out), "--url", url)
    assert done_cli.returncode == 0, done_cli.stderr
    assert torch.equal(load_file(out)["w"], weights[2])
    page = httpx.get(f"{url}/jobs/job", timeout=10).text
    assert "pointer best" in page and "eval_loss=0.2" in page
    m.close()


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_bad_metrics_are_refused_with_a_code(start: Start) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    client = m.client
    begun = client.begin_checkpoint(1, [FILE])
    body = {
        "node_id": "a",
        "generation": begun.generation,
        "files": [{"name": FILE, "size": 1, "checksum": "x:1"}],
    }
    path = f"{url}/v1/jobs/job/checkpoints/{begun.version}/shards"
    for bad in (
        {"metrics": {"eval_loss": "NaN"}},
        {"metrics": {"bad name!": 1.0}},
        {"keep_best": {"metric": "eval_loss", "mode": "lowest"}},
        {"keep_best": {"metric": "eval_loss", "count": 0}},
    ):
        reply = httpx.post(
            path,
            json={**body, **bad},
            headers={CREDENTIAL_HEADER: client.credential or ""},
            timeout=10,
        )
        assert reply.status_code == 422, (bad, reply.text)
        assert reply.json()["code"] == "invalid_request"
    assert reader_state(url, begun.version) == "pending"
    m.close()


def reader_state(url: str, version: int) -> str:
    state: str = httpx.get(f"{url}/v1/jobs/job/checkpoints/{version}", timeout=10).json()["state"]
    return state


def test_a_policy_takes_keep_best_as_a_tuple_and_refuses_a_bad_one() -> None:
    assert SavePolicy(keep_best=("acc", "max", 2)).best == KeepBest(
        metric="acc", mode="max", count=2
    )
    assert SavePolicy(keep_best=("eval_loss",)).best == LOSS
    for bad in (("acc", "up"), ("acc", "max", 0), "eval_loss", ()):
        with pytest.raises(ValueError, match="keep_best"):
            SavePolicy(keep_best=bad)  # type: ignore[arg-type]
    assert SavePolicy(keep_last=2).keep_last == 2
    for last in (0, 1001, True):
        with pytest.raises(ValueError, match="keep_last"):
            SavePolicy(keep_last=last)


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_reader_token_exports_the_best_version(start: Start, tmp_path: Path) -> None:
    url = start("--token", TOKEN).url
    (node,) = clients(url, ["a"], token=TOKEN)
    join_all([node], coordinator_spec(1, 1))
    m = CheckpointManager(node, progress=False, keep_best=("eval_loss", "min"))
    for step, loss in ((1, 0.3), (2, 0.6)):
        m.save(
            {"w": torch.full((2,), float(step))}, step, metrics={"eval_loss": loss}, blocking=True
        )
    m.close()
    reader = ElasticClient(url, "job", "x", token=node.create_token("reader").token)
    done = export(reader, tmp_path / "r.safetensors", "best", progress=False)
    assert done.step == 1
    assert torch.equal(load_file(tmp_path / "r.safetensors")["w"], torch.full((2,), 1.0))
    with pytest.raises(Forbidden):  # a reader reads; it does not save
        reader.begin_checkpoint(3, [FILE], generation=1)
