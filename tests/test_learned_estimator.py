"""`LearnedEstimator`: the Estimator protocol from the predictor, in the simulator and from a store.

Most tests run without the shared data (no reference table: the predictor's fallbacks answer); the
ones that need Gavel's table skip with a reason when it is absent.
"""

from __future__ import annotations

import json
import math

import pytest

from qosflow.core.cluster import ClusterSpec
from qosflow.core.estimate import Estimator, make_estimator
from qosflow.core.job import Job, JobState
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.core.speed import SpeedModel
from qosflow.predict.estimator import LearnedEstimator, SimulatedProfiler, job_signature
from qosflow.predict.reference import default_gavel_path

needs_gavel = pytest.mark.skipif(not default_gavel_path().exists(),
                                 reason="Gavel's table is not at ../shared/data/throughputs/ (shared data absent)")


def _job(i: int, model: str = "mynet", *, gpus: int = 1, iterations: int | None = 1000, step: float = 0.5,
         overhead: float = 1.1, bs: int | None = 32, user: str | None = None, declared: float | None = None) -> Job:
    """A trace-like job: the profiler measures `step` per iteration; the job really takes `overhead` x more."""
    dur = (iterations or 1000) * step * overhead
    meta = {"iteration_time": step} if iterations else {}
    return Job(f"j{i}", float(i), QoSSpec(gpus=gpus, cpu_cores=4.0 * max(gpus, 1), shareable=True), dur, model=model,
               batch_size=bs, iterations=iterations, user=user, expected_duration=declared, meta=meta)


def _learned(seed: int = 0, **kw) -> LearnedEstimator:
    return LearnedEstimator(SpeedModel(), seed=seed, reference=None, **kw)


def test_protocol_conformance_and_value_ranges():
    est = _learned()
    assert isinstance(est, Estimator)
    assert est.name == "learned"
    a, b = _job(1), _job(2, "othernet", gpus=1)
    big = _job(3, gpus=8)
    assert isinstance(est.duration(a), float) and est.duration(a) > 0
    assert est.remaining(JobState(a)) == pytest.approx(est.duration(a))
    half = JobState(a, progress=0.5, attained=300.0)
    assert 0 < est.remaining(half) < est.duration(a)
    assert est.remaining(JobState(a, progress=1.0)) == 0.0
    xa, xb = est.pair_slowdown(a, b)
    assert 1.0 <= xa <= 10.0 and 1.0 <= xb <= 10.0
    assert est.spread_slowdown(big, 1, 1) == 1.0
    assert est.spread_slowdown(big, 2, 1) >= 1.0
    assert est.cpu_factor(a, 4.0) == 1.0  # what it asked for
    assert 0.0 < est.cpu_factor(a, 2.0) < 1.0
    assert est.cpu_factor(a, 0.0) == 0.0


def test_make_estimator_builds_it_for_the_simulator():
    est = make_estimator("learned", SpeedModel(), seed=3)
    assert isinstance(est, LearnedEstimator) and est.profiler is not None and est.seed == 3


def test_deterministic_for_a_seed_and_different_across_seeds():
    jobs = [_job(i, m, gpus=g) for i, (m, g) in enumerate([("mynet", 1), ("othernet", 2), ("mynet", 4), ("thirdnet", 1)])]

    def answers(seed):
        est = _learned(seed)
        return ([est.duration(j) for j in jobs], [est.pair_slowdown(a, b) for a in jobs for b in jobs],
                [est.cpu_factor(j, 1.0) for j in jobs])

    assert answers(7) == answers(7)
    assert answers(7)[0] != answers(8)[0]  # measurement noise depends on the seed


