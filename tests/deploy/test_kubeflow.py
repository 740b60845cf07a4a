"""Kubeflow Trainer v2 (deploy/kubeflow/): the manifests against the Trainer's API,
against each other and the coordinator's Service, and ``rallypoint run`` under the
``PET_*`` variables the Trainer's torch plugin injects (no cluster here).

The schema tests run once per lane, the lane a parameter of each:

- ``models``, always: the Trainer's API models as PyPI ships them
  (``kubeflow-trainer-api``, generated from the Trainer's OpenAPI document, JobSet and
  the Kubernetes types it embeds included). A document must parse with the models' own
  ``from_dict`` (types, required fields, enum values) and validate against a JSON schema
  generated from the same models with unknown fields refused (``from_dict`` drops them).
- ``crds``, only where ``RALLYPOINT_KUBEFLOW_CRDS`` names a folder with the Trainer's
  CRDs (kubeflow/trainer, manifests/base/crds/; ``.ci/run`` sets it where a copy lies
  beside the checkout): their structural schemas as the API server applies them with
  strict field validation. Without the variable this lane's tests are not collected: the
  CRDs are a second opinion, not something a clone needs.

Both lanes refuse the seven broken variants below; the models lane also refuses an
unknown ``restartPolicy``, an enum the CRDs do not carry.
"""

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
import pydantic
import pytest
import yaml
from kubeflow_trainer_api import models

from rallypoint.cli.processes import Coordinator
from rallypoint.trainer import torchrun_argv

from .._deploy import KNOWN_ENV, RDZV_CONF, documents, env_names

ROOT = Path(__file__).resolve().parents[2]
KUBEFLOW = ROOT / "deploy" / "kubeflow"
#: A folder with the Trainer's CRDs (trainer.kubeflow.org_*.yaml): the ``crds`` lane.
CRDS_ENV = "RALLYPOINT_KUBEFLOW_CRDS"
LANES = ["models", *(["crds"] if os.environ.get(CRDS_ENV) else [])]
GROUP_VERSION = "trainer.kubeflow.org/v1alpha1"
KINDS = {
    "TrainJob": models.TrainerV1alpha1TrainJob,
    "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
    "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime,
}
#: What the torch plugin sets itself and refuses in a TrainJob's env
#: (pkg/constants: TorchRunReservedEnvNames).
RESERVED = {
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
}

#: Why the API server would refuse a document of one kind.
Check = Callable[[dict[str, Any]], list[str]]


def _messages(validator: Any, doc: dict[str, Any]) -> list[str]:
    return [
        "/".join(map(str, e.instance_path)) + ": " + e.message for e in validator.iter_errors(doc)
    ]


