# ruff: noqa: E501  (the worker script below is data, kept as one block)
"""The HF Trainer through Rallypoint under real torchrun agents (CPU, gloo,
``--rdzv-backend=rallypoint``), with DDP and with ``deepspeed=`` ZeRO-2 (``DS_ACCELERATOR=cpu``):
``RallypointTrainer`` saves as versions and ``train(resume_from_checkpoint=True)`` resumes
every rank from the version the coordinator named, through the SIGKILL of a node and a
preemption notice, never from the stale ``checkpoint-999`` (and DeepSpeed ``latest``) in
``output_dir``.

The worker logs, on every save, the hash of each rank's model and optimizer state
(gathered to rank 0), and on every start the same hash as loaded: the test compares them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, Event, judge

from .._support import status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

#: DeepSpeed on CPU: its accelerator, and gloo under it; one thread per process.
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

WORKER = r"""
import argparse, io, json, os, time
import torch, torch.distributed as dist
import xxhash
from transformers import TrainingArguments, TrainerCallback
from rallypoint.client import ElasticClient
from rallypoint.trainer import SavePolicy
from rallypoint.trainer.transformers import RallypointTrainer

p = argparse.ArgumentParser()
p.add_argument("--events", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=24)
p.add_argument("--save-steps", type=int, default=4)
p.add_argument("--step-time", type=float, default=0.0)
p.add_argument("--zero", type=int, default=0, help="DeepSpeed ZeRO stage; 0: DDP")
p.add_argument("--model", choices=("llama", "bert"), default="llama")
p.add_argument("--persist-every", type=int, default=1)
a = p.parse_args()

client = ElasticClient.from_env(); assignment = client.join()
torch.set_num_threads(1)
torch.manual_seed(0)
V, L = 64, 16
if a.model == "llama":
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=L))
    data = [{"input_ids": torch.arange(i, i + L) % V, "labels": torch.arange(i, i + L) % V} for i in range(512)]
else:  # masked-LM pretraining of a tiny BERT: every 4th token masked (id 1)
    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=L))
    data = []
    for i in range(512):
        ids = (torch.arange(L) * (i % 7 + 1) + i) % (V - 2) + 2
        masked = torch.arange(L) % 4 == i % 4
        data.append({"input_ids": torch.where(masked, 1, ids), "labels": torch.where(masked, ids, -100)})
ds = None
if a.zero:
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True}},
          "zero_optimization": {"stage": a.zero}, "steps_per_print": 10**9}
args = TrainingArguments(output_dir=a.out, use_cpu=True, max_steps=a.steps, save_steps=a.save_steps, per_device_train_batch_size=2, logging_steps=1, report_to=[], learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, deepspeed=ds)

def tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            tensors(value[k], out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors(v, out)

def state():
    # Model (replicated) and this rank's optimizer state (with ZeRO, its partition).
    optimizer = trainer.model_wrapped.optimizer if a.zero else trainer.optimizer
    return {"model": trainer.model.state_dict(), "optimizer": optimizer.state_dict()}

def saves_back():
    # A user's own torch.save of the resumed state loads back equal (issue 36).
    buf = io.BytesIO(); torch.save(state(), buf); buf.seek(0)
    old, new = [], []; tensors(state(), old); tensors(torch.load(buf, weights_only=False), new)
    return len(old) == len(new) and all(torch.equal(x, y) for x, y in zip(old, new))

def digests():
    mine = []
    tensors(state(), mine)
    h = xxhash.xxh3_64()
    for t in mine:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    out = [None] * dist.get_world_size(); dist.all_gather_object(out, h.hexdigest()); return out

class Log(TrainerCallback):
    loss = float("nan")
    def ev(self, kind, **f):
        line = {"t": time.time(), "event": kind, "generation": assignment.generation, "rank": dist.get_rank(), "world_size": dist.get_world_size(), **f}
        with open(a.events, "a") as fh: fh.write(json.dumps(line) + "\n")
    def on_train_begin(self, args, state, control, **kw):
        r = trainer.restored
        self.ev("resumed", version=r.version if r else None, step=state.global_step + 1, digests=digests() if r else None, bytes_from=r.bytes_from if r else None, saves_back=saves_back() if r else None)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs: self.loss = round(float(logs["loss"]), 5)
    def on_step_end(self, args, state, control, **kw):
        if a.step_time: time.sleep(a.step_time)  # paces a tiny model so that a test can act mid-run
        if dist.get_rank() == 0: self.ev("step", step=state.global_step, loss=self.loss)
    def on_save(self, args, state, control, **kw):
        d = digests()
        if dist.get_rank() == 0:
            self.ev("saving", step=state.global_step, digests=d)
            if trainer.emergency:
                self.ev("emergency", step=state.global_step, version=trainer.last_save.result().version)
    def on_train_end(self, args, state, control, **kw):
        self.ev("finished", step=state.global_step, loss=self.loss)

trainer = RallypointTrainer(model=model, args=args, train_dataset=data, callbacks=[Log()], checkpoint_policy=SavePolicy(progress=False, persist_every=a.persist_every))
trainer.train(resume_from_checkpoint=True)
trainer.checkpoints.close()
"""


def stale_output_dir(path: Path) -> Path:
    """An ``output_dir`` as a stale mount could show it: a ``checkpoint-999`` the
    Trainer's ``get_last_checkpoint`` would take, and a DeepSpeed ``latest`` naming a
    tag no version has; their files are garbage (loading them would fail)."""
    folder = path / "checkpoint-999"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 999}))
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")
    (path / "deepspeed" / "global_step999").mkdir(parents=True)
    (path / "deepspeed" / "latest").write_text("global_step999")
    return path


def hf_cluster(
    coordinator: Coordinator, job: str, tmp_path: Path, nnodes: str, *extra: str, **kw: Any
) -> tuple[Cluster, Path]:
    script = tmp_path / "hf_worker.py"
    script.write_text(WORKER)
    events = tmp_path / f"{job}.events.jsonl"
    out = stale_output_dir(tmp_path / "out")  # every node's output_dir: nothing is written
    argv = [str(script), "--events", str(events), "--out", str(out), *extra]
    cluster = Cluster(
        coordinator.url, job, tmp_path, nnodes=nnodes, memory=tmp_path / "memory", script=argv, **kw
    )
    cluster.events_file = events
    return cluster, out


def check_resumes(log: list[Event], history: list[dict[str, Any]], steps: int) -> list[Event]:
    """The checks every run shares; the resumed events of the last generation."""
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps
    # The first generation started fresh: the stale checkpoint-999 was never loaded.
    first = [e for e in log if e["event"] == "resumed" and e["generation"] == 1]
    assert first and {(e["version"], e["step"]) for e in first} == {(None, 1)}
    last = history[-1]
    pointer = last["checkpoint"]
    assert pointer is not None and 0 < pointer["step"] < steps
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == last["generation"]]
    assert all(e["saves_back"] for e in resumed), resumed
    for e in resumed:
        assert (e["version"], e["step"]) == (pointer["version"], pointer["step"] + 1)
        assert sum(e["bytes_from"].values()) > 0
        if len(e["digests"]) == len(saved[pointer["step"]]):  # the same partitioning
            assert e["digests"] == saved[pointer["step"]]
        else:  # DDP at another world size: every rank holds the one replicated state
            assert set(e["digests"]) == set(saved[pointer["step"]]) and len(set(e["digests"])) == 1
    return resumed


def test_trainer_ddp_resumes_every_rank_from_the_named_version_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Nodes a (2 processes), b and c train a tiny Llama with DDP; c is SIGKILLed
    mid-run; a and b regroup (3 processes) and every rank resumes at the step the
    coordinator named, its model and Adam state equal to what was saved there, while
    ``output_dir`` holds a ``checkpoint-999`` ``get_last_checkpoint`` would take."""
    steps = 24
    cluster, _ = hf_cluster(
        coordinator, "hf-ddp", tmp_path, "2:3", "--steps", str(steps), "--step-time", "0.1"
    )
    try:
        cluster.add("a", nproc=2, env=ENV)
        cluster.add("b", env=ENV)
        cluster.add("c", env=ENV)
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["step"] >= 9 and e["world_size"] == 4, timeout=150
        )
        cluster.kill("c")
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert codes["a"] == 0 and codes["b"] == 0, codes
    history = status(coordinator, "hf-ddp")["history"]
    assert [g["world_size"] for g in history] == [3, 2], history  # nodes
    resumed = check_resumes(cluster.events(), history, steps)
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2]