def test_predictions_carry_their_basis():
    est = _learned()
    p = est.predict_duration(_job(1))
    assert p.basis == "iterations×step-time:samples(n=1)" and p.n_samples == 1 and p.low < p.value < p.high
    assert est.predict_duration(_job(2, declared=123.0)).basis == "declared+iterations×step-time:samples(n=1)"
    assert est.predict_duration(_job(20, "unprofiled", iterations=None, declared=123.0)).basis == "declared"
    no_iter = _job(3, "stage", iterations=None, bs=None)
    assert est.predict_duration(no_iter).basis.startswith("prior:default")
    r = est.predict_remaining(JobState(_job(1), progress=0.25, attained=10.0))
    assert r.basis.startswith("progress(f=0.25)×iterations×step-time")
    r2 = est.predict_remaining(JobState(no_iter, progress=0.5, attained=100.0))
    assert r2.basis.startswith("progress(f=0.50)+prior:")
    pa, pb = est.predict_pair(_job(1), _job(4, "othernet"))
    assert pa.basis and pb.basis  # e.g. fallback:default-slowdown without a reference table
    assert "spread/consolidated" in est.predict_spread(_job(5, gpus=4)).basis
    assert est.predict_cpu(_job(1), 2.0).basis.startswith("samples(n=2")  # the two profiled core counts
    assert est.basis(_job(1)) == p.basis


def test_improves_after_observing_finished_jobs():
    """The profile measures the bare step time; finished jobs reveal the real per-iteration time."""
    est = _learned()
    probe = _job(100, iterations=2000)
    before = abs(est.duration(probe) / probe.duration - 1)
    for i in range(8):
        done = _job(i, iterations=500 + 100 * i)
        est.duration(done)
        est.observe_finished(JobState(done, progress=1.0, finish_time=1e4), 1e4)
    p = est.predict_duration(probe)
    after = abs(p.value / probe.duration - 1)
    assert p.basis == "iterations×step-time:samples(n=9)"
    assert after < before / 2
    # a job without iterations learns from the durations of its signature
    stage = _job(200, "etl", iterations=None, bs=None)
    assert est.predict_duration(stage).basis.startswith("prior:default")
    est.observe_finished(JobState(_job(201, "etl", iterations=None, bs=None), progress=1.0), 0.0)
    p = est.predict_duration(stage)
    assert p.basis == "history(n=1)" and p.value == pytest.approx(1000 * 0.5 * 1.1, rel=0.3)


def test_the_simulator_feeds_finished_jobs_back():
    from qosflow.policies import get_policy
    from qosflow.sim.engine import Simulator

    jobs = [_job(i, ["a", "b", "c"][i % 3], gpus=[1, 2, 4][i % 3], iterations=200 + 10 * i) for i in range(12)]
    est = _learned()
    res = Simulator(jobs, ClusterSpec.uniform(2, 4), get_policy("sjf-bsbf"), estimator=est, speed=SpeedModel()).run()
    assert len(res.finished) == 12
    assert est.stats["finished_observed"] == 12
    assert res.estimator == "learned"


def test_simulated_profiler_measures_the_truth_with_seeded_noise():
    speed = SpeedModel()
    j = _job(1)
    a, b = SimulatedProfiler(speed, seed=1), SimulatedProfiler(speed, seed=1)
    assert a.step_time(j) == b.step_time(j)
    assert a.step_time(j) == pytest.approx(0.5, rel=0.25)
    exact = SimulatedProfiler(speed, seed=1, noise=0.0)
    assert exact.step_time(j) == 0.5
    prof = exact.profile(j)
    assert set(prof.ref_speeds) == set(exact.refs) and all(0 < v <= 1 for v in prof.ref_speeds.values())
    assert [c for c, _ in prof.cpu_points] == [2.0, 4.0]


def test_signatures():
    assert job_signature(_job(1, "resnet18", bs=128)) == "resnet18/bs128"
    assert job_signature(_job(1, "ResNet-50 (batch size 64)", bs=64)) == "ResNet-50 (batch size 64)"
    assert job_signature(_job(1, "flows.train:fit", bs=None)) == "flows.train:fit"


