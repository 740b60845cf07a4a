"""Several real processes, each its own node of a job, sharing a gloo process group.

Each process joins through ``ElasticClient``, heartbeats, builds its process group from
the assignment (as ``trainer/examples/train_join.py`` does), runs the test's ``run``
function and leaves. Only on 1-process nodes; torchrun's many processes per node are
tested under torchrun itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# Joins before it imports torch (seconds on this machine), so that the processes of one
# call join within the job's last call of each other and form one generation.
_WORKER = r"""
import json, os, sys
from datetime import timedelta
from rallypoint.client import ElasticClient, JobSpec
url, job, node, n, body, out = sys.argv[1:7]
client = ElasticClient(url, job, node)
spec = JobSpec(min_nodes=1, max_nodes=64, last_call=timedelta(seconds=3))
server, box = None, {}
if os.environ.get("RANKS_MEMORY"):  # a memory tier and replica server, as an agent runs
    from pathlib import Path
    from rallypoint.trainer.memory import MEMORY_ENV, NodeMemory
    from rallypoint.trainer.memory import ReplicaServer
    root = Path(os.environ["RANKS_MEMORY"]) / node
    os.environ[MEMORY_ENV] = str(root)
    server = ReplicaServer(NodeMemory(root, job, node), client, "127.0.0.1",
                           lambda: box["a"].generation if box else 0).start()
a = client.join(spec=spec, timeout=timedelta(seconds=60),
                peer=None if server is None else server.url)
box["a"] = a
assert a.world_size == int(n), f"a generation of {a.world_size}, not {n}: joins too far apart"
# Beating from the seal on: importing torch takes seconds, more on a loaded machine, and
# a member silent for the heartbeat timeout would end the generation under the test.
with client.heartbeats():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}",
                            rank=a.rank, world_size=a.world_size)
    scope = {"__name__": "ranks_body", "server": server}
    exec(compile(open(body).read(), body, "exec"), scope)
    try:
        result = scope["run"](client, a)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["rank"] = a.rank
    dist.barrier()
    dist.destroy_process_group()
client.leave("done", fenced=False)
with open(out, "w") as f:
    json.dump(result, f)
"""


def run_ranks(
    url: str,
    job: str,
    nodes: list[str],
    body: str,
    tmp: Path,
    *,
    timeout: float = 180,
    memory: Path | None = None,
) -> list[dict[str, Any]]:
    """Runs ``body`` (Python source defining ``run(client, assignment) -> dict``) in one
    process per node of ``nodes``, which form one generation of exactly that size (the
    job admits 1 to 64 nodes and seals 3 s after the first join).

    With ``memory``, each process gets a memory tier of its own (``memory/NODE``) and a
    replica server, as its agent would give it; ``body`` sees the server as ``server``.

    Returns:
        Each process's dict, ``rank`` added, in rank order.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    source = tmp / f"body-{nodes[0]}.py"
    source.write_text(body)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if memory is not None:
        env["RANKS_MEMORY"] = str(memory)
    n = str(len(nodes))
    procs = []
    for node in nodes:
        out = tmp / f"{node}.json"
        out.unlink(missing_ok=True)
        args = [sys.executable, "-c", _WORKER, url, job, node, n, str(source), str(out)]
        procs.append((subprocess.Popen(args, env=env), out))
    try:
        for proc, _ in procs:
            assert proc.wait(timeout) == 0, f"a rank exited with {proc.returncode}"
    finally:
        for proc, _ in procs:
            proc.kill()
    results = [json.loads(out.read_text()) for _, out in procs]
    return sorted(results, key=lambda r: int(r["rank"]))
