"""Cluster block values the worker could never use are refused when the block is built or saved, naming the
field and the fix (admin review: they were accepted, then the worker logged "setup failed" every 5 s, or
only "UnsupportedProtocol" from every heartbeat, or ran Jobs in a namespace Kubernetes refuses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

ROOT = Path(__file__).resolve().parent.parent
TOK = SecretStr("s3cret")


def _err(cls, **kw) -> str:
    with pytest.raises(ValidationError) as ei:
        cls(**kw)
    return " ".join(str(ei.value).split())


def test_bare_metal_block_refuses_what_the_agents_backend_cannot_use():
    from qosflow.prefect.blocks import BareMetalGPUCluster as B

    assert "needs agent_token" in _err(B, hosts=["a"], backend="agents", agent_url="http://{host}:8701")
    assert "needs agent_token" in _err(B, hosts=["a"], backend="agents", agent_url="http://{host}:8701", agent_token=SecretStr(" "))
    msg = _err(B, hosts=["a"], backend="agents", agent_url="127.0.0.1:8721", agent_token=TOK)
    assert "agent_url '127.0.0.1:8721': it has no http:// or https:// scheme; write it as http://{host}:8701" in msg, msg
    msg = _err(B, hosts=["a"], backend="agents", agent_urls={"a": "10.0.0.1:8701"}, agent_token=TOK)
    assert "agent_urls['a'] '10.0.0.1:8701': it has no http:// or https:// scheme" in msg, msg
    assert "the only placeholder it may have is {host}" in _err(B, hosts=["a"], backend="agents", agent_url="http://{hostname}:1",
                                                               agent_token=TOK)
    msg = _err(B, hosts=["", "gpu-b"], backend="agents", agent_urls={"gpu-b": "http://b:1"}, agent_token=TOK)
    assert "hosts: host 1 of 2 has an empty name" in msg and "for host(s) " not in msg, msg
    assert "empty name" in _err(B, hosts=["  "])
    # still accepted
    B(hosts=["a", "b"], backend="agents", agent_url="https://{host}:8701", agent_token=TOK)
    B(hosts=["a"], backend="agents", agent_urls={"a": "http://10.0.0.1:8701"}, agent_token=TOK)
    B.virtual(2, 4)


def test_kubernetes_block_refuses_what_kubernetes_would(tmp_path):
    from qosflow.prefect.blocks import KubernetesGPUCluster as K

    msg = _err(K, namespace="ML_Team")
    assert "namespace 'ML_Team' is not a Kubernetes namespace name (a DNS-1123 label" in msg and "e.g. 'ml-team'" in msg, msg
    assert "DNS-1123" in _err(K, namespace="a" * 64)
    msg = _err(K, api_url="127.0.0.1:8725")
    assert "api_url '127.0.0.1:8725': it has no http:// or https:// scheme" in msg, msg
    msg = _err(K, kubeconfig=str(tmp_path / "nope"))
    assert "kubeconfig" in msg and "no such file on this machine" in msg, msg
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\n")
    msg = _err(K, kubeconfig=str(kc), api_url="http://127.0.0.1:8001")
    assert "give either api_url (a plain API URL, no credentials) or kubeconfig, not both" in msg, msg
    assert "image '': give the container image" in _err(K, image="")
    assert "image 'my image': give the container image" in _err(K, image="my image")
    # (an empty placeholder image was accepted, and the API server's 422 then logged at every heartbeat)
    msg = _err(K, capacity_request_image="")
    assert "capacity_request_image '': give the placeholder pods' image (a pause image), e.g. registry.k8s.io/pause:3.9" in msg, msg
    assert K(capacity_request_image="registry.example.org/pause:3.10").capacity_request_image == "registry.example.org/pause:3.10"
    # (the backend refused these only when the worker built it; the block could not set the field at all before)
    msg = _err(K, capacity_peer_check_s=-1)
    assert "capacity_peer_check_s Input should be greater than or equal to 0" in msg, msg
    assert "capacity_peer_check_s Input should be a finite number" in _err(K, capacity_peer_check_s=float("nan"))
    assert K(capacity_peer_check_s=0).capacity_peer_check_s == 0
    # still accepted; an empty optional text (as the UI saves it) is unset
    K(kubeconfig=str(kc), context="lab", namespace="ml-team")
    k = K(api_url="http://127.0.0.1:8001", kubeconfig="", context="")
    assert k.kubeconfig is None and k.context is None


@pytest.mark.slow
def test_worker_start_on_a_pool_whose_block_was_saved_invalid_exits_with_the_fix(prefect_server, capsys):
    """A block saved before these checks (here: edited through the API) loads with the fix, not a traceback,
    and `qosflow worker start --pool P` (the pool's own cluster_block) exits with it instead of logging
    "setup failed" every 5 s."""
    import httpx

    from qosflow.cli.main import main
    from qosflow.prefect.blocks import BareMetalGPUCluster

    pool = "validation-old-block"
    blk = BareMetalGPUCluster(hosts=["gpu-a"], backend="agents", agent_url="http://{host}:8701", agent_token=TOK, virtual_gpus=True)
    blk.save("validation-agents", overwrite=True)
    assert main(["init", "--pool", pool, "--cluster-block", "validation-agents"]) == 0
    capsys.readouterr()
    with httpx.Client(base_url=prefect_server, timeout=30) as c:
        doc = blk._block_document_id
        data = c.get(f"/block_documents/{doc}", params={"include_secrets": True}).json()["data"]
        data["agent_url"] = "127.0.0.1:8721"
        assert c.patch(f"/block_documents/{doc}", json={"data": data, "merge_existing_data": False}).status_code == 204
    env = dict(os.environ, PREFECT_API_URL=prefect_server,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    for k in ("QOSFLOW_CLUSTER_BLOCK", "QOSFLOW_CLUSTER_FILE"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool],
                         capture_output=True, text=True, env=env, timeout=120)  # before: ran until the timeout
    err = " ".join(out.stderr.split())
    assert out.returncode == 2, err
    assert "work pool 'validation-old-block' names cluster block 'validation-agents'" in err, err
    assert "agent_url '127.0.0.1:8721': it has no http:// or https:// scheme" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_worker_started_without_the_cli_stops_on_an_invalid_or_missing_cluster_block(prefect_server, monkeypatch):
    """`prefect worker start --pool P` (the pool's cluster_block) or QOSFLOW_CLUSTER_BLOCK skip the CLI's check:
    the worker logged "setup failed ... retrying every 5 s" for ever. A block that fails validation or does not
    exist cannot fix itself: the worker now stops with the error naming the block and the fix."""
    import asyncio

    import httpx

    from qosflow.cli.main import main
    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import BareMetalGPUCluster
    from qosflow.prefect.worker import QosflowWorker

    pool = "validation-plain-start"
    blk = BareMetalGPUCluster(hosts=["gpu-a"], backend="agents", agent_url="http://{host}:8701", agent_token=TOK, virtual_gpus=True)
    blk.save("validation-plain", overwrite=True)
    assert main(["init", "--pool", pool, "--cluster-block", "validation-plain"]) == 0
    with httpx.Client(base_url=prefect_server, timeout=30) as c:
        doc = blk._block_document_id
        data = c.get(f"/block_documents/{doc}", params={"include_secrets": True}).json()["data"]
        data["agent_url"] = "127.0.0.1:8721"
        assert c.patch(f"/block_documents/{doc}", json={"data": data, "merge_existing_data": False}).status_code == 204
    for k in ("QOSFLOW_CLUSTER_BLOCK", "QOSFLOW_CLUSTER_FILE", "QOSFLOW_POLICY_BLOCK"):
        monkeypatch.delenv(k, raising=False)

    async def start(name: str) -> BaseException:
        w = QosflowWorker(work_pool_name=pool, create_pool_if_not_found=False, name=name)
        with pytest.raises(SpecError) as ei:  # before: still running at the timeout
            await asyncio.wait_for(w.start(printer=lambda *a, **k: None), 60)
        return ei.value

    err = str(asyncio.run(start("validation-plain-1")))  # the pool's block, saved invalid
    assert "block qosflow-bare-metal-cluster/validation-plain is invalid" in err, err
    assert "agent_url" in err and "fix it in the Prefect UI" in err, err
    monkeypatch.setenv("QOSFLOW_CLUSTER_BLOCK", "validation-no-such-block")
    err = str(asyncio.run(start("validation-plain-2")))  # a block that does not exist
    assert "no cluster block named 'validation-no-such-block'" in err and "prefect block ls" in err, err


@pytest.mark.slow
def test_a_worker_stops_on_a_policy_blocks_estimator_it_cannot_import(prefect_server, monkeypatch):
    """A QoS policy block whose estimator is a module:attr the worker's Python cannot import (a typo, a package not
    installed where the worker runs): the worker logged 'setup failed: No module named ...; retrying every 5 s' for
    ever and took no run (CLI review). It now stops with the error naming the block, the estimator and the fix."""
    import asyncio

    from qosflow.cli.main import main
    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.worker import QosflowWorker

    pool = "validation-estimator"
    QoSPolicy(estimator="no_such_estimator_module:Estimator").save("validation-estimator", overwrite=True)
    for k in ("QOSFLOW_CLUSTER_BLOCK", "QOSFLOW_CLUSTER_FILE", "QOSFLOW_POLICY_BLOCK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("QOSFLOW_POLICY_BLOCK", "validation-estimator")  # (the pool's cluster: this machine, local)
    assert main(["init", "--pool", pool]) == 0

    async def start() -> BaseException:
        w = QosflowWorker(work_pool_name=pool, create_pool_if_not_found=False, name="validation-estimator-1")
        with pytest.raises(SpecError) as ei:  # before: still running at the timeout
            await asyncio.wait_for(w.start(printer=lambda *a, **k: None), 60)
        return ei.value

    err = str(asyncio.run(start()))
    assert "QoS policy block 'validation-estimator'" in err and "no module named 'no_such_estimator_module'" in err, err
    assert "install the module where the worker runs" in err, err


def test_a_policy_blocks_worker_settings_given_are_those_off_their_default():
    """`prefect deploy` copies a QoS policy block whole into the deployment's `qos_policy` job variable,
    defaults included; the pipeline's log then said of a block that set only a deadline and a class that
    'its at_risk_margin, coda_feedback, early_check_min_gpus, early_check_s, estimator, policy,
    round_interval_s are the worker's settings' (admin review, deployments/prefect.yaml's nightly run).
    QoSPolicy.worker_settings_given names only the worker's settings a block moved off their default."""
    import json
    from pathlib import Path

    from qosflow.prefect.blocks import QoSPolicy

    only_pipeline = QoSPolicy(deadline_s=3600, priority="guaranteed").model_dump(mode="json")
    assert QoSPolicy.worker_settings_given(only_pipeline) == []
    nightly = json.loads((Path(__file__).resolve().parents[1] / "blocks" / "nightly-policy.json").read_text())["data"]
    assert QoSPolicy.worker_settings_given(QoSPolicy(**nightly).model_dump(mode="json")) == ["estimator", "policy"]
    assert QoSPolicy.worker_settings_given({"deadline_s": 60, "coda_feedback": False, "options": {}}) == ["coda_feedback"]