@needs_gavel
def test_gavel_cold_start_reference_and_profiled_jobs():
    from qosflow.sim.interference import default_speed_model

    speed = default_speed_model()
    est = LearnedEstimator(speed, seed=0)
    known = _job(1, "resnet18", bs=128)  # a job type of the reference table
    new = _job(2, "dqn", bs=128)  # not in the table: profiled against the reference jobs
    pa, pb = est.predict_pair(new, known)
    assert pa.basis.startswith("profile+interference-model")
    kk, _ = est.predict_pair(known, known)
    assert kk.basis.startswith("reference:gavel/v100")
    assert est.stats["profiles"] == 1  # the table's job needs no profile
    truth = speed.pair_slowdown(new, known)[0]
    assert pa.value == pytest.approx(truth, rel=0.5)


# ------------------------------------------------------------------------------------------ live worker


def test_from_store_uses_live_samples_and_writes_finished_stages_back(tmp_path):
    from qosflow.store import Store

    url = f"sqlite:///{tmp_path / 'q.db'}"
    store = Store.open(url)
    store.add_samples([{"signature": "mynet/bs32", "gpus": 1, "step_time_s": t, "source": "stage"} for t in (0.40, 0.42, 0.41)])
    store.record_stage(stage_run_id="old-1", signature="etl", duration_s=50.0, state="COMPLETED")
    est = LearnedEstimator.from_store(store, reference=None)
    assert est.profiler is None and est.speed is None  # no simulator truth in the live worker
    j = _job(1)
    p = est.predict_duration(j)
    assert p.basis == "iterations×step-time:samples(n=3)" and p.value == pytest.approx(1000 * 0.41, rel=0.05)
    stage = _job(2, "etl", iterations=None, bs=None)
    assert est.predict_duration(stage).basis == "history(n=1)"
    est.observe(stage, 70.0)  # the worker's hook
    assert est.predict_duration(stage).basis == "history(n=2)"
    assert [h.duration_s for h in store.stage_history(signature="etl")] == [50.0, 70.0]
    assert store.prediction_errors("duration")[0][1].actual == 70.0
    est.observe(j, 450.0)
    again = LearnedEstimator.from_store(Store.open(url), reference=None)
    assert again.predict_duration(_job(3)).basis == "iterations×step-time:samples(n=4)"
    assert again.predict_duration(_job(4, "etl", iterations=None, bs=None)).basis == "history(n=2)"


def test_the_workers_start_reads_the_samples_once(tmp_path):
    """The predictor (its configurations) and the estimator (its step times) each read every sample at a
    worker's start: twice the queries and twice the ORM instances. The estimator now keeps the step times it
    needs from the predictor's one pass, in one query per 20,000 samples."""
    import sqlalchemy as sa

    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")
    store.add_samples([{"signature": "mynet/bs32", "gpus": 1, "step_time_s": t, "gpu_type": "v100"} for t in (0.40, 0.42, 0.41)]
                      + [{"signature": "mynet/bs32", "gpus": 1, "step_time_s": 0.9, "co_runner": "etl"},
                         {"signature": "mynet/bs32", "gpus": 1, "step_time_s": 0.5, "gpu_type": "a100"}])
    queries: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda _c, _cur, sql, *a: queries.append(" ".join(sql.split())))
    est = LearnedEstimator.from_store(store, reference=None, persist=False)
    assert len([q for q in queries if "FROM sample" in q]) == 1, queries
    # what each learned from the one pass: the predictor every sample, the estimator the solo ones
    assert est.predictor.n_observed == 5
    assert est.reference_gpu == "v100"  # the first model the samples name
    assert est.predict_gpu_speed(_job(1), "a100").basis.startswith("samples(n=1 on a100,3 on v100)")
    assert est.predict_duration(_job(1)).basis == "iterations×step-time:samples(n=4)"  # (a100's converted)