def test_trainer_deepspeed_zero2_resumes_every_rank_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The same with ``deepspeed=`` ZeRO-2: node a (2 processes) and b train; b is
    SIGKILLed; a replacement c (ZeRO keeps its partitioning, so the world comes back to
    3) reads its rank's optimizer partition from a peer's memory or storage; every rank
    restores its own partition at the named step, as saved; the stale ``latest`` and
    ``checkpoint-999`` are never read."""
    steps = 24
    cluster, out = hf_cluster(
        coordinator,
        "hf-zero2",
        tmp_path,
        "2:2",
        "--zero",
        "2",
        "--steps",
        str(steps),
        "--step-time",
        "0.1",
    )
    try:
        cluster.add("a", nproc=2, env=ENV)
        cluster.add("b", env=ENV)
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 9, timeout=150)
        cluster.kill("b")
        cluster.add("c", env=ENV)
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert codes["a"] == 0 and codes["c"] == 0, codes
    history = status(coordinator, "hf-zero2")["history"]
    assert [g["world_size"] for g in history] == [2, 2], history
    resumed = check_resumes(cluster.events(), history, steps)
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2]
    assert len(set(resumed[0]["digests"])) == 3  # three partitions, each rank its own
    assert (out / "deepspeed" / "latest").read_text() == "global_step999"  # there all along


def test_trainer_deepspeed_bert_pretraining_miniature_loses_no_step_to_a_preemption_notice(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """HF Trainer + DeepSpeed ZeRO-2 masked-LM pretraining of a tiny BERT on nodes a
    and b; routine versions stay in memory. A Scheduled Events ``Preempt`` for b: every
    rank stops at one step, the emergency version goes to storage, b leaves cleanly, a
    replacement c joins, and the job resumes from that version with 0 steps lost."""
    steps = 24
    with FakeImds() as imds:
        cluster, _ = hf_cluster(
            coordinator, "hf-preempt", tmp_path, "2:2", "--zero", "2", "--model", "bert",
            "--steps", str(steps), "--step-time", "0.1", "--persist-every", "100",
            imds_url=imds.url,
        )  # fmt: skip
        try:
            cluster.add("a", env=ENV)
            cluster.add("b", env=ENV)
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 6, timeout=150)
            event_id = imds.schedule("b")
            assert cluster.agents["b"].proc.wait(timeout=90) == 0  # saved, left cleanly
            cluster.add("c", env=ENV)
            codes = cluster.wait(timeout=150)
        finally:
            cluster.stop()
    assert imds.acknowledged == [event_id]
    assert codes == {"a": 0, "b": 0, "c": 0}
    history = status(coordinator, "hf-preempt")["history"]
    assert [g["world_size"] for g in history] == [2, 2], history
    assert "preempted (Preempt)" in history[0]["ended_reason"]
    log = cluster.events()
    check_resumes(log, history, steps)
    assert judge(log, history).steps_lost == {2: 0}
    emergency = {e["version"] for e in log if e["event"] == "emergency"}
    pointer = history[1]["checkpoint"]
    assert emergency == {pointer["version"]} and pointer["durable"]
    versions = httpx.get(f"{coordinator.url}/v1/jobs/hf-preempt/checkpoints", timeout=10).json()
    assert "memory" in {v["durability"] for v in versions}  # routine ones stayed in memory
