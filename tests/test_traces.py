"""Trace loaders, the synthetic generator, deadline assignment and `load_workload`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.qos import PriorityClass, QoSSpec
from qosflow.errors import QosflowError, SpecError, TraceFormatError, UnknownNameError
from qosflow.paths import shared_data
from qosflow.sim.clusters import load_cluster
from qosflow.policies import get_policy
from qosflow.sim.engine import simulate
from qosflow.sim.deadlines import assign_deadlines, deadline_factor
from qosflow.sim.interference import GavelInterference, default_throughputs_path
from qosflow.sim.traces.alibaba_jobs import load_alibaba_jobs
from qosflow.sim.traces.gavel import load_gavel
from qosflow.sim.traces.muri import load_muri
from qosflow.sim.traces.synthetic import (
    GPU_CHOICES,
    generate_synthetic,
    mean_duration,
    mean_gpus,
    offered_load,
    rate_for_load,
)
from qosflow.sim.workload import FORMATS, load_workload

TRACES = shared_data() / "traces"
MURI = TRACES / "muri_philly_trace1.csv"
MURI_CLUSTER = TRACES / "muri_cluster_n8g8.csv"
GAVEL_DIR = TRACES / "gavel_msr_seed0"
ALI_PODS = TRACES / "alibaba_v2023_openb_pod_list_default.csv"
ALI_NODES = TRACES / "alibaba_v2023_openb_node_list_gpu_node.csv"
TPUT = default_throughputs_path()


def need(*paths: Path) -> None:
    for p in paths:
        if not p.exists():
            pytest.skip(f"shared data file not found: {p}")


@pytest.fixture(scope="module")
def table() -> GavelInterference:
    need(TPUT)
    return GavelInterference()


@pytest.fixture
def tiny(tmp_path) -> GavelInterference:
    """A two-type table in Gavel's format, so error paths are tested without the shared data."""
    p = tmp_path / "tput.json"
    p.write_text(json.dumps({"v100": {"('A3C', 1)": {"null": 7.0}, "('ResNet-18 (batch size 32)', 1)": {"null": 30.0}}}))
    return GavelInterference(p)


MURI_HEADER = "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,interval,iteration_time,resource_time_0,resource_time_1,resource_time_2,priority"
MURI_ROW = "7,2,4000,100,resnet18,128,77900,1000,779,711,110,0,{prio}"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ====================================================================== Muri
def test_muri_row_units_and_qos(tmp_path):
    p = write(tmp_path, "m.csv", MURI_HEADER + "\n" + MURI_ROW.format(prio=0) + "\n" + MURI_ROW.replace("7,", "8,", 1).format(prio=1) + "\n")
    jobs, rej = load_muri(p)
    assert rej == []
    j = jobs[0]
    assert j.job_id == "7" and j.submit_time == 4.0 and j.duration == pytest.approx(77.9)
    assert j.resource_profile == pytest.approx((0.711, 0.110, 0.0))
    assert j.model == "resnet18" and j.batch_size == 128 and j.iterations == 100
    assert j.qos.gpus == 2 and j.qos.shareable and j.qos.gang
    assert j.qos.gpu_mem_mb == 6432 and j.qos.cpu_cores == 8.0
    assert j.qos.priority is PriorityClass.NORMAL and jobs[1].qos.priority is PriorityClass.BEST_EFFORT
    assert j.meta["iteration_time"] == pytest.approx(0.779) and j.meta["line"] == 2
    j2, _ = load_muri(p, iteration_overhead=1.015)
    assert j2[0].duration == pytest.approx(77.9 * 1.015)


