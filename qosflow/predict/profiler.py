"""`qosflow profile MODULE:FUNCTION --steps N`: lightweight profiling of a stage function.

The function runs in a child process, once per configuration (by default two CPU core counts, pinned
with os.sched_setaffinity), for at most `steps` reported steps or `budget_s` seconds, whichever comes
first. It reports steps through `qosflow.track` / `qosflow.report_progress` (the child sets
QOSFLOW_PROGRESS_FILE); if it accepts a `steps` (or `max_steps`, `num_steps`) argument it is given
N+1: the first step is treated as warm-up, the next N are measured. Step times and -- when NVML finds a GPU
-- GPU utilisation and memory are stored as samples; the CPU time and wall time reported (not stored) cover
the whole child process, start-up and imports included (the CPU time also the processes it started), and how
busy other processes kept its cores meanwhile. Without a GPU this is said plainly and only CPU time is
profiled: no GPU number is ever made up.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qosflow.core.gpu_names import CPU_ONLY, short_gpu_model
from qosflow.errors import QosflowError, SpecError
from qosflow.procgroup import group_members, poll_group, stat_fields, stop_group
from qosflow.progress import ENV_VAR, read_progress
from qosflow.workers import cpu_cores


@dataclass
class GpuInfo:
    present: bool
    name: str | None
    message: str


def detect_gpu() -> GpuInfo:
    try:
        import pynvml
    except ImportError:
        return GpuInfo(False, None, "no GPU: nvidia-ml-py (pynvml) is not installed; profiling CPU time only")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML raises its own error types
        return GpuInfo(False, None, f"no GPU: NVML unavailable ({exc}); profiling CPU time only")
    try:
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return GpuInfo(False, None, "no GPU: NVML found 0 devices; profiling CPU time only")
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else name
        return GpuInfo(True, str(name), f"GPU 0: {name} (NVML; model {short_gpu_model(name)})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class _NvmlSampler(threading.Thread):
    """Polls GPU 0's utilisation and memory every 0.2 s while a configuration runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.util: list[float] = []
        self.mem_mb: list[float] = []
        self._stop_evt = threading.Event()

    def run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            while not self._stop_evt.wait(0.2):
                self.util.append(float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
                self.mem_mb.append(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20)
        finally:
            pynvml.nvmlShutdown()

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(2)


@dataclass
class ConfigResult:
    cpu_cores: int
    gpus: int
    steps: int
    step_time_s: float | None
    step_time_sd_s: float | None
    cpu_time_s: float
    wall_s: float
    gpu_util_pct: float | None = None
    gpu_mem_mb: float | None = None
    stopped: str = "finished"
    #: how busy other processes kept the cores the function was pinned to meanwhile (per cent of those cores'
    #: time; /proc/stat less the function's own CPU time), None where /proc/stat cannot be read
    others_busy_pct: float | None = None
    #: the signature the target's process derived (module.function; a @qos_task's stage signature)
    signature: str | None = None


@dataclass
class ProfileResult:
    target: str
    signature: str
    gpu: GpuInfo
    configs: list[ConfigResult] = field(default_factory=list)
    stored_samples: int = 0
    database: str | None = None
    #: why storing the measurements failed (the database went away while the function ran), else None
    store_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: exit status and stderr marker of the child when the target cannot be loaded or called
_SETUP_EXIT = 87
_SETUP_MARK = "qosflow-profile-setup-error: "
#: stderr marker of the signature the child derived from the target (what the worker calls the stage)
_SIG_MARK = "qosflow-profile-signature: "

_RUNNER = r"""
import importlib, inspect, os, sys, traceback
target, steps, cores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
MARK, EXIT, SIG_MARK = sys.argv[4], int(sys.argv[5]), sys.argv[6]
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
mod, _, fn = target.partition(":")
sys.path.insert(0, os.getcwd())

def fail(msg):
    sys.stderr.flush()
    sys.stderr.write("\n" + MARK + msg.replace("\n", " ") + "\n")
    sys.stderr.flush()
    os._exit(EXIT)

try:
    m = importlib.import_module(mod)
except Exception as exc:
    traceback.print_exc()
    if isinstance(exc, ModuleNotFoundError) and exc.name and (mod == exc.name or mod.startswith(exc.name + ".")):
        fail(f"no module named {mod!r} (looked in the current directory {os.getcwd()} and the installed packages): "
             "run qosflow profile from the directory that holds it, or install its package")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        # a package the module imports (torch, ...) that the Python running qosflow lacks: the module is fine,
        # the interpreter is not the one it is meant for (was "fix the module")
        fail(f"module {mod!r} imports {exc.name!r}, which is not installed for {sys.executable}, the Python that "
             f"runs qosflow profile and the function: install it there ({sys.executable} -m pip install ...), or "
             f"run the profile with the Python that has it: PYTHON -m qosflow profile {target} ...")
    fail(f"importing module {mod!r} failed: {type(exc).__name__}: {exc} (fix the module; the end of its traceback follows)")
f = getattr(m, fn, None)
if f is None:
    # what could be meant: the module's own functions and its @qos_task stages (a Prefect task, not a function,
    # was left out while the functions it imported, qos_task itself, were listed)
    def _own(obj):
        if getattr(obj, "qos_fn", None) is not None:
            obj = obj.qos_fn
        return inspect.isfunction(obj) and getattr(obj, "__module__", None) == m.__name__
    names = [n for n in dir(m) if not n.startswith("_") and _own(getattr(m, n))]
    import difflib
    near = difflib.get_close_matches(fn, names, n=1)
    fail(f"module {mod!r} ({getattr(m, '__file__', '?')}) has no function {fn!r}"
         + (f" (did you mean {mod}:{near[0]}?)" if near else "")
         + (f"; its functions and stages: {', '.join(names[:20])}" if names else "; it defines no function"))
if not callable(f):
    fail(f"{target} is not a function (it is a {type(f).__name__!r} object)")
inner = getattr(f, "qos_fn", None)
if inner is not None:  # a @qos_task: run its function, and store under the signature the worker gives the stage
    from qosflow.predict.estimator import signature_of
    sig = signature_of(f.signature, getattr(f, "batch_size", None))
    f = inner
else:
    sig = f"{getattr(f, '__module__', None) or mod}.{getattr(f, '__qualname__', None) or fn}"
sys.stderr.write("\n" + SIG_MARK + sig + "\n")
sys.stderr.flush()
try:
    params = inspect.signature(f).parameters
except (TypeError, ValueError):
    params = {}
kw = {}
for name in ("steps", "max_steps", "num_steps"):
    if name in params:
        kw[name] = steps + 1  # the warm-up step and the N measured: a loop of exactly `steps` gave N-1
        break
required = [p.name for p in params.values() if p.default is p.empty and p.name not in kw
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
if required:
    fail(f"{target} needs the argument(s) {', '.join(required)}; qosflow profile calls it with no arguments "
         "(only steps/max_steps/num_steps=N+1 when it takes one): give them defaults, or profile a small wrapper "
         f"function that calls it, with --signature {sig} so that its samples go to this stage (under the wrapper's "
         "own name no stage would use them)")
try:
    f(**kw)
except Exception as exc:  # its traceback from the function on: the first frame, this runner's, said File "<string>"
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


def _check_target(target: str) -> None:
    mod, sep, fn = target.partition(":")
    if not sep or not mod or not fn or not fn.isidentifier():
        raise SpecError("target", f"{target!r} is not MODULE:FUNCTION (e.g. mypkg.train:step_loop)")
    if "/" in mod or "\\" in mod or (mod.endswith(".py") and os.path.isfile(mod)):
        # a file path (what `prefect deploy` takes): was "no module named 'mystages/train.py'"
        p = Path(mod)
        if p.is_absolute():
            try:
                p = p.relative_to(Path.cwd())
            except ValueError:
                pass
        parts = [x for x in (p.with_suffix("") if p.suffix == ".py" else p).parts if x != "."]
        if p.is_absolute() or ".." in parts or not all(x.isidentifier() for x in parts):
            raise SpecError("target", f"{target!r} names a file; TARGET is MODULE:FUNCTION, the module's dotted name "
                            f"as imported from the current directory: cd to the directory that holds its package "
                            f"and give PACKAGE.MODULE:{fn}")
        raise SpecError("target", f"{target!r} names a file; TARGET is MODULE:FUNCTION, the module's dotted name as "
                        f"imported from the current directory: {'.'.join(parts)}:{fn}")


def measured_step_times(events: list, steps: int) -> list[float]:
    """Durations of steps 2 .. steps+1 (step 1 is the warm-up), whatever the first reported step is:
    `track` reports step 0 before the loop, so step 1's duration is known (and dropped); a function
    that calls `report_progress(1)` after its first step only starts the clock there."""
    out: list[float] = []
    for a, b in zip(events, events[1:]):
        ds = b.step - a.step
        if ds > 0 and b.t >= a.t:
            d = (b.t - a.t) / ds
            out.extend(d for s in range(a.step + 1, b.step + 1) if s >= 2)
    return out[:steps]


def run_config(target: str, steps: int, cores: int, budget_s: float, gpu: GpuInfo) -> ConfigResult:
    with tempfile.TemporaryDirectory(prefix="qosflow-profile-") as tmp:
        prog = os.path.join(tmp, "progress.jsonl")
        env = dict(os.environ, **{ENV_VAR: prog})
        sampler = _NvmlSampler() if gpu.present else None
        if sampler:
            sampler.start()
        pinned = sorted(os.sched_getaffinity(0))[:cores]  # the cores the runner pins itself to
        busy0 = _cores_busy_s(pinned)
        t0 = time.monotonic()
        ru0 = os.times()
        # stderr goes to a file, not a pipe: a chatty function would fill a pipe nobody reads while it
        # runs and block; its own session lets the profile kill whatever the function started
        with open(os.path.join(tmp, "stderr.txt"), "w+", encoding="utf-8", errors="replace") as errf:
            proc = subprocess.Popen(
                [sys.executable, "-c", _RUNNER, target, str(steps), str(cores), _SETUP_MARK, str(_SETUP_EXIT), _SIG_MARK],
                env=env, stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True,
            )
            stopped = "finished"
            group_cpu = 0.0
            try:
                while poll_group(proc) is None:  # (an exited function's group is ended before it is reaped)
                    time.sleep(0.02)
                    if time.monotonic() - t0 > budget_s:
                        stopped = f"budget {budget_s:g}s reached"
                    else:
                        ev = read_progress(prog)
                        if ev and max(e.step for e in ev) >= steps + 1:  # warm-up step + N measured
                            stopped = f"{steps} steps reached"
                    if stopped != "finished":
                        group_cpu = _group_cpu_s(proc.pid)  # before the stop, while its processes live
                        break
            finally:  # also on Ctrl-C: nothing of the function may outlive the profile
                # the child and everything it started (DataLoader workers, multiprocessing children):
                # they would keep running, and an inherited stderr would keep the profile waiting
                # (`stop_group` signals the group while its leader still holds the group's id: after
                # the leader is reaped the id may belong to another process's group)
                stop_group(proc, 0)
                proc.wait()
            wall = time.monotonic() - t0
            ru1 = os.times()
            busy1 = _cores_busy_s(pinned)
            if sampler:
                sampler.stop()
            errf.seek(0)
            err = errf.read()
        if proc.returncode == _SETUP_EXIT and stopped == "finished":
            lines = err.strip().splitlines()
            msg = next((ln[len(_SETUP_MARK):] for ln in reversed(lines) if ln.startswith(_SETUP_MARK)), None)
            if msg is not None:
                tail = [ln for ln in lines if not ln.startswith(_SETUP_MARK)][-5:]
                detail = ("\n" + "\n".join(tail)) if tail and "traceback follows" in msg else ""
                raise QosflowError(f"cannot profile {target}: {msg}{detail}")
        if proc.returncode not in (0, None) and stopped == "finished":
            tail = [ln for ln in (err or "").strip().splitlines() if not ln.startswith(_SIG_MARK)][-5:]
            raise QosflowError(f"{target} failed with exit code {proc.returncode}:\n" + "\n".join(tail))
        ev = read_progress(prog)
    derived = next((ln[len(_SIG_MARK):].strip() for ln in err.splitlines() if ln.startswith(_SIG_MARK)), None)
    times = measured_step_times(ev, steps)
    cpu = max((ru1.children_user - ru0.children_user) + (ru1.children_system - ru0.children_system), group_cpu)
    res = ConfigResult(
        cpu_cores=cores, gpus=1 if gpu.present else 0, steps=len(times),
        step_time_s=statistics.median(times) if times else None,
        step_time_sd_s=statistics.stdev(times) if len(times) > 1 else None,
        cpu_time_s=cpu, wall_s=wall, stopped=stopped, signature=derived or None,
    )
    if busy0 is not None and busy1 is not None and wall > 0:
        res.others_busy_pct = 100 * min(1.0, max(0.0, (busy1 - busy0 - cpu) / (wall * len(pinned))))
    if sampler and sampler.util:
        res.gpu_util_pct = statistics.mean(sampler.util)
        res.gpu_mem_mb = max(sampler.mem_mb)
    return res


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of the live processes of the function's group and of the children each has reaped. A
    function stopped at its N-th step is killed with its DataLoader workers, whose CPU time the profile's own
    count (its reaped children's) never saw: 0.06 s was shown for a function whose worker had used 1.5 s."""
    total = 0
    for pid in group_members(pgid):
        f = stat_fields(pid)  # from the state on: utime, stime, cutime, cstime are at 11-14
        try:
            total += sum(int(x) for x in f[11:15])  # type: ignore[index]
        except (TypeError, ValueError):  # gone meanwhile
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _cores_busy_s(cpus: list[int]) -> float | None:
    """Seconds the CPUs `cpus` have spent busy since boot, whoever ran (/proc/stat: user, nice, system, irq,
    softirq, steal); None without /proc/stat."""
    want = {f"cpu{c}" for c in cpus}
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            rows = [ln.split() for ln in fh if ln.startswith("cpu")]
    except OSError:
        return None
    ticks = sum(int(r[i]) for r in rows if r[0] in want for i in (1, 2, 3, 6, 7, 8) if i < len(r))
    return ticks / os.sysconf("SC_CLK_TCK")


def default_core_counts() -> list[int]:
    n = cpu_cores()
    return sorted({max(1, n // 2), n})


def check_core_counts(cores: list[int], option: str = "cores") -> None:
    """Refuse a core count below 1 or above the cores this process may use, or one given twice (the same
    configuration measured twice), naming `option`."""
    avail = cpu_cores()
    for c in cores:
        if c < 1 or c > avail:
            raise SpecError(option, f"{c} is not between 1 and the {avail} cores this process may use")
    twice = sorted({c for c in cores if cores.count(c) > 1})
    if twice:
        raise SpecError(option, f"{', '.join(map(str, twice))} given more than once ({','.join(map(str, cores))}); each "
                                "core count is one configuration, measured once: give distinct counts, e.g. "
                                f"{','.join(map(str, sorted(set(cores))))}")


def profile(target: str, steps: int, *, cores: list[int] | None = None, budget_s: float = 60.0,
            signature: str | None = None, store: Any = None) -> ProfileResult:
    _check_target(target)
    if steps < 1:
        raise SpecError("steps", f"must be >= 1, got {steps}")
    if not budget_s > 0 or budget_s == float("inf"):
        raise SpecError("budget", f"must be a number of seconds > 0, got {budget_s}")
    cores = cores or default_core_counts()
    check_core_counts(cores)
    gpu = detect_gpu()
    result = ProfileResult(target=target, signature=signature or target, gpu=gpu)
    for c in cores:
        result.configs.append(run_config(target, steps, c, budget_s, gpu))
    if signature is None:  # what the worker will call the stage, so that its estimates use this profile
        result.signature = next((c.signature for c in result.configs if c.signature), None) or target
    if store is not None:
        import sqlalchemy as sa

        result.database = store.safe_url
        try:
            _store(store, result, short_gpu_model(gpu.name) if gpu.name else CPU_ONLY)
        except (QosflowError, sa.exc.SQLAlchemyError) as exc:
            # the database went away while the function ran (minutes, maybe): was a traceback, and the
            # measurements were neither printed nor written to --json
            done = f" (its {result.stored_samples} samples were, the profile row was not)" if result.stored_samples else ""
            result.store_error = (f"the measurements were not stored in {store.safe_url}{done}: "
                                  f"{getattr(exc, 'orig', None) or exc}")
    return result


def _store(store: Any, result: ProfileResult, gpu_type: str) -> None:
    """Each measured configuration as a sample, the fastest as the signature's profile too."""
    samples = []
    for r in result.configs:
        if r.step_time_s is None:
            continue
        samples.append({
            "signature": result.signature, "gpus": r.gpus, "gpu_type": gpu_type,
            "cpu_cores": r.cpu_cores, "step_time_s": r.step_time_s, "steps": r.steps, "source": "profile",
            "gpu_util_pct": r.gpu_util_pct, "gpu_mem_mb": r.gpu_mem_mb,
        })
    store.add_samples(samples)
    result.stored_samples = len(samples)
    best = min((r for r in result.configs if r.step_time_s), key=lambda r: r.step_time_s, default=None)
    if best is not None:
        store.add_profile(result.signature, best.step_time_s, gpu_type=gpu_type, cpu_cores=best.cpu_cores)
