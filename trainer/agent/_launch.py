"""``rallypoint run``: torchrun with the rallypoint backend and defaults from the
environment, for launchers that cannot pass flags (AzureML commands, Kubernetes pods).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from ._quiet import generation_end, report_uncaught, stop_quietly

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "FLIGHT_RECORDER_ENTRIES",
    "MALLOC_ARENAS",
    "RUN_ENV",
    "WARM_ENV",
    "WARM_MODULES",
    "WARM_MODULES_ENV",
    "WORKER_ENV_FILE",
    "run",
    "torchrun_argv",
    "warm_modules",
    "worker_defaults",
]

#: Workers that fail in a collective when a peer dies count as restarts in torchrun;
#: membership changes the plugin reports do not. A worker whose generation ended waits to
#: be stopped for the change (._quiet), so few of the former remain; room for many.
DEFAULT_MAX_RESTARTS = 100
#: The collectives torch's flight recorder keeps for its hang dumps, in workers that
#: ``rallypoint run`` starts, unless ``TORCH_FR_BUFFER_SIZE`` (or its older name,
#: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) says otherwise. torch keeps 2,000, each with the
#: Python stack that issued it (gloo's too, from torch 2.13): a worker's memory grew
#: 2.2 MB as the ring filled, over its first ~20 generations of the regrouping chaos run
#: (heaptrack: ``c10d::FlightRecorder`` and its captured tracebacks). That run's worker
#: issued about 256 collectives a generation: the shorter ring fills in its first.
FLIGHT_RECORDER_ENTRIES = 256
#: glibc's malloc arenas in workers that ``rallypoint run`` starts, unless
#: ``MALLOC_ARENA_MAX`` (or ``arena_max`` in ``GLIBC_TUNABLES``) says otherwise. glibc
#: makes up to 8 a core, and the threads a regrouping worker starts at every generation
#: (its process group's, the watcher's) take them in turn: in the chaos run (14 rounds,
#: ``/proc/self/smaps`` at each generation) a dozen arenas' tops grew by 16-116 KiB of
#: touched pages each, 0.76 MB of the worker's 0.79 MB rise over 23 generations, while
#: the C heap in use rose 0.1 MB. With 2 arenas the worker's RSS range after the fifth
#: regroup was 0.22 MB against 1.33 MB, and a CPU training step took as long
#: (``bench/malloc_arenas.py``).
MALLOC_ARENAS = 2
#: The variables ``rallypoint run`` reads (besides AzureML's and torchrun's ``PET_*``).
RUN_ENV = (
    "RALLYPOINT_URL",
    "RALLYPOINT_JOB",
    "RALLYPOINT_NNODES",
    "RALLYPOINT_MIN_NODES",
    "RALLYPOINT_NPROC_PER_NODE",
    "RALLYPOINT_MAX_RESTARTS",
    "RALLYPOINT_RDZV_CONF",
    "RALLYPOINT_WARM_START",
    "RALLYPOINT_WARM_MODULES",
)


def _whole(value: str, low: int, high: int | None = None) -> bool:
    if not (value.isascii() and value.isdigit()):
        return False
    return int(value) >= low and (high is None or int(value) <= high)


def _nnodes(value: str) -> bool:
    parts = value.split(":")
    return len(parts) <= 2 and all(_whole(p, 1) for p in parts) and int(parts[0]) <= int(parts[-1])


def _modules(value: str) -> bool:
    """Module names (``lightning.pytorch``) separated by commas."""
    return all(
        part.strip() and all(piece.isidentifier() for piece in part.strip().split("."))
        for part in value.split(",")
    )


def _nproc(value: str) -> bool:
    if _whole(value, 1) or value in ("auto", "cpu", "gpu", "xpu"):
        return True
    import torch

    return value == torch._C._get_privateuse1_backend_name()  # an out-of-tree device's


#: The ``--rdzv-conf`` keys the plugin reads as whole seconds (RendezvousSettings).
_CONF_SECONDS = {
    "heartbeat_timeout",
    "heartbeat_interval",
    "last_call",
    "join_timeout",
    "store_timeout",
    "timeout",
    "hang_limit",
    "phase_limit",
}


def _sizes(value: str) -> bool:
    """World sizes in nodes, ascending, separated by ``/`` (torch splits the conf on
    commas): ``2/4/8``."""
    parts = value.split("/")
    return all(_whole(p.strip(), 1) for p in parts) and all(
        int(a) < int(b) for a, b in itertools.pairwise(parts)
    )


def _conf_value(key: str, value: str) -> bool:
    if key in _CONF_SECONDS:
        return _whole(value, 0)
    return key != "world_sizes" or _sizes(value)


def _conf(value: str) -> bool:
    """What torch's ``--rdzv-conf`` parser takes, the plugin's timeouts whole seconds and
    its ``world_sizes`` node counts separated by ``/``."""
    if not value.strip():
        return True
    pairs = [item.split("=", 1) for item in value.split(",")]
    return all(
        len(pair) == 2
        and pair[0].strip()
        and pair[1].strip()
        and _conf_value(pair[0].strip(), pair[1].strip())
        for pair in pairs
    )


_NNODES = ("N or MIN:MAX, whole numbers with 1 <= MIN <= MAX", _nnodes)
_NPROC = ("a whole number >= 1, or auto, cpu, gpu or xpu", _nproc)
_RESTARTS = ("a whole number >= 0", lambda v: _whole(v, 0))
_CONF = (
    "KEY=VALUE pairs separated by commas, the timeouts in whole seconds, world_sizes as "
    "ascending node counts separated by / (2/4/8)",
    _conf,
)
#: What each variable ``rallypoint run`` or torchrun reads from a launcher takes. Checked
#: before torchrun starts, which would end in a traceback, a bare assertion or usage text
#: naming its flag, not the variable.
_ACCEPTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "RALLYPOINT_NNODES": _NNODES,
    "PET_NNODES": _NNODES,
    "RALLYPOINT_MIN_NODES": ("a whole number >= 1", lambda v: _whole(v, 1)),
    "RALLYPOINT_NPROC_PER_NODE": _NPROC,
    "PET_NPROC_PER_NODE": _NPROC,
    "RALLYPOINT_MAX_RESTARTS": _RESTARTS,
    "PET_MAX_RESTARTS": _RESTARTS,
    "RALLYPOINT_RDZV_CONF": _CONF,
    "PET_RDZV_CONF": _CONF,
    "PET_NODE_RANK": ("a whole number >= 0", lambda v: _whole(v, 0)),
    "PET_MASTER_PORT": ("a port number, 0 to 65535", lambda v: _whole(v, 0, 65535)),
    "RALLYPOINT_WARM_MODULES": ("module names separated by commas", _modules),
}


def _check_env(env: Mapping[str, str]) -> None:
    """Checks the values of the variables :func:`torchrun_argv` and torchrun read.

    An empty ``RALLYPOINT_*`` variable counts as unset, as it does there; an empty
    ``PET_*`` one is a value, as torchrun reads it.

    Raises:
        ValueError: One line that names the first bad variable and what it takes.
    """
    for name, (accepts, valid) in _ACCEPTS.items():
        value = env.get(name)
        if value is None or (not value and name.startswith("RALLYPOINT_")):
            continue
        if not valid(value):
            raise ValueError(f"{name} is {value!r}; it takes {accepts}")


def _given(args: Sequence[str]) -> set[str]:
    """The torchrun options in ``args`` (before the script), normalized."""
    given: set[str] = set()
    for arg in args:
        if not arg.startswith("-"):
            break  # the training script: what follows is its own
        given.add(arg.lstrip("-").split("=", 1)[0].replace("_", "-"))
    return given


def torchrun_argv(args: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's arguments: ``args`` plus every option they leave open.

    Each option comes from the first of: ``args`` (the user's own flags), a
    ``RALLYPOINT_*`` variable, torchrun's ``PET_*`` variable (torchrun reads it itself,
    so it is left to it), and a default Rallypoint derives:

    ====================  =============================  =================================
    option                ``RALLYPOINT_*``               derived default
    ====================  =============================  =================================
    ``--rdzv-backend``                                   ``rallypoint``
    ``--rdzv-endpoint``   ``RALLYPOINT_URL``
    ``--rdzv-id``         ``RALLYPOINT_JOB``             AzureML's ``AZUREML_RUN_ID``
    ``--nnodes``          ``RALLYPOINT_NNODES``          ``RALLYPOINT_MIN_NODES`` (1) to
                          (``MIN:MAX``)                  AzureML's ``AZUREML_NODE_COUNT``
    ``--nproc-per-node``  ``RALLYPOINT_NPROC_PER_NODE``  ``gpu`` with CUDA, else 1
    ``--max-restarts``    ``RALLYPOINT_MAX_RESTARTS``    100
    ``--rdzv-conf``       ``RALLYPOINT_RDZV_CONF``
    ====================  =============================  =================================

    One exception: a ``PET_NNODES`` that is a plain count, as Kubeflow Trainer v2 sets
    it (the TrainJob's ``numNodes``), is taken as the most nodes, and ``--nnodes`` becomes
    ``RALLYPOINT_MIN_NODES`` (1) to it: left to torchrun, it would make every node wait
    for all of them at every restart. A ``MIN:MAX`` one (PyTorchJob's ``elasticPolicy``)
    is left to torchrun. ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``
    need nothing: torchrun uses them only for its ``static`` backend, and the
    coordinator assigns ranks and the master address.

    Raises:
        ValueError: No coordinator URL or job id from any source, or a variable's value
            that torchrun or the plugin would refuse (see :func:`_check_env`).
    """
    env = os.environ if environ is None else environ
    _check_env(env)
    given = _given(args)
    min_nodes = env.get("RALLYPOINT_MIN_NODES") or "1"
    pet_nnodes = env.get("PET_NNODES", "")
    # Where --nnodes is RALLYPOINT_MIN_NODES to a count from the launcher (below).
    most = "PET_NNODES" if "PET_NNODES" in env else "AZUREML_NODE_COUNT"
    from_launcher = not ("nnodes" in given or env.get("RALLYPOINT_NNODES"))
    if from_launcher and env.get(most, "").isdigit() and int(min_nodes) > int(env[most]):
        raise ValueError(
            f"RALLYPOINT_MIN_NODES is {min_nodes!r}; it takes a whole number from 1 to "
            f"{most} ({env[most]})"
        )
    # (option, its RALLYPOINT_* value, the default Rallypoint derives); a callable
    # default is only worked out when needed (it imports torch).
    options: list[tuple[str, str | None, str | Callable[[], str] | None]] = [
        ("rdzv-backend", None, "rallypoint"),
        ("rdzv-endpoint", env.get("RALLYPOINT_URL"), None),
        ("rdzv-id", env.get("RALLYPOINT_JOB"), env.get("AZUREML_RUN_ID")),
        (
            "nnodes",
            env.get("RALLYPOINT_NNODES")
            or (f"{min_nodes}:{pet_nnodes}" if pet_nnodes.isdigit() else None),
            f"{min_nodes}:{env['AZUREML_NODE_COUNT']}" if "AZUREML_NODE_COUNT" in env else None,
        ),
        ("nproc-per-node", env.get("RALLYPOINT_NPROC_PER_NODE"), _gpus_or_one),
        ("max-restarts", env.get("RALLYPOINT_MAX_RESTARTS"), str(DEFAULT_MAX_RESTARTS)),
        ("rdzv-conf", env.get("RALLYPOINT_RDZV_CONF"), None),
    ]
    extra: list[str] = []
    for name, ours, derived in options:
        if name in given:
            continue
        if ours:
            extra.append(f"--{name}={ours}")
        elif _pet(name) not in env and derived is not None:
            extra.append(f"--{name}={derived() if callable(derived) else derived}")
    out = extra + list(args)
    final = _given(out) | {name for name, _, _ in options if _pet(name) in env}
    for name, source in (("rdzv-endpoint", "RALLYPOINT_URL"), ("rdzv-id", "RALLYPOINT_JOB")):
        if name not in final:
            raise ValueError(f"set {source} or pass --{name}")
    return out


