"""Retention: `Store.prune` and `qosflow predict prune` (SQLite and PostgreSQL).

What goes and what stays, a dry run, a writer during a prune, the predictor after a prune, bad input."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from qosflow.errors import SpecError
from qosflow.predict.prediction import Prediction
from qosflow.store import Store
from qosflow.store.models import Outcome, PredictionRecord, Profile, Sample, StageHistory
from qosflow.store.store import parse_age

NOW = datetime.now(timezone.utc)
OLD = NOW - timedelta(days=200)
TABLES = (Sample, StageHistory, PredictionRecord, Outcome, Profile)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'qosflow.db'}"
    return request.getfixturevalue("pg_url")


def _stage(store: Store, run: str, sig: str, *, at: datetime, gpus: int = 1, step: float | None = 0.1,
           state: str = "COMPLETED", co_runner: str | None = None, gpu_type: str = "v100") -> None:
    """A finished stage written as the worker's estimator writes it (`LearnedEstimator._write_stage`), at `at`."""
    store.record_prediction(Prediction(100.0, 80.0, 120.0, 3, "history(n=3)"), signature=sig, target="duration",
                            stage_run_id=run)
    store.record_outcome(run, 90.0, signature=sig, target="duration")
    store.record_stage(stage_run_id=run, signature=sig, stage=sig, state=state, gpus=gpus, steps=100, duration_s=90.0,
                       step_time_s=step, co_runner=co_runner, gpu_type=gpu_type, created_at=at)
    if step is not None:
        store.add_sample(signature=sig, gpus=gpus, step_time_s=step, steps=100, source="stage", stage_run_id=run,
                         co_runner=co_runner, gpu_type=gpu_type, created_at=at)
    # record_prediction and record_outcome take no time: age them as the stage
    with store.engine.begin() as conn:
        for t in (PredictionRecord.__table__, Outcome.__table__):
            conn.execute(sa.update(t).where(t.c.stage_run_id == run).values(created_at=at))


def _ids(store: Store, model) -> set[int]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(model.__table__.c.id)).scalars())


def _runs(store: Store, model) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(model.__table__.c.stage_run_id)).scalars())


def _preds(store: Store) -> list[PredictionRecord]:
    from sqlmodel import Session, select

    with Session(store.engine) as s:
        return list(s.exec(select(PredictionRecord).order_by(PredictionRecord.id)).all())


def _fill(store: Store) -> None:
    """a: 10 old runs and 2 recent ones on 1 GPU; a on 2 GPUs once, long ago; b: 3 old runs (its only ones);
    a next to b, twice long ago; a failed run of c long ago; a profile; old predictions of no run of d: two on
    its declared duration, one not."""
    for i in range(10):
        _stage(store, f"a-old-{i}", "a", at=OLD + timedelta(hours=i))
    for i in range(2):
        _stage(store, f"a-new-{i}", "a", at=NOW - timedelta(days=1, hours=i))
    _stage(store, "a2-old", "a", gpus=2, at=OLD)
    for i in range(3):
        _stage(store, f"b-old-{i}", "b", at=OLD + timedelta(hours=i))
    for i in range(2):
        _stage(store, f"ab-old-{i}", "a", co_runner="b", step=0.15, at=OLD + timedelta(hours=i))
    _stage(store, "c-failed", "c", state="FAILED", step=None, at=OLD)
    store.add_profile("a", 0.1, gpu_type="v100")
    store.record_prediction(Prediction(5.0, 4.0, 6.0, 0, "declared"), signature="d", target="duration")
    store.record_prediction(Prediction(6.0, 4.0, 7.0, 0, "declared"), signature="d", target="duration")
    store.record_prediction(Prediction(5.0, 4.0, 6.0, 3, "history(n=3)"), signature="d", target="duration")
    with store.engine.begin() as conn:
        t = PredictionRecord.__table__
        conn.execute(sa.update(t).where(t.c.stage_run_id.is_(None)).values(created_at=OLD))
    assert len(store.prediction_errors()) == 19


