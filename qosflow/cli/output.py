"""Output of the CLI commands: their output paths, checked before the work starts (a long run whose results
cannot be written would otherwise end in a traceback, with the results lost), the JSON writer and the
progress bar, and the console and printing of their result tables (`result_console`, `print_table`): on a terminal a
table fits its width, split into parts that repeat its first columns; elsewhere (a pipe, a file, a log) as it always was."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from qosflow.errors import QosflowError
from qosflow.paths import shared_data
from qosflow.sim.files import replacing


def check_output_file(path: Path, option: str = "--json") -> None:
    """Fail now if `path` cannot be written (a directory, an unwritable or missing place). Leaves nothing
    behind: a missing parent directory is made only when the file is written."""
    if str(path) == "-":  # was written to a file named '-' in the current directory
        raise QosflowError(f"{option} -: the results go to a file, not to standard output (the table goes there); "
                           f"give a file name, e.g. {option} out.json")
    if path.is_dir():
        raise QosflowError(f"{option} {path}: is a directory; give a file name, e.g. {path / 'out.json'}")
    try:
        if path.parent.exists():
            existed = path.exists()
            with open(path, "a", encoding="utf-8"):
                pass
            if not existed:
                path.unlink()
        else:
            _probe_mkdir(path.parent)
    except OSError as exc:
        raise _unwritable(option, path, exc, "a path in a writable directory") from None


def _in_shared_data(path: Path) -> bool:
    try:
        shared, where = shared_data().resolve(), path.resolve()
    except OSError:
        return False
    return shared == where or shared in where.parents


def _shared_data_refused(option: str, path: Path, example: str) -> QosflowError:
    return QosflowError(f"{option} {path}: that is in the shared public data ({shared_data()}), which is read in place "
                        f"and never written; give a place of your own, e.g. {option} {example}")


def _check_not_someone_elses(path: Path, option: str) -> None:
    """Fail now if `path` is in the shared public data, or an existing file that no qosflow command wrote: not
    a JSON object or array (a trace, a CSV, a stage's source, a database). `check_not_an_input` knows only the files
    given on this command line: `simulate --trace synthetic --json muri_philly_trace1.csv` wrote its results
    over the shared Muri trace (and its plots beside it), whose read-only mode root does not heed. An earlier
    result (a JSON object, or the array `predict stages --json` writes), or an empty file, is replaced as before."""
    if _in_shared_data(path):
        raise _shared_data_refused(option, path, str(Path("out") / (path.stem + "-results.json")))
    if not path.is_file():
        return
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError:
        return  # check_output_file says why it cannot be written
    if head and not head.startswith((b"{", b"[")):
        shown = head.split(b"\n", 1)[0][:60].decode("utf-8", "replace")
        raise QosflowError(f"{option} {path}: the file exists and is not a JSON result (it begins {shown!r}); the results "
                           f"would overwrite it. Give another file, e.g. {option} {path.with_name(path.stem + '-results.json')}, "
                           "or remove that one first")


def check_output_dir(path: Path, option: str = "--out") -> None:
    """Fail now if `path` cannot be made a directory we can write files in. Leaves nothing behind: a
    missing directory is made only when the first file is written into it."""
    if path.exists() and not path.is_dir():
        raise QosflowError(f"{option} {path}: is a file, not a directory; give a directory")
    if _in_shared_data(path):  # (its plots and per-job CSVs would go beside the traces)
        raise _shared_data_refused(option, path, "out/")
    try:
        if path.is_dir():
            probe = path / ".qosflow-write-check"
            probe.write_text("")
            probe.unlink()
        else:
            _probe_mkdir(path)
    except OSError as exc:
        raise _unwritable(option, path, exc, "a writable directory") from None


def check_not_an_input(path: Path | None, inputs: dict, option: str = "--json") -> None:
    """Fail now if the output file `path` is one of the command's input files (`inputs`: option -> path or
    spec, None when not given; a cluster's FILE#vc counts as FILE). The check of the output place passed,
    and the run then wrote its results over the trace, cluster, pod list or table it had read. Nor may it be
    a file that is not a JSON result, or one of the shared public data (`_check_not_someone_elses`)."""
    if path is None:
        return
    for opt, given in inputs.items():
        if given is None:
            continue
        src = Path(str(given).split("#", 1)[0])
        try:
            same = src.is_file() and path.exists() and os.path.samefile(path, src) or src.resolve() == path.resolve()
        except OSError:
            same = False
        if same and src.is_file():
            raise QosflowError(f"{option} {path}: that is the {opt} file this command uses, and the results would "
                               f"overwrite it; give another file, e.g. {option} {path.with_name(path.stem + '-results.json')}")
    _check_not_someone_elses(path, option)


def check_file_and_dir(file: Path | None, directory: Path | None, file_option: str = "--json", dir_option: str = "--out") -> None:
    """Fail now if the file `file` is the directory `directory` or one of its parents: each check alone
    passes, and the run then wrote one and ended in a FileExistsError traceback on the other."""
    if file is None or directory is None:
        return
    f, d = file.resolve(), directory.resolve()
    if f == d or f in d.parents:
        what = (f"{file_option} names a file and {dir_option} a directory at the same path" if f == d
                else f"{dir_option} would be a directory inside the file {file_option} names")
        raise QosflowError(f"{file_option} {file} and {dir_option} {directory}: {what}; give them different paths, e.g. "
                           f"{file_option} {directory / 'results.json'}")


def _probe_mkdir(missing: Path) -> None:
    """Raise OSError unless a directory can be made in the nearest existing ancestor of `missing` (the first
    directory `mkdir(parents=True)` would make): a directory is made there and removed again."""
    ancestor = missing
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    os.rmdir(tempfile.mkdtemp(prefix=".qosflow-write-check-", dir=ancestor))


def write_json_file(path: Path, data: dict, option: str = "--json") -> Path:
    """The one JSON writer of the CLI commands (results of simulate, pack, predict eval, profile).
    A figure that does not exist (NaN, infinity) is written as null: Python's `NaN` is not JSON, and
    jq, JavaScript and most JSON readers refuse the whole file."""
    text = json.dumps(_finite(data), indent=2, allow_nan=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # written beside it and renamed: a run interrupted while writing (Ctrl-C) left half a JSON file
        with replacing(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise _unwritable(option, path, exc, "a path in a writable directory") from None
    return path


def interrupted(written: list[Path], pending: list[str]) -> QosflowError:
    """What a Ctrl-C (KeyboardInterrupt) left: the files this run had written, and those it had not (the
    place may still hold an earlier run's). Ctrl-C ended the command with no word at all (exit 130)."""
    if not written:
        return Interrupted("interrupted before the runs had finished: nothing was written"
                           + (f" to {' or '.join(pending)}" if pending else ""))
    return Interrupted(f"interrupted while writing the results: written {', '.join(map(str, written))}; not written "
                       f"{', '.join(pending) or '-'} (what is there is an earlier run's): run the command again for a "
                       "complete set")


def unwritable_result(exc: OSError, written: list[Path]) -> QosflowError:
    """A result file that could not be written once the runs were done (its name taken by a directory, a
    full disk): which, why, and what had been written before it."""
    where = exc.filename2 if isinstance(exc, IsADirectoryError) and exc.filename2 else exc.filename
    return QosflowError(f"cannot write {where or 'the results'}: {exc.strerror or exc}"
                        + (f"; written before it: {', '.join(map(str, written))}" if written else "; nothing was written")
                        + ". Free that place (or give another --out / --json) and run again")


class Interrupted(QosflowError):
    """A command stopped by Ctrl-C; exit status 130, as a shell gives a command killed by SIGINT."""

    exit_code = 130


def result_console(min_width: int = 0):
    """The console a command prints its results on. On a terminal: the terminal's width (COLUMNS when set, else
    its size), which `print_table` fits every table into. Elsewhere (a pipe, a file, a batch job's log): at least
    `min_width` columns, as before, so that scripts and logs that read the tables get the same lines; simulate and
    status printed their tables at 120 columns into an 80-column terminal too, where they wrapped into a jumble
    of box characters."""
    from rich.console import Console

    console = Console()
    if on_terminal(console) or console.width >= min_width:
        return console
    return Console(width=min_width)


def on_terminal(console) -> bool:
    """Whether `console` writes to a terminal: its file is one (or TTY_COMPATIBLE=1 says to take it for one,
    TTY_COMPATIBLE=0 not). Not rich's `is_terminal`, which FORCE_COLOR makes true: a CI job that sets it for
    coloured logs would have had its tables split at rich's default of 80 columns."""
    said = os.environ.get("TTY_COMPATIBLE", "")
    if said in ("0", "1"):
        return said == "1"
    isatty = getattr(console.file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed file
        return False


def print_table(console, table, *, keep: int = 1, first: tuple[str, ...] = (), flexible: dict[str, int] | None = None) -> None:
    """Print a rich `table` on `console`: on a terminal, in as many parts as it takes to fit the terminal's width
    (`split_table`); elsewhere whole, as before."""
    if not on_terminal(console):
        console.print(table)
        return
    parts = split_table(table, console, console.width, keep=keep, first=first, flexible=flexible)
    caption = table.caption if len(parts) > 1 else None
    for part in parts:
        if caption is not None:
            part.caption = None
        console.print(part)
    if caption is not None:  # under the parts at the terminal's width: under the last part it wrapped at that part's
        from rich.text import Text

        console.print(Text(caption, style="table.caption") if isinstance(caption, str) else caption)


def table_width(table, console, flexible: dict[str, int] | None = None) -> int:
    """The columns `table` takes at its natural width (each cell on one line), a column named in `flexible`
    (header -> width) counted at no more than that width (prose that wraps well, e.g. why a stage waits)."""
    from dataclasses import replace

    from rich.measure import Measurement

    if flexible:
        table = _with_columns(table, [replace(c, max_width=min(c.max_width or 10**6, flexible[c.header]))
                                      if isinstance(c.header, str) and c.header in flexible else c for c in table.columns])
    return Measurement.get(console, console.options.update(width=100_000), table).maximum


def split_table(table, console, width: int, *, keep: int = 1, first: tuple[str, ...] = (),
                flexible: dict[str, int] | None = None) -> list:
    """`table` as parts no wider than `width` columns, each with the first `keep` columns (what names a row: the
    policy, the stage) and as many others as fit, every row and number as it was. The columns named in `first`
    (their headers) are placed before the others, in that order, each in the first part with room for it; then the
    others in the table's order, likewise; within a part the columns keep the table's order. One part, the table itself, when it fits. The title
    goes on every part (the later ones '(continued)'), the caption under the last. A column that does not fit
    even alone beside the `keep` ones gets a part of its own, which rich then narrows by wrapping its cells."""
    if table_width(table, console, flexible) <= width or len(table.columns) <= keep:
        return [table]
    cols = list(table.columns)
    keys, rest = cols[:keep], cols[keep:]
    named = {c.header: c for c in rest if isinstance(c.header, str)}
    order = [named[h] for h in first if h in named]
    order += [c for c in rest if c not in order]
    parts: list[list] = []
    for col in order:  # first fit: each column into the first part it fits in
        for part in parts:
            if table_width(_with_columns(table, keys + _in_table_order(part + [col], cols)), console, flexible) <= width:
                part.append(col)
                break
        else:
            parts.append([col])
    out = []
    for i, part in enumerate(parts):
        t = _with_columns(table, keys + _in_table_order(part, cols))
        if i > 0 and t.title is not None:
            t.title = f"{t.title} (continued)" if isinstance(t.title, str) else t.title
        if i < len(parts) - 1:
            t.caption = None
        out.append(t)
    return out


def _in_table_order(part: list, cols: list) -> list:
    return sorted(part, key=lambda c: next(i for i, x in enumerate(cols) if x is c))


def _with_columns(table, columns: list):
    """A copy of `table` (title, caption, box, styles, rows' styles and sections) with these of its columns."""
    import copy
    from dataclasses import replace

    t = copy.copy(table)
    t.columns = [replace(c, _index=i, _cells=list(c._cells)) for i, c in enumerate(columns)]
    t.rows = list(table.rows)
    return t


def progress_bar(*columns, console=None):
    """The transient progress bar of a long CLI run (rich's `Progress`; its default columns if none given).

    Started only on an interactive console: elsewhere (a pipe, a log, TERM=dumb) a transient bar shows
    nothing, yet rich's `Progress.stop` prints an empty line there, so the run's next output, or the
    error of a run that failed inside the bar, came after a stray blank line."""
    from rich import get_console
    from rich.progress import Progress

    console = console or get_console()
    if not (on_terminal(console) and console.is_interactive):  # (FORCE_COLOR makes a log 'interactive' to rich)
        # a run in a batch job or under nohup showed nothing at all for its hours: lines on stderr instead
        return LogProgress()
    return Progress(*columns, console=console, transient=True)


class LogProgress:
    """The progress of a long run where no bar can be drawn (stderr not a terminal: a batch job, nohup, a
    pipe): once the run has taken `after` seconds, a line on stderr per task at each tenth of its total,
    at most one per task every `every` seconds otherwise ('[0:02:10] fifo: 5,000/20,000 (25 %)'). A short
    run prints nothing. The calls are those of rich's `Progress` that the commands use."""

    def __init__(self, after: float = 10.0, every: float = 60.0, stream=None):
        import time

        self._clock = time.monotonic
        self._start = self._clock()
        self.after, self.every = after, every
        self._stream = stream
        self._tasks: dict[int, dict] = {}

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        tid = len(self._tasks)
        self._tasks[tid] = {"description": description.strip(), "total": total, "completed": 0.0, "step": 0, "at": None}
        return tid

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, completed: float | None = None, advance: float | None = None,
               description: str | None = None, total: float | None = None, **_) -> None:
        t = self._tasks[task_id]
        if description is not None:
            t["description"] = description.strip()
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        now = self._clock()
        if now - self._start < self.after or not t["total"]:
            return
        step = int(10 * t["completed"] / t["total"])
        if step > t["step"] or t["at"] is None or now - t["at"] >= self.every:
            t["step"], t["at"] = step, now
            import sys

            elapsed = int(now - self._start)
            stamp = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
            print(f"[{stamp}] {t['description']}: {t['completed']:,.0f}/{t['total']:,.0f} "
                  f"({t['completed'] / t['total']:.0%})", file=self._stream or sys.stderr, flush=True)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _unwritable(option: str, path: Path, exc: OSError, give: str) -> QosflowError:
    return QosflowError(f"{option} {path}: cannot write there ({exc.strerror or exc}); give {give}")