def _pet(option: str) -> str:
    """The variable torchrun reads ``--option`` from when the flag is not given."""
    return "PET_" + option.upper().replace("-", "_")


def _gpus_or_one() -> str:
    try:
        import torch
    except ImportError:
        return "1"
    # device_count() asks NVML; is_available() initializes CUDA's driver, after which a
    # process forked from this one cannot use CUDA (bench/warm_cuda.py, on an H200).
    return "gpu" if torch.cuda.device_count() > 0 else "1"


#: Modules the worker-starting server imports once, so that workers started after a
#: membership change do not import torch again (seconds per worker). DDP's constructor
#: imports ``torch._dynamo`` (and sympy with it): 1.8-2.3 s of CPU per worker here.
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "rallypoint.trainer",
)
#: ``0`` turns the warm start off: workers are then fresh interpreters, as torchrun's own.
WARM_ENV = "RALLYPOINT_WARM_START"
#: More modules for the server to import once, separated by commas: a framework's
#: (``lightning.pytorch``, ``transformers``), which each worker would otherwise import at
#: every start (seconds). Not by default: a job that does not use them would pay the
#: imports once per node for nothing. Importing Lightning 2.6 or transformers 5.17 leaves
#: CUDA uninitialized, so workers forked after them train on the GPU (bench/warm_cuda.py).
WARM_MODULES_ENV = "RALLYPOINT_WARM_MODULES"
#: Where the agent's plugin writes the ``RALLYPOINT_*`` variables of the generation it
#: joined: a warm worker's environment is the server's, from before that generation.
WORKER_ENV_FILE = "RALLYPOINT_WORKER_ENV"


