"""Lightning on Rallypoint: real Lightning under real torchrun agents (CPU, gloo) with
``--rdzv-backend=rallypoint``, the example ``train_lightning.py`` (a small CNN on
synthetic CIFAR-shaped data), and failures.

Each run checks that every rank resumed from the version the coordinator named, that the
state it resumed with hashes like the state saved at that step, and that a folder with
a newer-looking ``last.ckpt`` changed nothing. The elastic-data runs count, from the
indices every rank logged for every batch it trained, which samples of each epoch were
trained and how often, across a shrink and a growth of the world; and a run through a
node's SIGKILL with a replacement must end bit-for-bit where an uninterrupted one does.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, Event, example_script, judge
from rallypoint.trainer import BatchPlan, ElasticSampler
from rallypoint.trainer._lightning import _EpochSampler, _order_of, _rebuilt, resume_position
from rallypoint.trainer.errors import WorldSizeError
from rallypoint.trainer.lightning import RallypointDDPStrategy

from .._support import (
    b_hangs_and_is_named,
    committed,
    ends,
    joins_hot,
    kept_and_rolled_back,
    run_to_the_end,
    status,
)
from .._versions import final_model, largest_relative_difference

pytestmark = pytest.mark.timeout(180)

STEPS = 30


@pytest.fixture(autouse=True)
def _warm_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked from a warm server that imported Lightning, as the docs advise a
    Lightning job: a restarted worker does not import it again. (The CPU it saves here is
    what each server spends: 85.2 against 88.3 CPU-s for the node-kill test.)"""
    monkeypatch.setenv("RALLYPOINT_WARM_MODULES", "lightning.pytorch,rallypoint.trainer.lightning")


def test_a_resumed_sampler_counts_the_batches_lightning_already_did() -> None:
    # 480 samples, 2 ranks of 8: 30 batches an epoch, 10 of them counted before a resume.
    sampler = _EpochSampler(480, rank=1, world_size=2, shuffle=True, seed=3, batch_size=8)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 160})
    sampler.counted = 10
    assert len(sampler) == 240  # 10 counted batches of 8 + the 160 samples left to this rank
    assert len(list(sampler)) == 160
    full = _EpochSampler(480, rank=1, world_size=2, shuffle=True, seed=3, batch_size=8)
    assert list(sampler) == list(full)[80:]  # the epoch's order, from where it stood
    # 3 batches a step: at 15, 5 batches of 2 ranks x 8 past the counted ones went into
    # steps; at 14, only 2 (the batches of an unfinished step do not count).
    assert sampler.consumed_after(15, accumulation=3, last=False) == 160 + 5 * 16
    assert sampler.consumed_after(14, accumulation=3, last=False) == 160 + 2 * 16
    assert sampler.consumed_after(17, accumulation=3, last=True) == 480
    sampler.set_epoch(1)
    assert (sampler.counted, sampler.consumed, len(sampler)) == (0, 0, 240)


def test_the_loader_is_rebuilt_with_the_plans_batch_keeping_its_other_options() -> None:
    loader = DataLoader(list(range(96)), batch_size=8, shuffle=True, drop_last=True)
    sampler = _EpochSampler(96, rank=0, world_size=2, shuffle=True, seed=0, batch_size=4)
    rebuilt = _rebuilt(loader, sampler, 4)
    assert (rebuilt.batch_size, rebuilt.sampler, rebuilt.drop_last) == (4, sampler, True)
    assert len(rebuilt) == 12  # 48 samples of this rank's share in batches of 4
    assert [len(b) for b in rebuilt] == [4] * 12


def test_a_scripts_own_elastic_sampler_is_taken_over_with_its_order() -> None:
    own = ElasticSampler(100, rank=1, world_size=3, shuffle=True, seed=7, batch_size=4)
    length, shuffle, seed = _order_of(own, 200)  # the sampler's length, not the dataset's
    assert (length, shuffle, seed) == (100, True, 7)
    ours = _EpochSampler(length, rank=0, world_size=1, shuffle=shuffle, seed=seed, batch_size=1)
    assert list(ours) == list(ElasticSampler(100, rank=0, world_size=1, shuffle=True, seed=7))
    assert _order_of(RandomSampler(range(50)), 50) == (50, True, 0)
    assert _order_of(SequentialSampler(range(50)), 50) == (50, False, 0)