def test_a_declared_duration_gives_way_to_measured_runs(tmp_path):
    """A stage declared at 100 s that runs in about 32 s: its runs correct the declaration (the worker's
    case: every @qos_task stage may declare an expected_duration), in this process and after a restart."""
    from qosflow.store import Store

    url = f"sqlite:///{tmp_path / 'q.db'}"
    est = LearnedEstimator.from_store(Store.open(url), reference=None)

    def stage(i: int) -> Job:
        return _job(i, "flows.retrain.train", iterations=None, declared=100.0)

    first = est.predict_duration(stage(0))
    assert (first.value, first.basis, first.n_samples) == (100.0, "declared", 0) and first.low < 100.0 < first.high
    est.observe(stage(1), 31.0)
    one = est.predict_duration(stage(2))
    assert one.basis == "declared+history(n=1)" and one.n_samples == 1
    assert 31.0 < one.value < 36.0  # one run outweighs a rough declaration, not entirely
    assert one.high / one.value < first.high / first.value  # and the band narrows
    for i, t in enumerate((33.0, 32.0), start=3):
        est.observe(stage(i), t)
    three = est.predict_duration(stage(9))
    assert three.value == pytest.approx(32.0, rel=0.02) and est.samples(stage(9)) == 3
    assert est.remaining_high(JobState(stage(9))) == pytest.approx(three.high)
    again = LearnedEstimator.from_store(Store.open(url), reference=None)
    assert again.predict_duration(stage(10)).value == pytest.approx(three.value)
    # a declaration that the runs confirm stays where it is
    fresh = LearnedEstimator.from_store(Store.open(f"sqlite:///{tmp_path / 'other.db'}"), reference=None)
    fresh.observe(stage(1), 100.0)
    assert fresh.duration(stage(2)) == pytest.approx(100.0)


def test_worker_stages_teach_step_times_and_measured_slowdowns(tmp_path):
    """`observe_stage`, the worker's hook: a stage that ran alone and reported its steps gives a solo
    step-time sample; one that shared its GPU with one partner the whole time gives a measured slowdown
    (its step time over the solo one) and an isolated duration; one whose partners came and went gives
    its wall time only."""
    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")
    est = LearnedEstimator.from_store(store, reference=None)

    def stage(i: int, model: str = "train") -> Job:
        return Job(f"s{i}", 0.0, QoSSpec(gpus=1, cpu_cores=2.0, shareable=True), 60.0, model=model)

    partner = stage(99, "etl")
    est.observe_stage(stage(1), 50.0, steps=100)  # alone: 0.5 s per step
    [solo] = store.samples_for("train", co_runner=None)
    assert solo.step_time_s == pytest.approx(0.5) and solo.steps == 100
    before = est.pair_slowdown(stage(2), partner)[0]
    est.observe_stage(stage(3), 80.0, steps=100, partners=[partner], ran_alone=False)  # 0.8 s per step shared
    [pair] = store.samples_for("train", co_runner="etl")
    assert pair.step_time_s == pytest.approx(0.8) and pair.stage_run_id == "s3"
    after = est.pair_slowdown(stage(4), partner)[0]
    assert abs(after - 1.6) < abs(before - 1.6) and est.stats["colocations_observed"] == 1
    # the duration history holds isolated durations: the shared run's 80 s stays out of it
    assert est.duration(stage(5)) == pytest.approx(50.0, rel=1e-6)
    assert LearnedEstimator.from_store(store, reference=None).duration(stage(5)) == pytest.approx(50.0, rel=1e-6)
    est.observe_stage(stage(6), 70.0, steps=100, partners=[partner], ran_alone=True)  # shared part of the time
    assert len(store.samples_for("train")) == 2 and est.stats["colocations_observed"] == 1
    assert [h.duration_s for h in store.stage_history(signature="train")] == [50.0, 80.0, 70.0]
    # no solo measurement yet: a shared run cannot be turned into a slowdown, and gives no sample
    est.observe_stage(stage(7, "fresh"), 30.0, steps=10, partners=[partner], ran_alone=False)
    assert store.samples_for("fresh") == [] and est.stats["colocations_observed"] == 1
    # the worker forgets every stage it is done with: nothing per job stays behind
    running = stage(8)
    est.remaining(JobState(running, placement=Placement("s8", ((0, 0),)), progress=0.5, attained=10.0))
    assert "s8" in est._sig and "s8" in est._where
    for i in (*range(1, 9), 99):
        est.forget(stage(i))
    assert not (est._sig or est._dur or est._rem or est._where or est._jobs)


