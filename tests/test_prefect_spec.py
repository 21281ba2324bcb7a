"""@qos_task/@qos_flow arguments, tags, blocks, the worker type and the deadline split (no server)."""

from __future__ import annotations

import json
import time

import pytest

from qosflow.errors import SpecError
from qosflow.prefect.dag import StageNode, forecast, split_deadline
from qosflow.prefect.spec import qos_from_tags
from qosflow.prefect.tasks import QoSTask, qos_flow, qos_task


def f(x):
    return x + 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(gpus=-1), "gpus"),
        (dict(gpus=0.5), "gpus"),
        (dict(gpus="two"), "gpus"),
        (dict(gpu_milli=0), "gpu_milli"),
        (dict(gpus=2, gpu_milli=500), "gpu_milli"),
        (dict(gpu_mem_mb=-1), "gpu_mem_mb"),
        (dict(cpu_cores=-2), "cpu_cores"),
        (dict(gpus=0, cpu_cores=0), "cpu_cores"),
        (dict(deadline=0), "deadline"),
        (dict(deadline=float("nan")), "deadline"),
        (dict(deadline=5, expected_duration=10), "deadline"),
        (dict(latency_slo=-1), "latency_slo"),
        (dict(priority="urgent"), "priority"),
        (dict(shareable="yes"), "shareable"),
        (dict(gpus=0, shareable=True), "shareable"),
        (dict(gang=1), "gang"),
        (dict(expected_duration=0), "expected_duration"),
        (dict(expected_duration="long"), "expected_duration"),
        (dict(batch_size=0), "batch_size"),
        (dict(retries=-1), "retries"),
        (dict(retries=1.5), "retries"),
        (dict(retry_delay_seconds=-3), "retry_delay_seconds"),
        (dict(timeout_seconds=0), "timeout_seconds"),
        (dict(timeout_seconds=60, expected_duration=600), "timeout_seconds"),  # no deadline needed to be wrong
        (dict(tags="gpu"), "tags"),
        (dict(tags=["qos:gpus=8"]), "tags"),
        (dict(name=""), "name"),
        (dict(gpu_count=2), "gpu_count"),
        (dict(cpu_cores="4"), "cpu_cores"),
        (dict(gpu_mem_mb="16384"), "gpu_mem_mb"),
        (dict(deadline=True), "deadline"),
        (dict(cpu_cores=True), "cpu_cores"),
        (dict(latency_slo="0.1"), "latency_slo"),
        (dict(retry_delay_seconds="5"), "retry_delay_seconds"),
    ],
)
def test_bad_arguments_fail_at_decoration(kwargs, field):
    with pytest.raises(SpecError) as ei:
        qos_task(**kwargs)  # before the function is even given
    assert ei.value.field == field
    assert field in str(ei.value) and "@qos_task" in str(ei.value)
    with pytest.raises(SpecError):
        qos_task(f, **kwargs)


def test_number_given_as_string_says_how_to_write_it():
    with pytest.raises(SpecError, match=r"invalid cpu_cores: must be a number \(CPU cores\), got '4'; write cpu_cores=4"):
        qos_task(f, cpu_cores="4")


def test_durations_may_be_written_with_units():
    from datetime import timedelta

    t = qos_task(f, deadline="1h30m", latency_slo="250s", expected_duration=timedelta(minutes=10), early_check="30s")
    assert (t.qos.deadline, t.qos.latency_slo, t.expected_duration, t.early_check) == (5400.0, 250.0, 600.0, 30.0)
    assert qos_from_tags(t.tags)[0].deadline == 5400.0  # the tags carry seconds
    assert t.with_options(deadline="2 hours").qos.deadline == 7200.0
    with pytest.raises(SpecError, match=r"invalid deadline: must be a number of seconds after submission or a duration \(.*'2h'"):
        qos_task(f, deadline="in two hours")
    with pytest.raises(SpecError, match=r"got '45'; write deadline=45 \(seconds\) or deadline='45s'"):
        qos_task(f, deadline="45")
    with pytest.raises(SpecError, match="expected_duration"):
        qos_task(f, expected_duration="-5m")
    # a bare number in a string is an error for every duration (docs/prefect.md), not read as seconds
    # for some: expected_duration="45" and early_check="45" were accepted
    for kw in ("expected_duration", "early_check"):
        with pytest.raises(SpecError, match=rf"invalid {kw}: .*got '45'; write {kw}=45 \(seconds\) or {kw}='45s'"):
            qos_task(f, **{kw: "45"})
    import inspect

    line = inspect.currentframe().f_lineno + 3  # the decorator's line is named, as @qos_task's is (it was only "@qos_flow")
    with pytest.raises(SpecError, match=rf"@qos_flow at test_prefect_spec.py:{line}: invalid deadline: .*got '45'; "
                                        r"write deadline=45 \(seconds\) or deadline='45s'"):
        qos_flow(deadline="45")
    with pytest.raises(SpecError, match="invalid deadline: 3600s is shorter than the stage's own expected_duration"):
        qos_task(f, deadline="1h", expected_duration="2h")