@pytest.mark.parametrize(
    "row, where",
    [
        ("7,2,4000,100,resnet18,128,abc,1000,779,711,110,0,1", "'duration'"),
        ("7,0,4000,100,resnet18,128,77900,1000,779,711,110,0,1", "'num_gpu'"),
        ("7,1.5,4000,100,resnet18,128,77900,1000,779,711,110,0,1", "'num_gpu'"),
        ("7,2,-5,100,resnet18,128,77900,1000,779,711,110,0,1", "'submit_time'"),
        ("7,2,4000,100,,128,77900,1000,779,711,110,0,1", "'model_name'"),
        ("7,2,4000,100,resnet18,128,-1,1000,779,711,110,0,1", "'duration'"),
        ("7,2,4000,100,resnet18,128,77900,1000,779,711,110,nan,1", "'resource_time_2'"),
        ("7,2,4000,100,resnet18,128,77900,1000", "expected 13 fields"),
    ],
)
def test_muri_bad_rows_name_file_line_and_column(tmp_path, row, where):
    good = MURI_ROW.replace("7,", "1,", 1).format(prio=0)
    p = write(tmp_path, "bad.csv", MURI_HEADER + "\n" + good + "\n" + row + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_muri(p)
    assert ei.value.line == 3 and ei.value.path.endswith("bad.csv")
    assert "bad.csv:3" in str(ei.value) and where in str(ei.value)


def test_muri_zero_duration_rows_are_rejected_not_fatal(tmp_path):
    zero = "9,1,5000,0,resnet18,128,0,1000,0,0,0,0,0"
    p = write(tmp_path, "z.csv", MURI_HEADER + "\n" + MURI_ROW.format(prio=0) + "\n" + zero + "\n")
    jobs, rej = load_muri(p)
    assert [j.job_id for j in jobs] == ["7"]
    assert rej == [("9", "line 3: duration 0 ms, nothing to run")]


def test_muri_missing_column_and_duplicates(tmp_path):
    p = write(tmp_path, "m.csv", MURI_HEADER.replace(",duration", "") + "\n")
    with pytest.raises(TraceFormatError, match=r"m\.csv:1: missing column\(s\) 'duration'"):
        load_muri(p)
    row = MURI_ROW.format(prio=0)
    p = write(tmp_path, "d.csv", f"{MURI_HEADER}\n{row}\n{row}\n")
    with pytest.raises(TraceFormatError, match=r"d\.csv:3: column 'job_id': job '7' already appears on line 2"):
        load_muri(p)
    with pytest.raises(TraceFormatError, match="not found"):
        load_muri(tmp_path / "nope.csv")
    p = write(tmp_path, "e.csv", MURI_HEADER + "\n")
    with pytest.raises(TraceFormatError, match="no jobs"):
        load_muri(p)


def test_muri_priority_column_is_optional(tmp_path):
    # Muri's simulator draws a random priority when a trace has none: the column may be left out
    header = MURI_HEADER.removesuffix(",priority")
    row = MURI_ROW.format(prio=0).removesuffix(",0")
    p = write(tmp_path, "np.csv", f"{header}\n{row}\n")
    jobs, rej = load_muri(p)
    assert rej == [] and [j.job_id for j in jobs] == ["7"]
    j = jobs[0]
    assert j.meta["trace_priority"] is None and j.meta["priority_from_trace"] is False
    assert j.qos.priority is PriorityClass.NORMAL
    # without a trace priority, a job without a deadline becomes best-effort (as for Gavel's traces)
    wl = load_workload(str(p), "muri", cluster=load_cluster("8x8"), deadline_share=0.0)
    assert wl.jobs[0].qos.priority is PriorityClass.BEST_EFFORT
    # an empty cell is unknown too; a present value still counts
    p = write(tmp_path, "mixed.csv", MURI_HEADER + "\n" + MURI_ROW.format(prio="") + "\n"
              + MURI_ROW.replace("7,", "8,", 1).format(prio=1) + "\n")
    jobs, _ = load_muri(p)
    assert [j.meta["priority_from_trace"] for j in jobs] == [False, True]
    assert jobs[1].qos.priority is PriorityClass.BEST_EFFORT


def test_muri_model_without_a_memory_profile_gets_the_largest_figure(tmp_path):
    """A model SJF-BSBF did not profile used to get no GPU memory, so qosflow never co-located it
    (the baselines placed it as if it needed none); it now gets the largest profiled figure, and the
    job says the figure was assumed."""
    from qosflow.sim.interference import MURI_GPU_MEM_MB

    p = write(tmp_path, "new.csv", MURI_HEADER + "\n" + MURI_ROW.format(prio=0) + "\n"
              + MURI_ROW.replace("7,", "8,", 1).replace("resnet18", "inception_v3").format(prio=0) + "\n")
    jobs, rej = load_muri(p)
    assert rej == []
    known, new = jobs
    assert (known.qos.gpu_mem_mb, known.meta["gpu_mem_assumed"]) == (MURI_GPU_MEM_MB["resnet18"], False)
    assert (new.qos.gpu_mem_mb, new.meta["gpu_mem_assumed"]) == (max(MURI_GPU_MEM_MB.values()), True)


def test_muri_shared_trace():
    need(MURI, MURI_CLUSTER)
    cluster = load_cluster(str(MURI_CLUSTER))
    jobs, rej = load_muri(MURI, cluster=cluster)
    assert len(jobs) == 1494 and rej == []
    assert {j.model for j in jobs} == {"resnet18", "shufflenet_v2_x1_0", "vgg16", "vgg19", "dqn", "a2c", "bert", "gpt2"}
    assert all(j.qos.gpu_mem_mb is not None and j.resource_profile and len(j.resource_profile) == 3 for j in jobs)
    assert max(j.qos.gpus for j in jobs) == 32
    # offered load about 2x on 64 GPUs (README)
    span = max(j.submit_time for j in jobs) - min(j.submit_time for j in jobs)
    load = sum(j.qos.gpus * j.duration for j in jobs) / span / cluster.num_gpus
    assert 1.8 < load < 2.2


def test_muri_rejects_jobs_that_never_fit_and_reports_them():
    need(MURI)
    small = ClusterSpec.uniform(2, 8, gpu_mem_mb=32768, cpu_cores=64)
    jobs, rej = load_muri(MURI, cluster=small)
    assert len(jobs) + len(rej) == 1494
    assert rej and all("32 GPUs" in reason or "GPUs" in reason for _, reason in rej)
    assert {j.job_id for j in jobs}.isdisjoint({jid for jid, _ in rej})


# ====================================================================== Gavel
GAVEL_LINE = "ResNet-18 (batch size 32)\tcd %s && python3 main.py\t--num_steps\t1\t{steps}\t{t}\t{sf}"


def test_gavel_durations_from_throughputs(tmp_path, table):
    p = write(tmp_path, "vc.trace", GAVEL_LINE.format(steps=29947, t="0.000000", sf=1) + "\n" + GAVEL_LINE.format(steps=1000, t="12.5", sf=16) + "\n")
    jobs, rej = load_gavel(p, throughputs=table)
    assert rej == [] and [j.job_id for j in jobs] == ["vc-0", "vc-1"]
    j = jobs[0]
    assert j.duration == pytest.approx(29947 / table.throughput("ResNet-18 (batch size 32)", 1))
    assert j.model == "ResNet-18 (batch size 32)" and j.batch_size == 32 and j.iterations == 29947
    assert j.qos.gpus == 1 and j.qos.shareable and j.qos.gpu_mem_mb == 1500.0 and j.qos.cpu_cores == 4.0
    assert j.meta["throughput_source"] == "measured"
    assert jobs[1].submit_time == 12.5 and jobs[1].qos.gpus == 16
    assert "extrapolated" in jobs[1].meta["throughput_source"]


def test_gavel_nine_field_form(tmp_path, tiny):
    line = "A3C\tcd x\t--max-steps\t0\t5000\t1\t1\t-1\t42"
    jobs, _ = load_gavel(write(tmp_path, "g.trace", line + "\n"), throughputs=tiny)
    assert jobs[0].submit_time == 42.0 and jobs[0].qos.gpus == 1 and jobs[0].meta["SLO"] == -1


def test_gavel_ten_field_form(tmp_path, tiny):
    """Gavel's latest parse_trace reads a working directory after the command."""
    from qosflow.sim.runner import guess_format

    line = "A3C\tcd x\t/workspace/a3c\t--max-steps\t0\t5000\t2\t1.5\t-1\t42"
    p = write(tmp_path, "g.txt", line + "\n")
    jobs, _ = load_gavel(p, throughputs=tiny)
    j = jobs[0]
    assert (j.submit_time, j.qos.gpus, j.iterations, j.meta["priority_weight"]) == (42.0, 2, 5000, 1.5)
    assert guess_format(str(p)) == "gavel"
    with pytest.raises(TraceFormatError, match="got 8"):
        load_gavel(write(tmp_path, "bad.trace", "\t".join(line.split("\t")[:8]) + "\n"), throughputs=tiny)


@pytest.mark.parametrize(
    "line, where",
    [
        ("\tcd\t-n\t1\t100\t0\t1", "'job_type'"),
        ("A3C\tcd\t-n\t1\tmany\t0\t1", "'total_steps'"),
        ("A3C\tcd\t-n\t1\t100\t0\t0", "'scale_factor'"),
        ("A3C\tcd\t-n\t1\t100\tsoon\t1", "'arrival_time'"),
        ("A3C\tcd\t-n\t2\t100\t0\t1", "'needs_data_dir'"),
        ("A3C\tcd\t-n\t1\t100", "7 tab-separated fields"),
    ],
)
def test_gavel_bad_lines(tmp_path, tiny, line, where):
    good = "A3C\tcd\t-n\t1\t100\t0\t1"
    p = write(tmp_path, "bad.trace", good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_gavel(p, throughputs=tiny)
    assert ei.value.line == 2 and "bad.trace:2" in str(ei.value) and where in str(ei.value)


def test_gavel_unknown_job_type_is_rejected_not_fatal(tmp_path, tiny):
    lines = ["A3C\tcd\t-n\t1\t100\t0\t1", "Nope (batch size 3)\tcd\t-n\t1\t100\t5\t1", "A3C\tcd\t-n\t1\t700\t9\t1"]
    jobs, rej = load_gavel(write(tmp_path, "vc.trace", "\n".join(lines) + "\n"), throughputs=tiny)
    assert [j.job_id for j in jobs] == ["vc-0", "vc-2"]  # ids still count every line, as Gavel's
    assert len(rej) == 1 and rej[0][0] == "vc-1"
    assert "line 2" in rej[0][1] and "'Nope (batch size 3)'" in rej[0][1] and "throughput table" in rej[0][1]


def test_gavel_needs_a_throughput_table(tmp_path):
    p = write(tmp_path, "g.trace", "A3C\tcd\t-n\t1\t100\t0\t1\n")
    with pytest.raises(TraceFormatError, match="throughput table"):
        load_gavel(p, throughputs=tmp_path / "absent.json")
    with pytest.raises(TraceFormatError, match="directory"):
        load_gavel(tmp_path)


def test_gavel_bom_blank_runs_and_header(tmp_path, tiny):
    """A byte-order mark made the first job type unknown (the job silently rejected), as did a double
    blank inside a job type; a header line failed on 'total_steps' without saying traces have none."""
    lines = ["ResNet-18  (batch size 32)\tcd\t-n\t1\t300\t0\t1", "A3C\tcd\t-n\t1\t700\t9\t1"]
    p = tmp_path / "vc.trace"
    p.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    jobs, rej = load_gavel(p, throughputs=tiny)
    assert rej == [] and [j.model for j in jobs] == ["ResNet-18 (batch size 32)", "A3C"]
    head = "\t".join(("job_type", "command", "num_steps_arg", "needs_data_dir", "total_steps", "arrival_time", "scale_factor"))
    with pytest.raises(TraceFormatError, match=r"h.trace:1: looks like a header .*Gavel traces have none"):
        load_gavel(write(tmp_path, "h.trace", head + "\n" + lines[1] + "\n"), throughputs=tiny)


def test_gavel_slo_field_is_the_deadline(tmp_path, tiny):
    """Gavel's 9-field form carries an SLO: deadline = SLO x duration after arrival; -1 is none."""
    lines = ["A3C\tcd x\t--max-steps\t0\t7000\t1\t1\t2.5\t10", "A3C\tcd x\t--max-steps\t0\t700\t1\t1\t-1\t20"]
    p = write(tmp_path, "s.trace", "\n".join(lines) + "\n")
    jobs, _ = load_gavel(p, throughputs=tiny)
    for share in (0.0, 1.0):
        by = {j.job_id: j for j in assign_deadlines(jobs, share=share, seed=0)}
        assert by["s-0"].qos.deadline == pytest.approx(2.5 * 1000.0) and by["s-0"].meta["deadline_lambda"] == 2.5
        assert (by["s-1"].qos.deadline is None) == (share == 0.0)  # no SLO: drawn with the share
        if share:
            assert 1.2 <= by["s-1"].meta["deadline_lambda"] <= 3.0


def test_gavel_shared_traces(table):
    need(GAVEL_DIR)
    files = sorted(GAVEL_DIR.glob("*.trace"))
    assert files
    cluster = load_cluster(str(GAVEL_DIR / "cluster_specs.json"))
    total = 0
    for f in files:
        jobs, rej = load_gavel(f, cluster=cluster, throughputs=table)
        assert len(jobs) + len(rej) == sum(1 for line in f.read_text().splitlines() if line.strip())
        assert all(j.duration > 0 and math.isfinite(j.duration) for j in jobs)
        total += len(jobs) + len(rej)
    assert total == 15264


# ====================================================================== Alibaba
ALI_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


def test_alibaba_pods_to_jobs(tmp_path):
    rows = [
        "p0,12000,16384,1,1000,,LS,Running,0,500,10",
        "p1,6000,12288,1,460,V100M16,BE,Succeeded,5,100,5",
        "p2,4000,8192,0,0,,Burstable,Succeeded,7,50,8",
        "p3,8000,8192,2,1000,T4|P100,Guaranteed,Failed,9,90,9",
        "p4,11908,47104,1,1000,,BE,Pending,10,125,",
        "p5,1000,1024,1,1000,,LS,Succeeded,10,10,10",
    ]
    p = write(tmp_path, "pods.csv", ALI_HEADER + "\n" + "\n".join(rows) + "\n")
    jobs, rej = load_alibaba_jobs(p)
    by = {j.job_id: j for j in jobs}
    assert set(by) == {"p0", "p1", "p2", "p3"}
    assert [r[0] for r in rej] == ["p4", "p5"]
    assert "never scheduled" in rej[0][1] and "not after" in rej[1][1]
    j0 = by["p0"]
    assert j0.submit_time == 0 and j0.duration == 490 and j0.meta["censored"]
    assert j0.qos.cpu_cores == 12 and j0.qos.mem_mb == 16384 and not j0.qos.shareable
    assert j0.qos.priority is PriorityClass.GUARANTEED and j0.meta["wants_deadline"] is True
    j1 = by["p1"]
    assert j1.qos.fractional and j1.qos.gpu_milli == 460 and j1.qos.gpu_model == "V100M16"
    assert j1.qos.priority is PriorityClass.BEST_EFFORT and j1.meta["wants_deadline"] is False
    assert by["p2"].qos.gpus == 0 and by["p2"].qos.priority is PriorityClass.NORMAL
    assert by["p3"].qos.gpus == 2 and by["p3"].qos.gpu_model == "T4|P100" and by["p3"].meta["gpu_spec"] == ["T4", "P100"]
    assert by["p3"].qos.gpu_models == ("T4", "P100")


def test_alibaba_replay_needs_the_time_columns_and_unique_names(tmp_path):
    """A list without its times was "all pods never scheduled"; a repeated name failed later with no
    file or line (and `pack` took it silently)."""
    from qosflow.sim.traces.alibaba import load_pods

    bare = write(tmp_path, "bare.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n")
    assert len(load_pods(bare)) == 1  # enough to pack
    with pytest.raises(TraceFormatError, match=r"bare.csv:1: missing column\(s\) 'creation_time', 'scheduled_time', "
                                               r"'deletion_time'.*replayed in time \(qosflow pack needs only the first five\)"):
        load_alibaba_jobs(bare)
    rows = ["p0,1000,1024,1,500,,LS,Running,0,50,1", "p1,1000,1024,1,500,,LS,Running,0,50,1", "p0,1000,1024,1,500,,LS,Running,0,50,1"]
    dup = write(tmp_path, "dup.csv", ALI_HEADER + "\n" + "\n".join(rows) + "\n")
    for load in (load_pods, load_alibaba_jobs):
        with pytest.raises(TraceFormatError, match=r"dup.csv:4: column 'name': pod 'p0' already appears on line 2"):
            load(dup)


def test_alibaba_pod_must_fit_one_node(tmp_path):
    # two 4-GPU T4 nodes and one 8-GPU G2 node: 8 T4 GPUs exist, but no single T4 node has them
    nodes = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\n"
                  "t0,64000,262144,4,T4\nt1,64000,262144,4,T4\ng0,96000,786432,8,G2\n")
    rows = [
        "p0,8000,8192,8,1000,T4,LS,Running,0,500,10",  # 8 T4 GPUs: no T4 node is that big
        "p1,8000,8192,8,1000,,LS,Running,0,500,10",  # any model: the G2 node holds it
        "p2,8000,500000,4,1000,T4,BE,Running,0,500,10",  # more memory than a T4 node has
        "p3,8000,8192,4,1000,T4,BE,Running,0,500,10",
    ]
    pods = write(tmp_path, "pods.csv", ALI_HEADER + "\n" + "\n".join(rows) + "\n")
    jobs, rej = load_alibaba_jobs(pods, cluster=load_cluster(str(nodes)))
    assert sorted(j.job_id for j in jobs) == ["p1", "p3"]
    assert [r[0] for r in rej] == ["p0", "p2"]
    assert "one node" in rej[0][1] and "no T4 node has 500000 MiB of host memory" in rej[1][1]


def test_alibaba_pod_with_several_models_runs_on_one_of_them(tmp_path):
    # a pod accepting T4 or P100 must never land on the G2 node, though the G2 node is free first
    nodes = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\n"
                  "g0,96000,786432,8,G2\nt0,64000,262144,2,T4\np0,64000,262144,2,P100\n")
    rows = [f"a{i},4000,8192,2,1000,T4|P100,LS,Running,{i},{500 + i},{i}" for i in range(4)]
    rows.append("b0,4000,8192,4,1000,T4|P100,LS,Running,0,500,0")  # no T4 or P100 node has 4 GPUs
    pods = write(tmp_path, "pods.csv", ALI_HEADER + "\n" + "\n".join(rows) + "\n")
    cluster = load_cluster(str(nodes))
    jobs, rej = load_alibaba_jobs(pods, cluster=cluster)
    assert [r[0] for r in rej] == ["b0"] and "'T4' or 'P100'" not in rej[0][1] and "T4 or P100 node" in rej[0][1]
    for name in ("fifo", "qosflow"):
        policy, used = get_policy(name), set()
        decide = policy.schedule

        def schedule(view, decide=decide, used=used):
            d = decide(view)
            used.update(cluster.nodes[n].gpu_model for p in d.starts for n in p.nodes)
            return d

        policy.schedule = schedule
        res = simulate(jobs, cluster, policy)
        assert len(res.jobs) == 4 and all(js.finish_time is not None for js in res.jobs), name
        assert used == {"T4", "P100"}, (name, used)


