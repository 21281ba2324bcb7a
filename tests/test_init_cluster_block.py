"""`qosflow init` on a pool whose cluster block the admin changed (admin review): init again set the
pool's cluster_block back to POOL-cluster (virtual GPUs) without a word; `--cluster-block NAME` points
the pool at an existing cluster block; the restart hint says what happens to the running stages per backend."""

from __future__ import annotations

import asyncio

from pydantic import SecretStr


def _pool_cluster_block(pool: str):
    from qosflow.prefect.local import pool_variable_defaults

    return asyncio.run(pool_variable_defaults(pool)).get("cluster_block")


def _set_pool_cluster_block(pool: str, name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    async def go():
        async with get_client() as c:
            wp = await c.read_work_pool(pool)
            t = wp.base_job_template
            t["variables"]["properties"]["cluster_block"]["default"] = name
            await c.update_work_pool(pool, WorkPoolUpdate(base_job_template=t))

    asyncio.run(go())


def _out(capsys) -> tuple[str, str]:
    o = capsys.readouterr()
    return " ".join(o.out.split()), " ".join(o.err.split())


def test_init_again_keeps_a_cluster_block_init_does_not_manage_and_cluster_block_option(prefect_server, capsys, monkeypatch):
    from qosflow.cli.main import main
    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy

    pool = "init-keeps-lab"
    assert main(["init", "--pool", pool]) == 0
    capsys.readouterr()
    BareMetalGPUCluster(hosts=["gpu-a"], backend="agents", agent_url="http://{host}:8701", agent_token=SecretStr("t0ken"),
                        virtual_gpus=True).save("init-lab", overwrite=True)
    KubernetesGPUCluster(api_url="http://127.0.0.1:1", node_names=["n1"], virtual_gpus=True).save("init-k8s", overwrite=True)
    _set_pool_cluster_block(pool, "init-lab")  # as the docs advise for host agents

    # init again: the agents block stays, and init says so (was set back to init-keeps-lab-cluster silently)
    assert main(["init", "--pool", pool, "--policy", "qosflow"]) == 0
    out, err = _out(capsys)
    assert _pool_cluster_block(pool) == "init-lab"
    assert "cluster block init-lab: kept" in out, out

    # options describing the managed block are not used then: a warning says so
    assert main(["init", "--pool", pool, "--hosts", "3"]) == 0
    out, err = _out(capsys)
    assert _pool_cluster_block(pool) == "init-lab"
    assert "--hosts 3 not used: pool init-keeps-lab keeps its cluster block init-lab" in err, err

    # --cluster-block: an existing Kubernetes block
    assert main(["init", "--pool", pool, "--cluster-block", "init-k8s"]) == 0
    out, err = _out(capsys)
    assert _pool_cluster_block(pool) == "init-k8s"
    assert "cluster block init-k8s: the existing kubernetes cluster block (changed from init-lab)" in out, out

    # a restart hint per backend: Kubernetes stages keep running and are adopted (was "go back to the pool's queue")
    async def online(_pool):
        return ["w-1"]

    monkeypatch.setattr("qosflow.cli.init._online_workers", online)
    assert main(["init", "--pool", pool, "--policy", "fifo"]) == 0
    out, err = _out(capsys)
    assert "keep running as Kubernetes Jobs and the restarted worker adopts them" in out, out
    assert "go back to the pool's queue" not in out, out
    monkeypatch.undo()

    # missing, and not a cluster block: refused, the pool unchanged
    assert main(["init", "--pool", pool, "--cluster-block", "no-such-block"]) == 2
    out, err = _out(capsys)
    assert "invalid --cluster-block: no cluster block named 'no-such-block'" in err, err
    QoSPolicy(policy="fifo").save("init-a-policy", overwrite=True)
    assert main(["init", "--pool", pool, "--cluster-block", "qosflow-qos-policy/init-a-policy"]) == 2
    out, err = _out(capsys)
    assert "not a qosflow cluster block" in err, err
    assert main(["init", "--pool", pool, "--cluster-block", "init-lab", "--hosts", "2"]) == 2
    out, err = _out(capsys)
    assert "give one or the other" in err, err
    assert _pool_cluster_block(pool) == "init-k8s"

    # back to the block init saves, from the options
    assert main(["init", "--pool", pool, "--cluster-block", f"{pool}-cluster", "--hosts", "2"]) == 0
    out, err = _out(capsys)
    assert _pool_cluster_block(pool) == f"{pool}-cluster"
    assert f"cluster block {pool}-cluster: 2 x 4 virtual GPUs, 16 cores per host (changed from init-k8s)" in out, out
    assert len(BareMetalGPUCluster.load(f"{pool}-cluster").hosts) == 2


def test_init_again_with_other_sizes_says_what_the_cluster_block_was(prefect_server, capsys):
    """docs/prefect.md: `qosflow init` again with other --hosts saves the block again. After `qosflow init
    --pool gpu` (1 x 4), `qosflow init --pool gpu --hosts 2 --gpus-per-host 4` printed 'cluster block
    gpu-cluster: 2 x 4 virtual GPUs, 16 cores per host (unchanged)' (admin review): the pool's
    cluster_block name was unchanged, the cluster was not. It now says what the block held before."""
    from qosflow.cli.main import main

    pool = "init-resized"
    assert main(["init", "--pool", pool]) == 0
    capsys.readouterr()
    assert main(["init", "--pool", pool, "--hosts", "2", "--gpus-per-host", "4"]) == 0
    out, _ = _out(capsys)
    assert (f"cluster block {pool}-cluster: 2 x 4 virtual GPUs, 16 cores per host "
            "(saved again; it was 1 x 4 virtual GPUs, 16 cores per host)") in out, out
    assert main(["init", "--pool", pool, "--hosts", "2", "--gpus-per-host", "4"]) == 0
    out, _ = _out(capsys)
    assert f"cluster block {pool}-cluster: 2 x 4 virtual GPUs, 16 cores per host (unchanged)" in out, out


def test_the_restart_hint_on_a_local_pool_does_not_claim_an_agents_workers_stages_stop(prefect_server, capsys, monkeypatch):
    """The bare-metal worker of docs/infrastructure.md is `qosflow worker start --pool gpu --cluster-file lab.yaml`
    on a pool `qosflow init` made (its cluster block: local). init again said that worker's stages 'on this
    machine's local backend stop, and go back to the pool's queue' (admin review): they ran on the agents,
    and keep running. The hint says which stages stop."""
    from qosflow.cli.main import main

    pool = "init-hint-local"
    assert main(["init", "--pool", pool]) == 0
    capsys.readouterr()

    async def online(_pool):
        return ["w-agents"]

    monkeypatch.setattr("qosflow.cli.init._online_workers", online)
    assert main(["init", "--pool", pool, "--policy", "fifo"]) == 0
    out, _ = _out(capsys)
    assert "worker(s) w-agents of pool init-hint-local keep the cluster and policy they started with" in out, out
    assert "a worker started with --cluster-file or --cluster-block on host agents or Kubernetes leaves its stages running" in out, out
    assert "on this machine's local backend stop" not in out, out


def test_init_help_names_cluster_block(capsys):
    from qosflow.cli.main import main

    assert main(["init", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--cluster-block" in out and "keeps a cluster_block that names another block" in out, out


def test_docs_start_agents_on_the_agents_default_port():
    """README said `qosflow agent start --port 7800` while docs/infrastructure.md, the agent_url examples and
    the agent's own default use 8701 (admin review)."""
    import re
    from pathlib import Path

    import typer.main

    from qosflow.cli.main import app

    root = Path(__file__).resolve().parent.parent
    agent = typer.main.get_command(app).commands["agent"].commands["start"]
    default = next(p.default for p in agent.params if p.name == "port")
    ports = {(f.name, int(m)) for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for m in re.findall(r"qosflow agent start[^\n`]*?--port (\d+)", f.read_text())}
    assert ports and {p for _, p in ports} == {default}, (default, ports)
