"""Gavel's interference table as the speed model's source of pair and spread slowdowns."""

from __future__ import annotations

import json

import pytest

from qosflow.core.job import Job
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.core.speed import InterferenceSource, SpeedModel
from qosflow.errors import TraceFormatError
from qosflow.sim.interference import (
    FAILED_PAIR_SLOWDOWN,
    GAVEL_GPU_MEM_MB,
    MODEL_TO_GAVEL,
    MURI_GPU_MEM_MB,
    GavelInterference,
    default_speed_model,
    default_throughputs_path,
    gpu_mem_mb,
)

MURI_MODELS = ("resnet18", "shufflenet_v2_x1_0", "vgg16", "vgg19", "dqn", "a2c", "bert", "gpt2")

needs_table = pytest.mark.skipif(
    not default_throughputs_path().is_file(),
    reason=f"shared Gavel throughput table not found at {default_throughputs_path()}",
)


@pytest.fixture(scope="module")
def table() -> GavelInterference:
    if not default_throughputs_path().is_file():
        pytest.skip(f"shared Gavel throughput table not found at {default_throughputs_path()}")
    return GavelInterference()


def tiny_table(tmp_path, **over):
    """A small table in Gavel's format: two types, one failed pair, a spread variant."""
    data = {
        "v100": {
            "('A', 1)": {"null": 10.0, "('A', 1)": [5.0, 5.0], "('B', 1)": [8.0, 2.0]},
            "('B', 1)": {"null": 4.0, "('A', 1)": [2.0, 8.0], "('B', 1)": [0.0, 0.0]},
            "('A', 2)": {"null": 18.0, "('A', 2)": [0.0, 0.0]},
            "('B', 2)": {"null": 7.0},
        },
        "v100_unconsolidated": {
            "('A', 2)": {"null": 12.0},
            "('B', 2)": {"null": 7.7},
        },
    }
    data.update(over)
    p = tmp_path / "tput.json"
    p.write_text(json.dumps(data))
    return p


# ---------------------------------------------------------------------- mapping
def test_every_muri_model_maps_to_a_gavel_job_type(table):
    for m in MURI_MODELS:
        jt = table.resolve(m)
        assert jt is not None, m
        assert jt in table.job_types
        assert MODEL_TO_GAVEL[m] == jt


def test_gavel_types_map_to_themselves_and_unknown_is_none(table):
    for jt in table.job_types:
        assert table.resolve(jt) == jt
    assert table.resolve("no-such-model") is None
    assert table.pair_slowdown("no-such-model", "resnet18") is None
    assert table.spread_slowdown("no-such-model", 4) is None


def test_memory_tables_cover_every_model(table):
    assert set(table.job_types) == set(GAVEL_GPU_MEM_MB)
    for m in MURI_MODELS:
        assert gpu_mem_mb(m) == MURI_GPU_MEM_MB[m]
    assert MURI_GPU_MEM_MB["resnet18"] == 6432 and MURI_GPU_MEM_MB["gpt2"] == 10532
    assert gpu_mem_mb("unknown") is None


# ---------------------------------------------------------------------- slowdowns
def test_protocol(table):
    assert isinstance(table, InterferenceSource)


def test_all_pair_slowdowns_at_least_one(table):
    models = list(table.job_types) + list(MURI_MODELS)
    for a in models:
        for b in models:
            for g in (1, 2, 8):
                xa, xb = table.pair_slowdown(a, b, g)
                assert xa >= 1.0 and xb >= 1.0, (a, b, g)


def test_pair_slowdown_is_symmetric(table):
    for a in MURI_MODELS:
        for b in MURI_MODELS:
            xa, xb = table.pair_slowdown(a, b)
            ya, yb = table.pair_slowdown(b, a)
            assert (xa, xb) == pytest.approx((yb, ya))


def test_spread_slowdowns_at_least_one(table):
    for jt in table.job_types:
        for g in (1, 2, 3, 4, 8, 16, 64):
            s = table.spread_slowdown(jt, g)
            assert s is None or s >= 1.0
    assert table.spread_slowdown("resnet18", 1) == 1.0
    # A3C was only measured on one GPU: nothing known about spreading it
    assert table.spread_slowdown("A3C", 4) is None


