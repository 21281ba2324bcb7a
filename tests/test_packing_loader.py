"""Alibaba v2023 pod/node list loaders: the shared files, and bad input naming file:line:column."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosflow.errors import QosflowError, TraceFormatError
from qosflow.sim.traces.alibaba import default_node_list, default_pod_list, load_nodes, load_pods

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"


def _shared(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"shared Alibaba trace not found at {path} (expected ../shared/data/traces/)")
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shared_pod_list_loads():
    pods = load_pods(_shared(default_pod_list()))
    assert len(pods) == 8152
    first = pods[0]
    assert (first.name, first.cpu_milli, first.memory_mib, first.num_gpu, first.gpu_milli) == ("openb-pod-0000", 12000, 16384, 1, 1000)
    assert first.creation_time == 0 and first.deletion_time == 12537496
    assert sum(1 for p in pods if p.num_gpu == 0) == 1088  # CPU-only pods
    assert sum(1 for p in pods if p.num_gpu == 1 and p.gpu_milli < 1000) > 3000  # shares of one GPU
    assert all(p.gpu_milli == 1000 for p in pods if p.num_gpu > 1)
    assert all(p.scheduled_time is None for p in pods if p.pod_phase == "Pending")
    assert pods[-1].line == 8153


def test_shared_node_list_loads():
    nodes = load_nodes(_shared(default_node_list()))
    assert len(nodes) == 1213
    assert sum(n.gpu for n in nodes) == 6212
    assert {n.model for n in nodes} >= {"G2", "T4", "P100", "V100M16", "V100M32"}


@pytest.mark.parametrize(
    "row, column",
    [
        ("p1,abc,1024,1,500,,LS,Running,0,10,0", "cpu_milli"),
        ("p1,1000,-5,1,500,,LS,Running,0,10,0", "memory_mib"),
        ("p1,1000,1024,1,1500,,LS,Running,0,10,0", "gpu_milli"),
        ("p1,1000,1024,2,500,,LS,Running,0,10,0", "gpu_milli"),  # multi-GPU pods take whole GPUs
        ("p1,1000,1024,0,300,,LS,Running,0,10,0", "gpu_milli"),
        ("p1,1000,1024,1,0,,LS,Running,0,10,0", "gpu_milli"),
        ("p1,1000,1024,x,500,,LS,Running,0,10,0", "num_gpu"),
        ("p1,1000,1024,1,500,,LS,Running,soon,10,0", "creation_time"),
        ("p1,1000,1024,1,500,,LS,Running,20,10,0", "deletion_time"),
        (",1000,1024,1,500,,LS,Running,0,10,0", "name"),
    ],
)
def test_bad_pod_row_names_file_line_column(tmp_path, row, column):
    good = "p0,1000,1024,1,1000,,LS,Running,0,10,0"
    p = _write(tmp_path, "pods.csv", f"{POD_HEADER}\n{good}\n{row}\n")
    with pytest.raises(TraceFormatError) as ei:
        load_pods(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:3:"), msg
    assert repr(column) in msg, msg
    assert ei.value.line == 3 and ei.value.path == str(p)
    assert isinstance(ei.value, QosflowError)


def test_wrong_field_count(tmp_path):
    p = _write(tmp_path, "pods.csv", f"{POD_HEADER}\np0,1000,1024,1,1000,,LS,Running,0,10\n")
    with pytest.raises(TraceFormatError, match=r":2: expected 11 fields"):
        load_pods(p)


def test_missing_columns_are_named(tmp_path):
    p = _write(tmp_path, "pods.csv", "name,cpu_milli,num_gpu\np0,1000,1\n")
    with pytest.raises(TraceFormatError) as ei:
        load_pods(p)
    msg = str(ei.value)
    assert f"{p}:1:" in msg and "'memory_mib'" in msg and "'gpu_milli'" in msg and "'cpu_milli'" not in msg.split("(found")[0]


def test_optional_columns_may_be_absent(tmp_path):
    p = _write(tmp_path, "pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,250\n")
    (pod,) = load_pods(p)
    assert pod.gpu_spec == () and pod.creation_time is None and pod.qos == ""


def test_gpu_spec_is_split(tmp_path):
    p = _write(tmp_path, "pods.csv", f"{POD_HEADER}\np0,1000,1024,1,500,V100M16|V100M32,LS,Running,0,10,\n")
    (pod,) = load_pods(p)
    assert pod.gpu_spec == ("V100M16", "V100M32") and pod.scheduled_time is None


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(TraceFormatError, match="empty file"):
        load_pods(_write(tmp_path, "empty.csv", ""))
    with pytest.raises(TraceFormatError, match="no pods"):
        load_pods(_write(tmp_path, "header.csv", POD_HEADER + "\n"))
    with pytest.raises(TraceFormatError, match="not found"):
        load_nodes(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    "row, column",
    [
        ("n1,abc,1024,8,G2", "cpu_milli"),
        ("n1,96000,1024,-1,G2", "gpu"),
        ("n1,96000,1024,8,", "model"),
        ("n0,96000,1024,8,G2", "sn"),  # duplicate name
    ],
)
def test_bad_node_row(tmp_path, row, column):
    p = _write(tmp_path, "nodes.csv", f"{NODE_HEADER}\nn0,96000,393216,8,G2\n{row}\n")
    with pytest.raises(TraceFormatError) as ei:
        load_nodes(p)
    assert str(ei.value).startswith(f"{p}:3:") and repr(column) in str(ei.value)


def test_pod_and_node_lists_that_are_not_utf8_text_or_are_directories(tmp_path):
    """A Latin-1 pod list ended in a UnicodeDecodeError traceback; a directory said 'file not found'."""
    p = tmp_path / "pods.csv"
    p.write_bytes((POD_HEADER + "\n" + "pod-\xe9,1000,1024,1,500,,LS,Running,0,10,0\n").encode("latin-1"))
    with pytest.raises(TraceFormatError, match=r"pods\.csv:2: not UTF-8 text \(byte 0xe9\); a pod list is a UTF-8 text file"):
        load_pods(p)
    with pytest.raises(TraceFormatError, match=r"is a directory; give the node list file"):
        load_nodes(tmp_path)


def test_a_pod_list_saved_with_semicolons_says_so(tmp_path):
    p = _write(tmp_path, "pods.csv", POD_HEADER.replace(",", ";") + "\np0;1000;1024;1;500;;LS;Running;0;10;0\n")
    with pytest.raises(TraceFormatError, match=r"pods\.csv:1: missing column.*its header is separated by semicolons"):
        load_pods(p)
    # a comma-separated header without the columns gets no delimiter hint
    p = _write(tmp_path, "other.csv", "a,b\n1,2\n")
    with pytest.raises(TraceFormatError) as ei:
        load_pods(p)
    assert "separated by" not in str(ei.value)


def test_pod_and_node_lists_swapped_say_so(tmp_path):
    """`qosflow pack --pods NODES --nodes PODS` listed missing columns only."""
    nodes = _write(tmp_path, "nodes.csv", NODE_HEADER + "\nn0,64000,262144,2,P100\n")
    pods = _write(tmp_path, "pods.csv", POD_HEADER + "\np0,1000,1024,1,500,,LS,Running,0,10,0\n")
    with pytest.raises(TraceFormatError, match=r"nodes\.csv:1: missing column.*this is a node list, not a pod list "
                                               r"\(qosflow pack takes it as --nodes\)"):
        load_pods(nodes)
    with pytest.raises(TraceFormatError, match=r"this is a pod list, not a node list \(qosflow pack takes it as --pods\)"):
        load_nodes(pods)