def test_background_writes_keep_the_database_off_the_callers_thread(tmp_path, monkeypatch):
    """The worker's estimator writes finished stages from a thread of its own: `observe_stage` returns
    while the database is still busy (here: held at a gate), learning has happened already, and
    `flush`/`close` wait for the writes, which land in order."""
    import threading

    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")
    est = LearnedEstimator.from_store(store, reference=None, background_writes=True)
    gate, entered = threading.Event(), threading.Event()
    real = store.record_outcome

    def held(*a, **kw):
        entered.set()
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(store, "record_outcome", held)
    stage = lambda i: Job(f"s{i}", 0.0, QoSSpec(gpus=0, cpu_cores=1.0), 60.0, model="etl")  # noqa: E731
    est.observe_stage(stage(1), 30.0)
    est.observe_stage(stage(2), 32.0)
    assert entered.wait(5) and store.stage_history() == []  # returned; the write waits at the gate
    assert est.duration(stage(3)) == pytest.approx((30.0 * 32.0) ** 0.5)  # learned all the same
    assert est.flush(timeout=0.2) is False
    gate.set()
    assert est.flush(timeout=10)
    assert [h.stage_run_id for h in store.stage_history()] == ["s1", "s2"]
    est.observe_stage(stage(4), 31.0)
    est.close()
    assert [h.stage_run_id for h in store.stage_history()] == ["s1", "s2", "s4"]


def test_make_estimator_learned_without_a_speed_model_opens_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{tmp_path / 'live.db'}")
    est = make_estimator("learned")
    assert isinstance(est, LearnedEstimator) and est.store is not None and est.profiler is None
    assert est.duration(_job(1, "never-seen", iterations=None, bs=None)) == est.default_duration


# ------------------------------------------------------------------------------------------ CLI


def test_simulate_cli_learned_and_comparison(tmp_path):
    from qosflow.cli.main import main

    out = tmp_path / "one.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "40", "--policies", "genie,sjf-bsbf",
                 "--estimator", "learned", "--no-plots", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["estimator"] == "learned" and set(data["policies"]) == {"genie", "sjf-bsbf"}
    cmp = tmp_path / "cmp.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "40", "--policies", "genie",
                 "--estimator", "oracle,learned", "--no-plots", "--json", str(cmp)]) == 0
    data = json.loads(cmp.read_text())
    assert data["estimator_baseline"] == "oracle"
    assert set(data["by_estimator"]) == {"oracle", "learned"}
    d = data["estimator_deltas"]["learned"]["genie"]
    assert math.isfinite(d["dsr_delta_points"]) and math.isfinite(d["avg_jct_delta_pct"])
    assert data["estimator_deltas"]["oracle"]["genie"]["dsr_delta_points"] == 0.0
    assert main(["simulate", "--trace", "synthetic", "--jobs", "10", "--estimator", "oracle,psychic", "--no-plots"]) == 2


