"""The memory tier's costs, each beside its anchor in the same run.

1. blocked: how long ``CheckpointManager.save()`` keeps training waiting when the version
   stays in memory (a memory tier, ``persist_every`` large) against a save that goes to
   blob storage (no memory tier), and how long until each is committed. One process,
   ``--mib`` MiB of float32 tensors, a real coordinator (uvicorn) on local storage.
2. peer copy: MiB/s of a rank's file copied to another node's replica server (another
   process: grant checked, every item's checksum verified, the file kept in its memory
   tier) against a plain socket copy of the same bytes between two processes, written
   to a file in the same folder.

Each figure is the median of ``--repeat`` rounds after one warm-up.

Usage: python bench/tiers.py [--mib 512] [--tensors 32] [--repeat 5] [--smoke]
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from _frameworks import measuring, parsed  # noqa: E402

from rallypoint.client import ElasticClient, JobSpec  # noqa: E402
from rallypoint.trainer import CheckpointManager  # noqa: E402
from rallypoint.trainer._bytes import as_memoryview, checksum  # noqa: E402
from rallypoint.trainer.memory import MEMORY_ENV, push  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

MiB = 1 << 20


def median(f: Callable[[], float], repeat: int) -> float:
    f()  # warm-up
    return statistics.median(f() for _ in range(repeat))


def make_state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    per = mib * MiB // tensors // 4
    return {f"layer{i}.weight": torch.randn(per // 1024, 1024) for i in range(tensors)}


def saves(url: str, shm: Path, mib: int, tensors: int, repeat: int) -> dict[str, float]:
    """Blocked and committed seconds of a memory save and of a blob save."""
    state = make_state(mib, tensors)
    out: dict[str, float] = {}
    for name, memory in (("memory", True), ("blob", False)):
        os.environ[MEMORY_ENV] = str(shm) if memory else "none"
        client = ElasticClient(url, f"blocked-{name}", "n0")
        client.join("127.0.0.1", spec=JobSpec(min_nodes=1, max_nodes=1))
        with client.heartbeats():
            # The first version always goes to storage: save it before timing.
            manager = CheckpointManager(client, progress=False, persist_every=10**6)
            manager.save(state, 0, blocking=True)
            out[f"{name}_blocked"], out[f"{name}_committed"] = timed(manager, state, repeat)
            manager.close()
        client.close()
    return out


def timed(
    manager: CheckpointManager, state: dict[str, torch.Tensor], repeat: int
) -> tuple[float, float]:
    """Median seconds save() blocked, and median seconds to a committed version."""
    step = [0]

    def blocked() -> float:
        step[0] += 1
        handle = manager.save(state, step[0])
        assert handle is not None
        handle.result()
        return handle.blocked

    def committed() -> float:
        step[0] += 1
        started = time.perf_counter()
        handle = manager.save(state, step[0], blocking=True)
        assert handle is not None
        return time.perf_counter() - started

    return median(blocked, repeat), median(committed, repeat)


# The receiving node: an agent's replica server in a process of its own.
SERVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rallypoint.client import ElasticClient, JobSpec
    from rallypoint.trainer.memory import NodeMemory
    from rallypoint.trainer.memory import ReplicaServer
    url, shm = sys.argv[1], Path(sys.argv[2])
    client = ElasticClient(url, "peers", "b")
    box = {}
    server = ReplicaServer(NodeMemory(shm, "peers", "b"), client, "127.0.0.1",
                           lambda: box["a"].generation if box else 0).start()
    box["a"] = client.join("127.0.0.1", spec=JobSpec(min_nodes=2, max_nodes=2),
                           peer=server.url)
    with client.heartbeats():
        print("ready", flush=True)
        sys.stdin.read()
    """
)

# The anchor's receiver: a plain socket into a new file in the same folder, keeping as
# many as the replica server keeps (2), so both take fresh shared memory alike (on a VM,
# memory the guest never touched is slow to take: reusing one file would hide that).
SINK = textwrap.dedent(
    """
    import socket, sys
    from pathlib import Path
    folder = Path(sys.argv[1])
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for i in range(10**9):
        conn, _ = listener.accept()
        size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
        target = folder / f"sink-{i}.bin"
        with open(target, "wb") as f:
            left = size
            while left:
                n = conn.recv_into(view[: min(len(buf), left)])
                if not n:
                    break
                f.write(view[:n])
                left -= n
        (folder / f"sink-{i - 2}.bin").unlink(missing_ok=True)
        conn.sendall(b"k")
        conn.close()
    """
)


def copies(url: str, shm: Path, mib: int, tensors: int, repeat: int) -> dict[str, float]:
    """MiB/s of a peer copy and of a plain socket copy of the same bytes."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # The server's node must be up before the sender's join can seal; a child that
    # cannot start would otherwise leave the sender waiting.
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, url, str(shm / "b")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK, str(shm)], stdout=subprocess.PIPE, text=True
    )
    try:
        client = ElasticClient(url, "peers", "a")
        client.join("127.0.0.1", spec=JobSpec(min_nodes=2, max_nodes=2))
        beats = client.heartbeats().__enter__()
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        state = make_state(mib, tensors)
        parts = [as_memoryview(t.view(-1).view(torch.uint8)) for t in state.values()]
        items, offset = [], 0
        for part in parts:
            items.append((offset, len(part), checksum([part])))
            offset += len(part)
        size = offset
        step = [0]

        def peer() -> float:
            step[0] += 1
            begun = client.begin_checkpoint(
                step[0], ["data.distcp"], rank=0, world_size=2, memory=True
            )
            assert begun.replica is not None
            started = time.perf_counter()
            push(begun.replica, begun.version, "rank-00000/data.distcp", parts, items)
            return size / MiB / (time.perf_counter() - started)

        def plain() -> float:
            started = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(size.to_bytes(8, "big"))
                for part in parts:
                    conn.sendall(part)
                assert conn.recv(1) == b"k"
            return size / MiB / (time.perf_counter() - started)

        out = {"plain": median(plain, repeat), "peer": median(peer, repeat)}
        beats.__exit__(None, None, None)
        client.close()
        return out
    finally:
        for proc in (server, sink):
            proc.kill()
            proc.wait()


def main() -> int:
    parser = measuring(__doc__, mib=512, repeat=5)
    parser.add_argument("--tensors", type=int, default=32)
    args = parsed(parser, {"tensors": 4})
    shm_root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp,
        tempfile.TemporaryDirectory(prefix="bench-tiers-", dir=shm_root) as shm,
    ):
        coordinator = Coordinator(["--storage", f"local:{Path(tmp) / 'storage'}"], {}).start()
        try:
            blocked = saves(
                coordinator.url, Path(shm) / "saves", args.mib, args.tensors, args.repeat
            )
            copied = copies(coordinator.url, Path(shm), args.mib, args.tensors, args.repeat)
        finally:
            coordinator.stop()
    print(f"\n{args.mib} MiB in {args.tensors} float32 tensors, median of {args.repeat}")
    print(f"{'':34} {'memory tier':>12} {'blob only':>12} {'ratio':>7}")
    for what in ("blocked", "committed"):
        m, b = blocked[f"memory_{what}"], blocked[f"blob_{what}"]
        print(f"{'save(): ' + what + ' (s)':34} {m:12.3f} {b:12.3f} {m / b:7.2f}x")
    print(f"\n{'copy to another process (MiB/s)':34} {'peer':>12} {'socket':>12} {'ratio':>7}")
    print(
        f"{'':34} {copied['peer']:12.0f} {copied['plain']:12.0f} "
        f"{copied['peer'] / copied['plain']:7.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