def test_alibaba_bad_row(tmp_path):
    p = write(tmp_path, "pods.csv", ALI_HEADER + "\np0,12000,16384,1,1000,,LS,Running,0,500,10\np1,x,1,1,1000,,LS,Running,0,5,1\n")
    with pytest.raises(TraceFormatError, match=r"pods\.csv:3: column 'cpu_milli'"):
        load_alibaba_jobs(p)


def test_alibaba_shared_trace():
    need(ALI_PODS, ALI_NODES)
    cluster = load_cluster(str(ALI_NODES))
    jobs, rej = load_alibaba_jobs(ALI_PODS, cluster=cluster)
    assert len(jobs) + len(rej) == 8152
    assert len(rej) == 897  # the pending pods: no running time, reported with a reason
    assert all(reason for _, reason in rej)
    assert sum(1 for j in jobs if j.qos.fractional) > 1000


# ====================================================================== synthetic
def test_synthetic_distribution_and_determinism(table):
    a, _ = generate_synthetic(2000, seed=3, table=table)
    b, _ = generate_synthetic(2000, seed=3, table=table)
    c, _ = generate_synthetic(2000, seed=4, table=table)
    key = lambda js: [(j.job_id, j.submit_time, j.duration, j.model, j.qos.gpus) for j in js]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    gpus = [j.qos.gpus for j in a]
    assert set(gpus) <= set(GPU_CHOICES)
    assert abs(gpus.count(1) / 2000 - 0.7) < 0.04 and abs(gpus.count(8) / 2000 - 0.05) < 0.02
    durs = [j.duration for j in a]
    assert min(durs) >= 60 * 10**1.5 - 1e-6 and max(durs) <= 60 * 10**4 + 1e-6
    assert abs(sum(1 for d in durs if d > 60 * 10**3) / 2000 - 0.2) < 0.04
    for j in a:  # every model measured by Gavel at that many GPUs
        assert j.qos.gpus in table.scales(j.model)
    assert a[0].submit_time == 0.0 and all(x.submit_time <= y.submit_time for x, y in zip(a, a[1:]))


