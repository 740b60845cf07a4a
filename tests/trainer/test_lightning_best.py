"""Lightning's best and last as the coordinator's versions (issue 34): a
``ModelCheckpoint(monitor=..., save_top_k=k)`` run pins its top-k versions, whatever the
job's retention of the newest; ``validate/test/predict(ckpt_path="best"|"last")`` load
the job's best and latest versions, in the process that trained and in one that did not;
and a Lightning version exports to safetensors under the module's own names.

One process each, as a torchrun worker of one (its environment set, a real gloo group
of one), on a coordinator started in this process: Lightning's own Trainer, loops and
ModelCheckpoint, nothing mocked.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from rallypoint.client import ElasticClient, KeepBest
from rallypoint.trainer import SavePolicy, export
from rallypoint.trainer._lightning import MAX_TOP_K, keep_best_of
from rallypoint.trainer.lightning import RallypointDDPStrategy

from .._support import join_all, spec
from ..conftest import Start

pytestmark = pytest.mark.timeout(120)

#: The validation loss of each epoch: better, better, best, then worse twice.
LOSSES = [0.9, 0.5, 0.3, 0.6, 0.8]
BEST = LOSSES.index(min(LOSSES))


class Scripted(pl.LightningModule):
    """A linear model trained for real (its weights change every step) whose
    ``val_loss`` follows :data:`LOSSES`; it keeps its weights at each validation."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(1))  # a buffer: in state_dict() too
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        #: The weights each evaluation ran with (test_step/predict_step).
        self.evaluated: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # type: ignore[no-any-return]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen += 1
        return self(batch[0]).pow(2).mean()  # type: ignore[no-any-return]

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", LOSSES[min(self.current_epoch, len(LOSSES) - 1)])

    def on_validation_epoch_end(self) -> None:
        self.weights[self.current_epoch] = snapshot(self)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.evaluated.append(snapshot(self))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.evaluated.append(snapshot(self))
        return self(batch[0])  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as torchrun's only worker (Lightning's TorchElasticEnvironment: no
    launcher of its own), its process group destroyed after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1"}
    env |= {"LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["TORCHELASTIC_RUN_ID"] = "test"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def trainer(client: ElasticClient, tmp_path: Path, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=RallypointDDPStrategy(client, policy=SavePolicy(progress=False, keep_last=1)),
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


def train(url: str, tmp_path: Path) -> tuple[pl.Trainer, Scripted, ElasticClient]:
    """:data:`LOSSES`' epochs, a version each (the monitoring top-1 saves while the loss
    improves, a second ModelCheckpoint every epoch), on a job that keeps its newest
    version only."""
    (client,) = [ElasticClient(url, "job", "a")]
    join_all([client], spec(1, 1))
    torch.manual_seed(0)
    model = Scripted()
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val_loss", save_top_k=1)
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_epochs=1)
    fitted = trainer(client, tmp_path, max_epochs=len(LOSSES), callbacks=[best, every])
    fitted.fit(model, loader(), loader())
    return fitted, model, client


class Trained(NamedTuple):
    url: str
    fitted: pl.Trainer
    model: Scripted
    client: ElasticClient


