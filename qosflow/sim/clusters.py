"""Cluster specs for simulation: ``NxG``, Muri cluster CSVs, Alibaba node lists, Gavel cluster specs.

`load_cluster(spec)` accepts:

* ``NxG`` -- N nodes of G GPUs each (``8x8``), V100-32GB-like: 32 GiB per GPU, 64 cores and
  512 GiB of host memory per node, one switch;
* a Muri cluster CSV (``num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node``,
  memory in GB, one data row): 32 GiB GPUs (Muri's testbed used V100s; the CSV gives no GPU memory);
* an Alibaba node list (``sn,cpu_milli,memory_mib,gpu,model``): one node per row, GPU memory from
  `ALIBABA_GPU_MEM_MB` by model, nodes without GPUs allowed;
* a Gavel cluster spec ``V:P:K`` (numbers of V100, P100 and K80 GPUs, Gavel's ``--cluster_spec``),
  optionally ``V:P:K/v:p:k`` with GPUs per server (Gavel's ``--num_gpus_per_server``; default 4,
  the 4-GPU Azure NC24-class servers of Gavel's testbed), or a Gavel ``cluster_specs.json``
  (``{"<virtual cluster>": ["V:P:K", ...]}``; ``FILE#vc`` picks a virtual cluster, else the first).

Files are recognised by their header, not their name. Errors name the file and line.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.errors import SpecError, TraceFormatError
from qosflow.sim.traces._common import check_text, check_unique_columns, delimiter_hint

GIB = 1024.0

#: defaults of an ``NxG`` cluster: V100-32GB-like servers
NXG_GPU_MEM_MB = 32 * GIB
NXG_CPU_CORES = 64.0
NXG_MEM_MB = 512 * GIB

#: Muri's CSV has no GPU memory: its testbed used 32 GB V100s
MURI_GPU_MEM_MB = 32 * GIB
MURI_COLUMNS = ("num_switch", "num_node_p_switch", "num_gpu_p_node", "num_cpu_p_node", "mem_p_node")

#: GPU memory (MiB) by Alibaba GPU model. Public data sheets for the named ones; G2 and G3 are
#: anonymised in the trace: 32 GiB assumed (the pods never ask for GPU memory, only gpu_milli).
ALIBABA_GPU_MEM_MB: dict[str, float] = {
    "T4": 16 * GIB,
    "P100": 16 * GIB,
    "V100M16": 16 * GIB,
    "V100M32": 32 * GIB,
    "A10": 24 * GIB,
    "A100": 80 * GIB,
    "G2": 32 * GIB,
    "G3": 32 * GIB,
}
ALIBABA_DEFAULT_GPU_MEM_MB = 32 * GIB

#: Gavel's GPU types: memory per GPU and, per 4-GPU server, cores and host memory (Azure NC24s_v3
#: for V100, NC24s_v2 for P100, NC24 for K80; per-GPU numbers scale with the server size)
GAVEL_SERVERS: dict[str, dict[str, float]] = {
    "v100": {"gpu_mem_mb": 16 * GIB, "cores_per_gpu": 6.0, "mem_mb_per_gpu": 112 * GIB},
    "p100": {"gpu_mem_mb": 16 * GIB, "cores_per_gpu": 6.0, "mem_mb_per_gpu": 112 * GIB},
    "k80": {"gpu_mem_mb": 12 * GIB, "cores_per_gpu": 6.0, "mem_mb_per_gpu": 56 * GIB},
}
GAVEL_ORDER = ("v100", "p100", "k80")
GAVEL_GPUS_PER_SERVER = 4

#: GPUs one server of an ``NxG`` or ``V:P:K/v:p:k`` spec may hold: no server holds more (8-16 is usual), and
#: the simulator's per-GPU arrays are nodes x GPUs per node (`100000x100000` asked for 75 GiB and died)
MAX_GPUS_PER_NODE = 128

_NXG = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_GAVEL = re.compile(r"^\s*(\d+):(\d+):(\d+)\s*(?:/\s*(\d+):(\d+):(\d+)\s*)?$")


def load_cluster(spec: str | Path, *, name: str | None = None) -> ClusterSpec:
    """A `ClusterSpec` from ``NxG``, ``V:P:K[/v:p:k]`` or a cluster file (see the module doc)."""
    s = str(spec).strip()
    if not s:
        raise SpecError("cluster", "empty cluster spec; use NxG (e.g. 8x8), V:P:K (Gavel) or a cluster file")
    m = _NXG.match(s)
    if m:
        n, g = int(m.group(1)), int(m.group(2))
        if n <= 0:
            raise SpecError("cluster", f"{s!r}: need at least one node")
        if g <= 0:
            raise SpecError("cluster", f"{s!r}: need at least one GPU per node")
        if g > MAX_GPUS_PER_NODE:
            raise SpecError("cluster", f"{s!r}: {g} GPUs per node; a node is one server, with at most {MAX_GPUS_PER_NODE} "
                                       f"(NxG is N servers of G GPUs each: e.g. {max(1, g // 8)}x8)")
        return ClusterSpec.uniform(
            n, g, gpu_mem_mb=NXG_GPU_MEM_MB, cpu_cores=NXG_CPU_CORES, mem_mb=NXG_MEM_MB, name=name or f"{n}x{g}"
        )
    m = _GAVEL.match(s)
    if m:
        counts = tuple(int(x) for x in m.group(1, 2, 3))
        per = tuple(int(x) for x in m.group(4, 5, 6)) if m.group(4) else (GAVEL_GPUS_PER_SERVER,) * 3
        return gavel_cluster(counts, per, name=name or s, where=None)
    path_s, _, frag = s.partition("#")
    path = Path(path_s)
    if not path.exists():
        raise SpecError(
            "cluster",
            f"{s!r} is neither NxG (e.g. 8x8), a Gavel spec V:P:K (e.g. 500:0:0) nor an existing file",
        )
    if path.is_dir():
        raise SpecError("cluster", f"{s!r} is a directory; give a cluster file (Muri CSV, Alibaba node list, cluster_specs.json)")
    return load_cluster_file(path, vc=frag or None, name=name)


def load_cluster_file(path: str | Path, *, vc: str | None = None, name: str | None = None) -> ClusterSpec:
    p = Path(path)
    check_text(p, "cluster file")
    with open(p, encoding="utf-8-sig") as f:
        head = f.read(4096)
    first = head.lstrip().split("\n", 1)[0].strip()
    if head.lstrip().startswith("{"):
        return _gavel_json(p, vc, name)
    cols = [c.strip() for c in first.split(",")]
    if "num_switch" in cols or "num_node_p_switch" in cols:
        return _muri_csv(p, name)
    if "sn" in cols and "gpu" in cols:
        return _alibaba_nodes(p, name)
    what = _trace_not_cluster(first)
    if what:  # a trace given as --cluster (the other way round already said so)
        raise TraceFormatError(p, 1, f"this is {what}, not a cluster file; pass it as --trace, and as --cluster NxG "
                                     "(e.g. 8x8), V:P:K (e.g. 36:36:36), a Muri cluster CSV or an Alibaba node list")
    raise TraceFormatError(
        p,
        1,
        "not a cluster file qosflow knows: expected a Muri CSV header "
        f"({','.join(MURI_COLUMNS)}), an Alibaba node list header (sn,cpu_milli,memory_mib,gpu,model) "
        "or a Gavel cluster_specs.json" + delimiter_hint(cols),
    )


def _trace_not_cluster(first_line: str) -> str | None:
    """What trace (or table) a cluster file's first line shows, if any: a Muri trace or an Alibaba pod list
    by its columns (as `qosflow.sim.runner` tells them apart), a Gavel trace by its tab-separated fields."""
    from qosflow.sim.runner import FORMAT_MARKS
    from qosflow.sim.traces.gavel import FORMS as GAVEL_FORMS

    cols = {c.strip().strip('"') for c in first_line.split(",")}
    names = {"muri": "a Muri trace", "alibaba": "an Alibaba pod list"}
    for fmt, marks in FORMAT_MARKS.items():
        if len(marks & cols) >= len(marks) / 2:
            return names.get(fmt, f"a {fmt} trace")
    if "\t" in first_line and first_line.count("\t") + 1 in GAVEL_FORMS:
        return "a Gavel trace (tab-separated job lines)"
    return None


# ---------------------------------------------------------------------- Muri
def _muri_csv(p: Path, name: str | None) -> ClusterSpec:
    with open(p, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    header = [h.strip() for h in rows[0]]
    check_unique_columns(p, header)
    missing = [c for c in MURI_COLUMNS if c not in header]
    if missing:
        raise TraceFormatError(p, 1, f"missing column(s) {', '.join(missing)}; a Muri cluster CSV needs {','.join(MURI_COLUMNS)}")
    data = [(i + 1, r) for i, r in enumerate(rows) if i > 0 and any(c.strip() for c in r)]
    if not data:
        raise TraceFormatError(p, None, "no data row: a Muri cluster CSV has one row after the header")
    if len(data) > 1:
        raise TraceFormatError(p, data[1][0], "a Muri cluster CSV has exactly one data row (the cluster); found more")
    line, row = data[0]
    if len(row) != len(header):
        raise TraceFormatError(p, line, f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
    vals = dict(zip(header, (c.strip() for c in row)))

    def num(col: str, integer: bool) -> float:
        raw = vals[col]
        try:
            v = float(raw)
        except ValueError:
            raise TraceFormatError(p, line, f"column {col!r}: expected a number, got {raw!r}") from None
        if integer and not v.is_integer():
            raise TraceFormatError(p, line, f"column {col!r}: expected a whole number, got {raw!r}")
        if v <= 0:  # a node of no GPUs made a cluster of none, on which every job was rejected
            raise TraceFormatError(p, line, f"column {col!r}: must be > 0, got {raw!r}"
                                   + (" (GPUs per node)" if col == "num_gpu_p_node" else ""))
        return v

    sw = int(num("num_switch", True))
    nps = int(num("num_node_p_switch", True))
    gpn = int(num("num_gpu_p_node", True))
    cpn = num("num_cpu_p_node", False)
    mem = num("mem_p_node", False) * GIB
    return ClusterSpec.uniform(
        sw * nps,
        gpn,
        gpu_mem_mb=MURI_GPU_MEM_MB,
        cpu_cores=cpn,
        mem_mb=mem,
        nodes_per_switch=nps,
        name=name or p.stem,
    )


# ---------------------------------------------------------------------- Alibaba
def _alibaba_nodes(p: Path, name: str | None) -> ClusterSpec:
    from qosflow.sim.traces.alibaba import load_nodes  # noqa: PLC0415  (the node-list parser)

    nodes = []
    for n in load_nodes(p):
        if n.cpu_milli <= 0:
            raise TraceFormatError(p, n.line, f"column 'cpu_milli': node {n.sn!r} needs > 0 milli-CPU, got {n.cpu_milli}")
        if n.memory_mib <= 0:
            raise TraceFormatError(p, n.line, f"column 'memory_mib': node {n.sn!r} needs > 0 MiB, got {n.memory_mib}")
        nodes.append(
            NodeSpec(
                name=n.sn,
                gpus=n.gpu,
                gpu_mem_mb=ALIBABA_GPU_MEM_MB.get(n.model, ALIBABA_DEFAULT_GPU_MEM_MB),
                cpu_cores=n.cpu_milli / 1000.0,
                mem_mb=float(n.memory_mib),
                gpu_model=n.model or "none",
            )
        )
    return ClusterSpec(tuple(nodes), name=name or p.stem)


# ---------------------------------------------------------------------- Gavel
def gavel_cluster(
    counts: tuple[int, int, int],
    per_server: tuple[int, int, int] = (GAVEL_GPUS_PER_SERVER,) * 3,
    *,
    name: str | None = None,
    where: str | None = None,
) -> ClusterSpec:
    """Servers of Gavel's GPU types: counts = (V100s, P100s, K80s), per_server GPUs on each server.
    A count that is not a multiple of the server size leaves a last, smaller server."""
    if sum(counts) <= 0:
        raise SpecError("cluster", f"Gavel spec {':'.join(map(str, counts))} has no GPUs", where=where)
    nodes: list[NodeSpec] = []
    for gt, count, per in zip(GAVEL_ORDER, counts, per_server):
        if count and per <= 0:
            raise SpecError("cluster", f"{gt}: GPUs per server must be > 0, got {per}", where=where)
        if count and per > MAX_GPUS_PER_NODE:
            raise SpecError("cluster", f"{gt}: {per} GPUs per server; a server holds at most {MAX_GPUS_PER_NODE} "
                                       f"(V:P:K/v:p:k gives GPUs per type, then GPUs per server: e.g. 36:36:36/4:4:4)", where=where)
        info = GAVEL_SERVERS[gt]
        i = 0
        left = count
        while left > 0:
            g = min(per, left)
            nodes.append(
                NodeSpec(
                    name=f"{gt}-{i}",
                    gpus=g,
                    gpu_mem_mb=info["gpu_mem_mb"],
                    cpu_cores=info["cores_per_gpu"] * per,
                    mem_mb=info["mem_mb_per_gpu"] * per,
                    switch=0,
                    gpu_model=gt,
                )
            )
            left -= g
            i += 1
    return ClusterSpec(tuple(nodes), name=name or ":".join(map(str, counts)))


def _gavel_json(p: Path, vc: str | None, name: str | None) -> ClusterSpec:
    try:
        data = json.loads(p.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(p, exc.lineno, f"not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict) or not data:
        raise TraceFormatError(p, 1, 'expected {"<virtual cluster>": ["V100s:P100s:K80s", ...]}')
    key = vc if vc is not None else next(iter(data))
    if key not in data:
        raise TraceFormatError(p, None, f"no virtual cluster {key!r}; the file has: {', '.join(data)}")
    specs = data[key]
    if isinstance(specs, dict):  # worker type -> job -> throughputs: was "'k80': expected a list of "V:P:K" strings"
        raise TraceFormatError(p, None, "this is a Gavel throughput table (worker type -> job -> throughputs), not a cluster "
                                        "spec: simulate reads it by itself (throughputs/ under QOSFLOW_SHARED_DATA); for a "
                                        "cluster of those GPU types give --cluster V:P:K (V100s:P100s:K80s, e.g. 36:36:36)")
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, list) or not specs or not isinstance(specs[0], str):
        raise TraceFormatError(p, _line_of(p, key), f"{key!r}: expected a list of \"V:P:K\" strings")
    m = _GAVEL.match(specs[0])
    if not m:
        raise TraceFormatError(p, _line_of(p, specs[0]), f"{key!r}: {specs[0]!r} is not \"V100s:P100s:K80s\" (e.g. 500:0:0)")
    counts = tuple(int(x) for x in m.group(1, 2, 3))
    per = tuple(int(x) for x in m.group(4, 5, 6)) if m.group(4) else (GAVEL_GPUS_PER_SERVER,) * 3
    return gavel_cluster(counts, per, name=name or f"{key}:{specs[0]}", where=str(p))


def _line_of(p: Path, needle: str) -> int | None:
    for i, line in enumerate(p.read_text(encoding="utf-8-sig").splitlines(), 1):
        if needle in line:
            return i
    return None
