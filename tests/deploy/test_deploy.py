"""The container, compose, Kubernetes and AzureML files: parsed and checked against what
the code reads (no Docker engine, cluster or Azure here), and their commands run outside
containers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rallypoint.client import (
    ENDPOINT_KEY_ENV,
    NODE_ENV,
    TRANSPORT_ENV,
    URL_ENV,
)
from rallypoint.service.settings import Settings

from .._coordinator import Coordinator
from .._deploy import KNOWN_ENV, RDZV_CONF, ROOT, documents, env_names

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def stage(name: str) -> str:
    """The instructions of one build stage."""
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert match, f"no stage {name}"
    return match.group(1)


def test_the_coordinator_image_is_slim_unprivileged_and_health_checked() -> None:
    coordinator = stage("coordinator")
    assert 'pip install ".[service]"' in coordinator and "torch" not in coordinator
    assert re.search(r"^USER rallypoint$", coordinator, re.M)
    assert "/healthz" in coordinator and "HEALTHCHECK" in coordinator
    assert 'CMD ["rallypoint", "serve"]' in coordinator
    assert "EXPOSE 8080" in coordinator
    env = dict(re.findall(r"(RALLYPOINT_\w+)=(\S+)", coordinator))
    assert set(env) <= KNOWN_ENV and env["RALLYPOINT_PORT"] == "8080"
    assert re.search(r"^USER rallypoint$", stage("trainer"), re.M)
    assert "download.pytorch.org/whl/cpu" in stage("trainer")  # not the CUDA wheels


def test_compose_is_consistent_with_the_images_and_the_code() -> None:
    services = COMPOSE["services"]
    assert set(services) == {"azurite", "coordinator", "trainer-1", "trainer-2"}
    assert services["azurite"]["image"] == "mcr.microsoft.com/azure-storage/azurite"
    assert "--inMemoryPersistence" in services["azurite"]["command"]
    coordinator = services["coordinator"]
    assert coordinator["build"]["target"] == "coordinator"
    assert "8080:8080" in coordinator["ports"]
    conn = coordinator["environment"]["AZURE_STORAGE_CONNECTION_STRING"]
    assert "http://azurite:10000/" in conn and "http://azurite:10002/" in conn
    for name in ("trainer-1", "trainer-2"):
        trainer = services[name]
        assert trainer["build"]["target"] == "trainer"
        assert trainer["depends_on"]["coordinator"]["condition"] == "service_healthy"
        env = trainer["environment"]
        assert env["RALLYPOINT_URL"] == "http://coordinator:8080"
        assert env["RALLYPOINT_NODE"] == name and env["RALLYPOINT_JOB"] == "compose"
        assert env["RALLYPOINT_TOKEN"] == coordinator["environment"]["RALLYPOINT_TOKEN"]
        assert trainer["command"][:2] == ["rallypoint", "run"]
        assert f"--local-addr={name}" in trainer["command"]
    for service in services.values():
        assert set(service.get("environment") or {}) <= KNOWN_ENV


def _endpoint(conn: str, kind: str) -> str:
    return re.search(rf"{kind}Endpoint=(http://[^/;]+)", conn).group(1)  # type: ignore[union-attr]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_compose_commands_train_against_azurite_outside_containers(
    azurite: str, tmp_path: Path
) -> None:
    services = COMPOSE["services"]
    env = dict(services["coordinator"]["environment"])
    conn = env["AZURE_STORAGE_CONNECTION_STRING"]
    for kind in ("Blob", "Table"):  # the compose network's azurite is this test's
        conn = conn.replace(_endpoint(conn, kind), _endpoint(azurite, kind))
    env["AZURE_STORAGE_CONNECTION_STRING"] = conn
    env["RALLYPOINT_STORAGE_PREFIX"] = "compose" + os.urandom(3).hex()
    coordinator = Coordinator([], env, log=tmp_path / "coordinator.log").start()
    try:
        procs = []
        for name in ("trainer-1", "trainer-2"):
            trainer = services[name]
            command = [
                "--local-addr=127.0.0.1" if arg.startswith("--local-addr=") else arg
                for arg in trainer["command"]
            ]
            assert command[0] == "rallypoint"
            tenv = {**os.environ, **trainer["environment"], "RALLYPOINT_URL": coordinator.url}
            with (tmp_path / f"{name}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", *command], env=tenv, stdout=log, stderr=log
                    )
                )
        codes = [p.wait(240) for p in procs]
        headers = {"Authorization": f"Bearer {env['RALLYPOINT_TOKEN']}"}
        job = httpx.get(f"{coordinator.url}/v1/jobs/compose", headers=headers).json()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    assert codes == [0, 0], (tmp_path / "trainer-1.log").read_text()[-3000:]
    assert job["checkpoint"]["step"] == 190  # the example saves every 10 of 200 steps


def test_the_kubernetes_manifests_fit_the_coordinator_and_each_other() -> None:
    from rallypoint.service.app import create_app

    routes = set(create_app(Settings()).openapi()["paths"])
    docs = documents("coordinator.yaml")
    assert set(docs) == {"Secret", "Deployment", "Service"}
    secret_keys = set(docs["Secret"]["stringData"])
    spec = docs["Deployment"]["spec"]
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"] == spec["template"]["metadata"]["labels"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" and "/readyz" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and "/healthz" in routes
    # Both answer from memory (tests/e2e/test_failover.py: HAProxy's 1 s checks through a
    # frozen storage); the grace, not the probe, decides when storage makes one unready.
    assert container["readinessProbe"]["timeoutSeconds"] == 1
    assert container["livenessProbe"]["timeoutSeconds"] == 1
    assert env_names(container) <= KNOWN_ENV
    for env in container["env"]:
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == docs["Secret"]["metadata"]["name"] and ref["key"] in secret_keys
    port = container["ports"][0]
    values = {e["name"]: e.get("value") for e in container["env"]}
    assert port["containerPort"] == 8080 and values["RALLYPOINT_PORT"] == "8080"
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert "requests" in container["resources"] and "limits" in container["resources"]

    job = documents("pytorchjob.yaml")["PyTorchJob"]["spec"]
    elastic = job["elasticPolicy"]
    assert elastic["rdzvBackend"] == "rallypoint"
    assert elastic["rdzvId"] == documents("pytorchjob.yaml")["PyTorchJob"]["metadata"]["name"]
    assert elastic["rdzvHost"] == docs["Service"]["metadata"]["name"]
    assert elastic["rdzvPort"] == docs["Service"]["spec"]["ports"][0]["port"]
    assert elastic["minReplicas"] <= elastic["maxReplicas"]
    (trainer,) = job["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert trainer["command"][:2] == ["rallypoint", "run"]
    assert env_names(trainer) <= KNOWN_ENV
    conf = {c["key"] for c in elastic["rdzvConf"]}
    assert conf <= RDZV_CONF


AZUREML = ROOT / "deploy" / "azureml"


def _azureml(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((AZUREML / name).read_text())
    return loaded


def test_the_azureml_endpoint_fits_the_coordinator() -> None:
    from rallypoint.client._client import _POLL
    from rallypoint.service.app import create_app

    paths = create_app(Settings()).openapi()["paths"]
    endpoint, deployment = _azureml("endpoint.yml"), _azureml("deployment.yml")
    assert endpoint["auth_mode"] == "key"
    assert deployment["endpoint_name"] == endpoint["name"]
    routes = deployment["environment"]["inference_config"]
    assert "get" in paths[routes["liveness_route"]["path"]]
    assert routes["liveness_route"]["path"] == "/healthz"
    assert routes["readiness_route"]["path"] == "/readyz"
    assert deployment["readiness_probe"]["timeout"] == deployment["liveness_probe"]["timeout"] == 1
    assert "post" in paths[routes["scoring_route"]["path"]]
    assert routes["scoring_route"]["path"] == "/v1/envelope"
    env = deployment["environment_variables"]
    assert {r["port"] for r in routes.values()} == {int(env["RALLYPOINT_PORT"])}
    assert "EXPOSE 8080" in stage("coordinator")
    assert set(env) <= KNOWN_ENV
    # The settings the container starts with are valid (the endpoint key guards it).
    names = {k for k in env if k.startswith("RALLYPOINT_")}
    settings = Settings(**{k.removeprefix("RALLYPOINT_").lower(): env[k] for k in names})
    assert (settings.host, settings.storage, settings.log_format) == ("0.0.0.0", "azure", "json")
    requests = deployment["request_settings"]
    # The gateway must outwait the longest long-poll, and hold one per node and more.
    assert requests["request_timeout_ms"] > 2 * _POLL * 1000
    assert requests["max_concurrent_requests_per_instance"] >= 256


def test_the_azureml_job_runs_rallypoint_elastically() -> None:
    job = _azureml("job.yml")
    assert job["type"] == "command" and job["distribution"]["type"] == "pytorch"
    assert job["distribution"]["process_count_per_instance"] == 1  # torchrun starts workers
    assert job["command"].startswith("rallypoint run ")
    env = job["environment_variables"]
    assert set(env) | {ENDPOINT_KEY_ENV} <= KNOWN_ENV
    assert env[TRANSPORT_ENV] == "envelope" and env[URL_ENV].endswith("/score")
    low, high = (int(n) for n in env["RALLYPOINT_NNODES"].split(":"))
    resources = job["resources"]
    assert low <= resources["instance_count"] <= resources["max_instance_count"] == high
    assert (AZUREML / job["code"] / "pyproject.toml").exists()


# azure-ai-ml's schemas, on marshmallow 3, warn hundreds of times of marshmallow 4.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_azureml_files_load_with_the_sdks_loaders() -> None:
    """What ``az ml ... create -f`` reads them with: azure-ai-ml's loaders, whose schemas
    refuse a field they do not know and a value outside their enums."""
    from azure.ai.ml import load_job, load_online_deployment, load_online_endpoint

    job = load_job(AZUREML / "job.yml")
    # Spot (low-priority) VMs, asked of serverless compute, where the job tier applies.
    assert job.queue_settings is not None and job.queue_settings.job_tier == "spot"
    assert job.compute is None
    resources = job.resources
    assert resources.instance_type and (resources.instance_count, resources.max_instance_count) == (
        2,
        4,
    )
    assert job.distribution.process_count_per_instance == 1
    # The cluster's word for the tier is no job tier: the loader refuses it.
    with pytest.raises(Exception, match="job_tier"):
        load_job(AZUREML / "job.yml", params_override=[{"queue_settings.job_tier": "low_priority"}])
    endpoint = load_online_endpoint(AZUREML / "endpoint.yml")
    assert (endpoint.auth_mode, endpoint.identity.type) == ("key", "system_assigned")
    deployment = load_online_deployment(AZUREML / "deployment.yml")
    assert deployment.endpoint_name == endpoint.name and deployment.instance_count == 2
    assert deployment.environment.inference_config["scoringRoute"]["path"] == "/v1/envelope"
    assert deployment.request_settings.request_timeout_ms == 90000
    assert deployment.liveness_probe.timeout == deployment.readiness_probe.timeout == 1


class _Gateway(ThreadingHTTPServer):
    """What a managed online endpoint does in front of the container: checks its key and
    forwards the scoring path, and only that, to the scoring route."""

    daemon_threads = True

    def __init__(self, key: str, scoring_url: str) -> None:
        self.key, self.scoring_url = key, scoring_url
        self.seen: list[str] = []
        super().__init__(("127.0.0.1", 0), _Forward)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Forward(BaseHTTPRequestHandler):
    server: _Gateway
    # What the gateway keeps for itself (its key) or rewrites; the rest (the
    # coordinator's token, a node's credential) reaches the container as sent.
    _CONSUMED = frozenset({"authorization", "host", "content-length", "connection"})

    def do_POST(self) -> None:
        self.server.seen.append(self.path)
        if self.path != "/score":
            return self._reply(404, b"{}")
        if self.headers.get("Authorization") != f"Bearer {self.server.key}":
            return self._reply(401, b"{}")
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in self._CONSUMED}
        reply = httpx.post(self.server.scoring_url, content=body, headers=headers, timeout=90)
        self._reply(reply.status_code, reply.content)

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        self._reply(404, b"{}")

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_azureml_job_command_trains_through_a_scoring_only_gateway(
    azurite: str, tmp_path: Path
) -> None:
    deployment, job = _azureml("deployment.yml"), _azureml("job.yml")
    # The deployment's environment, with Azurite's connection string for the managed
    # identity (which only Azure has) and a loopback address.
    env = {k: str(v) for k, v in deployment["environment_variables"].items()}
    del env["AZURE_STORAGE_ACCOUNT"]
    env |= {
        "AZURE_STORAGE_CONNECTION_STRING": azurite,
        "RALLYPOINT_STORAGE_PREFIX": "aml" + os.urandom(3).hex(),
        "RALLYPOINT_HOST": "127.0.0.1",
    }
    coordinator = Coordinator([], env, log=tmp_path / "coordinator.log").start()
    scoring = deployment["environment"]["inference_config"]["scoring_route"]["path"]
    gateway = _Gateway("endpoint-key", coordinator.url + scoring)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    # The job's command, shortened to 30 steps, on 2 nodes as AzureML would start it.
    command = job["command"].replace("--steps 20000", "--steps 30")
    command = command.replace("--checkpoint-every 100", "--checkpoint-every 10")
    assert command.split()[:2] == ["rallypoint", "run"]
    nodes = []
    try:
        for rank in range(2):
            node_env = {
                **os.environ,
                **{k: str(v) for k, v in job["environment_variables"].items()},
                URL_ENV: gateway.url,
                ENDPOINT_KEY_ENV: "endpoint-key",
                "AZUREML_RUN_ID": "aml-run-1",
                "AZUREML_NODE_COUNT": "2",
                "RALLYPOINT_NNODES": "2:2",  # both nodes are here: no last call to wait
                NODE_ENV: f"aml-node-{rank}",
            }
            with (tmp_path / f"node-{rank}.log").open("wb") as log:
                nodes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", *command.split()],
                        env=node_env,
                        stdout=log,
                        stderr=log,
                    )
                )
        codes = [p.wait(240) for p in nodes]
        status = httpx.get(f"{coordinator.url}/v1/jobs/aml-run-1").json()
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        gateway.shutdown()
        coordinator.stop()
    assert codes == [0, 0], (tmp_path / "node-0.log").read_text()[-3000:]
    assert status["checkpoint"]["step"] == 20
    assert [g["world_size"] for g in status["history"]] == [2]  # one generation of both
    # Every call went through the one path the endpoint forwards.
    assert gateway.seen and set(gateway.seen) == {"/score"}