def test_prune_deletes_old_rows_and_keeps_each_configurations_latest(url):
    with Store.open(url) as store:
        _fill(store)
        rep = store.prune(timedelta(days=90), keep_samples=3, keep_runs=4)
        samples = {(s.stage_run_id or "") for s in store.samples_for()}
        # a on 1 GPU alone: its 3 most recent (the 2 recent, the latest old); every other configuration is within 3
        assert samples == {"a-new-0", "a-new-1", "a-old-9", "a2-old", "b-old-0", "b-old-1", "b-old-2",
                           "ab-old-0", "ab-old-1"}
        # history: a's solo completed runs keep 4 (2 recent + 2 latest old), the others are within 4
        runs = _runs(store, StageHistory)
        assert runs == {"a-new-0", "a-new-1", "a-old-9", "a-old-8", "a2-old", "b-old-0", "b-old-1", "b-old-2",
                        "ab-old-0", "ab-old-1", "c-failed"}
        # predictions and outcomes: those of the kept runs, and d's latest on its declared duration
        assert _runs(store, PredictionRecord) == runs | {None}
        assert [(p.basis, p.value) for p in _preds(store) if p.stage_run_id is None] == [("declared", 6.0)]
        assert _runs(store, Outcome) == runs
        assert len(store.profiles_for("a")) == 1
        assert rep.deleted == {"sample": 9, "stage_history": 8, "prediction": 10, "outcome": 8}
        assert rep.before == {"sample": 18, "stage_history": 19, "prediction": 22, "outcome": 19}
        assert rep.kept_old["sample"] == 7 and rep.kept_old["stage_history"] == 9
        # a second prune has nothing left to delete
        assert sum(store.prune(timedelta(days=90), keep_samples=3, keep_runs=4).deleted.values()) == 0
        # nothing younger than the cut-off goes, however many that is
        for i in range(2, 6):
            _stage(store, f"a-new-{i}", "a", at=NOW - timedelta(days=1, hours=i))
        store.prune(timedelta(days=90), keep_samples=3, keep_runs=3)
        assert {s.stage_run_id for s in store.samples_for(co_runner=None, gpus=1, signature="a")} == {
            f"a-new-{i}" for i in range(6)}
        assert {f"a-new-{i}" for i in range(6)} <= _runs(store, StageHistory) & _runs(store, PredictionRecord)
        # every configuration is still there
        assert {(s.signature, s.gpus, s.co_runner) for s in store.samples_for()} == {
            ("a", 1, None), ("a", 2, None), ("b", 1, None), ("a", 1, "b")}


def test_a_dry_run_deletes_nothing_and_counts_what_a_prune_deletes(url):
    with Store.open(url) as store:
        _fill(store)
        before = {m: _ids(store, m) for m in TABLES}
        dry = store.prune(timedelta(days=90), keep_samples=3, keep_runs=3, dry_run=True)
        assert dry.dry_run and sum(dry.deleted.values()) > 0
        assert {m: _ids(store, m) for m in TABLES} == before
        real = store.prune(timedelta(days=90), keep_samples=3, keep_runs=3)
        assert real.deleted == dry.deleted and real.kept_old == dry.kept_old
        after = {m: _ids(store, m) for m in TABLES}
        assert {m.__tablename__: len(before[m] - after[m]) for m in TABLES if m is not Profile} == real.deleted


