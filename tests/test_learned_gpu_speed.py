"""`LearnedEstimator.gpu_speed`: a job's speed on a GPU model relative to the GPU its durations are for.

Sources, in order of trust: the signature's own step times on both models, the reference table's per-type
step times, the ratio pooled over other signatures measured on both, 1.0. Live stages measured on another
model are learned converted to the reference GPU; a homogeneous cluster's answers do not change.
"""

from __future__ import annotations

import pytest

from qosflow.core.estimate import OracleEstimator
from qosflow.core.job import Job
from qosflow.core.qos import QoSSpec
from qosflow.core.speed import SpeedModel
from qosflow.predict.estimator import LearnedEstimator
from qosflow.predict.predictor import Predictor
from qosflow.predict.reference import default_gavel_path

needs_gavel = pytest.mark.skipif(not default_gavel_path().exists(),
                                 reason="Gavel's table is not at ../shared/data/throughputs/ (shared data absent)")

RESNET, RECOMMENDER = "ResNet-50 (batch size 64)", "Recommendation (batch size 512)"


def _stage(i: int, model: str = "flows.train", gpus: int = 1) -> Job:
    return Job(f"s{i}-{model}", 0.0, QoSSpec(gpus=gpus, cpu_cores=4.0), 60.0, model=model)


def _live(tmp_path, name: str = "q.db", reference=None) -> LearnedEstimator:
    from qosflow.store import Store

    return LearnedEstimator.from_store(Store.open(f"sqlite:///{tmp_path / name}"), reference=reference)


def _on(gpu_type: str | None) -> dict:
    return {"placement": "consolidated", **({"gpu_type": gpu_type} if gpu_type is not None else {})}


@needs_gavel
def test_the_reference_table_gives_each_job_types_speed_per_gpu_model(tmp_path):
    """Nothing measured: Gavel's per-type solo step times -- a K80 runs ResNet-50 at 0.14 x a V100 (the
    reference GPU of Gavel's table) but the recommender faster than a V100; NVML names are shortened."""
    from qosflow.sim.interference import GavelInterference

    est = _live(tmp_path, reference="auto")
    assert est.reference_gpu == "v100"
    truth = GavelInterference()
    resnet, rec = _stage(1, RESNET), _stage(2, RECOMMENDER)
    p = est.predict_gpu_speed(resnet, "Tesla K80")
    assert p.value == pytest.approx(truth.gpu_speed(RESNET, 1, "k80"), rel=1e-9) and p.value == pytest.approx(0.14, abs=0.01)
    assert p.basis == "reference:gavel/k80÷v100" and p.n_samples == 0 and p.low < p.value < p.high
    assert est.gpu_speed(rec, "k80") > 1.0
    assert est.gpu_speed(rec, "p100") == pytest.approx(truth.gpu_speed(RECOMMENDER, 1, "p100"), rel=1e-9)
    big = _stage(3, RESNET, gpus=16)  # beyond the table's GPU counts: at its largest, as the simulator extrapolates
    assert est.gpu_speed(big, "k80") == pytest.approx(truth.gpu_speed(RESNET, 16, "k80"), rel=1e-9)
    same = est.predict_gpu_speed(resnet, "Tesla V100-SXM2-16GB")
    assert (same.value, same.basis) == (1.0, "reference-gpu(v100)")


@needs_gavel
def test_simulation_profiles_each_model_near_the_truth_deterministically():
    """In the simulator a job is profiled on each GPU model it is asked about (the truth's speed with the
    profiler's noise), blended with the table: close to the oracle, the same for a seed."""
    from qosflow.core.estimate import make_estimator
    from qosflow.sim.interference import GavelInterference

    speed = SpeedModel(interference=GavelInterference())
    oracle = OracleEstimator(speed)
    jobs = [Job(f"j{i}", 0.0, QoSSpec(gpus=1), 1000.0, model=m, iterations=1000, meta={"iteration_time": 1.0})
            for i, m in enumerate((RESNET, RECOMMENDER))]

    def answers(seed):
        est = make_estimator("learned", speed, seed=seed)
        return [est.predict_gpu_speed(j, m) for j in jobs for m in ("k80", "p100")]

    a = answers(4)
    assert a == answers(4) and [p.value for p in a] != [p.value for p in answers(5)]
    for p, (j, m) in zip(a, [(j, m) for j in jobs for m in ("k80", "p100")]):
        assert p.value == pytest.approx(oracle.gpu_speed(j, m), rel=0.1)
        assert p.basis == f"samples(n=1 on {m},1 on v100)+reference:gavel/{m}÷v100"


