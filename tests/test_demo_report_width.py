"""The demo's closing report (`qosflow.prefect.demo.print_report`) in an 80-column console: every figure whole.

Its columns were all no-wrap, so rich cut them to fit 80 columns (a terminal, and a pipe, whose console is 80 wide):
`23…` for a stage's end time, `m…` for whether its deadline was met."""
import io

from rich.console import Console

from qosflow.prefect.demo import print_report


def _stage(name: str, host: str) -> dict:
    return dict(name=name, host=host, gpus=["host0:0", "host0:1"], cpu_cores=4.0, started=100.0, ended=2345.6,
                predicted_s=2000.2, actual_s=2245.6, deadline_met=True)


REPORT = {"policy": "qosflow", "max_stages_per_gpu": 2, "pipelines": [dict(
    name="retrain-resnet-nightly-2026-11-28", priority="latency-critical", deadline=3600.0, started_at=50.0,
    elapsed_s=2295.6, met=True, state="completed",
    stages=[_stage("prepare-data-from-warehouse", "gpu-server-01.lab.example.org"), _stage("train", "gpu-server-02")])]}


def _printed(width: int) -> str:
    buf = io.StringIO()
    print_report(REPORT, Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


def test_at_80_columns_no_figure_is_cut_and_names_wrap_whole():
    out = _printed(80)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for figure in ("2295.6", "2000.2", "2245.6", "50.0", "3600", "met", "yes", "0,1"):
        assert figure in out, figure
    for header in ("stage", "host", "GPU", "cores", "start", "end", "pred", "act", "QoS", "deadline s", "took s"):
        assert header in out, header


def test_at_120_columns_each_row_is_one_line():
    out = _printed(120)
    assert "prepare-data-from-warehouse   gpu-server-01.lab.example.org" in out
    assert "retrain-resnet-nightly-2026-11-28" in out
