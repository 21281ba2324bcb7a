"""Stages as Kubernetes Jobs, through the official `kubernetes` Python client.

One `batch/v1` Job per stage:

* pinned to the node(s) the qosflow scheduler chose (required node affinity on
  `kubernetes.io/hostname`); a gang over several nodes whose placement is the same on each but for the node (the
  same GPUs, cores and cpuset) is ONE Indexed Job (completions = parallelism = nodes, one pod per node through
  hostname anti-affinity), so the job controller creates every pod of the gang in the same step; any other gang
  becomes one Job per node, created back to back, each pod's QOSFLOW_PLACEMENT its own node's. With `gang_scheduler="volcano"` a `scheduling.volcano.sh/v1beta1`
  PodGroup (minMember = all pods) is created first and the pods use `schedulerName: volcano`;
  `"kai"` does the same with KAI's `scheduling.run.ai/v2alpha2` PodGroup and queue label.
* `nvidia.com/gpu` limits for whole GPUs; CPU requests equal to the cores the placement allocated
  (no CPU limit: CFS quotas throttle data loaders); memory requests when the stage declares memory.
* GPU sharing without `CUDA_VISIBLE_DEVICES`: a shared stage (a fractional share or a co-located
  pair) asks for the NVIDIA device plugin's shared resource, `nvidia.com/gpu.shared`, i.e. the
  plugin's **time-slicing** (default) or **MPS** sharing configured with `renameByDefault: true`. The
  device plugin, not qosflow, picks the device, so `CUDA_VISIBLE_DEVICES` is not set; with MPS the
  plugin splits compute and memory evenly among replicas, and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
  from the placement is passed on. See docs/infrastructure.md.
* labels and annotations tie the Job and its pods to the stage and the Prefect flow run
  (`LaunchSpec.labels`, e.g. `prefect.io/flow-run-id`), and carry the placement JSON.
* credentials in the stage's env (`is_secret_env`: PREFECT_API_KEY, PREFECT_API_AUTH_STRING, tokens,
  passwords, URLs with a password) are never plain values in the Job: they go into a Secret per stage
  attempt, created first and then owned by the Job(s), referenced by `secretKeyRef`, and deleted when
  the stage ends (or by the garbage collector with its Job). One that no Job owns (its worker died
  before the Job was created) is deleted after `orphan_secret_grace_s` by `sweep_orphan_secrets`.
* `backoffLimit: 0`: qosflow classifies failures itself (qosflow.failures) and retries an
  infrastructure failure on another node, a user failure per the stage's retries.

The nodes (inventory, the heartbeat's `healthy_nodes`, the worker's `list_nodes`) come from a node watch kept in a
thread (an informer: one LIST, then a WATCH with bookmarks, a LIST again on 410 Gone or a broken stream; a LIST per
call while it is broken; `watch_nodes`). A node deleted ends the waits of the stages with pods there at once (NodeLost).
What the pods that are not qosflow's stages request per node (`foreign_pod_usage`) comes from a pod informer likewise
(`watch_pods`; qosflow.backends.k8s_usage).

Waiting uses list + watch on the stage's pods, re-listing on 410 Gone and retrying 5xx answers. Pod
phases and reasons map to an `ExitStatus`: OOMKilled, Evicted, NodeLost (or the node NotReady for
longer than `node_lost_grace_s`, or deleted), Unschedulable for longer than `unschedulable_timeout_s` -> INFRA;
ImagePullBackOff, InvalidImageName, CreateContainerConfigError, a non-zero exit -> USER (but a missing
Secret that is qosflow's own, the attempt's credentials, -> INFRA: the stage runs again). `kill`
deletes the Job (propagationPolicy Background), its PodGroup and its Secret.

A pod's progress reports (`qosflow.report_progress`) reach the worker through its log: the stage writes
them to a file in the container and, prefixed `qosflow-progress `, to standard error (at most two lines a
second; `QOSFLOW_PROGRESS_ECHO`). `sync_progress` reads rank 0's log (its tail, after a first whole read)
and keeps the new lines in the local file the scheduler reads.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Mapping, NamedTuple, Sequence

from qosflow.backends.base import (Backend, BackendUnreachable, CapacityWant, ClusterUpdate, ExitKind, ExitStatus, LaunchSpec,
                                   NodeListing, ProgressCopies, StageHandle, placement_env)
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.gpu_names import short_gpu_model
from qosflow.errors import QosflowError, SpecError
from qosflow.placement_api import PROGRESS_FILE_ENV
from qosflow.progress import ECHO_ENV, ECHO_PREFIX

log = logging.getLogger("qosflow.backends.kubernetes")

LABEL_STAGE = "qosflow.dev/stage-id"
LABEL_JOB = "qosflow.dev/job"
ANN_STAGE = "qosflow.dev/stage-id"
ANN_PLACEMENT = "qosflow.dev/placement"
VIRTUAL_LABEL = "qosflow.dev/virtual-gpus"
GPU = "nvidia.com/gpu"
class GangScheduler(NamedTuple):
    """How a gang-capable scheduler is asked for: its schedulerName, the pod annotation naming the
    PodGroup, and the PodGroup's API group and version (for `manifests` and, reading them back, `adopt`)."""

    scheduler_name: str
    group_annotation: str
    group: str
    version: str


GANG_SCHEDULERS = {
    "volcano": GangScheduler("volcano", "scheduling.k8s.io/group-name", "scheduling.volcano.sh", "v1beta1"),
    "kai": GangScheduler("kai-scheduler", "pod-group-name", "scheduling.run.ai", "v2alpha2"),
}
#: kill reasons kept for waits still to report them (the oldest go first)
KILLED_KEPT = 4096
GPU_SHARED = "nvidia.com/gpu.shared"
LABEL_ROLE = "qosflow.dev/role"
#: a pipeline run's pod requests (CPU cores, MiB of memory) unless its job variables give cpu_cores / mem_mb: what
#: a pipeline process that dispatches stages and waits for them uses (Prefect's engine and client: ~200 MiB)
PIPELINE_CPU_CORES = 0.25
PIPELINE_MEM_MB = 512.0
PIPELINE_JOBS_ENV = "QOSFLOW_K8S_PIPELINE_JOBS"
#: capacity requests (scale from zero): placeholder pods, as the cluster-overprovisioner's, that a cluster-autoscaler
#: (or Karpenter) sees Pending and Unschedulable and adds a node for
ROLE_CAPACITY = "capacity-request"
LABEL_CAPACITY_FOR = "qosflow.dev/capacity-for"
LABEL_CLUSTER = "qosflow.dev/cluster"
ANN_CAPACITY_FOR = "qosflow.dev/capacity-for"
#: a placeholder's part of its stage (a gang wider than a node asks for one node-sized part per pod): its index, and
#: (annotation) how many parts the stage's request has
LABEL_CAPACITY_PART = "qosflow.dev/capacity-part"
ANN_CAPACITY_PARTS = "qosflow.dev/capacity-parts"
#: who made a placeholder: the worker's lease holder id (`Backend.capacity_peers`; a backend no worker named: an id
#: of its own), and its pool's key in the lease store. Another worker deletes it only once its maker's presence there
#: is gone (several workers on one pool); one without them (made before 2026-11-27) goes at a worker's first sync; a
#: worker of another pool never deletes it (`KubernetesBackend._capacity_other_pool`)
ANN_CAPACITY_OWNER = "qosflow.dev/capacity-owner"
ANN_CAPACITY_POOL = "qosflow.dev/capacity-pool"
#: the pool that made a stage's Jobs, pods, Secret and PodGroup (and a placeholder): its key in the lease store as a label
#: value (`label_value`), once the worker said it (`capacity_peers`). Two pools whose blocks have the same name (the
#: cluster label alike) in one namespace tell their stages apart by it (`owns`); an object without it (made before
#: 2026-11-28, or before the worker said its pool) is taken as this pool's, as it was
LABEL_POOL = "qosflow.dev/pool"
#: the same pool's key exactly (annotation; since 2026-11-28): two pool keys can make one label value ("gpu team" and
#: "gpu-team" of one Prefect server are both `gpu-team-<hash>`), so the annotation decides when an object carries it, and
#: the label decides only for an object of the release before, which carries the label alone (`same_pool`)
ANN_POOL = "qosflow.dev/pool-key"
CAPACITY_IMAGE = "registry.k8s.io/pause:3.9"
#: the stand-in nodes of a node group scaled to zero (`capacity_node`): planned on, down, until a real node is listed
STANDIN_PREFIX = "scaled-to-zero-"
#: the keys of a declared node shape (`capacity_node`)
CAPACITY_NODE_KEYS = ("gpus", "cpu", "memory", "gpu_product", "gpu_memory_mb", "count")
_in_api_call = threading.local()


class _Poked(Exception):
    """A wait's pod watch was not opened: a node of its pods was deleted meanwhile (it looks again at once)."""


class _QuietRetries(logging.Filter):
    """urllib3 warns "Retrying (Retry(total=2, ...)) after connection broken by ..." at every retry of a
    request: three warnings per call while the API server is unreachable, again at every heartbeat. In
    qosflow's own API calls (this thread is inside `_quiet_retries`) they go to qosflow's debug log instead:
    if the retries run out, the call raises and its caller reports that once, naming the cluster; if one
    succeeds, nothing needs saying. Other warnings, and other code's requests, are left alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_in_api_call, "depth", 0) and record.levelno == logging.WARNING and str(record.msg).startswith("Retrying"):
            log.debug("urllib3: %s", record.getMessage())
            return False
        return True


_QUIET_RETRIES = _QuietRetries()


class _quiet_retries:
    """Within this block (this thread only), urllib3's retry warnings are qosflow debug records."""

    def __enter__(self) -> None:
        pool_log = logging.getLogger("urllib3.connectionpool")
        if _QUIET_RETRIES not in pool_log.filters:
            pool_log.addFilter(_QUIET_RETRIES)
        _in_api_call.depth = getattr(_in_api_call, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _in_api_call.depth -= 1


_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


#: the RBAC manifest that grants the worker's account what the backend asks of the API (deploy/kubernetes/README.md)
RBAC_MANIFEST = "deploy/kubernetes/worker-rbac.yaml"
#: the API server's message for a request RBAC refused (its forbiddenMessage)
_RBAC_REFUSED = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]+)" in API group "(?P<group>[^"]*)" '
                           r'(?:in the namespace "(?P<ns>[^"]+)"|at the cluster scope)')


def rbac_refusal(e: Any) -> str | None:
    """What a 403 of the API server refused and how to fix it, when RBAC refused it (its Status message names the user,
    verb, resource, API group and namespace): "the account U may not create jobs.batch in namespace ml: apply ...".
    None for any other answer, and for a 403 that is not RBAC's (a ResourceQuota, Pod Security, an admission webhook)."""
    if getattr(e, "status", None) != 403:
        return None
    try:
        message = json.loads(e.body or "{}").get("message") or ""
    except (ValueError, TypeError, AttributeError):
        return None
    m = _RBAC_REFUSED.search(message)
    if m is None:
        return None
    resource = f"{m['resource']}.{m['group']}" if m["group"] else m["resource"]
    where = f"in namespace {m['ns']}" if m["ns"] else "at the cluster scope"
    return (f"the account {m['user']} may not {m['verb']} {resource} {where}: apply {RBAC_MANIFEST} (see deploy/kubernetes/README.md) "
            "or grant it that rule")


@functools.cache
def _forbidden_type() -> type:
    from kubernetes.client.exceptions import ApiException

    class KubernetesForbidden(ApiException):
        """A 403 that RBAC gave (still an ApiException: status, reason, body), whose text says what was refused and the
        fix (`refusal`), not the client's "(403) Reason: Forbidden" and headers."""

        def __init__(self, e: Any, message: str, refusal: str):
            super().__init__(status=e.status, reason=e.reason)
            self.body, self.headers, self.message, self.refusal = e.body, e.headers, message, refusal

        def __str__(self) -> str:
            return self.message

    return KubernetesForbidden


def stop_watch(w: Any) -> None:
    """Stop a `kubernetes.watch.Watch` that may be None or already closed (its stream then ends at its next read)."""
    if w is not None:
        with contextlib.suppress(Exception):
            w.stop()


def _placement_on_each_node(raw: str) -> str:
    """QOSFLOW_PLACEMENT (JSON) for the pods of one Indexed Job on several nodes: its "node" is `$(QOSFLOW_NODE)`, which
    the kubelet expands in each pod from the variable of that name defined before it (the downward API's
    spec.nodeName), and every other `$` is escaped (`$$`) so that nothing else is expanded. Unreadable: as it is."""
    try:
        plan = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(plan, dict):
        return raw
    rest = json.dumps({k: v for k, v in plan.items() if k != "node"}, separators=(",", ":")).replace("$", "$$")
    return '{"node":"$(QOSFLOW_NODE)"' + ("," + rest[1:] if rest != "{}" else "}")


def _env_but_node(env: Mapping[str, str]) -> tuple:
    """A stage's environment on one node (`placement_env`) without what names the node (`QOSFLOW_NODE`, the placement's
    "node"): equal for two nodes when one pod template, whose placement names its node through `$(QOSFLOW_NODE)`
    (`_placement_on_each_node`), gives each rank what its own node's placement says (its GPUs, cores, cpuset)."""
    rest = {k: v for k, v in env.items() if k not in ("QOSFLOW_NODE", "QOSFLOW_PLACEMENT")}
    try:
        plan = json.loads(env.get("QOSFLOW_PLACEMENT") or "null")
    except ValueError:
        plan = env.get("QOSFLOW_PLACEMENT")
    if isinstance(plan, dict):
        plan = {k: v for k, v in plan.items() if k != "node"}
    return tuple(sorted(rest.items())), json.dumps(plan, sort_keys=True)


def _pods_unread_cause(exc: BaseException, namespace: str) -> tuple[tuple, str, str]:
    """Why a reading of the pods on the nodes failed: (a key the same for the same cause, whatever the request: not the
    client's text of an ApiException, which carries its response headers, an audit id among them; the cause, said; its
    fix, "" or a sentence). A 403: the account may not list pods, and the RBAC rule that grants it."""
    status = getattr(exc, "status", None)
    if status is not None:
        refusal = getattr(exc, "refusal", None) or rbac_refusal(exc)
        try:
            said = json.loads(getattr(exc, "body", None) or "{}").get("message") or ""
        except (ValueError, TypeError, AttributeError):
            said = ""
        key = ("api", status, getattr(exc, "reason", None), refusal or said)
        cause = f"the API server answered {status} {getattr(exc, 'reason', '') or ''}".rstrip() + (f": {refusal or said}" if refusal or said else "")
        if status == 403:
            return key, cause, (f"Grant the worker's account list and watch on pods, the rule {{apiGroups: [\"\"], resources: [\"pods\"], "
                                f"verbs: [\"list\", \"watch\"]}}: in its Role in namespace {namespace} (the Role qosflow-worker of "
                                f"{RBAC_MANIFEST}), and for the pods of every namespace in a ClusterRole bound to it (qosflow-worker-pods "
                                f"there); apply that file (sed 's/qosflow-stages/{namespace}/g' {RBAC_MANIFEST} | kubectl apply -f -, "
                                "deploy/kubernetes/README.md). ")
        return key, cause, ""
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (type(exc).__name__, getattr(exc, "reason", None) or why), why, ""


def label_value(v: str) -> str:
    """A valid label value (<= 63 chars of [A-Za-z0-9-_.], alphanumeric at both ends)."""
    s = re.sub(r"[^A-Za-z0-9_.-]", "-", str(v))
    if len(s) > 63:
        s = s[:54] + "-" + hashlib.sha1(str(v).encode()).hexdigest()[:8]
    return s.strip("-_.") or "x"


def same_pool(labels: Mapping[str, str] | None, pool: str, annotations: Mapping[str, str] | None = None) -> bool:
    """Whether an object labelled `labels` and annotated `annotations` is of the pool whose key (in the lease store) is
    `pool`: its pool key annotation (`ANN_POOL`, or a placeholder's `ANN_CAPACITY_POOL`) names that key exactly; or, for
    an object without one (made by the release before, which labelled its pool only), its `LABEL_POOL` label is the key's
    label value; one with neither (an older version's), and every one while the pool is not known (`pool` ""), is."""
    if not pool:
        return True
    ann = annotations or {}
    key = ann.get(ANN_POOL) or ann.get(ANN_CAPACITY_POOL)
    if key:
        return key == pool
    theirs = (labels or {}).get(LABEL_POOL)
    return theirs is None or theirs == _pool_label_of(pool)


@functools.lru_cache(maxsize=16)
def _pool_label_of(pool: str) -> str:
    """`label_value(pool)`, once per key (a pod reading asks it for each of 10,000 pods)."""
    return label_value(pool)


def _capacity_pod_fits(pod: Any, body: Mapping) -> bool:
    """Whether placeholder `pod` (a V1Pod, another maker's) asks for what `body` (this backend's manifest of the same
    name) would: one container with the same requests and limits (compared as quantities: the API server may write them
    otherwise, 1Gi for 1024Mi), node selector and priority class."""
    want = body["spec"]
    spec = pod.spec
    if spec is None or len(spec.containers or []) != 1:
        return False
    res = spec.containers[0].resources
    wres = want["containers"][0].get("resources") or {}

    def same(a: Mapping | None, b: Mapping | None) -> bool:
        a, b = a or {}, b or {}
        try:
            return set(a) == set(b) and all(abs(quantity(a[k]) - quantity(b[k])) <= 1e-9 * max(1.0, abs(quantity(b[k]))) for k in a)
        except SpecError:
            return False

    return (same(res.requests if res else None, wres.get("requests")) and same(res.limits if res else None, wres.get("limits"))
            and (spec.node_selector or {}) == (want.get("nodeSelector") or {})
            and (spec.priority_class_name or None) == want.get("priorityClassName"))


def job_name(stage_id: str, suffix: str = "") -> str:
    """A DNS-1123 Job name (<= 63 chars) unique to the stage attempt."""
    slug = re.sub(r"[^a-z0-9-]", "-", stage_id.lower()).strip("-")
    h = hashlib.sha1(stage_id.encode()).hexdigest()[:8]
    return f"qf-{slug[:40].strip('-')}-{h}{suffix}"


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity(q: Any) -> float:
    """A Kubernetes quantity ("500m", "16Gi", 4) in base units."""
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)", str(q).strip())
    if not m or (m.group(2) and m.group(2) not in _SUFFIX):
        raise SpecError("quantity", f"{q!r} is not a Kubernetes quantity")
    return float(m.group(1)) * (_SUFFIX[m.group(2)] if m.group(2) else 1.0)


def _mib(mb: float) -> str:
    """A memory request of `mb` MB, as a stage's pod and its placeholder both ask it (whole MiB, rounded down)."""
    return f"{int(mb)}Mi"


def _cpu(cores: float) -> str:
    return f"{int(round(cores * 1000))}m"