def _strict_crd(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field
    validation (``kubectl apply --validate=strict``): a field the schema does not name
    is an error, not silently pruned. Also OpenAPI's ``nullable`` in JSON Schema."""
    if isinstance(schema, list):
        return [_strict_crd(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict_crd(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _crd_checks() -> dict[str, Check]:
    """One check per kind the CRDs define (served versions of our group/version)."""
    folder = Path(os.environ[CRDS_ENV])
    if not folder.is_dir():
        pytest.fail(
            f"{CRDS_ENV}={folder} is no folder: it should hold trainer.kubeflow.org_*.yaml "
            "from kubeflow/trainer's manifests/base/crds/"
        )
    checks: dict[str, Check] = {}
    for path in sorted(folder.glob("trainer.kubeflow.org_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        for version in crd["spec"]["versions"]:
            if f"{crd['spec']['group']}/{version['name']}" == GROUP_VERSION:
                schema = _strict_crd(version["schema"]["openAPIV3Schema"])
                validator = jsonschema_rs.Draft4Validator(schema)
                checks[crd["spec"]["names"]["kind"]] = functools.partial(_messages, validator)
    return checks


_NULL = {"type": "null"}


def _strict_model(schema: Any) -> Any:
    """A JSON schema pydantic generated from the API models, as strict as the API
    server: unknown fields refused (the models ignore them); an optional field absent,
    not null; and a oneOf wrapper of the OpenAPI generator (``IntOrString``,
    ``Quantity``: a model with an ``actual_instance``) the value it wraps."""
    if isinstance(schema, list):
        return [_strict_model(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict_model(v) for k, v in schema.items()}
    wrapped = out.get("properties", {}).get("actual_instance")
    if wrapped is not None:
        return {"anyOf": [s for s in wrapped["anyOf"] if s != _NULL]}
    if _NULL in out.get("anyOf", []):
        # Optional[X] without the null, so that an error names the field, not the anyOf.
        rest = [s for s in out.pop("anyOf") if s != _NULL]
        out |= rest[0] if len(rest) == 1 else {"anyOf": rest}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _model_check(model: type[pydantic.BaseModel], validator: Any, doc: dict[str, Any]) -> list[str]:
    found = _messages(validator, doc)
    try:
        model.from_dict(doc)  # type: ignore[attr-defined]
    except pydantic.ValidationError as exc:
        found += [".".join(map(str, e["loc"])) + ": " + e["msg"] for e in exc.errors()]
    return found


@functools.cache
def checks(lane: str) -> dict[str, Check]:
    if lane == "crds":
        return _crd_checks()
    return {
        kind: functools.partial(
            _model_check,
            model,
            jsonschema_rs.Draft202012Validator(_strict_model(model.model_json_schema())),
        )
        for kind, model in KINDS.items()
    }


def errors(doc: dict[str, Any], lane: str) -> list[str]:
    """Why the API server would refuse ``doc``, as far as ``lane``'s schemas say."""
    if doc.get("apiVersion") != GROUP_VERSION or doc.get("kind") not in checks(lane):
        return [f"{doc.get('apiVersion')} {doc.get('kind')} is no Kubeflow Trainer kind"]
    return checks(lane)[doc["kind"]](doc)


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


@pytest.mark.parametrize("lane", LANES)
def test_the_schemas_are_the_trainers_kinds(lane: str) -> None:
    assert set(checks(lane)) == {"TrainJob", "TrainingRuntime", "ClusterTrainingRuntime"}


@pytest.mark.parametrize("lane", LANES)
def test_every_manifest_validates_against_the_trainers_schemas(lane: str) -> None:
    docs = manifests()
    # Only the Trainer's kinds here: the coordinator's core objects are in
    # deploy/kubernetes/, and a core object added here would need a check of its own.
    assert set(docs) == {"ClusterTrainingRuntime", "TrainJob"}
    for doc in docs.values():
        assert errors(doc, lane) == [], doc["kind"]
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


@pytest.mark.parametrize("lane", LANES)
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
    kind: str, change: Callable[[dict[str, Any]], None], complaint: str, lane: str
) -> None:
    found = errors(_broken(kind, change), lane)
    assert found and any(complaint in e for e in found), found


def test_the_models_refuse_a_value_outside_an_enum() -> None:
    # Rules on exit codes or conditions need restartPolicy Never; the CRDs take any string.
    doc = _broken("ClusterTrainingRuntime", lambda d: _node_pod(d).update(restartPolicy="Nevr"))
    assert any("restartPolicy" in e and "Never" in e for e in errors(doc, "models"))


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
    names = env_names(container) | {e["name"] for e in job["spec"]["trainer"]["env"]}
    assert names - {"POD_IP"} <= KNOWN_ENV
    assert not names & RESERVED
    coordinator = documents("coordinator.yaml")
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
    # A node's workers share its log: two prints can land on one line, "WORKER {..}WORKER {..}".
    seen = [
        json.loads(part)
        for text in logs
        for line in text.splitlines()
        if line.startswith("WORKER ")
        for part in line.split("WORKER ")
        if part.strip()
    ]
    assert sorted(int(w["RANK"]) for w in seen) == [0, 1, 2, 3]
    for worker in seen:
        assert (worker["WORLD_SIZE"], worker["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert worker["MASTER_ADDR"] == "127.0.0.1" and worker["sum"] == 4
        assert worker["RALLYPOINT_JOB"] == "tj-e2e"
    assert [g["world_size"] for g in status["history"]] == [2]  # nodes, one generation