def test_resume_position_puts_lightnings_counter_in_this_worlds_batches() -> None:
    saved = {"epoch": 2, "consumed": 144}
    # Saved by 3 ranks of 8 (6 batches in); 2 ranks of 8 are 9 batches in.
    assert resume_position(saved, length=480, epoch=2, per_batch=16) == (2, 144, 9)
    # The epoch was over: the next one from its start, the counter at a whole epoch.
    assert resume_position({"epoch": 2, "consumed": 480}, length=480, epoch=2, per_batch=16) == (
        3,
        0,
        None,
    )
    assert resume_position(saved, length=480, epoch=3, per_batch=16) == (3, 0, None)


def test_a_world_that_cannot_split_the_jobs_global_batch_is_refused_before_training() -> None:
    strategy = RallypointDDPStrategy()  # joins nothing until it saves or loads
    with pytest.raises(WorldSizeError) as refused:
        strategy._plan({"global_batch": 16}, world=3, micro=8, accumulation=1)
    assert refused.value.valid == [1, 2, 4, 8, 16]
    assert strategy.batch_plan is None


def test_the_global_batch_is_kept_or_by_choice_follows_the_world(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = RallypointDDPStrategy()._plan({"global_batch": 48}, world=2, micro=8, accumulation=2)
    assert kept == BatchPlan(48, 2, 8, 3)
    caplog.set_level(logging.INFO, "rallypoint.trainer")
    own = RallypointDDPStrategy(keep_global_batch=False)
    assert own._plan({"global_batch": 48}, world=2, micro=8, accumulation=2) == BatchPlan(
        32, 2, 8, 2
    )
    assert "32 samples per step, not the job's 48; an epoch takes 1.5x the steps" in caplog.text
    assert "global batch 32 = 2 ranks x 8 per device x 2 accumulation steps" in caplog.text
    # The first generation fixes the job's global batch from the script's values.
    first = RallypointDDPStrategy()._plan(None, world=3, micro=8, accumulation=2)
    assert first == BatchPlan(48, 3, 8, 2)


@pytest.mark.e2e
def test_importing_the_trainer_package_imports_no_framework() -> None:
    code = 'import sys, rallypoint.trainer; assert "lightning" not in sys.modules'
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def stale_folder(path: Path) -> Path:
    """A checkpoint folder as a stale mount shows it: files newer than anything the job
    saved, at a step far ahead. Lightning's ``ckpt_path="last"`` would pick them."""
    path.mkdir(parents=True)
    bogus = {
        "global_step": 10_000,
        "epoch": 99,
        "state_dict": {},
        "pytorch-lightning_version": "2.6.6",
    }
    for name in ("last.ckpt", "epoch=99-step=10000.ckpt"):
        torch.save(bogus, path / name)
        os.utime(path / name, (2e9, 2e9))  # 2033: newer than any save of this run
    return path


def lightning_cluster(
    coordinator: Coordinator, job: str, tmp_path: Path, strategy: str, *extra: str, **kw: Any
) -> Cluster:
    events = tmp_path / f"{job}.events.jsonl"
    script = [
        str(example_script().with_name("train_lightning.py")),
        *("--strategy", strategy, "--steps", str(STEPS), "--batch-size", "12"),
        *("--samples", "960", "--checkpoint-every", "4", "--step-time", "0.05"),
        *("--events", str(events), "--digests"),
        *("--checkpoint-dir", str(stale_folder(tmp_path / "stale"))),
        *extra,
    ]
    cluster = Cluster(coordinator.url, job, tmp_path, nnodes="2:3", script=script, **kw)
    cluster.script += ["--step-time-file", str(cluster.step_time_file)]  # cluster.wait's
    cluster.events_file = events
    return cluster


def kill_a_node_mid_run(coordinator: Coordinator, tmp_path: Path, strategy: str) -> None:
    job = f"lit-{strategy}"
    # fit(ckpt_path="last") too: the coordinator's version wins over the folder's files.
    cluster = lightning_cluster(coordinator, job, tmp_path, strategy, "--ckpt-path", "last")
    try:
        cluster.start(("a", {"nproc": 2}), "b", "c")
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10, timeout=120)
        victim = "c"
        cluster.kill(victim)  # the node and its worker, SIGKILL
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    log = cluster.events()
    history = status(coordinator, job)["history"]
    assert [g["world_size"] for g in history][:2] == [3, 2], history  # nodes
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS, codes
    assert all(code == 0 for node, code in codes.items() if node != victim), codes
    # Generation 1 started fresh despite the stale folder and ckpt_path="last".
    first = [e for e in log if e["event"] == "resumed" and e["generation"] == 1]
    assert {(e["version"], e["step"]) for e in first} == {(None, 0)}
    saved = {e["step"]: e["digest"] for e in log if e["event"] == "saving"}
    pointer = history[1]["checkpoint"]
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 2]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2]  # 3 processes of 4
    for e in resumed:
        assert (e["version"], e["step"], e["saved_by"]) == (pointer["version"], pointer["step"], 4)
        assert e["digest"] == saved[pointer["step"]]  # model and optimizer, gathered
        assert sum(e["bytes_from"].values()) > 0
        assert e["saves_back"]  # a torch.save of the resumed state loads back equal
    assert 4 <= pointer["step"] < STEPS  # resumed mid-run, not from the stale 10,000


