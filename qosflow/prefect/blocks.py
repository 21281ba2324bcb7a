"""Prefect blocks: a QoS policy, a bare-metal GPU cluster, a Kubernetes GPU cluster.

Register them with `prefect block register -m qosflow.prefect.blocks` (or `qosflow init`); they then
appear in the UI's block catalog. The `qosflow` work pool names its cluster and policy blocks in its
base job template (`cluster_block`, `policy_block`), and deployments can reference a policy block
in their job variables (`{{ prefect.blocks.qosflow-qos-policy.nightly }}`).

Inside a running event loop `Block.save()`/`Block.load()` return coroutines: use `asave`/`aload`.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Optional

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator, model_validator

from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.qos import PriorityClass

_LOGO = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"


def _no_unknown_fields(block: Block) -> None:
    """Prefect blocks keep unknown keyword arguments as extras; a misspelt field (gpus_per_hosts=8) would be
    saved and silently ignored. Name it instead."""
    from qosflow.errors import closest_name

    for k in block.model_extra or {}:
        if k.startswith("_") or k == "block_type_slug":
            continue
        close = closest_name(k, list(type(block).model_fields))
        raise ValueError(f"unknown field {k!r}" + (f"; did you mean {close!r}?" if close else f"; fields: {', '.join(type(block).model_fields)}"))


def _http_url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) URL with a host (e.g. '127.0.0.1:8721', which httpx refused only at the
    first request, as 'UnsupportedProtocol'), else None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "it has no http:// or https:// scheme" if "://" not in url else f"its scheme {parts.scheme!r} is not http or https"
    if not parts.hostname:
        return "it names no host"
    return None


def _blank_to_none(v: Any) -> Any:
    """An optional text field left empty (the UI saves '') means not set."""
    return None if isinstance(v, str) and not v.strip() else v


class QoSPolicy(Block):
    """How the qosflow worker schedules: the policy, where estimates come from, QoS defaults."""

    _block_type_name: ClassVar[str] = "qosflow QoS Policy"
    _block_type_slug: ClassVar[str] = "qosflow-qos-policy"
    _logo_url: ClassVar[str] = _LOGO
    _description: ClassVar[str] = (
        "qosflow scheduling policy: which policy orders and places stage runs, where duration estimates "
        "come from, and the QoS class given to pipelines that declare none."
    )

    policy: str = Field(default="fifo", description="Scheduling policy name (qosflow.policies.get_policy), e.g. fifo, sjf, genie, qosflow.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options passed to the policy.")
    estimator: str = Field(
        default="learned",
        description="Where estimates come from: learned (the predictor and its store: profiles, every finished stage; "
        "declared durations are updated by measured runs), history (declared duration, then the median of the stage's "
        "past runs, in a JSON file), declared, or module:attr.",
    )
    priority: str = Field(default="normal", description="Default priority class: critical, guaranteed, normal, best-effort.")
    deadline_s: Optional[float] = Field(default=None, description="Default pipeline deadline in seconds after it starts (none: no deadline).")
    round_interval_s: float = Field(default=1.0, gt=0, description="Seconds between scheduling rounds when nothing happens.")
    coda_feedback: bool = Field(default=True, description="Move cores from co-located CPU stages to lagging GPU stages (CODA).")
    at_risk_margin: float = Field(
        default=0.0, ge=0, lt=1,
        description="Flag a stage at risk (event qosflow.qos.at-risk) once its forecast finish falls in the last fraction "
        "of the time between its becoming ready and its deadline (0: only when the forecast misses the deadline).",
    )
    early_check_s: float = Field(
        default=0.0, ge=0,
        description="Early check (0: off): run a new stage (no successful run of its signature yet) that needs at least "
        "early_check_min_gpus GPUs for this many seconds on one GPU first, so a user error fails it before it takes its GPUs.",
    )
    early_check_min_gpus: int = Field(default=2, ge=1, description="Smallest GPU count of a stage that gets the early check.")

    @field_validator("priority")
    @classmethod
    def _prio(cls, v: str) -> str:
        return PriorityClass.parse(v, where="QoSPolicy block").value

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, v: str) -> str:
        from qosflow.errors import UnknownNameError
        from qosflow.prefect.scheduler import check_estimator_name

        try:
            return check_estimator_name(v)
        except UnknownNameError as exc:  # a KeyError: pydantic reports ValueErrors on the field
            raise ValueError(str(exc)) from None

    @field_validator("deadline_s")
    @classmethod
    def _deadline(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not v > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {v!r}")
        return v

    @model_validator(mode="after")
    def _known_fields(self) -> "QoSPolicy":
        _no_unknown_fields(self)
        return self

    @model_validator(mode="after")
    def _policy_and_options(self) -> "QoSPolicy":
        """The policy must exist and take every option, each of the type it declares: a text "false"
        from the UI would turn a true/false option on, and a bad value would only fail in the worker."""
        from qosflow.errors import UnknownNameError
        from qosflow.policies import get_policy, option_problem

        try:
            for opt, value in (self.options or {}).items():
                problem = option_problem(self.policy, opt, value)
                if problem is not None:
                    raise ValueError(f"options: {problem}")
            get_policy(self.policy, **(self.options or {}))
        except UnknownNameError as exc:  # a KeyError: pydantic reports ValueErrors on the field
            raise ValueError(str(exc)) from None
        except TypeError as exc:
            raise ValueError(f"options: {exc}") from None
        return self

    #: the fields a pipeline run takes from its deployment's `qos_policy` job variable; the others are the worker's
    PIPELINE_FIELDS: ClassVar[tuple[str, ...]] = ("deadline_s", "priority")

    @classmethod
    def worker_settings_given(cls, values: Mapping[str, Any]) -> list[str]:
        """The worker's settings (every field but `PIPELINE_FIELDS`) that `values` -- a policy block's fields, e.g.
        a deployment's `qos_policy` job variable, which `prefect deploy` copies whole, defaults included -- sets
        to something other than its default, sorted. Fields at their default are not "given": a block that set
        only a deadline was told its at_risk_margin, coda_feedback, ... were the worker's settings."""
        given = []
        for name, field in cls.model_fields.items():
            if name in cls.PIPELINE_FIELDS or name not in values:
                continue
            default = field.get_default(call_default_factory=True)
            if values[name] is not None and values[name] != default:
                given.append(name)
        return sorted(given)

    def make_policy(self):
        from qosflow.policies import get_policy

        return get_policy(self.policy, **(self.options or {}))