def test_synthetic_same_without_table(table):
    a, _ = generate_synthetic(300, seed=1, table=table)
    b, _ = generate_synthetic(300, seed=1, table=None)
    assert [(j.model, j.duration) for j in a] == [(j.model, j.duration) for j in b]


def test_synthetic_rate_and_load():
    assert mean_gpus() == pytest.approx(1.9)
    assert 60000 < mean_duration() < 61000
    r = rate_for_load(1.0, 64)
    assert r == pytest.approx(64 * 3600 / (1.9 * mean_duration()))
    jobs, _ = generate_synthetic(3000, seed=0, rate_per_hour=10.0)
    span = jobs[-1].submit_time - jobs[0].submit_time
    assert 3000 / (span / 3600) == pytest.approx(10.0, rel=0.1)
    # a target load is met exactly by the sample, over its arrival window
    for load, gpus in ((1.0, 64), (0.5, 16), (2.0, 500)):
        jobs, _ = generate_synthetic(400, seed=9, load=load, cluster_gpus=gpus)
        span = jobs[-1].submit_time - jobs[0].submit_time
        assert sum(j.qos.gpus * j.duration for j in jobs) / (span * gpus) == pytest.approx(load)
    a, _ = generate_synthetic(100, seed=2, load=1.0, cluster_gpus=64)
    b, _ = generate_synthetic(100, seed=2, load=2.0, cluster_gpus=64)
    assert [j.duration for j in a] == [j.duration for j in b]  # the load only moves arrivals
    assert b[-1].submit_time == pytest.approx(a[-1].submit_time / 2)
    with pytest.raises(SpecError, match="num_jobs"):
        generate_synthetic(0)
    with pytest.raises(SpecError, match="load"):
        generate_synthetic(10, load=-1.0)
    with pytest.raises(SpecError, match="rate_per_hour"):
        generate_synthetic(10, rate_per_hour=0.0)


