"""Fairness between users in `qosflow simulate`: --users gives the synthetic jobs users, and the report
shows each user's share of the outcome per policy (table "Per user", JSON "per_user")."""

import json

import pytest

from qosflow.cli.main import main
from qosflow.sim.metrics import jain_index, user_metrics, users_jain


def _user_rows(text: str) -> dict[str, dict[str, list[str]]]:
    """The "Per user" table: policy -> user -> cells (jobs, avg JCT, avg slowdown, deadlines met, GPU-hours)."""
    part = text[text.index("Per user"):]
    rows, policy = {}, None
    for ln in part.splitlines():
        if not ln.startswith("│"):
            continue
        cells = [c.strip() for c in ln.split("│")[1:-1]]
        policy = cells[0] or policy
        rows.setdefault(policy, {})[cells[1]] = cells[2:]
    return rows


def test_users_give_a_per_user_table_and_json(tmp_path, capsys):
    out = tmp_path / "res.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "60", "--cluster", "2x4", "--users", "3", "--policies", "sjf,qosflow",
                 "--seed", "1", "--no-plots", "--parallel", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["workload"]["users"] == 3
    # the users are those load_workload(..., users=3) gives the synthetic jobs
    from qosflow.sim.runner import resolve_workload
    from qosflow.sim.workload import load_workload

    spec = resolve_workload("synthetic", None, "2x4", seed=1, jobs=60)[1]
    wl = load_workload("synthetic", "synthetic", cluster=spec, seed=1, num_jobs=60, users=3)
    want: dict[str, int] = {}
    for j in wl.jobs:
        want[j.user] = want.get(j.user, 0) + 1
    assert sorted(want) == ["user1", "user2", "user3"]
    table = _user_rows(text)
    assert set(table) == {"sjf", "qosflow"}
    for name in ("sjf", "qosflow"):
        pol = data["policies"][name]
        users = pol["per_user"]["users"]
        assert list(users) == ["user1", "user2", "user3"]
        assert {u: v["jobs"] for u, v in users.items()} == want
        assert sum(v["finished"] for v in users.values()) == pol["jobs"] == 60
        assert sum(v["deadline_jobs"] for v in users.values()) == pol["deadline_jobs"]
        assert sum(v["met"] for v in users.values()) == round(pol["dsr"] * pol["deadline_jobs"])
        n = sum(v["finished"] for v in users.values())
        assert sum(v["avg_jct"] * v["finished"] for v in users.values()) / n == pytest.approx(pol["avg_jct"])
        assert sum(v["avg_slowdown"] * v["finished"] for v in users.values()) / n == pytest.approx(pol["avg_slowdown"])
        assert all(v["gpu_hours"] > 0 for v in users.values())
        jain = pol["per_user"]["jain_slowdown"]
        assert jain == pytest.approx(jain_index([v["avg_slowdown"] for v in users.values()]))
        assert 1 / 3 <= jain <= 1
        # the table: a row per user with the JSON's figures, and Jain's index
        rows = table[name]
        assert list(rows) == ["user1", "user2", "user3", "Jain"]
        for u, v in users.items():
            jobs, _jct, slow, met, gpu_h = rows[u]
            assert jobs == str(v["finished"]) and slow == f"{v['avg_slowdown']:.2f}"
            assert met.startswith(f"{v['met']}/{v['deadline_jobs']} (") if v["deadline_jobs"] else met == "-"
            assert gpu_h.startswith(f"{v['gpu_hours']:,.1f} (")
        assert rows["Jain"][2] == f"{jain:.3f}"


def test_one_user_or_none_gives_no_per_user_table(tmp_path, capsys):
    """Without users (every trace) or with a single one, there is nothing to compare between users."""
    for extra in ([], ["--users", "1"]):
        out = tmp_path / "res.json"
        assert main(["simulate", "--trace", "synthetic", "--jobs", "30", "--cluster", "1x4", "--policies", "qosflow",
                     "--no-plots", "--parallel", "1", "--json", str(out), *extra]) == 0
        text = capsys.readouterr().out
        assert "Per user" not in text and "Jain" not in text
        assert "per_user" not in json.loads(out.read_text())["policies"]["qosflow"]


def test_user_shares_are_given_as_a_list(tmp_path):
    out = tmp_path / "res.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "40", "--cluster", "1x8", "--users", "0.5,0.5", "--policies", "fifo",
                 "--no-plots", "--parallel", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["workload"]["users"] == [0.5, 0.5]
    assert list(data["policies"]["fifo"]["per_user"]["users"]) == ["user1", "user2"]


