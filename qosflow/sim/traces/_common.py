"""Helpers shared by the trace loaders: CSV rows with line numbers, typed fields, rejection."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Iterable, Iterator

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.qos import QoSSpec
from qosflow.errors import SpecError, TraceFormatError

#: (job id, reason) of a job that can never run on the cluster; never silently dropped
Rejected = tuple[str, str]

#: CPU cores given to each GPU of a training job when the trace does not say (CODA measured 4-6
#: cores per GPU saturating CV input pipelines; 4 keeps an 8-GPU job within 32 cores)
CORES_PER_GPU = 4.0


#: leading bytes of files that are not text: (magic, what the file is and how to fix it)
_PACKED = (
    (b"\x1f\x8b", "gzip-compressed: unpack it first (gunzip)"),
    (b"PK\x03\x04", "a ZIP archive or a spreadsheet (.xlsx): unpack it, or export the sheet as CSV"),
)


def check_text(path: Path, kind: str) -> None:
    """Fail with a TraceFormatError naming `path` when it is a directory, a compressed file or a spreadsheet,
    or not UTF-8 text (then with the line of the first bad byte); a missing file is left to the caller.
    Reading such files ended in a UnicodeDecodeError traceback."""
    if path.is_dir():
        raise TraceFormatError(path, None, f"is a directory; give the {kind} file")
    if not path.is_file():
        return
    raw = path.read_bytes()
    for magic, what in _PACKED:
        if raw.startswith(magic):
            raise TraceFormatError(path, None, f"is {what}; a {kind} is a text file")
    try:
        raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise TraceFormatError(
            path, line, f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); a {kind} is a UTF-8 text file: save it as "
                        "UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)") from None


def delimiter_hint(header: list[str]) -> str:
    """'; the header is separated by ...' when a one-column header holds another delimiter than the comma
    (a CSV saved with semicolons, as spreadsheets do in many locales, or with tabs), else ''."""
    if len(header) == 1:
        for delim, name in ((";", "semicolons"), ("\t", "tabs"), ("|", "'|'")):
            if delim in header[0]:
                return f"; its header is separated by {name}, but the file must be comma-separated: save it as CSV with commas"
    return ""


def misnamed_hint(missing: Iterable[str], header: list[str], known: Iterable[str] = ()) -> str:
    """'; ...' naming, for each missing column, the header column it most likely was meant to be ('Duration',
    'num_gpus', 'gpu mili'), among those the format does not know (`known`), else ''."""
    import difflib

    spare = [h for h in header if h and h not in set(known) and h not in set(missing)]
    norm = {h: re.sub(r"[\s_\-]+", "_", h.strip().lower()) for h in spare}
    pairs = []
    for m in missing:
        same = [h for h in spare if norm[h] == m.lower()]
        near = (same or difflib.get_close_matches(m.lower(), [norm[h] for h in spare], n=1, cutoff=0.75)
                or [norm[h] for h in spare if len(norm[h]) >= 3 and m.lower().startswith(norm[h])][:1])  # 'dur
        if near:
            h = same[0] if same else next(h for h in spare if norm[h] == near[0])
            pairs.append(f"{h!r} for {m!r}")
    if not pairs:
        return ""
    return f"; the header has {', '.join(pairs)}: rename {'it' if len(pairs) == 1 else 'them'} (names are exact, lowercase)"


def csv_rows(path: Path, required: Iterable[str], kind: str, known: Iterable[str] = ()) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) for every data row, after checking the header names every required column
    (`known`: the format's optional columns, never taken for a misnamed required one)."""
    required = tuple(required)
    check_text(path, kind)
    if not path.is_file():
        raise TraceFormatError(path, None, f"{kind} not found")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TraceFormatError(path, 1, f"empty file; a {kind} starts with the header {','.join(required)}") from None
        except csv.Error as exc:
            raise TraceFormatError(path, 1, f"unreadable CSV header: {exc}") from None
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceFormatError(
                path,
                1,
                f"missing column(s) {', '.join(repr(c) for c in missing)}; a {kind} needs {','.join(required)} "
                f"(found: {','.join(header)}){misnamed_hint(missing, header, known)}{delimiter_hint(header)}",
            )
        check_unique_columns(path, header)
        yield from data_rows(path, reader, header)


def check_unique_columns(path: Path, header: list[str]) -> None:
    """A header naming a column twice is an error naming it: the last of the two was read and the first
    ignored without a word (a 'duration' column pasted after another: jobs of 1 h ran 60 ms)."""
    dup = [h for i, h in enumerate(header) if h and h in header[:i]]
    if dup:
        cols = ", ".join(f"{h!r} (columns {header.index(h) + 1} and {header.index(h, header.index(h) + 1) + 1})"
                         for h in dict.fromkeys(dup))
        raise TraceFormatError(path, 1, f"the header names {cols} twice; keep one of each")


