"""``rallypoint run`` (torchrun with defaults from the environment; what it says of bad
values and an unreachable coordinator) and training without torchrun (``train_join.py``
under a shell supervisor)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint.cli.processes import free_port, judge
from rallypoint.client import ElasticClient, RetryPolicy, TransportError
from rallypoint.trainer import torchrun_argv
from rallypoint.trainer.agent import (
    FLIGHT_RECORDER_ENTRIES,
    MALLOC_ARENAS,
    WARM_MODULES,
    warm_modules,
    worker_defaults,
)

from ...conftest import Spawn

ENV = {"RALLYPOINT_URL": "http://coord:8080", "RALLYPOINT_JOB": "job1"}


def flags(argv: list[str]) -> dict[str, str]:
    out = {}
    for arg in argv:
        if not arg.startswith("--"):
            break
        name, _, value = arg[2:].partition("=")
        out[name] = value
    return out


def test_workers_keep_a_short_flight_record_and_few_arenas_unless_told_otherwise() -> None:
    record, arenas = str(FLIGHT_RECORDER_ENTRIES), str(MALLOC_ARENAS)
    assert worker_defaults({}) == {"TORCH_FR_BUFFER_SIZE": record, "MALLOC_ARENA_MAX": arenas}
    assert worker_defaults({"TORCH_FR_BUFFER_SIZE": "2000"}) == {"MALLOC_ARENA_MAX": arenas}
    assert worker_defaults({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {"MALLOC_ARENA_MAX": arenas}
    assert worker_defaults({"MALLOC_ARENA_MAX": "8"}) == {"TORCH_FR_BUFFER_SIZE": record}
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.tcache_count=0"}
    assert worker_defaults(tunables) == {"TORCH_FR_BUFFER_SIZE": record}
    other = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert worker_defaults(other) == {"TORCH_FR_BUFFER_SIZE": record, "MALLOC_ARENA_MAX": arenas}


ARENAS = textwrap.dedent(
    """
    import ctypes, sys, threading
    # Eight threads alive at once, each allocating: glibc gives each its own arena while
    # it may make more (8 a core by default).
    gate = threading.Barrier(9)
    def allocate():
        kept = [bytearray(4096) for _ in range(64)]
        gate.wait()
        gate.wait()
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for t in threads:
        t.start()
    gate.wait()
    ctypes.CDLL(None).malloc_stats()  # to stderr: an "Arena N:" block for each
    gate.wait()
    for t in threads:
        t.join()
    """
)


@pytest.mark.e2e
def test_a_worker_makes_no_more_malloc_arenas_than_its_variable_allows(tmp_path: Path) -> None:
    """glibc reads the variable when the process starts: the warm server and the workers
    forked from it, and cold workers, start after ``rallypoint run`` sets it."""
    script = tmp_path / "arenas.py"
    script.write_text(ARENAS)

    def arenas(env: dict[str, str]) -> int:
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return len(re.findall(r"^Arena \d+:", out.stderr, re.MULTILINE))

    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    assert arenas({**base, **worker_defaults(base)}) == MALLOC_ARENAS
    assert arenas(base) > MALLOC_ARENAS  # the limit, not this script, keeps them few


@pytest.mark.e2e
def test_the_flight_record_a_worker_keeps_is_as_long_as_its_variable_says(
    tmp_path: Path,
) -> None:
    """torch reads the variable in the worker (gloo records too): the ring holds what it
    says, where torch's own default holds 2,000 collectives, each with its stack."""
    script = tmp_path / "fr.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, torch, torch.distributed as dist
            from torch._C._distributed_c10d import _dump_fr_trace_json
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
            t = torch.ones(2)
            for _ in range(600):
                dist.all_reduce(t)
            print(len(json.loads(_dump_fr_trace_json()).get("entries", [])))
            dist.destroy_process_group()
            """
        )
    )
    env = {**os.environ, **worker_defaults({})}
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == FLIGHT_RECORDER_ENTRIES


def test_fills_torchrun_flags_from_the_environment() -> None:
    argv = torchrun_argv(["train.py", "--lr", "0.1"], {**ENV, "RALLYPOINT_NNODES": "2:8"})
    assert argv[-3:] == ["train.py", "--lr", "0.1"]
    assert flags(argv) == {
        "rdzv-backend": "rallypoint",
        "rdzv-endpoint": "http://coord:8080",
        "rdzv-id": "job1",
        "nnodes": "2:8",
        "nproc-per-node": "1",
        "max-restarts": "100",
    }


def test_given_flags_and_torchruns_own_variables_win() -> None:
    argv = torchrun_argv(
        ["--nnodes=3", "--max_restarts", "5", "train.py", "--nnodes=9"],
        {**ENV, "RALLYPOINT_NNODES": "2:8", "PET_NPROC_PER_NODE": "4"},
    )
    given = flags(argv)
    assert given["nnodes"] == "3" and "max-restarts" not in given  # the user's own
    assert "nproc-per-node" not in given  # torchrun reads PET_NPROC_PER_NODE itself
    assert argv[-1] == "--nnodes=9"  # the script's argument, untouched


def test_azureml_variables_name_the_job_and_its_size() -> None:
    env = {"RALLYPOINT_URL": "http://c", "AZUREML_RUN_ID": "run_42", "AZUREML_NODE_COUNT": "4"}
    given = flags(torchrun_argv(["train.py"], env))
    assert (given["rdzv-id"], given["nnodes"]) == ("run_42", "1:4")


@pytest.mark.e2e
def test_without_a_coordinator_it_says_what_to_set() -> None:
    with pytest.raises(ValueError, match="RALLYPOINT_URL"):
        torchrun_argv(["train.py"], {"RALLYPOINT_JOB": "j"})
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "train.py"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")},
    )
    assert result.returncode == 2 and "set RALLYPOINT_URL" in result.stderr


#: Variables, and the start of the one line that refuses them.
BAD = [
    ({"PET_NNODES": "abc"}, "PET_NNODES is 'abc'; it takes N or MIN:MAX"),
    ({"RALLYPOINT_NNODES": "4:2"}, "RALLYPOINT_NNODES is '4:2'; it takes N or MIN:MAX"),
    ({"RALLYPOINT_NNODES": "0"}, "RALLYPOINT_NNODES is '0'; it takes N or MIN:MAX"),
    (
        {"RALLYPOINT_MIN_NODES": "5", "PET_NNODES": "4"},
        "RALLYPOINT_MIN_NODES is '5'; it takes a whole number from 1 to PET_NNODES (4)",
    ),
    ({"PET_NPROC_PER_NODE": "lots"}, "PET_NPROC_PER_NODE is 'lots'; it takes a whole"),
    ({"RALLYPOINT_MAX_RESTARTS": "-1"}, "RALLYPOINT_MAX_RESTARTS is '-1'; it takes a whole"),
    ({"RALLYPOINT_RDZV_CONF": "join_timeout=1m"}, "RALLYPOINT_RDZV_CONF is 'join_timeout=1m'"),
    ({"PET_RDZV_CONF": "last_call"}, "PET_RDZV_CONF is 'last_call'; it takes KEY=VALUE"),
    (
        {"RALLYPOINT_RDZV_CONF": "world_sizes=2,4"},
        "RALLYPOINT_RDZV_CONF is 'world_sizes=2,4'; it takes KEY=VALUE pairs",
    ),
    ({"RALLYPOINT_RDZV_CONF": "world_sizes=4/2"}, "RALLYPOINT_RDZV_CONF is 'world_sizes=4/2'"),
    ({"RALLYPOINT_RDZV_CONF": "world_sizes=0/2"}, "RALLYPOINT_RDZV_CONF is 'world_sizes=0/2'"),
    ({"PET_MASTER_PORT": "http"}, "PET_MASTER_PORT is 'http'; it takes a port number"),
    (
        {"RALLYPOINT_WARM_MODULES": "lightning pytorch"},
        "RALLYPOINT_WARM_MODULES is 'lightning pytorch'; it takes module names separated",
    ),
    ({"RALLYPOINT_WARM_MODULES": "a,,b"}, "RALLYPOINT_WARM_MODULES is 'a,,b'; it takes"),
]


@pytest.mark.parametrize(
    ("env", "says"),
    [pytest.param(env, says, id=",".join(f"{k}={v}" for k, v in env.items())) for env, says in BAD],
)
def test_a_bad_variable_is_named_with_what_it_takes(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError) as caught:
        torchrun_argv(["train.py"], {**ENV, **env})
    assert str(caught.value).startswith(says)


def test_good_values_pass_and_an_empty_rallypoint_variable_is_unset() -> None:
    env = {
        **ENV,
        "RALLYPOINT_MIN_NODES": "",
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "auto",
        "PET_MAX_RESTARTS": "3",
        "PET_NODE_RANK": "1",
        "PET_MASTER_PORT": "29500",
        "RALLYPOINT_RDZV_CONF": "last_call=1, join_timeout=60,token=t=x,world_sizes=2/4/8",
        "RALLYPOINT_WARM_MODULES": "lightning.pytorch, transformers",
    }
    assert flags(torchrun_argv(["train.py"], env))["nnodes"] == "1:4"


def test_the_warm_server_imports_torchs_modules_then_the_named_ones_once() -> None:
    assert warm_modules({}) == list(WARM_MODULES)
    named = {"RALLYPOINT_WARM_MODULES": " lightning.pytorch,torch, transformers "}
    assert warm_modules(named) == [*WARM_MODULES, "lightning.pytorch", "transformers"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("name", "value"), [("PET_NNODES", "abc"), ("RALLYPOINT_NNODES", "4:2")], ids=str
)
def test_rallypoint_run_refuses_a_bad_variable_in_one_line(name: str, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "PET_"))}
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "train.py"],
        capture_output=True,
        text=True,
        env={**env, **ENV, name: value},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()  # no traceback, no usage text
    assert line.startswith(f"rallypoint run: {name} is {value!r}; it takes N or MIN:MAX")


def test_each_backoff_names_the_coordinator_it_cannot_reach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ElasticClient(url, "job1", "n1", retry=RetryPolicy(deadline=timedelta(seconds=1)))
    with pytest.raises(TransportError):
        client.join()
    records = [r for r in caplog.records if r.name == "rallypoint.client"]
    assert records and all(r.levelno == logging.WARNING for r in records)
    said = [r.getMessage() for r in records]
    for attempt, message in enumerate(said, start=2):
        assert re.fullmatch(
            rf"cannot reach {url}: connection refused; retrying in [0-9.]+ s, "
            rf"attempt {attempt} \(POST /v1/jobs/job1/join\)",
            message,
        ), message


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_rallypoint_run_names_an_unreachable_coordinator_at_once_and_at_each_backoff() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "PET_"))}
    node = subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node=1", "train.py"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "RALLYPOINT_URL": url, "RALLYPOINT_JOB": "job1"},
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert node.stderr is not None
        for line in node.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sum("attempt" in x for _, x in lines) < 4:
            time.sleep(0.1)
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(30)
        reader.join(10)
    text = "\n".join(x for _, x in lines)
    # From the launcher's line (the interpreter and torch's import before it take what
    # the machine gives them) to the first warning: the join's first failure.
    started = next(t for t, x in lines if x.startswith("rallypoint run: torchrun"))
    warned = [(t, x) for t, x in lines if x.startswith(f"cannot reach {url}: ")]
    assert len(warned) >= 3, text
    assert warned[0][0] - started < 5, text
    attempts = [int(re.search(r"attempt (\d+)", x).group(1)) for _, x in warned]  # type: ignore[union-attr]
    assert attempts[:3] == [2, 3, 4], text
    assert "connection refused; retrying in" in warned[0][1] and "Traceback" not in text


WORKER = textwrap.dedent(
    """
    import sys
    warm = "torch._dynamo" in sys.modules  # before this script imported anything
    import json, os, stat
    from rallypoint.client import ElasticClient
    client = ElasticClient.from_env()
    a = client.join()  # the agent's assignment, asked for with the agent's credential
    keys = ("RALLYPOINT_GENERATION", "RALLYPOINT_NODE", "RANK", "WORLD_SIZE")
    exported = os.environ.get("RALLYPOINT_WORKER_ENV")  # warm workers read it
    mode = stat.S_IMODE(os.stat(exported).st_mode) if exported else None
    print("ASSIGNMENT " + json.dumps({"generation": a.generation, "rank": a.rank,
          "warm": warm, "env": {k: os.environ[k] for k in keys},
          "credential": client.credential == os.environ["RALLYPOINT_CREDENTIAL"] != "",
          "env_file_mode": None if mode is None else oct(mode)}), flush=True)
    os._exit(0)  # as PreemptionWatcher.finish ends one; the agent must see it finish
    """
)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_rallypoint_run_starts_torchrun_with_the_plugin(
    spawn: Spawn, tmp_path: Path, warm: bool
) -> None:
    coordinator = spawn()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {
        **os.environ,
        "RALLYPOINT_URL": coordinator.url,
        "RALLYPOINT_JOB": "runjob",
        "RALLYPOINT_NODE": "only",
        "RALLYPOINT_NNODES": "1:1",
        "RALLYPOINT_RDZV_CONF": "last_call=0",
        "RALLYPOINT_WARM_START": "1" if warm else "0",
    }
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--local-addr=127.0.0.1", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rallypoint run: torchrun --rdzv-backend=rallypoint" in result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("ASSIGNMENT "))
    seen = json.loads(line.removeprefix("ASSIGNMENT "))
    assert seen == {
        "generation": 1,
        "rank": 0,
        # Warm: forked from a server that imported torch and DDP's imports once.
        "warm": warm,
        "env": {
            "RALLYPOINT_GENERATION": "1",
            "RALLYPOINT_NODE": "only",
            "RANK": "0",
            "WORLD_SIZE": "1",
        },
        # The agent's node credential, which the worker acts with (its checkpoint reports).
        "credential": True,
        # The file a warm worker reads it from (with the token) is the user's alone.
        "env_file_mode": "0o600" if warm else None,
    }
    # The worker's join() returned the agent's assignment: it started no round of its own.
    status = ElasticClient(coordinator.url, "runjob").membership()
    assert [g.generation for g in status.history] == [1]


@pytest.mark.e2e
def test_rallypoint_run_starts_warm_workers_under_another_backend_too(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        "import multiprocessing, sys\n"
        "print('WARM', 'torch._dynamo' in sys.modules, 'xml.dom.minidom' in sys.modules)\n"
        "print('STARTS', multiprocessing.get_start_method())\n"
        "sys.exit(0)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rallypoint",
            "run",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=plain",
            "--nnodes=1",
            "--local-addr=127.0.0.1",
            str(script),
        ],
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")},
            # One more module for the server, and one that is not there: skipped.
            "RALLYPOINT_WARM_MODULES": "xml.dom.minidom,no_such_module_here",
        },
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARM True True" in result.stdout
    # The script's own processes start as under torchrun (the platform's default), not
    # from a forkserver of their own that would import the script again and outlive it.
    default = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert f"STARTS {default}" in result.stdout.splitlines(), result.stdout


SUPERVISOR = """
until "$PYTHON" "$SCRIPT" "$@"; do
    code=$?
    [ $code -eq 75 ] || exit $code
