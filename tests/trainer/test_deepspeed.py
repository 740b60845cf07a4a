"""DeepSpeed ZeRO through Rallypoint under real torchrun agents (CPU, gloo,
``DS_ACCELERATOR=cpu``): ``rallypoint.trainer.deepspeed.install`` after
``deepspeed.initialize``, ``engine.save_checkpoint`` as versions, and
``rallypoint.trainer.deepspeed.load_checkpoint`` resuming every rank from the version the
coordinator named, through the SIGKILL of a node and a stale ``latest`` file, and at
another world size (ZeRO's partitions resharded)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rallypoint.cli.processes import Cluster, Coordinator, Event, judge
from rallypoint.trainer import ElasticSampler

from .._state_checks import STATE_CHECKS
from .._support import ends, joins_hot, judged, saved_since, status, status_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: DeepSpeed on CPU: its accelerator, and gloo under it.
DS_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

WORKER = (
    r"""
import argparse, io, json, os, time
import torch, torch.distributed as dist
import xxhash
import deepspeed
from rallypoint.client import ElasticClient
from rallypoint.trainer import ElasticSampler, PreemptionWatcher, SavePolicy
from rallypoint.trainer.examples._launch import pause
import rallypoint.trainer.deepspeed as rp_deepspeed

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=3)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--every", type=int, default=5)
p.add_argument("--step-time", type=float, default=0.0)
p.add_argument("--step-time-file")
p.add_argument("--events", required=True)
p.add_argument("--items", type=int, default=120, help="an epoch's items")
p.add_argument("--micro", type=int, default=2, help="per-device batch")
p.add_argument("--global-batch", type=int, default=12, help="DeepSpeed's train_batch_size")
p.add_argument("--init-distributed", action="store_true", help="rp_deepspeed.init_distributed()")
args = p.parse_args()

torch.set_num_threads(1)
if args.init_distributed:  # joins, then deepspeed.init_distributed
    client = rp_deepspeed.init_distributed(dist_backend="gloo")
else:  # as the docs had scripts do before init_distributed
    client = ElasticClient.from_env()
    client.join()
    dist.init_process_group("gloo")
assignment = client.assignment
rank, world = dist.get_rank(), dist.get_world_size()

def event(kind, **fields):
    line = {"t": time.time(), "event": kind, "generation": assignment.generation,
            "rank": rank, "world_size": world, **fields}
    with open(args.events, "a") as f:
        f.write(json.dumps(line) + "\n")

"""
    + STATE_CHECKS
    + r'''
def state(engine):
    return {"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}

def digests(engine):
    """This rank's model (its ZeRO-3 partition) and optimizer partition, gathered."""
    mine = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    tensors(engine.optimizer.state_dict(), mine)
    return gathered_digests(mine)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