@pytest.mark.e2e
def test_lightning_ddp_resumes_from_the_coordinator_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    kill_a_node_mid_run(coordinator, tmp_path, "ddp")


@pytest.mark.e2e
def test_lightning_fsdp2_resumes_resharded_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    kill_a_node_mid_run(coordinator, tmp_path, "model-parallel")


@pytest.mark.e2e
def test_lightning_cifar_miniature_loses_no_step_to_a_preemption_notice(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    with FakeImds() as imds:
        # Routine versions stay in memory (every 100th to storage): the notice's
        # emergency version must reach storage.
        cluster = lightning_cluster(
            coordinator, "lit-preempt", tmp_path, "ddp", "--persist-every", "100", imds_url=imds.url
        )
        cluster.nnodes = "1:2"
        try:
            cluster.start(("a", {"nproc": 2}), "b")
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 6, timeout=120)
            event_id = imds.schedule("b")
            cluster.wait_for(lambda e: e["event"] == "resumed" and e["generation"] == 2)
            codes = cluster.wait(timeout=150)
        finally:
            cluster.stop()
    assert imds.acknowledged == [event_id]
    assert codes == {"a": 0, "b": 0}  # the preempted node left cleanly
    log = cluster.events()
    history = status(coordinator, "lit-preempt")["history"]
    assert [g["world_size"] for g in history] == [2, 1]
    assert "preempted (Preempt)" in history[0]["ended_reason"]
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS
    assert verdict.steps_lost == {2: 0}
    emergency = {e["version"] for e in log if e["event"] == "emergency"}
    pointer = history[1]["checkpoint"]
    assert emergency == {pointer["version"]} and pointer["durable"]
    saved = {e["step"]: e["digest"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 2]
    assert [e["digest"] for e in resumed] == [saved[pointer["step"]]] * 2
    versions = httpx.get(f"{coordinator.url}/v1/jobs/lit-preempt/checkpoints", timeout=10).json()
    assert "memory" in {v["durability"] for v in versions}  # routine ones stayed in memory


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "model-parallel"])
def test_lightning_takes_a_node_that_joins_under_rallypoint_runs_defaults(
    coordinator: Coordinator, tmp_path: Path, strategy: str
) -> None:
    """Node c joins a running job of a and b under ``rallypoint run``'s defaults: it
    parks, and its worker starts in the placeholder world. The strategy joins before it
    builds its process group (here first in a ``validate()`` before ``fit()``, which
    builds it too), so the worker waits there and goes in hot: it does not fail at the
    placeholder master, and the world of 3 trains."""
    job, steps = f"lit-join-{strategy}", 60
    # Paced (1 s a step) until c is in: its agent and worker start meanwhile.
    cluster = lightning_cluster(
        coordinator, job, tmp_path, strategy, "--validate-first", "--step-time", "1",
        "--steps", str(steps),  # global batch 24: 2 x 12, then 3 x 8
    )  # fmt: skip
    events = joins_hot(coordinator, cluster, 3, steps)
    resumed = [e for e in events if e["event"] == "resumed" and e["generation"] == 2]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2], resumed


