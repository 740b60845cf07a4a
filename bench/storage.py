"""Storage adapters side by side with their raw baselines, in one run.

For the local adapter and for Azure (on a real Azurite started here), prints table
inserts/s and compare-and-swap updates/s, and blob put/get MiB/s for one object,
each next to the same work done without Rallypoint:

- local table:  plain sqlite3, one transaction per write, same pragmas (WAL, FULL)
- local blobs:  dd with conv=fdatasync (write) and dd to /dev/null (read)
- Azure table:  azure-data-tables used directly
- Azure blobs:  azure-storage-blob used directly (same block size and concurrency)
- Azure table transactions: the adapter with its in-order batch path
  (``service/storage/_azure_batch.py``) and with azure-core's own, switched per round;
  wall-clock transactions/s and this process's CPU per transaction (Azurite's is not
  counted: on Azure it is not the coordinator's)

Usage: python bench/storage.py [--ops 2000] [--mib 256] [--repeat 5]
                               [--parts local,azure,batch] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from azure.core import MatchConditions
from azure.data.tables import TableServiceClient, UpdateMode
from azure.storage.blob import BlobServiceClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package

from bench._smoke import azurite, parse  # noqa: E402
from rallypoint.service.storage import (  # noqa: E402
    AzureStorage,
    BatchOp,
    BlobStore,
    Entity,
    LocalStorage,
    Storage,
    Table,
    _azure_batch,
    use_batch_path,
)
from rallypoint.service.storage._azure_blob import PARALLEL_TRANSFERS  # noqa: E402

MiB = 1 << 20


def median_rates(
    ours: Callable[[], float], theirs: Callable[[], float], repeat: int
) -> tuple[float, float]:
    """Median units/s of each; rounds alternate so neither gets a warmer cache or disk.

    One untimed round of each comes first: the first writes of a fresh file system
    area varied 3x here, whichever code made them.
    """
    ours()
    theirs()
    rates: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for work, out in ((ours, rates[0]), (theirs, rates[1])):
            start = time.perf_counter()
            units = work()
            out.append(units / (time.perf_counter() - start))
    return statistics.median(rates[0]), statistics.median(rates[1])


# --- tables -----------------------------------------------------------------------------


def adapter_inserts(table: Table, ops: int) -> Callable[[], float]:
    def work() -> float:
        part = uuid.uuid4().hex
        for i in range(ops):
            table.insert(Entity(part, f"r{i:06d}", {"state": "alive", "beat": i}))
        return ops

    return work


def adapter_cas(table: Table, ops: int) -> Callable[[], float]:
    def work() -> float:
        current = table.insert(Entity(uuid.uuid4().hex, "job", {"generation": 0}))
        for i in range(ops):
            current = table.replace(
                Entity(current.partition_key, "job", {"generation": i + 1}),
                if_match=current.etag or "",
            )
        return ops

    return work


def sqlite_baseline(path: Path, ops: int) -> tuple[Callable[[], float], Callable[[], float]]:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS t (pk TEXT, rk TEXT, etag TEXT, data TEXT, "
        "PRIMARY KEY (pk, rk)) WITHOUT ROWID"
    )

    def inserts() -> float:
        part = uuid.uuid4().hex
        for i in range(ops):
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT INTO t VALUES (?,?,?,?)",
                (part, f"r{i:06d}", uuid.uuid4().hex, f'{{"state":"alive","beat":{i}}}'),
            )
            db.execute("COMMIT")
        return ops

    def cas() -> float:
        part, etag = uuid.uuid4().hex, uuid.uuid4().hex
        db.execute("INSERT INTO t VALUES (?,?,?,?)", (part, "job", etag, '{"generation":0}'))
        for i in range(ops):
            new = uuid.uuid4().hex
            db.execute("BEGIN IMMEDIATE")
            changed = db.execute(
                "UPDATE t SET etag=?, data=? WHERE pk=? AND rk=? AND etag=?",
                (new, f'{{"generation":{i + 1}}}', part, "job", etag),
            ).rowcount
            db.execute("COMMIT")
            assert changed == 1
            etag = new
        return ops

    return inserts, cas


def sdk_table_baseline(conn: str, ops: int) -> tuple[Callable[[], float], Callable[[], float]]:
    client = TableServiceClient.from_connection_string(conn).create_table_if_not_exists("rawbench")

    def inserts() -> float:
        part = uuid.uuid4().hex
        for i in range(ops):
            client.create_entity(
                {"PartitionKey": part, "RowKey": f"r{i:06d}", "state": "alive", "beat": i}
            )
        return ops

    def cas() -> float:
        part = uuid.uuid4().hex
        etag = client.create_entity({"PartitionKey": part, "RowKey": "job", "generation": 0})[
            "etag"
        ]
        for i in range(ops):
            etag = client.update_entity(
                {"PartitionKey": part, "RowKey": "job", "generation": i + 1},
                mode=UpdateMode.REPLACE,
                etag=etag,
                match_condition=MatchConditions.IfNotModified,
            )["etag"]
        return ops

    return inserts, cas


def adapter_transactions(table: Table, ops: int, size: int) -> Callable[[], float]:
    """``ops`` upserts in transactions of ``size`` (a join writes 2, heartbeats 100)."""

    def work() -> float:
        part = uuid.uuid4().hex
        count = max(1, ops // size)
        for i in range(count):
            table.batch(
                [BatchOp("upsert", Entity(part, f"r{j:03d}", {"beat": i})) for j in range(size)]
            )
        return count

    return work


def with_batch_path(patched: bool, work: Callable[[], float]) -> Callable[[], float]:
    def switched() -> float:
        if patched:
            assert _azure_batch.install(), "azure-core is outside the tested releases"
        else:
            _azure_batch.uninstall()
        return work()

    return switched


def measure_transactions(conn: str, args: argparse.Namespace) -> None:
    """The in-order batch path against azure-core's own, rounds alternating."""
    storage = AzureStorage("benchtx", connection_string=conn)
    table = storage.table("batches")
    print(f"  {'transactions':28} {'in order':>10} {'azure-core':>10}  ratio")
    for size in (2, 100):
        work = adapter_transactions(table, args.ops, size)
        ours, stock = with_batch_path(True, work), with_batch_path(False, work)
        ours(), stock()  # warm-up
        walls: tuple[list[float], list[float]] = ([], [])
        cpus: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.repeat):
            for run, wall, cpu in ((ours, walls[0], cpus[0]), (stock, walls[1], cpus[1])):
                start, start_cpu = time.perf_counter(), time.process_time()
                count = run()
                wall.append(count / (time.perf_counter() - start))
                cpu.append((time.process_time() - start_cpu) * 1000 / count)
        for metric, (mine, base) in (
            (f"{size}-op transactions/s", walls),
            (f"{size}-op CPU ms/transaction", cpus),
        ):
            a, b = statistics.median(mine), statistics.median(base)
            print(f"  {metric:28} {a:10.2f} {b:10.2f}  {a / b:5.2f}", flush=True)
    _azure_batch.install()
    storage.close()