# The global batch is the config's train_batch_size: DeepSpeed sets the accumulation
# steps for each world (2 per device: 2 steps at world 3, 3 at world 2).
config = {
    "train_batch_size": args.global_batch,
    "train_micro_batch_size_per_gpu": args.micro,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": args.stage},
    "steps_per_print": 10**9,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
checkpoints = rp_deepspeed.install(engine, client, policy=SavePolicy(progress=False))
# The data: item i is row i of a fixed table; the elastic sampler deals each epoch's
# order out to this world's ranks from the position the version saved, as the docs show.
X = torch.randn(args.items, 16, generator=torch.Generator().manual_seed(0))
sampler = ElasticSampler(args.items, rank=rank, world_size=world, batch_size=args.micro)
_, client_state = rp_deepspeed.load_checkpoint(engine)
if client_state:
    sampler.load_state_dict(client_state["sampler"])
loader = torch.utils.data.DataLoader(range(args.items), batch_size=args.micro, sampler=sampler)
accumulation = engine.gradient_accumulation_steps()
restored = checkpoints.restored
latest = os.path.join(os.environ["SAVE_DIR"], "latest")
event("resumed", version=restored.version if restored else None,
      step=engine.global_steps + 1,
      digests=digests(engine) if restored else None,
      full=full_digest(engine.module) if restored else None,
      saved_by=checkpoints.saved_dp_world_size, reshard_s=checkpoints.reshard_seconds,
      bytes_from=restored.bytes_from if restored else None,
      saves_back=saves_back(state(engine)) if restored else None,
      sampler=sampler.state_dict(), accumulation=accumulation,
      # What this node's folder's `latest` said while the version loaded: DeepSpeed's
      # rank 0 rewrites it at each save, so the end of a run no longer shows it.
      latest=open(latest).read() if os.path.exists(latest) else None)

def train_step(s, indices):
    """Optimizer step s over `accumulation` micro-batches of this rank's indices; the
    sampler's position advanced past it (and saved, at a save); the last loss."""
    for idx in indices:
        x = X[idx]
        loss = torch.nn.functional.mse_loss(engine(x), x.flip(1))
        engine.backward(loss)
        engine.step()  # the optimizer steps at the last micro-batch only
    assert engine.global_steps == s
    sampler.advance(accumulation)  # after the optimizer step, on every rank
    event("trained", step=s, epoch=sampler.epoch, indices=[i for b in indices for i in b.tolist()])
    pause(args)
    if rank == 0:
        event("step", step=s, loss=round(loss.item(), 5))
    stop = watcher.should_stop()
    if s % args.every == 0 or stop:
        d, full = digests(engine), full_digest(engine.module)
        if rank == 0:
            event("saving", step=s, digests=d, full=full)
        # The sampler's position is part of the version: DeepSpeed keeps client_state
        # in the model states file and gives it back from load_checkpoint.
        checkpoints.save_checkpoint(os.environ["SAVE_DIR"], persist=stop, blocking=stop,
                                    client_state={"sampler": sampler.state_dict()})
    if stop:
        event("emergency", step=s, version=checkpoints.last_save.result().version)
        watcher.finish()
    return loss

with PreemptionWatcher(client) as watcher:
    epoch = sampler.epoch
    while engine.global_steps < args.steps:
        sampler.set_epoch(epoch)  # keeps a restored position in the restored epoch
        batches = iter(loader)
        while engine.global_steps < args.steps:
            indices = [b for _, b in zip(range(accumulation), batches)]
            if not indices:
                break  # the epoch is done (it holds whole global batches only)
            loss = train_step(engine.global_steps + 1, indices)
        epoch += 1
checkpoints.wait()
event("finished", step=engine.global_steps, loss=round(loss.item(), 5))
checkpoints.close()
'''
)


def test_import_of_rallypoint_trainer_imports_no_framework() -> None:
    code = (
        "import sys, rallypoint.trainer; "
        "bad = {'deepspeed', 'transformers', 'accelerate'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def stale_folder(folder: Path) -> Path:
    """A node's checkpoint folder as a cache could leave it: a ``latest`` naming a
    newer tag than any version, whose files are garbage (loading them would fail)."""
    (folder / "global_step999").mkdir(parents=True)
    (folder / "latest").write_text("global_step999")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt"):
        (folder / "global_step999" / name).write_bytes(b"not a checkpoint")
    return folder


def zero_cluster(
    coordinator: Coordinator, tmp_path: Path, job: str, nnodes: str, args: list[str], **kw: Any
) -> Cluster:
    """Agents that run :data:`WORKER` with ``args``, each node with a memory tier of its
    own, their events in ``tmp_path``."""
    script = tmp_path / "ds_worker.py"
    script.write_text(WORKER)
    events = tmp_path / "ds.events.jsonl"
    cluster = Cluster(
        coordinator.url,
        job,
        tmp_path,
        nnodes=nnodes,
        memory=tmp_path / "memory",
        script=[str(script), *args, "--events", str(events)],
        **kw,
    )
    cluster.script += ["--step-time-file", str(cluster.step_time_file)]  # cluster.wait's
    cluster.events_file = events
    return cluster


def test_zero3_resumes_every_rank_from_the_named_version_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Node a (2 processes) and node b (1) train ZeRO-3 with AdamW; b is SIGKILLed; a
    new node with a stale folder takes its place (ZeRO keeps its partitioning, so the
    world size comes back to 3). Every rank restores its own partition at the step the
    coordinator named, equal to what was saved, and the stale ``latest`` is never read."""
    args = ["--stage", "3", "--steps", "30", "--every", "5", "--step-time", "0.05"]
    cluster = zero_cluster(coordinator, tmp_path, "zero3", "2:2", args)
    stale = stale_folder(tmp_path / "c" / "checkpoints")
    try:
        first = []
        for node in ("a", "b"):
            (tmp_path / node).mkdir()
            env = {**DS_ENV, "SAVE_DIR": str(tmp_path / node / "checkpoints")}
            first.append((node, {"nproc": 2 if node == "a" else 1, "env": env}))
        cluster.start(*first)
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["step"] >= 12 and e["world_size"] == 3,
            timeout=240,
        )
        cluster.kill("b")
        cluster.add("c", nproc=1, env={**DS_ENV, "SAVE_DIR": str(stale)})
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    assert codes["a"] == 0 and codes["c"] == 0, codes
    judged(coordinator, cluster, 30)
    log = cluster.events()
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["version"] is not None]
    assert {e["rank"] for e in resumed} == {0, 1, 2}
    for e in resumed:
        # Model partition and optimizer partition of every rank, as saved at that step.
        assert e["digests"] == saved[e["step"] - 1]
        assert sum(e["bytes_from"].values()) > 0
        assert e["saves_back"]
    # The replacement's rank resumed the named version while its folder's `latest`
    # named the stale tag (DeepSpeed's rank 0 rewrites the file at its saves later).
    assert "global_step999" in {e["latest"] for e in resumed if e["generation"] == 2}


def test_zero3_with_a_standby_survives_a_node_kill_at_its_world_size_from_memory(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Nodes a and b train ZeRO-3 (``--nnodes 2:2``) and node s parks as their standby
    (``standbys=1``), taking copies of their files. b is SIGKILLed: s takes b's rank, so
    the world stays 2 and ZeRO's partitioning is the one saved. No generation fails: the
    second runs to the end, every rank restores its partition at the step the
    coordinator named, equal to what was saved, and s reads its own memory alone."""
    args = ["--stage", "3", "--steps", "200", "--every", "10", "--step-time", "0.05"]
    cluster = zero_cluster(coordinator, tmp_path, "zero3spare", "2:2", args, standbys=1)

    def node(name: str) -> tuple[str, dict[str, Any]]:
        (tmp_path / name).mkdir()
        return name, {"env": {**DS_ENV, "SAVE_DIR": str(tmp_path / name / "checkpoints")}}

    def add(name: str) -> None:
        name, options = node(name)
        cluster.add(name, **options)

    try:
        cluster.start(node("a"), node("b"))
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10, timeout=240)
        add("s")
        status_until(coordinator, "zero3spare", lambda b: any(w["standby"] for w in b["waiting"]))
        saved_since(coordinator, "zero3spare", time.time())
        before = {m["node_id"]: m["rank"] for m in status(coordinator, "zero3spare")["members"]}
        cluster.kill("b")
        cluster.wait_for(lambda e: e["event"] == "step" and e["generation"] == 2, timeout=240)
        after = {m["node_id"]: m["rank"] for m in status(coordinator, "zero3spare")["members"]}
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    assert codes["a"] == 0 and codes["s"] == 0, codes
    history = judged(coordinator, cluster, 200)
    log = cluster.events()
    # One generation ended, by the kill; the standby's ran to the end.
    assert [g["world_size"] for g in history] == [2, 2], ends(history)
    assert not any(g["load_failure"] for g in history), history
    assert after == {"a": before["a"], "s": before["b"]}
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 2]
    assert {e["rank"] for e in resumed} == {0, 1}
    for e in resumed:
        assert e["digests"] == saved[e["step"] - 1]
        assert e["saves_back"]
    taken = next(e for e in resumed if e["rank"] == before["b"])
    assert taken["bytes_from"]["storage"] == taken["bytes_from"]["peer"] == 0, taken
    assert taken["bytes_from"]["memory"] > 0


def test_a_node_that_joins_under_rallypoint_runs_defaults_gets_in(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Node c joins a and b's running ZeRO-2 job under ``rallypoint run``'s defaults (a
    hot join): ``rp_deepspeed.init_distributed()`` joins before it builds the process
    group, so c's worker waits there and goes in hot, and the world of 3 trains (the
    partitions resharded from the version the two saved)."""
    steps = 60
    args = ["--init-distributed", "--stage", "2", "--steps", str(steps), "--every", "5"]
    args += ["--step-time", "1"]  # until c is in: its agent and worker start meanwhile
    cluster = zero_cluster(coordinator, tmp_path, "ds-join", "2:3", args)
    env = {**DS_ENV, "SAVE_DIR": str(tmp_path / "checkpoints")}
    # c joins once a version is committed: a join before the two's first save (step 5)
    # restarts the three from nothing, which is no reshard (it happened in CI, where c
    # started within 4 s).
    events = joins_hot(coordinator, cluster, 3, steps, env=env, saved=True)
    resumed = [e for e in events if e["event"] == "resumed" and e["generation"] == 2]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2], resumed
    assert {(e["accumulation"], e["saved_by"]) for e in resumed} == {(2, 2)}


@pytest.mark.parametrize("stage", [3, 2])
def test_zero_resumes_at_another_world_size_shrunk_and_grown(
    coordinator: Coordinator, tmp_path: Path, stage: int
) -> None:
    """Three one-process nodes train ZeRO with AdamW (``--nnodes 2:3``); c is SIGKILLed
    and nobody replaces it: the two left resume at a world size of 2 from the version 3
    ranks saved. With ZeRO-3, node d then joins and the three resume from a version the
    two saved. Every rank resumes at the step the coordinator named, and the gathered
    full parameters and Adam moments after the reshard are those that were saved.

    The user's loop deals its data through ``ElasticSampler`` and saves its position as
    ``client_state``; the global batch is the config's ``train_batch_size`` (12: 2 per
    device x 2 accumulation steps at world 3, x 3 at world 2). Every step trains the
    next 12 items of its epoch's order at every world size, and each item of each epoch
    is trained once in the kept history: more only as a lost step's, re-done."""
    # ZeRO-3's two must still be training when d has started and joined (seconds).
    steps = 60 if stage == 3 else 40
    args = ["--stage", str(stage), "--steps", str(steps), "--every", "5", "--step-time", "0.2"]
    job = f"reshard{stage}"
    cluster = zero_cluster(coordinator, tmp_path, job, "2:3", args)

    def node(name: str) -> tuple[str, dict[str, Any]]:
        (tmp_path / name).mkdir()
        return name, {"nproc": 1, "env": {**DS_ENV, "SAVE_DIR": str(tmp_path / name / "ckpt")}}

    def add(name: str) -> None:
        name, options = node(name)
        cluster.add(name, **options)

    try:
        cluster.start(node("a"), node("b"), node("c"))
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["step"] >= 12 and e["world_size"] == 3,
            timeout=240,
        )
        cluster.kill("c")
        if stage == 3:
            # Grow once the two have saved a version of their own (and it committed).
            saved = cluster.wait_for(
                lambda e: e["event"] == "saving" and e["world_size"] == 2, timeout=240
            )
            cluster.wait_for(
                lambda e: (
                    e["event"] == "step" and e["world_size"] == 2 and e["step"] >= saved["step"] + 2
                ),
                timeout=60,
            )
            add("d")
            # Before the end, which cluster.wait hastens: the two train on while d starts.
            # d's own resume: a generation after the shrink's.
            cluster.wait_for(
                lambda e: (
                    e["event"] == "resumed"
                    and e["world_size"] == 3
                    and e["generation"] > saved["generation"]
                ),
                timeout=150,
            )
        codes = cluster.wait(timeout=300)
    finally:
        cluster.stop()
    survivors = ("a", "b", "d") if stage == 3 else ("a", "b")
    assert all(codes[n] == 0 for n in survivors), codes
    log = cluster.events()
    verdict = judge(log, status(coordinator, job)["history"])
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps
    saved_at: dict[int, tuple[str, int]] = {}  # the last save of each step, so far
    reshards = []
    for e in log:
        if e["event"] == "saving":
            saved_at[e["step"]] = (e["full"], e["world_size"])
        if e["event"] != "resumed" or e["version"] is None:
            continue
        full, world = saved_at[e["step"] - 1]
        assert e["full"] == full, e  # the consolidated state, as it was saved
        assert e["saved_by"] == world
        assert (e["reshard_s"] is not None) == (world != e["world_size"])
        assert e["saves_back"]
        if world != e["world_size"]:
            reshards.append((world, e["world_size"]))
    expected = [(3, 2), (2, 3)] if stage == 3 else [(3, 2)]
    # Every rank of each resharded generation, in order.
    assert sorted(set(reshards), key=reshards.index) == expected
    assert len(reshards) == sum(new for _, new in expected)
    # The global batch kept: DeepSpeed's accumulation steps follow the world.
    plans = {(e["world_size"], e["accumulation"]) for e in log if e["event"] == "resumed"}
    assert plans == {(3, 2), (2, 3)}, plans
    print(f"{job}: {each_item_once_an_epoch(log, steps, items=120, batch=12)}")
    # The universal checkpoints were removed (at close(), or by the next reshard).
    assert not list(Path(tempfile.gettempdir()).glob(f"rallypoint-deepspeed-{job}-*"))


def each_item_once_an_epoch(log: list[Event], steps: int, items: int, batch: int) -> str:
    """Step k trained the items ``(k - 1) * batch`` to ``k * batch`` of the run's
    concatenated epoch orders (the sampler's seed, 0), all ranks of its last generation
    together, whatever the world; each item of each epoch once in that kept history; an
    item trained more often only as one of a step two generations trained (a lost step,
    re-done on the same items). What was repeated and never trained, in words."""
    records: dict[int, dict[int, dict[int, Event]]] = {}
    every: Counter[tuple[int, int]] = Counter()
    for e in log:
        if e["event"] == "trained":
            records.setdefault(e["step"], {}).setdefault(e["generation"], {})[e["rank"]] = e
            every.update((e["epoch"], i) for i in e["indices"])
    assert sorted(records) == list(range(1, steps + 1))
    order = ElasticSampler(items, rank=0, world_size=1)
    kept: Counter[tuple[int, int]] = Counter()
    redone: set[tuple[int, int]] = set()
    for step, generations in sorted(records.items()):
        ranks = generations[max(generations)]
        # The kept generation trained the step on every rank (a killed rank's last step
        # can be recorded by some ranks only: the next generation re-does it).
        assert sorted(ranks) == list(range(ranks[0]["world_size"])), (step, generations)
        trained = sorted(i for e in ranks.values() for i in e["indices"])
        epoch, position = divmod((step - 1) * batch, items)
        order.set_epoch(epoch)
        assert {e["epoch"] for e in ranks.values()} == {epoch}, step
        assert trained == sorted(list(order)[position : position + batch]), step
        for earlier in generations.values():
            assert {i for e in earlier.values() for i in e["indices"]} <= set(trained), step
        if len(generations) > 1:
            redone |= {(epoch, i) for i in trained}
        kept.update((epoch, i) for i in trained)
    epochs = steps * batch // items
    assert kept == Counter({(e, i): 1 for e in range(epochs) for i in range(items)})
    repeated = {k for k, n in every.items() if n > 1}
    assert repeated <= redone, repeated - redone
    never = epochs * items - len(every)
    assert never == 0
    trainings = sum(n - 1 for n in every.values())
    return (
        f"{items // batch} steps an epoch at every world; {trainings} trainings of "
        f"{len(repeated)} items repeated (the re-done steps'), {never} never trained"
    )