@pytest.mark.parametrize("text, seconds", [("90s", 90.0), ("15min", 900.0), ("15 min", 900.0), ("2h", 7200.0), ("1h30m", 5400.0),
                                           ("1.5d", 129600.0), ("3 mins 4 secs", 184.0), ("1h, 30m", 5400.0), (" 2 Hours ", 7200.0)])
def test_duration_strings(text, seconds):
    from qosflow.core.qos import to_seconds

    assert to_seconds(text) == seconds


@pytest.mark.parametrize("text", ["45", "2x", "h", "500ms", "5 months", "-5m", "1hh", "soon", ""])
def test_strings_that_are_not_durations_are_left_for_the_check_to_name(text):
    from qosflow.core.qos import to_seconds

    assert to_seconds(text) == text


def test_error_names_the_function():
    with pytest.raises(SpecError, match="'f'"):
        qos_task(f, gpus=-1)


def test_async_stage_is_rejected():
    async def g():
        return 1

    with pytest.raises(SpecError, match="async"):
        qos_task(g)


def test_qos_travels_in_tags_and_survives_with_options():
    t = qos_task(gpus=2, cpu_cores=4, gpu_mem_mb=8000, deadline=300, priority="guaranteed", shareable=True, expected_duration=60, retries=2, tags=["team-a"])(f)
    assert isinstance(t, QoSTask)
    assert t.retries == 2 and "team-a" in t.tags
    spec, extra = qos_from_tags(t.tags)
    assert spec == t.qos and extra["expected_duration"] == 60
    # Prefect's own with_options returns a plain Task; tags still carry the QoS
    from prefect import Task

    plain = Task.with_options(t, name="x")
    assert qos_from_tags(plain.tags)[0] == t.qos
    # ours keeps the QoSTask and can change QoS
    t2 = t.with_options(name="bigger", gpus=4)
    assert isinstance(t2, QoSTask) and t2.name == "bigger" and t2.qos.gpus == 4 and t2.qos.cpu_cores == 4
    assert t2.retries == 2 and "team-a" in t2.tags
    assert qos_from_tags(t2.tags)[0].gpus == 4
    with pytest.raises(SpecError, match="gpus"):
        t.with_options(gpus=-3)
    # checked as the decorator checks them: a reserved tag was dropped without a word, an unknown
    # argument was Prefect's TypeError naming no stage
    with pytest.raises(SpecError, match=r"tag 'qos:x=1' uses the reserved prefix"):
        t.with_options(tags=["qos:x=1"])
    with pytest.raises(SpecError, match=r"f.with_options: invalid bogus: not a QoS argument nor a @task argument"):
        t.with_options(bogus=1)
    t3 = t.with_options(tags=["team-b"])
    assert "team-b" in t3.tags and "team-a" not in t3.tags and qos_from_tags(t3.tags)[0] == t.qos


def test_a_dispatched_stage_s_timeout_is_enforced_by_its_wait_not_by_prefect(monkeypatch):
    """Prefect's thread-based task timeout cannot stop a stage's process (it ran on, holding its GPU):
    Prefect sees no timeout on a stage that goes to a pool (wait_for_stage enforces it and cancels the
    stage's run), and the declared one on a stage that runs in-process; with_options keeps it."""
    t = qos_task(gpus=1, expected_duration=5, timeout_seconds=30, retries=1)(f)
    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    monkeypatch.delenv("QOSFLOW_PLACEMENT", raising=False)
    assert t.timeout_seconds == 30 and t.stage_timeout_seconds == 30  # in-process: Prefect's own timeout
    monkeypatch.setenv("QOSFLOW_POOL", "gpu")
    assert t.timeout_seconds is None and t.stage_timeout_seconds == 30  # dispatched: the wait's
    t2 = t.with_options(name="other")
    assert t2.stage_timeout_seconds == 30 and t2.timeout_seconds is None
    assert t.with_options(timeout_seconds=40).stage_timeout_seconds == 40
    monkeypatch.setenv("QOSFLOW_PLACEMENT", "{}")  # in a stage's own process a nested stage runs in-process
    assert t.timeout_seconds == 30


def test_local_call_runs_the_function():
    t = qos_task(f, gpus=1, expected_duration=1)
    assert t.fn(1) == 2  # no pool: the stage runs in-process


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(deadline=-1), "deadline"),
        (dict(priority="vip"), "priority"),
        (dict(pool=""), "pool"),
        (dict(plan={"a": ["b"]}), "plan"),
        (dict(plan={"a": ["b"], "b": ["a"]}), "plan"),
        (dict(plan={"a": "b"}), "plan"),
        (dict(colour="red"), "colour"),
    ],
)
def test_bad_flow_arguments(kwargs, field):
    with pytest.raises(SpecError) as ei:
        qos_flow(**kwargs)
    assert ei.value.field == field