# --- blobs ------------------------------------------------------------------------------


def adapter_blob(blobs: BlobStore, source: Path) -> tuple[Callable[[], float], Callable[[], float]]:
    size = source.stat().st_size

    def put() -> float:
        with source.open("rb") as f:
            blobs.put("bench/state.bin", f)
        return size / MiB

    def get() -> float:
        got = sum(len(chunk) for chunk in blobs.stream("bench/state.bin", chunk_size=8 * MiB))
        assert got == size
        return size / MiB

    return put, get


def dd_baseline(source: Path, workdir: Path) -> tuple[Callable[[], float], Callable[[], float]]:
    size = source.stat().st_size
    target = workdir / "dd.bin"

    def put() -> float:
        subprocess.run(
            ["dd", f"if={source}", f"of={target}", "bs=8M", "conv=fdatasync", "status=none"],
            check=True,
        )
        return size / MiB

    def get() -> float:
        subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=8M", "status=none"], check=True)
        return size / MiB

    return put, get


def sdk_blob_baseline(conn: str, source: Path) -> tuple[Callable[[], float], Callable[[], float]]:
    size = source.stat().st_size
    service = BlobServiceClient.from_connection_string(
        conn, max_block_size=8 * MiB, max_single_put_size=8 * MiB
    )
    container = service.get_container_client("rawbench")
    if not container.exists():
        container.create_container()
    blob = container.get_blob_client("state.bin")

    def put() -> float:
        with source.open("rb") as f:
            blob.upload_blob(f, overwrite=True, max_concurrency=PARALLEL_TRANSFERS)
        return size / MiB

    def get() -> float:
        got = sum(len(c) for c in blob.download_blob(max_concurrency=PARALLEL_TRANSFERS).chunks())
        assert got == size
        return size / MiB

    return put, get