def test_failed_pairs_are_memory_heavy(table):
    failed = [(a, b) for a in table.job_types for b in table.job_types if table.pair_failed(a, b)]
    assert failed, "Gavel's table records pairs that failed together"
    for a, b in failed:
        assert table.pair_slowdown(a, b) == (FAILED_PAIR_SLOWDOWN, FAILED_PAIR_SLOWDOWN)
        assert {a.split(" (")[0], b.split(" (")[0]} & {"ResNet-50", "Transformer", "LM"}


def test_tiny_table_semantics(tmp_path):
    t = GavelInterference(tiny_table(tmp_path))
    assert t.pair_slowdown("A", "B") == pytest.approx((10 / 8, 4 / 2))
    assert t.pair_slowdown("B", "A") == pytest.approx((4 / 2, 10 / 8))
    # B with B failed at scale 1
    assert t.pair_failed("B", "B") and t.pair_slowdown("B", "B") == (FAILED_PAIR_SLOWDOWN,) * 2
    # pairs at scale 2 were not measured ([0, 0] everywhere): the 1-GPU pair is used
    assert t.pair_slowdown("A", "A", 2) == pytest.approx((2.0, 2.0))
    assert not t.pair_failed("A", "A", 2)
    # spread: consolidated / unconsolidated, clamped at 1 when spread measured faster
    assert t.spread_slowdown("A", 2) == pytest.approx(1.5)
    assert t.spread_slowdown("B", 2) == 1.0
    assert t.spread_slowdown("A", 8) == pytest.approx(1.5)  # largest measured scale below
    # throughput: measured, or extrapolated linearly from the largest measured scale below
    assert t.throughput("A", 2) == 18.0 and t.throughput_source("A", 2) == "measured"
    assert t.throughput("A", 4) == pytest.approx(36.0)
    assert "extrapolated" in t.throughput_source("A", 4)
    assert t.throughput("A", 2, consolidated=False) == 12.0


def test_bad_tables(tmp_path):
    with pytest.raises(TraceFormatError, match="not found"):
        GavelInterference(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceFormatError, match=r"bad\.json:1.*expected Gavel's JSON throughput table"):
        GavelInterference(bad)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")  # (said "no GPU type 'v100' in the table; it has: " with nothing after it)
    with pytest.raises(TraceFormatError, match="expected a non-empty object keyed by GPU type"):
        GavelInterference(empty)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(TraceFormatError, match="not a text file"):
        GavelInterference(binary)
    with pytest.raises(TraceFormatError, match="no GPU type 'a100'"):
        GavelInterference(tiny_table(tmp_path), gpu_type="a100")
    badkey = tmp_path / "badkey.json"
    badkey.write_text(json.dumps({"v100": {"ResNet": {"null": 1.0}}}))
    with pytest.raises(TraceFormatError, match="job key 'ResNet'"):
        GavelInterference(badkey)
    badpair = tmp_path / "badpair.json"
    badpair.write_text(json.dumps({"v100": {"('A', 1)": {"null": 1.0, "('A', 1)": 3.0}}}))
    with pytest.raises(TraceFormatError, match="this throughput, other throughput"):
        GavelInterference(badpair)
    # the other GPU types' sections (their speeds on a mixed cluster) are checked as the table's own
    with pytest.raises(TraceFormatError, match=r"\['k80'\]\[\"\('A', 1\)\"\]: needs a \"null\""):
        GavelInterference(tiny_table(tmp_path, k80={"('A', 1)": {"('B', 1)": [1.0, 1.0]}}))
    with pytest.raises(TraceFormatError, match=r"\['k80'\] is not an object of job keys"):
        GavelInterference(tiny_table(tmp_path, k80=[1, 2]))


# ---------------------------------------------------------------------- speed model
def _job(jid: str, model: str, gpus: int = 1) -> Job:
    return Job(jid, 0.0, QoSSpec(gpus=gpus, shareable=True, gpu_mem_mb=1000.0), 100.0, model=model)


