"""The hand-written loop (``trainer/examples/train_ddp.py --global-batch``) through a
shrink and a growth of the world, against the same job run uninterrupted: real torchrun
agents (CPU, gloo) with ``--rdzv-backend=rallypoint`` and a real coordinator.

Every rank logs the indices of the items it trained at each optimizer step
(``--log-items``); the accounting is from those indices alone. The steps a restart rolled
back (trained after the version the next generation resumed from) are set apart: they
must have trained the same items as the steps that replaced them, and the steps kept
must have trained every item of each epoch once, in as many optimizer steps as the
uninterrupted run, with the same items in each step.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rallypoint.cli.processes import Cluster, Coordinator, Event, judge

from .._support import (
    committed,
    ended,
    ends,
    kept_and_rolled_back,
    pids_of,
    run_to_the_end,
    standing_still,
    status,
)
from .._versions import final_model, largest_relative_difference

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SAMPLES = 480  # 10 optimizer steps an epoch at the global batch below
GLOBAL_BATCH = 48
MICRO_BATCH = 8
STEPS = 30  # 3 epochs
# A version after every 4th step (0, 4, ..., 28): none ends an epoch, so every resume
# is mid-epoch.
CHECKPOINT_EVERY = 4
ACCUMULATION = {3: 2, 2: 3}  # 3 ranks x 8 x 2, 2 ranks x 8 x 3: 48 either way


def ddp_cluster(
    coordinator: Coordinator, job: str, workdir: Path, nnodes: str, step_time: float
) -> Cluster:
    # A slow machine must not change the worlds: a generous heartbeat timeout (a SIGKILL
    # is still seen at once, its socket closing) and last call (the first generation
    # waits for all three nodes; later rounds seal at once, with three or survivors).
    cluster = Cluster(
        coordinator.url,
        job,
        workdir,
        nnodes=nnodes,
        steps=STEPS,
        step_time=step_time,
        checkpoint_every=CHECKPOINT_EVERY,
        heartbeat_timeout=15,
        last_call=30,
    )
    cluster.script += ["--samples", str(SAMPLES), "--global-batch", str(GLOBAL_BATCH)]
    cluster.script += ["--batch-size", str(MICRO_BATCH), "--log-items", "--save-last"]
    # The sums of a step at 2 ranks round otherwise than at 3, and a rounding difference
    # that flips a ReLU's or a max-pool's choice on some item grows to 1e-4..1e-3 by the
    # end (seed 0, 40 steps: 7.2e-4, which a one-process replay of the same sums
    # reproduces). At this seed and rate, the spans of 2-rank steps this run can take
    # (from step 1, 5, 9 or 13 to a later version) replay at most 1.1e-5 apart, so the
    # comparison measures the run.
    cluster.script += ["--seed", "2", "--lr", "0.005"]
    return cluster


def by_step(events: Sequence[Event]) -> dict[int, list[int]]:
    """Each step's items, all ranks together, sorted."""
    steps: dict[int, list[int]] = {}
    for e in events:
        steps.setdefault(e["step"], []).extend(e["indices"])
    return {step: sorted(indices) for step, indices in sorted(steps.items())}


def shrink_then_grow(coordinator: Coordinator, tmp_path: Path) -> tuple[list[Event], Any]:
    """3 nodes of one process; one SIGKILLed early in epoch 0, no replacement (the world
    regroups at 2); a new node once the 2 have committed a version of their own (back to
    3). The events and the job's history, after checking every agent's exit status."""
    job = "ddp-elastic"
    cluster = ddp_cluster(coordinator, job, tmp_path, "2:3", step_time=0.2)
    cluster.conf += ",hang_limit=0"  # the survivors stand still on purpose below
    try:
        cluster.start("a", "b", "c")
        committed(coordinator, job, 4)
        cluster.kill("c")  # 3 ranks -> 2
        resumed = [cluster.wait_for(lambda e: e["event"] == "resumed" and e["generation"] == 2)]
        committed(coordinator, job, resumed[0]["step"] + (-resumed[0]["step"] % CHECKPOINT_EVERY))
        # The two stand still while node d's agent starts (tens of seconds on a loaded
        # machine), so that d joins mid-run however long that takes.
        with standing_still(pids_of(cluster, 2)):
            cluster.add("d")  # 2 -> 3
            assert "joined" in ended(coordinator, job, 2)
        cluster.wait_for(lambda e: e["event"] == "resumed" and e["generation"] == 3, timeout=150)
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0, "c": -9, "d": 0}, codes
    return cluster.events(), status(coordinator, job)["history"]


