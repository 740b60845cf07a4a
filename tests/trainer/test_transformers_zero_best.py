# ruff: noqa: E501  (the worker script below is data, kept as one block)
"""The HF Trainer's best model under DeepSpeed ZeRO-3 (issue 34), on two torchrun agents
(CPU, gloo, ``--rdzv-backend=rallypoint``, ``DS_ACCELERATOR=cpu``).

A tiny Llama built from a config (nothing is downloaded) learns one rule of next tokens
(``+1``) for the first half of the run and another (``+7``) for the second, in order
(``train_sampling_strategy="sequential"``); the evaluation set follows the first rule,
so its loss improves while the first rule is trained and worsens once the second one is:
the best version is one of the middle, not the latest. With ``metric_for_best_model``,
``load_best_model_at_end`` and ``save_total_limit=1``, the end of ``train()`` must leave
every rank holding the best version's model (loaded through DeepSpeed's own
``load_checkpoint``), the best version must outlive collection beside the latest, and
``save_model`` must write a folder ``from_pretrained`` loads with the same logits. The
test process, which never joins, exports ``best`` in ``hf`` format as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rallypoint.cli.processes import Cluster, Coordinator
from rallypoint.client import ElasticClient
from rallypoint.trainer import export

from .._support import status

#: DeepSpeed on CPU: its accelerator, and gloo under it; one thread per process.
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

#: Optimizer steps, and the evaluation (and save) interval; the first half of the steps
#: trains the evaluation's rule.
STEPS, EVERY = 12, 2

WORKER = r"""
import argparse, json, os
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from rallypoint.trainer import SavePolicy
from rallypoint.trainer.transformers import RallypointTrainer

p = argparse.ArgumentParser()
p.add_argument("--out", required=True, help="output_dir")
p.add_argument("--results", required=True, help="each rank's logits, rank 0's state, save_model's folder")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--every", type=int, required=True)
p.add_argument("--no-best", action="store_true", help="no evaluation, no save, no best")
a = p.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
V, L, MICRO, WORLD = 16, 16, 2, 2
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=L))

def sequence(start, stride):
    ids = (start + stride * torch.arange(L)) % V
    return {"input_ids": ids, "labels": ids}

class Rule(torch.utils.data.Dataset):
    # Item i starts at token i; the first `switch` items step by +1, the rest by +7:
    # each sequence of either rule goes through all V tokens, so every step trains
    # every transition of its rule, and the two rules disagree on each.
    def __init__(self, n, switch): self.n, self.switch = n, switch
    def __len__(self): return self.n
    def __getitem__(self, i): return sequence(i, 1 if i < self.switch else 7)

half = a.steps // 2 * MICRO * WORLD  # items of the first half of the steps
train = Rule(2 * half, half)
first_rule = Rule(8, 8)
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True}},
      "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
args = TrainingArguments(
    output_dir=a.out, use_cpu=True, report_to=[], disable_tqdm=True, deepspeed=ds, seed=0,
    max_steps=a.steps, per_device_train_batch_size=MICRO, per_device_eval_batch_size=4,
    learning_rate=1e-2, lr_scheduler_type="constant", train_sampling_strategy="sequential",
    adam_beta1=0.5,  # the first rule's momentum fades within a step or two of the switch
    eval_strategy="no" if a.no_best else "steps", eval_steps=a.every,
    save_strategy="no" if a.no_best else "steps", save_steps=a.every, logging_steps=1,
    metric_for_best_model=None if a.no_best else "loss", load_best_model_at_end=not a.no_best,
    save_total_limit=1)
trainer = RallypointTrainer(model=model, args=args, train_dataset=train, eval_dataset=first_rule, checkpoint_policy=SavePolicy(progress=False), watch_preemption=False)
trainer.train(resume_from_checkpoint=True)

# The model every rank holds now: ZeRO-3's forward gathers the partitions, on every rank.
probe = torch.stack([sequence(5, 1)["input_ids"], sequence(3, 7)["input_ids"], sequence(9, 3)["input_ids"]])
engine = trainer.model_wrapped
engine.eval()
with torch.no_grad():
    logits = engine(input_ids=probe).logits
rank = dist.get_rank()
torch.save({"probe": probe, "logits": logits}, os.path.join(a.results, f"rank{rank}.pt"))
# HF's save_model under ZeRO-3 gathers on every rank.
trainer.save_model(os.path.join(a.results, "saved"))
trainer.checkpoints.wait()
if rank == 0:
    s = trainer.state
    evals = {e["step"]: e["eval_loss"] for e in s.log_history if "eval_loss" in e}
    with open(os.path.join(a.results, "state.json"), "w") as f:
        json.dump({"evals": evals, "global_step": s.global_step, "best_model_checkpoint": s.best_model_checkpoint, "best_metric": s.best_metric, "best_global_step": s.best_global_step}, f)
trainer.checkpoints.close()
"""


def run(coordinator: Coordinator, job: str, tmp_path: Path, *args: str) -> Path:
    """The worker on nodes a and b (2 ranks of ZeRO-3), to the end; its results' folder."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = tmp_path / "results"
    results.mkdir()
    argv = [str(script), "--out", str(tmp_path / "out"), "--results", str(results), *args]
    cluster = Cluster(
        coordinator.url, job, tmp_path, nnodes="2:2", memory=tmp_path / "memory", script=argv
    )
    try:
        cluster.start("a", "b", env=ENV)
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0}, codes
    assert [g["world_size"] for g in status(coordinator, job)["history"]] == [2]
    return results