def test_default_speed_model_uses_the_table(table):
    sm = default_speed_model()
    assert isinstance(sm.interference, GavelInterference)
    a, b = _job("a", "vgg16"), _job("b", "dqn")
    assert sm.pair_slowdown(a, b) == pytest.approx(table.pair_slowdown("vgg16", "dqn"))
    p = Placement("a", ((0, 0),), cpu=((0, 4.0),), colocated_with=("b",))
    assert sm.rate(a, p, [b]) == pytest.approx(1.0 / table.pair_slowdown("vgg16", "dqn")[0])


def test_default_speed_model_without_table(tmp_path):
    sm = default_speed_model(tmp_path / "absent.json")
    assert isinstance(sm, SpeedModel) and sm.interference is None
    assert sm.pair_slowdown(_job("a", "x"), _job("b", "y")) == (sm.default_pair, sm.default_pair)


# ---------------------------------------------------------------------- GPU models (mixed clusters)
def _typed_table(tmp_path):
    """The tiny table plus a K80 section: A runs at half speed there, B (measured at 1 GPU only) faster."""
    return tiny_table(tmp_path, k80={"('A', 1)": {"null": 5.0}, "('A', 2)": {"null": 6.0}, "('B', 1)": {"null": 6.0}})


def test_gpu_speed_relative_to_the_tables_own_type(tmp_path):
    t = GavelInterference(_typed_table(tmp_path))
    assert t.gpu_types() == ("k80", "v100")
    assert t.gpu_speed("A", 1, "k80") == pytest.approx(0.5)
    assert t.gpu_speed("A", 2, "k80") == pytest.approx(6.0 / 18.0)
    # a scale the K80 section lacks: both sides extrapolated linearly from their largest scale below
    assert t.gpu_speed("B", 2, "k80") == pytest.approx((6.0 * 2) / 7.0)
    assert t.gpu_speed("A", 1, "v100") == 1.0
    # NVML's and Kubernetes' names are the same model
    assert t.gpu_speed("A", 1, "Tesla K80") == pytest.approx(0.5)
    assert t.gpu_speed("A", 1, "NVIDIA-K80") == pytest.approx(0.5)
    # unknown GPU model or job type: no statement
    assert t.gpu_speed("A", 1, "a100") is None
    assert t.gpu_speed("Z", 1, "k80") is None


def test_speed_model_runs_a_gang_at_its_slowest_gpu(tmp_path):
    sm = SpeedModel(GavelInterference(_typed_table(tmp_path)))
    a1, a2 = _job("a1", "A"), _job("a2", "A", gpus=2)
    assert sm.gpu_speed(a1, "k80") == pytest.approx(0.5)
    assert sm.gpu_speed(a1, "a100") == 1.0  # unknown model: the given speed
    p = Placement("a2", ((0, 0), (1, 0)), cpu=((0, 4.0), (1, 4.0)))
    # spread over a V100 node and a K80 node: the K80's pace, times the spread penalty
    r = sm.rate(a2, p, gpus_per_node=2, gpu_models=("v100", "k80"))
    assert r == pytest.approx((6.0 / 18.0) / sm.spread_slowdown(a2, 2, 1))
    assert sm.rate(a2, p, gpus_per_node=1) == 1.0  # no models given: the given speed
    assert sm.gpu_types_matter(["v100", "K80"]) and sm.gpu_types_matter(["k80"])
    assert not sm.gpu_types_matter(["v100", "generic", "a100"])
    assert not SpeedModel().gpu_types_matter(["v100", "k80"])