def uninterrupted(coordinator: Coordinator, tmp_path: Path) -> list[Event]:
    """The same job on 3 nodes no one stops, unpaced: its events."""
    work = tmp_path / "uninterrupted"
    work.mkdir()
    cluster = ddp_cluster(coordinator, "ddp-reference", work, "3:3", step_time=0.0)
    run_to_the_end(cluster)
    history = status(coordinator, "ddp-reference")["history"]
    assert [g["world_size"] for g in history] == [3], ends(history)
    return cluster.events()


def test_each_item_is_trained_once_an_epoch_through_a_shrink_and_a_growth(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    began = time.monotonic()
    log, history = shrink_then_grow(coordinator, tmp_path)
    reference = uninterrupted(coordinator, tmp_path)
    print(f"both runs took {time.monotonic() - began:.0f} s")

    assert [g["world_size"] for g in history] == [3, 2, 3], ends(history)
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS
    assert [e["step"] for e in reference if e["event"] == "finished"] == [STEPS] * 3

    # Every generation kept the global batch, and resumed at the step after the
    # version the coordinator named for it, mid-epoch.
    resumed = [e for e in log if e["event"] == "resumed"]
    for generation, world in ((1, 3), (2, 2), (3, 3)):
        mine = [e for e in resumed if e["generation"] == generation]
        assert len(mine) == world, mine
        for e in mine:
            assert e["plan"] == {
                "global_batch": GLOBAL_BATCH,
                "world_size": world,
                "micro_batch": MICRO_BATCH,
                "accumulation": ACCUMULATION[world],
            }
            if generation > 1:
                pointer = history[generation - 1]["checkpoint"]
                assert (e["version"], e["step"]) == (pointer["version"], pointer["step"] + 1)
                assert e["step"] % (SAMPLES // GLOBAL_BATCH), "meant to resume mid-epoch"

    # The two-rank generation committed steps of its own, which the third resumed from.
    assert history[2]["checkpoint"]["step"] >= history[1]["checkpoint"]["step"] + 1
    kept, lost = kept_and_rolled_back(log, "items")
    steps = by_step(kept)
    assert sorted(steps) == list(range(STEPS))
    assert all(len(indices) == GLOBAL_BATCH for indices in steps.values())
    # Each epoch: every item once, none never; 10 steps an epoch at 3 ranks and at 2.
    counts: dict[int, Counter[int]] = {}
    epoch_of: dict[int, int] = {}
    for e in kept:
        counts.setdefault(e["epoch"], Counter()).update(e["indices"])
        epoch_of[e["step"]] = e["epoch"]
    assert sorted(counts) == [0, 1, 2]
    for epoch, count in sorted(counts.items()):
        repeated = sum(n - 1 for n in count.values() if n > 1)
        never = SAMPLES - len(count)
        worlds = sorted({e["world_size"] for e in kept if e["epoch"] == epoch})
        epoch_steps = sorted(step for step, of in epoch_of.items() if of == epoch)
        print(
            f"epoch {epoch}: {repeated} repeated, {never} never trained, "
            f"{len(epoch_steps)} steps at world sizes {worlds}"
        )
        assert (repeated, never) == (0, 0), epoch
        assert epoch_steps == list(range(10 * epoch, 10 * epoch + 10))
    # The rolled-back steps trained what the steps that replaced them did.
    redone = by_step(lost)
    assert redone, "the test means a restart to roll steps back"
    # (A rank stopped between a step and its line leaves that step's items short.)
    for step, indices in redone.items():
        assert len(set(indices)) == len(indices) and set(indices) <= set(steps[step]), step
    print(f"{len(redone)} rolled-back steps re-done: {sorted(redone)}")
    # The same items in the same steps as the uninterrupted run.
    reference_kept, reference_lost = kept_and_rolled_back(reference, "items")
    assert not reference_lost
    assert by_step(reference_kept) == steps
    # Until the kill the two runs are one run: every rank's loss the same, bit for bit.
    first = min(e["step"] for e in resumed if e["generation"] == 2)
    assert {(e["step"], e["rank"]): e["loss"] for e in kept if e["step"] < first} == {
        (e["step"], e["rank"]): e["loss"] for e in reference_kept if e["step"] < first
    }

    # The same number of optimizer steps, and parameters equal up to the rounding of
    # another summation order (2 ranks x 3 accumulation steps for some steps).
    step, model = final_model(coordinator, "ddp-elastic", tmp_path, "model.")
    reference_step, expected = final_model(coordinator, "ddp-reference", tmp_path, "model.")
    assert step == reference_step == STEPS - 1
    difference = largest_relative_difference(model, expected)
    print(f"largest relative difference from the uninterrupted run: {difference:.3g}")
    assert difference < 1e-4