# --- report -----------------------------------------------------------------------------


def measure(
    backend: str,
    storage: Storage,
    table_baseline: tuple[Callable[[], float], Callable[[], float]],
    blob_baseline: tuple[Callable[[], float], Callable[[], float]],
    baseline_names: tuple[str, str],
    args: argparse.Namespace,
    source: Path,
) -> list[tuple[str, str, float, float, str]]:
    table, blobs = storage.table("bench"), storage.blobs("bench")
    put, get = adapter_blob(blobs, source)
    rows = []
    pairs = [
        ("table inserts/s", adapter_inserts(table, args.ops), table_baseline[0], 0),
        ("table CAS updates/s", adapter_cas(table, args.ops), table_baseline[1], 0),
        (f"blob put {args.mib} MiB, MiB/s", put, blob_baseline[0], 1),
        (f"blob get {args.mib} MiB, MiB/s", get, blob_baseline[1], 1),
    ]
    for metric, ours, theirs, which in pairs:
        mine, base = median_rates(ours, theirs, args.repeat)
        rows.append((backend, metric, mine, base, baseline_names[which]))
        print(
            f"  {backend:7} {metric:28} {mine:10.1f} {base:10.1f}  {mine / base:5.2f}", flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="table operations per round")
    parser.add_argument("--mib", type=int, default=256, help="blob size in MiB")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the median is shown")
    parser.add_argument(
        "--parts", default="local,azure,batch", help="comma-separated: local, azure, batch"
    )
    args = parse(parser, {"ops": 5, "mib": 1, "repeat": 1})
    parts = set(args.parts.split(","))
    if not parts <= {"local", "azure", "batch"}:
        parser.error(f"unknown parts: {', '.join(sorted(parts - {'local', 'azure', 'batch'}))}")

    with tempfile.TemporaryDirectory(
        prefix="rp-bench-", dir=ROOT / "build" if (ROOT / "build").is_dir() else None
    ) as tmp:
        work = Path(tmp)
        source = work / "source.bin"
        rows: list[tuple[str, str, float, float, str]] = []
        if parts & {"local", "azure"}:
            with source.open("wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(MiB))
            print(
                f"{args.ops} table ops and a {args.mib} MiB blob per round, median of "
                f"{args.repeat} after one warm-up; {os.cpu_count()} CPUs; files under {work}"
            )
            print(f"  {'storage':7} {'metric':28} {'rallypoint':>10} {'baseline':>10}  ratio")
        if "local" in parts:
            local = LocalStorage(work / "storage", "bench")
            rows += measure(
                "local",
                local,
                sqlite_baseline(work / "raw.sqlite3", args.ops),
                dd_baseline(source, work),
                ("sqlite3 txn", "dd fdatasync"),
                args,
                source,
            )
            local.close()
        if parts & {"azure", "batch"}:
            with azurite() as conn:
                if "azure" in parts:
                    use_batch_path()  # as `rallypoint serve` runs
                    azure = AzureStorage("bench", connection_string=conn)
                    rows += measure(
                        "azure",
                        azure,
                        sdk_table_baseline(conn, args.ops),
                        sdk_blob_baseline(conn, source),
                        ("azure-data-tables", "azure-storage-blob"),
                        args,
                        source,
                    )
                    azure.close()
                if "batch" in parts:
                    print(
                        f"\nAzure table transactions, {args.ops} upserts per round, median of "
                        f"{args.repeat} after one warm-up; azure-core "
                        f"{importlib.metadata.version('azure-core')}"
                    )
                    measure_transactions(conn, args)
    if rows:
        print("\nbaselines: " + "; ".join(sorted({f"{r[0]}: {r[4]}" for r in rows})))


if __name__ == "__main__":
    main()