def test_measured_colocations_and_spreads_replace_the_model():
    """A finished job's placement tells who it shared GPUs with and whether it was spread (simulated
    measurements of the truth, as a worker's progress reports would give them)."""
    from qosflow.core.placement import Placement

    speed = SpeedModel()  # no table: every pair truly slows by 1.4, a spread gang by up to 1.2
    est = _learned()
    partner = _job(50, "othernet")
    est.duration(partner)
    est.gpus_per_node = 4
    before = est.predict_pair(_job(0), partner)[0]
    assert not before.basis.startswith("samples")
    for i in range(3):
        j = _job(i)
        est.duration(j)
        est.observe_finished(JobState(j, progress=1.0, placement=Placement(j.job_id, ((0, 0),), colocated_with=(partner.job_id,))), 0.0)
    after = est.predict_pair(_job(9), partner)[0]
    assert after.basis == "samples(n=3)" and after.value == pytest.approx(speed.default_pair, rel=0.15)
    assert est.stats["colocations_observed"] == 3
    gang = [_job(20 + i, "bignet", gpus=2) for i in range(3)]
    for j in gang:
        est.duration(j)
        est.observe_finished(JobState(j, progress=1.0, placement=Placement(j.job_id, ((0, 0), (1, 0)))), 0.0)
    sp = est.predict_spread(_job(30, "bignet", gpus=2))
    assert sp.basis == "samples(n=3)" and sp.value == pytest.approx(speed.default_spread, rel=0.15)
    assert est.spread_slowdown(_job(30, "bignet", gpus=2), 2, 1) == pytest.approx(sp.value)


def test_spread_measured_at_one_gpu_count_calibrates_the_others():
    est = _learned()
    est.gpus_per_node = 4
    four = _job(1, "bignet", gpus=4)
    model8 = est.predict_spread(_job(2, "bignet", gpus=8)).value
    est.duration(four)
    est.observe_spread(four, 3.0)  # far worse than the model thought
    p8 = est.predict_spread(_job(3, "bignet", gpus=8))
    assert "calibration(n=1)" in p8.basis and p8.value > model8
    p4 = est.predict_spread(_job(4, "bignet", gpus=4))
    assert p4.basis.startswith("samples(n=1)+")


def test_running_jobs_are_read_from_their_progress():
    """In the simulator, a running job's progress between two looks gives its slowdown where it runs."""
    from qosflow.core.placement import Placement

    est = _learned()
    est.gpus_per_node = 4
    job = _job(1, "bignet", gpus=2, iterations=100_000)
    d = est.predict_duration(job).value
    where = Placement(job.job_id, ((0, 0), (1, 0)))  # two nodes where one would do
    for attained in (0.0, 2000.0, 4000.0, 6000.0):  # it runs at half its isolated speed
        est.remaining(JobState(job, placement=where, progress=attained / (2 * d), attained=attained))
    assert est.stats["in_flight_measured"] == 2  # the first interval after a start is skipped
    p = est.predict_spread(_job(2, "bignet", gpus=2))
    assert p.basis.startswith("samples(n=2)+") and p.value > 1.5


