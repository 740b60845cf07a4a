"""Quiet survivors: a node SIGKILL ends the generation, and each surviving node says so in
one line, with no traceback from the workers whose collectives failed with it; a real
error in the training script keeps its traceback. Real torchrun agents (``rallypoint
run``, with warm workers and with torchrun's own), CPU, gloo."""

from __future__ import annotations

import contextlib
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from rallypoint.cli.processes import Cluster, Coordinator

from .._support import IMAGE_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENDED = re.compile(r"^rallypoint: generation (\d+) ended: (.+); restarting workers$", re.M)


@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-workers", "torchrun-workers"])
def test_a_node_loss_costs_each_survivor_one_line_and_no_traceback(
    coordinator: Coordinator, tmp_path: Path, warm: str
) -> None:
    cluster = Cluster(
        coordinator.url, "quiet", tmp_path, nnodes="2:3", steps=400, image_size=IMAGE_SIZE
    )
    try:
        cluster.start("a", "b", "c", env={"RALLYPOINT_WARM_START": warm})
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 15)
        cluster.kill("c")
        # The survivors restarted and trained on in a world of two.
        cluster.wait_for(lambda e: e["event"] == "resumed" and e["world_size"] == 2)
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == 2)
        logs = {n: cluster.agents[n].log.read_text(errors="replace") for n in ("a", "b")}
    finally:
        cluster.stop()
    for node, log in logs.items():
        said = ENDED.findall(log)
        assert [g for g, _ in said] == ["1"], f"node {node}:\n{log}"
        assert said[0][1].startswith("node c "), said  # the coordinator's reason
        assert "Traceback" not in log, f"node {node}:\n{log}"
        assert "failed (exitcode" not in log, f"node {node}:\n{log}"  # no failure counted
        assert "checkpoint of step" not in log, f"node {node}:\n{log}"


BUGGY = textwrap.dedent(
    """
    import torch.distributed as dist

    from rallypoint.client import ElasticClient
    from rallypoint.trainer import CheckpointManager

    client = ElasticClient.from_env()
    client.join()
    dist.init_process_group("gloo")
    CheckpointManager(client, progress=False)
    dist.barrier()
    raise ValueError("a bug in the training script")
    """
)


@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-workers", "torchrun-workers"])
def test_a_real_error_keeps_its_traceback(
    coordinator: Coordinator, tmp_path: Path, warm: str
) -> None:
    script = tmp_path / "buggy.py"
    script.write_text(BUGGY)
    cluster = Cluster(coordinator.url, "buggy", tmp_path, nnodes="1:1", script=[str(script)])
    agent = cluster.add("a", env={"RALLYPOINT_WARM_START": warm})
    log = ""
    deadline = time.monotonic() + 180
    try:
        # torchrun restarts the worker again and again: its first failure is enough.
        while time.monotonic() < deadline:
            log = agent.log.read_text(errors="replace")
            if "ValueError: a bug" in log or agent.proc.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(timeout=0.2)
        log = agent.log.read_text(errors="replace")
    finally:
        cluster.stop()
    assert "ValueError: a bug in the training script" in log, log
    assert "Traceback" in log, log
    assert not ENDED.search(log), log