def test_synthetic_load_counts_only_the_jobs_the_cluster_can_run():
    """8-GPU jobs never fit 4-GPU nodes: they were rejected after the arrivals were stretched for
    their work too, so the jobs simulated offered less than the target (0.54 of 1.0 for 60 jobs on
    1x4, seed 3; 0.43 of 0.8 here)."""
    for spec, rejects in (("1x4", True), ("1x2", True), ("2x4", False)):
        cluster = load_cluster(spec)
        for seed in range(4):
            jobs, rej = generate_synthetic(60, seed=seed, cluster=cluster, load=0.8)
            assert bool(rej) is rejects
            assert jobs[0].submit_time == 0.0 and len(jobs) + len(rej) == 60
            assert offered_load(jobs, cluster.num_gpus).load == pytest.approx(0.8)


def test_offered_load_by_hand():
    jobs = [Job("a", 0.0, QoSSpec(gpus=1), 100.0), Job("b", 10.0, QoSSpec(gpus=2), 100.0), Job("c", 20.0, QoSSpec(gpus=1), 5.0)]
    o = offered_load(jobs, 2)
    assert o.window == 20.0 and o.jobs == 3
    assert o.load == pytest.approx((100 + 200 + 5) / (2 * 20))
    assert o.during_arrivals == pytest.approx((20 + 2 * 10 + 0) / (2 * 20))  # what falls in [0, 20]
    assert o.peak_gpus == 4 and o.over_capacity == pytest.approx(0.5)  # 3 GPUs asked for from 10 to 20
    assert not o.thin
    assert offered_load(jobs, 8).thin  # never more than 4 of 8 GPUs asked for
    assert offered_load(jobs[:1], 2).window == 0.0 and offered_load(jobs[:1], 2).thin
    with pytest.raises(SpecError, match="gpus"):
        offered_load(jobs, 0)


