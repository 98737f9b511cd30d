"""The Kubernetes seam, on paper (issue 28's part 6): no cluster runs here, so the fleet is checked as
data. Each operation of the Fleet seam is the Kubernetes API requests it makes, answered by a recorder
that plays the API server with the objects a cluster would hold; the manifests in deploy/kubernetes
are read as data: the job is elastic, its workers switch the agent on with the agent's own variables
and never tolerate a condemned node, its command goes through the trainer's own parser, and the
driver's RBAC grants every request the fleet makes."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankscope.common.agent_env import agent_environment
from rankscope.healing.kubernetes_fleet import TAINT, KubernetesFleet, Request
from rankscope.trainer.train_config import parse_args

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
NODES = ["gpu-a", "gpu-b", "gpu-c"]


class ApiServer:
    """What the driver would see of a cluster: a node per name (one with a taint of its own), the job's
    pod on each, ``node_workers`` answering in each pod; every request recorded."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __call__(self, request: Request) -> Any:
        self.requests.append(request)
        if request.verb == "get" and request.path.startswith("/api/v1/namespaces/training/pods"):
            node = re.search(r"spec.nodeName%3D([\w-]+)", request.path)
            return {"items": [{"metadata": {"name": f"gpt-worker-{i}"}, "spec": {"nodeName": n}, "status": {"hostIP": f"10.0.0.{i + 1}"}}
                              for i, n in enumerate(NODES) if node is None or node.group(1) == n]}  # fmt: skip
        if request.verb == "get" and request.path.startswith("/api/v1/nodes/"):
            return {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
        if request.verb == "create" and "/exec?" in request.path:
            argv = [part.split("=", 1)[1] for part in request.path.split("&") if part.startswith("command=")]
            return json.dumps({"ranks": [101, 102]} if argv[3] == "list" else {"sent": len(argv) - 5})
        return {}


@pytest.fixture
def api() -> ApiServer:
    return ApiServer()


@pytest.fixture
def fleet(api: ApiServer) -> KubernetesFleet:
    return KubernetesFleet("gpt", "training", api, image="rankscope:local", python="python")


def test_a_condemned_node_is_cordoned_tainted_with_its_incident_and_its_pod_deleted(fleet: KubernetesFleet, api: ApiServer) -> None:
    reason = "rankscope: lost_host lost:host=gpu-b: every rank of gpu-b went silent"
    done = fleet.fence("gpu-b", reason)
    (patch,), delete = [r for r in api.requests if r.verb == "patch"], api.requests[-1]
    assert (patch.verb, patch.path) == ("patch", "/api/v1/nodes/gpu-b")
    assert patch.body == {"metadata": {"annotations": {"rankscope.io/reason": reason}}, "spec": {"unschedulable": True, "taints": [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"}, {"key": TAINT, "value": "lost-host-gpu-b", "effect": "NoExecute"}]}}  # fmt: skip
    assert (delete.verb, delete.path) == ("delete", "/api/v1/namespaces/training/pods/gpt-worker-1")
    assert "cordoned and tainted gpu-b" in done and "gpt-worker-1" in done
    # taken back after it passed its self-check: the node's own taints stay, the cordon goes
    fleet.release("gpu-b")
    assert api.requests[-1].body == {"metadata": {"annotations": {"rankscope.io/reason": None}},
                                     "spec": {"unschedulable": False, "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}  # fmt: skip


def test_the_job_s_nodes_workers_and_the_self_check_pod_come_from_the_api(fleet: KubernetesFleet, api: ApiServer) -> None:
    assert fleet.hosts() == NODES
    assert fleet.workers(["gpu-a"]) == {("gpu-a", 101), ("gpu-a", 102)}
    assert fleet.signal({("gpu-c", 7), ("gpu-c", 8)}, signal.SIGSTOP) == 2
    exec_path = api.requests[-1].path
    assert exec_path.startswith("/api/v1/namespaces/training/pods/gpt-worker-2/exec?") and "&command=signal&command=SIGSTOP&command=" in exec_path
    runner = fleet.runner
    assert runner.address("gpu-b") == "10.0.0.2" and "10.0.0.3/32" in runner.networks
    argv = runner.command("gpu-b", ["python", "-m", "rankscope.healing.probes", "--probe", "local"])
    pod = json.loads(next(a for a in argv if a.startswith("--overrides=")).split("=", 1)[1])
    assert argv[:3] == ["kubectl", "run", "rankscope-check-gpu-b"] and pod["spec"]["nodeName"] == "gpu-b"
    assert pod["spec"]["tolerations"] == [{"key": TAINT, "operator": "Exists"}]  # it runs on the node it checks, condemned or not
    fleet.requeue()
    assert [r.body for r in api.requests[-2:]] == [{"spec": {"runPolicy": {"suspend": s}}} for s in (True, False)]


def test_the_manifests_make_an_elastic_job_the_fleet_can_heal_and_grant_the_driver_what_it_asks(fleet: KubernetesFleet, api: ApiServer) -> None:
    job = yaml.safe_load((DEPLOY / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    elastic, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["minReplicas"] < worker["replicas"] <= elastic["maxReplicas"]
    spec = worker["template"]["spec"]
    assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert not any(t.get("key") == TAINT for t in spec.get("tolerations", []))  # never back on a condemned node
    (container,) = spec["containers"]
    env = {e["name"] for e in container["env"]}
    assert env <= set(agent_environment("c:7777", "gpt", host="h", spool_dir=Path("/spool"))) and {"RANKSCOPE_ENABLE", "RANKSCOPE_COLLECTOR"} <= env
    assert container["command"][:3] == ["python", "-m", "rankscope.trainer"]
    config = parse_args(container["command"][3:])  # the trainer's own parser: the manifest cannot drift from its flags
    assert config.resume and config.ckpt_every > 0

    # every request of a whole healing (find, pause, check, fence, release, requeue) is granted to the driver
    fleet.workers(fleet.hosts())
    fleet.signal({("gpu-a", 1)}, signal.SIGCONT)
    fleet.fence("gpu-a", "rankscope: crash crash:rank=0: rank 0 died")
    fleet.release("gpu-a")
    fleet.requeue()
    rbac = list(yaml.safe_load_all((DEPLOY / "driver-rbac.yaml").read_text()))
    (role,) = [doc for doc in rbac if doc["kind"] == "ClusterRole"]
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    asked = {_needs(r) for r in api.requests}
    assert asked <= granted and {("", "pods", "create")} <= granted  # kubectl run makes the self-check's pod
    (binding,) = [doc for doc in rbac if doc["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["namespace"] == job["metadata"]["namespace"]


def _needs(request: Request) -> tuple[str, str, str]:
    """The RBAC (API group, resource, verb) ``request`` needs."""
    path = request.path.split("?")[0].strip("/").split("/")
    group = "" if path[0] == "api" else path[1]
    parts = path[2:] if path[0] == "api" else path[3:]
    if parts[0] == "namespaces":
        parts = parts[2:]
    resource = parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")
    verb = "list" if request.verb == "get" and len(parts) == 1 else request.verb
    return group, resource, verb
