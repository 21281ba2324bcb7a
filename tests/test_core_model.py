"""The core model: QoS validation, cluster state invariants, placements."""

import pytest

from qosflow.core import ClusterSpec, ClusterState, Job, Placement, QoSSpec, SubBatchPlan
from qosflow.core.cluster import PlacementError
from qosflow.errors import SpecError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"deadline": -5}, "deadline"),
        ({"deadline": 0}, "deadline"),
        ({"gpu_mem_mb": 0}, "gpu_mem_mb"),
        ({"gpus": -1}, "gpus"),
        ({"gpus": 2, "gpu_milli": 500}, "gpu_milli"),
        ({"gpu_milli": 0}, "gpu_milli"),
        ({"gpu_milli": 1500}, "gpu_milli"),
        ({"cpu_cores": -1}, "cpu_cores"),
        ({"gpus": 0, "cpu_cores": 0}, "cpu_cores"),
        ({"latency_slo": float("nan")}, "latency_slo"),
        ({"priority": "urgent"}, "priority"),
        ({"gpus": 1.5}, "gpus"),
        ({"gpus": 0, "shareable": True}, "shareable"),
        ({"gpu_model": ""}, "gpu_model"),
        ({"gpu_model": "A100||H100"}, "gpu_model"),
        ({"gpu_model": 100}, "gpu_model"),
        ({"cpu_cores": "4"}, "cpu_cores"),
        ({"deadline": True}, "deadline"),
        ({"mem_mb": [1]}, "mem_mb"),
    ],
)
def test_bad_qos_names_the_field(kwargs, field):
    with pytest.raises(SpecError) as ei:
        QoSSpec(**kwargs)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_qos_roundtrip_and_unknown_field():
    q = QoSSpec(gpus=2, deadline=3600, priority="guaranteed", shareable=True, gpu_mem_mb=8000)
    assert QoSSpec.from_dict(q.to_dict()) == q
    with pytest.raises(SpecError, match="deadlne"):
        QoSSpec.from_dict({"deadlne": 3})


def test_more_gpus_than_any_placement_is_rejected():
    spec = ClusterSpec.uniform(2, 4)
    assert spec.why_never_fits(QoSSpec(gpus=8)) is None
    reason = spec.why_never_fits(QoSSpec(gpus=9))
    assert reason and "9 GPUs" in reason
    with pytest.raises(SpecError, match="gpus"):
        spec.validate_qos(QoSSpec(gpus=16), where="stage train")
    assert spec.why_never_fits(QoSSpec(gpus=1, gpu_mem_mb=10**6))
    # one GPU is '1 GPU' (was '1 GPUs')
    assert spec.why_never_fits(QoSSpec(gpus=1, cpu_cores=64)) == "no node has 1 GPU with 64 cores"
    assert ClusterSpec.uniform(2, 4, mem_mb=1000).why_never_fits(QoSSpec(gpus=1, mem_mb=2000)).endswith("with 1 GPU (largest: 1000 MiB)")


def test_cpu_only_never_fits_says_what_is_missing():
    spec = ClusterSpec.uniform(2, 4, cpu_cores=32, mem_mb=1000)
    assert spec.why_never_fits(QoSSpec(gpus=0, cpu_cores=64)) == "no node has 64 CPU cores (largest: 32 cores)"
    assert "2000 MiB of memory (largest: 32 cores, 1000 MiB)" in spec.why_never_fits(QoSSpec(gpus=0, cpu_cores=8, mem_mb=2000))
    with pytest.raises(SpecError, match="cpu_cores: must be a number"):
        QoSSpec.from_dict({"gpus": 0, "cpu_cores": "4"})


def test_host_memory_no_node_has_is_never_fitting():
    spec = ClusterSpec.uniform(2, 4, mem_mb=100_000)
    assert spec.why_never_fits(QoSSpec(gpus=2, mem_mb=90_000)) is None
    why = spec.why_never_fits(QoSSpec(gpus=1, mem_mb=150_000))
    assert why and "150000 MiB of host memory" in why and "100000" in why
    # a job that fits on one node by GPUs is placed on one: that node needs its memory
    assert spec.why_never_fits(QoSSpec(gpus=2, mem_mb=150_000))
    # a gang wider than a node splits its host memory over its nodes: 75,000 MiB on each of two
    assert spec.why_never_fits(QoSSpec(gpus=8, mem_mb=150_000)) is None
    assert "host memory" in spec.why_never_fits(QoSSpec(gpus=8, mem_mb=250_000))