def test_deadline_split_along_critical_path():
    nodes = {
        "load": StageNode("load", 10, ()),
        "feat": StageNode("feat", 10, ("load",)),
        "a": StageNode("a", 60, ("feat",)),
        "b": StageNode("b", 20, ("feat",)),
        "eval": StageNode("eval", 20, ("a", "b")),
    }
    d = split_deadline(nodes, 200.0)  # critical path 100 s -> scale 2
    assert d["eval"] == pytest.approx(200)
    assert d["a"] == pytest.approx(160)
    assert d["b"] == pytest.approx(160)  # off the critical path: latest finish before eval
    assert d["feat"] == pytest.approx(40)
    assert d["load"] == pytest.approx(20)
    assert all(d[n] <= 200 for n in d)


def test_forecast_uncertainty_and_risk():
    nodes = {"a": StageNode("a", 10, (), 2.0), "b": StageNode("b", 10, ("a",), 2.0)}
    fc = forecast(nodes, now=100.0, done={}, running={}, deadline=115.0)
    assert fc.finish == pytest.approx(120.0) and fc.spread == pytest.approx(2.0 * 2**0.5)
    assert fc.at_risk and fc.p_meet < 0.5 and fc.remaining_path == ["a", "b"]
    fc2 = forecast(nodes, now=100.0, done={"a": 101.0}, running={}, deadline=115.0)
    assert fc2.finish == pytest.approx(111.0) and not fc2.at_risk


def test_placement_api(monkeypatch):
    import qosflow
    from qosflow.backends.base import placement_env
    from qosflow.core.cluster import ClusterSpec
    from qosflow.core.placement import Placement, SubBatchPlan

    assert qosflow.placement().placed is False
    cl = ClusterSpec.uniform(2, 4, virtual=True)
    p = Placement("j", ((1, 2),), cpu=((1, 3.0),), colocated_with=("k",), gpu_mem_mb=1000, sub_batch=SubBatchPlan.split(64, 4))
    for k, v in placement_env(p, cl, cpuset=[4, 5, 6]).items():
        monkeypatch.setenv(k, v)
    info = qosflow.placement()
    assert info.placed and info.node == "node1" and info.gpus == (2,) and info.virtual_gpus
    assert info.cpuset == (4, 5, 6) and info.threads == 3 and info.shared
    assert info.sub_batch_size(64) == 16 and info.micro_batches(64) == [16] * 4 and info.micro_batches(10) == [3, 3, 2, 2]
    # a batch size that is not a whole number fails alike placed or not (text from a config came back unchanged
    # in a local run and was a TypeError on a shared GPU; 0 became 1 there); numpy ints and 64.0 count
    import numpy as np

    from qosflow.placement_api import PlacementInfo

    for p in (info, PlacementInfo(placed=False)):
        assert p.sub_batch_size(np.int64(64)) == p.sub_batch_size(64.0) == p.sub_batch_size(np.float32(64)) == p.sub_batch_size(64)
        for bad in ("64", 0, -8, 2.5, True):
            with pytest.raises(SpecError, match=r"placement\(\)\.sub_batch_size: invalid global_batch: must be a whole number of samples >= 1"):
                p.sub_batch_size(bad)
        with pytest.raises(SpecError, match=r"got '64' \(int\('64'\) if it comes from a config or the environment\)"):
            p.micro_batches("64")
    assert info.micro_batches(0) == [] and PlacementInfo(placed=False).micro_batches(0) == [0]  # an empty last batch, as before


def test_worker_type_is_discoverable_and_template_has_qos_variables():
    from prefect.workers.base import BaseWorker

    from qosflow.prefect.worker import QosflowWorker

    assert BaseWorker.get_worker_class_from_type("qosflow") is QosflowWorker
    assert "qosflow" in BaseWorker.get_all_available_worker_types()
    t = QosflowWorker.get_default_base_job_template()
    props = t["variables"]["properties"]
    for k in ("gpus", "gpu_milli", "gpu_mem_mb", "cpu_cores", "deadline", "priority", "shareable", "gang", "expected_duration", "early_check_s",
              "cluster_block", "policy_block", "qos_policy"):
        assert k in props and k in t["job_configuration"]
    json.dumps(t)


def test_early_check_arguments_are_validated_where_they_are_given():
    from pydantic import ValidationError

    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.worker import QosflowVariables

    with pytest.raises(ValidationError, match="early_check_s"):
        QosflowVariables(early_check_s=-1)  # a deployment's job variables
    with pytest.raises(ValueError, match="early_check_min_gpus"):
        QoSPolicy(early_check_s=30, early_check_min_gpus=0)
    with pytest.raises(SpecError, match="early_check.*seconds >= 0"):
        qos_task(gpus=2, early_check=-5)
    with pytest.raises(SpecError, match="early_check.*uses no GPU"):
        qos_task(gpus=0, early_check=10)


def test_blocks_validate_and_build_clusters():
    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy, cluster_from_block_data

    c = BareMetalGPUCluster.virtual(2, 4, cpu_cores=16)
    spec = c.to_cluster_spec()
    assert spec.num_gpus == 8 and all(n.virtual for n in spec.nodes) and spec.node_names == ("host0", "host1")
    assert cluster_from_block_data(c.model_dump()).num_gpus == 8
    with pytest.raises(ValueError, match="hosts"):
        BareMetalGPUCluster(hosts=[])
    with pytest.raises(ValueError, match="agent_url"):
        BareMetalGPUCluster(hosts=["a"], backend="agents")
    with pytest.raises(ValueError, match="priority"):
        QoSPolicy(priority="vip")
    with pytest.raises(ValueError, match="deadline_s"):
        QoSPolicy(deadline_s=-5)
    k = KubernetesGPUCluster(node_names=["n1", "n2"], gpus_per_host=8)
    assert k.to_cluster_spec().num_gpus == 16
    assert QoSPolicy(policy="fifo").make_policy().name == "fifo"