def test_a_writer_during_a_prune_loses_no_row(url):
    """A worker's writes (every table) before and while a prune deletes thousands of old rows of the same
    configurations in many small transactions: every row the writer wrote is there afterwards (more of them per
    signature than the prune keeps: only their age keeps them), and the prune did its work."""
    n_old = 3000
    with Store.open(url) as store:
        with store.engine.begin() as conn:  # old stages, bulk (the write path would take minutes)
            conn.execute(sa.insert(Sample.__table__), [
                dict(signature=f"s{i % 5}", gpu_type="v100", placement="consolidated", gpus=1, cross_node=False,
                     step_time_s=0.1, steps=1, source="stage", stage_run_id=f"old-{i}", created_at=OLD + timedelta(seconds=i))
                for i in range(n_old)])
            conn.execute(sa.insert(StageHistory.__table__), [
                dict(stage_run_id=f"old-{i}", stage="x", signature=f"s{i % 5}", state="COMPLETED", gpu_type="v100", gpus=1,
                     placement="consolidated", duration_s=9.0, created_at=OLD + timedelta(seconds=i)) for i in range(n_old)])
            for t in (PredictionRecord.__table__, Outcome.__table__):
                extra = dict(value=1.0, low=1.0, high=1.0, n_samples=0, basis="", context_json="{}") \
                    if t is PredictionRecord.__table__ else dict(actual=1.0)
                conn.execute(sa.insert(t), [dict(stage_run_id=f"old-{i}", signature=f"s{i % 5}", target="duration",
                                                 created_at=OLD + timedelta(seconds=i), **extra) for i in range(n_old)])
    written: dict[str, list[int]] = {"sample": [], "stage_history": [], "prediction": [], "outcome": []}
    during = []
    stop, pruning, errors = threading.Event(), threading.Event(), []

    def writer():
        try:
            with Store.open(url) as w:
                i = 0
                while not stop.is_set():
                    run, sig = f"new-{i}", f"s{i % 5}"
                    written["prediction"].append(w.record_prediction(Prediction(9.0, 8.0, 10.0, 1, "history(n=1)"),
                                                                     signature=sig, target="duration", stage_run_id=run))
                    written["outcome"].append(w.record_outcome(run, 9.0, signature=sig))
                    written["stage_history"].append(w.record_stage(stage_run_id=run, signature=sig, stage="x", gpus=1,
                                                                   duration_s=9.0, gpu_type="v100"))
                    written["sample"].append(w.add_sample(signature=sig, gpus=1, step_time_s=0.1, gpu_type="v100",
                                                          stage_run_id=run))
                    if pruning.is_set():
                        during.append(i)
                    i += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while len(written["sample"]) < 60 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)  # more new rows per signature than keep: the prune ranks them first and keeps them
        with Store.open(url) as store:
            pruning.set()
            rep = store.prune(timedelta(days=90), keep_samples=10, keep_runs=10, batch=50)
            pruning.clear()
            time.sleep(0.1)
            stop.set()
            t.join(60)
            assert not errors, errors
            assert during, "the writer wrote nothing while the prune ran: the test proves nothing"
            for model in (Sample, StageHistory, PredictionRecord, Outcome):
                name = model.__tablename__
                assert set(written[name]) <= _ids(store, model), f"{name}: rows the writer wrote are gone"
            # the old rows went, but for each signature's 10 most recent (the new rows rank first)
            assert rep.deleted["sample"] >= n_old - 50 and rep.deleted["stage_history"] >= n_old - 50
            assert rep.deleted["prediction"] >= n_old - 50 and rep.deleted["outcome"] >= n_old - 50
    finally:
        stop.set()
        t.join(60)


def _answers(store: Store):
    """The predictor's and the worker's estimator's answers for every configuration the store has samples or runs
    of, as bases without their counts ('samples(n=3)' -> 'samples(n)')."""
    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.predict.predictor import Predictor

    strip = lambda p: re.sub(r"n=\d+", "n", p.basis)  # noqa: E731
    samples = store.samples_for()
    p = Predictor.open(store, reference=None)
    out = {}
    for s in samples:
        if s.co_runner is None:
            out[("solo", s.signature, s.gpus, s.gpu_type)] = strip(p.predict_solo_step_time(s.signature, s.gpus,
                                                                                             gpu_type=s.gpu_type))
        else:
            out[("pair", s.signature, s.co_runner, s.gpu_type)] = strip(p.predict_slowdown(s.signature, s.co_runner,
                                                                                          gpu_type=s.gpu_type))
    est = LearnedEstimator.from_store(store, reference=None, persist=False)
    for h in store.stage_history():
        job = Job(f"q-{h.signature}-{h.gpus}", 0.0, QoSSpec(gpus=h.gpus, cpu_cores=1.0), 1.0, model=h.signature)
        out[("duration", h.signature, h.gpus)] = strip(est.predict_duration(job))
    return out, {k for k in p._stats}