def _worker(module: bool, target: str, *args: str) -> None:
    """A worker: runs the training script (or ``-m`` module) as ``__main__``, as the
    interpreter torchrun would start does, in a process forked from the warm server."""
    source = os.environ.get(WORKER_ENV_FILE)
    if source:
        with open(source) as f:
            exported = f.read()
        if exported:  # empty under another rendezvous backend: nothing to take
            for name, value in json.loads(exported).items():
                if value is None:  # the agent unset it since the server started
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    sys.argv = [target, *args]
    # A process that a forkserver started takes "forkserver" as its default start method,
    # so the script's own processes (a DataLoader's workers) would start from a server of
    # their own, which imports the script again (5 s of CPU for a Lightning script here)
    # and outlives this worker when it is killed: its children watch the server, not
    # this process, and hold it open (pairs of ~180 MB each lingered after the Lightning
    # tests). Under torchrun a worker is a fresh interpreter with the platform's default.
    multiprocessing.set_start_method(None, force=True)
    # torch counts a function worker done only when it returns a value: a worker that
    # ends with exit status 0 any other way leaves the agent waiting forever. So
    # sys.exit(0) returns, and so does os._exit(0) from the main thread (as
    # PreemptionWatcher.finish ends a preempted worker). Nothing is lost by unwinding:
    # the process still ends in os._exit, after multiprocessing has sent the result.
    # Only in this process: a child forked from it (a DataLoader's worker) inherits the
    # patch, and its os._exit(0) at its end would unwind into this function's caller and
    # report to the agent as the worker, then wait for the agent forever (ex-loader
    # workers of earlier generations lingered so, ~300 MB each, in the HF Trainer tests).
    real_exit = os._exit
    main = threading.main_thread()
    worker = os.getpid()

    def exit_returns(status: int) -> NoReturn:
        if status == 0 and os.getpid() == worker and threading.current_thread() is main:
            raise SystemExit(0)
        real_exit(status)

    os._exit = exit_returns
    try:
        if module:
            sys.path.insert(0, os.getcwd())  # as `python -m` puts it first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except Exception as exc:
        # Raised here, torch's launcher logs it with its traceback: the generation's
        # end (a lost peer's collective) says one line instead.
        report_uncaught(exc)
        reason = generation_end(exc)
        if reason is None:
            raise
        os._exit = real_exit
        stop_quietly(reason)
    finally:
        os._exit = real_exit