def test_simulator_runs_jobs_at_their_gpus_speed(tmp_path):
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.policies import get_policy
    from qosflow.sim.engine import SimConfig, Simulator

    sm = SpeedModel(GavelInterference(_typed_table(tmp_path)))
    jobs = [Job("a", 0.0, QoSSpec(gpus=1, gpu_mem_mb=1000.0), 100.0, model="A"),
            Job("b", 0.0, QoSSpec(gpus=1, gpu_mem_mb=1000.0), 100.0, model="B")]

    def run(models):
        spec = ClusterSpec(tuple(NodeSpec(name=f"n{i}", gpus=1, gpu_mem_mb=16000.0, cpu_cores=8.0, mem_mb=64000.0,
                                          gpu_model=m) for i, m in enumerate(models)))
        res = Simulator(jobs, spec, get_policy("fifo"), speed=sm, config=SimConfig(restart_overhead=0.0)).run()
        return {js.job_id: js.finish_time for js in res.jobs}

    assert run(["v100", "v100"]) == pytest.approx({"a": 100.0, "b": 100.0}, abs=1e-6)
    # on K80s: A at half speed, B 1.5 x faster (Gavel measured such inversions: its recommender)
    assert run(["k80", "k80"]) == pytest.approx({"a": 200.0, "b": 100.0 / 1.5}, abs=1e-6)
    # a GPU model the table does not know runs jobs at their given speed
    assert run(["a100", "a100"]) == pytest.approx({"a": 100.0, "b": 100.0}, abs=1e-6)


def test_estimators_speak_of_gpu_models(tmp_path):
    from qosflow.core.estimate import NoisyEstimator, OracleEstimator, gpu_speed

    sm = SpeedModel(GavelInterference(_typed_table(tmp_path)))
    a = _job("a", "A")
    assert gpu_speed(OracleEstimator(sm), a, "k80") == pytest.approx(0.5)
    noisy = NoisyEstimator(sm, error=0.3, seed=1)
    v = gpu_speed(noisy, a, "k80")
    assert 0.35 <= v <= 0.65 and v != pytest.approx(0.5)
    assert gpu_speed(noisy, a, "v100") == 1.0  # the GPU the durations are for: no ratio to misjudge

    class Plain:  # an estimator that knows nothing of GPU models
        name = "plain"

    assert gpu_speed(Plain(), a, "k80") == 1.0


@pytest.mark.parametrize("policy", ["fifo", "srtf", "tiresias", "genie", "gavel", "qosflow"])
def test_every_policy_on_a_mixed_cluster_stays_above_the_typed_bound(tmp_path, policy):
    """On V100 + K80 servers every policy finishes every job, no job beats its time on its fastest GPU
    model, and the bounds count that time (B runs 1.5 x faster on a K80: its bound is shorter)."""
    from qosflow.core.estimate import OracleEstimator
    from qosflow.core.job import JobStatus
    from qosflow.policies import get_policy
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.engine import SimConfig, Simulator
    from qosflow.sim.metrics import compute_bounds, compute_metrics

    sm = SpeedModel(GavelInterference(_typed_table(tmp_path)))
    spec = load_cluster("4:0:4")
    jobs = [Job(f"j{i}", 30.0 * i, QoSSpec(gpus=1 + (i % 3 == 0), gpu_mem_mb=1000.0, shareable=True,
                                          deadline=1500.0 if i % 2 else None), 200.0 + 50 * (i % 5),
                model="AB"[i % 2]) for i in range(24)]
    res = Simulator(jobs, spec, get_policy(policy), estimator=OracleEstimator(sm), speed=sm,
                    config=SimConfig(check_invariants=True)).run()
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    typed, plain = compute_bounds(jobs, spec, sm), compute_bounds(jobs, spec)
    assert typed.avg_jct < plain.avg_jct  # B's jobs are faster on the K80s
    for js in res.jobs:
        fastest = max(sm.gpu_speed(js.job, m) for m in ("v100", "k80"))  # (B: 1.5, and 1.71 at 2 GPUs)
        assert js.finish_time - js.job.submit_time >= js.job.duration / fastest * 0.999
    m = compute_metrics(res)
    assert m.avg_jct >= typed.avg_jct * 0.999
    # the GPU-time each model's GPUs were allocated adds up to the cluster's
    assert set(m.gpu_util_by_model) == {"v100", "k80"}
    assert sum(u * 4 for u in m.gpu_util_by_model.values()) == pytest.approx(m.gpu_util * spec.num_gpus)  # (4 of each)
