"""Helpers to run real agents on 127.0.0.1 (tests, benchmarks, `demo --cluster` rehearsals),
and a first-fit placer standing in for the worker's policy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from qosflow.backends.base import LaunchSpec
from qosflow.core.cluster import ClusterSpec, ClusterState, PlacementError, default_cpu_split
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProcess:
    """`qosflow agent start` in a child process (its own process group), on 127.0.0.1."""

    def __init__(self, name: str, token: str, *, virtual_gpus: int = 2, port: int | None = None, args: Sequence[str] = (), log: Path | None = None):
        self.name, self.token, self.virtual_gpus = name, token, virtual_gpus
        self.port = port or free_port()
        self.args = list(args)
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "AgentProcess":
        env = {**os.environ, "QOSFLOW_AGENT_TOKEN": self.token}  # not on the command line
        cmd = [sys.executable, "-m", "qosflow", "agent", "start", "--port", str(self.port), "--name", self.name,
               "--virtual-gpus", str(self.virtual_gpus), *self.args]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited with {self.proc.returncode} (log: {self.log})")
            try:
                r = httpx.get(f"{self.url}/v1/health", headers={"Authorization": f"Bearer {self.token}"}, timeout=0.5)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"agent {self.name} did not answer on {self.url} within {timeout}s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the agent process only (its stages die with it through PDEATHSIG)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "AgentProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class FirstFitPlacer:
    """A minimal stand-in for the worker's policy: first up node (not avoided) with free GPUs.

    `place_fn(...)` gives the PlaceFn `qosflow.failures.run_with_failover` wants; `release` frees the
    slot when an attempt ends.
    """

    cluster: ClusterSpec
    down: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.state = ClusterState(self.cluster)
        self.lock = asyncio.Lock()

    def place_fn(self, stage_key: str, command: list[str], *, gpus: int = 1, cpu_cores: float = 1.0,
                 env: dict[str, str] | None = None, labels: dict[str, str] | None = None, prefer: str | None = None):
        qos = QoSSpec(gpus=gpus, cpu_cores=cpu_cores)

        async def place(attempt: int, avoid: set[str]) -> LaunchSpec | None:
            async with self.lock:
                order = list(range(len(self.cluster.nodes)))
                if prefer is not None:
                    order.sort(key=lambda i: self.cluster.nodes[i].name != prefer)
                for i in order:
                    node = self.cluster.nodes[i]
                    if node.name in avoid or node.name in self.down or self.state.down[i]:
                        continue
                    free = list(self.state.empty_gpus_on(i))
                    if len(free) < gpus or self.state.cpu_free[i] < cpu_cores:
                        continue
                    gl = tuple((i, int(g)) for g in free[:gpus])
                    p = Placement(f"{stage_key}-a{attempt}", gl, default_cpu_split(qos, gl, node=i))
                    try:
                        self.state.allocate(p, qos)
                    except PlacementError:
                        continue
                    return LaunchSpec(
                        stage_id=p.job_id, command=command, placement=p, cluster=self.cluster,
                        env=dict(env or {}), labels=dict(labels or {}),
                    )
                return None

        return place

    def release(self, spec: LaunchSpec) -> None:
        if spec.placement.job_id in self.state.allocs:
            self.state.release(spec.placement.job_id)
