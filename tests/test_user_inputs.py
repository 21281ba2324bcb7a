"""A user's own traces and clusters given to `qosflow simulate` (and `qosflow pack`): the mistakes of a
hand-made input, and what an earlier run leaves in the output directory."""

from __future__ import annotations

import json

import pytest

from qosflow.cli.main import main
from qosflow.errors import TraceFormatError
from qosflow.sim.clusters import load_cluster
from qosflow.sim.traces.muri import load_muri

TRACE = """job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time
a1,1,0,1000,resnet18,128,3600000,3600
a2,2,60000,2000,bert,4,7200000,3600
a3,4,120000,500,gpt2,4,1800000,3600
a4,1,180000,1000,vgg16,16,3600000,3600
a5,8,240000,1000,resnet18,128,3600000,3600
a6,1,300000,1000,dqn,128,600000,600
"""
CLUSTER = "num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,2,4,32,256\n"
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p1,4000,8192,1,500,,LS,Succeeded,0,3600,10
p2,2000,4096,0,0,,Burstable,Succeeded,200,900,200
"""


def _files(tmp_path, trace=TRACE, cluster=CLUSTER):
    t, c = tmp_path / "trace.csv", tmp_path / "cluster.csv"
    t.write_text(trace)
    c.write_text(cluster)
    return t, c


@pytest.mark.parametrize("cell, unit, value", [("60min", "milliseconds", "3600000"), ("2 h", "milliseconds", "7200000"),
                                                ("1500ms", "milliseconds", "1500")])
def test_a_duration_with_a_unit_says_what_to_write(tmp_path, cell, unit, value):
    """'60min' in the duration column was "expected duration in ms (a number), got '60min'", with no word on
    how to write it."""
    t, _ = _files(tmp_path, TRACE.replace("a1,1,0,1000,resnet18,128,3600000", f"a1,1,0,1000,resnet18,128,{cell}"))
    with pytest.raises(TraceFormatError) as e:
        load_muri(t)
    msg = str(e.value)
    assert f"{t}:2: column 'duration'" in msg
    assert f"the column is in {unit}, written without a unit: {cell!r} is {value}" in msg


def test_an_alibaba_time_with_a_unit_says_what_to_write(tmp_path, capsys):
    t, _ = _files(tmp_path, PODS.replace(",0,3600,10", ",0,1h,10"))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\n")
    assert main(["simulate", "--trace", str(t), "--cluster", str(nodes), "--policies", "fifo", "--no-plots"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{t}:2: column 'deletion_time'" in err and "in seconds, written without a unit: '1h' is 3600" in err


def test_a_muri_cluster_of_zero_gpus_per_node_is_refused_at_its_line(tmp_path):
    """num_gpu_p_node 0 made a cluster of no GPUs: every job was then rejected, 'the cluster has 0 that fit
    it', and the error named the trace, not the cluster file."""
    _, c = _files(tmp_path, cluster=CLUSTER.replace("1,2,4,32,256", "1,2,0,32,256"))
    with pytest.raises(TraceFormatError, match=r"cluster.csv:2: column 'num_gpu_p_node': must be > 0"):
        load_cluster(c)


def test_a_cluster_without_any_gpu_is_refused_by_simulate(tmp_path, capsys):
    """A node list of CPU nodes only was simulated: GPU jobs rejected one by one, the rest compared at 0 %
    GPU allocation."""
    t, _ = _files(tmp_path, PODS)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,0,\n")
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(t), "--cluster", str(nodes), "--policies", "fifo", "--json", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{nodes}: the cluster has no GPUs" in err
    assert not out.exists()