def test_a_bare_metal_block_declares_hosts_of_different_gpu_models():
    """Servers bought over the years differ: `host_gpu_models` gives a host's model where it is not
    `gpu_model` (what the policy chooses by); a host it names must be one of `hosts`."""
    from qosflow.prefect.blocks import BareMetalGPUCluster, cluster_from_block_data

    c = BareMetalGPUCluster(hosts=["new-1", "new-2", "old-1"], gpu_model="a100", host_gpu_models={"old-1": "rtx3090"}, virtual_gpus=True)
    assert [n.gpu_model for n in c.to_cluster_spec().nodes] == ["a100", "a100", "rtx3090"]
    assert [n.gpu_model for n in cluster_from_block_data(c.model_dump()).nodes] == ["a100", "a100", "rtx3090"]
    with pytest.raises(ValueError, match=r"host_gpu_models names host\(s\) old-2 that are not in hosts \(new-1, old-1\)"):
        BareMetalGPUCluster(hosts=["new-1", "old-1"], host_gpu_models={"old-2": "k80"})


def test_policy_block_checks_its_policy_and_options_where_they_are_given():
    """A QoS policy block with options of the wrong type used to be saved and only fail in the worker,
    or, for a text "false" (as a form sends it), silently turn a true/false option on."""
    from qosflow.prefect.blocks import QoSPolicy

    with pytest.raises(ValueError, match=r"options: option 'align' of policy 'qosflow' takes true or false, got 'false'"):
        QoSPolicy(policy="qosflow", options={"align": "false"})
    with pytest.raises(ValueError, match=r"options: option 'qos_weight' of policy 'qosflow' takes a number, got 'abc'"):
        QoSPolicy(policy="qosflow", options={"qos_weight": "abc"})
    with pytest.raises(ValueError, match=r"policy 'qosflow' has no option 'qos_wieght'; it has: .*qos_weight"):
        QoSPolicy(policy="qosflow", options={"qos_wieght": 2})
    with pytest.raises(ValueError, match=r"express_share must be in \[0, 1\)"):
        QoSPolicy(policy="qosflow", options={"express_share": 1.5})
    with pytest.raises(ValueError, match=r"unknown policy 'qosflw'"):
        QoSPolicy(policy="qosflw")
    ok = QoSPolicy(policy="qosflow", options={"align": False, "qos_weight": 2, "makespan_beta": None})
    pol = ok.make_policy()
    assert pol.align is False and pol.qos_weight == 2 and pol.makespan_beta is None


def test_policy_options_are_checked_without_making_the_policy_once_per_option(monkeypatch):
    """`option_problem` made the policy (get_policy) to check each option, so a block with n options
    made it n + 1 times; it reads the class alone now, and the block makes it once, with all its options."""
    from qosflow.errors import UnknownNameError
    from qosflow.policies import Decision, Policy, _REGISTRY, option_problem
    from qosflow.prefect.blocks import QoSPolicy

    made = []

    class Counted(Policy):
        name = "counted-test"

        def __init__(self, align: bool = True, weight: float = 1.0, label: str = "x"):
            made.append((align, weight, label))

        def schedule(self, view):
            return Decision()

    monkeypatch.setitem(_REGISTRY, "counted-test", Counted)
    assert option_problem("counted-test", "weight", 2.0) is None
    assert option_problem("counted-test", "align", "false") == "option 'align' of policy 'counted-test' takes true or false, got 'false'"
    assert option_problem("counted-test", "wieght", 2.0) == "policy 'counted-test' has no option 'wieght'; it has: align, label, weight"
    assert made == []
    QoSPolicy(policy="counted-test", options={"align": False, "weight": 2.0, "label": "y"})
    assert made == [(False, 2.0, "y")]
    with pytest.raises(UnknownNameError, match=r"unknown policy 'counted-tst'"):
        option_problem("counted-tst", "weight", 2.0)