def test_the_predictor_after_a_prune_answers_for_every_configuration_it_answered_for(tmp_path):
    url = f"sqlite:///{tmp_path / 'qosflow.db'}"
    with Store.open(url) as store:
        k = 0
        for sig, gpus_list in (("resnet/bs64", (1, 2, 4, 8)), ("bert/bs32", (1, 4)), ("gpt/bs8", (8,)), ("vit/bs16", (1,))):
            for gpus in gpus_list:
                for gt in ("v100", "a100"):
                    for i in range(1 + (k % 7)):  # 1 to 7 old samples (and runs) per configuration
                        _stage(store, f"{sig}-{gpus}-{gt}-{i}", sig, gpus=gpus, gpu_type=gt, step=0.1 * gpus ** -0.7 * (1 + i / 50),
                               at=OLD + timedelta(hours=k, minutes=i))
                    k += 1
        for a, b in (("resnet/bs64", "bert/bs32"), ("bert/bs32", "resnet/bs64"), ("vit/bs16", "resnet/bs64")):
            for i in range(4):
                _stage(store, f"{a}+{b}-{i}", a, co_runner=b, step=0.2, at=OLD + timedelta(minutes=i))
        before, keys_before = _answers(store)
        assert any(v.startswith("samples(") for v in before.values()) and any("history" in v for v in before.values())
        rep = store.prune(timedelta(days=90), keep_samples=3, keep_runs=3)
        assert rep.deleted["sample"] > 0 and rep.deleted["stage_history"] > 0
        after, keys_after = _answers(store)
        assert keys_after == keys_before
        assert after == before


def test_vacuum_shrinks_a_sqlite_file_only_when_asked(tmp_path):
    path = tmp_path / "qosflow.db"
    with Store.open(f"sqlite:///{path}") as store:
        with store.engine.begin() as conn:
            conn.execute(sa.insert(Sample.__table__), [
                dict(signature="s", gpu_type="v100", placement="consolidated", gpus=1, cross_node=False, step_time_s=0.1,
                     steps=1, source="stage", stage_run_id=f"old-{i}" * 4, created_at=OLD) for i in range(20_000)])
        size = lambda: sum(os.path.getsize(p) for p in (path, f"{path}-wal") if os.path.exists(p))  # noqa: E731
        import sqlite3

        c = sqlite3.connect(path)
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.close()
        full = size()
        rep = store.prune(timedelta(days=90), keep_samples=3)
        assert rep.deleted["sample"] == 19_997 and not rep.vacuumed and rep.file_bytes is None
        assert size() >= full * 0.9  # the pages are free, the file keeps its size
        rep = store.prune(timedelta(days=90), keep_samples=3, vacuum=True)
        assert rep.vacuumed and rep.file_bytes[1] < full / 5 and size() < full / 5
        assert store.count(Sample) == 3


def test_keeping_fewer_than_the_predictor_needs_is_refused(tmp_path):
    from qosflow.predict.predictor import MIN_SAMPLES
    from qosflow.store.store import KEEP_MIN

    assert KEEP_MIN == MIN_SAMPLES
    with Store.open(f"sqlite:///{tmp_path / 'qosflow.db'}") as store:
        for kw in ({"keep_samples": 2}, {"keep_runs": 1}, {"keep_samples": 0}):
            with pytest.raises(SpecError, match=next(iter(kw))):
                store.prune(timedelta(days=90), **kw)
        with pytest.raises(SpecError, match="older_than"):
            store.prune(timedelta(minutes=5))


@pytest.mark.parametrize("text, says", [
    ("90x", "is not an age"), ("-5d", "is negative"), ("10min", "too young"), ("0d", "too young"), ("", "is not an age"),
    ("d", "is not an age"), ("90 dayz", "is not an age"), ("1h30", "is not an age"), ("12 months", "is not an age"),
    ("-1d12h", "is negative"), ("99999999999999999999y", "more than 1000 years"), ("9" * 400 + "d", "more than 1000 years"),
])
def test_bad_ages_are_refused_naming_the_option_and_the_form(text, says):
    with pytest.raises(SpecError) as e:
        parse_age(text)
    assert says in str(e.value) and "--older-than" in str(e.value) and "e.g. 90d" in str(e.value)