def run(args: Sequence[str]) -> int:
    """Runs torchrun with :func:`torchrun_argv`; returns its exit status.

    Workers start warm: torchrun's agent starts them by forking a server process that
    imported torch once (``forkserver`` with :data:`WARM_MODULES` preloaded), instead of
    a new interpreter that imports torch at every restart. Each worker is still a fresh
    process that runs the script as ``__main__``; the server never touches a GPU, so
    CUDA initializes in the worker as usual. ``RALLYPOINT_WARM_START=0``, ``--no-python``
    or ``--start-method`` give torchrun's own behaviour.
    """
    try:
        argv = torchrun_argv(args)
    except ValueError as exc:
        print(f"rallypoint run: {exc}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.update(worker_defaults(os.environ))  # before any worker or server starts
    print("rallypoint run: torchrun " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        if _warm(argv):
            _launch_warm(argv)
        else:
            torchrun(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except ChildFailedError:
        return 1  # torchrun reported which worker failed, and how
    except SignalException as exc:
        # A node being stopped (a pod deleted, a VM evicted): torchrun stopped the
        # workers already, and its traceback says nothing more than this line.
        name = signal.Signals(exc.sigval).name
        print(f"rallypoint run: stopped by {name}; its workers ended", file=sys.stderr)
        return 128 + exc.sigval
    return 0


def worker_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``rallypoint run`` adds to its workers' environment where
    ``environ`` does not set them: :data:`FLIGHT_RECORDER_ENTRIES` and
    :data:`MALLOC_ARENAS`."""
    out = {}
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & environ.keys():
        out["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    if "MALLOC_ARENA_MAX" not in environ and "arena_max" not in environ.get("GLIBC_TUNABLES", ""):
        out["MALLOC_ARENA_MAX"] = str(MALLOC_ARENAS)
    return out


def _warm(argv: Sequence[str]) -> bool:
    given = _given(argv)
    return (
        os.environ.get(WARM_ENV, "1") != "0"
        and not {"no-python", "start-method", "standalone", "run-path"} & given
    )


def warm_modules(environ: Mapping[str, str] | None = None) -> list[str]:
    """What the warm server imports: :data:`WARM_MODULES`, then those named in
    ``RALLYPOINT_WARM_MODULES``. A module that fails to import is skipped there (as
    ``multiprocessing`` does with any preload), and the worker's own import reports it."""
    env = os.environ if environ is None else environ
    extra = [part.strip() for part in env.get(WARM_MODULES_ENV, "").split(",") if part.strip()]
    return list(dict.fromkeys([*WARM_MODULES, *extra]))


def _launch_warm(argv: Sequence[str]) -> None:
    """What ``torch.distributed.run.run`` does, with :func:`_worker` as the entrypoint
    (a function, as torchrun's own ``--run-path`` uses) and a warm ``forkserver``."""
    import multiprocessing.forkserver

    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    torch.multiprocessing._set_thread_name("pt_elastic")  # as torchrun names its agent
    parsed = get_args_parser().parse_args(list(argv))
    parsed.start_method = "forkserver"
    if parsed.master_port is None:
        parsed.master_port = 29500  # as torchrun's run() sets it (static backend only)
    config, _, _ = config_from_args(parsed)
    multiprocessing.set_forkserver_preload(warm_modules())
    with tempfile.NamedTemporaryFile(prefix="rallypoint-worker-env-", suffix=".json") as state:
        os.environ[WORKER_ENV_FILE] = state.name  # before the server starts: it inherits it
        # The server starts now, beside the rendezvous, not at the first worker start:
        # its imports (seconds) overlap the join, and a standby's server is warm while
        # it parks, so a replacement's workers fork at once (they inherit nothing of the
        # agent's later environment either way: the generation's comes in the file).
        threading.Thread(
            target=multiprocessing.forkserver.ensure_running, name="rallypoint-warm", daemon=True
        ).start()
        elastic_launch(config=config, entrypoint=_worker)(
            bool(parsed.module), parsed.training_script, *parsed.training_script_args
        )