@pytest.mark.parametrize("num_jobs, gpus, thin", [(30, 64, True), (60, 64, True), (400, 64, False), (60, 8, False)])
def test_synthetic_small_samples_offer_their_load_after_the_arrivals(num_jobs, gpus, thin):
    """`--jobs 60` on 64 GPUs barely queued: the sample does offer load 1.0 over its arrival window,
    but most of that work is its long jobs', run after the last arrival; `offered_load` says so
    (`thin`), and `qosflow simulate` prints a note. About 6 jobs per GPU keep the cluster loaded."""
    for seed in range(5):
        jobs, _ = generate_synthetic(num_jobs, seed=seed, cluster_gpus=gpus)
        o = offered_load(jobs, gpus)
        assert o.load == pytest.approx(1.0)  # the target is met by every sample, whatever its size
        assert o.during_arrivals < o.load
        assert o.thin is thin, (seed, o)
        if thin:  # no more than two thirds of the cluster asked for while jobs arrive
            assert o.during_arrivals < 0.5 and o.over_capacity < 0.1
        else:
            assert o.during_arrivals > 0.5 and o.peak_gpus > gpus


# ====================================================================== deadlines
def _jobs(n: int) -> list[Job]:
    return [Job(f"j{i}", float(i), QoSSpec(gpus=1), 100.0 + i) for i in range(n)]


