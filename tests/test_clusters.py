"""`load_cluster`: NxG, Muri CSV, Alibaba node list, Gavel cluster specs, and bad input."""

from __future__ import annotations

import pytest

from qosflow.core.qos import QoSSpec
from qosflow.errors import SpecError, TraceFormatError
from qosflow.paths import shared_data
from qosflow.sim.clusters import GIB, load_cluster

TRACES = shared_data() / "traces"


def need(p):
    if not p.exists():
        pytest.skip(f"shared data file not found: {p}")


def test_nxg():
    c = load_cluster("8x8")
    assert len(c.nodes) == 8 and c.num_gpus == 64 and c.name == "8x8"
    n = c.nodes[0]
    assert n.gpus == 8 and n.gpu_mem_mb == 32 * GIB and n.cpu_cores == 64 and n.mem_mb == 512 * GIB
    assert load_cluster(" 2X4 ").num_gpus == 8
    for bad in ("0x8", "8x0"):
        with pytest.raises(SpecError, match="cluster"):
            load_cluster(bad)


def test_unknown_spec_names_the_forms(tmp_path):
    with pytest.raises(SpecError, match="neither NxG"):
        load_cluster("eight-by-eight")
    with pytest.raises(SpecError, match="empty"):
        load_cluster("")
    with pytest.raises(SpecError, match="directory"):
        load_cluster(str(tmp_path))


def test_gavel_spec_strings():
    c = load_cluster("500:0:0")
    assert c.num_gpus == 500 and len(c.nodes) == 125
    assert {n.gpu_model for n in c.nodes} == {"v100"} and c.nodes[0].gpu_mem_mb == 16 * GIB
    c = load_cluster("8:8:8/4:4:8")
    assert c.num_gpus == 24 and [n.gpus for n in c.nodes] == [4, 4, 4, 4, 8]
    assert [n.gpu_model for n in c.nodes] == ["v100", "v100", "p100", "p100", "k80"]
    assert [n.gpus for n in load_cluster("6:0:0").nodes] == [4, 2]  # a smaller last server
    with pytest.raises(SpecError, match="no GPUs"):
        load_cluster("0:0:0")


def test_gavel_cluster_specs_json(tmp_path):
    p = tmp_path / "cluster_specs.json"
    p.write_text('{"philly": ["500:0:0"], "small": ["8:0:0"]}')
    assert load_cluster(str(p)).num_gpus == 500
    assert load_cluster(f"{p}#small").num_gpus == 8
    with pytest.raises(TraceFormatError, match="no virtual cluster 'x'"):
        load_cluster(f"{p}#x")
    bad = tmp_path / "bad.json"
    bad.write_text('{"philly": ["five hundred"]}')
    with pytest.raises(TraceFormatError, match=r"bad\.json:1: 'philly': 'five hundred'"):
        load_cluster(str(bad))


def test_muri_csv(tmp_path):
    p = tmp_path / "n2g4.csv"
    p.write_text("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n2,3,4,48,256\n")
    c = load_cluster(str(p))
    assert len(c.nodes) == 6 and c.num_gpus == 24 and c.name == "n2g4"
    assert [n.switch for n in c.nodes] == [0, 0, 0, 1, 1, 1]
    assert c.nodes[0].cpu_cores == 48 and c.nodes[0].mem_mb == 256 * GIB and c.nodes[0].gpu_mem_mb == 32 * GIB


@pytest.mark.parametrize(
    "text, match",
    [
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node\n1,8,8,92\n", r":1: missing column\(s\) mem_p_node"),
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,8,x,92,520\n", r":2: column 'num_gpu_p_node'"),
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,0,8,92,520\n", r":2: column 'num_node_p_switch'"),
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,8,8,92\n", r":2: expected 5 fields"),
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,8,8,92,520\n1,8,8,92,520\n", r":3: a Muri cluster CSV has exactly one"),
        ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n", "no data row"),
        ("hosts,gpus\nh1,8\n", r":1: not a cluster file"),
    ],
)
def test_bad_cluster_files(tmp_path, text, match):
    p = tmp_path / "c.csv"
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=match) as ei:
        load_cluster(str(p))
    assert str(p) in str(ei.value)


def test_alibaba_node_list(tmp_path):
    p = tmp_path / "nodes.csv"
    p.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,786432,8,G2\nn2,32000,131072,0,\n")
    c = load_cluster(str(p))
    assert [n.gpus for n in c.nodes] == [2, 8, 0] and c.num_gpus == 10
    assert c.nodes[0].gpu_model == "P100" and c.nodes[0].gpu_mem_mb == 16 * GIB and c.nodes[0].cpu_cores == 64
    assert c.nodes[1].mem_mb == 786432
    assert c.why_never_fits(QoSSpec(gpus=1, gpu_milli=500, cpu_cores=8, gpu_model="P100")) is None
    assert "no node has GPU model" in c.why_never_fits(QoSSpec(gpus=1, gpu_model="A100"))
    bad = tmp_path / "bad.csv"
    bad.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,0,1024,1,T4\n")
    with pytest.raises(TraceFormatError, match=r"bad\.csv:3: column 'cpu_milli'"):
        load_cluster(str(bad))


def test_shared_cluster_files():
    muri = TRACES / "muri_cluster_n8g8.csv"
    need(muri)
    c = load_cluster(str(muri))
    assert len(c.nodes) == 8 and c.num_gpus == 64 and c.nodes[0].cpu_cores == 92 and c.nodes[0].mem_mb == 520 * GIB
    nodes = TRACES / "alibaba_v2023_openb_node_list_gpu_node.csv"
    need(nodes)
    a = load_cluster(str(nodes))
    assert len(a.nodes) == 1213 and a.num_gpus == 6212
    assert {n.gpu_model for n in a.nodes} >= {"G2", "T4", "P100", "V100M16", "V100M32"}
    spec = TRACES / "gavel_msr_seed0" / "cluster_specs.json"
    need(spec)
    assert load_cluster(str(spec)).num_gpus == 500