def capacity_node_spec(shape: Any, name: str = STANDIN_PREFIX + "0") -> tuple[NodeSpec, int]:
    """The node a node group adds, declared (the cluster block's `capacity_node`), as a NodeSpec named `name`, and how
    many of it the group may hold at once (`count`, default 1: the stand-ins while it is at zero, `may_become`). Keys: `gpus` (whole GPUs, at
    least 1), `cpu` (cores: 32, "31500m") and `memory` ("240Gi", or MiB as a number), as the node's allocatable;
    optional `gpu_product` (its nvidia.com/gpu.product label, e.g. NVIDIA-A100-SXM4-80GB; the GPU model stages may
    ask for), `gpu_memory_mb` (of each GPU, default 16384, as a node without the label), `count`. A bad one raises
    SpecError naming the key (capacity_node.gpus, ...)."""
    from qosflow.errors import closest_name

    def bad(key: str, msg: str) -> SpecError:
        return SpecError(f"capacity_node.{key}" if key else "capacity_node", msg)

    if not isinstance(shape, dict):
        raise bad("", f"{shape!r}: give the node group's node as a mapping, e.g. {{gpus: 8, cpu: 64, memory: 480Gi}}")
    for k in shape:
        if k not in CAPACITY_NODE_KEYS:
            close = closest_name(str(k), list(CAPACITY_NODE_KEYS))
            raise bad("", f"unknown key {k!r}" + (f"; did you mean {close!r}?" if close else f"; keys: {', '.join(CAPACITY_NODE_KEYS)}"))
    for k in ("gpus", "cpu", "memory"):
        if shape.get(k) in (None, ""):
            raise bad(k, "missing: give the node's allocatable gpus, cpu and memory (kubectl describe node, Allocatable)")

    def number(key: str, v: Any, unit: float = 1.0) -> float:
        if isinstance(v, bool):
            raise bad(key, f"{v!r} is not a number")
        if isinstance(v, (int, float)) or (isinstance(v, str) and re.fullmatch(r"\s*[0-9]+(\.[0-9]*)?\s*", v)):
            x = float(v)  # (a plain number: cores, MiB, GPUs)
        else:
            try:
                x = quantity(v) / unit
            except SpecError:
                raise bad(key, f"{v!r} is not a number or a Kubernetes quantity") from None
        if not math.isfinite(x) or x <= 0:
            raise bad(key, f"{v!r}: give a number > 0")
        return x

    gpus = number("gpus", shape["gpus"])
    if gpus != int(gpus):
        raise bad("gpus", f"{shape['gpus']!r}: give whole GPUs (at least 1)")
    count = number("count", shape.get("count", 1))
    if count != int(count):
        raise bad("count", f"{shape.get('count')!r}: give a whole number of nodes (at least 1)")
    product = shape.get("gpu_product")
    if product is not None and not isinstance(product, str):
        raise bad("gpu_product", f"{product!r}: give the GPU's product name, as its nvidia.com/gpu.product label")
    node = NodeSpec(name=name, gpus=int(gpus), gpu_mem_mb=number("gpu_memory_mb", shape.get("gpu_memory_mb", 16_384)),
                    cpu_cores=number("cpu", shape["cpu"]),
                    mem_mb=number("memory", shape["memory"], 2**20),
                    gpu_model=short_gpu_model(product), labels={"nvidia.com/gpu.product": product} if product else {})
    return node, int(count)


#: Prefect's credential settings (its SecretStr settings), which a Prefect worker passes to the flow
#: runs it starts as environment variables: the API key, the API's basic-auth string, the database's
#: password and connection URL (server settings a worker started next to its server has set)
PREFECT_SECRET_ENV = frozenset({
    "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
    "PREFECT_SERVER_DATABASE_PASSWORD", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_API_DATABASE_PASSWORD", "PREFECT_API_DATABASE_CONNECTION_URL",
})
#: other credentials by name (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ..._PASSWORD): a word of
#: the name, between underscores
_SECRET_NAME = re.compile(r"(?:^|_)(?:API_?KEY|ACCESS_?KEY|SECRET|TOKEN|PASSWORD|PASSWD|AUTH_STRING|CREDENTIALS?|PRIVATE_KEY)(?:_|$)", re.I)
#: a URL carrying a password (postgresql://user:pw@host/db)
_URL_WITH_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def is_secret_env(name: str, value: str) -> bool:
    """Whether an environment variable of a stage is a credential, to be passed through a Secret
    rather than as a plain `value` in the Job (which anyone who may read Jobs reads)."""
    if not value:
        return False
    return name in PREFECT_SECRET_ENV or bool(_SECRET_NAME.search(name)) or bool(_URL_WITH_PASSWORD.match(str(value)))


def _secret_key(env_name: str) -> str:
    """The Secret's data key for an environment variable (its name when that is a valid key)."""
    if _CONFIG_KEY.fullmatch(env_name) and len(env_name) <= 253:
        return env_name
    return "env-" + hashlib.sha1(env_name.encode()).hexdigest()[:16]


def secret_name(stage_id: str) -> str:
    """The name of the Secret holding a stage attempt's credentials."""
    return job_name(stage_id, "-env")


