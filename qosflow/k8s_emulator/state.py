"""The emulator's object store and its controllers (job controller, scheduler, kubelet).

THIS IS AN EMULATOR, NOT KUBERNETES. It keeps Nodes, Pods, Jobs, Secrets, ConfigMaps (and custom
objects such as PodGroups) as the JSON the real API server serves, with resource versions and a
bounded event log for watches, and "runs" Jobs by creating their Pods, binding them to nodes (node affinity, node
selectors, no new pod on a cordoned node (spec.unschedulable), hostname anti-affinity, extended resources such as `nvidia.com/gpu`, each pod's requests as kube-scheduler
reserves them: init containers, sidecars, overhead; all-or-nothing groups for `schedulerName: volcano`) and moving them through their phases on a timer. No container
runs: by default a Running pod just "runs" for its annotated time; with `run_processes=True` the
emulated kubelet runs the pod's first container's command as a local process instead (no image,
no isolation: the host's interpreter and files, the pod's env with downward-API fields resolved),
and the pod ends with the process's exit code, so a real Prefect engine can run a real flow run
"through Kubernetes" in tests. A pod whose env names a missing Secret or key stays Pending in
CreateContainerConfigError until it exists (`container_env`); a garbage collector deletes objects
whose owners are all gone, and a pod garbage collector (kube-controller-manager's PodGC, `_collect_pods`) deletes
the pods of a node deleted from the cluster once it has been gone for `pod_gc_quarantine_s` (marked Failed with a
DisruptionTarget condition, reason DeletionByPodGC, first) and the oldest terminated pods beyond
`terminated_pod_gc_threshold`. Failures are injected through rules: OOMKilled, ImagePullBackOff,
Evicted, Unschedulable, a non-zero exit code, or a lost node (these kill a pod's process). Opt-in, a cluster-autoscaler
over one node group (`NodeGroup`, `Cluster(autoscaler=...)`) adds nodes for Unschedulable pods and deletes unneeded ones;
a pause container (`registry.k8s.io/pause:3.9`) runs until its pod is deleted.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import itertools
import os
import random
import re
import shutil
import string
import subprocess
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from qosflow.procgroup import poll_group, stop_group

ANN = "emulator.qosflow.dev/"
#: resource plural -> (apiVersion, kind, namespaced)
BUILTIN = {
    "nodes": ("v1", "Node", False),
    "namespaces": ("v1", "Namespace", False),
    "pods": ("v1", "Pod", True),
    "jobs": ("batch/v1", "Job", True),
    "secrets": ("v1", "Secret", True),
    "configmaps": ("v1", "ConfigMap", True),
    "priorityclasses": ("scheduling.k8s.io/v1", "PriorityClass", False),
}
#: kinds without a status (the API serves none)
NO_STATUS = {"secrets", "configmaps"}
#: a Secret's or ConfigMap's data key (the API's IsConfigKey)
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
#: the API server refuses a Secret whose data is larger than this (1 MiB)
SECRET_MAX_BYTES = 1024 * 1024
GROUP_OF = {"v1": "", "batch/v1": "batch", "scheduling.k8s.io/v1": "scheduling.k8s.io"}


def now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(t or time.time(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: the emulator's own random numbers (generated names, pod IPs): it runs in threads beside other code, which must not
#: see the global `random` state move under it (hypothesis warns when it changes while a strategy draws)
_RNG = random.Random()


def rand5() -> str:
    return "".join(_RNG.choices(string.ascii_lowercase + string.digits, k=5))


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}
        super().__init__(message)

    def status(self) -> dict:
        return {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "details": self.details, "code": self.code,
        }


# ---------------------------------------------------------------------- quantities & selectors
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity(q: Any) -> float:
    """A Kubernetes resource quantity ("500m", "16Gi", 4) as a float in base units."""
    if isinstance(q, (int, float)):
        return float(q)
    s = str(q).strip()
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)", s)
    if not m:
        raise ValueError(f"bad quantity {q!r}")
    num, suf = m.groups()
    if suf and suf not in _SUFFIX:
        raise ValueError(f"bad quantity suffix in {q!r}")
    return float(num) * (_SUFFIX[suf] if suf else 1.0)


_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_DNS1123 = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_SEL_TOKEN = re.compile(r"\s*(!=|==|=|>|<|!|\(|\)|,|[^\s!=><(),]+)")


def _bad_selector(msg: str) -> ApiError:
    return ApiError(400, "BadRequest", f"unable to parse requirement: {msg}")


def _label_key(key: str) -> str:
    """A label key as the API server checks it (apimachinery's IsQualifiedName)."""
    prefix, _, name = key.rpartition("/")
    if ("/" in key and not (prefix and len(prefix) <= 253 and re.fullmatch(_DNS1123, prefix))) \
            or not (len(name) <= 63 and re.fullmatch(_NAME, name)):
        raise _bad_selector(f'key: Invalid value: "{key}": name part must consist of alphanumeric characters, '
                            "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  "
                            "or 'my.name',  or '123-abc'), with an optional DNS subdomain prefix and '/'")
    return key


def _label_value(key: str, value: str) -> str:
    if value and not (len(value) <= 63 and re.fullmatch(_NAME, value)):
        raise _bad_selector(f'values[0][{key}]: Invalid value: "{value}": a valid label must be an empty string or '
                            "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                            "alphanumeric character (at most 63 characters)")
    return value


def parse_label_selector(sel: str | None):
    """A label selector's requirements, parsed as the API server parses them (apimachinery's
    labels.Parse): `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a)`, `k`, `!k`, `k>1`, `k<1`,
    joined by commas. Anything else -- a stray operator, an unclosed set, an invalid key or
    value -- is a 400 BadRequest, as a real cluster answers it."""
    reqs: list = []
    if not sel or not sel.strip():
        return reqs
    toks: list[str] = []
    pos = 0
    while pos < len(sel):
        m = _SEL_TOKEN.match(sel, pos)
        if not m or m.end() == pos:
            break
        if m.group(1):
            toks.append(m.group(1))
        pos = m.end()
    i = 0

    def take() -> str | None:
        nonlocal i
        t = toks[i] if i < len(toks) else None
        i += 1
        return t

    def word(t: str | None, what: str) -> str:
        if t is None or t in ("!=", "==", "=", ">", "<", "!", "(", ")", ","):
            raise _bad_selector(f"found '{t if t is not None else 'end of string'}', expected: {what}")
        return t

    while True:
        t = take()
        if t == "!":
            reqs.append((_label_key(word(take(), "identifier")), "!exists", set()))
        else:
            key = _label_key(word(t, "identifier"))
            op = toks[i] if i < len(toks) else None
            if op in (None, ","):
                reqs.append((key, "exists", set()))
            else:
                i += 1
                if op in ("=", "=="):
                    nxt = toks[i] if i < len(toks) else None
                    val = "" if nxt in (None, ",") else _label_value(key, word(take(), "identifier"))
                    reqs.append((key, "=", {val}))
                elif op == "!=":
                    nxt = toks[i] if i < len(toks) else None
                    val = "" if nxt in (None, ",") else _label_value(key, word(take(), "identifier"))
                    reqs.append((key, "!=", {val}))
                elif op in (">", "<"):
                    val = word(take(), "integer")
                    if not re.fullmatch(r"-?[0-9]+", val):
                        raise _bad_selector(f'values[0][{key}]: Invalid value: "{val}": for \'Gt\', \'Lt\' operators, the value must be an integer')
                    reqs.append((key, op, {val}))
                elif op in ("in", "notin"):
                    if take() != "(":
                        raise _bad_selector(f"found '{toks[i - 1] if i - 1 < len(toks) else 'end of string'}', expected: '('")
                    vals: set[str] = set()
                    while True:
                        v = take()
                        if v in (")", ","):  # an empty element: k in (), k in (a,)
                            vals.add("")
                        else:
                            vals.add(_label_value(key, word(v, "identifier")))
                            v = take()
                        if v == ")":
                            break
                        if v != ",":
                            raise _bad_selector(f"found '{v if v is not None else 'end of string'}', expected: ',' or ')'")
                    reqs.append((key, op, vals))
                else:
                    raise _bad_selector(f"found '{op}', expected: in, notin, =, ==, !=, gt, lt")
        t = take()
        if t is None:
            return reqs
        if t != ",":
            raise _bad_selector(f"found '{t}', expected: ',' or 'end of string'")


def labels_match(labels: dict, reqs) -> bool:
    for k, op, vals in reqs:
        v = labels.get(k)
        if op in ("=", "in") and v not in vals:
            return False
        if op in ("!=", "notin") and v in vals:
            return False
        if op == "exists" and k not in labels:
            return False
        if op == "!exists" and k in labels:
            return False
        if op in (">", "<"):  # the label must hold an integer, compared as one
            try:
                n, bound = int(v), int(next(iter(vals)))
            except (TypeError, ValueError):
                return False
            if not (n > bound if op == ">" else n < bound):
                return False
    return True


def _field(obj: dict, path: str) -> Any:
    cur: Any = obj
    for p in path.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    return cur


def fields_match(obj: dict, sel: str | None) -> bool:
    if not sel:
        return True
    for part in sel.split(","):
        if "!=" in part:
            k, v = part.split("!=", 1)
            if str(_field(obj, k.strip()) or "") == v.strip():
                return False
        elif "=" in part:
            k, v = re.split(r"==?", part, maxsplit=1)
            if str(_field(obj, k.strip()) or "") != v.strip():
                return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# ---------------------------------------------------------------------- the store
class Store:
    def __init__(self, window: int = 1000):
        self.rv = itertools.count(1000)
        self.current_rv = 999
        self.objs: dict[str, dict[tuple[str, str], dict]] = {}
        self.meta: dict[str, tuple[str, str, bool]] = dict(BUILTIN)
        #: (rv, plural, type, the object after, the object before: None for ADDED), as the API server's watch cache
        #: keeps the previous object so that a watch with a selector sees an object that leaves or enters it
        self.log: deque[tuple[int, str, str, dict, dict | None]] = deque()
        #: (plural, namespace, name) -> the object as its last event carried it (the next event's previous object)
        self._last: dict[tuple[str, str, str], dict] = {}
        self.window = window
        self.compacted_rv = 0  # events up to and including this rv are gone
        self.changed = asyncio.Event()
        #: watch streams open now, and opened in all (GET /emulator/state: tests wait on them, not on sleeps).
        #: A stream that ends with 410 Gone is counted closed before its client can read the 410
        self.watches_open = 0
        self.watches_opened = 0
        #: watch streams open now per resource (pods, nodes...)
        self.watches_by: dict[str, int] = {}
        #: explicit compactions (`compact`): they expire the open streams' versions too
        self.compactions = 0
        #: an idle watch stream sends a BOOKMARK (allowWatchBookmarks) or an empty chunk this often (the API server:
        #: a bookmark about every minute)
        self.bookmark_s = 5.0

    def table(self, plural: str) -> dict[tuple[str, str], dict]:
        return self.objs.setdefault(plural, {})

    def _emit(self, plural: str, etype: str, obj: dict) -> None:
        rv = next(self.rv)
        self.current_rv = rv
        obj["metadata"]["resourceVersion"] = str(rv)
        now = copy.deepcopy(obj)
        key = (plural, obj["metadata"].get("namespace", ""), obj["metadata"].get("name", ""))
        prev = None if etype == "ADDED" else self._last.get(key)
        if etype == "DELETED":
            self._last.pop(key, None)
        else:
            self._last[key] = now
        self.log.append((rv, plural, etype, now, prev))
        while len(self.log) > self.window:
            self.compacted_rv = self.log.popleft()[0]
        self.changed.set()
        self.changed = asyncio.Event()

    def compact(self) -> None:
        """Forget every event so far (as etcd compaction does): older watches get 410 Gone."""
        self.compacted_rv = self.current_rv
        self.log.clear()
        self.compactions += 1

    def get(self, plural: str, ns: str, name: str) -> dict:
        obj = self.table(plural).get((ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{self.resource_name(plural)} "{name}" not found', {"name": name, "kind": plural})
        return obj

    def resource_name(self, plural: str) -> str:
        api = self.meta.get(plural, ("", "", True))[0]
        group = GROUP_OF.get(api, api.split("/")[0])
        return f"{plural}.{group}" if group else plural

    def list(self, plural: str, ns: str | None = None, label_selector: str | None = None, field_selector: str | None = None) -> list[dict]:
        reqs = parse_label_selector(label_selector)
        return [
            o for (ons, _), o in sorted(self.table(plural).items())
            if (ns is None or ons == ns) and labels_match(o["metadata"].get("labels") or {}, reqs) and fields_match(o, field_selector)
        ]

    def create(self, plural: str, ns: str, obj: dict) -> dict:
        api, kind, namespaced = self.meta.get(plural, (obj.get("apiVersion", ""), obj.get("kind", ""), True))
        obj = copy.deepcopy(obj)
        md = obj.setdefault("metadata", {})
        if not md.get("name"):
            if md.get("generateName"):
                md["name"] = md["generateName"] + rand5()
            else:
                raise ApiError(422, "Invalid", f"{kind} \"\" is invalid: metadata.name: Required value: name or generateName is required")
        name = md["name"]
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, \'-\' or \'.\'')
        if plural == "secrets":
            obj = _secret_on_write(obj, name)
            md = obj["metadata"]
        if plural == "priorityclasses":
            _check_priority_class(obj, name, self.table(plural))
        if plural == "pods":
            self._admit_priority(obj, name)
        if plural == "jobs":  # (the API server's default, as a Job read back has it)
            obj.setdefault("spec", {}).setdefault("completionMode", "NonIndexed")
        key = (ns if namespaced else "", name)
        if key in self.table(plural):
            raise ApiError(409, "AlreadyExists", f'{self.resource_name(plural)} "{name}" already exists',
                           {"name": name, "group": GROUP_OF.get(api, api.split("/")[0]), "kind": plural})
        obj["apiVersion"], obj["kind"] = obj.get("apiVersion") or api, obj.get("kind") or kind
        if namespaced:
            md["namespace"] = ns
        md.setdefault("labels", {})
        md.setdefault("annotations", {})
        md["uid"] = str(uuid.uuid4())
        md["creationTimestamp"] = now_iso()
        md["generation"] = 1
        if plural not in NO_STATUS:
            obj.setdefault("status", {})
        self.table(plural)[key] = obj
        self._emit(plural, "ADDED", obj)
        return obj

    def _admit_priority(self, pod: dict, name: str) -> None:
        """The Priority admission plugin: a new pod's `spec.priorityClassName` resolved to `spec.priority` (and
        `spec.preemptionPolicy`) from its PriorityClass; a pod naming none gets the class marked `globalDefault`, if
        any, else priority 0. A class that does not exist is refused (403 Forbidden, as the plugin does), and so is a
        `spec.priority` given that is not the class's value."""
        spec = pod.setdefault("spec", {})
        classes = self.table("priorityclasses")
        cls_name = spec.get("priorityClassName")
        if cls_name:
            cls = classes.get(("", cls_name))
            if cls is None:
                raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: no PriorityClass with name {cls_name} was found')
        else:
            cls = next((c for _, c in sorted(classes.items()) if c.get("globalDefault")), None)
        value = int(cls["value"]) if cls is not None else 0
        if spec.get("priority") is not None and spec["priority"] != value:
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: the integer value of priority ({spec["priority"]}) must not be '
                                             f"provided in pod spec; priority admission controller computed {value} from the given "
                                             "PriorityClass name")
        if cls is not None:
            spec["priorityClassName"] = cls["metadata"]["name"]
            spec["preemptionPolicy"] = spec.get("preemptionPolicy") or cls.get("preemptionPolicy") or "PreemptLowerPriority"
        else:
            spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        spec["priority"] = value

    def replace(self, plural: str, ns: str, name: str, obj: dict, *, status_only: bool = False) -> dict:
        cur = self.get(plural, ns, name)
        want = (obj.get("metadata") or {}).get("resourceVersion")
        if want and want != cur["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {self.resource_name(plural)} "{name}": the object has been modified; please apply your changes to the latest version and try again',
                           {"name": name, "kind": plural})
        new = copy.deepcopy(obj)
        if status_only:
            new = {**cur, "status": new.get("status", {})}
        md = new.setdefault("metadata", {})
        if md.get("uid") and md["uid"] != cur["metadata"].get("uid"):
            raise ApiError(422, "Invalid", f'{cur.get("kind", plural)} "{name}" is invalid: metadata.uid: Invalid value: "{md["uid"]}": field is immutable',
                           {"name": name, "kind": plural})
        # (the API server keeps what it set: a creationTimestamp sent in an update or a patch is ignored, as
        # the registry's BeforeUpdate restores the old one; the uid it refuses to change, above)
        for k in ("uid", "creationTimestamp", "namespace", "name"):
            if k in cur["metadata"]:
                md[k] = cur["metadata"][k]
        if plural == "secrets":
            new = _secret_on_write(new, name)
        self.table(plural)[(cur["metadata"].get("namespace", ""), name)] = new
        self._emit(plural, "MODIFIED", new)
        return new

    def update(self, plural: str, obj: dict) -> None:
        """Controller-side in-place change (already mutated): bump the version, tell the watchers."""
        self._emit(plural, "MODIFIED", obj)

    def delete(self, plural: str, ns: str, name: str, preconditions: dict | None = None) -> dict:
        """Delete an object; DeleteOptions' `preconditions` (uid, resourceVersion) that the object does not
        meet fail it with 409 Conflict, as the API server's storage does."""
        obj = self.get(plural, ns, name)
        md = obj["metadata"]
        for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            want = (preconditions or {}).get(field)
            if want is not None and want != md.get(field):
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {self.resource_name(plural)} "{name}": Precondition failed: '
                                                f'{label} in precondition: {want}, {label} in object meta: {md.get(field)}',
                               {"name": name, "kind": plural})
        del self.table(plural)[(obj["metadata"].get("namespace", ""), name)]
        self._emit(plural, "DELETED", obj)
        return obj


def _check_priority_class(obj: dict, name: str, classes: dict) -> None:
    """A PriorityClass as the API server validates it: an integer `value` of at most 1,000,000,000 (higher ones are
    the system's), `preemptionPolicy` PreemptLowerPriority or Never, one `globalDefault` class at most."""
    value = obj.get("value")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(422, "Invalid", f'PriorityClass.scheduling.k8s.io "{name}" is invalid: value: Required value')
    if value > 1_000_000_000:
        raise ApiError(422, "Invalid", f'PriorityClass.scheduling.k8s.io "{name}" is invalid: value: Forbidden: maximum allowed value of a '
                                       "user defined priority is 1000000000")
    if obj.get("preemptionPolicy", "PreemptLowerPriority") not in ("PreemptLowerPriority", "Never"):
        raise ApiError(422, "Invalid", f'PriorityClass.scheduling.k8s.io "{name}" is invalid: preemptionPolicy: Unsupported value: '
                                       f'"{obj["preemptionPolicy"]}": supported values: "Never", "PreemptLowerPriority"')
    if obj.get("globalDefault"):
        other = next((c["metadata"]["name"] for c in classes.values() if c.get("globalDefault")), None)
        if other:
            raise ApiError(422, "Invalid", f'PriorityClass.scheduling.k8s.io "{name}" is invalid: globalDefault: Invalid value: true: '
                                           f"globalDefault is already set by {other}")
    obj.setdefault("preemptionPolicy", "PreemptLowerPriority")
    obj.setdefault("globalDefault", False)


# ---------------------------------------------------------------------- controllers
#: the label the emulated cluster-autoscaler puts on the nodes of its node group (a cloud provider's node pool label)
NODE_GROUP_LABEL = "emulator.qosflow.dev/node-group"


def is_pause_image(image: str) -> bool:
    """A pause container's image (registry.k8s.io/pause:3.9, k8s.gcr.io/pause, .../pause): it runs until its pod is
    deleted (the cluster-overprovisioner's placeholders)."""
    ref = (image or "").split("@", 1)[0]
    if ":" in ref.rsplit("/", 1)[-1]:  # (a tag, not a registry's port)
        ref = ref[: ref.rfind(":")]
    return ref == "pause" or ref.endswith("/pause")


@dataclass
class NodeGroup:
    """An emulated cluster-autoscaler over one node group (a cloud node pool), opt-in: `Cluster(autoscaler=NodeGroup(...))`.

    As the real cluster-autoscaler: a pod Pending with the condition PodScheduled=False reason Unschedulable that would
    fit on an empty node made from `template` (the emulated scheduler's own filter, `Cluster._bindable`: node selector,
    node affinity, resources, cordons) triggers a scale-up: after `scale_up_delay_s` (its scan interval plus the cloud's
    provisioning time) enough new nodes for the pods waiting (first fit on template nodes), at most `max` in the group,
    named `{name}-XXXXX` and labelled `emulator.qosflow.dev/node-group: {name}`, join Ready. Each pod triggers one
    scale-up (the real autoscaler counts the node it asked for as upcoming until max-node-provision-time). A node of
    the group with no pod bound to it but DaemonSets' (Pending or Running) for `scale_down_unneeded_s` is deleted
    (its --scale-down-unneeded-time, 10 min upstream), down to `min`. Nodes the test adds with the group's label are
    the group's too. The autoscaler's Events (TriggeredScaleUp) are not written: the emulator keeps no Events; its
    doings are in `Cluster.autoscaler_log` and GET /emulator/state."""

    template: dict
    min: int = 0
    max: int = 1
    scale_up_delay_s: float = 1.0
    scale_down_unneeded_s: float = 30.0
    name: str = "gpu-pool"

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"node group {self.name!r}: need 0 <= min <= max, got min={self.min} max={self.max}")
        if self.scale_up_delay_s < 0 or self.scale_down_unneeded_s < 0:
            raise ValueError(f"node group {self.name!r}: delays must be at least 0")

    def node(self, name: str) -> dict:
        """A node of the group: the template, named `name`, with the group's label."""
        node = copy.deepcopy(self.template)
        md = node.setdefault("metadata", {})
        md["name"] = name
        md["labels"] = {**(md.get("labels") or {}), "kubernetes.io/hostname": name, NODE_GROUP_LABEL: self.name}
        return node