@pytest.mark.parametrize("given, said", [("0", "at least 1 user"), ("a,b", "shares of the jobs"), ("0.5,-1", "shares of the jobs"),
                                         ("", "shares of the jobs")])
def test_bad_users_are_a_clear_error(given, said, capsys):
    assert main(["simulate", "--trace", "synthetic", "--jobs", "10", "--users", given, "--policies", "fifo", "--no-plots"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--users" in err and said in err, err


def test_users_with_a_trace_file_is_a_clear_error(tmp_path, capsys):
    from tiny_inputs import MURI_ONE_JOB

    trace = tmp_path / "t.csv"
    trace.write_text(MURI_ONE_JOB)
    assert main(["simulate", "--trace", str(trace), "--users", "3", "--policies", "fifo", "--no-plots"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--users" in err and "only the synthetic workload" in err, err


def test_jain_index_by_hand():
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)  # one user bears it all
    assert jain_index([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)  # (1+2+3)^2 / (3 x (1+4+9))
    assert jain_index([1.0, 3.0]) == pytest.approx(0.8)  # 16 / (2 x 10)
    assert jain_index([]) == 1.0 and jain_index([0.0, 0.0]) == 1.0


def test_user_metrics_of_a_hand_made_run():
    """Two users, one job with none: their slowdowns 1.5 and (1 + 3) / 2 = 2 and 1, Jain over the three."""
    from qosflow.core import Job, QoSSpec
    from qosflow.core.job import JobState, JobStatus

    def done(jid, user, submit, dur, finish, gpus=1, deadline=None):
        js = JobState(job=Job(jid, submit, QoSSpec(gpus=gpus, deadline=deadline), dur, user=user))
        js.status, js.finish_time, js.gpu_attained = JobStatus.DONE, finish, gpus * (finish - submit)
        return js

    jobs = [done("a1", "ann", 0.0, 100.0, 150.0, gpus=2, deadline=200.0),
            done("b1", "bo", 0.0, 100.0, 100.0), done("b2", "bo", 10.0, 100.0, 310.0, deadline=150.0),
            done("n1", None, 0.0, 50.0, 50.0)]
    rej = JobState(job=Job("r", 0.0, QoSSpec(gpus=1), 10.0, user="cy"))
    rej.status = JobStatus.REJECTED
    per = user_metrics([*jobs, rej])
    assert list(per) == ["(no user)", "ann", "bo"]  # the rejected job's user ran nothing
    assert per["ann"] == {"jobs": 1, "finished": 1, "avg_jct": 150.0, "avg_slowdown": 1.5, "deadline_jobs": 1, "met": 1,
                          "gpu_hours": pytest.approx(300.0 / 3600)}
    assert per["bo"]["avg_jct"] == 200.0 and per["bo"]["avg_slowdown"] == 2.0 and (per["bo"]["deadline_jobs"], per["bo"]["met"]) == (1, 0)
    assert users_jain(per) == pytest.approx(4.5**2 / (3 * (1.0 + 2.25 + 4.0)))


def test_resolved_users_are_those_the_generator_draws():
    """`qosflow simulate --users` resolves its workload with the users (`resolve_workload(users=...)`): job by
    job, the users `load_workload(..., users=...)` draws, and the same jobs as without users, with elastic jobs
    and deadlines too."""
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.runner import resolve_workload
    from qosflow.sim.workload import load_workload

    for cluster in ("2x4", "4x2"):  # (8-GPU jobs fit 2x4; 4x2 rejects some)
        kw = dict(seed=5, jobs=80, min_gpus_share=0.5)
        got, _ = resolve_workload("synthetic", None, cluster, users=[0.7, 0.2, 0.1], **kw)
        drawn = load_workload("synthetic", "synthetic", cluster=load_cluster(cluster), seed=5, num_jobs=80, min_gpus_share=0.5,
                              users=[0.7, 0.2, 0.1])
        plain, _ = resolve_workload("synthetic", None, cluster, **kw)
        assert [(j.job_id, j.user) for j in got.jobs] == [(j.job_id, j.user) for j in drawn.jobs]
        assert {j.user for j in got.jobs} == {"user1", "user2", "user3"} and {j.user for j in plain.jobs} == {None}
        assert [(j.job_id, j.submit_time, j.duration, j.qos, j.model) for j in got.jobs] == \
            [(j.job_id, j.submit_time, j.duration, j.qos, j.model) for j in plain.jobs]
        assert got.info["users"] == [0.7, 0.2, 0.1] and plain.info["users"] is None