def data_rows(path: Path, reader, header: list[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) for every row `reader` (a `csv.reader` past the header) yields, blank rows
    skipped, each row checked to have one field per column of `header` (stripped names)."""
    width = len(header)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceFormatError(path, reader.line_num, f"unreadable CSV row: {exc}") from None
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != width:
            raise TraceFormatError(path, reader.line_num, f"expected {width} fields ({','.join(header)}), got {len(row)}")
        yield reader.line_num, {h: v.strip() for h, v in zip(header, row)}


#: seconds per time unit a trace's cell may carry by mistake ('90min', '2 h', '1500ms')
_UNITS = {
    "ms": 0.001, "msec": 0.001, "millisecond": 0.001, "milliseconds": 0.001,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_WITH_UNIT = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z]+)\s*$")


def unit_hint(raw: str, unit: str) -> str:
    """'; ...' telling how to write a time given with a unit ('60min') in the column's `unit` ('ms' or 's'),
    else ''. The error said only "expected duration in ms (a number), got '60min'"."""
    m = _WITH_UNIT.match(raw)
    if not m or m.group(2).lower() not in _UNITS:
        return ""
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] / (0.001 if unit == "ms" else 1.0)
    name = "milliseconds" if unit == "ms" else "seconds"
    return f"; the column is in {name}, written without a unit: {raw.strip()!r} is {value:.12g}"


def separator_hint(raw: str) -> str:
    """'; ...' for a number written with thousands separators ('3,600,000') or a decimal comma ('0,5'), as
    spreadsheets export them in many locales, else ''."""
    t = raw.strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", t):
        return f"; write numbers without thousands separators: {t.replace(',', '')}"
    if re.fullmatch(r"[-+]?\d+,\d+", t):
        return f"; write the decimal point as a point: {t.replace(',', '.')}"
    return ""


def number(path: Path, line: int, col: str, raw: str, what: str, *, integer: bool = False, minimum: float | None = 0.0,
           positive: bool = False) -> float:
    """A finite number from column `col`, or a TraceFormatError naming file, line and column."""
    try:
        v = float(raw)
    except ValueError:
        unit = "ms" if what.endswith(" in ms") else "s" if what.endswith(" in seconds") else None
        hint = (unit_hint(raw, unit) if unit else "") or separator_hint(raw)
        raise TraceFormatError(path, line, f"column {col!r}: expected {what} (a number), got {raw!r}{hint}") from None
    if not math.isfinite(v):
        raise TraceFormatError(path, line, f"column {col!r}: expected a finite {what}, got {raw!r}")
    if integer and not v.is_integer():
        raise TraceFormatError(path, line, f"column {col!r}: expected a whole number ({what}), got {raw!r}")
    if positive and v <= 0:
        raise TraceFormatError(path, line, f"column {col!r}: {what} must be > 0, got {raw!r}")
    if minimum is not None and v < minimum:
        raise TraceFormatError(path, line, f"column {col!r}: {what} must be >= {minimum:g}, got {raw!r}")
    return v


def make_job(path: Path, line: int, **kwargs) -> Job:
    """A Job, turning a SpecError from its validation into a TraceFormatError at this line."""
    return _at_line(path, line, Job, kwargs)


def make_qos(path: Path, line: int, **kwargs) -> QoSSpec:
    """A QoSSpec, turning a SpecError from its validation into a TraceFormatError at this line."""
    return _at_line(path, line, QoSSpec, kwargs)


def _at_line(path: Path, line: int, cls, kwargs: dict):
    try:
        return cls(**kwargs)
    except SpecError as exc:
        raise TraceFormatError(path, line, str(exc)) from None


def split_rejected(jobs: list[Job], cluster: ClusterSpec | None, *, single_node: bool = False) -> tuple[list[Job], list[Rejected]]:
    """Jobs that can run on `cluster`, and (job id, reason) for those that never can (with
    `single_node`, also those no single node can hold: `ClusterSpec.why_never_fits`)."""
    if cluster is None:
        return jobs, []
    ok: list[Job] = []
    rejected: list[Rejected] = []
    memo: dict[tuple, str | None] = {}  # the answer depends only on the request's shape
    for j in jobs:
        q = j.qos
        key = (q.gpus, q.gpu_milli, q.gpu_mem_mb, q.cpu_cores, q.mem_mb, q.gpu_model)
        if key not in memo:
            memo[key] = cluster.why_never_fits(q, single_node=single_node)
        why = memo[key]
        if why:
            rejected.append((j.job_id, f"can never be placed on {cluster.name}: {why}"))
        else:
            ok.append(j)
    return ok, rejected
