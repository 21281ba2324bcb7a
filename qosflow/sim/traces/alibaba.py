"""Loaders for the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023, "openb" lists).

The trace comes with the FGD paper (Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23). Two CSV files:

* pod list: ``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,
  creation_time,deletion_time,scheduled_time`` -- ``gpu_milli`` is per GPU (< 1000: a share of
  one GPU); ``gpu_spec`` lists accepted GPU models separated by ``|`` (empty: any); times are
  seconds and may be empty (e.g. ``scheduled_time`` of a pending pod);
* node list: ``sn,cpu_milli,memory_mib,gpu,model``.

Required columns: pods ``name,cpu_milli,memory_mib,num_gpu,gpu_milli``; nodes
``sn,cpu_milli,memory_mib,gpu``. The others are optional. A malformed row raises
`qosflow.errors.TraceFormatError` naming the file, the line and the column.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from qosflow.errors import TraceFormatError
from qosflow.sim.traces._common import check_text, data_rows, delimiter_hint, misnamed_hint, separator_hint, unit_hint

MILLI = 1000

POD_COLUMNS = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)
POD_REQUIRED = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
NODE_REQUIRED = ("sn", "cpu_milli", "memory_mib", "gpu")


@dataclass(frozen=True, slots=True)
class AlibabaPod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    qos: str = ""
    pod_phase: str = ""
    creation_time: float | None = None
    deletion_time: float | None = None
    scheduled_time: float | None = None
    line: int = 0  #: line in the file (for messages)


@dataclass(frozen=True, slots=True)
class AlibabaNode:
    sn: str
    cpu_milli: int
    memory_mib: int
    gpu: int
    model: str = ""
    line: int = 0


def _rows(path: Path, required: tuple[str, ...], kind: str, why: str = "") -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row dict) for every data row; header and field-count checks (`why`: said after
    the list of required columns when one is missing)."""
    check_text(path, kind)
    if not path.is_file():
        raise TraceFormatError(path, None, f"{kind} file not found")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceFormatError(path, 1, f"empty file; expected a header with columns {','.join(required)}") from None
        except csv.Error as exc:
            raise TraceFormatError(path, reader.line_num, f"unreadable CSV header: {exc}") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            # the other list of the pair (qosflow pack --pods/--nodes swapped)
            other = {"pod list": (NODE_REQUIRED, "node list", "--nodes"), "node list": (POD_REQUIRED, "pod list", "--pods")}.get(kind)
            swapped = (f"; this is a {other[1]}, not a {kind} (qosflow pack takes it as {other[2]})"
                       if other and set(other[0]) <= set(header) else "")
            raise TraceFormatError(
                path,
                1,
                f"missing column(s) {', '.join(repr(c) for c in missing)} in the header; "
                f"a {kind} needs {','.join(required)}{why} (found: {','.join(header)})"
                f"{'' if swapped else misnamed_hint(missing, header, POD_COLUMNS + NODE_REQUIRED)}{delimiter_hint(header)}{swapped}",
            )
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup:
            raise TraceFormatError(path, 1, f"duplicate column(s) {', '.join(dup)} in the header")
        yield from data_rows(path, reader, header)


