"""The Fleet seam for Kubernetes, on paper: what a self-healing driver asks of the Kubernetes API, as requests.

No Kubernetes cluster runs where rankscope is built, so this fleet is written and tested as data:
each operation of the seam is the API requests it makes (``Request``: verb, path, body), handed to
``api`` (a real client's call on a cluster; a test's recorder here). The job is a Kubeflow
``PyTorchJob`` with an elastic policy (``deploy/kubernetes/pytorchjob.yaml``): one worker pod a node,
torchrun's elastic agent in each, a c10d rendezvous; the driver runs beside it with the RBAC of
``deploy/kubernetes/driver-rbac.yaml``, which grants exactly what these requests need.

- hosts: the nodes the job's pods run on;
- workers, pause and resume: ``rankscope.healing.node_workers`` run in the node's pod (exec);
- the self-check: a pod pinned to the node (``nodeName``, tolerating the condemned taint) running
  the probes (``KubernetesRunner``, with ``kubectl run``);
- fence: the node cordoned and tainted ``rankscope.io/condemned=<incident>:NoExecute`` with the reason
  as an annotation (neither this job nor the next lands there, and what ran there is evicted), then
  the job's pod on it deleted: the training operator restarts the workers on the nodes left
  (elastic: down to ``minReplicas``), from the last checkpoint;
- release: the taint and the cordon lifted (``rankscope node resume`` after the node passed its check);
- requeue: the job suspended and resumed (``runPolicy.suspend``): its pods are placed anew, on healthy nodes.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankscope.healing.fleet import Worker

__all__ = ["TAINT", "KubernetesFleet", "KubernetesRunner", "Request"]

#: the taint a condemned node carries (its value: the incident id)
TAINT = "rankscope.io/condemned"
#: the annotation that keeps the reason (taint values are short and restricted)
REASON = "rankscope.io/reason"
#: the label the training operator puts on a PyTorchJob's pods
JOB_LABEL = "training.kubeflow.org/job-name"


@dataclass(frozen=True)
class Request:
    """One call of the Kubernetes API: verb (get, patch, delete, create), path, body (JSON), content type of a patch."""

    verb: str
    path: str
    body: dict[str, Any] | None = None
    content_type: str = "application/merge-patch+json"


@dataclass(frozen=True)
class KubernetesRunner:
    """A self-check's commands in a pod pinned to the node, tolerating the condemned taint (``kubectl run``)."""

    namespace: str
    image: str
    #: the nodes' addresses (the link probes contact them and loopback only)
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def networks(self) -> tuple[str, ...]:
        return (*(f"{address}/32" for address in self.addresses.values()), "127.0.0.0/8")

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        pod = {"spec": {"nodeName": host, "tolerations": [{"key": TAINT, "operator": "Exists"}], "hostNetwork": True,
                        "containers": [{"name": "check", "image": self.image, "command": list(argv), "stdin": True}]}}  # fmt: skip
        return ["kubectl", "run", f"rankscope-check-{host}", f"--namespace={self.namespace}", f"--image={self.image}", "--restart=Never",
                "--rm", "--stdin", "--quiet", f"--overrides={json.dumps(pod)}"]  # fmt: skip

    def address(self, host: str) -> str:
        return self.addresses[host]


@dataclass
class KubernetesFleet:
    """The nodes of PyTorchJob ``job`` in ``namespace``, through the Kubernetes API (``api``)."""

    job: str
    namespace: str
    api: Callable[[Request], Any]
    #: the image the self-check pods run (the job's own: rankscope is installed in it)
    image: str
    python: str = sys.executable

    @property
    def runner(self) -> KubernetesRunner:
        nodes = {pod["spec"]["nodeName"]: pod["status"].get("hostIP", "") for pod in self._pods()}
        return KubernetesRunner(self.namespace, self.image, nodes)

    def hosts(self) -> list[str]:
        return sorted({pod["spec"]["nodeName"] for pod in self._pods()})

    def workers(self, hosts: Iterable[str]) -> set[Worker]:
        found: set[Worker] = set()
        for host in hosts:
            for pod in self._pods(host):
                answer = self._exec(pod, ["list"])
                found |= {(host, int(pid)) for pid in answer.get("ranks", [])}
        return found

    def signal(self, workers: Iterable[Worker], sig: signal.Signals) -> int:
        by_host: dict[str, list[int]] = {}
        for host, pid in workers:
            by_host.setdefault(host, []).append(pid)
        return sum(int(self._exec(pod, ["signal", sig.name, *map(str, pids)]).get("sent", 0)) for host, pids in by_host.items() for pod in self._pods(host))

    def fence(self, host: str, reason: str) -> str:
        """Cordon and taint the node with the reason, then delete the job's pods on it."""
        words = reason.split()  # "rankscope: KIND INCIDENT: SUMMARY"
        incident = words[2].rstrip(":") if len(words) > 2 and words[0] == "rankscope:" else "condemned"
        taints = [t for t in self._node(host)["spec"].get("taints", []) if t["key"] != TAINT]
        self.api(Request("patch", f"/api/v1/nodes/{host}", {
            "metadata": {"annotations": {REASON: reason}},
            "spec": {"unschedulable": True, "taints": [*taints, {"key": TAINT, "value": _label_value(incident), "effect": "NoExecute"}]},
        }))  # fmt: skip
        pods = [pod["metadata"]["name"] for pod in self._pods(host)]
        for pod in pods:
            self.api(Request("delete", f"/api/v1/namespaces/{self.namespace}/pods/{pod}"))
        return f"cordoned and tainted {host} ({reason}); deleted {', '.join(pods) or 'no pod of the job'}"

    def release(self, host: str) -> str:
        taints = [t for t in self._node(host)["spec"].get("taints", []) if t["key"] != TAINT]
        self.api(Request("patch", f"/api/v1/nodes/{host}", {"metadata": {"annotations": {REASON: None}}, "spec": {"unschedulable": False, "taints": taints}}))
        return f"uncordoned {host} and lifted its {TAINT} taint"

    def requeue(self) -> None:
        """Suspend the job and resume it: the operator deletes its pods, then creates them anew where the scheduler places them."""
        path = f"/apis/kubeflow.org/v1/namespaces/{self.namespace}/pytorchjobs/{self.job}"
        for suspend in (True, False):
            self.api(Request("patch", path, {"spec": {"runPolicy": {"suspend": suspend}}}))

    def _pods(self, host: str | None = None) -> list[dict[str, Any]]:
        selector = f"?labelSelector={JOB_LABEL}%3D{self.job}" + (f"&fieldSelector=spec.nodeName%3D{host}" if host else "")
        return list(self.api(Request("get", f"/api/v1/namespaces/{self.namespace}/pods{selector}"))["items"])

    def _node(self, host: str) -> dict[str, Any]:
        return dict(self.api(Request("get", f"/api/v1/nodes/{host}")))

    def _exec(self, pod: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
        command = "".join(f"&command={part}" for part in (self.python, "-m", "rankscope.healing.node_workers", *argv))
        answer = self.api(Request("create", f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}/exec?stdout=true{command}"))
        return dict(json.loads(str(answer).strip().splitlines()[-1])) if answer else {}


def _label_value(text: str) -> str:
    """``text`` as a taint value: at most 63 letters, digits, '-', '_' or '.', starting and ending with one of the first two."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:63].strip("-_.")
    return cleaned or "unknown"