@needs_gavel
def test_same_answers_in_processes_with_different_hash_seeds():
    """Model fits must not depend on set iteration order (PYTHONHASHSEED differs between processes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from qosflow.predict.estimator import LearnedEstimator\n"
        "from qosflow.sim.interference import default_speed_model\n"
        "from qosflow.core.job import Job\nfrom qosflow.core.qos import QoSSpec\n"
        "e = LearnedEstimator(default_speed_model(), seed=0)\n"
        "js = [Job(m, 0.0, QoSSpec(gpus=8), 100.0, model=m, batch_size=b, iterations=100) for m, b in"
        " [('dqn', 128), ('gpt2', 4), ('vgg16', 16)]]\n"
        "print([e.predict_spread(j).value for j in js], [e.pair_slowdown(a, b) for a in js for b in js])\n"
    )
    import qosflow

    root = str(Path(qosflow.__file__).resolve().parent.parent)  # this tree, whatever is installed
    outs = set()
    for h in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=h, PYTHONPATH=root)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outs) == 1


def test_unmeasured_pairs_are_planned_cautiously_measured_ones_as_predicted():
    """The scheduler plans an unmeasured pair between the model's estimate and its 90th percentile
    (deadlines lost to an underestimated slowdown cost more than sharing forgone); once the pair is
    measured it plans with the measurement. `predict_pair` always reports the model's own estimate."""
    from qosflow.core.placement import Placement
    from qosflow.predict.estimator import UNMEASURED_PAIR_CAUTION

    assert 0 < UNMEASURED_PAIR_CAUTION <= 1
    est = _learned()
    a, b = _job(0), _job(50, "othernet")
    est.duration(a), est.duration(b)
    pa, pb = est.predict_pair(a, b)
    assert not pa.basis.startswith(("samples", "reference")) and pa.high > pa.value
    xa, xb = est.pair_slowdown(a, b)
    want = math.exp((1 - UNMEASURED_PAIR_CAUTION) * math.log(pa.value) + UNMEASURED_PAIR_CAUTION * math.log(pa.high))
    assert xa == pytest.approx(want) and pa.value < xa <= pa.high
    for i in range(1, 4):
        j = _job(i)
        est.duration(j)
        est.observe_finished(JobState(j, progress=1.0, placement=Placement(j.job_id, ((0, 0),), colocated_with=(b.job_id,))), 0.0)
    measured = est.predict_pair(_job(9), b)[0]
    assert measured.basis.startswith("samples")
    assert est.pair_slowdown(_job(9), b)[0] == pytest.approx(measured.value)


def test_a_run_resumed_from_a_checkpoint_is_learned_as_a_whole_run(tmp_path):
    """A stage that picked its work up at step 60 of 100 and ran 20 s: its step time is 20 s / 40 steps,
    and the history gets the 50 s a whole run takes at that pace -- in this process and after a restart,
    whose store row keeps what the run did (20 s, 40 steps, resumed from 60)."""
    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")
    est = LearnedEstimator.from_store(store, reference=None)

    def stage(i: int) -> Job:
        return Job(f"s{i}", 0.0, QoSSpec(gpus=1, cpu_cores=2.0), 60.0, model="flows.train")

    est.observe_stage(stage(1), 50.0, steps=100)  # a whole run: 0.5 s per step
    est.observe_stage(stage(2), 20.0, steps=100, resumed_from=60)
    assert est.duration(stage(3)) == pytest.approx(50.0, rel=1e-6)  # not pulled towards 20 s
    rows = store.stage_history(signature="flows.train")
    assert [(h.duration_s, h.steps, h.resumed_from) for h in rows] == [(50.0, 100, None), (20.0, 40, 60)]
    assert [s.step_time_s for s in store.samples_for("flows.train")] == pytest.approx([0.5, 0.5])
    # its prediction was for a whole run: no error is measured against what it did
    from sqlmodel import Session, select

    from qosflow.store.models import Outcome

    with Session(store.engine) as sess:
        assert [o.stage_run_id for o in sess.exec(select(Outcome)).all()] == ["s1"]
    again = LearnedEstimator.from_store(store, reference=None)
    assert again.duration(stage(4)) == pytest.approx(50.0, rel=1e-6)
    # steps unknown: what a resumed run did cannot be told from a whole run, so nothing is learned
    est.observe_stage(stage(5), 5.0, steps=None, resumed_from=60)
    assert len(store.stage_history(signature="flows.train")) == 2


def test_remaining_time_of_a_resumed_run_reads_its_pace_since_it_started():
    """A live run resumed at half its work, 30 % done after 100 s of its own: it does 20 % per 100 s,
    so 350 s are left -- not the 233 s that reading 80 % done in 100 s would give."""
    from qosflow.predict.predictor import Predictor

    pr = Predictor(reference=None)
    whole = pr.predict_remaining("x", 0.8, 100.0)
    resumed = pr.predict_remaining("x", 0.8, 100.0, start_fraction=0.5)
    assert whole.value == pytest.approx(100.0 * 0.2 / 0.8)
    assert resumed.value == pytest.approx(100.0 * 0.2 / 0.3) and "resumed at 0.50" in resumed.basis
    # no progress since it started: the prior (here none)
    assert pr.predict_remaining("x", 0.5, 100.0, start_fraction=0.5).basis.startswith("prior:")