class _ClusterBase(Block, ABC):  # an interface: `prefect block register -m` skips it
    gpus_per_host: int = Field(default=4, ge=0, description="GPUs on each host.")
    gpu_mem_mb: float = Field(default=16384.0, gt=0, description="Memory of each GPU (MiB).")
    cpu_cores: float = Field(default=8.0, gt=0, description="CPU cores of each host available to stages.")
    mem_mb: float = Field(default=65536.0, gt=0, description="Host memory available to stages (MiB).")
    gpu_model: str = Field(default="generic", description="GPU model name (stages may ask for one).")
    virtual_gpus: bool = Field(
        default=False,
        description="Declare the GPUs instead of detecting them (no GPU on this machine/CI). Shown as virtual everywhere.",
    )

    @model_validator(mode="after")
    def _known_fields(self) -> "_ClusterBase":
        _no_unknown_fields(self)
        return self

    def host_names(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def host_gpu_model(self, host: str) -> str:
        """The GPU model of `host`'s GPUs (`gpu_model`, unless a subclass says otherwise per host)."""
        return self.gpu_model

    def to_cluster_spec(self) -> ClusterSpec:
        names = self.host_names()
        nodes = tuple(
            NodeSpec(
                name=h,
                gpus=self.gpus_per_host,
                gpu_mem_mb=self.gpu_mem_mb,
                cpu_cores=self.cpu_cores,
                mem_mb=self.mem_mb,
                gpu_model=self.host_gpu_model(h),
                virtual=self.virtual_gpus,
            )
            for h in names
        )
        return ClusterSpec(nodes, name=getattr(self, "_block_document_name", None) or "cluster")


def _looks_like_a_path(value: str) -> bool:
    """Whether a field that takes a PEM text was given a file's path instead: one line, no PEM header, and a
    directory, `~`, a certificate's suffix, or a file of that name."""
    import os

    v = value.strip()
    if "-----BEGIN" in v or "\n" in v:
        return False
    return "/" in v or "\\" in v or v.startswith("~") or v.lower().endswith((".pem", ".crt", ".cer")) or os.path.isfile(v)


def _ca_path_problem(value: str) -> str:
    """Why `agent_ca_cert` cannot be `value`, a file's path rather than its text (it only said "not a PEM CA
    certificate ...: no start line: cadata does not contain a certificate (_ssl.c:4020)"), and what to give."""
    import os

    path = os.path.expanduser(value)
    what = "is a file on this machine" if os.path.isfile(path) else "names no file on this machine either"
    return (f"agent_ca_cert takes the CA certificate's PEM text (-----BEGIN CERTIFICATE----- ...), not a path: {value!r} {what}; "
            "give the file's contents (e.g. agent_ca_cert=Path('ca.pem').read_text(), or paste them in the UI), "
            "or use a cluster file, whose tls_ca_file takes a path")


class BareMetalGPUCluster(_ClusterBase):
    """GPU hosts the worker places stages on: this machine (local backend) or host agents (agents issue)."""

    _block_type_name: ClassVar[str] = "qosflow Bare-Metal GPU Cluster"
    _block_type_slug: ClassVar[str] = "qosflow-bare-metal-cluster"
    _logo_url: ClassVar[str] = _LOGO
    _description: ClassVar[str] = (
        "Bare-metal GPU hosts for the qosflow worker: hosts, GPUs per host, GPU memory, cores, and the agent URL "
        "and token used by `qosflow agent`. With virtual_gpus the GPUs are declared (no NVML), e.g. for a demo."
    )

    hosts: list[str] = Field(default_factory=lambda: ["localhost"], description="Host names (one node each).")
    backend: Literal["local", "agents"] = Field(
        default="local", description="local: every host is this machine (processes); agents: `qosflow agent` on each host."
    )
    agent_url: Optional[str] = Field(
        default=None,
        description="Agent URL template, e.g. http://{host}:8701 (agents backend).",
    )
    agent_token: Optional[SecretStr] = Field(default=None, description="Secret token every agent request carries.")
    agent_urls: dict[str, str] = Field(
        default_factory=dict,
        description="Agent URL per host (overrides agent_url for that host), e.g. {\"gpu-a\": \"http://10.0.0.11:8701\"}.",
    )
    host_gpu_models: dict[str, str] = Field(
        default_factory=dict,
        description="GPU model per host where the hosts differ (overrides gpu_model for that host), e.g. "
        "{\"old-1\": \"k80\"}: the qosflow policy places each stage on the model where it runs best.",
    )
    heartbeat_s: float = Field(default=2.0, gt=0, description="Seconds between the worker's heartbeats to every agent.")
    fence_after_s: Optional[float] = Field(
        default=None, gt=0, description="The agents' --fence-after: a silent host's stages are rerun elsewhere only after it."
    )
    pipelines_on: str = Field(
        default="worker",
        description="Where deployed pipeline runs (job variable role 'pipeline') run on an agents cluster: 'worker' (a "
        "process on the worker's host, adopted only by a worker of the same name there), 'agents' (a process with no GPU "
        "through the agent of the up host with the most free CPU cores, adopted by any worker of the pool) or one host's "
        "name. agents/a host needs the pipeline's code importable on the hosts, as the stages' already is.",
    )
    agent_ca_cert: Optional[str] = Field(
        default=None,
        description="For agents at https:// (started with --tls-cert): the PEM certificate of the CA that signed theirs "
        "(-----BEGIN CERTIFICATE----- ...). Empty: the system's CAs.",
    )

    @field_validator("agent_ca_cert")
    @classmethod
    def _ca(cls, v: Optional[str]) -> Optional[str]:
        if v is None or not v.strip():
            return None
        from qosflow.backends.agent import tls_context

        if _looks_like_a_path(v):  # (as a cluster file's tls_ca_file takes)
            raise ValueError(_ca_path_problem(v.strip()))
        tls_context(v, "agent_ca_cert")  # (a SpecError is a ValueError: the block's validation error names the field)
        return v

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("hosts must name at least one host")
        blank = [i + 1 for i, h in enumerate(v) if not str(h).strip()]
        if blank:  # an empty name ended "agent_urls for host(s) " with the name missing
            raise ValueError(f"hosts: host {', '.join(map(str, blank))} of {len(v)} has an empty name; give every host its name "
                             "(e.g. gpu-a)")
        if len(set(v)) != len(v):
            raise ValueError(f"hosts must be unique, got {v}")
        return v

    @model_validator(mode="after")
    def _agents(self) -> "BareMetalGPUCluster":
        for field_name in ("agent_urls", "host_gpu_models"):
            unknown = sorted(set(getattr(self, field_name)) - set(self.hosts))
            if unknown:
                raise ValueError(f"{field_name} names host(s) {', '.join(unknown)} that are not in hosts ({', '.join(self.hosts)})")
        if self.backend == "agents":
            missing = [h for h in self.hosts if h not in self.agent_urls]
            if missing and not self.agent_url:
                raise ValueError(
                    f"backend 'agents' needs agent_url (e.g. http://{{host}}:8701) or agent_urls for host(s) {', '.join(missing)}"
                )
            token = self.agent_token.get_secret_value().strip() if self.agent_token is not None else ""
            if not token:  # was found only when the worker set up its backend, then logged every 5 s
                raise ValueError("backend 'agents' needs agent_token: the agents' secret token (the contents of the file "
                                 "given to `qosflow agent start --token-file`)")
        if self.agent_url:
            try:
                example = self.agent_url.format(host=self.hosts[0])
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"agent_url {self.agent_url!r}: the only placeholder it may have is {{host}} ({exc!r}); "
                                 "e.g. http://{host}:8701") from None
            problem = _http_url_problem(example)
            if problem:  # was only "UnsupportedProtocol" from every heartbeat
                raise ValueError(f"agent_url {self.agent_url!r}: {problem}; write it as http://{{host}}:8701 (or https://)")
        if self.pipelines_on != "worker":
            if self.backend != "agents":
                raise ValueError(f"pipelines_on {self.pipelines_on!r} needs backend 'agents' (with backend 'local' pipeline "
                                 "runs are processes on the worker's host)")
            from qosflow.backends.agent import check_pipelines_on

            check_pipelines_on(self.pipelines_on, self.hosts, "pipelines_on")
        for h, url in self.agent_urls.items():
            problem = _http_url_problem(url)
            if problem:
                raise ValueError(f"agent_urls[{h!r}] {url!r}: {problem}; write it as http://ADDRESS:8701 (or https://)")
        return self

    def host_names(self) -> list[str]:
        return list(self.hosts)

    def host_gpu_model(self, host: str) -> str:
        return self.host_gpu_models.get(host, self.gpu_model)

    def agent_address(self, host: str) -> str | None:
        if host in self.agent_urls:
            return self.agent_urls[host]
        return self.agent_url.format(host=host) if self.agent_url else None

    def make_backend(self):
        """The backend this block describes: `LocalBackend` (processes here) or `AgentBackend` (agents by URL,
        token from `agent_token`)."""
        if self.backend == "local":
            from qosflow.backends.local import LocalBackend

            return LocalBackend(self.to_cluster_spec())
        from qosflow.backends.agent import AgentBackend, AgentHost
        from qosflow.errors import SpecError

        token = self.agent_token.get_secret_value() if self.agent_token is not None else ""
        if not token:
            raise SpecError("agent_token", "the bare-metal cluster block has backend 'agents' but no agent_token: set the agents' secret token")
        hosts = [
            AgentHost(h, self.agent_address(h) or "", self.gpus_per_host, self.gpu_mem_mb, self.cpu_cores, self.mem_mb,
                      None if self.host_gpu_model(h) == "generic" else self.host_gpu_model(h))
            for h in self.hosts
        ]
        name = getattr(self, "_block_document_name", None) or "agents"
        return AgentBackend(hosts, token, heartbeat_s=self.heartbeat_s, fence_after_s=self.fence_after_s, cluster_name=name,
                            ca_cert=self.agent_ca_cert, pipelines_on=self.pipelines_on)

    @classmethod
    def from_cluster_file(cls, path: str) -> "BareMetalGPUCluster":
        """The block for a cluster file (`qosflow.backends.agent.load_cluster_file`): agents by URL, its token."""
        from qosflow.backends.agent import load_cluster_file

        cf = load_cluster_file(path)
        first = cf.hosts[0]
        kw: dict[str, Any] = {}
        for field_name, attr in (("gpus_per_host", "gpus"), ("gpu_mem_mb", "gpu_mem_mb"), ("cpu_cores", "cpu_cores"), ("mem_mb", "mem_mb"), ("gpu_model", "gpu_model")):
            v = getattr(first, attr)
            if v is not None:
                kw[field_name] = v
        # (hosts whose GPUs are of another model than the first's keep theirs)
        models = {h.name: h.gpu_model for h in cf.hosts if h.gpu_model and h.gpu_model != kw.get("gpu_model", "generic")}
        return cls(
            hosts=[h.name for h in cf.hosts],
            host_gpu_models=models,
            backend="agents",
            agent_urls={h.name: h.url for h in cf.hosts},
            agent_token=SecretStr(cf.token),
            heartbeat_s=cf.heartbeat_s,
            fence_after_s=cf.fence_after_s,
            agent_ca_cert=cf.ca_cert,
            pipelines_on=cf.pipelines_on,
            virtual_gpus=True,
            **kw,
        )

    @classmethod
    def virtual(cls, hosts: int = 2, gpus_per_host: int = 4, **kw: Any) -> "BareMetalGPUCluster":
        return cls(hosts=[f"host{i}" for i in range(hosts)], gpus_per_host=gpus_per_host, virtual_gpus=True, **kw)