def test_unknown_models_run_at_the_reference_speed_and_say_so(tmp_path):
    est = _live(tmp_path)
    job = _stage(1)
    for name in ("generic", "", "unknown", "cpu"):
        p = est.predict_gpu_speed(job, name)
        assert p.value == 1.0 and p.basis.startswith("gpu-model-unknown")
    p = est.predict_gpu_speed(job, "a100")  # a model nothing was measured on and no table knows
    assert p.value == 1.0 and p.basis == "no measurement on a100" and p.low < 1.0 < p.high
    assert est.predict_gpu_speed(_stage(2, gpus=0), "a100").basis == "no GPU"


def test_a_signature_learns_its_speed_on_two_models_and_durations_stay_consistent(tmp_path):
    """Live: the first model a stage runs on becomes the reference GPU; stages of the same signature on
    another model teach its speed there (its own measurements, alone from 3 on each), and are learned
    converted, so duration / speed on that model is what it measured there. The store keeps the model."""
    est = _live(tmp_path)
    for i in range(3):
        est.observe(_stage(i), 50.0, steps=100, where=_on("NVIDIA A100-SXM4-40GB"))  # 0.5 s per step
    assert est.reference_gpu == "a100"
    for i in range(3, 6):
        est.observe(_stage(i), 100.0, steps=100, where=_on("NVIDIA GeForce RTX 3090"))  # 1.0 s per step
    p = est.predict_gpu_speed(_stage(9), "rtx3090")
    assert p.value == pytest.approx(0.5) and p.basis == "samples(n=3 on rtx3090,3 on a100)"
    assert est.duration(_stage(9)) == pytest.approx(50.0)  # on the A100 (was the two models' mean)
    assert est.duration(_stage(9)) / est.gpu_speed(_stage(9), "rtx3090") == pytest.approx(100.0)
    assert {s.gpu_type for s in est.store.samples_for("flows.train")} == {"a100", "rtx3090"}
    # a restart learns the same from the store
    again = LearnedEstimator.from_store(est.store, reference=None)
    assert again.reference_gpu == "a100"
    assert again.gpu_speed(_stage(10), "rtx3090") == pytest.approx(0.5)
    assert again.duration(_stage(10)) == pytest.approx(50.0)


def test_a_signature_seen_on_one_model_takes_the_ratio_pooled_over_others(tmp_path):
    """A signature measured on the RTX 3090 only: its speed there is the ratio of the signatures measured on
    both; its measured time is converted with it (and a restart does the same)."""
    est = _live(tmp_path)
    for model, ratio in (("flows.a", 0.5), ("flows.b", 0.5)):
        est.observe(_stage(0, model), 10.0, steps=10, where=_on("a100"))
        est.observe(_stage(1, model), 10.0 / ratio, steps=10, where=_on("rtx3090"))
    lone = _stage(2, "flows.lone")
    est.observe(lone, 300.0, steps=100, where=_on("rtx3090"))
    p = est.predict_gpu_speed(_stage(3, "flows.lone"), "rtx3090")
    assert p.value == pytest.approx(0.5) and p.basis == "pooled:2 other ratio(s) on rtx3090/a100" and p.n_samples == 0
    assert est.duration(_stage(3, "flows.lone")) == pytest.approx(150.0)  # 3 s per step there: 1.5 s on the A100
    again = LearnedEstimator.from_store(est.store, reference=None)
    assert again.gpu_speed(_stage(4, "flows.lone"), "rtx3090") == pytest.approx(0.5)
    assert again.duration(_stage(4, "flows.lone")) == pytest.approx(150.0)