def test_several_accepted_gpu_models():
    a = ClusterSpec.uniform(1, 4, gpu_model="A100", prefix="a")
    h = ClusterSpec.uniform(1, 4, gpu_model="H100", prefix="h")
    v = ClusterSpec.uniform(1, 8, gpu_model="V100", prefix="v")
    spec = ClusterSpec(a.nodes + h.nodes + v.nodes)
    q = QoSSpec(gpus=4, gpu_model=" A100 | H100 ")
    assert q.gpu_model == "A100|H100" and q == QoSSpec(gpus=4, gpu_model="A100|H100")
    assert q.accepts_gpu_model("H100") and not q.accepts_gpu_model("V100")
    assert spec.model_mask(q.gpu_model).tolist() == [True, True, False]
    assert spec.why_never_fits(q) is None
    why = spec.why_never_fits(QoSSpec(gpus=8, gpu_model="A100|H100"), single_node=True)
    assert why and "A100 or H100 node" in why
    assert "'B200' or 'MI300'" in spec.why_never_fits(QoSSpec(gpus=1, gpu_model="B200|MI300"))
    state = ClusterState(spec)
    with pytest.raises(PlacementError, match="needs GPU model A100|H100"):
        state.allocate(Placement("j", gpus=((2, 0),), cpu=((2, 1.0),)), QoSSpec(gpus=1, gpu_model="A100|H100"))
    state.allocate(Placement("j", gpus=((1, 0),), cpu=((1, 1.0),)), QoSSpec(gpus=1, gpu_model="A100|H100"))


def _job(jid, **q):
    return Job(jid, 0.0, QoSSpec(**q), duration=100.0)


def test_allocate_release_and_invariants():
    spec = ClusterSpec.uniform(2, 4, cpu_cores=16, gpu_mem_mb=16000)
    st = ClusterState(spec)
    a = _job("a", gpus=2, cpu_cores=4, shareable=True, gpu_mem_mb=6000)
    b = _job("b", gpus=2, cpu_cores=4, shareable=True, gpu_mem_mb=6000)
    c = _job("c", gpus=2, cpu_cores=4, shareable=True, gpu_mem_mb=6000)
    pa = Placement("a", ((0, 0), (0, 1)), cpu=((0, 4.0),), gpu_mem_mb=6000)
    st.allocate(pa, a.qos)
    pb = Placement("b", ((0, 0), (0, 1)), cpu=((0, 4.0),), gpu_mem_mb=6000, colocated_with=("a",))
    st.allocate(pb, b.qos)
    st.check_invariants()
    # a third job on the same GPUs: never more than two
    with pytest.raises(PlacementError, match="two jobs"):
        st.allocate(Placement("c", ((0, 0), (0, 1)), cpu=((0, 4.0),), gpu_mem_mb=1000), c.qos)
    st.release("a")
    st.check_invariants()
    assert st.jobs_on_gpu(0, 0) == ("b",)
    st.release("b")
    assert st.total_empty_gpus() == 8
    st.check_invariants()


def test_colocation_needs_memory_and_shareable():
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=10000)
    st = ClusterState(spec)
    st.allocate(Placement("a", ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=6000), QoSSpec(shareable=True, gpu_mem_mb=6000))
    with pytest.raises(PlacementError, match="MiB"):
        st.allocate(Placement("b", ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=6000), QoSSpec(shareable=True, gpu_mem_mb=6000))
    with pytest.raises(PlacementError, match="not shareable"):
        st.allocate(Placement("c", ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=1000), QoSSpec(shareable=False, gpu_mem_mb=1000))


def test_fractional_shares_and_no_mixing():
    spec = ClusterSpec.uniform(1, 1)
    st = ClusterState(spec)
    q = QoSSpec(gpus=1, gpu_milli=400)
    st.allocate(Placement("a", ((0, 0),), cpu=((0, 1.0),), gpu_milli=400), q)
    st.allocate(Placement("b", ((0, 0),), cpu=((0, 1.0),), gpu_milli=400), q)
    with pytest.raises(PlacementError, match="milli"):
        st.allocate(Placement("c", ((0, 0),), cpu=((0, 1.0),), gpu_milli=400), q)
    with pytest.raises(PlacementError):
        st.allocate(Placement("w", ((0, 0),), cpu=((0, 1.0),)), QoSSpec(gpus=1))
    st.check_invariants()