def _code_blocks(doc: str) -> list[str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/prefect.md"])
def test_doc_pipeline_examples_define_every_stage_they_call(doc):
    """The pipeline examples are copied verbatim by users: every global name they use must exist."""
    import builtins
    import dis
    import types

    blocks = [b for b in _code_blocks(doc) if "@qos_flow" in b]
    assert blocks, f"{doc} has no @qos_flow example"
    import linecache

    for i, src in enumerate(blocks):
        ns: dict = {"__name__": "doc_example"}
        # the block's own lines under a name of its own: compiled as `doc`, the decorators' inspect.getsource
        # (Prefect's Task keeps the source) read the block's line numbers from the whole document, which failed
        # with a TokenError once the lines there happened to open a bracket they did not close
        name = f"<{doc} example {i + 1}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        exec(compile(src, name, "exec"), ns)
        for obj in list(ns.values()):
            fn = getattr(obj, "fn", None)  # Prefect flows/tasks keep the decorated function here
            fn = getattr(fn, "__wrapped__", fn)
            if not isinstance(fn, types.FunctionType) or fn.__module__ != "doc_example":
                continue
            used = {i.argval for i in dis.get_instructions(fn.__code__) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
            missing = sorted(n for n in used if n not in ns and not hasattr(builtins, n))
            assert not missing, f"{doc}: {fn.__name__} uses undefined {missing}"


@pytest.mark.parametrize("clash", [False, True])
def test_stage_of_a_deployed_entrypoint_runs_in_a_fresh_process(tmp_path, monkeypatch, clash):
    """`prefect deploy` loads `flows/x.py:flow` as the module `x` (or `__prefect_loader_...__` when that
    name is taken) with `flows/` on sys.path; the worker's stage process must still find the stage."""
    import subprocess
    import sys

    from prefect.utilities.importtools import load_script_as_module

    from qosflow.prefect.stage import pack_payload

    flows = tmp_path / "proj" / "flows"
    flows.mkdir(parents=True)
    (flows / "nightly_job_xyz.py").write_text(
        "def _helper(x):\n    return x * 2\n\n\ndef stage(x):\n    return _helper(x) + 1\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_script_as_module adds flows/ to it
    if clash:
        monkeypatch.setitem(sys.modules, "nightly_job_xyz", object())
    mod = load_script_as_module(str(flows / "nightly_job_xyz.py"))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    (tmp_path / "payload.pkl").write_bytes(pack_payload(mod.stage, (20,), {}))
    code = (
        "import pathlib\nfrom qosflow.prefect.stage import unpack_payload\n"
        "fn, a, k = unpack_payload(pathlib.Path('payload.pkl').read_bytes())\nprint(fn(*a, **k))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "41"


def test_planned_stages_are_forecast_with_their_declared_durations():
    """With `plan=`, stages not dispatched yet count with their expected_duration (not 60 s each)."""
    from qosflow.prefect.tasks import PipelineRun

    @qos_task(gpus=0, expected_duration=5)
    def load():
        return 1

    @qos_task(gpus=1, expected_duration=40)
    def fit(x):
        return x

    @qos_flow(deadline=100, plan={"load": [], "fit": ["load"]})
    def pipe():
        stages = (load, fit)  # a pipeline that names its stages (the body is not what is tested)
        return len(stages)

    assert pipe.fn() == 2  # the pipeline function without a flow run (no server)
    run = PipelineRun.finished[-1]
    assert run.expected == {"load": 5.0, "fit": 40.0}
    fc = run.forecast()
    assert fc.finish - run.started == pytest.approx(45.0, abs=2.0)
    split = split_deadline(run._nodes(), 100.0)
    assert split["load"] == pytest.approx(100.0 * 5 / 45) and split["fit"] == pytest.approx(100.0)


def test_worker_help_says_cluster_blocks_may_be_kubernetes(capsys, monkeypatch):
    """docs/prefect.md starts the worker with `--cluster-block k8s-a100`; the help said bare-metal only."""
    from qosflow.cli.main import main

    monkeypatch.setenv("COLUMNS", "120")  # rich truncates option help in narrow terminals

    assert main(["worker", "start", "--help"]) == 0
    out = "".join(c for c in capsys.readouterr().out if not c.isspace() and c not in "│╭╮╰╯─")  # wrapped lines joined
    assert "qosflow-kubernetes-cluster" in out and "QOSFLOW_CLUSTER_FILE" in out


@pytest.mark.parametrize("kwargs, field", [(dict(qos_deadline=-5), "qos_deadline"), (dict(qos_deadline=0), "qos_deadline"),
                                           (dict(qos_deadline=float("nan")), "qos_deadline"), (dict(qos_priority="urgent"), "qos_priority")])
def test_bad_per_run_qos_parameters_fail_before_any_stage(kwargs, field):
    """A deployment's or a call's qos_deadline/qos_priority is checked like the decorator's (a negative
    deadline used to be accepted: every stage past its deadline at once)."""
    calls = []

    @qos_flow(deadline=60)
    def pipe(qos_deadline: float | None = None, qos_priority: str | None = None):
        calls.append(1)

    with pytest.raises(SpecError) as ei:
        pipe.fn(**kwargs)  # the pipeline function without a flow run (no server)
    assert ei.value.field == field and "'pipe', run parameter" in str(ei.value) and not calls
    pipe.fn(qos_deadline=30, qos_priority="critical")
    assert calls == [1]


def test_pipeline_deadlines_may_be_written_with_units(monkeypatch):
    from qosflow.prefect.tasks import PipelineRun

    seen = []
    register = PipelineRun.register
    monkeypatch.setattr(PipelineRun, "register", lambda self: (seen.append(self.deadline), register(self))[1])

    @qos_flow(deadline="2h")
    def pipe(qos_deadline: str | None = None):
        pass

    pipe.fn()
    pipe.fn(qos_deadline="30min")  # a run parameter typed in the UI
    assert seen == [7200.0, 1800.0]
    with pytest.raises(SpecError, match="qos_deadline.*'2h'"):
        pipe.fn(qos_deadline="half an hour")
    with pytest.raises(SpecError, match="invalid deadline"):
        qos_flow(deadline="tomorrow")


@pytest.mark.parametrize("kwargs, field, text", [(dict(round_interval_s=0), "round_interval_s", "greater than 0"),
                                                 (dict(estimator="histroy"), "estimator", "history, learned")])
def test_policy_block_rejects_a_busy_loop_and_unknown_estimators(kwargs, field, text):
    """round_interval_s=0 made the worker's scheduling loop spin; a misspelt estimator only failed in the worker."""
    from pydantic import ValidationError

    from qosflow.prefect.blocks import QoSPolicy

    with pytest.raises(ValidationError) as ei:
        QoSPolicy(**kwargs)
    assert ei.value.errors()[0]["loc"] == (field,) and text in str(ei.value)
    assert QoSPolicy(estimator="learned", round_interval_s=0.5).estimator == "learned"
    assert QoSPolicy(estimator="mypkg.est:Estimator").estimator == "mypkg.est:Estimator"


def test_blocks_name_a_misspelt_field_instead_of_saving_and_ignoring_it():
    from pydantic import ValidationError

    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy

    for cls, kw, hint in [(BareMetalGPUCluster, dict(hosts=["a"], gpus_per_hosts=8), "did you mean 'gpus_per_host'"),
                          (KubernetesGPUCluster, dict(namspace="ml"), "did you mean 'namespace'"),
                          (QoSPolicy, dict(polcy="sjf"), "did you mean 'policy'")]:
        with pytest.raises(ValidationError, match=hint):
            cls(**kw)
    assert BareMetalGPUCluster(hosts=["a"], gpus_per_host=8).to_cluster_spec().nodes[0].gpus == 8


def test_qos_report_of_a_failed_pipeline_does_not_call_it_late():
    import time

    from qosflow.prefect.tasks import PipelineRun

    run = PipelineRun("p", "fid", deadline=3600, priority=None, pool=None, plan=None, expected={})
    run.ended, run.state = time.time() + 30, "failed"
    md = run.report_markdown()
    assert "not met** (the pipeline failed)" in md and "MISSED" not in md
    run.state, run.ended = "completed", run.started + 4000
    assert "**MISSED**" in run.report_markdown()


def test_decorator_error_names_the_file_and_line_of_the_decorator():
    """`@qos_task(gpus=0.5)` fails before the function exists; the error said only '@qos_task' (docs promised the stage)."""
    import inspect

    with pytest.raises(SpecError) as ei:
        line = inspect.currentframe().f_lineno + 1
        qos_task(gpus=0.5)
    assert str(ei.value).startswith(f"@qos_task at test_prefect_spec.py:{line}: invalid gpus:")


def test_placements_missing_at_a_stage_end_are_read_at_the_pipeline_end(monkeypatch):
    """A stage whose placement labels had not reached the server when it completed does not hold up
    the next stage: the pipeline reads them once it has ended, without moving its end time."""
    from qosflow.prefect import tasks
    from qosflow.prefect.tasks import PipelineRun, StageRecord

    run = PipelineRun("p", "fid", deadline=3600, priority=None, pool=None, plan=None, expected={})
    late = StageRecord("train", "tr1", (), 10.0, 5.0, time.time(), None, flow_run_id="fr-late", state="completed", engine_started=100.0)
    late.started, late.ended = 100.0, 110.0
    lost = StageRecord("eval", "tr2", (), 10.0, 5.0, time.time(), None, flow_run_id="fr-lost", state="completed")
    run.add(late)
    run.add(lost)
    reads = {"fr-late": 0, "fr-lost": 0}
    labels = {"qosflow.host": "host1", "qosflow.gpus": "host1:2,host1:3", "qosflow.cpu_cores": "4",
              "qosflow.virtual_gpus": "true", "qosflow.predicted_s": "9.5", "qosflow.placed_at": "99.0", "qosflow.queued_at": "98.0"}

    def read(fid):
        reads[fid] += 1
        return dict(labels) if fid == "fr-late" and reads[fid] >= 2 else None

    monkeypatch.setattr(tasks, "read_placement_labels", read)
    assert run.catch_up_placements(wait_s=0.6) == ["eval"]
    assert late.host == "host1" and late.gpus == ["host1:2", "host1:3"] and late.cpu_cores == 4.0
    assert late.placed == 99.0 and late.queued == 98.0 and late.started == 99.0 and late.virtual_gpus is True
    assert reads["fr-late"] == 2 and reads["fr-lost"] >= 2 and lost.host is None


def test_forecast_artifact_is_not_rewritten_for_every_stage_event(monkeypatch):
    """A stage's end and the next stage's dispatch publish the forecast within a second: one artifact
    version for both (each write contends for the Prefect server's SQLite lock); the final one always."""
    from qosflow.prefect import tasks
    from qosflow.prefect.tasks import PipelineRun

    written = []
    monkeypatch.setattr(tasks, "_artifact", lambda run, kind, key, data, description: written.append(data))
    run = PipelineRun("p", "fid", deadline=3600, priority=None, pool=None, plan={"a": [], "b": ["a"]}, expected={"a": 5.0, "b": 5.0})
    run.publish_forecast()
    run.publish_forecast()
    assert len(written) == 1
    run._forecast_written_at -= 5.0  # as if the last version were 5 s old
    run.publish_forecast()
    assert len(written) == 2
    run.ended = time.time()
    run.publish_forecast(final=True)
    assert len(written) == 3 and "Finished after" in written[-1]


def test_a_stage_running_past_the_pipeline_deadline_flags_it_at_risk_while_it_runs(monkeypatch):
    """The pipeline's at-risk event was computed only at a stage's dispatch and end, so a stage that
    ran past the deadline raised it with `violated`, at its end. `check_at_risk` (called every 2 s
    while a stage is waited for) raises it once, and writes no artifact version before that."""
    from qosflow.prefect import tasks
    from qosflow.prefect.tasks import PipelineRun, StageRecord

    written, events = [], []
    monkeypatch.setattr(tasks, "_artifact", lambda run, kind, key, data, description: written.append(data))
    monkeypatch.setattr(tasks, "_emit", lambda name, run, payload: events.append(name))
    run = PipelineRun("p", "fid", deadline=8, priority=None, pool=None, plan=None, expected={})
    rec = StageRecord("slow", "tr1", (), 3.0, 1.5, time.time(), run.deadline_at, state="running")
    rec.started = run.started
    run.add(rec)
    run.check_at_risk()
    assert events == [] and written == []  # 3 s expected of an 8 s deadline: on time
    run.started -= 10.0  # as if the pipeline had run for 10 s, the stage still running
    run.deadline_at -= 10.0
    rec.started -= 10.0
    run.check_at_risk()
    run.check_at_risk()
    assert events == ["qosflow.qos.at-risk"] and len(written) == 1 and "AT RISK" in written[0]


def test_a_pipelines_policy_block_says_which_of_its_fields_it_applies(monkeypatch, caplog):
    """The `nightly` block says `estimator: history`, but its stages ran with the worker's `learned`
    without a word: a deployment's `qos_policy` gives a run its deadline and class only."""
    import json
    import logging

    seen = []
    from qosflow.prefect.tasks import PipelineRun

    register = PipelineRun.register
    monkeypatch.setattr(PipelineRun, "register", lambda self: (seen.append((self.deadline, self.priority)), register(self))[1])
    monkeypatch.setenv("QOSFLOW_QOS_POLICY", json.dumps({"policy": "qosflow", "estimator": "history", "options": {},
                                                         "priority": "guaranteed", "deadline_s": 3600}))

    @qos_flow()
    def pipe():
        pass

    with caplog.at_level(logging.INFO, logger="qosflow"):
        pipe.fn()
    said = [r.getMessage() for r in caplog.records if "QoS policy block" in r.getMessage()]
    assert seen and seen[0][0] == 3600.0 and getattr(seen[0][1], "value", seen[0][1]) == "guaranteed"
    assert len(said) == 1 and "deadline 3600s and class guaranteed" in said[0], said
    assert "its estimator, policy are the worker's settings" in said[0] and "POOL-policy" in said[0], said
    caplog.clear()
    monkeypatch.setenv("QOSFLOW_QOS_POLICY", json.dumps({"deadline_s": 60}))
    with caplog.at_level(logging.INFO, logger="qosflow"):
        pipe.fn()
    said = [r.getMessage() for r in caplog.records if "QoS policy block" in r.getMessage()]
    assert said == ["QoS policy block: this run's deadline 60s and class default"], said
    # what `prefect deploy` passes: the whole block, the worker's settings at their defaults (they were all named)
    from qosflow.prefect.blocks import QoSPolicy

    caplog.clear()
    monkeypatch.setenv("QOSFLOW_QOS_POLICY", json.dumps(QoSPolicy(deadline_s=60).model_dump(mode="json")))
    with caplog.at_level(logging.INFO, logger="qosflow"):
        pipe.fn()
    said = [r.getMessage() for r in caplog.records if "QoS policy block" in r.getMessage()]
    assert said == ["QoS policy block: this run's deadline 60s and class normal"], said


def test_a_bad_priority_says_what_an_integer_priority_means():
    """The message offered "or an integer" without saying which way integers go, so `priority=10` meant as
    "low" (lower is more important in many schedulers) silently became critical."""
    with pytest.raises(SpecError, match=r"'urgent' is not a priority class; .* or an integer \(as in traces, larger is "
                                        r"more important: 2 or more critical, 1 guaranteed, 0 normal, below 0 best-effort\)"):
        qos_task(priority="urgent")


def test_a_pipeline_forecast_counts_the_time_its_stages_take_to_start():
    """The forecast put a waiting stage's start at its dependencies' end, but a stage starts seconds
    later (its flow run is created, a worker picks it up, it waits in the QoS queue): with short stages
    the forecast was far too early. It now adds the median start gap measured on the run so far."""
    from qosflow.prefect.tasks import PipelineRun, StageRecord

    run = PipelineRun("p", "fid", deadline=100, priority=None, pool=None,
                      plan={"a": [], "b": ["a"], "c": ["b"]}, expected={"a": 10.0, "b": 10.0, "c": 10.0})
    t0 = run.started
    fc = run.forecast()
    assert fc.overhead == 0.0 and fc.finish == pytest.approx(t0 + 30.0, abs=0.5)  # nothing measured yet
    a = StageRecord("a", "tr-a", (), 10.0, 0.0, t0, state="completed")
    a.started, a.ended = t0 + 3.0, t0 + 13.0  # started 3 s after the pipeline did
    run.add(a)
    b = StageRecord("b", "tr-b", ("a",), 10.0, 0.0, t0 + 13.5, state="running")
    b.started = t0 + 18.0  # 5 s after a ended
    run.add(b)
    fc = run.forecast()
    assert fc.overhead == pytest.approx(4.0)  # the median of 3 and 5
    # b ends at 28; c starts 4 s later and runs 10 s
    assert fc.finish == pytest.approx(max(time.time(), t0 + 28.0) + 4.0 + 10.0, abs=0.2)
    assert fc.remaining_path == ["b", "c"]
    # a stage whose dependency has not ended is not measured
    assert run.start_overhead() == pytest.approx(4.0)


def test_a_late_pipeline_sends_one_violation_and_each_late_stage_one(monkeypatch):
    """A late stage was reported twice (by the worker that ran it and again by its pipeline at the end),
    so the example automation sent ~13 notifications for one late pipeline (user review). The pipeline
    now sends one event, scope 'pipeline', listing its late stages; the stage's own comes from the worker,
    scope 'stage'. The example automation matches the pipeline's only, and is a valid Prefect automation."""
    import uuid

    import prefect.events
    import yaml
    from prefect.events.schemas.automations import AutomationCore

    from qosflow.prefect.tasks import PipelineRun, StageRecord

    sent: list[dict] = []
    monkeypatch.setattr(prefect.events, "emit_event", lambda **kw: sent.append(kw))
    monkeypatch.setattr(PipelineRun, "catch_up_placements", lambda self, wait_s=10.0: [])
    monkeypatch.setattr(PipelineRun, "_remember_plan", lambda self: None)
    from qosflow.prefect import tasks

    monkeypatch.setattr(tasks, "_artifact", lambda *a, **kw: None)  # (no server here)
    run = PipelineRun("p", "fid", deadline=10, priority=None, pool="gpu", plan=None, expected={})
    for name, late in (("a", True), ("b", True), ("c", False)):
        rec = StageRecord(name, f"tr-{name}", (), 1.0, 0.5, run.started, run.started + 5, flow_run_id=str(uuid.uuid4()), state="completed")
        rec.ended = run.started + (8 if late else 2)
        run.add(rec)
    run.deadline_at = run.started - 1  # the pipeline ended late
    run.finish(ok=True)
    violated = [e for e in sent if e["event"] == "qosflow.qos.violated"]
    assert len(violated) == 1
    assert violated[0]["resource"]["qosflow.scope"] == "pipeline" and violated[0]["payload"]["late_stages"] == ["a", "b"]

    spec = yaml.safe_load(open("deployments/automation-violation.yaml"))
    spec["actions"][0]["block_document_id"] = str(uuid.uuid4())
    auto = AutomationCore.model_validate(spec)
    assert auto.trigger.match.root.get("qosflow.scope") == "pipeline"
    assert "late_stages" in spec["actions"][0]["body"]


def test_the_workers_stage_events_are_labelled_as_a_stages():
    from types import SimpleNamespace

    import prefect.events

    from qosflow.prefect.worker import QosflowWorker

    sent: list[dict] = []
    w = QosflowWorker(work_pool_name="events-test")
    entry = SimpleNamespace(job=SimpleNamespace(pipeline="pipe-run-id"), flow_run_id="fr-1", name="train")
    real = prefect.events.emit_event
    try:
        prefect.events.emit_event = lambda **kw: sent.append(kw)
        w._event("qosflow.qos.violated", entry, {"stage": "train", "pipeline": "pipe-run-id"})
    finally:
        prefect.events.emit_event = real
    [e] = sent
    assert e["resource"]["qosflow.scope"] == "stage" and e["payload"]["pipeline"] == "pipe-run-id"


class _RunParams(__import__("pydantic").BaseModel):
    lr: float = 0.1
    epochs: int = 2


def test_pipeline_parameter_annotated_with_a_pydantic_model_validates():
    # this module uses `from __future__ import annotations`: Prefect resolved the string annotation in the
    # pipeline wrapper's module (qosflow.prefect.tasks), and every run failed "`Pydantic_PipelineModel` is
    # not fully defined; you should define `_RunParams`"
    @qos_flow(name="pydantic-params")
    def pipeline(p: _RunParams, n: int | None = None) -> float:
        return p.lr

    out = pipeline.validate_parameters({"p": {"lr": 0.5}})
    assert isinstance(out["p"], _RunParams) and out["p"].lr == 0.5
    assert pipeline.parameters.properties["p"]  # the deployment's parameter schema still builds
