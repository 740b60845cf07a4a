"""A DeepSpeed ZeRO version leaves the job whole (issue 34): two ranks train a small
causal LM under ZeRO-2 or ZeRO-3 and save it through ``rallypoint.trainer.deepspeed``;
one process that is not a member exports the version, and the model loaded from the
export (``AutoModelForCausalLM.from_pretrained`` on the ``hf`` folder, or the
``safetensors`` file into a fresh model) gives the trained model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rallypoint.client import ElasticClient
from rallypoint.trainer import export

from ..._ranks import run_ranks
from ..._support import tiny_llama_config
from ...conftest import Start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONFIG = tiny_llama_config(vocab=97, hidden=32, layers=2, heads=4, positions=64)

BODY = r"""
import json, os, tempfile
import torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
import rallypoint.trainer.deepspeed as rp_deepspeed
from rallypoint.trainer import SavePolicy

STAGE = __STAGE__

def run(client, a):
    # Each process is a node of its own: what torchrun would set for DeepSpeed.
    os.environ.update(LOCAL_RANK="0", RANK=str(a.rank), WORLD_SIZE=str(a.world_size))
    torch.manual_seed(0)
    config = LlamaConfig(**__CONFIG__)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": STAGE},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ours = rp_deepspeed.install(engine, client, policy=SavePolicy(progress=False))
    g = torch.Generator().manual_seed(a.rank)
    for _ in range(3):
        ids = torch.randint(0, 97, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    # What the HF Trainer integration records; a DeepSpeed loop of one's own may too.
    ours.metadata = {"hf_config": json.loads(config.to_json_string(use_diff=False))}
    ours.save_checkpoint(tempfile.mkdtemp(), blocking=True)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=torch.arange(16).reshape(1, 16)).logits
    ours.close()
    return {"logits": logits.tolist()}
"""


@pytest.mark.parametrize("backend", ["local"], indirect=True)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_version_exports_a_model_that_gives_the_trained_logits(
    start: Start, tmp_path: Path, stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    url = start().url
    body = BODY.replace("__STAGE__", str(stage)).replace("__CONFIG__", repr(CONFIG))
    results = run_ranks(url, f"zero{stage}", ["a", "b"], body, tmp_path, timeout=240)
    assert all("error" not in r for r in results), results
    trained = torch.tensor(results[0]["logits"])
    assert torch.equal(trained, torch.tensor(results[1]["logits"]))  # ZeRO: one model
    exporter = ElasticClient(url, f"zero{stage}", "exporter")
    probe = torch.arange(16).reshape(1, 16)

    if stage == 3:
        done = export(exporter, tmp_path / "hf", format="hf", progress=False)
        assert {f.name for f in done.files} == {"model.safetensors", "config.json"}
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == 32
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    else:
        export(exporter, tmp_path / "m.safetensors", progress=False)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model.load_state_dict(load_file(tmp_path / "m.safetensors"))  # strict: every name
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    # fp32 on CPU: the master weights ZeRO keeps are the model's own.
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)