class KubernetesGPUCluster(_ClusterBase):
    """A Kubernetes cluster with GPU nodes (the Kubernetes backend ships in its own issue)."""

    _block_type_name: ClassVar[str] = "qosflow Kubernetes GPU Cluster"
    _block_type_slug: ClassVar[str] = "qosflow-kubernetes-cluster"
    _logo_url: ClassVar[str] = _LOGO
    _description: ClassVar[str] = (
        "A Kubernetes cluster for the qosflow worker: namespace, stage image, GPU node labels and the GPU resource name."
    )

    namespace: str = Field(default="default", description="Namespace stage Jobs are created in.")
    image: str = Field(default="prefecthq/prefect:3-python3.11", description="Container image stages run in.")
    node_labels: dict[str, str] = Field(default_factory=dict, description="Only nodes with these labels run stages.")
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name of a whole GPU (the device plugin's); a shared GPU is this name + '.shared'.")
    node_names: list[str] = Field(default_factory=list, description="Nodes to plan on when the API cannot be read (virtual).")
    sharing: Literal["none", "time-slicing", "mps"] = Field(default="none", description="GPU sharing the NVIDIA device plugin is configured for.")

    gang_scheduler: Optional[Literal["volcano", "kai"]] = Field(default=None, description="Gang-capable scheduler (PodGroups), if installed.")
    kubeconfig: Optional[str] = Field(default=None, description="Kubeconfig file (default: in-cluster config, then ~/.kube/config).")
    context: Optional[str] = Field(default=None, description="Kubeconfig context.")
    api_url: Optional[str] = Field(
        default=None,
        description="Plain API server URL without credentials (`kubectl proxy`, or the qosflow test emulator); not with kubeconfig/context.",
    )
    credentials_in_secret: bool = Field(
        default=True,
        description="Pass a stage's credentials (PREFECT_API_KEY, ...) through a Secret per stage (the account needs create/delete "
                    "on secrets); off: as plain values in the Job, readable by whoever may read Jobs.",
    )

    request_capacity: bool = Field(
        default=False,
        description="Scale from zero: for a stage that has waited capacity_request_after_s because no node has room for it, "
                    "create a placeholder pod (a pause container with the stage's GPUs, cpu and memory) that the cluster's "
                    "autoscaler (cluster-autoscaler, Karpenter) adds a node for; deleted when the stage is placed. The account "
                    "needs list, create and delete on pods.",
    )
    capacity_request_after_s: float = Field(default=30.0, ge=0, description="Seconds a stage waits for room before capacity is requested for it.")
    max_capacity_requests: int = Field(
        default=4, ge=0,
        description="Placeholder pods at most at once (the stages that waited longest; a gang wider than a node takes one per part).")
    capacity_request_image: str = Field(default="registry.k8s.io/pause:3.9", description="The placeholder pods' image (a pause image).")
    capacity_priority_class: Optional[str] = Field(
        default=None, description="priorityClassName of the placeholder pods (a low one lets other pods preempt them).")
    capacity_node: Optional[dict[str, Any]] = Field(
        default=None,
        description="The node the GPU pool's autoscaler adds, declared: {gpus, cpu, memory} as its allocatable (e.g. {\"gpus\": 8, "
                    "\"cpu\": 64, \"memory\": \"480Gi\"}), optional gpu_product (its nvidia.com/gpu.product label), gpu_memory_mb "
                    "(per GPU), count (how many such nodes the group may hold at once, default 1: the stand-ins while the pool is at zero, and the widest gang accepted when fewer nodes are listed). With "
                    "request_capacity, a worker started while no node exists plans on it (down) instead of failing; a gang wider "
                    "than it is asked for in node-sized placeholders (one pod per part; max_capacity_requests counts pods).",
    )
    capacity_peer_check_s: float = Field(
        default=10.0, ge=0, allow_inf_nan=False,
        description="Several workers on one pool: how often (seconds) a worker looks whether the makers of the other "
                    "placeholders are alive (their presence in the lease store) and deletes those of workers gone; 0: at every heartbeat.",
    )

    @field_validator("kubeconfig", "context", "api_url", "capacity_priority_class", mode="before")
    @classmethod
    def _unset(cls, v: Any) -> Any:
        return _blank_to_none(v)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        import re

        if not (len(v) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", v)):
            like = re.sub(r"[^a-z0-9-]+", "-", v.lower()).strip("-")[:63].strip("-") or "default"
            raise ValueError(f"namespace {v!r} is not a Kubernetes namespace name (a DNS-1123 label: at most 63 lowercase "
                             f"letters, digits and dashes, starting and ending with a letter or digit); e.g. {like!r}")
        return v

    @field_validator("capacity_node", mode="before")
    @classmethod
    def _capacity_node(cls, v: Any) -> Any:
        v = _blank_to_none(v) if not isinstance(v, dict) else (v or None)
        if v is not None:
            from qosflow.backends.kubernetes import capacity_node_spec

            capacity_node_spec(v)  # (SpecError, a ValueError, names the key: "invalid capacity_node.gpus: ...")
        return v

    @field_validator("image", "capacity_request_image")
    @classmethod
    def _image(cls, v: str, info: Any) -> str:
        if not v.strip() or v != v.strip() or any(c.isspace() for c in v):
            what, e_g = (("the container image stages run in", "prefecthq/prefect:3-python3.11") if info.field_name == "image" else
                         ("the placeholder pods' image (a pause image)", "registry.k8s.io/pause:3.9"))
            raise ValueError(f"{info.field_name} {v!r}: give {what}, e.g. {e_g}")
        return v

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, v: Optional[str]) -> Optional[str]:
        problem = _http_url_problem(v) if v is not None else None
        if problem:
            raise ValueError(f"api_url {v!r}: {problem}; write it as http://HOST:PORT (e.g. `kubectl proxy`'s http://127.0.0.1:8001)")
        return v

    @field_validator("kubeconfig")
    @classmethod
    def _kubeconfig(cls, v: Optional[str]) -> Optional[str]:
        import os

        if v is not None and not os.path.isfile(os.path.expanduser(v)):
            raise ValueError(f"kubeconfig {v!r}: no such file on this machine; give the path of a kubeconfig file, or leave "
                             "kubeconfig empty for the in-cluster config, then ~/.kube/config")
        return v

    @model_validator(mode="after")
    def _one_way_in(self) -> "KubernetesGPUCluster":
        if self.api_url is not None:
            both = [f for f in ("kubeconfig", "context") if getattr(self, f) is not None]
            if both:  # api_url won without a word: the kubeconfig's credentials were not used
                raise ValueError(f"give either api_url (a plain API URL, no credentials) or {' and '.join(both)}, not both: "
                                 f"with api_url the {' and '.join(both)} would not be used")
        return self

    def host_names(self) -> list[str]:
        return list(self.node_names) or ["k8s-node0"]

    def make_backend(self):
        """A `KubernetesBackend` for this cluster (inventory from the nodes' allocatable GPUs and labels)."""
        from qosflow.backends.kubernetes import KubernetesBackend

        api_client = None
        if self.api_url:
            from kubernetes import client

            cfg = client.Configuration()
            cfg.host = self.api_url
            api_client = client.ApiClient(cfg)
        name = getattr(self, "_block_document_name", None) or "kubernetes"
        return KubernetesBackend(
            namespace=self.namespace, image=self.image, api_client=api_client, kubeconfig=self.kubeconfig, context=self.context,
            gpu_sharing=self.sharing, gang_scheduler=self.gang_scheduler, node_selector=dict(self.node_labels), cluster_name=name,
            gpu_resource=self.gpu_resource, credentials_in_secret=self.credentials_in_secret,
            request_capacity=self.request_capacity, capacity_request_after_s=self.capacity_request_after_s,
            max_capacity_requests=self.max_capacity_requests, capacity_request_image=self.capacity_request_image,
            capacity_priority_class=self.capacity_priority_class, capacity_node=dict(self.capacity_node) if self.capacity_node else None,
            capacity_peer_check_s=self.capacity_peer_check_s,
        )


def cluster_from_block_data(data: dict[str, Any]) -> ClusterSpec:
    """A ClusterSpec from a resolved block document (job variables) or plain dict."""
    if "hosts" in data or "agent_url" in data or "backend" in data:
        return BareMetalGPUCluster(**{k: v for k, v in data.items() if not k.startswith("_")}).to_cluster_spec()
    return KubernetesGPUCluster(**{k: v for k, v in data.items() if not k.startswith("_")}).to_cluster_spec()


__all__ = ["BareMetalGPUCluster", "KubernetesGPUCluster", "QoSPolicy", "cluster_from_block_data"]