@pytest.fixture
def trained(start: Start, tmp_path: Path, worker: None) -> Trained:
    """The run :func:`train` trains on a coordinator started for the test (a test asks
    for the local backend), and the coordinator's URL."""
    url = start().url
    return Trained(url, *train(url, tmp_path))


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_the_best_epoch_survives_collection_and_best_and_last_load_it_and_the_newest(
    trained: Trained, tmp_path: Path
) -> None:
    url, fitted, model, client = trained
    steps_per_epoch = 4
    kept = {v.step: v for v in client.checkpoints()}
    best_step, last_step = (BEST + 1) * steps_per_epoch, len(LOSSES) * steps_per_epoch
    # keep_last=1: the newest; the best by val_loss is pinned; epochs 1, 2 and 4 went.
    assert sorted(kept) == [best_step, last_step]
    assert kept[best_step].best_place == 1
    assert kept[best_step].metrics == {"val_loss": pytest.approx(LOSSES[BEST])}
    assert kept[last_step].metrics == {"val_loss": pytest.approx(LOSSES[-1])}
    assert not same(model.weights[BEST], model.weights[len(LOSSES) - 1])

    # In the process that trained: "best" is the best epoch's weights, not the last's.
    fitted.test(model, loader(), ckpt_path="best")
    assert same(model.evaluated[-1], model.weights[BEST])
    assert same(snapshot(model), model.weights[BEST])
    assert fitted.strategy.session.loaded.version == kept[best_step].version  # type: ignore[attr-defined]
    fitted.test(model, loader(), ckpt_path="last")
    assert same(model.evaluated[-1], model.weights[len(LOSSES) - 1])

    # A fresh Trainer that never trained, on a client that never joins (no round starts):
    # a new model, no ModelCheckpoint; validate, test and predict name the versions.
    generation = client.membership()
    evaluator = ElasticClient(url, "job", "evaluator")
    fresh = Scripted()
    later = trainer(evaluator, tmp_path / "eval", enable_checkpointing=False)
    later.validate(fresh, loader(), ckpt_path="best")
    assert same(snapshot(fresh), model.weights[BEST])
    later.test(fresh, loader(), ckpt_path="last")
    assert same(fresh.evaluated[-1], model.weights[len(LOSSES) - 1])
    later.predict(fresh, loader(), ckpt_path="best")
    assert same(fresh.evaluated[-1], model.weights[BEST])
    assert evaluator.assignment is None
    assert client.membership().generation == generation.generation


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_lightning_version_exports_to_safetensors_under_the_modules_names(
    trained: Trained, tmp_path: Path
) -> None:
    url, _, model, client = trained
    reader = ElasticClient(url, "job", "reader")
    out = tmp_path / "best.safetensors"
    done = export(reader, out, "best", only="state_dict.", progress=False)
    assert done.step == (BEST + 1) * 4
    # The version's state as Lightning's checkpoint holds it: state_dict.<module's name>.
    tensors = load_file(out)
    assert same({k.removeprefix("state_dict."): v for k, v in tensors.items()}, model.weights[BEST])
    # The hf format drops the prefix: the LightningModule's own state_dict() names.
    folder = export(
        reader, tmp_path / "hf", "best", format="hf", only="state_dict.", progress=False
    )
    assert same(load_file(folder.files[0]), model.weights[BEST])

    # fit() still resumes from the version the coordinator names (the latest, not the
    # best) once the node rejoins: one more epoch on top of the last.
    client.leave()
    again = ElasticClient(url, "job", "a")
    join_all([again], spec(1, 1))
    resumed = trainer(again, tmp_path, max_epochs=len(LOSSES) + 1)
    resumed.fit(Scripted(), loader(), loader())
    restored = resumed.strategy.restored  # type: ignore[attr-defined]
    assert (restored.step, resumed.global_step) == (len(LOSSES) * 4, (len(LOSSES) + 1) * 4)


def test_a_model_checkpoints_top_k_becomes_the_coordinators_rule() -> None:
    def rule(**kw: Any) -> KeepBest | None:
        return keep_best_of([object(), ModelCheckpoint(**kw)])

    assert rule(monitor="val_loss", save_top_k=3) == KeepBest(metric="val_loss", count=3)
    assert rule(monitor="val/acc", mode="max") == KeepBest(metric="val/acc", mode="max")
    assert rule(monitor="val_loss", save_top_k=-1) == KeepBest(metric="val_loss", count=MAX_TOP_K)
    assert rule(monitor="val_loss", save_top_k=500).count == MAX_TOP_K  # type: ignore[union-attr]
    assert rule(monitor="val_loss", save_top_k=0) is None  # it keeps nothing
    assert rule(monitor="val loss") is None  # a name the coordinator refuses: logged
    assert rule() is None  # no monitor: the newest, which retention keeps anyway
    # A rule of the policy's own wins over ModelCheckpoint's.
    strategy = RallypointDDPStrategy(policy=SavePolicy(keep_best=("acc", "max")))
    strategy.session.keep_best(KeepBest(metric="val_loss"))
    assert strategy.session.policy.best == KeepBest(metric="acc", mode="max")
    plain = RallypointDDPStrategy()
    plain.session.keep_best(KeepBest(metric="val_loss", count=2))
    assert plain.session.policy.best == KeepBest(metric="val_loss", count=2)
    assert plain.session.policy.progress is False  # the rest of the policy kept