def test_ages():
    assert parse_age("90d") == timedelta(days=90)
    assert parse_age("12w") == timedelta(weeks=12)
    assert parse_age("1y") == timedelta(days=365)
    assert parse_age("36h") == timedelta(hours=36)
    assert parse_age("90m") == parse_age("90min") == timedelta(minutes=90)
    assert parse_age(" 2.5D ") == timedelta(days=2.5)
    # the forms a @qos_task's deadline takes (one parser): units spelled out, several parts
    assert parse_age("90 days") == parse_age("90d") and parse_age("1d12h") == parse_age("1d, 12 hours") == timedelta(hours=36)
    assert parse_age("2W") == timedelta(weeks=2)


def test_ages_and_qos_durations_are_read_by_one_parser():
    """`parse_age` (--older-than) took 90d, 12w, 1y but not '90 days' or '1d12h'; `to_seconds` (a @qos_task's
    deadline) took '90 days' and '1h30m' but not 12w or 1y. One parser now: every duration either took before
    means the same seconds in both (old forms kept: test_ages, tests/test_prefect_spec.py's duration strings)."""
    from qosflow.core.qos import parse_duration, to_seconds

    for text, seconds in (("90d", 90 * 86400), ("12w", 12 * 7 * 86400), ("1y", 365 * 86400), ("36h", 36 * 3600),
                          ("90m", 5400), ("90min", 5400), ("2.5D", 2.5 * 86400), ("90 days", 90 * 86400),
                          ("1h30m", 5400), ("1.5d", 1.5 * 86400), ("63 mins 4 secs", 3784), ("1h, 30m", 5400),
                          (" 2 Hours ", 7200), ("7200s", 7200), (".5d", 43200)):
        assert parse_duration(text) == to_seconds(text) == parse_age(text).total_seconds() == seconds, text
    for text in ("45", "2x", "h", "500ms", "5 months", "-5m", "1hh", "soon", "", "12 months", "1h30"):
        assert parse_duration(text) is None and to_seconds(text) == text, text


def test_the_cli(tmp_path, capsys):
    from qosflow.cli.main import app, main

    url = f"sqlite:///{tmp_path / 'qosflow.db'}"
    with Store.open(url) as store:
        _fill(store)
        before = {m: _ids(store, m) for m in TABLES}
    for bad in ("90x", "-5d"):
        assert main(["predict", "prune", "--older-than", bad, "--db", url]) == 2
        err = capsys.readouterr().err
        assert "--older-than" in err and "e.g. 90d" in err, err
    assert main(["predict", "prune", "--older-than", "90d", "--keep-samples", "2", "--db", url]) == 2
    assert "--keep-samples" in capsys.readouterr().err
    runner = CliRunner()
    r = runner.invoke(app, ["predict", "prune", "--older-than", "90d", "--db", url, "--dry-run", "--keep-samples", "3",
                            "--keep-runs", "4", "--json", str(tmp_path / "dry.json")], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert "would delete" in r.output and "nothing was deleted" in r.output
    assert json.loads((tmp_path / "dry.json").read_text())["deleted"]["sample"] == 9
    with Store.open(url) as store:
        assert {m: _ids(store, m) for m in TABLES} == before
    r = runner.invoke(app, ["predict", "prune", "--older-than", "90d", "--db", url, "--keep-samples", "3",
                            "--keep-runs", "4", "--vacuum"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert re.search(r"sample\s+18\s+9\s+7\s+9", r.output), r.output  # rows, deleted, old rows kept, left
    assert re.search(r"prediction\s+22\s+10\s+", r.output) and "VACUUM" in r.output
    with Store.open(url) as store:
        assert store.count(Sample) == 9
    r = runner.invoke(app, ["predict", "prune", "--help"])
    assert r.exit_code == 0 and "--older-than" in r.output and "--dry-run" in r.output
    assert main(["predict", "prune", "--older-than", "90d", "--db", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "no qosflow database" in capsys.readouterr().err