#: kube-controller-manager's --terminated-pod-gc-threshold default
TERMINATED_POD_GC_THRESHOLD = 12500
#: the emulator's PodGC quarantine of a missing node (upstream: 40 s, a constant of the controller), short for tests
POD_GC_QUARANTINE_S = 5.0


class Cluster:
    """The store plus the emulated control plane (job controller, scheduler, kubelets, garbage collectors).

    `pod_gc_quarantine_s`: how long a node bound pods name must stay missing before the pod garbage collector deletes
    those pods (upstream 40 s; here 5 s by default, still longer than a client watching the nodes needs to see the
    node's deletion); `terminated_pod_gc_threshold`: terminated (Succeeded/Failed) pods kept before the oldest are
    deleted (upstream's --terminated-pod-gc-threshold, 12500; 0 or less: never); `autoscaler`: a `NodeGroup`, the
    emulated cluster-autoscaler (off by default)."""

    def __init__(self, window: int = 1000, tick_s: float = 0.02, start_delay_s: float = 0.05, run_processes: bool = False,
                 pod_gc_quarantine_s: float = POD_GC_QUARANTINE_S, terminated_pod_gc_threshold: int = TERMINATED_POD_GC_THRESHOLD,
                 autoscaler: NodeGroup | None = None):
        self.store = Store(window)
        #: the emulated cluster-autoscaler (`NodeGroup`), or None (the default: nodes come and go only by hand)
        self.autoscaler = autoscaler
        #: what it did: {"t", "action": "scale-up"/"scale-down", "node", "pods": [pod names that triggered it]}
        self.autoscaler_log: list[dict[str, Any]] = []
        self._unschedulable_since: dict[str, float] = {}  # pod uid -> first seen Unschedulable and helped by the group
        self._scaled_for: set[str] = set()  # pod uids a scale-up was made for
        self._unneeded_since: dict[str, float] = {}  # node of the group -> since when no pod needs it
        self.tick_s = tick_s
        self.start_delay_s = start_delay_s
        self.run_processes = run_processes
        self.pod_gc_quarantine_s = float(pod_gc_quarantine_s)
        self.terminated_pod_gc_threshold = int(terminated_pod_gc_threshold)
        #: PodGC: a missing node that bound pods name -> when it was first seen missing (time.monotonic())
        self._missing_nodes: dict[str, float] = {}
        #: pods the pod garbage collector deleted, by cause (upstream's pod_gc_collector_force_delete_pods_total)
        self.pod_gc: dict[str, int] = {"orphaned": 0, "terminated": 0}
        #: the job controller's memory of a Job's pods (its job-tracking finalizer): job uid -> {pod uid: (phase, index)}
        #: as last seen, and the ends of the pods gone since ({"succeeded": n, "failed": n, "indexes": {...}})
        self._job_pods_seen: dict[str, dict[str, tuple[str | None, str | None]]] = {}
        self._job_pods_gone: dict[str, dict[str, Any]] = {}
        #: Job uid -> when (monotonic) it finished (Complete or Failed): the TTL-after-finished controller's clock
        self._job_finished: dict[str, float] = {}
        self._logdir = tempfile.mkdtemp(prefix="qosflow-k8s-emulator-") if run_processes else None
        self.rules: list[dict] = []  # failure rules applied to new pods
        self.faults: list[dict] = []  # HTTP faults (method, path regex, status, count)
        #: "VERB resource" (LIST nodes, WATCH nodes, GET pods...) -> requests and response body bytes served
        self.traffic: dict[str, dict[str, int]] = {}
        #: every API request served, in RBAC's terms: (user, verb, group, resource, subresource, namespace, allowed) -> how
        #: many (`rbac.request_attributes`; user "" for a request without a token: the emulator's admin)
        self.requests: dict[tuple[str, str, str, str, str, str, bool], int] = {}
        #: RBAC in force (`rbac.Authorizer`), or None: every request allowed. It judges the requests of token users only
        self.rbac: Any = None
        #: bearer token -> user name (`POST /emulator/tokens`): a request with a token of no user gets 401
        self.tokens: dict[str, str] = {}
        self.timeline: dict[str, dict[str, Any]] = {}  # pod uid -> private lifecycle data
        self._stopping: list[subprocess.Popen] = []  # processes of deleted pods being stopped (SIGTERM, grace period)

    # -------------------------------------------------------------- nodes
    def add_node(self, node: dict) -> dict:
        node = copy.deepcopy(node)
        md = node.setdefault("metadata", {})
        md.setdefault("labels", {}).setdefault("kubernetes.io/hostname", md["name"])
        st = node.setdefault("status", {})
        st.setdefault("capacity", dict(st.get("allocatable", {})))
        st.setdefault("conditions", [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                                      "lastHeartbeatTime": now_iso(), "lastTransitionTime": now_iso()}])
        return self.store.create("nodes", "", node)

    def lose_node(self, name: str) -> None:
        node = self.store.get("nodes", "", name)
        for c in node["status"]["conditions"]:
            if c["type"] == "Ready":
                c.update(status="Unknown", reason="NodeStatusUnknown", message="Kubelet stopped posting node status.", lastTransitionTime=now_iso())
        node["spec"] = {**node.get("spec", {}), "taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now_iso()}]}
        self.store.update("nodes", node)
        for pod in self.store.list("pods"):
            if pod["spec"].get("nodeName") == name and pod["status"].get("phase") in ("Pending", "Running"):
                self._finish(pod, "Failed", reason="NodeLost", message=f"Node {name} which was running pod {pod['metadata']['name']} is unresponsive",
                             disruption="DeletionByTaintManager", exit_code=None)

    @staticmethod
    def node_ready(node: dict) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    # -------------------------------------------------------------- jobs
    def on_job_created(self, job: dict) -> None:
        job["status"] = {"startTime": now_iso(), "active": 0, "succeeded": 0, "failed": 0, "ready": 0}
        self.store.update("jobs", job)

    def _job_pods(self, job: dict) -> list[dict]:
        uid = job["metadata"]["uid"]
        return [p for p in self.store.list("pods", job["metadata"]["namespace"])
                if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences", []))]

    def _make_pod(self, job: dict, index: int | None) -> None:
        tpl = copy.deepcopy(job["spec"]["template"])
        md = tpl.setdefault("metadata", {})
        jname, uid = job["metadata"]["name"], job["metadata"]["uid"]
        labels = md.setdefault("labels", {})
        labels.update({"job-name": jname, "controller-uid": uid, "batch.kubernetes.io/job-name": jname, "batch.kubernetes.io/controller-uid": uid})
        ann = md.setdefault("annotations", {})
        spec = tpl["spec"]
        if index is not None:
            ann["batch.kubernetes.io/job-completion-index"] = str(index)
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            spec.setdefault("hostname", f"{jname}-{index}")
            for c in spec.get("containers", []):
                c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
        md["name"] = f"{jname}-{index}-{rand5()}" if index is not None else f"{jname}-{rand5()}"
        md["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": jname, "uid": uid, "controller": True, "blockOwnerDeletion": True}]
        tpl["apiVersion"], tpl["kind"] = "v1", "Pod"
        pod = self.store.create("pods", job["metadata"]["namespace"], tpl)
        self.on_pod_created(pod)

    def _sync_job(self, job: dict) -> None:
        st = job.setdefault("status", {})
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in st.get("conditions", [])):
            return
        spec = job["spec"]
        completions = int(spec.get("completions") or 1)
        parallelism = int(spec.get("parallelism") or 1)
        backoff = int(spec.get("backoffLimit", 6))
        indexed = spec.get("completionMode") == "Indexed"
        pods = self._job_pods(job)
        active = [p for p in pods if p["status"].get("phase") in (None, "Pending", "Running")]
        succeeded = [p for p in pods if p["status"].get("phase") == "Succeeded"]
        failed = [p for p in pods if p["status"].get("phase") == "Failed"]
        gone = self._count_gone_pods(job, pods)
        new = {"active": len(active), "succeeded": len(succeeded) + gone["succeeded"], "failed": len(failed) + gone["failed"],
               "ready": sum(1 for p in active if p["status"].get("phase") == "Running")}
        cond = None
        if new["failed"] > backoff:
            cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}
            for p in active:  # the job controller terminates what is left
                self.store.delete("pods", p["metadata"]["namespace"], p["metadata"]["name"])
            new["active"] = 0
        elif new["succeeded"] >= completions:
            cond = {"type": "Complete", "status": "True", "reason": "CompletionsReached", "message": "Reached expected number of succeeded pods"}
        else:
            want = min(parallelism, completions - new["succeeded"]) - len(active)
            if want > 0:
                if indexed:
                    taken = {int(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]) for p in active + succeeded}
                    taken |= {int(i) for i in gone["indexes"]}
                    free = [i for i in range(completions) if i not in taken][:want]
                else:
                    free = [None] * want
                for i in free:  # every pod of the stage is created in the same step
                    try:
                        self._make_pod(job, i)
                    except ApiError:  # (refused by admission, e.g. a missing PriorityClass: FailedCreate, tried again next step)
                        continue
                    new["active"] += 1
        changed = any(st.get(k) != v for k, v in new.items()) or cond is not None
        st.update(new)
        if cond is not None:
            cond.update(lastProbeTime=now_iso(), lastTransitionTime=now_iso())
            st.setdefault("conditions", []).append(cond)
            self._job_finished[job["metadata"]["uid"]] = time.monotonic()
            if cond["type"] == "Complete":
                st["completionTime"] = now_iso()
        if changed:
            self.store.update("jobs", job)

    def _count_gone_pods(self, job: dict, pods: list[dict]) -> dict[str, Any]:
        """The ends of the Job's pods that are gone (deleted by the pod garbage collector, by hand...), which the
        job controller still counts, as its job-tracking finalizer lets it count a pod before the pod can go: one
        last seen Succeeded as succeeded (its completion index done), any other as failed (the job controller counts
        a pod deleted before it succeeded as failed). Without this, a Job whose pods were garbage-collected would start
        them again as if they had never run."""
        uid = job["metadata"]["uid"]
        seen = self._job_pods_seen.setdefault(uid, {})
        gone = self._job_pods_gone.setdefault(uid, {"succeeded": 0, "failed": 0, "indexes": set()})
        now = {p["metadata"]["uid"]: (p["status"].get("phase"), (p["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index"))
               for p in pods}
        for puid, (phase, index) in list(seen.items()):
            if puid not in now:
                del seen[puid]
                if phase == "Succeeded":
                    gone["succeeded"] += 1
                    if index is not None:
                        gone["indexes"].add(index)
                else:
                    gone["failed"] += 1
        seen.update(now)
        return gone

    def _forget_deleted_jobs(self) -> None:
        live = {j["metadata"]["uid"] for j in self.store.list("jobs")}
        for memo in (self._job_pods_seen, self._job_pods_gone, self._job_finished):
            for uid in [u for u in memo if u not in live]:
                del memo[uid]

    def _expire_finished_jobs(self) -> None:
        """kube-controller-manager's TTL-after-finished controller: a Job finished (Complete or Failed) for its
        `spec.ttlSecondsAfterFinished` is deleted, its pods with it (propagation Background, as upstream)."""
        now = time.monotonic()
        for job in self.store.list("jobs"):
            ttl = (job.get("spec") or {}).get("ttlSecondsAfterFinished")
            done = self._job_finished.get(job["metadata"]["uid"])
            if ttl is None or done is None or now - done < float(ttl):
                continue
            try:
                gone = self.store.delete("jobs", job["metadata"]["namespace"], job["metadata"]["name"])
            except ApiError:  # (deleted meanwhile)
                continue
            self.on_job_deleted(gone, "Background")

    def on_job_deleted(self, job: dict, propagation: str | None, grace: Any = None) -> None:
        """The garbage collector's part in a Job's deletion: with Background/Foreground propagation its
        pods go now (other dependents, e.g. a Secret it owns, at the collector's next pass), stopped with
        the DeleteOptions' `grace` (`on_pod_deleted`); orphaning (the API's default for batch/v1 Jobs)
        removes the Job from every dependent's ownerReferences."""
        uid = job["metadata"]["uid"]
        if propagation in ("Background", "Foreground"):
            for p in self.store.list("pods", job["metadata"]["namespace"]):
                if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences", [])):
                    self.store.delete("pods", p["metadata"]["namespace"], p["metadata"]["name"])
                    self.on_pod_deleted(p, grace)
            return
        for plural in list(self.store.objs):
            for o in self.store.list(plural, job["metadata"]["namespace"]):
                refs = o["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):
                    o["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                    self.store.update(plural, o)

    def _collect_garbage(self) -> None:
        """Kubernetes' garbage collector: an object whose ownerReferences all name owners (by uid)
        that no longer exist is deleted (a Secret owned by a deleted Job, a deleted Job's pods)."""
        live = {o["metadata"].get("uid") for t in self.store.objs.values() for o in t.values()}
        for plural in list(self.store.objs):
            for o in list(self.store.table(plural).values()):
                refs = o["metadata"].get("ownerReferences") or []
                if refs and not any(r.get("uid") in live for r in refs):
                    self.store.delete(plural, o["metadata"].get("namespace", ""), o["metadata"]["name"])

    def _collect_pods(self) -> None:
        """kube-controller-manager's pod garbage collector (PodGC), at every controller step (upstream: every 20 s):

        * terminated pods (Succeeded, Failed) beyond `terminated_pod_gc_threshold` (if above 0) are deleted, evicted ones
          first, then the oldest (creationTimestamp, then name);
        * orphaned pods: a pod bound to a node that does not exist puts that node in quarantine; once it has been missing
          for `pod_gc_quarantine_s` (upstream 40 s), the pods bound to it are deleted, each first marked Failed (if not
          already Succeeded or Failed) with the condition `{"type": "DisruptionTarget", "status": "True", "reason":
          "DeletionByPodGC", "message": "PodGC: node no longer exists"}` in its status, as upstream's
          markFailedAndDeletePodWithCondition patches it (watchers see that MODIFIED event, then DELETED).

        Deletions are forced (gracePeriodSeconds 0): a pod's process (`run_processes`) is SIGKILLed."""
        if self.terminated_pod_gc_threshold > 0:
            ended = [p for p in self.store.list("pods") if p["status"].get("phase") in ("Succeeded", "Failed")]
            excess = len(ended) - self.terminated_pod_gc_threshold
            if excess > 0:
                ended.sort(key=lambda p: (not (p["status"].get("phase") == "Failed" and p["status"].get("reason") == "Evicted"),
                                          p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
                for p in ended[:excess]:
                    self._force_delete_pod(p)
                    self.pod_gc["terminated"] += 1
        nodes = {n["metadata"]["name"] for n in self.store.list("nodes")}
        t = time.monotonic()
        pods = self.store.list("pods")
        for p in pods:
            node = p["spec"].get("nodeName")
            if node and node not in nodes:
                self._missing_nodes.setdefault(node, t)
        deleted: set[str] = set()
        for node, since in list(self._missing_nodes.items()):
            if node in nodes:  # (back within its quarantine: not deleted after all)
                del self._missing_nodes[node]
            elif t - since >= self.pod_gc_quarantine_s:
                del self._missing_nodes[node]
                deleted.add(node)
        for p in pods:
            if p["spec"].get("nodeName") in deleted:
                st = p["status"]
                if st.get("phase") not in ("Succeeded", "Failed"):
                    st["phase"] = "Failed"
                    cond = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
                            "message": "PodGC: node no longer exists", "lastTransitionTime": now_iso()}
                    conds = st.setdefault("conditions", [])
                    at = next((i for i, c in enumerate(conds) if c.get("type") == "DisruptionTarget"), None)
                    if at is None:
                        conds.append(cond)
                    else:
                        conds[at] = cond
                    self.store.update("pods", p)
                self._force_delete_pod(p)
                self.pod_gc["orphaned"] += 1

    def _force_delete_pod(self, pod: dict) -> None:
        self.store.delete("pods", pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        self.on_pod_deleted(pod, 0)

    # -------------------------------------------------------------- pods
    def on_pod_deleted(self, pod: dict, grace: Any = None) -> None:
        """A pod deleted through the API: its process (`run_processes`) is stopped as a kubelet stops a deleted
        pod's containers: SIGTERM, then SIGKILL after the DeleteOptions' gracePeriodSeconds (`grace`; None: the
        pod's terminationGracePeriodSeconds, default 30; 0: SIGKILL at once). See `_reap_deleted`."""
        tl = self.timeline.get(pod["metadata"].get("uid", ""))
        if tl is None:
            return
        if grace is None:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        try:
            tl["grace"] = max(0.0, float(grace))
        except (TypeError, ValueError):
            tl["grace"] = 30.0

    def on_pod_created(self, pod: dict) -> None:
        ann = pod["metadata"].get("annotations") or {}
        behaviour = {
            "run_s": float(ann.get(ANN + "run-seconds", 0.3)),
            "exit_code": int(ann.get(ANN + "exit-code", 0)),
            "fail": ann.get(ANN + "fail"),
            "fail_after_s": float(ann.get(ANN + "fail-after-s", 0.1)),
        }
        image = ((pod["spec"].get("containers") or [{}])[0].get("image") or "")
        if is_pause_image(image):  # a pause container sleeps until its pod is deleted (no process runs, even with run_processes)
            behaviour.update(run_s=float("inf"), pause=True)
        if ".invalid/" in image or image.endswith(".invalid"):  # RFC 2606: a registry that cannot exist
            behaviour["fail"] = "ImagePullBackOff"
        for rule in self.rules:
            if rule.get("times", 1) <= 0:
                continue
            if not labels_match(pod["metadata"].get("labels") or {}, parse_label_selector(rule.get("selector"))):
                continue
            if rule.get("node") and rule["node"] not in _affinity_nodes(pod):
                continue
            rule["times"] = rule.get("times", 1) - 1
            if rule.get("fail"):
                behaviour["fail"] = rule["fail"]
            if "after_s" in rule:
                behaviour["fail_after_s"] = float(rule["after_s"])
            if "exit_code" in rule:
                behaviour["exit_code"] = int(rule["exit_code"])
            if "run_s" in rule:
                behaviour["run_s"] = float(rule["run_s"])
        self.timeline[pod["metadata"]["uid"]] = {"created": time.monotonic(), **behaviour}
        pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self.store.update("pods", pod)

    def _finish(self, pod: dict, phase: str, *, reason: str | None = None, message: str | None = None,
                exit_code: int | None = 0, container_reason: str | None = None, disruption: str | None = None) -> None:
        self._kill_process(pod["metadata"]["uid"])
        st = pod["status"]
        st["phase"] = phase
        if reason:
            st["reason"] = reason
        if message:
            st["message"] = message
        conds = [c for c in st.get("conditions", []) if c["type"] not in ("Ready", "ContainersReady")]
        conds += [{"type": "Ready", "status": "False", "reason": "PodCompleted" if phase == "Succeeded" else "PodFailed", "lastTransitionTime": now_iso()}]
        if disruption:
            conds.append({"type": "DisruptionTarget", "status": "True", "reason": disruption, "message": message or "", "lastTransitionTime": now_iso()})
        st["conditions"] = conds
        if exit_code is not None:
            term = {"exitCode": exit_code, "reason": container_reason or ("Completed" if exit_code == 0 else "Error"), "finishedAt": now_iso()}
            st["containerStatuses"] = [
                {"name": c["name"], "ready": False, "restartCount": 0, "image": c.get("image", ""), "imageID": "", "state": {"terminated": term}}
                for c in pod["spec"].get("containers", [])
            ]
        self.store.update("pods", pod)

    def _bindable(self, pod: dict, nodes: list[dict], extra_load: dict[str, dict[str, float]]) -> tuple[dict | None, str]:
        """A node this pod fits on, or None and the scheduler's message."""
        wanted = _affinity_nodes(pod)
        sel = pod["spec"].get("nodeSelector") or {}
        req = _requests(pod)
        anti = _anti_affinity(pod)
        why: dict[str, int] = {}
        for node in nodes:
            name = node["metadata"]["name"]
            labels = node["metadata"].get("labels", {})
            if wanted is not None and name not in wanted or any(labels.get(k) != v for k, v in sel.items()):
                why["node(s) didn't match Pod's node affinity/selector"] = why.get("node(s) didn't match Pod's node affinity/selector", 0) + 1
                continue
            if not self.node_ready(node):
                why["node(s) had untolerated taint {node.kubernetes.io/unreachable: }"] = why.get("node(s) had untolerated taint {node.kubernetes.io/unreachable: }", 0) + 1
                continue
            if (node.get("spec") or {}).get("unschedulable") and not _tolerates_unschedulable(pod):
                # (cordoned: the scheduler's NodeUnschedulable filter; pods already bound there run on)
                why["node(s) were unschedulable"] = why.get("node(s) were unschedulable", 0) + 1
                continue
            if anti and any(labels_match(p["metadata"].get("labels", {}), anti) and p["spec"].get("nodeName") == name
                            and p["status"].get("phase") in ("Pending", "Running") for p in self.store.list("pods", pod["metadata"]["namespace"])):
                why["node(s) didn't match pod anti-affinity rules"] = why.get("node(s) didn't match pod anti-affinity rules", 0) + 1
                continue
            alloc = {k: quantity(v) for k, v in node["status"].get("allocatable", {}).items()}
            used = self._used(name)
            for k, v in extra_load.get(name, {}).items():
                used[k] = used.get(k, 0.0) + v
            short = [k for k, v in req.items() if used.get(k, 0.0) + v > alloc.get(k, 0.0) + 1e-9]
            if short:
                for k in short:
                    why[f"Insufficient {k}"] = why.get(f"Insufficient {k}", 0) + 1
                continue
            return node, ""
        parts = ", ".join(f"{n} {w}" for w, n in sorted(why.items()))
        return None, f"0/{len(nodes)} nodes are available: {parts}. preemption: 0/{len(nodes)} nodes are available: {len(nodes)} Preemption is not helpful for scheduling."

    def _used(self, node_name: str) -> dict[str, float]:
        used: dict[str, float] = {}
        for p in self.store.list("pods"):
            if p["spec"].get("nodeName") == node_name and p["status"].get("phase") in ("Pending", "Running"):
                for k, v in _requests(p).items():
                    used[k] = used.get(k, 0.0) + v
        return used

    def _bind(self, pod: dict, node: dict) -> None:
        pod["spec"]["nodeName"] = node["metadata"]["name"]
        st = pod["status"]
        st["conditions"] = [c for c in st.get("conditions", []) if c["type"] != "PodScheduled"] + [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}]
        st.pop("reason", None)
        st.pop("message", None)
        st["hostIP"] = "10.0.0.1"
        st["containerStatuses"] = [{"name": c["name"], "ready": False, "restartCount": 0, "image": c.get("image", ""), "imageID": "",
                                    "state": {"waiting": {"reason": "ContainerCreating"}}} for c in pod["spec"].get("containers", [])]
        self.timeline[pod["metadata"]["uid"]]["bound"] = time.monotonic()
        self.store.update("pods", pod)

    def _unschedulable(self, pod: dict, message: str) -> None:
        conds = pod["status"].get("conditions", [])
        cur = next((c for c in conds if c["type"] == "PodScheduled"), None)
        if cur and cur.get("message") == message:
            return
        pod["status"]["conditions"] = [c for c in conds if c["type"] != "PodScheduled"] + [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message, "lastTransitionTime": now_iso()}]
        self.store.update("pods", pod)

    def _schedule(self) -> None:
        nodes = self.store.list("nodes")
        pending = [p for p in self.store.list("pods") if not p["spec"].get("nodeName") and p["status"].get("phase") == "Pending"]
        groups: dict[tuple[str, str], list[dict]] = {}
        for pod in pending:
            tl = self.timeline.get(pod["metadata"]["uid"], {})
            if tl.get("fail") == "Unschedulable":
                self._unschedulable(pod, f"0/{len(nodes)} nodes are available: {len(nodes)} Insufficient nvidia.com/gpu. (injected by the emulator)")
                continue
            g = (pod["metadata"].get("annotations") or {}).get("scheduling.k8s.io/group-name")
            if g and pod["spec"].get("schedulerName") == "volcano":
                groups.setdefault((pod["metadata"]["namespace"], g), []).append(pod)
                continue
            node, why = self._bindable(pod, nodes, {})
            if node is not None:
                self._bind(pod, node)
            else:
                self._unschedulable(pod, why)
        for (ns, g), pods in groups.items():  # gang: all of the group binds, or none of it
            try:
                pg = self.store.get("podgroups", ns, g)
                min_member = int(pg.get("spec", {}).get("minMember", len(pods)))
            except ApiError:
                min_member = len(pods)
            if len(pods) < min_member:
                continue
            load: dict[str, dict[str, float]] = {}
            plan = []
            for pod in pods:
                node, why = self._bindable(pod, nodes, load)
                if node is None:
                    for p in pods:
                        self._unschedulable(p, f"pod group {g}: {why}")
                    plan = []
                    break
                plan.append((pod, node))
                nl = load.setdefault(node["metadata"]["name"], {})
                for k, v in _requests(pod).items():
                    nl[k] = nl.get(k, 0.0) + v
            for pod, node in plan:
                self._bind(pod, node)

    # -------------------------------------------------------------- the cluster-autoscaler (opt-in)
    def _autoscale(self) -> None:
        """One pass of the emulated cluster-autoscaler (`NodeGroup`): scale up for unschedulable pods an empty template
        node would take, scale down nodes of the group that no pod needs."""
        g = self.autoscaler
        assert g is not None
        t = time.monotonic()
        nodes = self.store.list("nodes")
        group = [n for n in nodes if (n["metadata"].get("labels") or {}).get(NODE_GROUP_LABEL) == g.name]
        pods = self.store.list("pods")
        live = {p["metadata"]["uid"] for p in pods}
        for uid in [u for u in self._unschedulable_since if u not in live]:
            del self._unschedulable_since[uid]
        self._scaled_for &= live
        # scale-up: pods the scheduler found no node for (PodScheduled False, Unschedulable) that a new node would take
        probe = g.node(f"{g.name}-template")  # (the empty node the autoscaler simulates the pods on, Ready as a new node is)
        probe["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        want: list[dict] = []
        for p in pods:
            uid = p["metadata"]["uid"]
            if p["spec"].get("nodeName") or p["status"].get("phase") != "Pending" or uid in self._scaled_for:
                continue
            cond = next((c for c in p["status"].get("conditions") or [] if c.get("type") == "PodScheduled"), None)
            if not cond or cond.get("status") != "False" or cond.get("reason") != "Unschedulable":
                continue
            if self._bindable(p, [probe], {})[0] is None:  # (a bigger node than the group's would be needed, or another label)
                continue
            since = self._unschedulable_since.setdefault(uid, t)
            if t - since >= g.scale_up_delay_s:
                want.append(p)
        if want:
            room = g.max - len(group)
            # first fit of the waiting pods on new template nodes, as the autoscaler's binpacking estimator
            load: list[dict[str, float]] = []
            took: list[list[str]] = []
            for p in want:
                req = _requests(p)
                alloc = {k: quantity(v) for k, v in probe["status"].get("allocatable", {}).items()}
                for i, nl in enumerate(load):
                    if all(nl.get(k, 0.0) + v <= alloc.get(k, 0.0) + 1e-9 for k, v in req.items()):
                        break
                else:
                    if len(load) >= room:
                        continue  # (the group is at its max: the real autoscaler says NotTriggerScaleUp)
                    load.append({})
                    took.append([])
                    i = len(load) - 1
                for k, v in req.items():
                    load[i][k] = load[i].get(k, 0.0) + v
                took[i].append(p["metadata"]["uid"])
                self._scaled_for.add(p["metadata"]["uid"])
            names = {p["metadata"]["uid"]: p["metadata"]["name"] for p in want}
            for uids in took:
                while True:
                    name = f"{g.name}-{rand5()}"
                    if ("", name) not in self.store.table("nodes"):
                        break
                self.add_node(g.node(name))
                self.autoscaler_log.append({"t": time.time(), "action": "scale-up", "node": name, "pods": [names[u] for u in uids]})
            group = [n for n in self.store.list("nodes") if (n["metadata"].get("labels") or {}).get(NODE_GROUP_LABEL) == g.name]
        # scale-down: a node of the group with no pod but DaemonSets' for scale_down_unneeded_s
        needed = set()
        for p in pods:
            owners = p["metadata"].get("ownerReferences") or []
            if p["spec"].get("nodeName") and p["status"].get("phase") in (None, "Pending", "Running") \
                    and not any(r.get("kind") == "DaemonSet" for r in owners):
                needed.add(p["spec"]["nodeName"])
        names_now = {n["metadata"]["name"] for n in group}
        for name in [n for n in self._unneeded_since if n not in names_now or n in needed]:
            del self._unneeded_since[name]
        count = len(group)
        for n in sorted(group, key=lambda n: n["metadata"]["name"]):
            name = n["metadata"]["name"]
            if name in needed:
                continue
            since = self._unneeded_since.setdefault(name, t)
            if t - since >= g.scale_down_unneeded_s and count > g.min:
                self.store.delete("nodes", "", name)
                del self._unneeded_since[name]
                count -= 1
                self.autoscaler_log.append({"t": time.time(), "action": "scale-down", "node": name, "pods": []})

    def _kubelet(self) -> None:
        t = time.monotonic()
        for pod in self.store.list("pods"):
            tl = self.timeline.get(pod["metadata"]["uid"])
            phase = pod["status"].get("phase")
            if tl is None or "bound" not in tl or phase not in ("Pending", "Running"):
                continue
            fail = tl.get("fail")
            if phase == "Pending":
                if t - tl["bound"] < self.start_delay_s:
                    continue
                if fail in ("ImagePullBackOff", "ErrImagePull"):
                    image = pod["spec"]["containers"][0].get("image", "")
                    stage = "ErrImagePull" if t - tl["bound"] < self.start_delay_s * 3 else "ImagePullBackOff"
                    cur = pod["status"]["containerStatuses"][0]["state"].get("waiting", {}).get("reason")
                    if cur != stage:
                        msg = (f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": not found' if stage == "ErrImagePull"
                               else f'Back-off pulling image "{image}"')
                        for cs in pod["status"]["containerStatuses"]:
                            cs["state"] = {"waiting": {"reason": stage, "message": msg}}
                        self.store.update("pods", pod)
                    continue
                try:  # the containers' environment, as the kubelet makes it before it creates them
                    envs = [container_env(self.store, pod, c) for c in pod["spec"].get("containers", [])]
                except _ConfigError as exc:
                    # as a kubelet does: the pod stays Pending, its containers waiting with
                    # CreateContainerConfigError, and the next sync tries again (the Secret may be created later)
                    cur = pod["status"]["containerStatuses"][0]["state"].get("waiting", {})
                    if (cur.get("reason"), cur.get("message")) != ("CreateContainerConfigError", str(exc)):
                        for cs in pod["status"]["containerStatuses"]:
                            cs["state"] = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                        self.store.update("pods", pod)
                    continue
                pod["status"]["phase"] = "Running"
                pod["status"]["startTime"] = now_iso()
                pod["status"]["podIP"] = "10.1.0.%d" % _RNG.randint(2, 250)
                for cs in pod["status"]["containerStatuses"]:
                    cs.update(ready=True, started=True, state={"running": {"startedAt": now_iso()}})
                pod["status"]["conditions"] = [c for c in pod["status"].get("conditions", []) if c["type"] != "Ready"] + [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now_iso()}]
                tl["running"] = t
                if self.run_processes and not tl.get("pause"):
                    self._start_process(pod, tl, envs[0] if envs else {})
                self.store.update("pods", pod)
                continue
            ran = t - tl["running"]
            if fail in ("OOMKilled", "Evicted", "NodeLost", "Error") and ran >= tl["fail_after_s"]:
                if fail == "OOMKilled":
                    self._finish(pod, "Failed", exit_code=137, container_reason="OOMKilled")
                elif fail == "Evicted":
                    self._finish(pod, "Failed", reason="Evicted", message="The node was low on resource: memory. Threshold quantity: 100Mi, available: 42Mi.",
                                 exit_code=137, container_reason="ContainerStatusUnknown", disruption="TerminationByKubelet")
                elif fail == "NodeLost":
                    self.lose_node(pod["spec"]["nodeName"])
                else:
                    self._finish(pod, "Failed", exit_code=tl["exit_code"] or 1)
                continue
            proc = tl.get("proc")
            if proc is not None:
                # (the container's other processes end with its main one, as when a container's pid 1 exits: its
                # background children were left running, and a deleted pod's stop found its main process gone)
                code = poll_group(proc)
                if code is not None:
                    code = 128 - code if code < 0 else code  # killed by a signal: 128 + signal, as a container runtime says
                    self._finish(pod, "Succeeded" if code == 0 else "Failed", exit_code=code)
                continue
            if "spawn_error" in tl:
                self._finish(pod, "Failed", exit_code=128, container_reason="StartError", message=tl["spawn_error"])
                continue
            if ran >= tl["run_s"]:
                code = tl["exit_code"]
                self._finish(pod, "Succeeded" if code == 0 else "Failed", exit_code=code)

    # -------------------------------------------------------------- processes (run_processes=True)
    def _start_process(self, pod: dict, tl: dict, container_env: dict[str, str]) -> None:
        c = pod["spec"]["containers"][0]
        # (the kubelet expands $(VAR) in command and args too, from all of the container's variables: `expand_env`)
        argv = [expand_env(str(a), container_env) for a in list(c.get("command") or []) + list(c.get("args") or [])]
        env = {**os.environ, **container_env}
        log = os.path.join(self._logdir or tempfile.gettempdir(), f"{pod['metadata']['uid']}.log")
        tl["log"] = log
        try:
            with open(log, "ab") as out:
                tl["proc"] = subprocess.Popen(argv, env=env, cwd=c.get("workingDir") or None, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
        except (OSError, ValueError) as exc:
            tl["spawn_error"] = f"failed to start container process {argv!r}: {exc}"

    def _kill_process(self, uid: str) -> None:
        proc = (self.timeline.get(uid) or {}).get("proc")
        if proc is not None:
            stop_group(proc, 0)  # (SIGKILL at once, as the kubelet's stop of a deleted pod here)

    def _reap_deleted(self) -> None:
        """A deleted pod's process is stopped (the kubelet stops its containers): deleted through the API
        (`on_pod_deleted`), with SIGTERM and its grace period (in a thread of its own: the control plane goes
        on meanwhile), as a real kubelet does, so that the process can end cleanly (a Prefect engine reports its
        state, a pipeline cancels the stage runs it waited for); otherwise (the job controller, the garbage
        collector) SIGKILL at once."""
        live = {p["metadata"]["uid"] for p in self.store.list("pods")}
        for uid, tl in list(self.timeline.items()):
            if tl.get("proc") is not None and uid not in live:
                grace = float(tl.get("grace") or 0.0)
                if grace > 0:
                    import threading

                    self._stopping.append(tl["proc"])
                    threading.Thread(target=stop_group, args=(tl["proc"], grace), daemon=True, name=f"emulator-stop-{uid[:8]}").start()
                else:
                    self._kill_process(uid)
                tl.pop("proc", None)

    def shutdown(self) -> None:
        """Kill every pod process left and remove their logs."""
        for uid in list(self.timeline):
            self._kill_process(uid)
        for proc in self._stopping:  # (deleted pods still in their grace period)
            stop_group(proc, 0)
        if self._logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)

    def logs(self, pod: dict) -> str:
        tl = self.timeline.get(pod["metadata"]["uid"], {})
        if tl.get("log"):
            try:
                with open(tl["log"], errors="replace") as fh:
                    return fh.read()
            except OSError:
                return ""
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value", "") for e in c.get("env", []) if "value" in e}
        lines = [
            f"[qosflow k8s emulator] pod {pod['metadata']['name']} on node {pod['spec'].get('nodeName')}: no container runs here",
            f"[qosflow k8s emulator] image {c.get('image')} command {c.get('command', []) + c.get('args', [])}",
            f"QOSFLOW_PLACEMENT={env.get('QOSFLOW_PLACEMENT', '')}",
        ]
        if "running" not in tl:
            return ""
        return "\n".join(lines) + "\n"

    async def run(self) -> None:
        while True:
            try:
                for job in self.store.list("jobs"):
                    self._sync_job(job)
                self._schedule()
                if self.autoscaler is not None:
                    self._autoscale()
                self._kubelet()
                self._collect_garbage()
                self._collect_pods()
                self._expire_finished_jobs()
                self._forget_deleted_jobs()
                if self.run_processes:
                    self._reap_deleted()
                for job in self.store.list("jobs"):
                    self._sync_job(job)
            except Exception:  # pragma: no cover - keep the control plane alive
                import logging

                logging.getLogger("qosflow.k8s_emulator").exception("controller step failed")
            await asyncio.sleep(self.tick_s)


def _secret_on_write(obj: dict, name: str) -> dict:
    """A Secret as the API server stores it: `data` values are base64 (400 when one is not, as the
    API's decoding of the request says), `stringData` (write-only) is merged into `data` over it and
    dropped, keys must be config keys (422), the whole at most 1 MiB (422), `type` defaults to Opaque."""
    obj = copy.deepcopy(obj)
    data = dict(obj.get("data") or {})
    for k, v in data.items():
        try:
            base64.b64decode(str(v), validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "BadRequest", f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{k}]') from None
    for k, v in (obj.pop("stringData", None) or {}).items():
        data[k] = base64.b64encode(str(v).encode()).decode()
    for k in data:
        if not _CONFIG_KEY.fullmatch(k) or len(k) > 253:
            raise ApiError(422, "Invalid", f'Secret "{name}" is invalid: data[{k}]: Invalid value: "{k}": a valid config key must consist of '
                                           "alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', "
                                           "regex used for validation is '[-._a-zA-Z0-9]+')")
    if sum(len(base64.b64decode(v)) for v in data.values()) > SECRET_MAX_BYTES:
        raise ApiError(422, "Invalid", f'Secret "{name}" is invalid: data: Too long: must have at most {SECRET_MAX_BYTES} bytes')
    obj["data"] = data
    obj.setdefault("type", "Opaque")
    return obj


class _ConfigError(Exception):
    """A container's environment cannot be made (the kubelet's CreateContainerConfigError)."""


def _config_value(store: Store, ns: str, ref: dict, plural: str) -> str | None:
    """The value a secretKeyRef / configMapKeyRef names; None if it is optional and missing."""
    kind = "Secret" if plural == "secrets" else "ConfigMap"
    name, key = ref.get("name") or "", ref.get("key") or ""
    obj = store.table(plural).get((ns, name))
    if obj is None:
        if ref.get("optional"):
            return None
        raise _ConfigError(f'{kind.lower()} "{name}" not found')
    data = obj.get("data") or {}
    if key not in data:
        if plural == "configmaps" and key in (obj.get("binaryData") or {}):
            return base64.b64decode(obj["binaryData"][key]).decode(errors="replace")
        if ref.get("optional"):
            return None
        raise _ConfigError(f"couldn't find key {key} in {kind} {ns}/{name}")
    return base64.b64decode(data[key]).decode(errors="replace") if plural == "secrets" else str(data[key])


def container_env(store: Store, pod: dict, container: dict) -> dict[str, str]:
    """The environment the kubelet gives a container: `envFrom` (Secrets, ConfigMaps, with their
    prefix) first, then `env` in order (`value`, downward-API `fieldRef`, `secretKeyRef`,
    `configMapKeyRef`). A missing Secret/ConfigMap or key that is not optional raises `_ConfigError`
    with the kubelet's message. A `value`'s $(VAR) references to a variable defined before it are expanded, $$ is a
    `$`, and a reference to none is left as it is (`expand_env`, the kubelet's dependent variables)."""
    ns = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        ref, plural = (src["secretRef"], "secrets") if src.get("secretRef") else (src.get("configMapRef") or {}, "configmaps")
        obj = store.table(plural).get((ns, ref.get("name") or ""))
        if obj is None:
            if ref.get("optional"):
                continue
            raise _ConfigError(f'{"secret" if plural == "secrets" else "configmap"} "{ref.get("name")}" not found')
        for k, v in (obj.get("data") or {}).items():
            env[(src.get("prefix") or "") + k] = base64.b64decode(v).decode(errors="replace") if plural == "secrets" else str(v)
    for e in container.get("env") or []:
        if "valueFrom" not in e:
            env[e["name"]] = expand_env(str(e.get("value", "")), env)
            continue
        vf = e["valueFrom"] or {}
        if vf.get("secretKeyRef"):
            v = _config_value(store, ns, vf["secretKeyRef"], "secrets")
        elif vf.get("configMapKeyRef"):
            v = _config_value(store, ns, vf["configMapKeyRef"], "configmaps")
        else:
            v = _downward(pod, ((vf.get("fieldRef") or {}).get("fieldPath") or ""))
        if v is not None:
            env[e["name"]] = v
    return env


def expand_env(value: str, env: dict[str, str]) -> str:
    """`value` with its $(VAR) references to `env` expanded, as the kubelet expands a container's env values
    (Kubernetes' third_party/forked/golang/expansion): `$$` is a `$`, `$(NAME)` of a variable defined is its value, one
    of no variable is left as written, an opening `$(` never closed is kept and what follows it read on, a `$` before
    anything else is kept."""
    if "$" not in value:
        return value
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        ch = value[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = value[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = value.find(")", i + 2)
            if end < 0:  # (not closed: "$(" kept, and the rest read on, as the kubelet does: a later "$$" is still a "$")
                out.append("$(")
                i += 2
                continue
            name = value[i + 2:end]
            out.append(env[name] if name in env else value[i:end + 1])
            i = end + 1
        else:
            out.append("$")
            i += 1
    return "".join(out)


def _downward(pod: dict, path: str) -> str | None:
    """The value of a downward-API fieldRef (metadata.name/namespace/uid, metadata.labels['k'],
    metadata.annotations['k'], spec.nodeName, spec.serviceAccountName, status.podIP)."""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        v = (pod["metadata"].get(m.group(1)) or {}).get(m.group(2))
        return None if v is None else str(v)
    v = _field(pod, path)
    return None if v is None else str(v)


def _requests(pod: dict) -> dict[str, float]:
    """What the scheduler reserves for a pod, as kube-scheduler's noderesources plugin does: per resource, its
    containers' requests summed, or its largest init container's if larger (init containers run one at a time, before
    the others), where a restartable init container (a sidecar) keeps running and so adds to both; plus the pod's
    overhead (RuntimeClass). A limit without a request stands for the request (the API server's default)."""

    def of(c: dict) -> dict[str, float]:
        res = c.get("resources") or {}
        return {k: quantity(v) for k, v in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items()}

    spec = pod["spec"]
    steady: dict[str, float] = {}  # (once running: the containers and every sidecar)
    for c in spec.get("containers", []):
        for k, v in of(c).items():
            steady[k] = steady.get(k, 0.0) + v
    sidecars: dict[str, float] = {}  # (those started so far: they run beside each later init container)
    peak: dict[str, float] = {}  # (the most one init container needs, with the sidecars started before it)
    for c in spec.get("initContainers") or []:
        req = of(c)
        if c.get("restartPolicy") == "Always":
            for k, v in req.items():
                sidecars[k] = sidecars.get(k, 0.0) + v
                steady[k] = steady.get(k, 0.0) + v
        else:
            for k, v in req.items():
                peak[k] = max(peak.get(k, 0.0), v + sidecars.get(k, 0.0))
    out = {k: max(steady.get(k, 0.0), peak.get(k, 0.0)) for k in steady.keys() | peak.keys()}
    for k, v in (spec.get("overhead") or {}).items():
        out[k] = out.get(k, 0.0) + quantity(v)
    return out


def _tolerates_unschedulable(pod: dict) -> bool:
    """Whether the pod tolerates a cordoned node's taint (node.kubernetes.io/unschedulable:NoSchedule), as a
    DaemonSet's pods do."""
    for t in pod["spec"].get("tolerations") or []:
        key_ok = t.get("key") == "node.kubernetes.io/unschedulable" or (not t.get("key") and t.get("operator") == "Exists")
        if key_ok and t.get("effect") in (None, "", "NoSchedule"):
            return True
    return False


def _affinity_nodes(pod: dict) -> set[str] | None:
    aff = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    names: set[str] | None = None
    for term in aff.get("nodeSelectorTerms", []):
        for ex in term.get("matchExpressions", []) + term.get("matchFields", []):
            if ex.get("key") in ("kubernetes.io/hostname", "metadata.name") and ex.get("operator") == "In":
                names = (names or set()) | set(ex.get("values", []))
    if pod["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname"):
        names = (names or set()) | {pod["spec"]["nodeSelector"]["kubernetes.io/hostname"]}
    return names


def _anti_affinity(pod: dict):
    terms = (((pod["spec"].get("affinity") or {}).get("podAntiAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or [])
    for t in terms:
        if t.get("topologyKey") == "kubernetes.io/hostname":
            ml = (t.get("labelSelector") or {}).get("matchLabels") or {}
            return [(k, "=", {v}) for k, v in ml.items()]
    return None


def gpu_node(
    name: str,
    gpus: int = 4,
    *,
    cpu: str = "32",
    memory: str = "256Gi",
    product: str = "NVIDIA-A100-SXM4-40GB",
    gpu_mem_mb: int = 40960,
    replicas: int | None = None,
    sharing: str = "time-slicing",
    labels: dict[str, str] | None = None,
) -> dict:
    """A GPU node as the NVIDIA device plugin + GPU feature discovery would label it.

    With `replicas` (time-slicing or MPS, `renameByDefault: true`) the node advertises
    `nvidia.com/gpu.shared = gpus * replicas` instead of `nvidia.com/gpu`. Emulated nodes carry
    `qosflow.dev/virtual-gpus: "true"`: their GPUs are declared, not real.
    """
    lab = {
        "kubernetes.io/hostname": name,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": str(gpu_mem_mb),
        "qosflow.dev/virtual-gpus": "true",
        **(labels or {}),
    }
    alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
    if replicas:
        lab["nvidia.com/gpu.replicas"] = str(replicas)
        lab["nvidia.com/gpu.sharing-strategy"] = "mps" if sharing == "mps" else "time-slicing"
        alloc["nvidia.com/gpu.shared"] = str(gpus * replicas)
    else:
        alloc["nvidia.com/gpu"] = str(gpus)
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": lab}, "spec": {}, "status": {"allocatable": alloc, "capacity": dict(alloc)}}


def iter_objs(store: Store, plurals: Iterable[str]) -> Iterable[tuple[str, dict]]:
    for p in plurals:
        for o in store.table(p).values():
            yield p, o
