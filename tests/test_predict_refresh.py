"""A running worker's estimator learns what the other workers of its pool write to the shared store
(`LearnedEstimator.refresh_from_store`), without counting its own rows twice, off the event loop's lock
while it refits, and without raising when the database is down."""

from __future__ import annotations

import logging
import threading

import pytest
from sqlalchemy.exc import OperationalError

from qosflow.core.job import Job
from qosflow.core.qos import QoSSpec
from qosflow.predict.estimator import LearnedEstimator
from qosflow.store import Store


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'q.db'}"
    return request.getfixturevalue("pg_url")  # (skipped, saying why, without QOSFLOW_TEST_POSTGRES_URL)


def stage(i: int, model: str = "flows.train", *, declared: float | None = None, gpus: int = 1) -> Job:
    return Job(f"s{i}", 0.0, QoSSpec(gpus=gpus, cpu_cores=2.0, shareable=True), 60.0, model=model,
               expected_duration=declared)


def worker(url: str) -> LearnedEstimator:
    """A worker's estimator, as `make_live_estimator` builds it (its own connection to the shared store)."""
    return LearnedEstimator.from_store(Store.open(url), reference=None, background_writes=True)


def test_a_running_worker_learns_a_stage_another_worker_ran(url):
    """The field report: w2, started first, predicted the declared 60 s for a train stage w1 had learned as
    80.8 s. After a refresh w2 plans with what w1 measured, as a restarted w2 would."""
    w2 = worker(url)
    w1 = worker(url)
    assert w2.duration(stage(1, declared=60.0)) == pytest.approx(60.0)
    w1.observe_stage(stage(2, declared=60.0), 80.8, steps=100)
    w1.flush()
    assert w2.duration(stage(3, declared=60.0)) == pytest.approx(60.0)  # (nothing read yet)
    assert w2.refresh_from_store() == 2  # its history row and its solo step-time sample
    after = w2.duration(stage(3, declared=60.0))
    restarted = worker(url).duration(stage(3, declared=60.0))
    assert after == pytest.approx(restarted, rel=1e-9) and after == pytest.approx(80.8, rel=0.1)
    assert w2.predict_duration(stage(4)).basis == "history(n=1)"
    assert w2.step_time(stage(5)).value == pytest.approx(0.808)
    assert w2.refresh_from_store() == 0  # only new rows are read
    w1.close(), w2.close()


def test_own_rows_are_not_counted_twice(url):
    """A worker's `observe_stage` learned its stage already: a refresh that reads the rows it wrote skips
    them, so its prediction is the one it had without the refresh -- while another worker's rows written
    meanwhile are taken."""
    w1, other = worker(url), worker(url)
    control = LearnedEstimator.from_store(Store.open(url), reference=None, persist=False)
    for i, d in enumerate((50.0, 70.0)):
        w1.observe_stage(stage(i), d, steps=100)
        control.observe_stage(stage(i), d, steps=100)
    w1.flush()
    before = w1.predict_duration(stage(10))
    assert w1.refresh_from_store() == 0
    again = w1.predict_duration(stage(10))
    assert again.value == before.value and again.basis == before.basis == "history(n=2)"
    assert w1.step_time(stage(11)).n_samples == 2
    assert (again.value, again.low, again.high) == pytest.approx(
        (lambda p: (p.value, p.low, p.high))(control.predict_duration(stage(10))), rel=1e-12)
    # now another worker's run, and one more of its own written after it: only the other's is taken
    other.observe_stage(stage(20), 90.0, steps=100)
    other.flush()
    w1.observe_stage(stage(21), 60.0, steps=100)
    w1.flush()
    assert w1.refresh_from_store() == 2
    assert w1.predict_duration(stage(22)).basis == "history(n=4)"
    assert w1.duration(stage(22)) == pytest.approx(worker(url).duration(stage(22)), rel=1e-9)
    w1.close(), other.close()


def test_refreshed_predictor_answers_as_a_restarted_one(url):
    """Samples of every kind another process writes -- a shared run (co-located sample), `qosflow profile`'s
    samples and profile, multi-GPU runs -- reach the refreshed predictor once each: its step times,
    slowdowns and sample counts are those of an estimator built from the store now."""
    w2 = worker(url)
    w1 = worker(url)
    partner = stage(99, "flows.etl")
    w1.observe_stage(stage(1), 50.0, steps=100)
    w1.observe_stage(partner, 20.0, steps=40)
    w1.observe_stage(stage(2), 80.0, steps=100, partners=[partner], ran_alone=False)
    for i in range(6):  # multi-GPU runs of several signatures: the scaling model gets its training rows
        w1.observe_stage(stage(30 + i, f"flows.m{i}", gpus=1), 10.0, steps=100)
        w1.observe_stage(stage(40 + i, f"flows.m{i}", gpus=4), 4.0, steps=100)
    w1.flush()
    profiler_store = Store.open(url)  # what `qosflow profile` stores: its runs as samples, then its best as a profile
    profiler_store.add_samples([{"signature": "flows.prof", "step_time_s": 0.3, "gpus": 1, "gpu_type": "unknown",
                                 "cpu_cores": 2, "source": "profile"}])
    profiler_store.add_profile("flows.prof", 0.3, gpu_type="unknown", cpu_cores=2)
    taken = w2.refresh_from_store()
    assert taken == 2 * (3 + 12) + 2  # history rows and samples of 15 runs (the shared one: its sample too) + 2
    fresh = worker(url)
    p2, pf = w2.predictor, fresh.predictor
    assert p2.n_observed == pf.n_observed
    for sig, gpus in (("flows.train", 1), ("flows.prof", 1), ("flows.m0", 4), ("flows.unseen", 2)):
        a, b = p2.predict_solo_step_time(sig, gpus), pf.predict_solo_step_time(sig, gpus)
        assert (a.value, a.n_samples, a.basis) == (pytest.approx(b.value, rel=1e-9), b.n_samples, b.basis), sig
    assert (p2.scaling is None) == (pf.scaling is None)
    for j in (stage(50), stage(51, "flows.m3", gpus=4)):
        assert w2.duration(j) == pytest.approx(fresh.duration(j), rel=1e-9)
    assert w2.pair_slowdown(stage(52), partner) == pytest.approx(fresh.pair_slowdown(stage(52), partner), rel=1e-9)
    assert w2.refresh_from_store() == 0  # the profile is not read again either
    assert p2.n_observed == pf.n_observed
    w1.close(), w2.close()