def logits_of(folder: Path, probe: torch.Tensor) -> torch.Tensor:
    """The logits on ``probe`` of the model ``from_pretrained`` loads from ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=probe).logits
    return logits


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_zero3_trainer_ends_holding_the_best_version_which_outlives_collection_and_exports(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """HF Trainer + ZeRO-3 on nodes a and b, 12 steps evaluated and saved every 2: the
    evaluation loss improves over the first rule's steps and worsens after them. At the
    end every rank's model gives the logits of ``best`` exported by a process that never
    joined, ``from_pretrained`` on the export (with the ``config.json`` the version
    recorded) and on ``save_model``'s folder; ``best`` is not the latest version, and
    with ``save_total_limit=1`` the two are all that collection left."""
    job = "hf-zero3-best"
    results = run(coordinator, job, tmp_path, "--steps", str(STEPS), "--every", str(EVERY))

    # The evaluation's course: better over the first rule's steps, then worse.
    state = json.loads((results / "state.json").read_text())
    evals = {int(step): loss for step, loss in state["evals"].items()}
    print(f"{job}: eval_loss by step {evals}")
    steps = list(range(EVERY, STEPS + 1, EVERY))
    assert sorted(evals) == steps and state["global_step"] == STEPS
    best_step = min(evals, key=evals.__getitem__)
    assert best_step == STEPS // 2, evals  # the last step of the first rule
    before = [evals[s] for s in steps if s <= best_step]
    after = [evals[s] for s in steps if s >= best_step]
    assert before == sorted(before, reverse=True) and after == sorted(after), evals
    assert len(set(evals.values())) == len(evals), evals  # strictly

    # best is the coordinator's best by eval_loss, not the latest, and it outlived
    # collection: keep_last=1 (save_total_limit) leaves it and the latest only.
    reader = ElasticClient(coordinator.url, job, "reader")
    kept = {v.step: v for v in reader.checkpoints()}
    assert sorted(kept) == [best_step, STEPS], kept
    best, latest = kept[best_step], kept[STEPS]
    assert best.best_place == 1 and latest.latest and not best.latest
    assert best.metrics["eval_loss"] == evals[best_step]
    assert reader.checkpoint("best").version == best.version
    assert state["best_model_checkpoint"] == f"rallypoint:v{best.version}"
    assert (state["best_global_step"], state["best_metric"]) == (best_step, evals[best_step])

    # Every rank holds the best version's model: the logits of its hf export, loaded by
    # from_pretrained, with the config.json the version recorded.
    ranks = [torch.load(results / f"rank{r}.pt") for r in range(2)]
    probe, held = ranks[0]["probe"], ranks[0]["logits"]
    torch.testing.assert_close(ranks[1]["logits"], held, rtol=0, atol=0)  # ZeRO: one model
    done = export(reader, tmp_path / "best", "best", format="hf", progress=False)
    assert done.version == best.version
    config = json.loads((tmp_path / "best" / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["vocab_size"]) == ("llama", 32, 16)
    from_best = logits_of(tmp_path / "best", probe)
    difference = float((from_best - held).abs().max())
    print(f"{job}: best v{best.version} (step {best_step}); rank 0 vs its export {difference:.3g}")
    torch.testing.assert_close(from_best, held, rtol=1e-5, atol=1e-5)
    # Not the model the run ended with: the latest version's logits are elsewhere.
    export(reader, tmp_path / "latest", "latest", format="hf", progress=False)
    from_latest = logits_of(tmp_path / "latest", probe)
    apart = float((from_latest - held).abs().max())
    print(f"{job}: latest v{latest.version} vs rank 0 {apart:.3g}")
    assert apart > 1e-2

    # save_model wrote a folder from_pretrained loads, with the same model: the best
    # version, exported (consolidated by DeepSpeed's zero_to_fp32) on rank 0.
    with safe_open(str(results / "saved" / "model.safetensors"), "pt") as f:
        assert (f.metadata() or {}).get("rallypoint_version") == str(best.version)
    saved = logits_of(results / "saved", probe)
    torch.testing.assert_close(saved, held, rtol=1e-5, atol=1e-5)
    print(f"{job}: save_model vs rank 0 {float((saved - held).abs().max()):.3g}")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_zero3_save_model_saves_the_model_in_memory_as_a_version_and_exports_it(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """13 steps with no save (``save_strategy="no"``): the model the run ends with is no
    version's. ``save_model`` saves it as one on both ranks, then exports it: a folder
    ``from_pretrained`` loads with the trained logits. (The Trainer's own save under
    ZeRO-3 without the gather flag writes DeepSpeed's files and no weights: without the
    fix this test finds no model.safetensors.)"""
    job = "hf-zero3-save-model"
    results = run(coordinator, job, tmp_path, "--steps", "13", "--every", "13", "--no-best")
    held = torch.load(results / "rank0.pt")
    reader = ElasticClient(coordinator.url, job, "reader")
    latest = reader.checkpoint("latest")
    assert latest.step == 13  # save_model's version
    with safe_open(str(results / "saved" / "model.safetensors"), "pt") as f:
        assert (f.metadata() or {}).get("rallypoint_version") == str(latest.version)
    saved = logits_of(results / "saved", held["probe"])
    torch.testing.assert_close(saved, held["logits"], rtol=1e-5, atol=1e-5)
