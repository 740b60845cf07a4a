"""The HF Trainer's best model and its way out (issue 34): ``metric_for_best_model`` and
``save_total_limit`` become the job's retention, ``load_best_model_at_end`` loads the
coordinator's ``best``, ``save_model`` writes a folder ``from_pretrained`` loads, and a
job's first generation starts from pretrained weights in the user's own files.

One rank in this process, against a coordinator in this process: a tiny Llama built from
a config (nothing is downloaded), a scripted evaluation so the metric's course is known.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager, SavePolicy
from rallypoint.trainer._pack import unpack
from rallypoint.trainer._transformers import monitored_metric, trainer_policy
from rallypoint.trainer.transformers import RallypointTrainer

from .._support import clients, join_all, spec, tiny_llama_config
from ..conftest import Start

#: The evaluation's loss at each step: better until step 2, then worse (1.0 past 6).
LOSSES = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.8, 5: 0.85, 6: 0.9}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**tiny_llama_config(vocab=64, hidden=16, layers=1, heads=2, positions=32))
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, items: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (items, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ScriptedEval(RallypointTrainer):
    """Evaluates to :data:`LOSSES` at each step, logged as the Trainer's own
    ``evaluate`` logs it."""

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = {"eval_loss": LOSSES.get(self.state.global_step, 1.0)}
        self.log(metrics)
        return metrics


class SavedWeights(TrainerCallback):
    """Each save's model weights, by step (a TrainerCallback's ``on_save``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.by_step[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


def node(url: str) -> ElasticClient:
    (client,) = clients(url, ["a"])
    join_all([client], spec(1, 1))
    return client


def args(out: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "save_strategy": "steps",
        "save_steps": 1,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**base, **kw})


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainers_arguments_become_the_jobs_retention() -> None:
    a = args(Path("unused"), load_best_model_at_end=True, eval_strategy="steps", save_total_limit=3)
    assert monitored_metric(a) == "eval_loss"  # HF's default for load_best_model_at_end
    policy = trainer_policy(a, SavePolicy(persist_every=2))
    assert policy.best is not None and (policy.best.metric, policy.best.mode) == (
        "eval_loss",
        "min",
    )
    assert policy.keep_last == 3 and policy.persist_every == 2
    higher = args(Path("unused"), metric_for_best_model="eval_accuracy", greater_is_better=True)
    assert trainer_policy(higher).best.mode == "max"  # type: ignore[union-attr]
    # The user's own rule wins; no limit (or HF's "none" of 0) leaves the coordinator's.
    mine = trainer_policy(a, SavePolicy(keep_best=("eval_f1", "max"), keep_last=9))
    assert mine.best.metric == "eval_f1" and mine.keep_last == 9  # type: ignore[union-attr]
    assert trainer_policy(args(Path("unused"), save_total_limit=0)) == SavePolicy()


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_load_best_model_at_end_loads_the_best_version_which_outlives_collection(
    start: Start, tmp_path: Path
) -> None:
    url = start().url
    saved = SavedWeights()
    trainer = ScriptedEval(
        model=tiny_llama(),
        args=args(
            tmp_path / "out",
            max_steps=6,
            eval_strategy="steps",
            eval_steps=1,
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            save_total_limit=2,
        ),
        train_dataset=Tokens(),
        eval_dataset=Tokens(4),
        callbacks=[saved],
        rallypoint_client=node(url),
        checkpoint_policy=SavePolicy(progress=False),
        watch_preemption=False,
    )
    trainer.train(resume_from_checkpoint=True)

    # The best (step 2) survived collection with the two newest; v1, v3, v4 did not.
    reader = ElasticClient(url, "job", "reader")
    kept = {v.step: v for v in reader.checkpoints()}
    assert sorted(kept) == [2, 5, 6]
    assert kept[2].best_place == 1 and kept[2].metrics == {"eval_loss": 0.5}
    assert kept[6].metrics == {"eval_loss": 0.9} and kept[6].latest
    # The model is step 2's, on the Trainer's own terms.
    model = trainer.model
    assert model is not None
    assert same(model.state_dict(), saved.by_step[2])
    assert not same(model.state_dict(), saved.by_step[6])
    state = trainer.state
    assert state.best_model_checkpoint == f"rallypoint:v{kept[2].version}"
    assert (state.best_metric, state.best_global_step) == (0.5, 2)

    # save_model exports the best version: a folder from_pretrained loads, same logits.
    out = tmp_path / "final"
    trainer.save_model(str(out))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert (f.metadata() or {}).get("rallypoint_version") == str(kept[2].version)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = Tokens(2).ids
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (out / "training_args.bin").exists()

    # Every version records the model's config, as export's hf format reads it.
    m = CheckpointManager(trainer.checkpoints.client, progress=False)
    meta = m.load(kept[6].version).metadata or {}
    assert meta["hf_config"]["hidden_size"] == 16 and "hf_generation_config" in meta
    m.close()
    trainer.checkpoints.close()

    # The next generation resumes at step 6 and loads the best again at its end:
    # best_model_checkpoint came back with the version's trainer state. (The Trainer
    # checks max_steps after a step, so it trains one more, evaluated worse.)
    trainer.checkpoints.client.leave("done")
    (b,) = clients(url, ["b"])
    join_all([b], spec(1, 1))
    again = ScriptedEval(
        model=tiny_llama(seed=1),
        args=trainer.args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(4),
        rallypoint_client=b,
        checkpoint_policy=SavePolicy(progress=False),
        watch_preemption=False,
    )
    again.train(resume_from_checkpoint=True)
    assert again.restored is not None and again.restored.step == 6
    assert again.state.best_model_checkpoint == f"rallypoint:v{kept[2].version}"
    assert again.model is not None and same(again.model.state_dict(), saved.by_step[2])
    again.checkpoints.close()


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_jobs_first_generation_starts_from_pretrained_files_and_its_first_version_holds_them(
    start: Start, tmp_path: Path
) -> None:
    # The user's own pretrained files (here: saved from a config, never downloaded).
    pretrained = tmp_path / "pretrained"
    tiny_llama(seed=7).save_pretrained(pretrained)
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = RallypointTrainer(
        model=model,
        # A learning rate of 0: the version of step 1 holds the pretrained weights.
        args=args(tmp_path / "out", max_steps=1, learning_rate=0.0),
        train_dataset=Tokens(),
        rallypoint_client=node(start().url),
        checkpoint_policy=SavePolicy(progress=False),
        watch_preemption=False,
    )
    # No version yet: save_model is the Trainer's own save of the model in memory.
    trainer.save_model(str(tmp_path / "before"))
    assert (tmp_path / "before" / "model.safetensors").exists()
    trainer.train(resume_from_checkpoint=True)  # no version: a fresh start
    assert trainer.restored is None
    trainer.checkpoints.wait()
    first = trainer.checkpoints.load("latest")
    assert first.step == 1
    assert same(unpack(first.state["model"]), weights)
    assert first.metadata is not None
    assert first.metadata["hf_config"] == json.loads(model.config.to_json_string(use_diff=False))
    trainer.checkpoints.close()
