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

    def __init__(self, name: str, token: str, *, virtual_gpus: int = 2, port: int | None = None, args: Sequence[str] = (), log: Path | None = None,
                 tls: "TestTLS | None" = None):
        self.name, self.token, self.virtual_gpus = name, token, virtual_gpus
        self.port = port or free_port()
        self.args = list(args)
        self.log = log
        #: serve HTTPS with a certificate of this test CA (`make_test_tls`)
        self.tls = tls
        if tls is not None:
            self.args += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

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
                r = httpx.get(f"{self.url}/v1/health", headers={"Authorization": f"Bearer {self.token}"}, timeout=0.5,
                              verify=self.tls.context() if self.tls else True)
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


@dataclass(frozen=True)
class TestTLS:
    """PEM files of a throw-away CA and of a server certificate it signed for 127.0.0.1 and localhost."""

    ca: Path
    cert: Path
    key: Path

    def context(self):
        """An SSL context that trusts this CA only (httpx's `verify=`)."""
        import ssl

        return ssl.create_default_context(cafile=str(self.ca))


def make_test_tls(directory: Path, *, days: int = 2) -> TestTLS:
    """A test CA and an agent certificate for 127.0.0.1/localhost (the `cryptography` package Prefect
    depends on), for tests and rehearsals of an agent served over HTTPS. Never for a real cluster: make
    its certificates with the organisation's CA (docs/infrastructure.md)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qosflow test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qosflow agent")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    out = TestTLS(directory / "ca.pem", directory / "agent.pem", directory / "agent-key.pem")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    out.key.chmod(0o600)
    return out


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