def test_deadline_share_and_lambda_bounds():
    out = assign_deadlines(_jobs(4000), share=0.5, seed=7)
    with_dl = [j for j in out if j.qos.deadline is not None]
    assert abs(len(with_dl) / 4000 - 0.5) < 0.03
    for j in with_dl:
        lam = j.qos.deadline / j.duration
        assert 1.2 <= lam <= 3.0 and lam == pytest.approx(j.meta["deadline_lambda"])
        assert j.qos.priority is PriorityClass.GUARANTEED
        assert j.deadline == pytest.approx(j.submit_time + j.qos.deadline)
    assert all(j.qos.priority is PriorityClass.BEST_EFFORT for j in out if j.qos.deadline is None)
    lams = sorted(j.meta["deadline_lambda"] for j in with_dl)
    assert lams[len(lams) // 2] == pytest.approx(2.1, abs=0.1)
    assert all(len(assign_deadlines(_jobs(50), share=s, seed=1)) == 50 for s in (0.0, 1.0))
    assert not any(j.qos.deadline for j in assign_deadlines(_jobs(50), share=0.0))
    assert all(j.qos.deadline for j in assign_deadlines(_jobs(50), share=1.0))


def test_deadlines_deterministic_and_stable_under_truncation():
    a = assign_deadlines(_jobs(300), seed=5)
    b = assign_deadlines(_jobs(300), seed=5)
    c = assign_deadlines(_jobs(300), seed=6)
    t = assign_deadlines(_jobs(300)[100:], seed=5)
    dl = lambda js: [(j.job_id, j.qos.deadline) for j in js]  # noqa: E731
    assert dl(a) == dl(b) and dl(a) != dl(c)
    assert dl(t) == dl(a)[100:]
    assert deadline_factor("j3", 5) == deadline_factor("j3", 5)


def test_deadlines_respect_the_trace():
    base = _jobs(4)
    forced = [
        Job(j.job_id, j.submit_time, j.qos.with_(priority=p), j.duration,
            meta={"wants_deadline": w, "priority_from_trace": True})
        for j, (w, p) in zip(base, [(True, "guaranteed"), (False, "best-effort"), (False, "normal"), (None, "normal")])
    ]
    out = assign_deadlines(forced, share=0.0, seed=0)
    assert out[0].qos.deadline is not None and out[1].qos.deadline is None and out[2].qos.deadline is None
    assert out[2].qos.priority is PriorityClass.NORMAL  # kept: the trace said so
    assert out[3].qos.deadline is None and out[3].qos.priority is PriorityClass.NORMAL
    assert forced[0].qos.deadline is None  # inputs untouched


def test_deadline_arguments_are_checked():
    with pytest.raises(SpecError, match="deadline_share"):
        assign_deadlines(_jobs(2), share=1.5)
    with pytest.raises(SpecError, match="deadline_lambda"):
        assign_deadlines(_jobs(2), lam=(0.5, 2.0))


# ====================================================================== load_workload
def test_load_workload_synthetic_default():
    cluster = load_cluster("8x8")
    w = load_workload("synthetic", "synthetic", cluster=cluster, seed=0)
    assert len(w.jobs) == 400 and w.rejected == [] and w.cluster_hint == "8x8"
    span = w.jobs[-1].submit_time - w.jobs[0].submit_time
    assert sum(j.qos.gpus * j.duration for j in w.jobs) / (span * cluster.num_gpus) == pytest.approx(1.0)
    assert 0.4 < w.info["with_deadline"] / 400 < 0.6
    w2 = load_workload("synthetic", "synthetic", cluster=cluster, seed=0)
    assert [(j.job_id, j.qos.deadline, j.duration) for j in w.jobs] == [(j.job_id, j.qos.deadline, j.duration) for j in w2.jobs]
    w3 = load_workload("synthetic", "synthetic", cluster=cluster, seed=0, num_jobs=50, deadline_share=0.0)
    assert len(w3.jobs) == 50 and not any(j.qos.deadline for j in w3.jobs)


def test_load_workload_formats_and_errors(tmp_path):
    cluster = load_cluster("8x8")
    with pytest.raises(UnknownNameError, match="unknown trace format 'csv'"):
        load_workload("x", "csv", cluster=cluster)
    assert isinstance(UnknownNameError("a", "b", []), QosflowError)
    assert set(FORMATS) == {"muri", "gavel", "alibaba", "synthetic"}
    with pytest.raises(SpecError, match="ClusterSpec"):
        load_workload("synthetic", "synthetic", cluster="8x8")  # type: ignore[arg-type]


def test_load_workload_muri_shared():
    need(MURI, MURI_CLUSTER)
    w = load_workload(str(MURI), "muri", cluster=load_cluster(str(MURI_CLUSTER)), seed=1)
    assert len(w.jobs) == 1494 and w.cluster_hint and w.cluster_hint.endswith("muri_cluster_n8g8.csv")
    assert all(x.submit_time <= y.submit_time for x, y in zip(w.jobs, w.jobs[1:]))
    # without a deadline, the trace's priority column is kept (0 -> normal, 1 -> best-effort)
    kept = {(j.meta["trace_priority"], j.qos.priority) for j in w.jobs if j.qos.deadline is None}
    assert kept == {(0, PriorityClass.NORMAL), (1, PriorityClass.BEST_EFFORT)}


def test_alibaba_trace_picks_the_gpu_node_list_next_to_it(tmp_path):
    # the dataset ships a GPU-node list and an all-node list side by side: use the GPU nodes
    from qosflow.sim.runner import resolve_workload

    write(tmp_path, "openb_node_list_gpu_node.csv", "sn,cpu_milli,memory_mib,gpu,model\nt0,64000,262144,4,T4\nt1,64000,262144,4,T4\n")
    write(tmp_path, "openb_node_list_all_node.csv", "sn,cpu_milli,memory_mib,gpu,model\nt0,64000,262144,4,T4\nt1,64000,262144,4,T4\nc0,96000,786432,0,\n")
    pods = write(tmp_path, "openb_pod_list_x.csv", ALI_HEADER + "\np0,8000,8192,2,1000,,LS,Running,0,500,10\n")
    wl, spec = resolve_workload(str(pods), None, None)
    assert [n.name for n in spec.nodes] == ["t0", "t1"] and [j.job_id for j in wl.jobs] == ["p0"]


def test_loaders_name_files_that_are_not_utf8_text(tmp_path, tiny):
    """A Latin-1 trace, a gzip-compressed one, a spreadsheet or a directory ended in a UnicodeDecodeError
    traceback, or in 'not found' for a directory given with --format."""
    import gzip

    rows = [MURI_ROW.replace("7,", f"{i},", 1).format(prio=0) for i in range(1, 60)]
    rows[55] = rows[55].replace("resnet18", "r\xe9snet")  # line 57 of the file
    latin = tmp_path / "latin.csv"
    latin.write_bytes((MURI_HEADER + "\n" + "\n".join(rows) + "\n").encode("latin-1"))
    with pytest.raises(TraceFormatError, match=r"latin\.csv:57: not UTF-8 text \(byte 0xe9\); a Muri trace is a UTF-8 "
                                               r"text file: save it as UTF-8"):
        load_muri(latin)
    packed = tmp_path / "m.csv.gz"
    packed.write_bytes(gzip.compress((MURI_HEADER + "\n" + MURI_ROW.format(prio=0) + "\n").encode()))
    with pytest.raises(TraceFormatError, match=r"m\.csv\.gz: is gzip-compressed: unpack it first"):
        load_muri(packed)
    sheet = tmp_path / "m.xlsx"
    sheet.write_bytes(b"PK\x03\x04" + bytes(range(256)))
    with pytest.raises(TraceFormatError, match=r"export the sheet as CSV"):
        load_muri(sheet)
    with pytest.raises(TraceFormatError, match=r"is a directory; give the Muri trace file"):
        load_muri(tmp_path)
    gz_trace = tmp_path / "vc.trace"
    gz_trace.write_bytes(gzip.compress(b"A3C\tcd\t-n\t1\t100\t0\t1\n"))
    with pytest.raises(TraceFormatError, match=r"vc\.trace: is gzip-compressed"):
        load_gavel(gz_trace, throughputs=tiny)
    with pytest.raises(TraceFormatError, match=r"m\.csv\.gz: is gzip-compressed: unpack it first \(gunzip\); a cluster file"):
        load_cluster(str(packed))


def test_a_trace_saved_with_semicolons_says_so(tmp_path):
    """A spreadsheet's semicolon CSV said only that every column was missing."""
    p = write(tmp_path, "semi.csv", MURI_HEADER.replace(",", ";") + "\n" + MURI_ROW.format(prio=0).replace(",", ";") + "\n")
    with pytest.raises(TraceFormatError, match=r"semi\.csv:1: missing column.*its header is separated by semicolons, but "
                                               r"the file must be comma-separated"):
        load_muri(p)
    p = write(tmp_path, "nodes.csv", "sn;cpu_milli;memory_mib;gpu;model\nn0;64000;262144;2;P100\n")
    with pytest.raises(TraceFormatError, match=r"not a cluster file qosflow knows.*separated by semicolons"):
        load_cluster(str(p))
