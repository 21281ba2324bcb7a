"""`qosflow demo`, the README's main job, end to end in its own process: its own Prefect server,
the qosflow pool and worker on the embedded virtual cluster, three pipelines with different QoS.

Deadlines are not asserted (they depend on how loaded the machine is); that every pipeline and
stage ran, where, and that the virtual GPUs say so, is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_demo_runs_three_pipelines_and_writes_the_outcome(tmp_path):
    out = tmp_path / "demo.json"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "QOSFLOW_HOME": str(tmp_path / "qosflow")}
    env.pop("PREFECT_API_URL", None)  # the demo starts and uses its own server
    proc = subprocess.run([sys.executable, "-m", "qosflow", "demo", "--no-ui", "--json", str(out), "--home", str(tmp_path / "demo")],
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["policy"] == "qosflow" and d["cluster"]["virtual_gpus"] is True and d["cluster"]["backend"] == "local"
    assert {p["priority"] for p in d["pipelines"]} == {"critical", "guaranteed", "best-effort"}
    for p in d["pipelines"]:
        assert p["state"] == "completed", p
        assert p["stages"] and all(s["host"] in ("host0", "host1") and s["virtual_gpus"] is True for s in p["stages"])
        assert (p["deadline"] is None) == (p["met"] is None)
    assert 1 <= d["max_stages_per_gpu"] <= 2
    assert "QoS outcome" in proc.stdout


def test_demo_across_two_real_agents_from_a_cluster_file(tmp_path):
    """`qosflow demo --cluster FILE`: the same three pipelines, their stages launched through two
    `qosflow agent` processes (virtual GPUs) named in a cluster file."""
    from qosflow.agent.testing import AgentProcess

    token = "demo-cluster-token-5d1"
    out = tmp_path / "demo.json"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "QOSFLOW_HOME": str(tmp_path / "qosflow")}
    env.pop("PREFECT_API_URL", None)
    with AgentProcess("lab-a", token, virtual_gpus=4, args=["--cpu-cores", "8"], log=tmp_path / "a.log") as a, \
            AgentProcess("lab-b", token, virtual_gpus=4, args=["--cpu-cores", "8"], log=tmp_path / "b.log") as b:
        (tmp_path / "token").write_text(token + "\n")
        cluster = tmp_path / "lab.yaml"
        cluster.write_text(f"name: lab\ntoken_file: token\nheartbeat_s: 1.0\nhosts:\n"
                           f"  - {{name: lab-a, agent_url: '{a.url}'}}\n  - {{name: lab-b, agent_url: '{b.url}'}}\n")
        proc = subprocess.run([sys.executable, "-m", "qosflow", "demo", "--no-ui", "--json", str(out), "--home", str(tmp_path / "demo"),
                               "--cluster", str(cluster)], env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["cluster"]["file"] == str(cluster) and d["cluster"]["backend"] == "agent"
    hosts = {s["host"] for p in d["pipelines"] for s in p["stages"]}
    assert all(p["state"] == "completed" for p in d["pipelines"])
    assert hosts and hosts <= {"lab-a", "lab-b"}


def test_a_terminated_demo_stops_its_prefect_server(tmp_path):
    """SIGTERM ended the demo at once and left its Prefect server (its own session) running; once that
    was fixed, a demo terminated while its pipelines ran stopped its server but never exited (its
    pipelines' threads waited for stages that would never end)."""
    import signal
    import time

    import httpx

    from qosflow.prefect.local import free_port

    port = free_port()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "QOSFLOW_HOME": str(tmp_path / "qosflow")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "qosflow", "demo", "--no-ui", "--port", str(port), "--home", str(tmp_path / "demo")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        up = False
        while time.monotonic() < deadline and not up:
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.5)
        assert up, "the demo's server did not come up"
        running = False  # terminate it while its pipelines run
        while time.monotonic() < deadline and not running:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/api/flow_runs/count", json={"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}, timeout=5)
                running = r.status_code == 200 and r.json() >= 2
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert running, "the demo's pipelines did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        gone = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not gone:
            try:
                httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2)
                time.sleep(0.5)
            except httpx.HTTPError:
                gone = True
        assert gone, "the demo's Prefect server still answers after the demo was terminated"
    finally:
        if proc.poll() is None:
            proc.kill()