SAMPLES = 480  # 10 steps an epoch of the global batch below
GLOBAL_BATCH = 48  # the first generation's 3 ranks x 8 per device x 2 accumulation steps
ELASTIC_STEPS = 30  # 3 epochs


def elastic_cluster(
    coordinator: Coordinator, job: str, tmp_path: Path, nnodes: str, steps: int, *extra: str
) -> Cluster:
    events = tmp_path / f"{job}.events.jsonl"
    script = [
        str(example_script().with_name("train_lightning.py")),
        *("--steps", str(steps), "--batch-size", "8", "--accumulate", "2"),
        *("--samples", str(SAMPLES), "--checkpoint-every", "3", "--step-time", "0.05"),
        *("--events", str(events), "--digests", "--log-samples", *extra),
    ]
    cluster = Cluster(coordinator.url, job, tmp_path, nnodes=nnodes, script=script)
    cluster.script += ["--step-time-file", str(cluster.step_time_file)]  # cluster.wait's
    cluster.events_file = events
    return cluster


def sample_counts(batches: Sequence[Event]) -> dict[int, Counter[int]]:
    """How often each sample was trained, by epoch."""
    counts: dict[int, Counter[int]] = {}
    for e in batches:
        counts.setdefault(e["epoch"], Counter()).update(e["indices"])
    return counts


def first_step(cluster: Cluster, generation: int, step: int) -> None:
    cluster.wait_for(
        lambda e: e["event"] == "step" and e["generation"] >= generation and e["step"] >= step,
        timeout=150,
    )


def shrink_then_grow(
    coordinator: Coordinator, tmp_path: Path, strategy: str, *extra: str
) -> tuple[list[Event], list[dict[str, Any]], dict[str, int]]:
    """3 nodes of one process, one SIGKILLed mid-epoch 0, a new one mid-epoch 1: the
    events, the job's history and the agents' exit statuses."""
    job = f"lit-elastic-{strategy}"
    # Paced so that node d's agent starts and joins while there are steps left to train.
    pace = ("--strategy", strategy, "--step-time", "0.3", *extra)
    cluster = elastic_cluster(coordinator, job, tmp_path, "2:3", ELASTIC_STEPS, *pace)
    try:
        cluster.start("a", "b", "c")
        first_step(cluster, 1, 5)
        cluster.kill("c")  # 3 ranks -> 2, no replacement
        first_step(cluster, 2, 8)
        cluster.add("d")  # 2 -> 3
        cluster.wait_for(lambda e: e["event"] == "resumed" and e["generation"] == 3)
        codes = cluster.wait(timeout=200)
        # Nothing of the job outlives it: not the loader workers of the ranks that were
        # restarted, nor a server started for them.
        assert cluster.lingering() == []
    finally:
        cluster.stop()
    return cluster.events(), status(coordinator, job)["history"], codes