done
"""


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_without_torchrun_a_shell_loop_restarts_the_script_on_a_membership_change(
    tmp_path: Path,
) -> None:
    from rallypoint.cli.processes import Coordinator, example_script

    storage = ["--storage", f"local:{tmp_path / 's'}"]
    coordinator = Coordinator(storage, log=tmp_path / "c.log").start()
    events = tmp_path / "events.jsonl"
    loop = tmp_path / "supervise.sh"
    loop.write_text(SUPERVISOR)
    args = ["--nodes", "1:3", "--steps", "120", "--step-time", "0.03", "--addr", "127.0.0.1"]
    args += ["--heartbeat-timeout", "3", "--events", str(events)]

    def node(name: str) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHON": sys.executable,
            # By path, not -m: importing the package would import torch before the join.
            "SCRIPT": str(example_script().with_name("train_join.py")),
            "RALLYPOINT_URL": coordinator.url,
            "RALLYPOINT_JOB": "plain",
            "RALLYPOINT_NODE": name,
        }
        log = (tmp_path / f"{name}.log").open("wb")
        return subprocess.Popen(["bash", str(loop), *args], env=env, stdout=log, stderr=log)

    def wait_for(pred: object) -> None:
        import time

        end = time.monotonic() + 120
        while time.monotonic() < end:
            if events.exists() and any(
                pred(json.loads(x))  # type: ignore[operator]
                for x in events.read_text().splitlines()
                if x.endswith("}")
            ):
                return
            time.sleep(0.05)
        raise TimeoutError

    try:
        nodes = [node("a"), node("b")]
        wait_for(lambda e: e["event"] == "step" and e["step"] >= 20 and e["world_size"] == 2)
        nodes.append(node("c"))  # scale up: a and b exit 75 and their loops restart them
        wait_for(lambda e: e["event"] == "step" and e["world_size"] == 3)
        assert [p.wait(120) for p in nodes] == [0, 0, 0]
        history = ElasticClient(coordinator.url, "plain").membership().model_dump()["history"]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    lines = [json.loads(x) for x in events.read_text().splitlines() if x.endswith("}")]
    verdict = judge(lines, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == 120
    assert [g["world_size"] for g in history][-1] == 3
