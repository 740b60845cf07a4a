"""Kubeflow Trainer v2 (deploy/kubeflow/): the manifests against the Trainer's own CRD
schemas, against each other and the coordinator's Service, and ``rallypoint run`` under
the ``PET_*`` variables the Trainer's torch plugin injects (no cluster here)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
import yaml

from rallypoint.cli.processes import Coordinator
from rallypoint.trainer import torchrun_argv

from .test_deploy import KNOWN_ENV, RDZV_CONF, _documents, _env_names

ROOT = Path(__file__).resolve().parent.parent
KUBEFLOW = ROOT / "deploy" / "kubeflow"
#: The Trainer's CRDs (kubeflow/trainer, manifests/base/crds/), kept beside the
#: repository in shared/ and read from there; the variable points elsewhere.
CRDS_ENV = "RALLYPOINT_KUBEFLOW_CRDS"
CRDS = Path(os.environ.get(CRDS_ENV) or ROOT.parent / "shared/reference/kubeflow-trainer")
GROUP_VERSION = "trainer.kubeflow.org/v1alpha1"
#: What the torch plugin sets itself and refuses in a TrainJob's env
#: (pkg/constants: TorchRunReservedEnvNames).
RESERVED = {
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
}


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field
    validation (``kubectl apply --validate=strict``): a field the schema does not name
    is an error, not silently pruned. Also OpenAPI's ``nullable`` in JSON Schema."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def _validators() -> dict[str, jsonschema_rs.Draft4Validator]:
    """One validator per kind the CRDs define (served versions of our group/version)."""
    if not CRDS.is_dir():
        pytest.fail(
            f"no Kubeflow Trainer CRDs at {CRDS}: set {CRDS_ENV} to a folder with "
            "trainer.kubeflow.org_*.yaml from kubeflow/trainer's manifests/base/crds/"
        )
    validators = {}
    for path in sorted(CRDS.glob("trainer.kubeflow.org_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        for version in crd["spec"]["versions"]:
            if f"{crd['spec']['group']}/{version['name']}" == GROUP_VERSION:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                validators[crd["spec"]["names"]["kind"]] = jsonschema_rs.Draft4Validator(schema)
    return validators


def errors(doc: dict[str, Any]) -> list[str]:
    """Why the API server would refuse ``doc``, as far as the CRD's schema says."""
    if doc.get("apiVersion") != GROUP_VERSION or doc.get("kind") not in _validators():
        return [f"{doc.get('apiVersion')} {doc.get('kind')} is no Kubeflow Trainer kind"]
    validator = _validators()[doc["kind"]]
    return [
        "/".join(map(str, e.instance_path)) + ": " + e.message for e in validator.iter_errors(doc)
    ]


