"""Every bench runs in the suite: each script's smoke mode (``--smoke``, see
``bench/_smoke.py``: the same code paths at tiny sizes) as a process, failing the test
if it fails, so a bench that breaks is seen the day it breaks, not the day someone next
measures with it. A bench added without a smoke run here fails the suite too. The load
generator's requests are checked against the bytes a real ``ElasticClient`` writes on a
socket."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

from bench import _loadgen
from bench._smoke import AZURITE_ENV
from rallypoint.cli.processes import free_port
from rallypoint.client import ElasticClient, JobSpec
from rallypoint.client.models import Assignment, HeartbeatReply, JoinReply, RankProgress

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CREDENTIAL = "c" * 43  # as long as a coordinator's

#: Each bench's smoke run: the command after the bench's path, and whether it takes the
#: session's Azurite (else it starts none, or, as outage.py, one of its own to freeze).
SMOKES: dict[str, tuple[list[str], bool]] = {
    "checkpoint.py": (["--smoke"], True),
    "cuda.sh": ([], False),  # SMOKE=1: the driver, and cuda_roundtrip.py's smoke through it
    "export.py": (["--smoke"], False),
    "frameworks_hf_deepspeed.py": (["--smoke"], False),
    "frameworks_lightning.py": (["--smoke"], False),
    "gloo_end.py": (["--smoke"], False),
    "hangs.py": (["--smoke"], False),
    "malloc_arenas.py": (["--smoke"], False),
    "outage.py": (["--smoke"], False),
    "recovery.py": (["--smoke"], False),
    "rendezvous.py": (["--smoke"], True),
    "resume_position.py": (["--smoke"], False),
    "storage.py": (["--smoke"], True),
    "tiers.py": (["--smoke"], False),
    "warm_cuda.py": (["--smoke"], False),
    "zero_reshard.py": (["--smoke"], False),
}
#: Benches whose smoke run is another test's.
ELSEWHERE = {
    "cuda_roundtrip.py": "cuda.sh's smoke run here",
    "cuda_state.py": "tests/test_bench_cuda.py",
}


def test_every_bench_has_a_smoke_run() -> None:
    """Each script in bench/ is run here (or named where it is); each helper module of
    theirs (a leading underscore) is imported by one of them, so it runs too."""
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    benches = {name for name in scripts if not name.startswith("_")}
    assert benches == SMOKES.keys() | ELSEWHERE.keys()
    sources = "\n".join((BENCH / name).read_text() for name in benches | scripts)
    for helper in sorted(scripts - benches):
        module = helper.removesuffix(".py")
        used = re.search(rf"^\s*(from|import) (bench\.)?{module}\b", sources, re.MULTILINE)
        assert used or f"{module}.py" in sources, f"no bench uses bench/{helper}"


@pytest.mark.e2e  # each runs the bench as a process, which starts others
@pytest.mark.parametrize("bench", sorted(SMOKES))
def test_the_bench_runs_in_its_smoke_mode(
    bench: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    args, needs_azurite = SMOKES[bench]
    env = {
        **os.environ,
        # The single-process benches' process groups: another run may hold the default.
        "MASTER_PORT": str(free_port()),
        "PYTHONWARNINGS": "ignore",
    }
    if needs_azurite:
        env[AZURITE_ENV] = request.getfixturevalue("azurite")
    if bench.endswith(".sh"):
        env.update({"SMOKE": "1", "PYTHON": sys.executable})
        command = ["bash", str(BENCH / bench), str(tmp_path / "logs"), *args]
    else:
        command = [sys.executable, str(BENCH / bench), *args]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{bench} --smoke exited {done.returncode}:\n{done.stdout[-6000:]}"


@contextmanager
def recording(replies: list[bytes]) -> Iterator[tuple[str, list[tuple[bytes, bytes]]]]:
    """A loopback HTTP/1.1 server on one keep-alive connection that answers each request
    with the next of ``replies`` (JSON) and keeps its head and body as they arrived."""
    seen: list[tuple[bytes, bytes]] = []
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as stream:
            for reply in replies:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    head += stream.readline()
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                seen.append((head, stream.read(length)))
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(reply), reply)
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        thread.join(10)
        server.close()


def test_the_load_generator_writes_the_clients_bytes() -> None:
    """A join, its wait, and heartbeats held and not, and one with its workers' progress,
    as ElasticClient writes them on a socket and as the load generator builds them: the
    same bytes (the join's key aside, a new one per join)."""
    job, node = "job", "n00007"
    spec = JobSpec(min_nodes=2, max_nodes=2, last_call=timedelta(0))
    assignment = Assignment(
        job_id=job,
        node_id=node,
        generation=3,
        rank=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
    )
    replies = [
        JoinReply(status="waiting", round=1, credential=CREDENTIAL),
        JoinReply(status="sealed", round=1, assignment=assignment),
        HeartbeatReply(action="continue", generation=3),
        HeartbeatReply(action="continue", generation=3),
        HeartbeatReply(action="continue", generation=3, hang_limit=3.0),
    ]
    progress = [
        RankProgress(rank=r, step=120, idle=0.05, interval=0.11, own=0.08, process="running")
        for r in range(8)
    ]
    with recording([r.model_dump_json(exclude_none=True).encode() for r in replies]) as (
        url,
        seen,
    ):
        client = ElasticClient(url, job, node)
        client.join("127.0.0.1", 20007, spec=spec)
        client.heartbeat()
        client.heartbeat(timedelta(seconds=1))
        client.heartbeat(timedelta(seconds=1), progress=progress)
        client.close()
    assert len(seen) == 5
    (join_head, join_body), wait, beat, held, reporting = seen

    head, body = _loadgen._join(url, job, node, 20007, spec)
    join_id = json.loads(join_body)["join_id"]
    assert head == join_head
    assert body.replace(json.loads(body)["join_id"].encode(), join_id.encode()) == join_body

    def built(template: _loadgen._Template) -> tuple[bytes, bytes]:
        return template.head_for(node.encode(), CREDENTIAL.encode()), template.body

    assert built(_loadgen._wait(url, job, 1)) == wait
    assert built(_loadgen._heartbeat(url, job, 3, timedelta(0))) == beat
    assert built(_loadgen._heartbeat(url, job, 3, timedelta(seconds=1))) == held
    assert built(_loadgen._heartbeat(url, job, 3, timedelta(seconds=1), progress)) == reporting