@dataclass
class KubernetesBackend(Backend):
    """Runs each stage as a Job. Pass `api_client` (tests, the emulator) or load a kubeconfig."""

    namespace: str = "default"
    image: str = "python:3.11-slim"
    api_client: Any = None
    kubeconfig: str | None = None
    context: str | None = None
    gpu_sharing: str = "time-slicing"  # "time-slicing" | "mps" | "none"
    #: the extended resource of a whole GPU (a device plugin other than NVIDIA's names its own)
    gpu_resource: str = GPU
    #: the shared (renamed) resource of the device plugin's time-slicing or MPS; default: gpu_resource + ".shared"
    shared_resource: str = ""
    gang_scheduler: str | None = None  # None | "volcano" | "kai"
    kai_queue: str = "default"
    node_selector: dict[str, str] = field(default_factory=dict)
    service_account: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    ttl_after_finished_s: int | None = 3600
    unschedulable_timeout_s: float = 60.0
    node_lost_grace_s: float = 40.0
    #: tolerationSeconds for unreachable/not-ready nodes (Kubernetes' default of 300 s is slow)
    eviction_toleration_s: int = 30
    watch_timeout_s: int = 30
    #: keep the view of the nodes from a watch (an informer: one LIST, then a WATCH from its resourceVersion with
    #: bookmarks, a new LIST on 410 Gone or a broken stream), from which the heartbeat's `healthy_nodes` and the
    #: worker's `list_nodes` are served; while the watch is broken they LIST. False: a LIST at every call (as before
    #: 2026-11-27: at 1,000 nodes, the whole node list every 2 s)
    watch_nodes: bool = True
    #: timeoutSeconds of each node WATCH request (then it is opened again from the last resourceVersion, no LIST)
    node_watch_timeout_s: int = 120
    #: follow the pods that are not qosflow's stages with a watch too (a pod informer, `k8s_usage.PodInformer`): the
    #: heartbeat's `foreign_pod_usage` is its view (no request, no parse, a new pod seen as soon as its event comes);
    #: while it is broken, a LIST at most every POD_READ_S. False: that LIST reading only (as before 2026-11-27)
    watch_pods: bool = True
    #: timeoutSeconds of each pod WATCH request
    pod_watch_timeout_s: int = 120
    api_retries: int = 4
    #: seconds to connect to / read an answer from the API server, per request (watches have their own)
    api_connect_timeout_s: float = 10.0
    api_read_timeout_s: float = 60.0
    cluster_name: str = "kubernetes"
    #: a stage's credentials (`is_secret_env`: PREFECT_API_KEY, ...) go into a Secret per stage attempt,
    #: which the Job's env references (secretKeyRef), not into the Job as plain values. False: plain
    #: values (for an account that may not create Secrets; anyone who may read Jobs reads them)
    credentials_in_secret: bool = True
    #: a stage attempt's Secret that no Job owns and that is older than this is an orphan (its worker died
    #: between creating it and its Job, or a failed launch's clean-up failed): deleted by `sweep_orphan_secrets`
    #: (at `inventory()`, the worker's start, and every `orphan_sweep_s` at its heartbeats). Longer than any
    #: launch takes, so that a Secret whose Job is being created is never taken for one
    orphan_secret_grace_s: float = 600.0
    orphan_sweep_s: float = 600.0
    #: pipeline runs deployed on the pool (role pipeline: the run that dispatches the stages, holding no GPU) run
    #: as Jobs of their own (`launch_unplaced`), which any worker of the pool adopts after a restart or a rollout.
    #: False (or QOSFLOW_K8S_PIPELINE_JOBS=0 in the worker's environment): as processes on the worker's host, as
    #: before 2026-11-27 (for a deployment whose flow code or environment exists only there, not in the image)
    pipelines_as_jobs: bool = True
    #: what a pipeline run's pod requests when its job variables do not say (cpu_cores, mem_mb): no limit
    pipeline_cpu_cores: float = PIPELINE_CPU_CORES
    pipeline_mem_mb: float = PIPELINE_MEM_MB
    #: scale from zero (docs/infrastructure.md, "Scaling from zero"): a stage that has waited `capacity_request_after_s`
    #: in the QoS queue because no node of the worker's plan has room for it gets a placeholder pod (a pause container
    #: with the stage's GPUs, cpu and memory, the block's node selector) that a cluster-autoscaler sees Pending and
    #: Unschedulable and adds a node for; deleted when the stage is placed (before its Job is created) or leaves the
    #: queue. At most `max_capacity_requests` at once; `capacity_priority_class`: their priorityClassName (a low one
    #: lets other pods preempt them). Off by default: without it nothing asks for a node, and on a GPU pool scaled to
    #: zero (or full) the stages wait until a node comes some other way
    request_capacity: bool = False
    capacity_request_after_s: float = 30.0
    max_capacity_requests: int = 4
    capacity_request_image: str = CAPACITY_IMAGE
    capacity_priority_class: str | None = None
    #: the node group's node shape, declared (`capacity_node_spec`: gpus, cpu, memory as the node's allocatable; optional
    #: gpu_product, gpu_memory_mb, count): a worker started while the pool is scaled to zero plans on `count` stand-ins
    #: of it, down, so that stages queue and capacity is requested for them (`request_capacity` on); and a gang wider
    #: than such a node is asked for in parts of its GPUs. None: the nodes listed say it
    capacity_node: dict[str, Any] | None = None
    #: how often (seconds) a worker looks whether the makers of the other placeholders of its cluster are alive (their
    #: presence in the lease store) and deletes those of makers gone: one LIST of the placeholders (made at each
    #: heartbeat anyway while this worker has some) and one read of the lease store when another's are there
    capacity_peer_check_s: float = 10.0

    name = "kubernetes"

    @property
    def shares_gpus(self) -> bool:  # type: ignore[override]
        """Without the device plugin's sharing (sharing "none") a pod asks for whole nvidia.com/gpu
        devices: two stages the policy put on one GPU would get two devices, or one would not fit."""
        return self.gpu_sharing != "none"

    def least_share_milli(self, cluster: Any, node: int | str | None = None) -> int:
        """A shared stage's pod asks for one slice of the device plugin's shared resource (`_gpu_resources`), and
        kube-scheduler counts slices, not parts of a GPU: a pod takes one slice OF THE NODE IT LANDS ON, 1/replicas of a
        GPU there (the node's `REPLICAS_LABEL`, `k8s_usage.slice_milli`, as another pod's slice is booked,
        `k8s_usage.node_shares`). A stage asking for less is booked at least at that; else the plan put more shared
        stages on a node than it has slices free, and the last pod stayed Unschedulable (a 1-GPU node of 4 replicas with
        3 slices taken by other pods: two stages of 100 thousandths placed, one slice free).

        `node` (an index of `cluster.nodes`, or a node's name): that node's slice, the floor of a stage placed there;
        0 when the node does not say its replicas (no label, an unreadable one) or GPUs are not shared. Without it (the
        stage's node not chosen yet): the largest slice of the nodes that say theirs, the one floor under which no node
        of `cluster` over-commits (a node of smaller slices is then booked more than it takes, until the booking is made
        per node, `least_share_milli(cluster, node)`); 0 when none says it or GPUs are not shared."""
        from qosflow.backends.k8s_usage import slice_milli

        if not self.shares_gpus:
            return 0
        nodes = tuple(getattr(cluster, "nodes", ()) or ())
        if node is not None:
            if isinstance(node, str):
                spec = next((n for n in nodes if getattr(n, "name", None) == node), None)
            else:
                spec = nodes[int(node)] if 0 <= int(node) < len(nodes) else None
            if spec is None:
                raise KeyError(f"least_share_milli: no node {node!r} in the cluster (nodes: {', '.join(getattr(n, 'name', '?') for n in nodes)})")
            return slice_milli(getattr(spec, "labels", None)) or 0
        slices = (slice_milli(getattr(n, "labels", None)) for n in nodes)
        return max((m for m in slices if m is not None), default=0)

    def __post_init__(self) -> None:
        import os

        if os.environ.get(PIPELINE_JOBS_ENV, "").strip().lower() in ("0", "false", "no", "off"):
            self.pipelines_as_jobs = False
        if not self.shared_resource:
            self.shared_resource = GPU_SHARED if self.gpu_resource == GPU else f"{self.gpu_resource}.shared"
        if self.gpu_sharing not in ("time-slicing", "mps", "none"):
            raise SpecError("gpu_sharing", f"{self.gpu_sharing!r}: use time-slicing, mps or none")
        if self.gang_scheduler not in (None, "volcano", "kai"):
            raise SpecError("gang_scheduler", f"{self.gang_scheduler!r}: use volcano, kai or nothing")
        if not (math.isfinite(self.capacity_request_after_s) and self.capacity_request_after_s >= 0):
            raise SpecError("capacity_request_after_s", f"{self.capacity_request_after_s!r}: give a number of seconds >= 0")
        if self.max_capacity_requests < 0:
            raise SpecError("max_capacity_requests", f"{self.max_capacity_requests!r}: give a number >= 0")
        if not (math.isfinite(self.capacity_peer_check_s) and self.capacity_peer_check_s >= 0):
            raise SpecError("capacity_peer_check_s", f"{self.capacity_peer_check_s!r}: give a number of seconds >= 0")
        if self.capacity_node is not None:
            capacity_node_spec(self.capacity_node)  # (a bad shape fails here, naming its key)
        from kubernetes import client, config

        if self.api_client is None:
            try:
                config.load_incluster_config()
                self.api_client = client.ApiClient()
            except config.ConfigException:
                try:
                    self.api_client = config.new_client_from_config(config_file=self.kubeconfig, context=self.context)
                except (config.ConfigException, OSError) as exc:
                    raise QosflowError(
                        f"Kubernetes cluster {self.cluster_name!r}: cannot load {self._config_source()}: {str(exc).rstrip('.')}. Give the cluster "
                        "block's kubeconfig (a kubeconfig file) and context, or api_url for a plain API server URL"
                    ) from None
        self.core = client.CoreV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        #: stage id -> why it was killed (for the wait that reports it CANCELLED; a kill may come before
        #: its wait starts). Bounded: a kill whose wait had already ended left its entry for good
        self._killed: OrderedDict[str, str] = OrderedDict()
        self._stop: dict[str, threading.Event] = {}
        self._progress = ProgressCopies("qosflow-k8s-progress-")
        #: stage id -> the (t, step) of the last progress line copied (None: the log not read yet)
        self._progress_seen: dict[str, tuple[float, float] | None] = {}
        self.stats = {"watch_410": 0, "api_5xx_retried": 0, "adopted_409": 0, "wait_api_unreachable": 0,
                      "orphan_secrets_deleted": 0, "orphan_secrets_owned": 0}
        #: Secrets this backend is creating now (their launch has not given them an owner yet): never orphans
        self._launching: set[str] = set()
        self._sweep_task: asyncio.Task | None = None
        self._swept_at = -math.inf
        self._sweep_error: str | None = None
        #: zone (or qosflow.dev/switch label) -> switch number, kept from one listing of the nodes to the next: a node
        #: added in a new zone gets a new number, the others keep theirs (`_node_spec`)
        self._switches: dict[str, int] = {}
        #: why each listed node takes no stage now (not Ready, cordoned), from the last listing (`down_reasons`)
        self._down_why: dict[str, str] = {}
        #: nodes Ready but cordoned in the last listing (`keeps_stages`)
        self._cordoned: set[str] = set()
        #: the node informer (`watch_nodes`): name -> V1Node as the watch last saw it, and whether that view follows
        #: the API now (listed, and its watch open or being opened again from where it was)
        self._node_lock = threading.Lock()
        self._node_view: dict[str, Any] = {}
        self._node_synced = False
        self._node_thread: threading.Thread | None = None
        self._node_stop = threading.Event()
        self._node_watch: Any = None
        self._node_error: str | None = None
        #: nodes seen deleted (a DELETED event, or gone from a listing) -> when (monotonic): their pods will not run
        #: again; forgotten when such a node is back
        self._nodes_gone: dict[str, float] = {}
        #: the node names of the last view or listing (to see which ones a listing no longer has)
        self._nodes_known: set[str] | None = None
        #: waits watching their pods now: stage id -> {"watch", "nodes" (of its pods), "checked" (when it last looked
        #: at its nodes)}; a node deleted stops their watch, so that they look again at once (`_nodes_deleted`)
        self._waiting: dict[str, dict[str, Any]] = {}
        #: the nodes as last described (non-empty), for `update_cluster` while no node is listed
        self._described: list[NodeSpec] = []
        self.stats.update({"node_lists": 0, "node_watches": 0, "node_watch_410": 0, "node_watch_broken": 0, "node_events": 0})
        #: what the worker plans on of each node (`_plan_key`) as last seen (the first listing, then the informer's), None
        #: before; and whom to tell when that changes (`on_nodes_changed`: the worker's reload loop)
        self._plan_keys: dict[str, tuple] | None = None
        self._nodes_changed: Callable[[], None] | None = None
        self.stats["nodes_changed"] = 0
        #: the priority the API server gives this pool's stage pods (they name no priority class: 0, or the value of the
        #: class marked globalDefault), as last seen on one of them (`_evaluate`); None: they may not preempt
        #: (preemptionPolicy Never). Another worker's placeholder is booked as taken unless its priority is lower
        #: (`k8s_usage.preemptible`): a class name alone does not say kube-scheduler will preempt it for a stage
        self._stage_priority: int | None = 0
        self._capacity_priority_said: set[tuple] = set()
        #: the pod informer (`watch_pods`), started at the first `foreign_pod_usage`
        from qosflow.backends.k8s_usage import PodInformer

        self._pod_informer = PodInformer(self)
        #: why the pods on the nodes could not be read at the last reading (`_pods_unread_cause`'s key), None when they were
        self._pods_unread: tuple | None = None
        self.stats["pod_read_failures_said"] = 0
        self.stats.update({"pod_lists": 0, "pod_readings": 0, "pod_watches": 0, "pod_watch_410": 0, "pod_watch_broken": 0, "pod_events": 0})
        #: capacity requests (`request_capacity`): job id -> the names of its placeholder pods (one per part), made by this backend
        self._capacity: dict[str, tuple[str, ...]] = {}
        #: the stand-ins planned on while no node is listed (`capacity_node`), until nodes are
        self._standins: set[str] = set()
        #: stages too wide for max_capacity_requests, said once
        self._capacity_too_wide: set[str] = set()
        #: job ids placed since their placeholder was deleted (a sync that read the queue before cannot make it again)
        self._capacity_placed: set[str] = set()
        #: stages whose way `_clear_way` cleared and whose pods are not all bound yet: job id -> (pods expected, until
        #: when at most, the attempt's stage id or None); no placeholder is made meanwhile (`_capacity_settled`)
        self._capacity_settling: dict[str, tuple[int, float, str | None]] = {}
        #: the first sync has been made (the placeholders of older versions, which name no maker, deleted)
        self._capacity_swept = False
        self._capacity_lock: asyncio.Lock | None = None
        #: who makes this backend's placeholders (`capacity_peers`: the worker's lease holder id; until told, an id of
        #: this backend's own), every id it has made them under, its pool's key, how to learn who is alive (None: not
        #: known, no lease store), and when (monotonic) it last looked (`capacity_peer_check_s`)
        from qosflow.store.leases import holder_id

        self._capacity_owner = holder_id("kubernetes-backend")
        self._capacity_owners = {self._capacity_owner}
        self._capacity_pool = ""
        self._capacity_live: Callable[[str], Collection[str]] | None = None
        self._capacity_peers_at = -math.inf
        self._capacity_live_error: str | None = None
        self.stats.update({"capacity_requested": 0, "capacity_dropped": 0, "capacity_left_deleted": 0, "capacity_adopted": 0,
                           "capacity_conflict_mine": 0, "capacity_conflict_theirs": 0})

    # ------------------------------------------------------------------ API calls with retries
    def _call(self, fn, *args, _doing: str | None = None, **kw):
        """fn(*args, **kw), with 429/5xx answers retried. An API server that cannot be reached (refused,
        reset, timed out after urllib3's retries) raises `BackendUnreachable`, saying what it was
        `_doing` (default: fn's name), for every call of this backend alike."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        # bounded: an API server that accepts no connection (a black-holed address) held a worker
        # thread for minutes per call, and a stopping worker's interpreter waits for its threads
        kw.setdefault("_request_timeout", (self.api_connect_timeout_s, self.api_read_timeout_s))
        with _quiet_retries():
            for i in range(self.api_retries + 1):
                try:
                    return fn(*args, **kw)
                except ApiException as e:
                    if e.status in (429, 500, 502, 503, 504) and i < self.api_retries:
                        self.stats["api_5xx_retried"] += 1
                        time.sleep(0.05 * 2**i)
                        continue
                    refusal = rbac_refusal(e)
                    if refusal is not None and not hasattr(e, "refusal"):  # (RBAC's 403: said with what and how to fix it)
                        doing = _doing or getattr(fn, "__name__", "call it").replace("_namespaced", "").replace("_", " ")
                        raise _forbidden_type()(e, f"Kubernetes cluster {self.cluster_name!r}: the API server at {self._api_host} "
                                                   f"answered 403 Forbidden to {doing}: {refusal}", refusal) from None
                    raise
                except (urllib3.exceptions.HTTPError, OSError) as e:
                    why = getattr(e, "reason", None) or e
                    doing = _doing or getattr(fn, "__name__", "call it").replace("_namespaced", "").replace("_", " ")
                    exc = BackendUnreachable(f"Kubernetes cluster {self.cluster_name!r}: cannot reach the API server at {self._api_host} "
                                             f"to {doing} ({why}). Is the cluster up, and does the cluster block's api_url or "
                                             "kubeconfig/context point at it?")
                    exc.reason = str(why)
                    self._distrust_node_view()
                    self._pod_informer.distrust()
                    raise exc from None

    async def _acall(self, fn, *args, **kw):
        return await asyncio.to_thread(self._call, fn, *args, **kw)

    # ------------------------------------------------------------------ inventory
    def _node_spec(self, n, switches: dict[str, int]) -> NodeSpec:
        labels = n.metadata.labels or {}
        alloc = n.status.allocatable or {}
        if self.gpu_resource in alloc:
            gpus = int(quantity(alloc[self.gpu_resource]))
        else:  # shared (renamed) resource: the physical count is GPU feature discovery's label
            gpus = int(labels.get("nvidia.com/gpu.count", 0)) if self.shared_resource in alloc else 0
        zone = labels.get("qosflow.dev/switch") or labels.get("topology.kubernetes.io/zone") or ""
        sw = switches.setdefault(zone, len(switches))
        return NodeSpec(
            name=n.metadata.name,
            gpus=gpus,
            gpu_mem_mb=float(labels.get("nvidia.com/gpu.memory", 16_384)),
            cpu_cores=max(0.001, quantity(alloc.get("cpu", "1"))),
            mem_mb=max(1.0, quantity(alloc.get("memory", "1Gi")) / 2**20),
            switch=sw,
            gpu_model=short_gpu_model(labels.get("nvidia.com/gpu.product")),
            virtual=labels.get(VIRTUAL_LABEL) == "true",
            labels={k: v for k, v in labels.items() if k.startswith("nvidia.com/gpu") or k.startswith("qosflow.dev/") or k.startswith("topology.")},
        )

    def _selector(self) -> str | None:
        return ",".join(f"{k}={v}" for k, v in self.node_selector.items()) or None

    def _config_source(self) -> str:
        """Where the API client's configuration came from, for error messages."""
        if self.kubeconfig:
            where = f"kubeconfig {self.kubeconfig}"
        else:
            import os

            where = f"kubeconfig {os.environ.get('KUBECONFIG') or '~/.kube/config'} (the default: no kubeconfig given)"
        return where + (f", context {self.context!r}" if self.context else "")

    @property
    def _api_host(self) -> str:
        """The API server's URL, for messages."""
        return getattr(getattr(self.api_client, "configuration", None), "host", "?")

    async def _list_nodes(self) -> list:
        """The nodes; an unreachable API server or refused credentials is an error saying where and what to fix."""
        from kubernetes.client.exceptions import ApiException

        host = self._api_host
        try:
            return (await self._acall(self.core.list_node, label_selector=self._selector(), _doing="list its nodes")).items
        except ApiException as e:
            if e.status in (401, 403):
                fix = ("its credentials were refused: check the kubeconfig's user/token" if e.status == 401 else
                       getattr(e, "refusal", None) or f"its user may not list nodes: apply {RBAC_MANIFEST} (see deploy/kubernetes/README.md)")
                raise QosflowError(f"Kubernetes cluster {self.cluster_name!r}: the API server at {host} answered {e.status} {e.reason} "
                                   f"to listing nodes; {fix}") from None
            raise

    async def inventory(self) -> ClusterSpec:
        nodes = await self._nodes_now()
        if not nodes:
            standins = self._standin_specs()
            if not standins:
                raise QosflowError(self._no_node_message())
            # a GPU pool scaled to zero (at night): the worker plans on stand-ins of the declared node, down (`_healthy`), so
            # that stages queue, wait for capacity and get placeholders; the autoscaler's first node replaces them
            # (`list_nodes`: the worker retires them as it does a deleted node)
            self._described = standins
            log.info("Kubernetes cluster %r: no node matches %s in %s (a node group scaled to zero): planning on %d stand-in%s of "
                     "the declared capacity_node (%d GPU%s, %g cores, %g MiB), down, until the autoscaler adds a node",
                     self.cluster_name, self.node_selector or "any label", self._api_host, len(standins), "" if len(standins) == 1 else "s",
                     standins[0].gpus, "" if standins[0].gpus == 1 else "s", standins[0].cpu_cores, standins[0].mem_mb)
            self._start_sweep()
            return ClusterSpec(tuple(standins), name=self.cluster_name)
        self._start_sweep()  # (at the worker's start: what a worker that died left behind)
        return ClusterSpec(tuple(await asyncio.to_thread(self._node_specs, nodes)), name=self.cluster_name)

    def _no_node_message(self) -> str:
        where = f"no Kubernetes node matches {self.node_selector or 'any label'} in {self._api_host}"
        if self.capacity_node is not None:  # (declared, but request_capacity off: nothing would ever ask for a node)
            fix = ("the cluster block declares capacity_node, but request_capacity is off: turn request_capacity on (the worker then "
                   "plans on the declared node while the pool is at zero and asks the autoscaler for nodes), or scale the node pool "
                   "to at least one node")
        else:
            fix = ("scale the GPU node pool to at least one node (its autoscaler's minimum), or, for a pool an autoscaler scales to "
                   "zero, turn request_capacity on and declare the pool's node in the cluster block's capacity_node (e.g. "
                   "{gpus: 8, cpu: 64, memory: 480Gi}): the worker then starts with the pool at zero; or check node_labels")
        return f"{where}: {fix}"

    def may_become(self) -> ClusterSpec | None:
        """With `request_capacity` and a declared `capacity_node`: `count` nodes of that shape, what the node group may
        hold at once (a stage no node listed now can hold, a gang wider than the nodes left after a scale-down, is
        judged against it before it is refused); else None."""
        if not self.request_capacity or self.capacity_node is None:
            return None
        node, count = capacity_node_spec(self.capacity_node)
        return ClusterSpec(tuple(dataclasses.replace(node, name=f"{STANDIN_PREFIX}{i}") for i in range(count)), name=self.cluster_name)

    def _standin_specs(self) -> list[NodeSpec]:
        """The stand-ins of the declared node (`capacity_node`) to plan on while no node is listed, [] when none is
        declared or `request_capacity` is off."""
        if not self.request_capacity or self.capacity_node is None:
            return []
        node, count = capacity_node_spec(self.capacity_node)
        specs = [dataclasses.replace(node, name=f"{STANDIN_PREFIX}{i}") for i in range(count)]
        self._standins = {n.name for n in specs}
        return specs

    def _node_specs(self, nodes: list) -> list[NodeSpec]:
        """The listed nodes as NodeSpecs, by name (their switch numbers kept from the last listing); the last non-empty
        description is kept (`update_cluster` while every node is deleted)."""
        specs = [self._node_spec(n, self._switches) for n in sorted(nodes, key=lambda n: n.metadata.name)]
        if specs:
            self._described = specs
            self._standins = set()  # (real nodes: the worker retires the stand-ins)
        return specs

    async def healthy_nodes(self) -> set[str]:
        nodes = await self._nodes_now()
        self._start_sweep()  # (every orphan_sweep_s, in the background: the heartbeat does not wait for it)
        self._poke_waits()  # (a wait whose node was deleted and that has not looked yet: told again)
        return self._healthy(nodes)

    async def foreign_pod_usage(self) -> dict:
        """Node name -> what the pods bound there that are not qosflow's stages request (DaemonSets, pipeline-run pods,
        other users' pods), for the worker to book: the pod informer's view while its watch follows the API (`watch_pods`:
        no request), else one LIST of pods at the heartbeat, at most every `k8s_usage.POD_READ_S` (after which the
        informer is started if it is not running)."""
        from qosflow.backends.k8s_usage import read_foreign_usage

        self.stats["pod_readings"] += 1
        if self.watch_pods:
            view = self._pod_informer.usage()
            if view is not None:
                self._pods_read_again()
                return view
        try:
            usage = await asyncio.to_thread(read_foreign_usage, self)
        except Exception as exc:
            self._say_pods_unread(exc)
            raise
        if self.watch_pods:
            self._pod_informer.start()
        self._pods_read_again()
        return usage

    def _say_pods_unread(self, exc: BaseException) -> None:
        """Say at WARNING, once per cause (not at every heartbeat, which reads again), that the pods on the nodes cannot
        be read: what they take is not booked, so stages may be placed into room kube-scheduler gives them. The worker
        logged this at debug only: an account without `list pods` booked nothing of other pods, silently. A 403 names
        the RBAC rule to add (`deploy/kubernetes/worker-rbac.yaml`)."""
        key, cause, fix = _pods_unread_cause(exc, self.namespace)
        if key == self._pods_unread:
            return
        self._pods_unread = key
        self.stats["pod_read_failures_said"] += 1
        log.warning("Kubernetes cluster %r: cannot read the pods bound to its nodes (%s): what other pods take there (DaemonSets, "
                    "other users' pods, pipeline runs, another pool's stages) is not booked in the plan, so a stage may be placed "
                    "into room kube-scheduler gives them (its pod then waits Unschedulable, and the stage fails as INFRA after "
                    "unschedulable_timeout_s). %sThe pods are read again at every heartbeat; this is said again only if the cause "
                    "changes", self.cluster_name, cause, fix)

    def _pods_read_again(self) -> None:
        if self._pods_unread is not None:
            self._pods_unread = None
            log.info("Kubernetes cluster %r: the pods bound to its nodes are read again; what they take is booked", self.cluster_name)

    # ------------------------------------------------------------------ the node informer (`watch_nodes`)
    async def _nodes_now(self) -> list:
        """The nodes as they are now: the informer's view while its watch follows the API (no request), else one
        LIST (whose nodes missing since the last view or listing are taken as deleted), after which the informer
        is started if it is not running."""
        with self._node_lock:
            if self._node_synced:
                return list(self._node_view.values())
        nodes = await self._list_nodes()
        self._saw_listing({n.metadata.name for n in nodes})
        if self._plan_keys is None and self.watch_nodes:  # (the worker's first plan: the watch's first LIST may differ from it)
            keys = {n.metadata.name: self._plan_key(n) for n in nodes}
            with self._node_lock:
                if self._plan_keys is None:
                    self._plan_keys = keys
        self._start_node_watch()
        return nodes

    def _saw_listing(self, names: set[str]) -> None:
        """A full listing of the nodes (a LIST, or the informer's): those of the last one missing from it were deleted."""
        with self._node_lock:
            known, self._nodes_known = self._nodes_known, set(names)
            for name in names:
                self._nodes_gone.pop(name, None)
        if known is not None and known - names:
            self._nodes_deleted(known - names)

    def _nodes_deleted(self, names: Collection[str]) -> None:
        """Nodes deleted (a DELETED event, or gone from a listing): their pods will not run again (the pod garbage
        collector deletes them). The waits of stages with pods there stop their watch and look at once."""
        now = time.monotonic()
        with self._node_lock:
            for name in names:
                self._nodes_gone.setdefault(name, now)
            while len(self._nodes_gone) > KILLED_KEPT:
                self._nodes_gone.pop(next(iter(self._nodes_gone)))
            if self._nodes_known is not None:
                self._nodes_known -= set(names)
        self._poke_waits()

    def _poke_waits(self) -> None:
        """Stop the pod watch of every wait that has a pod on a node deleted since it last looked at its nodes."""
        with self._node_lock:
            gone = dict(self._nodes_gone)
            waits = list(self._waiting.values())
        for w in waits:
            if any(gone.get(n, -math.inf) >= w["checked"] for n in w["nodes"]) and w.get("watch") is not None:
                w["poked"] = True
                stop_watch(w["watch"])

    def _node_gone(self, name: str) -> bool:
        """Whether node `name` is known to be deleted (no API call)."""
        with self._node_lock:
            return name in self._nodes_gone

    def _cached_node(self, name: str) -> Any:
        """The node as the informer sees it, or None (not synced, or not a node of the selector)."""
        with self._node_lock:
            return self._node_view.get(name) if self._node_synced else None

    def _start_node_watch(self) -> None:
        if not self.watch_nodes or self._node_stop.is_set() or (self._node_thread is not None and self._node_thread.is_alive()):
            return
        self._node_thread = threading.Thread(target=self._node_watch_run, name=f"qosflow-k8s-nodes-{self.cluster_name}", daemon=True)
        self._node_thread.start()

    def _node_watch_run(self) -> None:
        with _quiet_retries():
            failures = 0
            while not self._node_stop.is_set():
                try:
                    self._node_watch_once()
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the heartbeat LISTs meanwhile, and says what is wrong
                    failures += 1
                    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    refusal = rbac_refusal(exc)  # (the WATCH refused: the heartbeats LIST the nodes for ever, said once)
                    if why != self._node_error:
                        log.log(logging.WARNING if refusal else logging.DEBUG, "Kubernetes cluster %r: the node watch broke (%s); the nodes "
                                "are listed at each heartbeat until it is open again", self.cluster_name, refusal or why)
                    self._node_error = why
                    self._node_stop.wait(min(5.0, 0.2 * 2 ** min(failures, 5)))
                finally:
                    with self._node_lock:
                        self._node_synced = False

    def _node_watch_once(self) -> None:
        """One LIST, then WATCHes from its resourceVersion (each `node_watch_timeout_s` long, resumed from the last
        version seen, bookmarks included) until a 410 Gone or a broken stream: then back to the caller, to LIST again."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        lst = self._call(self.core.list_node, label_selector=self._selector(), _doing="list its nodes")
        self.stats["node_lists"] += 1
        keys = {n.metadata.name: self._plan_key(n) for n in lst.items}
        with self._node_lock:
            self._node_view = {n.metadata.name: n for n in lst.items}
            self._node_synced = True
            # (against the listing the worker planned on first, or the view before a 410 or a broken watch)
            changed = self._plan_keys is not None and keys != self._plan_keys
            self._plan_keys = keys
        self._saw_listing({n.metadata.name for n in lst.items})
        if changed:
            self._say_nodes_changed()
        if self._node_error is not None:
            log.debug("Kubernetes cluster %r: the node watch follows the nodes again", self.cluster_name)
            self._node_error = None
        rv = lst.metadata.resource_version
        while not self._node_stop.is_set():
            w = self._node_watch = watch.Watch()
            self.stats["node_watches"] += 1
            try:
                for ev in w.stream(self.core.list_node, label_selector=self._selector(), resource_version=rv, allow_watch_bookmarks=True,
                                   timeout_seconds=self.node_watch_timeout_s,
                                   _request_timeout=(self.api_connect_timeout_s, self.node_watch_timeout_s + 30)):
                    if ev["type"] == "BOOKMARK":
                        rv = w.resource_version or rv
                        continue
                    node = ev["object"]
                    name = node.metadata.name
                    rv = node.metadata.resource_version or rv
                    self.stats["node_events"] += 1
                    key = None if ev["type"] == "DELETED" else self._plan_key(node)
                    with self._node_lock:
                        if ev["type"] == "DELETED":
                            self._node_view.pop(name, None)
                        else:
                            self._node_view[name] = node
                            self._nodes_gone.pop(name, None)
                            if self._nodes_known is not None:
                                self._nodes_known.add(name)
                        changed = self._plan_keys is not None and self._plan_keys.get(name) != key
                        if changed:
                            if key is None:
                                del self._plan_keys[name]
                            else:
                                self._plan_keys[name] = key
                    if ev["type"] == "DELETED":
                        self._nodes_deleted([name])
                    if changed:
                        self._say_nodes_changed()
            except ApiException as e:
                if e.status == 410:  # the version is compacted: LIST again
                    self.stats["node_watch_410"] += 1
                    return
                self.stats["node_watch_broken"] += 1
                raise
            except Exception:
                if self._node_stop.is_set():
                    return
                self.stats["node_watch_broken"] += 1
                raise
            finally:
                self._node_watch = None
            if w._stop or not self._node_synced:  # (stopped: `_distrust_node_view`; LIST again)
                return
            rv = w.resource_version or rv

    def _plan_key(self, n) -> tuple:
        """What the worker plans on of node `n`: its description (`_node_spec`: allocatable GPUs, cpu, memory, the GPU and
        topology labels), whether it is Ready and whether it is cordoned. Not its heartbeats (`lastHeartbeatTime`, which
        a kubelet writes every 10-40 s on nodes without leases), images, other labels or annotations: a MODIFIED event
        that changes only those changes nothing the worker follows."""
        try:
            spec = self._node_spec(n, {})
        except (TypeError, ValueError):  # (a label that is no number: the worker's listing fails on it and says so)
            spec = None
        return spec, _ready(n), bool(n.spec and n.spec.unschedulable)

    def on_nodes_changed(self, callback: Callable[[], None] | None) -> bool:
        """The node informer (`watch_nodes`) calls `callback`, in its thread, for each event that adds or deletes a node or
        changes its `_plan_key` (and for a LIST, after a 410 or a broken watch, that finds such a change): the worker
        follows the nodes within a second instead of at its next reading. Without the informer (`watch_nodes` False)
        nothing tells it: the nodes are followed every cluster_reload_s only."""
        self._nodes_changed = callback
        return self.watch_nodes

    def _say_nodes_changed(self) -> None:
        self.stats["nodes_changed"] += 1
        callback = self._nodes_changed
        if callback is not None:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - (a worker's loop closed as it stops): the informer goes on
                log.debug("Kubernetes cluster %r: could not say that its nodes changed: %s", self.cluster_name, exc)

    def _distrust_node_view(self) -> None:
        """A call found the API server unreachable: the node watch's view is not served any more (the heartbeat LISTs,
        and so sees the outage, rather than reading a view whose stream may hang on a dead connection for minutes),
        and its watch is stopped: the informer LISTs again, and serves its view once that LIST succeeds."""
        with self._node_lock:
            self._node_synced = False
        stop_watch(self._node_watch)

    def _stop_node_watch(self) -> None:
        self._node_stop.set()
        stop_watch(self._node_watch)

    def _healthy(self, nodes: list) -> set[str]:
        """The nodes that take stages (Ready, not cordoned); why each other one does not is kept for `down_reasons`
        (a node deleted from the cluster among them)."""
        ok, why, cordoned = set(), {}, set()
        for n in nodes:
            if not _ready(n):
                why[n.metadata.name] = "the node is not Ready"
            elif n.spec and n.spec.unschedulable:
                why[n.metadata.name] = "the node is cordoned (spec.unschedulable)"
                cordoned.add(n.metadata.name)
            else:
                ok.add(n.metadata.name)
        with self._node_lock:
            for name in self._nodes_gone:
                why.setdefault(name, "the node was deleted from the cluster")
        for name in self._standins:
            why.setdefault(name, "a stand-in for the declared capacity_node while the node pool is at zero: no stage is placed "
                                 "there; capacity is requested for the stages that wait")
        self._down_why, self._cordoned = why, cordoned
        return ok

    def down_reasons(self) -> dict[str, str]:
        return dict(self._down_why)

    def keeps_stages(self, node: str) -> bool:
        """A cordoned node (Ready, spec.unschedulable) takes no new pod; those it runs go on."""
        return node in self._cordoned

    # ------------------------------------------------------------------ nodes come and go without an edit of the block
    #: a cluster autoscaler adds GPU nodes, an administrator cordons or deletes one: the worker lists the nodes
    #: again every cluster_reload_s and follows them (`list_nodes`), and as soon as the node watch sees such a change
    #: (`on_nodes_changed`)
    lists_nodes = True

    async def list_nodes(self) -> NodeListing:
        """The nodes that match the selector now (the node watch's view; one list call while it is broken; described
        off the event loop, as 1,000 nodes take a while), those that take stages, and those cordoned."""
        nodes = await self._nodes_now()
        specs = await asyncio.to_thread(self._node_specs, nodes)
        cordoned = {n.metadata.name for n in nodes if n.spec and n.spec.unschedulable}
        return NodeListing(specs, self._healthy(nodes), cordoned)

    # ------------------------------------------------------------------ the cluster block is edited
    #: fields of an edited block taken at once: they are read only when a stage is launched
    UPDATABLE = ("image", "credentials_in_secret", "request_capacity", "capacity_request_after_s", "max_capacity_requests",
                 "capacity_request_image", "capacity_priority_class", "capacity_node", "capacity_peer_check_s")
    #: fields that running stages (their Jobs, pods, Secrets and watches) or the worker's plan depend on
    RESTART_FIELDS = ("namespace", "kubeconfig", "context", "_api_host", "gpu_sharing", "gpu_resource", "shared_resource",
                      "gang_scheduler", "node_selector")

    async def update_cluster(self, new: Backend, busy: Collection[str] = ()) -> ClusterUpdate:
        """Take what `new` (a KubernetesBackend built from the edited cluster block, `Backend.update_cluster`) changes
        that only the next launches read (`UPDATABLE`: the stage image, whether credentials go through a Secret);
        the rest (`RESTART_FIELDS`) is said in `not_applied`. The nodes are the API's now (with the selector this
        backend started with): nodes added to the cluster since are used, nodes gone are retired."""
        if not isinstance(new, KubernetesBackend):
            raise NotImplementedError(f"the cluster is now of another kind ({new.name} backend), and this worker runs its stages "
                                      f"through the {self.name} backend")
        not_applied = []
        for f in self.RESTART_FIELDS:
            mine, theirs = getattr(self, f), getattr(new, f)
            if mine != theirs:
                not_applied.append(f"its {f.lstrip('_').replace('api_host', 'API server')} changed from {mine!r} to {theirs!r}; "
                                   f"the worker keeps {mine!r} until it is restarted")
        applied = []
        for f in self.UPDATABLE:
            if getattr(self, f) != getattr(new, f):
                applied.append(f"{f} {getattr(self, f)!r} -> {getattr(new, f)!r} (for the stages launched from now on)")
                setattr(self, f, getattr(new, f))
        nodes = await self._nodes_now()
        if not nodes:
            # every node deleted (an autoscaler scaled the GPU node pool to zero) or none matching for a moment: the edit is
            # taken all the same (it failed with "no Kubernetes node matches" before); the nodes last described stay planned,
            # down for the heartbeat (the node was deleted), until nodes come back (this is said, and handed over again)
            not_applied.append(f"no node of the cluster matches its node selector now ({self.node_selector or 'any label'}: every "
                               f"node deleted, or scaled to zero?); the worker keeps the nodes it had, down, until nodes come back")
            described = list(self._described)
            if self._standins and {n.name for n in described} == self._standins:  # (stand-ins: of the shape as edited now)
                described = self._standin_specs() or described
            return ClusterUpdate(described, not_applied, applied)
        self._start_sweep()
        specs = await asyncio.to_thread(self._node_specs, nodes)
        return ClusterUpdate(specs, not_applied, applied)

    # ------------------------------------------------------------------ orphaned Secrets
    def _start_sweep(self) -> None:
        """Start `sweep_orphan_secrets` in the background if it has not run for `orphan_sweep_s` seconds."""
        if not self.credentials_in_secret or (self._sweep_task is not None and not self._sweep_task.done()):
            return
        if time.monotonic() - self._swept_at < self.orphan_sweep_s:
            return
        self._swept_at = time.monotonic()
        self._sweep_task = asyncio.get_running_loop().create_task(self._sweep_quietly(), name="qosflow-k8s-orphan-secrets")

    async def _sweep_quietly(self) -> None:
        try:
            await self.sweep_orphan_secrets()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a clean-up: said once per distinct failure, tried again later
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if why != self._sweep_error:
                fix = (f" (the sweep lists, patches and deletes secrets and lists jobs: the worker's account needs list, patch and "
                       f"delete on secrets and list on jobs in namespace {self.namespace}, as the Role of {RBAC_MANIFEST} grants)"
                       if (" 403" in f" {why}" or "(403)" in why) and not hasattr(exc, "refusal") else "")
                log.warning("Kubernetes cluster %r: could not look for orphaned stage Secrets in %s: %s%s; trying again in %gs",
                            self.cluster_name, self.namespace, why, fix, self.orphan_sweep_s)
            self._sweep_error = why
        else:
            self._sweep_error = None

    async def sweep_orphan_secrets(self, *, grace_s: float | None = None, now: float | None = None) -> list[str]:
        """Delete the stage attempts' Secrets that no Job owns, older than `grace_s` (default
        `orphan_secret_grace_s`), in this backend's namespace; return their names.

        A launch creates the Secret, then the Job(s), then makes the Job(s) its owners; a worker that died
        in between (or a failed launch whose clean-up failed too) left a Secret holding the stage's
        credentials (the Prefect API key) for ever: the garbage collector only deletes what has owners.
        Only qosflow's own Secrets are touched: labelled `app.kubernetes.io/managed-by=qosflow`, carrying
        the `qosflow.dev/stage-id` annotation and label of one stage and named `secret_name(stage)` (a
        Secret of someone else's, even with a similar name, is left alone), and this pool's (`owns`: one
        labelled with another pool is that pool's worker's to sweep). One whose stage's Job exists
        (the worker died after creating the Job) gets it as its owner instead: its pods may still need it.
        The delete is conditional on the Secret being as read (uid and resourceVersion preconditions):
        one a launch has just reused or given an owner is not deleted."""
        from kubernetes.client.exceptions import ApiException

        grace = self.orphan_secret_grace_s if grace_s is None else float(grace_s)
        now = time.time() if now is None else now
        doing = "look for orphaned stage Secrets"
        secrets = (await self._acall(self.core.list_namespaced_secret, self.namespace, label_selector=MANAGED_SELECTOR, _doing=doing)).items
        dropped: list[str] = []
        for sec in secrets:
            md = sec.metadata
            stage = (md.annotations or {}).get(ANN_STAGE)
            if (not stage or md.name != secret_name(stage) or (md.labels or {}).get(LABEL_STAGE) != label_value(stage)
                    or md.owner_references or md.name in self._launching or md.deletion_timestamp is not None
                    or not self.owns(md.labels, md.annotations)):
                continue
            created = md.creation_timestamp.timestamp() if md.creation_timestamp is not None else None
            if created is None or now - created < grace:
                continue
            jobs = (await self._acall(self.batch.list_namespaced_job, self.namespace, label_selector=f"{LABEL_STAGE}={label_value(stage)}",
                                      _doing=doing)).items
            jobs = [j for j in jobs if (j.metadata.annotations or {}).get(ANN_STAGE) == stage and j.metadata.deletion_timestamp is None
                    and self.owns(j.metadata.labels, j.metadata.annotations)]
            try:
                if jobs:  # the Job was created, the owner not set: set it (deleted with the Job, as a launch does it)
                    owners = [{"apiVersion": "batch/v1", "kind": "Job", "name": j.metadata.name, "uid": j.metadata.uid} for j in jobs]
                    await self._acall(self.core.patch_namespaced_secret, md.name, self.namespace,
                                      {"metadata": {"ownerReferences": owners, "resourceVersion": md.resource_version}},
                                      _content_type="application/merge-patch+json", _doing=doing)
                    self.stats["orphan_secrets_owned"] += 1
                    log.info("stage %s: its Secret %s had no owner; its Job %s owns it now", stage, md.name, jobs[0].metadata.name)
                    continue
                body = {"apiVersion": "v1", "kind": "DeleteOptions",
                        "preconditions": {"uid": md.uid, "resourceVersion": md.resource_version}}
                await self._acall(self.core.delete_namespaced_secret, md.name, self.namespace, body=body, _doing=doing)
            except ApiException as e:
                if e.status in (404, 409):  # gone already, or changed since it was read (a launch reused it): left
                    continue
                raise
            self.stats["orphan_secrets_deleted"] += 1
            dropped.append(md.name)
            log.warning("stage %s: deleted its credentials Secret %s, which no Job owned (created %s, its worker stopped before the "
                        "stage's Job was created?)", stage, md.name, md.creation_timestamp.isoformat())
        return dropped

    # ------------------------------------------------------------------ capacity requests (scale from zero)
    @property
    def holds_capacity_requests(self) -> bool:  # type: ignore[override]
        return bool(self._capacity)

    def _capacity_selector(self) -> str:
        return f"{LABEL_ROLE}={ROLE_CAPACITY},{LABEL_CLUSTER}={label_value(self.cluster_name)}"

    def capacity_peers(self, holder: str, pool: str, live: Callable[[str], Collection[str]] | None) -> None:
        """The worker's lease holder id (this backend's placeholders are annotated with it), its pool's key, and how to
        learn the live holder ids of a pool (`Backend.capacity_peers`): the makers of the other placeholders of this
        cluster are judged by it (`sync_capacity_requests`). The pool's key also labels what this backend creates from
        then on (`LABEL_POOL`), and decides which stage pods and Jobs are its own (`owns`): the worker says it before
        the first launch, adoption or reading of the pods (`QosflowWorker._ensure_qos`)."""
        if holder and holder != self._capacity_owner:
            self._capacity_owner = holder
            self._capacity_owners.add(holder)
        if pool and pool != self._capacity_pool:
            self._capacity_pool = pool
            # (the pods booked as another's change with it: the readings, LIST or informer, are made again)
            self._pod_usage_last = None
            self._pod_informer.distrust()
        self._capacity_live = live

    def _pool_label(self) -> str:
        """This backend's pool as its objects' `LABEL_POOL` holds it; "" until the worker has said it (`capacity_peers`)."""
        pool = getattr(self, "_capacity_pool", "")  # (the pod informer's first sums are made before it is set, in __post_init__)
        return label_value(pool) if pool else ""

    def _pool_key(self) -> str:
        """This backend's pool's key in the lease store, as its objects' `ANN_POOL` holds it; "" until the worker said it."""
        return getattr(self, "_capacity_pool", "")

    def owns(self, labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None = None) -> bool:
        """Whether a stage's Job, pod or Secret labelled `labels` and annotated `annotations` is this pool's, as far as
        its pool says (`same_pool`: its pool key annotation, else its pool label): another pool's (another pool's worker
        on the same cluster and namespace, with a block of the same name) is not, and is never adopted, swept or deleted
        here. One naming no pool (an older version's), and every one while this backend does not know its pool, is
        taken as this pool's, as before."""
        return same_pool(labels, self._pool_key(), annotations)

    async def _capacity_makers_alive(self, pools: Collection[str]) -> dict[str, set[str]] | None:
        """The live holder ids of each of `pools` (the lease store's presence, `capacity_peers`); None when that cannot be
        known now (no lease store, or it failed: said in the log, once while it lasts)."""
        live = self._capacity_live
        if live is None:
            return None
        try:
            out = {}
            for pool in sorted(pools):
                out[pool] = set(await asyncio.wait_for(asyncio.to_thread(live, pool), 10.0))
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, asyncio.TimeoutError) else "no answer in 10s"
            if why != self._capacity_live_error:
                log.warning("cannot read which workers are alive from the lease store (%s): the capacity requests other workers "
                            "made are kept (one a live worker still wants, deleted, would lose or delay its scale-up); looked at "
                            "again in %gs", why, self.capacity_peer_check_s)
            self._capacity_live_error = why
            return None
        if self._capacity_live_error is not None:
            log.info("the lease store tells again which workers are alive: the capacity requests of workers gone are deleted")
            self._capacity_live_error = None
        return out

    def capacity_node_gpus(self) -> int:
        """The GPUs of a node of the node group, the most a placeholder asks for: the declared `capacity_node`'s, else
        the largest node last described (the worker's plan); 0 when neither is known (one placeholder per stage)."""
        if self.capacity_node is not None:
            return capacity_node_spec(self.capacity_node)[0].gpus
        return max((n.gpus for n in self._described), default=0)

    def capacity_parts(self, want: CapacityWant) -> list[tuple[int, float, float]]:
        """How stage `want` is asked for: (GPUs, cores, MB of memory) per placeholder pod. One part for a stage that
        fits on a node of the group; a gang wider than one (`capacity_node_gpus`) in node-sized parts: full nodes, then
        the rest (10 GPUs on 4-GPU nodes: 4, 4, 2), as its placement on the nodes they bring splits it and its pods then
        ask: its cores in proportion to the GPUs of each part (`default_cpu_split`), its memory evenly (each node of a
        placement holds mem/k, `ClusterState.allocate`; before 2026-11-28 the parts split it in proportion to their GPUs
        too, so the narrow part asked for less than its stage's pod would and the autoscaler could bring a node too
        small for it)."""
        per = self.capacity_node_gpus()
        if per <= 0 or want.gpus <= per or want.gpu_milli < 1000:
            return [(want.gpus, want.cpu_cores, want.mem_mb)]
        sizes = [per] * (want.gpus // per) + ([want.gpus % per] if want.gpus % per else [])
        return [(g, want.cpu_cores * g / want.gpus, want.mem_mb / len(sizes)) for g in sizes]

    def capacity_request_manifests(self, want: CapacityWant) -> list[dict]:
        """The placeholder pods of stage `want`, one per part (`capacity_parts`)."""
        parts = self.capacity_parts(want)
        return [self.capacity_request_manifest(want, part=i, of=parts) for i in range(len(parts))]

    def capacity_request_manifest(self, want: CapacityWant, part: int = 0, of: list[tuple[int, float, float]] | None = None) -> dict:
        """The placeholder pod asking the cluster for a node for stage `want` (the cluster-overprovisioner's pause
        pod), or for part `part` of it (`of`: its parts, `capacity_parts`; default: the whole stage in one): a pause
        container requesting the part's GPUs (whole ones, or one shared GPU for a fractional share when the device plugin
        shares them), cpu and memory, the block's node selector, the GPU taint's toleration (as a stage's pods),
        optionally `capacity_priority_class`. Labels qosflow.dev/capacity-for (the stage) and qosflow.dev/capacity-part
        (the part's index); no qosflow.dev/stage-id label: no stage's selector matches it. Annotations
        qosflow.dev/capacity-owner (its maker: the worker's lease holder id, `capacity_peers`) and qosflow.dev/capacity-pool
        (the pool's key in the lease store, once the worker said it; the label qosflow.dev/pool too, as a label value):
        another worker deletes it only once its maker is gone.
        `cluster-autoscaler.kubernetes.io/safe-to-evict`: a bare pod would otherwise keep its node from being scaled down."""
        gpus_n, cores, mem_mb = (of or [(want.gpus, want.cpu_cores, want.mem_mb)])[part]
        gpus = self._gpu_resources(gpus_n, want.gpu_milli < 1000)
        requests = {"cpu": _cpu(max(cores, 0.001)), **gpus}
        if mem_mb:
            requests["memory"] = _mib(mem_mb)
        labels = {"app.kubernetes.io/managed-by": "qosflow", "app.kubernetes.io/name": "qosflow-capacity-request",
                  LABEL_ROLE: ROLE_CAPACITY, LABEL_CAPACITY_FOR: label_value(want.job_id), LABEL_CAPACITY_PART: str(part),
                  LABEL_CLUSTER: label_value(self.cluster_name)}
        if self._capacity_pool:
            labels[LABEL_POOL] = self._pool_label()
        annotations = {ANN_CAPACITY_FOR: want.job_id, ANN_CAPACITY_PARTS: str(len(of or [None])), "qosflow.dev/stage-name": want.name,
                       ANN_CAPACITY_OWNER: self._capacity_owner, "cluster-autoscaler.kubernetes.io/safe-to-evict": "true"}
        if self._capacity_pool:
            annotations[ANN_CAPACITY_POOL] = self._capacity_pool
        spec: dict[str, Any] = {
            "containers": [{"name": "pause", "image": self.capacity_request_image,
                            "resources": {"requests": requests, **({"limits": dict(gpus)} if gpus else {})}}],
            "tolerations": [{"key": self.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
        }
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.capacity_priority_class:
            spec["priorityClassName"] = self.capacity_priority_class
        if self.image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": n} for n in self.image_pull_secrets]
        name = job_name(want.job_id, "-cap" if not of or len(of) == 1 else f"-cap-{part}")
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": labels, "annotations": annotations},
                "spec": spec}

    def _capacity_lock_now(self) -> asyncio.Lock:
        if self._capacity_lock is None:
            self._capacity_lock = asyncio.Lock()
        return self._capacity_lock

    def _capacity_forget(self, job_id: str, name: str) -> None:
        left = tuple(n for n in self._capacity.get(job_id, ()) if n != name)
        if left:
            self._capacity[job_id] = left
        else:
            self._capacity.pop(job_id, None)

    async def _delete_capacity_pod(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:  # (at once: the pause container needs no grace, and the stage's pod waits for its room)
            await self._acall(self.core.delete_namespaced_pod, name, self.namespace, grace_period_seconds=0,
                              _doing="delete a capacity request")
        except ApiException as e:
            if e.status != 404:
                raise

    async def _drop_capacity_request(self, job_id: str, why: str) -> None:
        async with self._capacity_lock_now():
            names = self._capacity.pop(job_id, ())
            if why == "placed":
                self._capacity_placed.add(job_id)
            for i, name in enumerate(names):
                try:
                    await self._delete_capacity_pod(name)
                except Exception as exc:  # (the next sync deletes it: it is no longer wanted)
                    log.warning("stage %s: could not delete its capacity request %s (%s): deleted at the next heartbeat", job_id, name, exc)
                    self._capacity[job_id] = tuple(self._capacity.get(job_id, ())) + tuple(names[i:])
                    return
                self.stats["capacity_dropped"] += 1
                log.info("stage %s: capacity request %s deleted (%s)", job_id, name, why)

    async def _clear_way(self, job_id: str, nodes: list[str], stage_id: str | None = None) -> None:
        """Before stage `job_id`'s Job is created on `nodes`: delete its placeholders (every part), and this backend's
        placeholders that could take the room the worker gave it: those not bound yet (the kube-scheduler may bind one
        to the room the stage's placeholder leaves before the job controller has made the stage's pod) and those bound
        to one of its nodes (one took room there that a stage which ended left). Their stages, if they still wait for
        capacity, get new ones at the next heartbeat (`sync_capacity_requests`). A placeholder of the worker's own
        `capacity_priority_class`, lower than the stages', is preempted anyway; without one this is what keeps a stage
        from being Unschedulable behind a placeholder. Only this backend's own (the names in `_capacity`): another
        worker's placeholders on the pool are its to delete, for its stages, so two workers never delete each other's."""
        async with self._capacity_lock_now():
            self._capacity_placed.add(job_id)
            self._capacity_settling[job_id] = (max(1, len(nodes)), time.monotonic() + max(1.0, float(self.unschedulable_timeout_s)), stage_id)
            mine = {name: jid for jid, names in self._capacity.items() for name in names}
            try:
                pods = (await self._acall(self.core.list_namespaced_pod, self.namespace, label_selector=self._capacity_selector(),
                                          _doing=f"launch stage {job_id}")).items
            except Exception as exc:  # (the stage's own are deleted all the same)
                log.debug("listing the capacity requests before stage %s: %s", job_id, exc)
                pods = []
            in_way = {p.metadata.name for p in pods if p.metadata.name in mine and (not p.spec.node_name or p.spec.node_name in nodes)}
            in_way.update(self._capacity.get(job_id, ()))
            for name in sorted(in_way, key=lambda n: (mine.get(n) != job_id, n)):  # (the stage's own first)
                jid = mine[name]
                try:
                    await self._delete_capacity_pod(name)
                except Exception as exc:  # (the next sync deletes it if it is no longer wanted)
                    log.warning("stage %s: could not delete capacity request %s (%s)", job_id, name, exc)
                    continue
                self._capacity_forget(jid, name)
                self.stats["capacity_dropped"] += 1
                log.info("stage %s: capacity request %s deleted (%s)", jid, name,
                         "its stage is placed" if jid == job_id else f"in the way of stage {job_id}, placed: made again if still wanted")

    def _capacity_budget(self, wants: Sequence[CapacityWant]) -> dict[str, list[dict]]:
        """The placeholders wanted, by job id: the stages in `wants`' order (longest wait first) while their pods (one
        per part) fit in `max_capacity_requests`, which counts pods: a gang in three parts takes three. The first that
        does not fit ends the list (a later, narrower stage does not take the room the gang waits for); a stage with more
        parts than `max_capacity_requests` is skipped, with a warning (once), as it could never be asked for whole."""
        out: dict[str, list[dict]] = {}
        budget = self.max_capacity_requests
        for w in wants:
            bodies = self.capacity_request_manifests(w)
            if len(bodies) > self.max_capacity_requests:
                if w.job_id not in self._capacity_too_wide:
                    self._capacity_too_wide.add(w.job_id)
                    log.warning("stage %s waits for capacity, but it needs %d node-sized placeholders (%d GPUs on nodes of %d) and "
                                "max_capacity_requests is %d: none is made for it; raise max_capacity_requests to at least %d",
                                w.name, len(bodies), w.gpus, self.capacity_node_gpus(), self.max_capacity_requests, len(bodies))
                continue
            if len(bodies) > budget:
                break
            out[w.job_id] = bodies
            budget -= len(bodies)
        return out

    async def sync_capacity_requests(self, wants: Sequence[CapacityWant]) -> None:
        """Make the placeholder pods match `wants` (the stages waiting for capacity, longest wait first; as many as
        `max_capacity_requests` pods allow get theirs, `_capacity_budget`; a gang wider than a node has one per part,
        `capacity_parts`): one LIST of the placeholders of this cluster (label selector), a create for each missing
        one, a delete for each of this backend's no longer wanted (its stage placed, gone, or room found for it) or
        ended (a Failed or preempted placeholder is made again; another's that ended too: its maker, if alive, makes it
        again). Other workers' placeholders (several workers on one pool) are left to them while they are alive:

        * one that names no maker (made by a version before 2026-11-27) is deleted at the first call, as before;
        * one whose maker (qosflow.dev/capacity-owner) has no live presence in the lease store for its pool
          (`capacity_peers`: a worker that died, or stopped without deleting its own) is deleted at the first call and
          at each look after it, every `capacity_peer_check_s` (a LIST then, even when this backend has none to
          make): within the lease TTL and that after its maker's last heartbeat;
        * when that cannot be known: without a lease store (the worker was not told, `capacity_peers`; a worker alone
          on its pool) every other's is deleted at the first call, as before; when the lease store fails, none is (a
          warning says so) until it answers again at a later look;
        * but one of those (its maker gone, by the tests above) of a stage in `wants` (named as this backend would
          name it: the stage of a worker that died, which this worker took over) that asks for what this backend would
          (`_capacity_pod_fits`) is adopted instead of being deleted and made again: a PATCH rewrites its maker (and
          pool) to this backend's, on condition that it is as listed (its resourceVersion), so the autoscaler sees the
          same pod stay (`_adopt_capacity_pod`). One that asks for something else (the stage's request changed) is
          replaced. A live maker's (or one whose maker cannot be judged now) is never adopted, even of a stage this
          backend asks for: it is left to its maker, not taken for this backend's (not made again under its name, not
          deleted when the stage is placed here), and counted as another's once bound (`k8s_usage.counted`);
        * one of another pool (`_capacity_other_pool`: its qosflow.dev/pool label or capacity-pool annotation names
          another pool than the one the worker said; another pool's worker, whose lease store may be another, so this
          one's cannot tell whether its maker lives) is never deleted, adopted or taken for this backend's: it is its
          pool's workers' (counted as another's once bound, `k8s_usage.counted`). One that names no pool (a version
          before 2026-11-27), and every one while the worker has not said its pool, is judged as above.

        Nothing when `request_capacity` is off."""
        if not self.request_capacity:
            if not self._capacity:
                return
            wants = []  # (turned off by an edit of the cluster block: this backend's placeholders go)
        from kubernetes.client.exceptions import ApiException

        chosen = self._capacity_budget(wants)
        self._capacity_too_wide &= {w.job_id for w in wants}
        expected = {jid: {b["metadata"]["name"] for b in bodies} for jid, bodies in chosen.items()}
        doing = "request capacity"
        async with self._capacity_lock_now():
            self._capacity_placed &= set(chosen)
            now = time.monotonic()
            look = not self._capacity_swept or (self._capacity_live is not None and now - self._capacity_peers_at >= self.capacity_peer_check_s)
            if not chosen and not self._capacity and not look:
                return
            pods = (await self._acall(self.core.list_namespaced_pod, self.namespace, label_selector=self._capacity_selector(), _doing=doing)).items
            if look:
                self._capacity_peers_at = now
            # the makers of the others' placeholders (LISTed first: a maker's presence is recorded before it makes any)
            makers: dict[str, tuple[str, str]] = {}  # name -> (maker, its pool)
            for p in pods:
                ann = p.metadata.annotations or {}
                if self._capacity_other_pool(p):
                    continue  # (another pool's: not judged here, nor asked about in this pool's lease store)
                jid, owner = ann.get(ANN_CAPACITY_FOR) or "", ann.get(ANN_CAPACITY_OWNER) or ""
                if owner and owner not in self._capacity_owners:
                    makers[p.metadata.name] = (owner, ann.get(ANN_CAPACITY_POOL) or self._capacity_pool)
            alive = await self._capacity_makers_alive({pool for _, pool in makers.values()}) if look and makers else None
            bodies = {b["metadata"]["name"]: b for bs in chosen.values() for b in bs}
            have: set[str] = set()
            theirs: set[str] = set()  # (kept and not this backend's: not made again under the same name, not taken as its own)
            for p in pods:
                ann = p.metadata.annotations or {}
                jid = ann.get(ANN_CAPACITY_FOR) or ""
                name = p.metadata.name
                if self._capacity_other_pool(p):
                    # another pool's (its worker, maybe of another Prefect server and lease store, makes and deletes it):
                    # never deleted or adopted here, even if it ended or names a stage this backend asks for
                    have.add(name)
                    theirs.add(name)
                    continue
                ended = (p.status.phase if p.status else None) in ("Succeeded", "Failed")
                owner = ann.get(ANN_CAPACITY_OWNER) or None
                # (the maker it names decides; one naming none, an older version's, is this backend's if it made it)
                ours = owner in self._capacity_owners if owner else name in self._capacity.get(jid, ())
                why = ""
                if ours:
                    pass
                elif name not in makers:  # (no maker named: an older version's)
                    if not self._capacity_swept:
                        why = "left by a worker that stopped (a version that does not name it)"
                elif alive is not None:
                    maker, pool = makers[name]
                    if maker not in alive.get(pool, ()):
                        why = f"its maker, worker {maker}, is gone (no live presence in the lease store)"
                elif not self._capacity_swept and self._capacity_live is None:
                    why = (f"left by worker {makers[name][0]} (without a lease store, which would tell whether it is alive, "
                           "a worker is taken to be alone on its pool)")
                if why and not ended and name in bodies and jid not in self._capacity_placed and _capacity_pod_fits(p, bodies[name]):
                    # a placeholder its maker left (the test that would delete it) of a stage this backend asks for now
                    # (a dead worker's stage, taken over): adopted as it is, not deleted and made again (the autoscaler
                    # would see it vanish). A live maker's is never adopted: two live workers never take each other's
                    if not await self._adopt_capacity_pod(p, jid, makers.get(name, (owner or "",))[0], why):
                        continue  # (gone, or changed since the LIST: looked at again at the next sync)
                    if name not in self._capacity.get(jid, ()):
                        self._capacity[jid] = self._capacity.get(jid, ()) + (name,)
                    have.add(name)
                    continue
                if why:
                    await self._delete_capacity_pod(name)
                    self.stats["capacity_left_deleted"] += 1
                    log.info("capacity request %s (stage %s) deleted: %s", name, jid, why)
                    continue
                if ended or (ours and name not in expected.get(jid, ())):
                    await self._delete_capacity_pod(name)
                    if ours:
                        self._capacity_forget(jid, name)
                        self.stats["capacity_dropped"] += 1
                        log.info("stage %s: capacity request %s deleted (%s)", jid, name,
                                 "it ended: made again" if ended else "no longer waiting for capacity")
                    continue
                have.add(name)
                if not ours:
                    theirs.add(name)  # (a live maker's, or one not judged yet: its maker's to delete, never this backend's)
            self._capacity_swept = True
            for jid in list(self._capacity):  # (deleted by someone else: made again below if wanted)
                kept = tuple(n for n in self._capacity[jid] if n in have and n not in theirs)
                if kept:
                    self._capacity[jid] = kept
                else:
                    del self._capacity[jid]
            if chosen and self._capacity_settling and not await self._capacity_settled(doing):
                return  # (no placeholder made while a stage placed is not bound yet: one made now could take its room)
            for w in wants:
                if w.job_id not in chosen or w.job_id in self._capacity_placed:
                    continue
                bodies = chosen[w.job_id]
                for body in bodies:
                    name = body["metadata"]["name"]
                    if name in theirs:
                        continue  # (a placeholder of that name is another's: it asks for the node; never this backend's)
                    if name not in have:
                        try:
                            made = await self._acall(self.core.create_namespaced_pod, self.namespace, body, _doing=doing)
                            self._check_capacity_priority(made)
                        except ApiException as e:
                            if e.status != 409:
                                log.warning("stage %s: could not request capacity (%s %s): %s", w.name, e.status, e.reason, (e.body or "")[:300])
                                continue
                            if not await self._made_by_me(name, w.job_id, doing):
                                continue
                            self.stats["capacity_conflict_mine"] += 1
                        self.stats["capacity_requested"] += 1
                        req = body["spec"]["containers"][0]["resources"]["requests"]
                        part = f" (part {body['metadata']['labels'][LABEL_CAPACITY_PART]} of {len(bodies)})" if len(bodies) > 1 else ""
                        log.info("stage %s has waited %.0fs for capacity (no node has room for it): placeholder pod %s%s asks the "
                                 "cluster's autoscaler for a node (%s)", w.name, w.waited_s, name, part,
                                 ", ".join(f"{k}={v}" for k, v in req.items()))
                    if name not in self._capacity.get(w.job_id, ()):
                        self._capacity[w.job_id] = self._capacity.get(w.job_id, ()) + (name,)

    async def _capacity_settled(self, doing: str) -> bool:
        """Whether every stage `_clear_way` cleared the way for has its pods bound (one LIST of the attempt's pods by its
        qosflow.dev/stage-id label each), or has waited `unschedulable_timeout_s` (its launch failed, or its pods are
        Unschedulable: its wait reports it). Until then a sync makes no placeholder: between the placeholders' deletion
        and the stage's pods' binding (the launch's Job create, the job controller's pod), a placeholder made for
        another waiting stage would be bound to the room the stage was given first, and the stage's pod would be
        Unschedulable behind it (before 2026-11-28 it was, when a heartbeat's sync came in that window).
        The attempt's own pods: one that ended (Succeeded, Failed) was bound, so a stage done before a sync looked is
        settled (it was not: its ended pods were left out, and no placeholder was made for anyone until the deadline);
        an earlier attempt's pods (the same qosflow.dev/job, still terminating after a kill) are not the attempt's, and
        do not say its pods are bound. (Without the attempt's id, `_clear_way` alone: the job's pods, those ended or
        being deleted left out.) A stage killed meanwhile is done with by `kill`."""
        now = time.monotonic()
        for jid, (expected, until, stage_id) in list(self._capacity_settling.items()):
            if now >= until:
                del self._capacity_settling[jid]
                continue
            sel = f"{LABEL_STAGE}={label_value(stage_id)}" if stage_id else f"{LABEL_JOB}={label_value(jid)}"
            try:
                pods = (await self._acall(self.core.list_namespaced_pod, self.namespace, label_selector=sel, _doing=doing)).items
            except Exception as exc:  # noqa: BLE001 - looked at again at the next sync
                log.debug("stage %s: its pods could not be listed (%s): no capacity request made before they are", jid, exc)
                return False
            if stage_id:
                pods = [p for p in pods if (p.metadata.annotations or {}).get(ANN_STAGE) in (None, stage_id)]
                bound = [p for p in pods if (p.spec is not None and p.spec.node_name)
                         or (p.status.phase if p.status else None) in ("Succeeded", "Failed")]
            else:
                pods = [p for p in pods if (p.status.phase if p.status else None) not in ("Succeeded", "Failed")
                        and p.metadata.deletion_timestamp is None]  # (not an earlier attempt's)
                bound = [p for p in pods if p.spec is not None and p.spec.node_name]
            if len(pods) >= expected and len(bound) == len(pods):
                del self._capacity_settling[jid]
            else:
                return False
        return True

    async def _made_by_me(self, name: str, job_id: str, doing: str) -> bool:
        """After a create of placeholder `name` answered 409 (one of that name appeared since this sync's LIST): whether
        the one there is this backend's, made by a create of its own whose answer was lost (it names one of this
        backend's makers, `_capacity_owners`), read by one LIST by name (the `list` the worker has on pods; no `get`).
        Another's (a live worker of the pool that asks for the same stage, or another pool's) is not recorded as this
        backend's (before 2026-11-28 it was, until the next sync: `_clear_way` could delete it meanwhile): the next sync
        judges it as any other's. Gone, or not readable now: not recorded either (the next sync makes it again)."""
        try:
            pods = (await self._acall(self.core.list_namespaced_pod, self.namespace, label_selector=self._capacity_selector(),
                                      field_selector=f"metadata.name={name}", _doing=doing)).items
        except Exception as exc:  # noqa: BLE001 - left to the next sync
            log.debug("stage %s: capacity request %s answered 409 and could not be read (%s): looked at again at the next sync", job_id, name, exc)
            return False
        pod = next((p for p in pods if p.metadata.name == name), None)
        owner = ((pod.metadata.annotations or {}).get(ANN_CAPACITY_OWNER) if pod is not None else None) or None
        if pod is not None and owner in self._capacity_owners:
            return True
        self.stats["capacity_conflict_theirs"] += 1
        log.info("stage %s: capacity request %s was made meanwhile by %s: left to its maker, not taken for this worker's "
                 "(the next sync looks at it again)", job_id, name,
                 "nobody (it is gone)" if pod is None else f"worker {owner}" if owner else "a worker that does not name itself")
        return False

    def _check_capacity_priority(self, made: Any) -> None:
        """Say once (per class and value) when this backend's placeholder `made` got a priority that does not let this
        pool's stages preempt it: `capacity_priority_class` is meant to be below them (else a stage placed into room a
        bound placeholder of this worker holds waits for `_clear_way`, and one of another worker's is booked as taken)."""
        spec = getattr(made, "spec", None)
        cls, prio = (spec.priority_class_name, spec.priority) if spec is not None else (None, None)
        if not cls or prio is None or (self._stage_priority is not None and prio < self._stage_priority):
            return
        key = (cls, prio, self._stage_priority)
        if key in self._capacity_priority_said:
            return
        self._capacity_priority_said.add(key)
        log.warning("Kubernetes cluster %r: capacity_priority_class %r has priority %s, not lower than this pool's stage pods' (%s): "
                    "kube-scheduler will not preempt these placeholders for a stage, and the workers of other pools on the cluster "
                    "book their room as taken; give the block a PriorityClass whose value is below %s (the "
                    "cluster-overprovisioner's: value -10, preemptionPolicy Never)", self.cluster_name, cls, prio,
                    "none: they may not preempt" if self._stage_priority is None else self._stage_priority,
                    0 if self._stage_priority is None else self._stage_priority)

    def _saw_stage_priority(self, pod: Any) -> None:
        """Learn the priority the API server gave one of this pool's stage pods (`_stage_priority`); when it changes, the
        pod readings are made again, since which placeholders a stage may preempt changes with it."""
        spec = pod.spec
        if spec is None or spec.priority is None:
            return
        prio = None if spec.preemption_policy == "Never" else int(spec.priority)
        if prio != self._stage_priority:
            log.info("Kubernetes cluster %r: this pool's stage pods get priority %s%s (the API server's Priority admission): "
                     "another worker's capacity placeholder is booked as taken unless its priority is lower", self.cluster_name,
                     spec.priority, " and may not preempt (preemptionPolicy Never)" if prio is None else "")
            self._stage_priority = prio
            self._pod_usage_last = None
            self._pod_informer.distrust()

    def _capacity_other_pool(self, pod: Any) -> str:
        """The pool placeholder `pod` names when it is another pool than this backend's (its `LABEL_POOL` label, or its
        `ANN_CAPACITY_POOL` annotation); "" when it is this pool's, names none (a version before 2026-11-27), or the
        worker has not said this backend's pool (`capacity_peers`), or it names this backend as its maker."""
        md = pod.metadata
        if not self._capacity_pool or (md.annotations or {}).get(ANN_CAPACITY_OWNER) in self._capacity_owners:
            return ""
        ann_pool = (md.annotations or {}).get(ANN_CAPACITY_POOL) or ""
        if ann_pool and ann_pool != self._capacity_pool:
            return ann_pool
        return "" if self.owns(md.labels) else (md.labels or {}).get(LABEL_POOL, "")

    async def _adopt_capacity_pod(self, pod: Any, job_id: str, maker: str, why: str = "") -> bool:
        """Make placeholder `pod` (made by `maker`, for stage `job_id`, which this backend now asks capacity for; left by
        its maker, `why`) this backend's: a merge PATCH of its maker annotation (and its pool's annotation and label:
        this backend's, or none if the worker has not said its pool) with its resourceVersion as listed. False when it
        is gone (404) or changed since (409): the next sync looks at it again."""
        from kubernetes.client.exceptions import ApiException

        md = pod.metadata
        pool = self._capacity_pool or None
        patch = {"metadata": {"resourceVersion": md.resource_version,
                              "annotations": {ANN_CAPACITY_OWNER: self._capacity_owner, ANN_CAPACITY_POOL: pool},
                              "labels": {LABEL_POOL: self._pool_label() or None}}}
        try:
            await self._acall(self.core.patch_namespaced_pod, md.name, self.namespace, patch, _content_type="application/merge-patch+json",
                              _doing="adopt a capacity request")
        except ApiException as e:
            if e.status in (404, 409):
                log.debug("capacity request %s (stage %s) not adopted: %s %s", md.name, job_id, e.status, e.reason)
                return False
            raise
        self.stats["capacity_adopted"] += 1
        log.info("stage %s: capacity request %s, made by worker %s, adopted (this worker asks for the stage now; %s): kept as it "
                 "is, its maker is this worker", job_id, md.name, maker or "(not named)", why or "its maker left it")
        return True

    # ------------------------------------------------------------------ manifests
    def _gpu_resources(self, n: int, shared: bool) -> dict[str, str]:
        """The extended resource of `n` GPUs in a pod's limits (and requests), a stage's or its placeholder's alike:
        slices of the shared resource for a shared placement (a fractional share, or co-located) when the device plugin
        shares GPUs (`shares_gpus`), else whole devices; {} for none."""
        if n <= 0:
            return {}
        return {self.shared_resource if shared and self.shares_gpus else self.gpu_resource: str(n)}

    def _stage_labels(self, spec: LaunchSpec) -> tuple[dict[str, str], dict[str, str]]:
        """The labels and annotations of everything a stage attempt creates (its Jobs, pods, Secret, PodGroup). Its
        cluster's name too, and its pool's key once the worker said it (`LABEL_POOL`): the worker of another qosflow
        pool on the same nodes books this pool's stage pods as pods that are not its own (`k8s_usage.counted`), even
        when the two pools' blocks have the same name, and never adopts or sweeps them (`owns`)."""
        labels = {"app.kubernetes.io/managed-by": "qosflow", "app.kubernetes.io/name": "qosflow-stage",
                  LABEL_STAGE: label_value(spec.stage_id), LABEL_JOB: label_value(spec.placement.job_id),
                  LABEL_CLUSTER: label_value(self.cluster_name)}
        annotations = {ANN_STAGE: spec.stage_id}
        for k, v in spec.labels.items():
            if _LABEL_KEY.match(k):
                labels[k] = label_value(v)
            annotations[k] = str(v)
        if self._capacity_pool:
            labels[LABEL_POOL] = self._pool_label()
            annotations[ANN_POOL] = self._capacity_pool
        return labels, annotations

    def _credentials(self, spec: LaunchSpec) -> dict[str, str]:
        """The stage's environment variables that go through its Secret (none when credentials_in_secret is off)."""
        if not self.credentials_in_secret:
            return {}
        return {k: str(v) for k, v in spec.env.items() if v is not None and is_secret_env(k, str(v))}

    def secret_manifest(self, spec: LaunchSpec) -> dict | None:
        """The Secret holding the stage attempt's credentials (base64 `data`, as the API serves it), or
        None when it has none. It is created before the Job(s), which then own it (ownerReferences):
        Kubernetes' garbage collector deletes it with them; qosflow deletes it when the stage ends."""
        creds = self._credentials(spec)
        if not creds:
            return None
        labels, annotations = self._stage_labels(spec)
        return {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(spec.stage_id), "namespace": self.namespace, "labels": labels, "annotations": annotations},
            "data": {_secret_key(k): base64.b64encode(v.encode()).decode() for k, v in creds.items()},
        }

    def manifests(self, spec: LaunchSpec) -> tuple[list[dict], dict | None]:
        """The Job(s) and PodGroup for a stage (plain dicts, as the API takes them). Credentials in the
        stage's env are `secretKeyRef`s to `secret_manifest(spec)`, never plain values."""
        p = spec.placement
        nodes = list(p.nodes)
        names = [spec.cluster.nodes[i].name for i in nodes]
        # what each rank's environment is on its node (`placement_env`: its GPUs, cores, cpuset, virtual GPUs)
        node_envs = {n: placement_env(p, spec.cluster, n, spec.cpusets.get(n), requested_gpus=spec.requested_gpus) for n in nodes}
        uniform = len({_env_but_node(e) for e in node_envs.values()}) == 1
        groups = [(nodes, names)] if uniform else [([n], [nm]) for n, nm in zip(nodes, names)]
        base = job_name(spec.stage_id)
        stage_label = label_value(spec.stage_id)
        labels, annotations = self._stage_labels(spec)
        annotations.update({"qosflow.dev/nodes": ",".join(names), "qosflow.dev/gpu-sharing": self.gpu_sharing})
        pods_total = len(nodes)
        pg_name = base if self.gang_scheduler and pods_total > 1 else None
        creds = self._credentials(spec)
        jobs = []
        for gi, (gnodes, gnames) in enumerate(groups):
            n0 = gnodes[0]
            k_gpus, cores = len(p.gpus_on(n0)), p.cores_on(n0)
            env = dict(node_envs[n0])
            env.pop("CUDA_VISIBLE_DEVICES", None)  # the device plugin assigns the devices
            env.pop("QOSFLOW_NODE", None)
            env.update(spec.env)
            env.update({"QOSFLOW_STAGE_ID": spec.stage_id, "QOSFLOW_GANG_SIZE": str(pods_total), "QOSFLOW_GANG_HOSTS": ",".join(names)})
            # progress: a file in the container, echoed to the log, which is what the worker can read
            env.setdefault(PROGRESS_FILE_ENV, f"/tmp/qosflow-progress-{base}.jsonl")
            env.setdefault(ECHO_ENV, "stderr")
            placement_json = env.get("QOSFLOW_PLACEMENT", "")
            node_ref = {"name": "QOSFLOW_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
            if len(gnodes) > 1 and placement_json:
                # one pod template for the nodes of an Indexed Job: each pod's placement names its own node (the kubelet
                # expands $(QOSFLOW_NODE), defined before it, from the downward API); it named the first node on all. The
                # rest of it is every node's alike (`uniform`): a gang whose nodes' GPUs or cores differ (GPUs 0,1 on one
                # node, 2,3 on the other) is one Job per node, each pod with its own node's placement; before 2026-11-28
                # it was one Indexed Job, and every rank read the first node's GPUs and cpuset
                env["QOSFLOW_PLACEMENT"] = _placement_on_each_node(placement_json)
            env_list: list[dict] = [
                {"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name(spec.stage_id), "key": _secret_key(k)}}}
                if k in creds and creds[k] == v else {"name": k, "value": v}
                for k, v in env.items()
            ]
            if len(gnodes) > 1:
                env_list.insert(0, node_ref)
            else:
                env_list.append(node_ref)
            if len(gnodes) > 1:
                env_list.append({"name": "QOSFLOW_GANG_RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
            else:
                env_list.append({"name": "QOSFLOW_GANG_RANK", "value": str(gi)})
            limits = self._gpu_resources(k_gpus, p.gpu_milli < 1000 or bool(p.colocated_with))
            requests = {"cpu": _cpu(max(cores, 0.001))}
            if p.mem_mb:
                requests["memory"] = _mib(p.mem_mb / len(nodes))
            pod_labels = dict(labels)
            pod_ann = dict(annotations)
            pod_ann[ANN_PLACEMENT] = placement_json
            pod_spec: dict[str, Any] = {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "stage",
                    "image": spec.image or self.image,
                    "command": list(spec.command),
                    "env": env_list,
                    "resources": {"limits": {**limits}, "requests": {**requests, **limits}},
                    **({"workingDir": spec.cwd} if spec.cwd else {}),
                }],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": gnames}]}]}}},
                "tolerations": [
                    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": self.eviction_toleration_s},
                    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": self.eviction_toleration_s},
                    {"key": self.gpu_resource, "operator": "Exists", "effect": "NoSchedule"},
                ],
            }
            if len(gnodes) > 1:
                pod_spec["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {LABEL_STAGE: stage_label}}, "topologyKey": "kubernetes.io/hostname"}]}
            if self.service_account:
                pod_spec["serviceAccountName"] = self.service_account
            if self.image_pull_secrets:
                pod_spec["imagePullSecrets"] = [{"name": s} for s in self.image_pull_secrets]
            if pg_name:
                gs = GANG_SCHEDULERS[self.gang_scheduler]
                pod_spec["schedulerName"] = gs.scheduler_name
                pod_ann[gs.group_annotation] = pg_name
                if self.gang_scheduler == "kai":
                    pod_labels["kai.scheduler/queue"] = self.kai_queue
            job_spec: dict[str, Any] = {
                "backoffLimit": 0,
                "completions": len(gnodes),
                "parallelism": len(gnodes),
                "template": {"metadata": {"labels": pod_labels, "annotations": pod_ann}, "spec": pod_spec},
            }
            if len(gnodes) > 1:
                job_spec["completionMode"] = "Indexed"
            if self.ttl_after_finished_s is not None:
                job_spec["ttlSecondsAfterFinished"] = self.ttl_after_finished_s
            jobs.append({
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": base if len(groups) == 1 else f"{base[:56]}-r{gi}", "namespace": self.namespace, "labels": dict(labels), "annotations": dict(annotations)},
                "spec": job_spec,
            })
        podgroup = None
        if pg_name:
            gs = GANG_SCHEDULERS[self.gang_scheduler]
            podgroup = {
                "apiVersion": f"{gs.group}/{gs.version}", "kind": "PodGroup",
                "metadata": {"name": pg_name, "namespace": self.namespace, "labels": dict(labels),
                             **({"annotations": {ANN_POOL: annotations[ANN_POOL]}} if ANN_POOL in annotations else {})},
                "spec": {"minMember": pods_total, **({"queue": self.kai_queue} if self.gang_scheduler == "kai" else {})},
            }
        return jobs, podgroup

    # ------------------------------------------------------------------ pipeline runs
    def pipeline_manifests(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None = None, *,
                           labels: dict[str, str] | None = None, cpu_cores: float | None = None,
                           mem_mb: float | None = None) -> tuple[dict, dict | None]:
        """The Job (and credentials Secret, or None) of a pipeline run: as a stage's (image, namespace, labels,
        service account, pull secrets, credentials through a Secret, backoffLimit 0, TTL), but with no GPU, no node
        affinity and no node selector, and a small CPU/memory request (`cpu_cores`/`mem_mb`, else the backend's
        `pipeline_cpu_cores`/`pipeline_mem_mb`), no limit. Labelled `qosflow.dev/role=pipeline`."""
        from types import SimpleNamespace

        spec = SimpleNamespace(stage_id=stage_id, placement=SimpleNamespace(job_id=stage_id), labels=dict(labels or {}),
                               env={k: v for k, v in env.items() if v is not None})
        job_labels, annotations = self._stage_labels(spec)  # type: ignore[arg-type]
        job_labels.update({"app.kubernetes.io/name": "qosflow-pipeline", LABEL_ROLE: "pipeline"})
        annotations["qosflow.dev/nodes"] = ""
        creds = self._credentials(spec)  # type: ignore[arg-type]
        secret = None
        if creds:
            secret = {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": secret_name(stage_id), "namespace": self.namespace, "labels": dict(job_labels),
                             "annotations": dict(annotations)},
                "data": {_secret_key(k): base64.b64encode(v.encode()).decode() for k, v in creds.items()},
            }
        env_list: list[dict] = [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name(stage_id), "key": _secret_key(k)}}}
            if k in creds and creds[k] == str(v) else {"name": k, "value": str(v)}
            for k, v in spec.env.items()
        ]
        env_list.append({"name": "QOSFLOW_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        cores = float(cpu_cores) if cpu_cores else self.pipeline_cpu_cores
        mem = float(mem_mb) if mem_mb else self.pipeline_mem_mb
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "containers": [{
                "name": "pipeline",
                "image": self.image,
                "command": list(command),
                "env": env_list,
                "resources": {"requests": {"cpu": _cpu(max(cores, 0.001)), "memory": f"{int(max(mem, 1))}Mi"}},
                **({"workingDir": cwd} if cwd else {}),
            }],
            "tolerations": [
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": self.eviction_toleration_s},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": self.eviction_toleration_s},
            ],
        }
        if self.service_account:
            pod_spec["serviceAccountName"] = self.service_account
        if self.image_pull_secrets:
            pod_spec["imagePullSecrets"] = [{"name": s} for s in self.image_pull_secrets]
        job_spec: dict[str, Any] = {
            "backoffLimit": 0, "completions": 1, "parallelism": 1,
            "template": {"metadata": {"labels": dict(job_labels), "annotations": dict(annotations)}, "spec": pod_spec},
        }
        if self.ttl_after_finished_s is not None:
            job_spec["ttlSecondsAfterFinished"] = self.ttl_after_finished_s
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": job_name(stage_id), "namespace": self.namespace, "labels": dict(job_labels), "annotations": dict(annotations)},
               "spec": job_spec}
        return job, secret

    async def _create_job(self, job: dict, stage_id: str, doing: str, kind: str) -> Any:
        """Create Job `job` of stage (or pipeline run) `stage_id`; a 409 for a Job of this very attempt (an earlier
        create whose answer was lost) adopts it, never starts it twice; one of another `kind`, or of another pool
        (`owns`), is a QosflowError."""
        from kubernetes.client.exceptions import ApiException

        try:
            return await self._acall(self.batch.create_namespaced_job, self.namespace, job, _doing=doing)
        except ApiException as e:
            if e.status != 409:
                raise
        cur = await self._acall(self.batch.read_namespaced_job, job["metadata"]["name"], self.namespace, _doing=doing)
        if (cur.metadata.annotations or {}).get(ANN_STAGE) != stage_id:
            raise QosflowError(f"Job {job['metadata']['name']} exists in {self.namespace} and belongs to another {kind}")
        if not self.owns(cur.metadata.labels, cur.metadata.annotations):
            raise QosflowError(f"Job {job['metadata']['name']} exists in {self.namespace} and belongs to another pool "
                               f"({(cur.metadata.annotations or {}).get(ANN_POOL) or (cur.metadata.labels or {}).get(LABEL_POOL)})")
        self.stats["adopted_409"] += 1
        return cur

    async def launch_unplaced(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None = None, *,
                              labels: dict[str, str] | None = None, cpu_cores: float | None = None,
                              mem_mb: float | None = None) -> StageHandle:
        """Start a pipeline run (no slot) as a Job of its own (`pipeline_manifests`). Its handle is a stage's: `wait`,
        `kill` (the Job is deleted: its pod gets SIGTERM, then SIGKILL after its grace period) and `adopt` (by any
        worker, from the Job's labels) work on it alike. A refusal of the API is the handle's `launch_error` (its wait
        reports it); an unreachable API raises `BackendUnreachable`."""
        doing = f"launch pipeline run {stage_id}"
        self._killed.pop(stage_id, None)
        job, secret = self.pipeline_manifests(stage_id, command, env, cwd, labels=labels, cpu_cores=cpu_cores, mem_mb=mem_mb)
        ref: dict[str, Any] = {"namespace": self.namespace, "jobs": [job["metadata"]["name"]], "podgroup": None, "secret": None,
                               "selector": f"{LABEL_STAGE}={label_value(stage_id)}", "expected_pods": 1, "nodes": [""],
                               "launch_error": None, "role": "pipeline"}

        async def create(step: dict[str, str]) -> None:
            cur = await self._create_job(job, stage_id, doing, "run")
            if secret is not None:
                step["what"] = f"set the owner of Secret {secret['metadata']['name']}"
                owner = [{"apiVersion": "batch/v1", "kind": "Job", "name": cur.metadata.name, "uid": cur.metadata.uid}]
                await self._acall(self.core.patch_namespaced_secret, secret["metadata"]["name"], self.namespace,
                                  {"metadata": {"ownerReferences": owner}}, _content_type="application/merge-patch+json", _doing=doing)

        return await self._launch_attempt(StageHandle(stage_id, self.name, "", ref), secret, doing, create)

    # ------------------------------------------------------------------ launch
    async def launch(self, spec: LaunchSpec) -> StageHandle:
        """Create the stage's Job(s). An unreachable API server raises `BackendUnreachable` (nothing or
        part of the stage was created: the same attempt id launched again adopts what exists if placed the same; placed
        otherwise, what the cut launch left is deleted and the handle's launch_error reports INFRA, `_stale_jobs`)."""
        from kubernetes.client.exceptions import ApiException

        doing = f"launch stage {spec.stage_id}"
        self._killed.pop(spec.stage_id, None)  # (an earlier kill of this attempt id does not cancel this launch)
        if self._capacity:  # its placeholder goes first (the node it brought is the stage's), and any in its way
            await self._clear_way(spec.placement.job_id, [spec.cluster.nodes[i].name for i in spec.placement.nodes], spec.stage_id)

        jobs, pg = self.manifests(spec)
        secret = self.secret_manifest(spec)
        ref: dict[str, Any] = {
            "namespace": self.namespace,
            "jobs": [j["metadata"]["name"] for j in jobs],
            "podgroup": None,
            "secret": None,  # (set once it is this attempt's: kill and the stage's end delete it)
            "selector": f"{LABEL_STAGE}={label_value(spec.stage_id)}",
            "expected_pods": sum(j["spec"]["parallelism"] for j in jobs),
            "nodes": [spec.cluster.nodes[i].name for i in spec.placement.nodes],
            "launch_error": None,
        }
        stale = await self._stale_jobs(spec.stage_id, jobs, doing)
        if stale:
            self._capacity_settling.pop(spec.placement.job_id, None)  # (no pod will come: placeholders may be made again)
            return await self._drop_stale_launch(spec, ref, stale, secret)

        async def create(step: dict[str, str]) -> None:
            if pg is not None:
                group, version = pg["apiVersion"].split("/")
                try:
                    await self._acall(self.custom.create_namespaced_custom_object, group, version, self.namespace, "podgroups", pg,
                                      _doing=doing)
                except ApiException as e:
                    if e.status != 409:
                        raise
                ref["podgroup"] = {"group": group, "version": version, "name": pg["metadata"]["name"]}
            owners = []
            for j in jobs:  # back to back: every pod of the gang exists before any can finish
                cur = await self._create_job(j, spec.stage_id, doing, "stage")
                owners.append({"apiVersion": "batch/v1", "kind": "Job", "name": cur.metadata.name, "uid": cur.metadata.uid})
            if secret is not None:  # owned by the Job(s): deleted with them (a Job's TTL, a kubectl delete) if not before
                step["what"] = f"set the owners of Secret {secret['metadata']['name']}"
                await self._acall(self.core.patch_namespaced_secret, secret["metadata"]["name"], self.namespace,
                                  {"metadata": {"ownerReferences": owners}}, _content_type="application/merge-patch+json", _doing=doing)
            if ref["podgroup"]:  # the PodGroup too (best effort: an account that may not patch PodGroups still runs gangs)
                try:
                    await self._acall(self.custom.patch_namespaced_custom_object, ref["podgroup"]["group"], ref["podgroup"]["version"],
                                      self.namespace, "podgroups", ref["podgroup"]["name"], {"metadata": {"ownerReferences": owners}},
                                      _content_type="application/merge-patch+json", _doing=doing)
                except ApiException as e:
                    log.debug("stage %s: PodGroup %s not owned by its Job(s): %s %s", spec.stage_id, ref["podgroup"]["name"], e.status, e.reason)

        try:
            handle = await self._launch_attempt(StageHandle(spec.stage_id, self.name, ref["nodes"][0], ref), secret, doing, create)
        except BaseException:
            self._capacity_settling.pop(spec.placement.job_id, None)  # (no pod will come: placeholders may be made again)
            raise
        if handle.ref.get("launch_error"):
            self._capacity_settling.pop(spec.placement.job_id, None)
        return handle

    async def _stale_jobs(self, stage_id: str, jobs: list[dict], doing: str) -> dict[str, str]:
        """The Jobs of attempt `stage_id` (this pool's) that an earlier launch of it left and that are not this launch's
        `jobs` as they are: another name (one Indexed Job then, one Job per node now, or the other way round), or the same
        name on other node(s) or with another placement. Name -> the node(s) its pods are pinned to. A launch cut short
        (the API went away between a gang's Job creates: BackendUnreachable) is launched again by the worker with the
        same attempt id, placed anew: the same placement adopts what exists (`_create_job`), another one must not."""
        from kubernetes.client.exceptions import ApiException

        sel = f"{LABEL_STAGE}={label_value(stage_id)}"
        try:
            found = (await self._acall(self.batch.list_namespaced_job, self.namespace, label_selector=sel, _doing=doing)).items
        except ApiException as e:  # (not looked: the launch goes on as before this check; its creates say any refusal)
            log.debug("stage %s: Jobs of an earlier launch not looked for: %s %s", stage_id, e.status, e.reason)
            return {}
        want = {j["metadata"]["name"]: _launch_key(j) for j in jobs}
        out: dict[str, str] = {}
        for cur in found:
            if (cur.metadata.annotations or {}).get(ANN_STAGE) != stage_id or not self.owns(cur.metadata.labels, cur.metadata.annotations):
                continue  # (another stage's or pool's: `_create_job` says so if its name is one of this launch's)
            if cur.metadata.deletion_timestamp is not None:
                continue
            have = _launch_key(self.api_client.sanitize_for_serialization(cur))
            if want.get(cur.metadata.name) != have:
                out[cur.metadata.name] = ",".join(have[2]) or "?"
        return out

    async def _drop_stale_launch(self, spec: LaunchSpec, ref: dict[str, Any], stale: Mapping[str, str],
                                 secret: dict | None) -> StageHandle:
        """Attempt `spec` was launched before, elsewhere (`_stale_jobs`), and that launch was cut short: its Jobs are
        deleted (with its Secret and PodGroup) and nothing is created; the handle's launch_error says so, its wait reports
        an infrastructure failure and the worker places the stage again under a new attempt id (the names of this one are
        taken until the deleted Jobs' pods are gone, which a wait of the new ones would count among theirs)."""
        said = ", ".join(f"{n} (on {nodes})" for n, nodes in sorted(stale.items()))
        ref["launch_error"] = (f"an earlier launch of this attempt, cut short, left Job(s) {said} that are not this launch's "
                               f"placement ({', '.join(ref['nodes'])}): deleted, and the stage is placed again")
        ref["jobs"] = sorted(set(ref["jobs"]) | set(stale))
        if secret is not None:
            ref["secret"] = secret["metadata"]["name"]
        if self.gang_scheduler:  # (the cut launch's PodGroup, owned by no Job yet)
            gs = GANG_SCHEDULERS[self.gang_scheduler]
            ref["podgroup"] = {"group": gs.group, "version": gs.version, "name": job_name(spec.stage_id)}
        log.warning("stage %s: %s", spec.stage_id, ref["launch_error"])
        handle = StageHandle(spec.stage_id, self.name, ref["nodes"][0], ref)
        await self._kill_cut(handle, "launch failed", reraise=(BackendUnreachable,))
        return handle

    async def _kill_cut(self, handle: StageHandle, reason: str, reraise: tuple[type, ...] = ()) -> None:
        """Delete what a launch cut short left (`_drop_stale_launch`, `adopt`); a failure (but `reraise`) is said and
        left to the handle's wait, which tries once more (`kill_left`): an adoption that raised stopped the worker's
        recovery of every other lease."""
        try:
            await self.kill(handle, reason=reason)
            handle.ref.pop("kill_left", None)
        except reraise:
            raise
        except Exception as exc:  # noqa: BLE001 - said; the wait tries again
            handle.ref["kill_left"] = reason
            log.warning("stage %s: could not delete its Job(s) %s yet (%s); tried again when its end is reported",
                        handle.stage_id, ", ".join(handle.ref.get("jobs") or []), exc)
        finally:
            self._killed.pop(handle.stage_id, None)

    async def _launch_attempt(self, handle: StageHandle, secret: dict | None, doing: str,
                              create: Callable[[dict[str, str]], Awaitable[None]]) -> StageHandle:
        """What `launch` and `launch_unplaced` share around their creation of Jobs (`create`): the attempt's Secret (if
        any) created first, as a pod started without it would fail (CreateContainerConfigError); a refusal of the API
        becomes the handle's `launch_error` (its wait reports it) and what the launch created is deleted; a
        QosflowError (a Job or Secret of another stage has this one's name) deletes the Secret made for this launch
        and is raised. `create` gets `{"what": ...}`, the step under way, which it may set: the launch_error names it
        unless it is "create"."""
        from kubernetes.client.exceptions import ApiException

        step = {"what": "create"}
        if secret is not None:
            self._launching.add(secret["metadata"]["name"])
        try:
            if secret is not None:
                step["what"] = f"create Secret {secret['metadata']['name']} (the worker's account needs get, list, create, patch and delete on secrets)"
                await self._put_secret(secret, handle.stage_id, doing)
                handle.ref["secret"] = secret["metadata"]["name"]
                step["what"] = "create"
            await create(step)
        except ApiException as e:
            what = step["what"]
            handle.ref["launch_error"] = (f"Kubernetes API answered {e.status} {e.reason}" + (f" to: {what}" if what != "create" else "")
                                          + (f": {e.refusal}" if hasattr(e, "refusal") else ""))
            await self.kill(handle, reason="launch failed")
            self._killed.pop(handle.stage_id, None)
        except QosflowError:
            await self._drop_secret(handle)
            raise
        finally:
            if secret is not None:
                self._launching.discard(secret["metadata"]["name"])
        return handle

    async def _put_secret(self, secret: dict, stage_id: str, doing: str) -> None:
        """Create the stage attempt's Secret; one left by an earlier launch of this attempt (same name,
        same stage) gets the current values."""
        from kubernetes.client.exceptions import ApiException

        name = secret["metadata"]["name"]
        try:
            await self._acall(self.core.create_namespaced_secret, self.namespace, secret, _doing=doing)
        except ApiException as e:
            if e.status != 409:
                raise
            cur = await self._acall(self.core.read_namespaced_secret, name, self.namespace, _doing=doing)
            ours = self.owns(cur.metadata.labels, cur.metadata.annotations)
            if (cur.metadata.annotations or {}).get(ANN_STAGE) != stage_id or not ours:
                raise QosflowError(f"Secret {name} exists in {self.namespace} and belongs to another {'stage' if ours else 'pool'}") from None
            await self._acall(self.core.patch_namespaced_secret, name, self.namespace, {"data": secret["data"]},
                              _content_type="application/merge-patch+json", _doing=doing)

    async def _drop_secret(self, handle: StageHandle) -> None:
        """Delete the stage attempt's Secret (its pods, started, have their environment)."""
        from kubernetes.client.exceptions import ApiException

        name = handle.ref.get("secret")
        if not name:
            return
        try:
            await self._acall(self.core.delete_namespaced_secret, name, handle.ref["namespace"], _doing=f"delete Secret {name}")
        except ApiException as e:
            if e.status != 404:
                raise
        handle.ref["secret"] = None

    async def ranks_exited_ok(self, handle: StageHandle, skip: Collection[int] = ()) -> set[int]:
        """A gang's pods (its selector) of rank > 0 (`pod_rank`) that Succeeded and are not being deleted. (LIST with
        resourceVersion "0": served from the API server's watch cache, not a quorum read of etcd: the worker asks every
        few seconds for each gang running, 25 such reads a second with 50 gangs.)"""
        pods = (await self._acall(self.core.list_namespaced_pod, handle.ref["namespace"], label_selector=handle.ref["selector"],
                                  resource_version="0")).items
        out: set[int] = set()
        for pod in pods:
            rank = pod_rank(pod)
            if rank is None or rank <= 0 or rank in skip or pod.metadata.deletion_timestamp is not None:
                continue
            if (pod.status.phase if pod.status else None) == "Succeeded":
                out.add(rank)
        return out

    async def adopt(self, stage_id: str, hosts: list[str] | None = None) -> StageHandle | None:
        """Find the Job(s) of an attempt a previous worker of this pool started (`owns`: never another pool's)."""
        sel = f"{LABEL_STAGE}={label_value(stage_id)}"
        jobs = (await self._acall(self.batch.list_namespaced_job, self.namespace, label_selector=sel)).items
        jobs = [j for j in jobs if (j.metadata.annotations or {}).get(ANN_STAGE) == stage_id and self.owns(j.metadata.labels, j.metadata.annotations)]
        if not jobs:
            return None
        wanted = secret_name(stage_id)
        refs = {e.value_from.secret_key_ref.name for j in jobs for c in (j.spec.template.spec.containers or []) for e in (c.env or [])
                if e.value_from is not None and e.value_from.secret_key_ref is not None}
        ref = {
            "namespace": self.namespace, "jobs": [j.metadata.name for j in jobs], "podgroup": _podgroup_of(jobs[0]), "selector": sel,
            "secret": wanted if wanted in refs else None,
            "expected_pods": sum(j.spec.parallelism or 1 for j in jobs),
            "nodes": (jobs[0].metadata.annotations or {}).get("qosflow.dev/nodes", "").split(","), "launch_error": None,
        }
        if (jobs[0].metadata.labels or {}).get(LABEL_ROLE) == "pipeline":
            ref["role"] = "pipeline"
        handle = StageHandle(stage_id, self.name, ref["nodes"][0], ref)
        missing = self._ranks_never_made(stage_id, jobs, ref)
        if missing:
            # a gang of one Job per node whose launch was cut between its creates (its worker died, or the API went
            # away and the worker stopped): its Jobs found were taken for the whole gang, and rank 0's pod ending was the
            # stage's success though the missing ranks never ran. Deleted; its wait reports an infrastructure failure
            ref["launch_error"] = (f"the gang's launch was cut short: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of its "
                                   f"{len(ref['nodes'])} never got a Job (found {', '.join(ref['jobs'])}); its Jobs are deleted")
            log.warning("stage %s: %s", stage_id, ref["launch_error"])
            await self._kill_cut(handle, "launch cut short")
        return handle

    def _ranks_never_made(self, stage_id: str, jobs: list, ref: Mapping[str, Any]) -> list[int]:
        """The ranks of a gang whose Jobs `jobs` (found by `adopt`) do not make: fewer pods than its nodes (the Jobs'
        "qosflow.dev/nodes"), the ranks no per-node Job's QOSFLOW_GANG_RANK names. [] for a whole gang, a single pod, a
        pipeline run, and a gang whose Jobs are old enough that a missing one may have finished and been deleted by
        `ttl_after_finished_s` (its pod then ended; counted as before)."""
        nodes = [n for n in ref["nodes"] if n]
        if ref.get("role") == "pipeline" or len(nodes) <= 1 or ref["expected_pods"] >= len(nodes):
            return []
        if self.ttl_after_finished_s is not None:
            import datetime

            now = datetime.datetime.now(datetime.timezone.utc)
            made = [j.metadata.creation_timestamp for j in jobs if j.metadata.creation_timestamp is not None]
            if not made or any((now - t).total_seconds() >= self.ttl_after_finished_s - 60 for t in made):
                log.warning("stage %s: its gang has %d pod(s) in its Job(s) %s for its %d nodes; a Job old enough for its "
                            "ttlSecondsAfterFinished may have ended and been deleted: the pods found are waited for",
                            stage_id, ref["expected_pods"], ", ".join(ref["jobs"]), len(nodes))
                return []
        found: set[int] = set()
        for j in jobs:
            if (j.spec.completion_mode or "") == "Indexed":
                found.update(range(j.spec.parallelism or 1))
                continue
            for c in (j.spec.template.spec.containers or []):
                for e in (c.env or []):
                    if e.name == "QOSFLOW_GANG_RANK" and e.value is not None and str(e.value).isdigit():
                        found.add(int(e.value))
        return [r for r in range(len(nodes)) if r not in found] or list(range(ref["expected_pods"], len(nodes)))

    # ------------------------------------------------------------------ wait
    async def wait(self, handle: StageHandle) -> ExitStatus:
        if handle.ref.get("launch_error"):
            if handle.ref.get("kill_left"):  # (what a cut launch left, not deleted then: `_kill_cut`)
                await self._kill_cut(handle, handle.ref["kill_left"])
            return ExitStatus(ExitKind.INFRA, None, f"launch failed: {handle.ref['launch_error']}")
        stop = self._stop.setdefault(handle.stage_id, threading.Event())
        try:
            st = await asyncio.to_thread(self._wait_sync, handle, stop)
        except asyncio.CancelledError:
            stop.set()
            self._stop.pop(handle.stage_id, None)  # (kept, one entry per stage whose wait the worker stopped)
            raise
        if not st.ok and st.kind is not ExitKind.CANCELLED:
            await self.kill(handle, reason=f"stage failed: {st.reason}")
            self._killed.pop(handle.stage_id, None)
        elif st.ok or handle.stage_id in self._killed:
            # the stage is over: its credentials and PodGroup go now, not with its Job an hour later
            # (ttlSecondsAfterFinished); a PodGroup was never deleted after a gang that succeeded.
            # (A wait stopped by the worker's exit keeps them: the pods run on, the next worker adopts them.)
            try:
                await self._drop_secret(handle)
                await self._drop_podgroup(handle)
            except Exception as exc:  # (API errors, an outage): the garbage collector takes them with the Job
                log.warning("stage %s: its Secret/PodGroup are left to be deleted with its Job: %s", handle.stage_id, exc)
            self._killed.pop(handle.stage_id, None)  # (reported: kept, it grew with every cancelled stage)
        self._stop.pop(handle.stage_id, None)
        return st

    def _wait_sync(self, handle: StageHandle, stop: threading.Event) -> ExitStatus:
        mine = {"watch": None, "nodes": set(), "checked": time.monotonic(), "poked": False}
        with self._node_lock:
            self._waiting[handle.stage_id] = mine
        try:
            with _quiet_retries():  # the watch's requests too
                return self._wait_loop(handle, stop)
        finally:
            with self._node_lock:
                if self._waiting.get(handle.stage_id) is mine:
                    del self._waiting[handle.stage_id]

    def _wait_loop(self, handle: StageHandle, stop: threading.Event) -> ExitStatus:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        ref = handle.ref
        ns, sel = ref["namespace"], ref["selector"]
        # ("ok": the pods seen Succeeded, still counted when deleted: a per-node Job of a gang finishes with its own pod,
        # and ttlSecondsAfterFinished deletes it, pod and all, while the other ranks run on)
        track: dict[str, Any] = {"unsched": {}, "notready": {}, "deleted": set(), "seen": set(), "ok": set()}
        outage: float | None = None  # since when the API has been unreachable
        refused: tuple[Any, Any] | None = None  # the API's last refusal to list the pods (403, 401, ...), and how many
        refusals = 0
        while not stop.is_set():
            try:
                lst = self._call(self.core.list_namespaced_pod, ns, label_selector=sel)
            except ApiException as e:
                # said once per kind of refusal (it was a warning every 0.5 s for as long as it lasted), tried
                # again less and less often (up to every 5 s)
                if (e.status, e.reason) != refused:
                    log.warning("Kubernetes cluster %r: the API answered %s %s to listing the pods of stage %s%s; qosflow keeps "
                                "trying", self.cluster_name, e.status, e.reason, handle.stage_id,
                                f" ({e.refusal})" if hasattr(e, "refusal") else "")
                    refused, refusals = (e.status, e.reason), 0
                refusals += 1
                stop.wait(min(5.0, 0.25 * refusals))
                continue
            except BackendUnreachable as e:  # (urllib3's retries ran out): the pods run on without us, so keep
                # waiting for them, saying so once per outage
                if outage is None:
                    outage = time.monotonic()
                    log.warning("Kubernetes cluster %r: cannot reach the API server at %s while waiting for stage %s (%s); "
                                "its pods run on, qosflow keeps looking", self.cluster_name, self._api_host, handle.stage_id,
                                getattr(e, "reason", None) or e)
                self.stats["wait_api_unreachable"] += 1
                stop.wait(min(5.0, 0.5 + 0.5 * (time.monotonic() - outage)))
                continue
            if outage is not None:
                log.warning("the Kubernetes API answers again after %.0f s; stage %s is followed again",
                            time.monotonic() - outage, handle.stage_id)
                outage = None
            if refused is not None:
                log.warning("the pods of stage %s are listed again (after %d refusal(s))", handle.stage_id, refusals)
                refused = None
            pods = {p.metadata.name: p for p in lst.items}
            me = self._waiting.get(handle.stage_id) or {}
            looked = time.monotonic()
            st = self._evaluate(handle, pods, track, check_nodes=True)
            if st is not None:
                return st
            w = watch.Watch()
            with self._node_lock:  # (a node deleted from now on stops this watch: `_poke_waits`)
                me.update(watch=w, nodes={p.spec.node_name for p in pods.values() if p.spec and p.spec.node_name}, checked=looked,
                          poked=False)
            if any(self._node_gone(n) for n in me.get("nodes", ())):
                continue  # (deleted while it looked: look again)

            @functools.wraps(self.core.list_namespaced_pod)
            def opened(*a: Any, **kw: Any) -> Any:
                # (a node deleted while the watch request was on its way: its Watch.stop() found no stream to stop yet)
                resp = self.core.list_namespaced_pod(*a, **kw)
                if me.get("poked") or any(self._node_gone(n) for n in me.get("nodes", ())):
                    with contextlib.suppress(Exception):
                        resp.close()
                        resp.release_conn()
                    me["poked"] = True
                    raise _Poked()
                return resp

            try:
                for ev in w.stream(opened, ns, label_selector=sel,
                                   resource_version=lst.metadata.resource_version, timeout_seconds=self._watch_timeout(track)):
                    pod = ev["object"]
                    if ev["type"] == "DELETED":
                        pods.pop(pod.metadata.name, None)
                        track["deleted"].add(pod.metadata.name)
                        if pod.status is not None and pod.status.phase == "Succeeded":
                            track["ok"].add(pod.metadata.name)
                    else:
                        pods[pod.metadata.name] = pod
                        if pod.spec and pod.spec.node_name and pod.spec.node_name not in me.get("nodes", ()):
                            with self._node_lock:
                                me["nodes"] = set(me.get("nodes", ())) | {pod.spec.node_name}
                            if self._node_gone(pod.spec.node_name):
                                break  # (bound to a node deleted meanwhile: list and look)
                    st = self._evaluate(handle, pods, track, check_nodes=False)
                    if st is not None or stop.is_set():
                        w.stop()
                        break
                if st is not None:
                    return st
            except ApiException as e:
                if e.status == 410:  # our resourceVersion expired: list again, then watch from there
                    self.stats["watch_410"] += 1
                    continue
                log.warning("watching pods of %s: %s %s", handle.stage_id, e.status, e.reason)
                time.sleep(0.2)
            except Exception as e:  # connection reset and friends: list again
                if not me.get("poked"):  # (stopped because a node of its pods was deleted: no warning, it looks at once)
                    log.warning("watch of %s broke: %s", handle.stage_id, e)
                    time.sleep(0.2)
            finally:
                with self._node_lock:
                    me["watch"] = None
        return ExitStatus(ExitKind.CANCELLED, None, self._killed.get(handle.stage_id, "wait stopped"))

    def _watch_timeout(self, track: dict) -> int:
        t = float(self.watch_timeout_s)
        now = time.monotonic()
        for since in track["unsched"].values():
            t = min(t, since + self.unschedulable_timeout_s - now + 0.2)
        for since in track["notready"].values():
            t = min(t, since + self.node_lost_grace_s - now + 0.2)
        if track["notready"]:
            t = min(t, 2.0)
        return max(1, int(t + 0.999))

    def _evaluate(self, handle: StageHandle, pods: dict[str, Any], track: dict, check_nodes: bool) -> ExitStatus | None:
        from kubernetes.client.exceptions import ApiException

        from qosflow.failures import classify_reason

        if handle.stage_id in self._killed:
            return ExitStatus(ExitKind.CANCELLED, None, f"cancelled: {self._killed[handle.stage_id]} (Job deleted)")
        expected = handle.ref["expected_pods"]
        now = time.monotonic()
        if pods and handle.ref.get("role") != "pipeline":
            self._saw_stage_priority(next(iter(pods.values())))
        track["seen"].update(pods)
        for name, pod in sorted(pods.items()):
            st = pod.status
            phase = st.phase if st else None
            node = pod.spec.node_name if pod.spec else None
            where = f"(pod {name}" + (f" on node {node})" if node else ")")
            cs = (st.container_statuses or []) if st else []
            if phase == "Succeeded":
                track.setdefault("ok", set()).add(name)
                continue
            if phase == "Failed":
                term = next((c.state.terminated for c in cs if c.state and c.state.terminated), None)
                if st.reason:  # Evicted, NodeLost, Shutdown...
                    return classify_reason(st.reason, f"{st.message or ''} {where}".strip(), term.exit_code if term else None)
                if term is not None and term.reason == "OOMKilled":
                    return classify_reason("OOMKilled", where, term.exit_code)
                # (a pod marked Failed by a controller: DeletionByPodGC, its node deleted, says so in a DisruptionTarget
                # condition while its containers still show running, as no kubelet reported their end)
                dis = next((c for c in (st.conditions or []) if c.type == "DisruptionTarget" and c.status == "True"), None)
                if dis is not None:
                    return classify_reason(dis.reason or "Evicted", f"{dis.message or ''} {where}".strip(), term.exit_code if term else None)
                if term is not None:
                    return classify_reason(term.reason or "Error", f"{(term.message or '').strip()} {where}".strip(), term.exit_code)
                return classify_reason("Error", f"the pod failed {where}")
            if phase == "Pending":
                waiting = next((c.state.waiting for c in cs if c.state and c.state.waiting), None)
                if waiting is not None and waiting.reason in ("ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "ErrImageNeverPull"):
                    ours = handle.ref.get("secret")
                    said = waiting.message or ""
                    if waiting.reason == "CreateContainerConfigError" and ours and (f'"{ours}"' in said or f"/{ours}" in said):
                        # qosflow's own Secret of the attempt is gone (deleted by hand, a namespace clean-up): not the
                        # user's mistake, so not the end of the stage; it runs again, its launch makes a new one
                        return ExitStatus(ExitKind.INFRA, None, f"the stage's credentials Secret {ours} is missing "
                                                                f"({waiting.message}) {where}".strip())
                    return classify_reason(waiting.reason, f"{waiting.message or ''} {where}".strip())
                sched = next((c for c in (st.conditions or []) if c.type == "PodScheduled"), None) if st else None
                if sched is not None and sched.status == "False" and sched.reason == "Unschedulable" and handle.ref.get("role") != "pipeline":
                    # (a pipeline run's pod waits for CPU as long as it takes: no other node would be better, and
                    # failing it would end the run)
                    since = track["unsched"].setdefault(name, now)
                    if now - since >= self.unschedulable_timeout_s:
                        return classify_reason("Unschedulable", f"{sched.message} {where} (waited {self.unschedulable_timeout_s:g}s)")
                else:
                    track["unsched"].pop(name, None)
            if check_nodes and node and phase in ("Pending", "Running"):
                # a node deleted from the cluster (its DELETED event, gone from a listing, or 404 now): its pods will not
                # run again (the pod garbage collector deletes them), reported at once; a node merely not Ready may come
                # back, and has node_lost_grace_s
                n = None if self._node_gone(node) else self._cached_node(node)
                if n is None and not self._node_gone(node):
                    try:
                        n = self._call(self.core.read_node, node)
                    except ApiException as e:
                        if e.status == 404:
                            self._nodes_deleted([node])
                    except Exception:
                        pass
                if self._node_gone(node):
                    return classify_reason("NodeLost", f"node {node} was deleted from the cluster: its pods will not run again {where}")
                ok = n is not None and _ready(n)
                if ok:
                    track["notready"].pop(node, None)
                else:
                    since = track["notready"].setdefault(node, now)
                    if now - since >= self.node_lost_grace_s:
                        return classify_reason("NodeLost", f"node {node} has not been Ready for {self.node_lost_grace_s:g}s {where}")
        ok = track.setdefault("ok", set())
        succeeded = len(ok)  # (with those deleted since they succeeded)
        if expected and succeeded >= expected:
            return ExitStatus(ExitKind.OK, 0, "")
        gone = track["deleted"] - set(pods) - ok
        if gone:
            return classify_reason("DeletionByPodGC", f"pod(s) {', '.join(sorted(gone))} deleted outside qosflow (drained or preempted?)")
        if check_nodes and not pods and track["seen"]:
            return ExitStatus(ExitKind.INFRA, None, f"the pods of Job(s) {', '.join(handle.ref['jobs'])} disappeared (Job deleted outside qosflow?)")
        return None

    # ------------------------------------------------------------------ control
    async def kill(self, handle: StageHandle, reason: str = "cancelled", grace: float | None = None) -> None:
        """Delete the stage's Job(s) (their pods go with them); `grace` becomes the DeleteOptions'
        gracePeriodSeconds (None: the pods' own terminationGracePeriodSeconds)."""
        from kubernetes.client.exceptions import ApiException

        self._killed.setdefault(handle.stage_id, reason)
        for jid, (_, _, sid) in list(self._capacity_settling.items()):  # (its pods will not be bound: placeholders may be made)
            if sid == handle.stage_id:
                del self._capacity_settling[jid]
        while len(self._killed) > KILLED_KEPT:
            self._killed.popitem(last=False)
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = max(0, int(grace))
        for name in handle.ref.get("jobs", []):
            try:
                await self._acall(self.batch.delete_namespaced_job, name, handle.ref["namespace"], body=body)
            except ApiException as e:
                if e.status != 404:
                    raise
        await self._drop_podgroup(handle)
        await self._drop_secret(handle)

    async def _drop_podgroup(self, handle: StageHandle) -> None:
        from kubernetes.client.exceptions import ApiException

        pg = handle.ref.get("podgroup")
        if pg:
            try:
                await self._acall(self.custom.delete_namespaced_custom_object, pg["group"], pg["version"], handle.ref["namespace"], "podgroups", pg["name"])
            except ApiException as e:
                if e.status != 404:
                    raise
            handle.ref["podgroup"] = None

    async def _pods_rank0_first(self, handle: StageHandle) -> list:
        pods = (await self._acall(self.core.list_namespaced_pod, handle.ref["namespace"], label_selector=handle.ref["selector"])).items
        return _rank0_first(pods)

    # ------------------------------------------------------------------ progress
    syncs_progress = True
    #: a log read per running stage and round: every 10 s, not 2, to spare the API server
    progress_sync_s = 10.0

    def progress_file(self, stage_id: str) -> str:
        return self._progress.path(stage_id)

    def drop_progress(self, stage_id: str) -> None:
        super().drop_progress(stage_id)
        self._progress_seen.pop(stage_id, None)

    async def sync_progress(self, handles: Sequence[StageHandle]) -> None:
        """Copy the progress lines rank 0's log gained since the last copy: the whole log the first time,
        then its last PROGRESS_TAIL_LINES lines (lines older than the last one copied are skipped)."""
        from kubernetes.client.exceptions import ApiException

        handles = [h for h in handles if h.backend == self.name and not h.ref.get("launch_error")]
        if not handles:
            return
        by_stage: dict[tuple[str, str], list] = {}  # (namespace, stage label) -> its pods: one list call per namespace
        for ns in {h.ref["namespace"] for h in handles}:
            try:
                pods = (await self._acall(self.core.list_namespaced_pod, ns, label_selector=MANAGED_SELECTOR)).items
            except (ApiException, BackendUnreachable, ValueError) as exc:
                log.debug("progress: listing pods in %s: %s", ns, exc)
                continue
            for p in pods:
                if self.owns(p.metadata.labels, p.metadata.annotations):
                    by_stage.setdefault((ns, (p.metadata.labels or {}).get(LABEL_STAGE, "")), []).append(p)

        async def one(handle: StageHandle) -> None:
            seen = self._progress_seen.get(handle.stage_id)
            pods = _rank0_first(by_stage.get((handle.ref["namespace"], label_value(handle.stage_id)), []))
            if not pods:
                return
            try:
                kw = {} if seen is None else {"tail_lines": PROGRESS_TAIL_LINES}
                text = await self._acall(self.core.read_namespaced_pod_log, pods[0].metadata.name, handle.ref["namespace"], **kw)
            except (ApiException, BackendUnreachable, ValueError) as exc:
                log.debug("progress of %s: %s", handle.stage_id, exc)
                return
            new = []
            for line in (text or "").splitlines():
                rec = _progress_line(line)
                if rec is None:
                    continue
                key = (rec[0], rec[1])
                if seen is not None and key <= seen:
                    continue
                new.append(rec[2])
                seen = key
            self._progress_seen[handle.stage_id] = seen if seen is not None else (-math.inf, -math.inf)
            self._progress.append(handle.stage_id, "".join(x + "\n" for x in new).encode())

        await asyncio.gather(*(one(h) for h in handles))

    async def logs(self, handle: StageHandle) -> AsyncIterator[str]:
        """The output of the stage's pods (rank 0 first), as the API has it now."""
        for p in await self._pods_rank0_first(handle):
            text = await self._acall(self.core.read_namespaced_pod_log, p.metadata.name, handle.ref["namespace"])
            for line in (text or "").splitlines():
                yield line

    async def aclose(self) -> None:
        if self._capacity:  # (its stages go back to the pool's queue: a node kept for them would be paid for nothing)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(self._drop_capacity_request(j, "the worker stopped") for j in list(self._capacity))), 10)
        self._stop_node_watch()
        self._pod_informer.stop()
        for ev in self._stop.values():
            ev.set()
        if self._sweep_task is not None and not self._sweep_task.done():
            self._sweep_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sweep_task
        await asyncio.to_thread(self.api_client.close)
        self._progress.close()


#: lines of a pod's log read for its progress after the first read (a stage echoes at most 2 a second)
PROGRESS_TAIL_LINES = 200
MANAGED_SELECTOR = "app.kubernetes.io/managed-by=qosflow"


def _launch_key(job: Mapping[str, Any]) -> tuple:
    """What a stage's Job (a manifest, or one read back: `ApiClient.sanitize_for_serialization`) runs where: the gang's
    nodes, the nodes its pods are pinned to, its pods' placement and their count; equal for a Job of the same launch."""
    meta = job.get("metadata") or {}
    spec = job.get("spec") or {}
    tpl = spec.get("template") or {}
    terms = ((((tpl.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    pinned = tuple(v for t in terms for e in (t.get("matchExpressions") or []) if e.get("key") == "kubernetes.io/hostname"
                   for v in (e.get("values") or ()))
    return ((meta.get("annotations") or {}).get("qosflow.dev/nodes"), ((tpl.get("metadata") or {}).get("annotations") or {}).get(ANN_PLACEMENT),
            pinned, spec.get("parallelism"), spec.get("completionMode") or "NonIndexed")  # (the API server's default)


def _podgroup_of(job) -> dict | None:
    """The PodGroup a Job's pods belong to (Volcano's or KAI's, as `manifests` writes them), for `adopt`."""
    tpl = job.spec.template
    ann = (tpl.metadata.annotations if tpl.metadata else None) or {}
    scheduler = tpl.spec.scheduler_name if tpl.spec else None
    for gs in GANG_SCHEDULERS.values():
        if scheduler == gs.scheduler_name and ann.get(gs.group_annotation):
            return {"group": gs.group, "version": gs.version, "name": ann[gs.group_annotation]}
    return None


def _rank0_first(pods: list) -> list:
    """A stage's pods in rank order (`pod_rank`: an Indexed Job's completion index, a per-node Job's QOSFLOW_GANG_RANK),
    rank 0 first. (By name, a gang of one Job per node came as -r0, -r1, -r10, -r2.)"""

    def rank(p) -> tuple[int, str]:
        r = pod_rank(p)
        return (r if r is not None else 0, p.metadata.name)

    return sorted(pods, key=rank)


def _progress_line(line: str) -> tuple[float, float, str] | None:
    """(time, step, the JSON) of a progress line a stage echoed to its log (`qosflow.progress.ECHO_PREFIX`)."""
    i = line.find(ECHO_PREFIX)  # (a log line may carry the runtime's timestamp first)
    if i < 0:
        return None
    body = line[i + len(ECHO_PREFIX):].strip()
    try:
        d = json.loads(body)
        return float(d["t"]), float(d["step"]), body
    except (ValueError, KeyError, TypeError):
        return None


def _ready(node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def pod_rank(pod: Any) -> int | None:
    """A stage pod's QOSFLOW_GANG_RANK: its value in the pod's env, else its Indexed Job's completion index."""
    for c in (getattr(pod.spec, "containers", None) or []):
        for e in (c.env or []):
            if e.name == "QOSFLOW_GANG_RANK" and e.value is not None:
                return int(e.value) if str(e.value).isdigit() else None
    idx = (pod.metadata.annotations or {}).get("batch.kubernetes.io/job-completion-index", "")
    return int(idx) if idx.isdigit() else None
