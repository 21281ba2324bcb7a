"""A Kubernetes API emulator for tests: NOT a Kubernetes cluster.

It serves the real REST paths and JSON for Nodes, Pods, Jobs, Secrets, ConfigMaps and custom resources (create, get,
list, watch with resourceVersion, bookmarks and 410 Gone, delete, 409 conflicts, injectable 500s; the API's traffic
counted per verb and resource in `GET /emulator/state`; every request recorded in RBAC's terms, `requests()`; RBAC
from Role/ClusterRole manifests judged for token users, `set_rbac`, `api_client(user=...)`) and "runs"
Jobs by creating Pods and moving them through their phases, so the official `kubernetes` Python
client (and `qosflow.backends.kubernetes`) can be exercised without a cluster. No container runs.
Failure injection: OOMKilled, ImagePullBackOff, Evicted, Unschedulable, exit codes, lost nodes.
A pod garbage collector deletes the pods of a deleted node (after `pod_gc_quarantine_s`, 5 s; upstream 40 s), marked
Failed with a DisruptionTarget condition (reason DeletionByPodGC) first, and the oldest terminated pods beyond
`terminated_pod_gc_threshold` (12500, as upstream). Opt-in, a cluster-autoscaler over one node group
(`autoscaler=NodeGroup(template=gpu_node("t"), min=0, max=2, scale_up_delay_s=1, scale_down_unneeded_s=30)`): a node
for Unschedulable pods an empty template node would take, unneeded nodes deleted. A pod whose image is a pause image
(`registry.k8s.io/pause:3.9`) runs until it is deleted.

    with EmulatorServer(nodes=[gpu_node("gpu-0"), gpu_node("gpu-1")]) as emu:
        api = kubernetes.client.CoreV1Api(emu.api_client())

`python -m qosflow.k8s_emulator --port 8080 --nodes 3 --gpus 4 [--run-processes] [--pod-gc-quarantine 40]
[--autoscale-max 4]` runs one standalone.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx

from qosflow.k8s_emulator.state import POD_GC_QUARANTINE_S, TERMINATED_POD_GC_THRESHOLD, Cluster, NodeGroup, gpu_node

__all__ = ["EmulatorServer", "gpu_node", "Cluster", "NodeGroup"]


class EmulatorServer:
    """The emulator on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, nodes: list[dict] | None = None, *, port: int = 0, window: int = 1000, tick_s: float = 0.02, start_delay_s: float = 0.05,
                 run_processes: bool = False, pod_gc_quarantine_s: float = POD_GC_QUARANTINE_S,
                 terminated_pod_gc_threshold: int = TERMINATED_POD_GC_THRESHOLD, autoscaler: NodeGroup | None = None):
        """`run_processes=True`: a Running pod runs its container's command as a local process (see state.py).
        `pod_gc_quarantine_s`: how long a deleted node's pods are left before the pod garbage collector deletes them
        (upstream 40 s); `terminated_pod_gc_threshold`: terminated pods kept (upstream 12500; 0: all); `autoscaler`: a
        `NodeGroup`, the emulated cluster-autoscaler (nodes added for Unschedulable pods, deleted when unneeded)."""
        self.cluster = Cluster(window=window, tick_s=tick_s, start_delay_s=start_delay_s, run_processes=run_processes,
                               pod_gc_quarantine_s=pod_gc_quarantine_s, terminated_pod_gc_threshold=terminated_pod_gc_threshold,
                               autoscaler=autoscaler)
        self._nodes = list(nodes or [])
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "EmulatorServer":
        import uvicorn

        from qosflow.k8s_emulator.server import create_app

        for n in self._nodes:
            self.cluster.add_node(n)
        config = uvicorn.Config(create_app(self.cluster), log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)

        def run() -> None:
            asyncio.run(self._server.serve(sockets=[self._sock]))

        self._thread = threading.Thread(target=run, name="k8s-emulator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the Kubernetes emulator did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.cluster.shutdown()
        self._sock.close()

    def __enter__(self) -> "EmulatorServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -------------------------------------------------------------- clients and controls
    def api_client(self, user: str | None = None):
        """An official `kubernetes.client.ApiClient` pointed at the emulator: as its admin (no token: every request
        allowed), or as `user` (e.g. "system:serviceaccount:qosflow:qosflow-worker", a bearer token the emulator issues),
        whose requests the RBAC in force (`set_rbac`) judges."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        if user is not None:
            cfg.api_key = {"authorization": self._ctl("POST", "tokens", {"user": user})["token"]}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def set_rbac(self, manifests: str | list[dict]) -> None:
        """Put RBAC in force for the token users (`api_client(user=...)`): `manifests` are Roles, ClusterRoles and their
        bindings (YAML text, several documents, or the parsed objects; other kinds are ignored). A request they do not
        allow gets 403 Forbidden with the API server's message. Manifests it cannot read: ValueError naming the document."""
        import yaml

        docs = [d for d in yaml.safe_load_all(manifests) if d] if isinstance(manifests, str) else list(manifests)
        r = httpx.post(f"{self.url}/emulator/rbac", json={"docs": docs}, timeout=10)
        if r.status_code == 400:
            raise ValueError(r.json()["message"])
        r.raise_for_status()

    def clear_rbac(self) -> None:
        """Every request allowed again (the default)."""
        self._ctl("DELETE", "rbac")

    def requests(self, user: str | None = None) -> list[dict]:
        """The API requests served so far in RBAC's terms: {"user", "verb", "group", "resource", "subresource",
        "namespace" ("" at the cluster scope), "allowed", "count"}; `user`: that user's only ("" the admin's)."""
        reqs = self._ctl("GET", "requests")["requests"]
        return [r for r in reqs if user is None or r["user"] == user]

    def clear_requests(self) -> None:
        self._ctl("DELETE", "requests")

    def _ctl(self, method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(method, f"{self.url}/emulator/{path}", json=body, timeout=10)
        r.raise_for_status()
        return r.json()

    def add_node(self, **kw: Any) -> dict:
        return self._ctl("POST", "nodes", kw)

    def lose_node(self, name: str) -> None:
        self._ctl("POST", f"nodes/{name}/lose")

    def add_rule(self, *, fail: str | None = None, selector: str | None = None, node: str | None = None, times: int = 1, **kw: Any) -> None:
        """Make the next `times` new pods (matching `selector`/`node`) fail with `fail`
        (OOMKilled, ImagePullBackOff, Evicted, Unschedulable, NodeLost, Error) or behave per `kw`
        (run_s, exit_code, after_s)."""
        rule = {"fail": fail, "selector": selector, "node": node, "times": times, **kw}
        self._ctl("POST", "rules", {k: v for k, v in rule.items() if v is not None})

    def clear_rules(self) -> None:
        """Drop the pod rules not used up yet (a test's leftovers would fail the next test's pods)."""
        self._ctl("DELETE", "rules")

    def add_fault(self, path: str, *, method: str | None = None, status: int = 500, count: int = 1, query: str | None = None) -> None:
        """The next `count` API requests whose path matches the regex `path` (and whose query string matches the regex
        `query`, e.g. ``watch=true`` for WATCHes only) get HTTP `status`."""
        f = {"path": path, "status": status, "count": count}
        if method:
            f["method"] = method
        if query:
            f["query"] = query
        self._ctl("POST", "faults", f)

    def compact(self) -> int:
        return self._ctl("POST", "compact")["compacted_rv"]

    def state(self) -> dict:
        return self._ctl("GET", "state")