def manifests() -> dict[str, dict[str, Any]]:
    """Every document in deploy/kubeflow/, by kind."""
    docs = [
        d
        for path in sorted(KUBEFLOW.glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one document of each kind"
    return by_kind


def test_the_crds_are_the_trainers_own() -> None:
    assert set(_validators()) == {"TrainJob", "TrainingRuntime", "ClusterTrainingRuntime"}


def test_every_manifest_validates_against_the_trainers_crd_schemas() -> None:
    docs = manifests()
    # Only the Trainer's kinds here: the coordinator's core objects are in
    # deploy/kubernetes/, and a core object added here would need a check of its own.
    assert set(docs) == {"ClusterTrainingRuntime", "TrainJob"}
    for doc in docs.values():
        assert errors(doc) == [], doc["kind"]
    # Two of the schema's CEL rules, which JSON Schema cannot run: the TrainJob's name
    # is a DNS label (it names the JobSet, its pods and our job).
    name = docs["TrainJob"]["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63


def _broken(kind: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(manifests()[kind])
    change(doc)
    return doc


def _node_job(runtime: dict[str, Any]) -> dict[str, Any]:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return job  # type: ignore[no-any-return]


def _node_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    return _node_job(runtime)["template"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kind", "change", "complaint"),
    [
        # Trainer v2 removed ElasticPolicy (kubeflow/trainer#3235): the v1-style field
        # is refused, so elasticity cannot quietly be asked of the Trainer.
        (
            "ClusterTrainingRuntime",
            lambda d: d["spec"]["mlPolicy"]["torch"].update(
                elasticPolicy={"minNodes": 2, "maxNodes": 4}
            ),
            "elasticPolicy",
        ),
        ("TrainJob", lambda d: d["spec"]["trainer"].update(numNode=4), "numNode"),
        ("TrainJob", lambda d: d["spec"]["trainer"].update(numNodes="4"), "integer"),
        ("TrainJob", lambda d: d["spec"].pop("runtimeRef"), "runtimeRef"),
        # A patch may not change the node container's command, only what the schema lists.
        (
            "TrainJob",
            lambda d: d["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
                "replicatedJobs"
            ][0]["template"]["spec"]["template"]["spec"].update(
                containers=[{"name": "node", "command": ["torchrun"]}]
            ),
            "command",
        ),
        (
            "ClusterTrainingRuntime",
            lambda d: _node_pod(d).update(terminationGracePeriodSeconds="60s"),
            "integer",
        ),
        ("TrainJob", lambda d: d.update(apiVersion="kubeflow.org/v1"), "no Kubeflow Trainer"),
    ],
    ids=[
        "v1-elastic-policy",
        "misspelt-field",
        "string-count",
        "no-runtime-ref",
        "patched-command",
        "grace-as-string",
        "v1-api",
    ],
)
def test_a_broken_manifest_is_refused(
    kind: str, change: Callable[[dict[str, Any]], None], complaint: str
) -> None:
    found = errors(_broken(kind, change))
    assert found and any(complaint in e for e in found), found


def _resolve(
    env: list[dict[str, Any]], pod: str, labels: dict[str, str], pod_ip: str
) -> dict[str, str]:
    """A container's variables as the kubelet sets them (the downward API and secrets
    this file uses)."""
    out = {}
    for var in env:
        if "value" in var:
            out[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            out[var["name"]] = f"secret:{source['secretKeyRef']['key']}"
            continue
        path = source["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        values = {"metadata.name": pod, "status.podIP": pod_ip}
        out[var["name"]] = labels[label.group(1)] if label else values[path]
    return out


def node_container(index: int) -> tuple[list[str], dict[str, str]]:
    """The node container of TrainJob pod ``index``: its command line (Kubernetes'
    ``$(VAR)`` expanded) and environment, as the Trainer builds them from the runtime
    and the TrainJob (kubeflow/trainer 8c0f5059b: the jobset plugin's builder puts the
    TrainJob's args and env over the runtime's; the torch plugin adds ``PET_*``)."""
    docs = manifests()
    runtime, job = docs["ClusterTrainingRuntime"], docs["TrainJob"]
    trainer = job["spec"]["trainer"]
    name = job["metadata"]["name"]
    (container,) = _node_pod(runtime)["containers"]
    env = {v["name"]: v for v in container["env"]} | {v["name"]: v for v in trainer["env"]}
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    pet = {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29500",
    }
    # The JobSet is the TrainJob's name, and labels its pods with it.
    labels = {"jobset.sigs.k8s.io/jobset-name": name}
    values = _resolve(list(env.values()), f"{name}-node-0-{index}-x7k2p", labels, "10.0.0.7")
    values |= pet
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg)
        for arg in container["command"] + trainer["args"]
    ]
    return argv, values


def test_the_manifests_fit_the_coordinator_the_trainer_and_each_other() -> None:
    docs = manifests()
    runtime, job = docs["ClusterTrainingRuntime"], docs["TrainJob"]
    ref = job["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == ("ClusterTrainingRuntime", runtime["metadata"]["name"])
    assert runtime["spec"]["mlPolicy"]["torch"] == {}  # the torch plugin, no more
    node = _node_job(runtime)
    # The Trainer finds the trainer's Job by this label and its container by this name.
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    pod = _node_pod(runtime)
    (container,) = pod["containers"]
    assert container["name"] == "node"
    assert container["command"][:2] == ["rallypoint", "run"]
    # Rules on exit codes or conditions need restartPolicy Never (Kubernetes' Job API).
    assert pod["restartPolicy"] == "Never"
    rules = node["template"]["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    # Past the notice (Azure: >= 30 s) and torchrun's 30 s for its workers.
    assert pod["terminationGracePeriodSeconds"] > 30
    # The variables: each one the code reads, none the torch plugin reserves.
    names = _env_names(container) | {e["name"] for e in job["spec"]["trainer"]["env"]}
    assert names - {"POD_IP"} <= KNOWN_ENV
    assert not names & RESERVED
    coordinator = _documents("coordinator.yaml")
    service = coordinator["Service"]
    argv, env = node_container(1)
    assert env["RALLYPOINT_URL"] == (
        f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    )
    assert env["RALLYPOINT_TOKEN"] == "secret:token"
    for var in container["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            secret = coordinator["Secret"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    conf = dict(kv.split("=") for kv in env["RALLYPOINT_RDZV_CONF"].split(","))
    assert set(conf) <= RDZV_CONF

    # What `rallypoint run` makes of it all: the job is the TrainJob, min:max nodes are
    # RALLYPOINT_MIN_NODES:numNodes, processes per node the Trainer's, the address the pod's.
    assert argv[:2] == ["rallypoint", "run"]
    out = torchrun_argv(argv[2:], env)
    given = dict(a[2:].split("=", 1) for a in out if a.startswith("--") and "=" in a)
    assert given["rdzv-backend"] == "rallypoint"
    assert given["rdzv-endpoint"] == env["RALLYPOINT_URL"]
    assert given["rdzv-id"] == job["metadata"]["name"]
    assert given["nnodes"] == f"2:{job['spec']['trainer']['numNodes']}"
    assert given["local-addr"] == "10.0.0.7"
    assert "nproc-per-node" not in given  # torchrun reads PET_NPROC_PER_NODE itself
    assert out[out.index("-m") :] == job["spec"]["trainer"]["args"]


# --- rallypoint run under the Trainer's PET_* variables -------------------------------

ENV = {"RALLYPOINT_URL": "http://rallypoint:8080", "RALLYPOINT_JOB": "tj"}
#: As the torch plugin injects them into pod 1 of TrainJob ``tj`` (numNodes 4).
TRAINER_PET = {
    "PET_NNODES": "4",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "tj-node-0-0.tj",
    "PET_MASTER_PORT": "29500",
}


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_a_plain_pet_nnodes_is_the_most_nodes_and_rallypoint_min_the_fewest() -> None:
    assert flags(torchrun_argv(["t.py"], {**ENV, **TRAINER_PET}))["nnodes"] == "1:4"
    env = {**ENV, **TRAINER_PET, "RALLYPOINT_MIN_NODES": "2"}
    assert flags(torchrun_argv(["t.py"], env))["nnodes"] == "2:4"
    # RALLYPOINT_NNODES says both, and wins; a flag wins over everything.
    env["RALLYPOINT_NNODES"] = "3:8"
    assert flags(torchrun_argv(["t.py"], env))["nnodes"] == "3:8"
    assert flags(torchrun_argv(["--nnodes=1:2", "t.py"], env))["nnodes"] == "1:2"
    # PyTorchJob's elasticPolicy puts MIN:MAX there already: torchrun reads it itself.
    v1 = {**ENV, "PET_NNODES": "2:4", "PET_RDZV_BACKEND": "rallypoint"}
    assert "nnodes" not in flags(torchrun_argv(["t.py"], v1))
    assert "rdzv-backend" not in flags(torchrun_argv(["t.py"], v1))


def test_rallypoint_variables_win_over_pet_and_pet_over_derived_defaults() -> None:
    env = {**ENV, **TRAINER_PET}
    given = flags(torchrun_argv(["t.py"], env))
    assert "nproc-per-node" not in given  # PET_NPROC_PER_NODE=auto, read by torchrun
    assert given["max-restarts"] == "100"
    env |= {"RALLYPOINT_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "3"}
    given = flags(torchrun_argv(["t.py"], env))
    assert given["nproc-per-node"] == "2" and "max-restarts" not in given
    # A launcher's endpoint and id give way to Rallypoint's own.
    env |= {"PET_RDZV_ENDPOINT": "elsewhere:29400", "PET_RDZV_ID": "other"}
    given = flags(torchrun_argv(["t.py"], env))
    assert (given["rdzv-endpoint"], given["rdzv-id"]) == ("http://rallypoint:8080", "tj")
    # The static backend's settings are not options we fill: nothing points elsewhere.
    assert not {"master-addr", "master-port", "node-rank"} & set(given)


WORKER = textwrap.dedent(
    """
    import json, os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)  # through the master address the coordinator named
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "RALLYPOINT_JOB")
    print("WORKER " + json.dumps({**{k: os.environ[k] for k in keys},
          "sum": int(total.item())}), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_rallypoint_run_trains_elastically_under_the_trainers_pet_variables(
    tmp_path: Path,
) -> None:
    """Two pods of a TrainJob that asked for three (numNodes 3; the third never gets a
    machine), each with the variables the torch plugin injects: they train as a world of
    two nodes, two processes each, through the coordinator's master address."""
    coordinator = Coordinator(
        ["--storage", f"local:{tmp_path / 'storage'}"], log=tmp_path / "coordinator.log"
    ).start()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "PET_"))}
    nodes = []
    try:
        for index in range(2):
            env = {
                **base,
                "RALLYPOINT_URL": coordinator.url,
                "RALLYPOINT_JOB": "tj-e2e",
                "RALLYPOINT_NODE": f"tj-e2e-node-0-{index}-x7k2p",
                "RALLYPOINT_MIN_NODES": "2",
                # Fail in a minute, not hang, if PET_NNODES made every node wait for 3.
                "RALLYPOINT_RDZV_CONF": "last_call=1,join_timeout=60",
                "PET_NNODES": "3",
                "PET_NPROC_PER_NODE": "2",
                "PET_NODE_RANK": str(index),
                # Where the Trainer's own rendezvous would be: unresolvable here.
                "PET_MASTER_ADDR": "tj-e2e-node-0-0.tj-e2e.invalid",
                "PET_MASTER_PORT": "29500",
            }
            log = (tmp_path / f"node-{index}.log").open("wb")
            nodes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rallypoint", "run", "--local-addr=127.0.0.1", script],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        codes = [p.wait(150) for p in nodes]
        status = httpx.get(f"{coordinator.url}/v1/jobs/tj-e2e", timeout=10).json()
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    logs = [(tmp_path / f"node-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    launched = next(x for x in logs[0].splitlines() if x.startswith("rallypoint run: torchrun"))
    assert "--nnodes=2:3" in launched and "--nproc-per-node" not in launched
    seen = [
        json.loads(line.removeprefix("WORKER "))
        for text in logs
        for line in text.splitlines()
        if line.startswith("WORKER ")
    ]
    assert sorted(int(w["RANK"]) for w in seen) == [0, 1, 2, 3]
    for worker in seen:
        assert (worker["WORLD_SIZE"], worker["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert worker["MASTER_ADDR"] == "127.0.0.1" and worker["sum"] == 4
        assert worker["RALLYPOINT_JOB"] == "tj-e2e"
    assert [g["world_size"] for g in status["history"]] == [2]  # nodes, one generation