def test_a_homogeneous_cluster_learns_exactly_as_when_models_were_unknown(tmp_path):
    """Stages all on one model (named, unnamed, or 'generic') give the same durations, slowdowns and
    spreads, live and after a restart: nothing is converted."""
    def run(name, gpu_type):
        est = _live(tmp_path, name)
        partner = _stage(99, "flows.etl")
        for i, (secs, gpus) in enumerate([(50.0, 1), (55.0, 1), (47.0, 1), (30.0, 4)]):
            est.observe_stage(_stage(i, gpus=gpus), secs, steps=100, where=_on(gpu_type))
        est.observe_stage(_stage(5), 80.0, steps=100, partners=[partner], ran_alone=False, where=_on(gpu_type))
        est.observe_stage(_stage(6, "flows.nosteps"), 42.0, where=_on(gpu_type))
        asked = [_stage(10), _stage(11, gpus=4), _stage(12, "flows.nosteps")]
        answers = lambda e: ([e.duration(j) for j in asked], e.pair_slowdown(asked[0], partner),  # noqa: E731
                             e.spread_slowdown(asked[1], 2, 1))
        return answers(est), answers(LearnedEstimator.from_store(est.store, reference=None))

    base = run("none.db", None)
    assert run("a100.db", "a100") == base
    assert run("generic.db", "generic") == base


@needs_gavel
def test_the_predictor_keeps_samples_under_the_models_its_table_knows(tmp_path):
    """A sample on a model the reference table measured stays under it (a K80's step time is no V100's);
    one on a model it does not know goes under the predictor's own type, as untyped samples always did."""
    from qosflow.predict.reference import ThroughputTable

    p = Predictor(ThroughputTable.load(default_gavel_path()))
    assert [p.type_key(g) for g in ("k80", "Tesla K80", "a100", "unknown", None, "cpu")] == \
        ["k80", "k80", "v100", "v100", "v100", "cpu"]
    p.observe({"signature": "mine/bs8", "gpus": 1, "step_time_s": 2.0, "gpu_type": "a100"})
    assert p.predict_solo_step_time("mine/bs8", 1).basis == "samples(n=1)"
    assert p.reference_speed(RESNET, 1, "k80", "v100") == pytest.approx(0.1409, abs=1e-3)
    assert p.reference_speed("mine/bs8", 1, "k80", "v100") is None


@needs_gavel
def test_in_flight_readings_on_a_slow_gpu_are_no_slowdown():
    """Simulation: with the engine's node models, a running job's progress is read against its speed on
    the GPUs it holds, so a K80's pace (ResNet-50 at 0.14 x a V100) is not learned as a spreading slowdown."""
    from qosflow.core.job import JobState
    from qosflow.core.placement import Placement
    from qosflow.sim.interference import GavelInterference

    def spread_after_running_on_k80s(models):
        est = LearnedEstimator(SpeedModel(interference=GavelInterference()), seed=0)
        job = Job("j1", 0.0, QoSSpec(gpus=2, cpu_cores=8.0), 1e4, model=RESNET, iterations=100_000,
                  meta={"iteration_time": 0.1})
        est.node_gpu_models, est.gpus_per_node = models, 4
        pace = est.speed.gpu_speed(job, "k80")  # the truth: how fast it really runs there
        d = est.duration(job)
        spread = Placement("j1", ((0, 0), (1, 0)))  # two nodes where one would do
        for attained in (0.0, 2000.0, 4000.0, 6000.0):  # at the K80's pace
            est.remaining(JobState(job, placement=spread, progress=attained * pace / d, attained=attained))
        assert est.stats["in_flight_measured"] == 2  # (the first interval after a start is skipped)
        return est.predict_spread(job).value

    assert spread_after_running_on_k80s(["k80", "k80"]) < 1.3
    assert spread_after_running_on_k80s(None) > 3.0  # (what it learned without the engine's models)


def test_a_gang_takes_its_signatures_speed_ratio_from_another_gpu_count(tmp_path):
    """A signature measured on both models at 1 GPU only: its 2-GPU gang's speed on the other model is
    that ratio (the nearest GPU count measured on both), not the ratio pooled over other signatures."""
    est = _live(tmp_path)
    for i in range(3):
        est.observe(_stage(i), 50.0, steps=100, where=_on("a100"))
        est.observe(_stage(i + 10), 100.0, steps=100, where=_on("rtx3090"))  # half as fast
        est.observe(_stage(i + 20, "flows.other"), 10.0, steps=10, where=_on("a100"))
        est.observe(_stage(i + 30, "flows.other"), 5.0, steps=10, where=_on("rtx3090"))  # twice as fast
    p = est.predict_gpu_speed(_stage(40, gpus=2), "rtx3090")
    assert p.value == pytest.approx(0.5) and p.basis.endswith("at 1 GPU(s)"), p
