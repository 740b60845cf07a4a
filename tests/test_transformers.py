# ruff: noqa: E501  (the worker script below is data, kept as one block)
"""The HF Trainer through Rallypoint under real torchrun agents (CPU, gloo, DDP):
``RallypointTrainer`` saves as versions and ``train(resume_from_checkpoint=True)``
resumes from the coordinator's version, not from a stale ``checkpoint-N``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.cli.processes import Cluster, Coordinator, judge

from . import test_torchrun
from .test_torchrun import status

pytest.importorskip("transformers")

coordinator = test_torchrun.coordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import xxhash
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments, TrainerCallback
from rallypoint.client import ElasticClient
from rallypoint.trainer.transformers import RallypointTrainer

events, steps = sys.argv[1], int(sys.argv[2])
client = ElasticClient.from_env(); assignment = client.join()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
model = LlamaForCausalLM(cfg)
data = [{"input_ids": torch.arange(i, i + 16) % 64, "labels": torch.arange(i, i + 16) % 64} for i in range(256)]
args = TrainingArguments(output_dir=os.environ["OUT_DIR"], use_cpu=True, max_steps=steps, save_steps=3, per_device_train_batch_size=2, logging_steps=1, report_to=[], learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0)

def digest(trainer):
    h = xxhash.xxh3_64()
    for t in list(trainer.model.state_dict().values()):
        h.update(t.detach().contiguous().float().numpy().tobytes())
    for s in trainer.optimizer.state_dict()["state"].values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().float().contiguous().numpy().tobytes())
    out = [None] * dist.get_world_size(); dist.all_gather_object(out, h.hexdigest()); return out

class Log(TrainerCallback):
    def ev(self, kind, **f):
        line = {"t": time.time(), "event": kind, "generation": assignment.generation, "rank": dist.get_rank(), "world_size": dist.get_world_size(), **f}
        with open(events, "a") as fh: fh.write(json.dumps(line) + "\n")
    def on_train_begin(self, a, state, control, **kw):
        r = trainer.restored
        self.ev("resumed", version=r.version if r else None, step=state.global_step + 1, digests=digest(trainer) if r else None)
    def on_step_end(self, a, state, control, **kw):
        if dist.get_rank() == 0: self.ev("step", step=state.global_step, loss=0.0)
    def on_save(self, a, state, control, **kw):
        d = digest(trainer)
        if dist.get_rank() == 0: self.ev("saving", step=state.global_step, digests=d)
    def on_train_end(self, a, state, control, **kw):
        self.ev("finished", step=state.global_step)

trainer = RallypointTrainer(model=model, args=args, train_dataset=data, callbacks=[Log()], checkpoint_options={"progress": False})
trainer.train(resume_from_checkpoint=True)
trainer.checkpoints.close()
"""


def test_trainer_ddp_resumes_from_the_coordinators_version_not_a_stale_checkpoint(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """A 2-process DDP run saves at steps 3 and 6; a second run of the job with
    ``resume_from_checkpoint=True`` resumes at step 7 from the version of step 6, its
    model and Adam state equal to what was saved, while ``output_dir`` holds a newer
    ``checkpoint-999`` the Trainer's own ``get_last_checkpoint`` would take."""
    script = tmp_path / "hf_worker.py"
    script.write_text(WORKER)
    events = tmp_path / "hf.events.jsonl"
    out = tmp_path / "out"
    (out / "checkpoint-999").mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1", "OUT_DIR": str(out)}
    for steps in (6, 10):
        cluster = Cluster(
            coordinator.url,
            "hf",
            tmp_path,
            nnodes="1",
            script=[str(script), str(events), str(steps)],
        )
        cluster.events_file = events
        try:
            cluster.add("a", nproc=2, env=env)
            assert cluster.wait(timeout=150) == {"a": 0}
        finally:
            cluster.stop()
    log = cluster.events()
    verdict = judge(log, status(coordinator, "hf")["history"])
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == 10
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["version"] is not None]
    assert sorted(e["rank"] for e in resumed) == [0, 1]
    assert all(e["step"] == 7 and e["digests"] == saved[6] for e in resumed)
