"""Reference tables the predictor learns from: Gavel's throughput table and co-location pair tables.

Gavel's table (``../shared/data/throughputs/gavel_simulation_throughputs.json``, read in place via
`qosflow.paths.shared_data`) maps worker type -> "('<job type>', <scale factor>)" -> {"null": solo
throughput (steps/s), "('<other job type>', 1)": [own throughput, other's throughput] when the two
share the GPU}. ``<worker>_unconsolidated`` holds the same jobs spread over servers.

A pair table is a CSV with columns ``model1,batchsize1,gpu_num1,speed1,model2,batchsize2,gpu_num2,speed2``
(other columns ignored); speed is the job's throughput while co-located, normalised to running alone.
An empty speed cell means not measured (NaN in `PairRow`); an empty batch size means unknown (0); a
batch size of 0 or less in the file is an error.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qosflow.errors import TraceFormatError

GAVEL_FILE = Path("throughputs") / "gavel_simulation_throughputs.json"
_BS_PATTERNS = [
    re.compile(r"^(?P<fam>.*?)\s*\(batch size (?P<bs>\d+)\)\s*$", re.I),
    re.compile(r"^(?P<fam>.*?)\s*[/:@_ -]\s*(?:bs|batch)[=_ ]?(?P<bs>\d+)\s*$", re.I),
]


def parse_signature(signature: str) -> tuple[str, int | None]:
    """(family, batch size) of a job signature: 'ResNet-50 (batch size 64)', 'resnet50/bs64', 'lm:bs=20'."""
    for pat in _BS_PATTERNS:
        m = pat.match(signature)
        if m:
            return m.group("fam").strip(), int(m.group("bs"))
    return signature.strip(), None


def default_gavel_path() -> Path:
    from qosflow.paths import shared_data

    return shared_data() / GAVEL_FILE


@dataclass
class ThroughputTable:
    """Gavel-style measurements: solo throughputs per (worker, consolidated, gpus) and 1-GPU pair speeds."""

    jobs: list[str]
    workers: list[str]
    #: (worker, consolidated, gpus) -> array over jobs of solo throughput (steps/s); NaN = not measured, 0 = failed
    solo: dict[tuple[str, bool, int], np.ndarray]
    #: worker -> J x J array: speed of row job (normalised to its solo 1-GPU throughput) when sharing with column job
    pair_speed: dict[str, np.ndarray]
    source: str = ""
    index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {j: i for i, j in enumerate(self.jobs)}

    @property
    def gpu_counts(self) -> list[int]:
        return sorted({n for (_w, _c, n) in self.solo})

    def solo_throughput(self, job: str, worker: str, gpus: int = 1, consolidated: bool = True) -> float | None:
        a = self.solo.get((worker, consolidated, gpus))
        if a is None or job not in self.index:
            return None
        v = float(a[self.index[job]])
        return v if v == v else None

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ThroughputTable":
        path = Path(path) if path is not None else default_gavel_path()
        try:
            text = path.read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            raise TraceFormatError(path, None, "throughput table not found") from None
        except IsADirectoryError:
            raise TraceFormatError(path, None, "is a directory; give the throughput table's JSON file in it "
                                               f"(e.g. {GAVEL_FILE.name})") from None
        except OSError as exc:
            raise TraceFormatError(path, None, f"cannot read the throughput table: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise TraceFormatError(path, None, "not a text file; expected a JSON throughput table "
                                               "(worker type -> job -> throughputs)") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            first = next((ln for ln in text.splitlines() if ln.strip()), "").lower()
            hint = ("; this looks like a co-location pair table (a CSV): give it as --pairs, not --throughputs"
                    if all(c in first for c in ("model1", "speed1", "model2")) else
                    "; expected Gavel's JSON throughput table (worker type -> job -> throughputs)")
            raise TraceFormatError(path, exc.lineno, f"not valid JSON: {exc.msg}{hint}") from None
        if not isinstance(raw, dict) or not raw:
            raise TraceFormatError(path, None, "expected an object: worker type -> job -> throughputs")
        workers = sorted({w.removesuffix("_unconsolidated") for w in raw})
        jobs: list[str] = []
        parsed: dict[str, dict[tuple[str, int], dict]] = {}
        for wk, entries in raw.items():
            if not isinstance(entries, dict):
                raise TraceFormatError(path, None, f"worker {wk!r}: expected an object of job entries")
            parsed[wk] = {}
            for key, val in entries.items():
                try:
                    job, scale = ast.literal_eval(key)
                    scale = int(scale)
                except (ValueError, SyntaxError, TypeError):
                    raise TraceFormatError(path, None, f"worker {wk!r}: bad job key {key!r}, expected \"('<job>', <gpus>)\"") from None
                if not isinstance(val, dict) or "null" not in val:
                    raise TraceFormatError(path, None, f"worker {wk!r} job {key}: missing solo throughput 'null'")
                parsed[wk][(job, scale)] = val
                if job not in jobs:
                    jobs.append(job)
            # every other figure is relative to a job's solo 1-GPU throughput on its worker type: without one
            # the evaluation and the predictor's references had nothing to divide by (a KeyError)
            if not entries:
                raise TraceFormatError(path, None, f"worker {wk!r}: no job entries; expected \"('<job>', <gpus>)\": "
                                                   "{\"null\": <solo throughput>, ...}, or drop the worker type")
            if not wk.endswith("_unconsolidated") and all(scale != 1 for _job, scale in parsed[wk]):
                raise TraceFormatError(path, None, f"worker {wk!r}: no 1-GPU job entry (\"('<job>', 1)\"); the solo "
                                                   "1-GPU throughputs are the base of the others: add them, or drop "
                                                   "the worker type")
        def num(x, where: str) -> float:
            """A throughput: a number >= 0, or null (not measured: NaN)."""
            if x is None:
                return math.nan
            try:
                v = float(x)
            except (TypeError, ValueError):
                v = -1.0
            if not (v >= 0 and math.isfinite(v)):
                raise TraceFormatError(path, None, f"{where}: {x!r} is not a throughput; expected a number >= 0 "
                                                   f"(steps/s; 0 = failed, null = not measured)")
            return v

        idx = {j: i for i, j in enumerate(jobs)}
        J = len(jobs)
        solo: dict[tuple[str, bool, int], np.ndarray] = {}
        pair: dict[str, np.ndarray] = {}
        for wk, entries in parsed.items():
            w = wk.removesuffix("_unconsolidated")
            cons = not wk.endswith("_unconsolidated")
            for (job, scale), val in entries.items():
                arr = solo.setdefault((w, cons, scale), np.full(J, np.nan))
                arr[idx[job]] = num(val["null"], f"worker {wk!r} job ({job!r}, {scale}) 'null'")
            if not cons:
                continue
            M = pair.setdefault(w, np.full((J, J), np.nan))
            for (job, scale), val in entries.items():
                if scale != 1:
                    continue
                base = solo[(w, cons, scale)][idx[job]]
                for pk, pv in val.items():
                    if pk == "null":
                        continue
                    try:
                        pjob, pscale = ast.literal_eval(pk)
                    except (ValueError, SyntaxError, TypeError):
                        continue
                    if int(pscale) != 1 or pjob not in idx or not base > 0 or pv is None:
                        continue
                    where = f"worker {wk!r} job ({job!r}, 1) co-runner {pk}"
                    if not isinstance(pv, (list, tuple)) or len(pv) != 2:
                        raise TraceFormatError(path, None, f"{where}: expected [this job's throughput, the co-runner's "
                                                           f"throughput], got {pv!r}")
                    own = num(pv[0], where)
                    num(pv[1], where)
                    if own / base > MAX_PAIR_SPEED:  # as a pair table's speed: was evaluated, at 1593 % MAPE
                        raise TraceFormatError(
                            path, None, f"{where}: {pv[0]!r} steps/s next to the co-runner is {own / base:.3g} x the "
                            f"job's solo 1-GPU throughput ({base:g}); sharing a GPU does not make a job faster than "
                            f"about 1 x (at most {MAX_PAIR_SPEED:g}): a typo, or a figure in other units")
                    M[idx[job], idx[pjob]] = own / base
        return cls(jobs=jobs, workers=workers, solo=solo, pair_speed=pair, source=str(path))

    def pair_rows(self, worker: str) -> list[dict]:
        """One row per unordered measured pair (a <= b) on `worker`, in the pair-table CSV format."""
        M = self.pair_speed[worker]
        rows = []
        for i, a in enumerate(self.jobs):
            for j in range(i, len(self.jobs)):
                b = self.jobs[j]
                if np.isnan(M[i, j]) or np.isnan(M[j, i]):
                    continue
                fa, ba = parse_signature(a)
                fb, bb = parse_signature(b)
                rows.append(
                    {"model1": fa, "batchsize1": ba or 0, "gpu_num1": 1, "speed1": round(float(M[i, j]), 6),
                     "model2": fb, "batchsize2": bb or 0, "gpu_num2": 1, "speed2": round(float(M[j, i]), 6),
                     "gpu_type": worker}
                )
        return rows


PAIR_COLUMNS = ["model1", "batchsize1", "gpu_num1", "speed1", "model2", "batchsize2", "gpu_num2", "speed2"]


def write_pairs_csv(rows: list[dict], path: str | Path) -> None:
    """Write a pair table `read_pairs_csv` reads back. An unknown batch size (0, as `PairRow` and
    `ThroughputTable.pair_rows` hold it, or None/NaN) is written as an empty cell: a 0 is refused."""
    cols = PAIR_COLUMNS + [k for k in (rows[0] if rows else {}) if k not in PAIR_COLUMNS]

    def cell(k, v):
        if k in ("batchsize1", "batchsize2") and (v is None or (isinstance(v, (int, float)) and (v == 0 or math.isnan(v)))):
            return ""
        return v

    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows({k: cell(k, v) for k, v in row.items()} for row in rows)


@dataclass(frozen=True)
class PairRow:
    model1: str
    batchsize1: float
    gpu_num1: int
    speed1: float
    model2: str
    batchsize2: float
    gpu_num2: int
    speed2: float
    line: int

    @property
    def key1(self) -> str:
        return job_key(self.model1, self.batchsize1, self.gpu_num1)

    @property
    def key2(self) -> str:
        return job_key(self.model2, self.batchsize2, self.gpu_num2)


#: cell values read as "empty" (not measured / unknown) in a pair table
MISSING = ("", "nan", "na", "n/a", "null", "none")
#: largest co-located speed a pair table may hold. A speed is throughput next to the partner over throughput
#: alone, so at most about 1; a little above 1 is measurement noise (Gavel's table tops out at 1.0), but
#: twice as fast next to a partner is not a measurement: a per-cent figure (85) or a throughput in steps/s
MAX_PAIR_SPEED = 2.0


def job_key(model: str, batch_size: float, gpus: int) -> str:
    bs = int(batch_size) if float(batch_size).is_integer() else batch_size
    return f"{model}|bs{bs}|g{gpus}"


_PAIR_HINTS = {
    "speed": "speed = throughput next to the partner / throughput alone, e.g. 0.85 (0 = could not run together; "
             "leave the cell empty if it was not measured)",
    "batchsize": "a batch size, e.g. 64 (leave the cell empty if unknown)",
    "gpu_num": "the number of GPUs the job uses, e.g. 1, 2, 4 or 8",
}


def _read_text(path: Path) -> str:
    """The file's text: UTF-8 (with or without BOM), UTF-16 with BOM, else Latin-1 (model names stay distinct)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(path, None, "pair table not found") from None
    except OSError as exc:
        raise TraceFormatError(path, None, f"cannot read the pair table: {exc.strerror or exc}") from None
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return raw.decode("utf-16")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def read_pairs_csv(path: str | Path) -> list[PairRow]:
    """Read a co-location pair table; every bad cell is reported as file:line with the column.

    Column names are matched ignoring case and surrounding spaces; the delimiter may be a comma, a tab
    or a semicolon (whichever the header line has most of); cells beyond the header are ignored.
    """
    path = Path(path)
    text = _read_text(path)
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    delim = max(",\t;", key=first.count)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delim, skipinitialspace=True)
    header: list[str] = []
    for cells in reader:  # the first non-blank line
        if any(c.strip() for c in cells):
            header = [h.strip().lower() for h in cells]
            break
    if not header:
        raise TraceFormatError(path, None, f"empty file; a pair table is a CSV whose header names {','.join(PAIR_COLUMNS)}")
    if first.lstrip().startswith(("{", "[")):
        raise TraceFormatError(path, None, "this is JSON, not a CSV pair table: a Gavel-style throughput table goes to "
                                        "--throughputs; a pair table's header names " + ",".join(PAIR_COLUMNS))
    missing = [c for c in PAIR_COLUMNS if c not in header]
    if missing:
        raise TraceFormatError(path, reader.line_num or 1, f"missing column(s) {', '.join(missing)}; the header must name "
                                        f"{','.join(PAIR_COLUMNS)} (other columns are ignored); found: {header[:20]}")
    col = {c: header.index(c) for c in PAIR_COLUMNS}
    rows = []
    start = reader.line_num
    for cells in reader:
        lineno, start = start + 1, reader.line_num  # the line the record starts on
        rec = {c: cells[i].strip() if i < len(cells) else "" for c, i in col.items()}
        if not any(rec.values()):
            continue
        cut = [c for c in PAIR_COLUMNS if col[c] >= len(cells)]
        if cut:  # a row cut short: its last speed was read as an empty cell, "not measured", and left out silently
            raise TraceFormatError(path, lineno, f"the row has {len(cells)} cell(s), so no column {', '.join(cut)} "
                                   f"(the header has {len(header)}): a cell is missing or the line was cut off; a "
                                   "speed that was not measured is an empty cell, not a missing one")
        vals = {}
        for c in PAIR_COLUMNS:
            v = rec[c]
            if c.startswith("model"):
                if not v:
                    raise TraceFormatError(path, lineno, f"column {c}: empty model name; every row needs both model names")
                vals[c] = v
                continue
            if v.lower() in MISSING and not c.startswith("gpu_num"):
                # an empty speed was not measured (that direction is left out); an empty batch size is unknown
                vals[c] = math.nan if c.startswith("speed") else 0.0
                continue
            hint = _PAIR_HINTS[c[:-1]]
            try:
                x = float(v)
            except ValueError:
                raise TraceFormatError(path, lineno, f"column {c}: {v!r} is not a number; {hint}") from None
            if c.startswith("batchsize") and not 0 < x < math.inf:  # 0 was taken for "unknown", as an empty cell is
                raise TraceFormatError(path, lineno, f"column {c}: {v!r} must be a finite number > 0; {hint}")
            if c.startswith("batchsize") and not x.is_integer():  # a count of samples (64.5: a unit or a typo)
                raise TraceFormatError(path, lineno, f"column {c}: {v!r} is not a whole number; a batch size counts "
                                       "samples per step: give a whole number, e.g. 64 (leave the cell empty if unknown)")
            if math.isnan(x) or math.isinf(x) or x < 0:
                raise TraceFormatError(path, lineno, f"column {c}: {v!r} must be a finite number >= 0; {hint}")
            if c.startswith("speed") and x > MAX_PAIR_SPEED:
                raise TraceFormatError(
                    path, lineno, f"column {c}: {v!r} is not a plausible speed (at most {MAX_PAIR_SPEED:g}; up to about 1 "
                    "is expected, a little above 1 is measurement noise): a speed is the job's throughput next to the "
                    "partner divided by its throughput alone, e.g. 0.85, not a per cent figure (85) or a throughput "
                    "in steps/s; divide by 100 or by the solo throughput")
            if c.startswith("gpu_num"):
                if not x.is_integer() or x < 1:
                    raise TraceFormatError(path, lineno, f"column {c}: {v!r} must be a whole number >= 1; {hint}")
                x = int(x)
            vals[c] = x
        rows.append(PairRow(line=lineno, **vals))
    if not rows:
        raise TraceFormatError(path, None, "no pair rows")
    return rows
