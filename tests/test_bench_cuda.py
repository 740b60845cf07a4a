"""The GPU benches (``bench/cuda.sh`` and its parts) where CI runs: no CUDA there, so the
one command says so and measures nothing, and the state bench's paths (a model's and
Adam's state saved through ours, DCP and torch.save, restored three ways) run on the
CPU at a small size (its ``--smoke``), so a change that breaks them is seen before a GPU
is lent. The round-trip bench runs through ``SMOKE=1 bench/cuda.sh`` in
``tests/test_benches.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.e2e  # they start bash, python and a coordinator


def test_without_cuda_the_gpu_run_says_so_and_measures_nothing(tmp_path: Path) -> None:
    assert not torch.cuda.is_available(), "this test is for machines without CUDA"
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "cuda.sh"), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CUDA is absent"), done.stdout
    assert not (tmp_path / "logs").exists()  # no part ran


def test_the_state_bench_runs_its_paths_on_the_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        # Its smoke mode: on the CPU, 0.02 GiB of 128-wide layers, one timed save.
        [sys.executable, str(ROOT / "bench" / "cuda_state.py"), "--smoke", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "FAILED" not in out and "DIFFER" not in out, out
    for variant in (
        "pinned copy",
        "ours (memory tier)",
        "dcp.async_save as it comes",
        "dcp.async_save, pinned shared-memory stager",
        "torch.save",
    ):
        assert variant in out, out
    # Three restores into device memory (here the CPU's), each equal bit for bit.
    assert out.count("bit for bit") == 3, out