def check_elastic_run(
    log: list[Event], history: list[dict[str, Any]], codes: dict[str, int]
) -> None:
    steps = ELASTIC_STEPS
    assert [g["world_size"] for g in history] == [3, 2, 3], ends(history)
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps, codes
    assert all(code == 0 for node, code in codes.items() if node != "c"), codes
    saved = {e["step"]: e["digest"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed"]
    for generation, world, accumulation in ((1, 3, 2), (2, 2, 3), (3, 3, 2)):
        mine = [e for e in resumed if e["generation"] == generation]
        assert len(mine) == world
        for e in mine:  # the global batch kept: more accumulation steps on fewer ranks
            assert e["plan"] == {
                "global_batch": GLOBAL_BATCH,
                "world_size": world,
                "micro_batch": 8,
                "accumulation": accumulation,
            }
            assert e["batches"] == 10 * accumulation  # the same 10 steps an epoch
            if generation > 1:
                pointer = history[generation - 1]["checkpoint"]
                assert (e["version"], e["step"]) == (pointer["version"], pointer["step"])
                assert e["digest"] == saved[pointer["step"]]
                assert pointer["step"] % 10, "the test means to resume mid-epoch"
    check_each_sample_once(log, steps)


def check_each_sample_once(log: list[Event], steps: int) -> None:
    """In the steps the run kept (not those a restart rolled back and re-did), every
    sample of every epoch trained once, ``GLOBAL_BATCH`` samples a step and 10 steps an
    epoch; prints the counts."""
    kept, lost = kept_and_rolled_back(log, "batch")
    counts = sample_counts(kept)
    epochs = steps // 10
    assert sorted(counts) == list(range(epochs))
    for epoch, count in counts.items():
        repeated = sum(n - 1 for n in count.values() if n > 1)
        never = SAMPLES - len(count)
        print(f"epoch {epoch}: {repeated} repeated, {never} never trained")
        assert (repeated, never) == (0, 0), epoch
    by_step: dict[int, int] = Counter()
    for e in kept:
        by_step[e["step"]] += len(e["indices"])
    assert by_step == dict.fromkeys(range(steps), GLOBAL_BATCH)  # every step 48 samples
    of_step = {e["step"]: e["epoch"] for e in kept}
    assert [list(of_step.values()).count(epoch) for epoch in range(epochs)] == [10] * epochs
    print(f"{len(lost)} batches of rolled-back steps re-done")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_ddp_trains_each_sample_once_an_epoch_through_a_shrink_and_a_growth(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    # A loader worker: its iterator deals from the sampler while the loops restore. A
    # schedule over trainer.estimated_stepping_batches: Lightning then sets the loader up
    # in configure_optimizers, before the loops are restored.
    extra = ("--num-workers", "1", "--schedule", "--epochs", "3")
    check_elastic_run(*shrink_then_grow(coordinator, tmp_path, "ddp", *extra))
    against_uninterrupted(coordinator, tmp_path, "ddp", *extra)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_ddp_takes_over_the_scripts_own_elastic_sampler_through_a_shrink(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The loader as the docs had users write it: an ElasticSampler of the script's own
    (``use_distributed_sampler=False``), saved in ``on_save_checkpoint`` and advanced by
    hand. Through 3 ranks -> 2 mid-epoch, the strategy takes it over (its seed and
    order kept): every sample of both epochs trained once in the steps kept."""
    job, steps = "lit-own-sampler", 20
    pace = ("--own-sampler", "--epochs", "2", "--step-time", "0.3")
    cluster = elastic_cluster(coordinator, job, tmp_path, "2:3", steps, *pace)
    try:
        cluster.start("a", "b", "c")
        first_step(cluster, 1, 5)
        cluster.kill("c")  # 3 ranks -> 2, no replacement
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    log, history = cluster.events(), status(coordinator, job)["history"]
    assert [g["world_size"] for g in history] == [3, 2], ends(history)
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps, codes
    assert codes["a"] == codes["b"] == 0, codes
    pointer = history[1]["checkpoint"]
    assert pointer["step"] % 10, "the test means to resume mid-epoch"
    check_each_sample_once(log, steps)


def against_uninterrupted(
    coordinator: Coordinator, tmp_path: Path, strategy: str, *extra: str
) -> None:
    """The elastic run's job trained again on 3 nodes no one stops (paced only as the
    shared flags pace it): both end with a version of the same step, whose parameters
    differ only by the rounding of another summation order (2 ranks x 3 accumulation
    steps for some steps); the largest relative difference is printed."""
    job = f"lit-elastic-{strategy}"
    work = tmp_path / "uninterrupted"
    work.mkdir()
    args = ("--strategy", strategy, *extra)
    cluster = elastic_cluster(coordinator, f"{job}-ref", work, "3:3", ELASTIC_STEPS, *args)
    run_to_the_end(cluster)
    step, model = final_model(coordinator, job, tmp_path, "state_dict.")
    reference_step, reference = final_model(coordinator, f"{job}-ref", work, "state_dict.")
    assert step == reference_step == ELASTIC_STEPS  # the same number of optimizer steps
    difference = largest_relative_difference(model, reference)
    print(f"{job}: largest relative difference from the uninterrupted run {difference:.3g}")
    # How far the rounding goes changed between machines (and their fresh installs), not
    # with this code: 4.6e-6 when this bound was set, 1.6e-4 on 2026-11-27's machine (an
    # AMD EPYC) in 3 runs of 22, 24 and 39 rolled-back batches, the same with the code of
    # the last CI run that passed at 1e-4; the most in the convolutions' weights (biases
    # 1e-7 to 2e-5): the sums of 3 micro-batches of 2 ranks, against 2 of 3. A lost or
    # repeated sample, step or version fails check_elastic_run above, whatever this bound.
    assert difference < 1e-3


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_ddp_through_a_node_kill_ends_bit_identical_to_an_uninterrupted_run(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    # 2 ranks x 8 x 2: 15 steps an epoch, a version every 5. A node is killed once the
    # version of step 10 is committed (the resume is mid-epoch), and its replacement once
    # that of step 15, the end of epoch 0, is (Lightning moves to epoch 1 itself).
    steps = 20
    paced = ("--checkpoint-every", "5", "--step-time", "0.2")
    clean = elastic_cluster(coordinator, "lit-clean", tmp_path, "2:2", steps, *paced)
    killed = elastic_cluster(coordinator, "lit-killed", tmp_path, "2:2", steps, *paced)
    try:
        clean.start("u", "v")
        killed.start("a", "b")
        for victim, replacement, step in (("b", "b2", 10), ("b2", "b3", 15)):
            committed(coordinator, "lit-killed", step)
            killed.kill(victim)
            killed.add(replacement)  # the same world size
        codes = {**killed.wait(timeout=200), **clean.wait(timeout=200)}
    finally:
        killed.stop()
        clean.stop()
    assert codes == {"a": 0, "b": -9, "b2": -9, "b3": 0, "u": 0, "v": 0}
    history = status(coordinator, "lit-killed")["history"]
    assert [g["world_size"] for g in history] == [2, 2, 2], ends(history)
    assert [g["checkpoint"]["step"] for g in history[1:]] == [10, 15]
    runs = {}
    for name, cluster in (("clean", clean), ("killed", killed)):
        log = cluster.events()
        kept, lost = kept_and_rolled_back(log, "batch")
        finished = {e["digest"] for e in log if e["event"] == "finished"}
        assert len(finished) == 1  # every rank alike
        runs[name] = (
            {(e["rank"], e["step"], e["batch"]): (e["indices"], e["loss"]) for e in kept},
            lost,
            finished,
        )
    (clean_batches, _, clean_digest), (killed_batches, lost, killed_digest) = (
        runs["clean"],
        runs["killed"],
    )
    assert lost, "the kill rolled no step back"
    assert len(clean_batches) == steps * 2 * 2  # 2 ranks x 2 accumulation steps
    assert killed_batches == clean_batches  # every batch's samples and loss, bit for bit
    for e in lost:  # the rolled-back steps, trained again alike
        assert clean_batches[(e["rank"], e["step"], e["batch"])] == (e["indices"], e["loss"])
    assert killed_digest == clean_digest  # the final model and optimizer state


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_fsdp2_trains_each_sample_once_an_epoch_through_a_shrink_and_a_growth(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    check_elastic_run(*shrink_then_grow(coordinator, tmp_path, "model-parallel"))


@pytest.mark.e2e
def test_a_hung_rank_of_a_lightning_job_is_named_and_the_others_train_on(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The strategy's CheckpointManager reports each rank's steps with no code of the
    script's: a rank that stops making progress is found, named, its stacks taken."""
    cluster = lightning_cluster(coordinator, "lhang", tmp_path, "ddp", "--steps", "400")
    b_hangs_and_is_named(coordinator, cluster, "train_lightning.py")
