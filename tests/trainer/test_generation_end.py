"""How a worker leaves an ended gloo generation: the ranks agree at a
:meth:`Generation.check` and leave at the same step, and each then shuts its gloo
connections, both ends, and no other connection.

A rank that left at its own next step once it saw the end could leave a peer inside
that step's all-reduce, waiting the group's timeout (bench/gloo_end.py --seed 2: 5 of 150
rounds before, 0 of 150 agreed)."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from rallypoint.cli.processes import free_port
from rallypoint.trainer._regroup import _shut_gloo


def connection(stack: ExitStack, *, timed: bool) -> tuple[socket.socket, socket.socket]:
    """A loopback connection's two ends (connected, accepted); ``timed``: both ends get
    the kernel timeouts gloo sets on its pairs' sockets."""
    listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
    client = stack.enter_context(socket.create_connection(listener.getsockname()))
    accepted = stack.enter_context(listener.accept()[0])
    if timed:
        for sock in (client, accepted):
            for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", 60, 0))
    return client, accepted


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_both_ends_of_gloo_connections_are_shut_and_no_other(stack: ExitStack) -> None:
    gloo = [connection(stack, timed=True) for _ in range(2)]
    other = connection(stack, timed=False)  # the store's, or an HTTP client's

    assert _shut_gloo() == 4

    for a, b in gloo:  # each end reads the end of the stream: gloo's wait would fail
        for sock in (a, b):
            sock.settimeout(1)
            assert sock.recv(1) == b""
    client, accepted = other
    client.sendall(b"x")
    accepted.settimeout(1)
    assert accepted.recv(1) == b"x"
    assert _shut_gloo() == 0  # the shut ones are no longer connected; the other stays
    client.sendall(b"y")
    assert accepted.recv(1) == b"y"


# Two ranks on gloo: rank 0 sees the end before its second check, rank 1 only later
# (its board, 0.3 s after). Both must leave at the same step, rank 1 once its own end
# came; each prints the step it left at and whether its end was set by then.
RANK = r"""
import json, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from rallypoint.client.models import Assignment
from rallypoint.trainer import Generation, GenerationEnded
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=timedelta(seconds=30))
assignment = Assignment(job_id="j", node_id=f"n{rank}", generation=1, rank=rank,
                        world_size=2, master_addr="127.0.0.1", master_port=port)
ended = threading.Event()
generation = Generation(assignment, rank, 2, 0, False, ended, detect=10.0, agree=True)
step = 0
try:
    while True:
        step += 1
        total = torch.ones(1)
        dist.all_reduce(total)  # the step's collective
        if rank == 0 and step == 2:
            ended.set()
        if rank == 1 and step == 2:
            threading.Timer(0.3, ended.set).start()
        generation.check()
        if step > 50:
            break
except GenerationEnded:
    pass
print(json.dumps({"rank": rank, "left_at": step, "ended": ended.is_set()}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_ranks_leave_an_ended_generation_at_the_same_step(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    lines = [json.loads(p.communicate(timeout=100)[0].splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert lines == [
        {"rank": 0, "left_at": 2, "ended": True},
        {"rank": 1, "left_at": 2, "ended": True},  # agreed, and waited for its own end
    ]