def test_a_failed_read_is_logged_and_retried(tmp_path, caplog, monkeypatch):
    """The database down: the refresh logs it, counts it and returns 0, never raises into the worker; the
    rows it could not read are read at the next refresh."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    w2, w1 = worker(url), worker(url)
    w1.observe_stage(stage(1), 80.8, steps=100)
    w1.flush()

    def down(*a, **kw):
        raise OperationalError("SELECT ...", {}, Exception("connection refused: the server is down"))

    monkeypatch.setattr(w2.store, "sample_rows", down)
    with caplog.at_level(logging.WARNING, logger="qosflow.predict.estimator"):
        assert w2.refresh_from_store() == 0
    assert w2.refresh_failures == 1 and "retried at the next refresh" in caplog.text and "server is down" in caplog.text
    assert w2.predict_duration(stage(2)).basis.startswith("prior:")
    monkeypatch.undo()
    assert w2.refresh_from_store() == 2
    assert w2.duration(stage(2)) == pytest.approx(80.8)
    w1.close(), w2.close()


def test_the_refit_runs_outside_the_lock_the_event_loop_takes(tmp_path, monkeypatch):
    """New configurations call for a model refit (~0.5 s on a large store): it runs on a copy of the
    aggregates while the estimator's lock is free, so the worker's event loop can go on predicting."""
    from qosflow.predict.predictor import Predictor

    url = f"sqlite:///{tmp_path / 'q.db'}"
    w2, w1 = worker(url), worker(url)
    for i in range(6):
        w1.observe_stage(stage(30 + i, f"flows.m{i}"), 10.0, steps=100)
        w1.observe_stage(stage(40 + i, f"flows.m{i}", gpus=4), 4.0, steps=100)
    w1.flush()
    free_during_refit: list[bool] = []
    real = Predictor.refit

    def refit(self, *a, **kw):
        def probe() -> None:  # (the event loop's thread, asking for the lock)
            got = w2._lock.acquire(blocking=False)
            if got:
                w2._lock.release()
            free_during_refit.append(got)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return real(self, *a, **kw)

    monkeypatch.setattr(Predictor, "refit", refit)
    assert w2.predictor.scaling is None
    assert w2.refresh_from_store() == 24
    assert free_during_refit == [True] and w2.predictor.scaling is not None
    assert not w2.predictor.needs_refit() and w2.stats["refits"] == 1
    w1.close(), w2.close()


def test_refreshes_in_a_thread_while_the_loop_predicts(tmp_path):
    """The worker's pattern: a thread refreshes (here: again and again, while a third estimator writes)
    while the caller predicts and observes on its own thread; nothing raises and, once both stop, the
    refreshed estimator answers as one built from the store."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    w2, w1 = worker(url), worker(url)
    stop = threading.Event()
    errors: list[BaseException] = []

    def refresher() -> None:
        try:
            while not stop.is_set():
                w2.refresh_from_store()
        except BaseException as exc:  # pragma: no cover - what the test looks for
            errors.append(exc)

    t = threading.Thread(target=refresher)
    t.start()
    try:
        for i in range(40):
            w1.observe_stage(stage(i, f"flows.s{i % 7}", gpus=1 + i % 3), 10.0 + i, steps=50)
            w2.observe_stage(stage(100 + i, f"flows.s{i % 5}"), 20.0 + i, steps=50)
            for j in range(8):
                w2.duration(stage(200 + j, f"flows.s{j}", gpus=1 + j % 3))
                w2.pair_slowdown(stage(300 + j, f"flows.s{j}"), stage(400, "flows.s1"))
    finally:
        w1.flush(), w2.flush()
        stop.set()
        t.join()
    assert not errors and w2.refresh_failures == 0
    w2.refresh_from_store()
    fresh = worker(url)
    for j in range(8):
        assert w2.duration(stage(500 + j, f"flows.s{j}", gpus=1 + j % 3)) == pytest.approx(
            fresh.duration(stage(500 + j, f"flows.s{j}", gpus=1 + j % 3)), rel=1e-9)
    w1.close(), w2.close()