def test_where_a_stage_ran_goes_into_its_store_rows(tmp_path):
    """The worker passes where a stage ran (`QoSScheduler.where_ran` and its times): its history row
    keeps it, and its step-time sample its placement and cores -- a stage spread over two nodes gives a
    spread sample, which the solo step times read back on a restart leave out."""
    from datetime import datetime, timezone

    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")
    est = LearnedEstimator.from_store(store, reference=None)
    t0, t1 = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)

    def stage(i: int, gpus: int = 1) -> Job:
        return Job(f"s{i}", 0.0, QoSSpec(gpus=gpus, cpu_cores=4.0), 60.0, model="flows.train")

    est.observe_stage(stage(1), 60.0, steps=100, where={"host": "gpu-a", "gpu_type": "a100", "placement": "consolidated",
                                                       "cpu_cores": 4, "started_at": t0, "finished_at": t1, "ignored": 1})
    est.observe_stage(stage(2, gpus=16), 30.0, steps=100, where={"host": "gpu-a,gpu-b", "placement": "spread", "cpu_cores": None})
    a, b = store.stage_history(signature="flows.train")
    assert (a.host, a.gpu_type, a.placement, a.cpu_cores) == ("gpu-a", "a100", "consolidated", 4)
    assert a.started_at.replace(tzinfo=timezone.utc) == t0 and a.finished_at.replace(tzinfo=timezone.utc) == t1
    assert (b.host, b.placement, b.cpu_cores, b.gpu_type) == ("gpu-a,gpu-b", "spread", None, "unknown")
    sa, sb = store.samples_for("flows.train")
    assert (sa.placement, sa.cpu_cores, sa.cross_node) == ("consolidated", 4, False)
    assert (sb.placement, sb.cross_node, sb.gpus) == ("spread", True, 16)
    again = LearnedEstimator.from_store(store, reference=None)
    assert again._steps.get((again._sig_of(stage(3, gpus=16))[1], 16)) is None  # the spread run is no solo step time


def test_a_stages_runs_on_different_cores_teach_its_cpu_curve_at_once(tmp_path):
    """CODA's curve learns from the worker's stages while it runs, not only from `qosflow profile` or after
    a restart: runs alone at 1 and 4 cores (0.8 and 0.35 s per step) give a two-point curve, by which 2
    cores run at about 0.5 s per step."""
    from qosflow.store import Store

    est = LearnedEstimator.from_store(Store.open(f"sqlite:///{tmp_path / 'q.db'}"), reference=None)

    def stage(i: int) -> Job:
        return Job(f"s{i}", 0.0, QoSSpec(gpus=1, cpu_cores=4.0), 60.0, model="flows.train")

    before = est.curve(stage(0))
    est.observe_stage(stage(1), 80.0, steps=100, where={"placement": "consolidated", "cpu_cores": 1})
    est.observe_stage(stage(2), 35.0, steps=100, where={"placement": "consolidated", "cpu_cores": 4})
    c = est.curve(stage(3))
    assert before.n_samples == 0 and c.n_samples == 2
    assert c.step_time(1) == pytest.approx(0.8, rel=0.01) and c.step_time(4) == pytest.approx(0.35, rel=0.01)
    assert c.step_time(2) == pytest.approx(0.5, rel=0.01)
    assert est.predict_cpu(stage(4), 2.0).value == pytest.approx(0.35 / 0.5, rel=0.02)
    # the same after a restart, from the samples' cores
    again = LearnedEstimator.from_store(est.store, reference=None)
    assert again.curve(stage(5)).n_samples == 2