def _int(path: Path, line: int, row: dict[str, str], col: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    raw = row[col]
    try:
        val = int(raw)
    except ValueError:
        try:
            f = float(raw)
        except ValueError:
            f = None
        if f is None or not f.is_integer():
            raise TraceFormatError(path, line, f"column {col!r}: expected an integer ({what}), got {raw!r}"
                                               f"{separator_hint(raw)}") from None
        val = int(f)
    if val < lo or (hi is not None and val > hi):
        rng = f">= {lo}" if hi is None else f"within {lo}..{hi}"
        raise TraceFormatError(path, line, f"column {col!r}: {what} must be {rng}, got {val}")
    return val


def _opt_time(path: Path, line: int, row: dict[str, str], col: str) -> float | None:
    raw = row.get(col, "")
    if raw == "":
        return None
    try:
        val = float(raw)
    except ValueError:
        raise TraceFormatError(path, line, f"column {col!r}: expected a time in seconds or empty, got {raw!r}"
                                           f"{unit_hint(raw, 's') or separator_hint(raw)}") from None
    if not (0 <= val < float("inf")):  # NaN and inf too: "must be > 0 seconds, got inf" came much later
        raise TraceFormatError(path, line, f"column {col!r}: time must be a finite number of seconds >= 0, got {raw!r}")
    return val


#: the columns that place a pod in time: optional for packing, needed to replay the list (simulate)
POD_TIMES = ("creation_time", "scheduled_time", "deletion_time")


def load_pods(path: str | Path, *, times: bool = False) -> list[AlibabaPod]:
    """The pod list, validated row by row; `times`: the header must also have `POD_TIMES`."""
    p = Path(path)
    out: list[AlibabaPod] = []
    seen: dict[str, int] = {}
    required, why = (POD_REQUIRED + POD_TIMES, " to be replayed in time (qosflow pack needs only the first five)") if times else (POD_REQUIRED, "")
    for line, row in _rows(p, required, "pod list", why):
        name = row["name"]
        if not name:
            raise TraceFormatError(p, line, "column 'name': empty pod name")
        if name in seen:
            raise TraceFormatError(p, line, f"column 'name': pod {name!r} already appears on line {seen[name]}; "
                                            "every pod of a list needs a name of its own")
        seen[name] = line
        cpu = _int(p, line, row, "cpu_milli", "milli-CPU")
        mem = _int(p, line, row, "memory_mib", "memory in MiB")
        num = _int(p, line, row, "num_gpu", "number of GPUs")
        milli = _int(p, line, row, "gpu_milli", "milli-GPU per GPU", 0, MILLI)
        if num == 0 and milli != 0:
            raise TraceFormatError(p, line, f"column 'gpu_milli': must be 0 when num_gpu is 0, got {milli}")
        if num > 0 and milli == 0:
            raise TraceFormatError(p, line, "column 'gpu_milli': must be 1..1000 when num_gpu >= 1, got 0")
        if num > 1 and milli != MILLI:
            raise TraceFormatError(
                p, line, f"column 'gpu_milli': a pod with num_gpu={num} asks for whole GPUs, so gpu_milli must be 1000, got {milli}"
            )
        spec = tuple(s.strip() for s in row.get("gpu_spec", "").split("|") if s.strip())
        created = _opt_time(p, line, row, "creation_time")
        deleted = _opt_time(p, line, row, "deletion_time")
        if created is not None and deleted is not None and deleted < created:
            raise TraceFormatError(p, line, f"column 'deletion_time': {deleted:g} is before creation_time {created:g}")
        out.append(
            AlibabaPod(
                name,
                cpu,
                mem,
                num,
                milli,
                spec,
                row.get("qos", ""),
                row.get("pod_phase", ""),
                created,
                deleted,
                _opt_time(p, line, row, "scheduled_time"),
                line,
            )
        )
    if not out:
        raise TraceFormatError(p, None, "the pod list has a header but no pods")
    return out


def load_nodes(path: str | Path) -> list[AlibabaNode]:
    """The node list, validated row by row (node names must be unique)."""
    p = Path(path)
    out: list[AlibabaNode] = []
    seen: dict[str, int] = {}
    for line, row in _rows(p, NODE_REQUIRED, "node list"):
        sn = row["sn"]
        if not sn:
            raise TraceFormatError(p, line, "column 'sn': empty node name")
        if sn in seen:
            raise TraceFormatError(p, line, f"column 'sn': node {sn!r} already defined on line {seen[sn]}")
        seen[sn] = line
        cpu = _int(p, line, row, "cpu_milli", "milli-CPU")
        mem = _int(p, line, row, "memory_mib", "memory in MiB")
        gpu = _int(p, line, row, "gpu", "number of GPUs")
        model = row.get("model", "")
        if gpu > 0 and not model and "model" in row:
            raise TraceFormatError(p, line, "column 'model': a node with GPUs needs its GPU model (e.g. V100M16)")
        out.append(AlibabaNode(sn, cpu, mem, gpu, model, line))
    if not out:
        raise TraceFormatError(p, None, "the node list has a header but no nodes")
    return out


def default_pod_list() -> Path:
    """``../shared/data/traces/alibaba_v2023_openb_pod_list_default.csv`` (read in place)."""
    from qosflow.paths import shared_data

    return shared_data() / "traces" / "alibaba_v2023_openb_pod_list_default.csv"


def default_node_list() -> Path:
    from qosflow.paths import shared_data

    return shared_data() / "traces" / "alibaba_v2023_openb_node_list_gpu_node.csv"