def test_gang_all_or_nothing_and_missing_nodes():
    spec = ClusterSpec.uniform(2, 2)
    st = ClusterState(spec)
    with pytest.raises(PlacementError, match="gang"):
        st.allocate(Placement("a", ((0, 0),), cpu=((0, 1.0),)), QoSSpec(gpus=2))
    with pytest.raises(PlacementError, match="not in the cluster"):
        st.allocate(Placement("a", ((5, 0),), cpu=((5, 1.0),)), QoSSpec(gpus=1))
    with pytest.raises(PlacementError, match="no GPU 7"):
        st.allocate(Placement("a", ((0, 7),), cpu=((0, 1.0),)), QoSSpec(gpus=1))
    st.set_node_down(1)
    with pytest.raises(PlacementError, match="down"):
        st.allocate(Placement("a", ((1, 0),), cpu=((1, 1.0),)), QoSSpec(gpus=1))
    assert st.total_empty_gpus() == 2
    st.check_invariants()


def test_cpu_overallocation_rejected():
    spec = ClusterSpec.uniform(1, 2, cpu_cores=4)
    st = ClusterState(spec)
    st.allocate(Placement("a", ((0, 0),), cpu=((0, 3.0),)), QoSSpec(gpus=1, cpu_cores=3))
    with pytest.raises(PlacementError, match="cores"):
        st.allocate(Placement("b", ((0, 1),), cpu=((0, 3.0),)), QoSSpec(gpus=1, cpu_cores=3))


def test_snapshot_is_independent():
    st = ClusterState(ClusterSpec.uniform(1, 2))
    snap = st.snapshot()
    snap.allocate(Placement("a", ((0, 0),), cpu=((0, 1.0),)), QoSSpec())
    assert st.total_empty_gpus() == 2 and snap.total_empty_gpus() == 1
    assert "a" not in st.allocs


def test_sub_batch_plan():
    p = SubBatchPlan.split(128, 4)
    assert p.sub_batch == 32
    with pytest.raises(SpecError):
        SubBatchPlan(128, 30, 4)
    with pytest.raises(SpecError):
        SubBatchPlan.split(100, 3)


@pytest.mark.parametrize(
    "nvml, short",
    [
        ("Tesla V100-SXM2-16GB", "v100"), ("Tesla K80", "k80"), ("Tesla P100-PCIE-16GB", "p100"),
        ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100"), ("Tesla T4", "t4"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"), ("NVIDIA RTX A6000", "rtxa6000"),
        ("NVIDIA GeForce GTX 1080 Ti", "gtx1080ti"), ("v100", "v100"), ("", "generic"), (None, "generic"),
        ("NVIDIA-A100-SXM4-40GB", "a100"), ("Tesla-V100-SXM2-16GB", "v100"), ("NVIDIA-GeForce-RTX-3090", "rtx3090"),
    ],
)
def test_nvml_product_names_shorten_to_the_model_the_reference_data_uses(nvml, short):
    from qosflow.core.gpu_names import short_gpu_model

    assert short_gpu_model(nvml) == short


def test_gpu_models_match_without_regard_to_case():
    """A stage's gpu_model="V100" runs on a host whose agent or node label says v100."""
    spec = ClusterSpec(ClusterSpec.uniform(1, 2, gpu_model="v100", prefix="v").nodes + ClusterSpec.uniform(1, 2, gpu_model="A100", prefix="a").nodes)
    assert list(spec.model_mask("V100")) == [True, False]
    assert list(spec.model_mask("a100|H100")) == [False, True]
    assert QoSSpec(gpus=1, gpu_model="V100|a100").accepts_gpu_model("v100")
    assert spec.why_never_fits(QoSSpec(gpus=1, gpu_model="V100")) is None


@pytest.mark.parametrize("text, expected", [("2", "critical"), (" 1 ", "guaranteed"), ("0", "normal"), ("-1", "best-effort")])
def test_a_priority_given_as_text_of_an_integer_means_that_integer(text, expected):
    """The priority job variable is a string, and the error for a bad one says 'or an integer': "2" was then
    refused with a message offering integers, which a job variable cannot hold."""
    assert QoSSpec(priority=text).priority.value == expected
