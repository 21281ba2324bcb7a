"""Alibaba v2023 GPU-sharing pods as simulator jobs.

The pod list is parsed and validated by `qosflow.sim.traces.alibaba.load_pods`; this module turns
pods into `Job`s:

* submit = ``creation_time``; duration = ``deletion_time - scheduled_time`` (the time it held its
  resources). A pod without ``scheduled_time`` (pending when the trace ended) or without a positive
  duration is *rejected with its reason*, never dropped. Pods still ``Running`` at the end of the
  trace have the trace end as deletion time: their duration is a lower bound (``meta["censored"]``);
* GPUs: ``num_gpu`` whole GPUs, or a share ``gpu_milli``/1000 of one GPU when ``num_gpu`` is 1 and
  ``gpu_milli`` < 1000; ``num_gpu`` 0 is a CPU-only pod. CPU cores = ``cpu_milli``/1000, host memory
  = ``memory_mib``. ``gpu_spec`` (accepted GPU models, ``|``-separated) becomes ``qos.gpu_model``
  as it is (one model or several, ``A|B``: any node of one of them). Pods never share whole GPUs with another job
  (``shareable=False``): their sharing is the fractional request itself;
* a pod runs on one node: one that no single node (of its GPU model) can hold is rejected with
  that reason, even where a multi-node gang would fit;
* QoS class: ``LS`` (latency-sensitive) and ``Guaranteed`` -> `guaranteed` with a deadline
  (``meta["wants_deadline"] = True``; see `qosflow.sim.deadlines`), ``BE`` -> `best-effort`, no
  deadline, ``Burstable`` -> `normal`, no deadline; anything else -> drawn like a trace without
  classes.
"""

from __future__ import annotations

from pathlib import Path

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.qos import PriorityClass
from qosflow.errors import TraceFormatError
from qosflow.sim.traces._common import Rejected, make_job, make_qos, split_rejected

#: trace QoS class -> (priority, wants a deadline)
QOS_CLASSES: dict[str, tuple[PriorityClass, bool]] = {
    "LS": (PriorityClass.GUARANTEED, True),
    "GUARANTEED": (PriorityClass.GUARANTEED, True),
    "BE": (PriorityClass.BEST_EFFORT, False),
    "BURSTABLE": (PriorityClass.NORMAL, False),
}


def load_alibaba_jobs(path: str | Path, *, cluster: ClusterSpec | None = None) -> tuple[list[Job], list[Rejected]]:
    """Jobs of an Alibaba v2023 pod list, and (pod name, reason) for pods that cannot be simulated
    (no scheduled time or no positive duration) or can never fit `cluster`."""
    from qosflow.sim.traces.alibaba import load_pods  # noqa: PLC0415  (the pod-list parser)

    p = Path(path)
    jobs: list[Job] = []
    rejected: list[Rejected] = []
    for pod in load_pods(p, times=True):  # replayed in time: a list without its times says so
        if pod.scheduled_time is None:
            rejected.append((pod.name, f"never scheduled in the trace (pod_phase {pod.pod_phase or '?'}, no scheduled_time): no running time"))
            continue
        if pod.deletion_time is None:
            rejected.append((pod.name, "no deletion_time: no running time"))
            continue
        if pod.creation_time is None:
            raise TraceFormatError(p, pod.line, "column 'creation_time': a scheduled pod needs its creation time (its submission)")
        duration = pod.deletion_time - pod.scheduled_time
        if duration <= 0:
            rejected.append((pod.name, f"deletion_time {pod.deletion_time:g} is not after scheduled_time {pod.scheduled_time:g}: no running time"))
            continue
        if pod.scheduled_time < pod.creation_time:
            raise TraceFormatError(p, pod.line, f"column 'scheduled_time': {pod.scheduled_time:g} is before creation_time {pod.creation_time:g}")
        klass = pod.qos.strip()
        prio, wants = QOS_CLASSES.get(klass.upper(), (PriorityClass.NORMAL, None))
        if pod.num_gpu == 0:
            gpus, milli = 0, 1000
        elif pod.num_gpu == 1:
            gpus, milli = 1, pod.gpu_milli
        else:
            gpus, milli = pod.num_gpu, 1000
        model = "|".join(pod.gpu_spec) or None
        qos = make_qos(
            p,
            pod.line,
            gpus=gpus,
            gpu_milli=milli,
            cpu_cores=pod.cpu_milli / 1000.0,
            mem_mb=float(pod.memory_mib),
            priority=prio,
            shareable=False,
            gang=True,
            gpu_model=model,
        )
        jobs.append(
            make_job(
                p,
                pod.line,
                job_id=pod.name,
                submit_time=pod.creation_time,
                qos=qos,
                duration=duration,
                model="alibaba-pod",
                meta={
                    "trace": "alibaba",
                    "line": pod.line,
                    "trace_qos": klass,
                    "wants_deadline": wants,
                    "priority_from_trace": wants is not None,
                    "pod_phase": pod.pod_phase,
                    "censored": pod.pod_phase == "Running",
                    "gpu_spec": list(pod.gpu_spec),
                    "queue_in_trace": pod.scheduled_time - pod.creation_time,
                },
            )
        )
    # a pod runs on one node: one that no single node (of its GPU model) can hold would wait for ever
    ok, never = split_rejected(jobs, cluster, single_node=True)
    return ok, rejected + never

