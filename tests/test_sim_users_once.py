"""`qosflow simulate --users`: the synthetic workload's users are drawn once, with its jobs
(`resolve_workload(users=...)`). They were drawn a second time after the workload was resolved (a second
`generate_synthetic` run, whose users were set on the first run's jobs by job id)."""

import json

import pytest

import qosflow.sim.traces.synthetic as synthetic
from qosflow.cli.main import main


@pytest.mark.parametrize("cluster", [["--cluster", "2x4"], []])
def test_simulate_with_users_generates_the_workload_once(cluster, tmp_path, monkeypatch):
    calls = []
    real = synthetic.generate_synthetic

    def counted(*args, **kw):
        calls.append(kw.get("users"))
        return real(*args, **kw)

    monkeypatch.setattr(synthetic, "generate_synthetic", counted)
    out = tmp_path / "res.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "40", *cluster, "--users", "0.5,0.5", "--policies", "fifo",
                 "--no-plots", "--parallel", "1", "--json", str(out)]) == 0
    assert calls == [[0.5, 0.5]]  # (without --cluster too: the synthetic workload's cluster is the default 8x8)
    data = json.loads(out.read_text())
    assert data["workload"]["users"] == [0.5, 0.5]
    assert list(data["policies"]["fifo"]["per_user"]["users"]) == ["user1", "user2"]


def test_users_with_a_trace_file_are_an_error_in_resolve_workload(tmp_path):
    """A Python caller passing users with a trace hears why, as `qosflow simulate --users` says it."""
    from tiny_inputs import MURI_ONE_JOB

    from qosflow.errors import SpecError
    from qosflow.sim.runner import resolve_workload

    trace = tmp_path / "t.csv"
    trace.write_text(MURI_ONE_JOB)
    with pytest.raises(SpecError, match="only the synthetic workload"):
        resolve_workload(str(trace), None, "2x4", users=3)
