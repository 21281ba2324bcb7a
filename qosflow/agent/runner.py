"""Start, follow and stop stage processes on this host.

Each stage runs in its own process group (so a kill reaches its children), with the environment the
worker sent (the placement's `CUDA_VISIBLE_DEVICES`, `OMP_NUM_THREADS`, `QOSFLOW_PLACEMENT`...), pinned
to its CPU cores with `sched_setaffinity` before it executes, and with `PR_SET_PDEATHSIG` so that it
dies with the agent: a lost agent never leaves a stage running that the worker will start elsewhere.
Output (stdout and stderr together) goes to a log file that `logs()` follows; the stage's progress
lines (`qosflow.report_progress`) to a file of their own, which the worker copies (`progress()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import pwd
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from qosflow.backends.base import AGENT_STOPPING
from qosflow.paths import file_stem
from qosflow.placement_api import PROGRESS_FILE_ENV
from qosflow.procgroup import group_members, kill_group

_PR_SET_PDEATHSIG = 1
#: the label that names a process's role (the same key as `qosflow.backends.agent.PIPELINE_ROLE_LABEL`): the
#: worker launches a pipeline run (`AgentBackend.launch_unplaced`, `pipelines_on: agents`) with value "pipeline"
ROLE_LABEL = "qosflow.dev/role"
#: how a fence's kill reason starts (`qosflow.failures` reads a stage killed so as the worker rerunning it elsewhere)
FENCED = "fenced"
#: how long an ended stage's progress file outlives its log removed under --max-logs-mb while the worker has not read it
#: to its end (`Runner._trim_logs`)
PROGRESS_KEEP_S = 60.0
#: how long a kill waits for the start of a stage whose process is being started (`Runner.kill`); past it the stage is
#: killed as soon as it has started
LAUNCH_WAIT_S = 60.0
#: how long the agent stopping waits for a start under way before it goes (`Runner.kill_all`)
STOP_START_WAIT_S = 5.0


class _Starters(concurrent.futures.Executor):
    """The threads that start the stages' processes (fork, then exec: `Runner._launch`), off the agent's event loop: an
    exec that hangs (a command or working directory on a dead NFS mount) froze the whole agent, which answered no
    heartbeat, and a worker took it for lost. They live as long as the agent (a stage's PR_SET_PDEATHSIG is its starting
    thread's) and are daemon threads: a ThreadPoolExecutor's are joined as the interpreter exits, and one whose start
    hung kept the agent from ever exiting (a SIGTERM, Ctrl-C, `systemctl stop` waited for the dead mount)."""

    def __init__(self, threads: int, name: str):
        self._threads, self._name = threads, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:  # type: ignore[override]
        with self._lock:
            if not self._started:
                for i in range(self._threads):
                    threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True).start()
                self._started = True
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args, kwargs = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the launch reads it
                fut.set_exception(exc)
            else:
                fut.set_result(result)


_STARTERS = _Starters(8, "qosflow-agent-start")

#: held by a process start from before `subprocess` makes its exec-status pipe until the parent has closed that pipe's
#: write end, just after the fork (`_StartedPopen`): a moment, whatever the child does
_FORK_LOCK = threading.Lock()


class _StartedPopen(subprocess.Popen):
    """A Popen whose fork no other start of this agent overlaps. `subprocess` learns that the exec happened (or why it
    failed) by reading a pipe to its end, and a child forked by another thread while that pipe's write end was open in
    the parent held a copy of it until it closed its fds, just before its exec: a child that hung before (its working
    directory on a dead NFS mount: the chdir comes first) held up the start of a stage that overlapped it, whose process
    ran while the agent had no pid for it, to report or to kill. The lock is released once the parent closed the write
    end (`_close_pipe_fds`, called right after) or the start ended, whichever comes first."""

    def __init__(self, *args, **kwargs):
        _FORK_LOCK.acquire()
        self._holds_fork_lock = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._release_fork_lock()

    def _close_pipe_fds(self, *fds):  # (subprocess: the exec-status pipe's write end is closed; its read begins)
        self._release_fork_lock()
        super()._close_pipe_fds(*fds)

    def _release_fork_lock(self) -> None:
        if self.__dict__.get("_holds_fork_lock"):
            self._holds_fork_lock = False
            _FORK_LOCK.release()


#: environment variables of the agent that a stage must never see
_SECRET_ENV = ("QOSFLOW_AGENT_TOKEN",)


#: kills the process groups of the stages still running when the agent's process is gone (EOF on its stdin)
_GUARD = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    op, _, pg = line.strip().partition(" ")
    if pg.isdigit():
        (groups.add if op == "+" else groups.discard)(int(pg))
for pg in groups:
    try:
        os.killpg(pg, signal.SIGKILL)
    except OSError:
        pass
"""


class _Guard:
    """One small process per agent process that outlives it and kills what its stages left running.

    PR_SET_PDEATHSIG reaches a stage's main process only. A process it started (`sh -c 'python
    train.py; ...'`'s python, a launcher's workers) survived an agent killed by SIGKILL or the OOM
    killer, while the worker, finding the agent's port closed, took the stage for dead and ran it again
    elsewhere: the stage ran twice. The guard is told each running stage's process group; when the
    agent's end of its pipe closes, however the agent ended, it SIGKILLs those groups."""

    def __init__(self) -> None:
        self._proc = None
        #: the groups told to the guard: a guard started again (the first one was killed) is told them all
        self._groups: set[int] = set()

    def _send(self, line: str) -> None:
        import subprocess
        import sys

        try:
            if self._proc is None or self._proc.poll() is not None:
                # (its fork, on the agent's event loop, is a stage start's too: one that overlapped it held a copy of
                # this start's pipe, and a child that hung before its exec froze the loop)
                self._proc = _StartedPopen([sys.executable, "-I", "-S", "-c", _GUARD], stdin=subprocess.PIPE,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True, text=True, bufsize=1)
                line = "".join(f"+ {pg}\n" for pg in sorted(self._groups)) + line
            self._proc.stdin.write(line + "\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError):
            pass  # no guard: the stages' main processes still die with the agent (PR_SET_PDEATHSIG)

    def watch(self, pgid: int) -> None:
        self._groups.add(pgid)
        self._send(f"+ {pgid}")

    def forget(self, pgid: int) -> None:
        self._groups.discard(pgid)
        self._send(f"- {pgid}")


_guard = _Guard()


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def map_cpuset(requested: list[int] | None, usable: list[int]) -> list[int] | None:
    """The cores to pin to. Requested core ids that exist here are kept; a host that declares more
    cores than it has (a virtual host on a small machine) gets its ids folded onto the real ones
    (id mod count). The status reports both sets, so nothing is hidden."""
    if not requested:
        return None
    present = [c for c in requested if c in usable]
    if len(present) == len(requested):
        return sorted(set(present))
    return sorted({usable[c % len(usable)] for c in requested})


@dataclass(frozen=True)
class StageUser:
    """The account stages run as when the agent runs as root (`qosflow agent start --stage-user`)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def resolve(cls, name: str) -> "StageUser":
        """The account `name` (or a numeric uid), checked: it exists, is not root, and the agent can switch to it."""
        from qosflow.errors import SpecError

        try:
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except (KeyError, ValueError):
            raise SpecError("--stage-user", f"no account {name!r} on this host; create one that owns nothing else "
                                            f"(e.g. `useradd --system --create-home {name}`) or name an existing one") from None
        if pw.pw_uid == 0:
            raise SpecError("--stage-user", f"{name!r} is root: stages would run with every right on the host; "
                                            "name an unprivileged account")
        if os.geteuid() != 0:
            raise SpecError("--stage-user", f"the agent runs as uid {os.geteuid()}, not root, and cannot switch to "
                                            f"{pw.pw_name!r}; start it as root (e.g. from a systemd unit without User=), "
                                            "or drop --stage-user to run stages as the agent's own user")
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    def _may(self, path: Path, bit: int) -> bool:
        """Whether this account has `bit` (4 read, 1 execute/search) on `path` by owner and mode (ACLs aside)."""
        st = path.stat()
        if st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid in self.groups or st.st_gid == self.gid:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    def can_read(self, path: Path) -> bool:
        """Whether this account may read the file `path`, its directories included."""
        path = path.resolve()
        return self._may(path, 4) and not self.blocked_at(path.parent)

    def blocked_at(self, directory: Path) -> Path | None:
        """The first directory on the way to `directory` (itself included) this account may not pass, or None."""
        directory = directory.resolve()
        for d in (*reversed(directory.parents), directory):
            if not self._may(d, 1):
                return d
        return None


@dataclass
class StageProc:
    stage_id: str
    command: list[str]
    log_path: Path
    labels: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    cpuset_requested: list[int] | None = None
    cpuset: list[int] | None = None
    pid: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    returncode: int | None = None
    killed_reason: str | None = None
    error: str | None = None
    #: its log was removed to keep the agent's logs within their budget (`Runner.max_log_bytes`)
    log_removed: bool = False
    #: the worker that launched it, or adopted it last (its `X-Qosflow-Worker` id): the fence kills it when that worker
    #: has been silent for --fence-after. None: launched without the header (an older worker, curl): any request counts
    owner: str | None = None
    #: when (the agent's fence clock) `owner` took it: its silence counts from then at the earliest
    owner_since: float = 0.0
    #: how far the worker has read its progress file (`Runner.progress`): a removed log's progress file goes once read
    progress_read: int = 0
    proc: subprocess.Popen | None = None
    #: a kill came while its process was still being started and gave up waiting (`LAUNCH_WAIT_S`): it is killed
    #: (SIGKILL) as soon as it has started
    kill_on_start: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: set once the launch has settled (its process started, with its pid, or it could not start)
    launched: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def progress_path(self) -> Path:
        """Where the stage's `qosflow.report_progress` lines go, beside its log (the worker copies them)."""
        return self.log_path.with_suffix(".progress")

    @property
    def running(self) -> bool:
        return self.ended_at is None

    @property
    def is_pipeline(self) -> bool:
        """A pipeline run (label qosflow.dev/role=pipeline): it holds no GPU and is never rerun elsewhere (the
        next worker adopts it), so a fence spares it."""
        return self.labels.get(ROLE_LABEL) == "pipeline"

    def status(self) -> dict:
        sig = -self.returncode if self.returncode is not None and self.returncode < 0 else None
        return {
            "stage_id": self.stage_id,
            "state": "running" if self.running else "exited",
            "pid": self.pid,
            "command": self.command,
            "labels": self.labels,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "returncode": self.returncode,
            "signal": signal.Signals(sig).name if sig else None,
            "killed_reason": self.killed_reason,
            "error": self.error,
            "log_removed": self.log_removed,
            "owner": self.owner,
            "cpuset_requested": self.cpuset_requested,
            "cpuset": self.cpuset,
        }


def start_error(command: list[str], cwd: str | None, exc: BaseException, user: "StageUser | None" = None,
                env: dict[str, str] | None = None) -> str:
    """Why a stage's process could not start, in words that name what is missing on this host and how to fix it.
    (Python says "No such file or directory: '/srv/x'" for a working directory that does not exist as for a command,
    which read "cannot start 'python3': ... '/srv/x'", as if python3 were missing.)"""
    prog = command[0] if command else ""
    who = f" (stages run as {user.name!r})" if user is not None else ""
    if not command:
        return "the stage's command is empty"
    if cwd and not os.path.isdir(cwd):
        return (f"its working directory {cwd} does not exist on this host: create it there (or give every host the same "
                f"layout), or set the stage's working directory to one that exists")
    if isinstance(exc, PermissionError) and cwd and exc.filename == cwd:
        return f"its working directory {cwd} cannot be entered{who}: {exc.strerror}"
    if isinstance(exc, FileNotFoundError):
        if os.sep in prog:
            extra = ""
            if os.path.basename(prog).startswith("python"):
                extra = (f"; the worker starts stages with its own interpreter's path: install qosflow (and the flow's code) at "
                         f"that path on every host, or set the work pool's `command` job variable to an interpreter every host "
                         f"has (this agent runs under {sys.executable})")
            return f"{prog} does not exist on this host{extra}"
        path = (env or {}).get("PATH") or os.environ.get("PATH", "")
        return f"{prog!r} is not on this host's PATH ({path}): install it there or give its full path"
    if isinstance(exc, PermissionError):
        return f"{prog} cannot be executed{who}: {exc.strerror} (is it a program, with its x bit set?)"
    return f"cannot start {prog!r}: {exc}"


class Runner:
    """All stages of one agent. Lives on the agent's event loop."""

    def __init__(self, workdir: Path, *, max_records: int = 10_000, stage_user: StageUser | None = None,
                 max_log_bytes: int | None = None):
        self.workdir = Path(workdir)
        #: the stages' logs (stdout and stderr) together stay within this many bytes: beyond it the logs of the stages
        #: that ended longest ago are removed (their records stay, `log_removed`). None: no limit. A stage that prints
        #: every step wrote tens of MB a run into the agent's directory (/tmp by default), kept until 10,000 records
        self.max_log_bytes = max_log_bytes
        # stage logs are for the agent's API (behind its token), not for every user of the host: a
        # --workdir the agent makes is its own (0700) and the logs are 0600, as in the default temp dir
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        #: stages run as this account, not as the agent's (root): they cannot read the token or the logs
        self.stage_user = stage_user
        if stage_user is not None:
            # the stage (another account) must reach its progress file, made and given to it per stage;
            # others may pass through the directory (0711) but not list it, and every log stays 0600
            self.workdir.chmod(self.workdir.stat().st_mode & 0o777 | 0o111)
            blocked = stage_user.blocked_at(self.workdir)
            if blocked is not None:
                from qosflow.errors import SpecError

                raise SpecError("--workdir", f"stages run as {stage_user.name!r}, who cannot pass through {blocked} to reach "
                                             f"their progress files in {self.workdir}: choose a --workdir outside it "
                                             f"(e.g. /var/lib/qosflow-agent) or chmod o+x {blocked}")
        self.stages: dict[str, StageProc] = {}
        self.max_records = max_records
        self._usable = usable_cpus()

    # ------------------------------------------------------------------ launch
    async def launch(self, stage_id: str, command: list[str], **kw) -> StageProc:
        """Start a stage (`_launch`). A launch that fails otherwise than by its process not starting (its log cannot be
        made, ...) ends its record, so that nothing waits for it for ever: a kill waits for its launch to settle."""
        before = self.stages.get(stage_id)
        try:
            return await self._launch(stage_id, command, **kw)
        except BaseException as exc:
            st = self.stages.get(stage_id)
            if st is not None and st is not before and not st.launched.is_set():
                st.error = st.error or f"the agent could not start it: {type(exc).__name__}: {exc}"
                st.returncode, st.ended_at = 127, time.time()
                st.done.set()
                st.launched.set()
            raise

    async def _launch(
        self,
        stage_id: str,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cpuset: list[int] | None = None,
        labels: dict[str, str] | None = None,
        python_fallback: bool = False,
        owner: str | None = None,
        owner_since: float = 0.0,
    ) -> StageProc:
        """Start `command`. `python_fallback`: its first word is the worker's own interpreter (the default stage
        command, `<worker's python> -m prefect.engine`); if this host has no such file, the agent's interpreter (the
        Python qosflow and Prefect are installed in here) runs the stage instead, and its log says so."""
        if stage_id in self.stages:
            raise KeyError(stage_id)
        self._prune()
        note = ""
        if python_fallback and command and os.path.isabs(command[0]) and not os.path.exists(command[0]) \
                and os.path.realpath(command[0]) != os.path.realpath(sys.executable):
            # the worker runs stages with the path of its own interpreter (/opt/qosflow/bin/python on the worker's host);
            # a host whose qosflow lives elsewhere (another venv, pyenv or conda path) failed every stage with
            # "No such file or directory". Only a path that does not exist: one that exists but cannot run (no x bit, a
            # broken interpreter) is this host's install to fix, said by the start error (it was run with another
            # interpreter, and the log said the file did not exist)
            note = (f"qosflow agent: {command[0]} (the worker's interpreter) does not exist on this host; running the stage "
                    f"with the agent's interpreter {sys.executable} (the flow's packages must be installed there too: a "
                    f"ModuleNotFoundError below means they are not)\n")
            command = [sys.executable, *command[1:]]
        log_path = self.workdir / f"{file_stem(stage_id)}.log"
        st = StageProc(
            stage_id=stage_id,
            command=list(command),
            log_path=log_path,
            labels=dict(labels or {}),
            cwd=cwd,
            cpuset_requested=list(cpuset) if cpuset else None,
            cpuset=map_cpuset(cpuset, self._usable),
            owner=owner,
            owner_since=owner_since,
        )
        self.stages[stage_id] = st
        child_env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
        user = self.stage_user
        if user is not None:  # the account's own home and name, not root's (the worker's env may still set them)
            child_env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
        child_env.update(env or {})
        child_env["QOSFLOW_STAGE_ID"] = stage_id
        child_env[PROGRESS_FILE_ENV] = str(st.progress_path)
        if st.cpuset:
            child_env.setdefault("QOSFLOW_CPUSET", ",".join(map(str, st.cpuset)))
        cpus = st.cpuset

        prctl = _prctl()  # (looked up here: the child, forked by a starter thread, only calls it)
        agent_pid = os.getpid()

        def _pre_exec() -> None:  # runs in the child between fork and exec
            try:
                if prctl is not None:
                    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            except Exception:
                pass
            if os.getppid() != agent_pid:
                # the agent died before PR_SET_PDEATHSIG was set (it does nothing once the parent is gone): a start that
                # hung (a working directory on a dead NFS mount) and went on later ran the stage with no agent to kill
                # it, while the worker ran it again elsewhere
                os._exit(127)
            if cpus:
                os.sched_setaffinity(0, cpus)

        as_user: dict = {}
        if user is not None:
            # the progress file is made here and given to the stage's account: it cannot create files in
            # the agent's directory. setgroups/setgid/setuid happen in the child before _pre_exec, so
            # PR_SET_PDEATHSIG (cleared by a credential change) is set after them
            fd = os.open(st.progress_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchown(fd, user.uid, user.gid)
            finally:
                os.close(fd)
            as_user = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
        st.started_at = time.time()
        logf = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab", buffering=0)
        loop = asyncio.get_running_loop()

        def start() -> subprocess.Popen:
            return _StartedPopen(command, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=child_env,
                                    cwd=cwd, start_new_session=True, preexec_fn=_pre_exec, **as_user)

        started = loop.run_in_executor(_STARTERS, start)
        try:
            # (shielded: a launch cancelled while its process starts, the agent stopping, must not leave that process
            # running unknown to the agent: it is killed once started)
            st.proc = await asyncio.shield(started)
        except asyncio.CancelledError:
            started.add_done_callback(_kill_orphan)
            started.add_done_callback(lambda _f: logf.close())
            raise
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # command not found, bad cwd, a cwd --stage-user cannot enter...
            why = start_error(command, cwd, exc, user, child_env)
            logf.write(f"{note}qosflow agent: cannot start {command!r}: {why}\n".encode())
            logf.close()
            st.error = why
            st.returncode = 127
            st.ended_at = time.time()
            st.done.set()
            st.launched.set()
            self._trim_logs()
            return st
        if note:
            logf.write(note.encode())
        logf.close()
        st.pid = st.proc.pid
        _guard.watch(st.pid)
        loop.create_task(self._reap(st))
        st.launched.set()
        if st.kill_on_start:  # (a kill gave up waiting for this start: it runs no further)
            try:
                os.killpg(st.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return st

    async def _reap(self, st: StageProc) -> None:
        assert st.proc is not None
        rc = await _exited(st.proc)
        # what the stage left behind in its process group (`cmd &`, a launcher's children) ends with it:
        # the worker frees the stage's slot now, and a DELETE or a fence only looks at running stages, so
        # such processes kept running, on GPUs given to the next stage, with nothing left to kill them.
        # The leader is reaped (by `_exited`): its id stays its group's only while a member
        # lives; once none does the id is free and may lead another process's group or session, so the
        # group is signalled only if members of the stage's session are still there (qosflow.procgroup)
        if group_members(st.pid):  # type: ignore[arg-type]
            kill_group(st.pid)  # type: ignore[arg-type]
        _guard.forget(st.pid)  # type: ignore[arg-type]
        st.returncode = rc
        st.ended_at = time.time()
        st.done.set()
        self._trim_logs()

    def _trim_logs(self) -> None:
        """Remove the logs of the stages that ended longest ago until all logs together fit `max_log_bytes` (the logs
        of running stages count, but are never removed). The stages' `.progress` files count too (a stage reporting
        progress at every step wrote as much there as in its log, outside the budget) and go with their log, once the
        worker has copied them to their end (`progress`) or the stage ended `PROGRESS_KEEP_S` ago: removed at the
        stage's end (--max-logs-mb 0), its last progress lines never reached the worker, which copies them after it."""
        if self.max_log_bytes is None:
            return
        now = time.time()
        sizes: dict[str, tuple[int, int]] = {}  # stage id -> (its log's bytes, its progress file's)
        for s in self.stages.values():
            log_size = 0 if s.log_removed else _size(s.log_path)
            progress_size = _size(s.progress_path)
            if log_size is not None or progress_size is not None:
                sizes[s.stage_id] = (log_size or 0, progress_size or 0)
        total = sum(a + b for a, b in sizes.values())
        if total <= self.max_log_bytes:
            return
        for s in sorted((s for s in self.stages.values() if not s.running and s.stage_id in sizes), key=lambda s: s.ended_at or 0):
            if total <= self.max_log_bytes:
                break
            log_size, progress_size = sizes[s.stage_id]
            if not s.log_removed:
                try:
                    s.log_path.unlink()
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                s.log_removed = True
                total -= log_size
            if progress_size and self._progress_spent(s, progress_size, now):
                try:
                    s.progress_path.unlink()
                except OSError:
                    continue
                total -= progress_size

    def _progress_spent(self, st: StageProc, size: int, now: float) -> bool:
        """Whether an ended stage's progress file may go: the worker read it to its end, or it ended long enough ago."""
        return st.progress_read >= size or now - (st.ended_at or now) >= PROGRESS_KEEP_S

    def _prune(self) -> None:
        if len(self.stages) < self.max_records:
            return
        finished = sorted((s for s in self.stages.values() if not s.running), key=lambda s: s.ended_at or 0)
        for s in finished[: len(self.stages) - self.max_records + 1]:
            self.stages.pop(s.stage_id, None)
            for path in (s.log_path, s.progress_path):  # the record is gone: so are its files
                try:
                    path.unlink()
                except OSError:
                    pass

    # ------------------------------------------------------------------ control
    async def wait(self, st: StageProc, timeout: float) -> None:
        try:
            await asyncio.wait_for(st.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def kill(self, st: StageProc, reason: str, grace: float = 5.0, *, start_wait: float | None = None) -> None:
        """SIGTERM its process group, then SIGKILL after `grace` (a fence, or grace 0: SIGKILL at once). A stage whose
        process is still being started is killed once it has started: the kill waits for that start at most `start_wait`
        seconds (default LAUNCH_WAIT_S), then marks it to be killed as it starts (`kill_on_start`) and returns."""
        if not st.launched.is_set():
            # a kill that comes while the stage's process is being started (the launch awaits its exec; a worker whose
            # launch timed out on a busy or frozen agent asks for the kill at once, and both requests are then served
            # together): os.killpg(None) raised TypeError, the DELETE answered 500, and the stage ran on, with the
            # worker's retry of it elsewhere. Kill it once it has started
            try:
                await asyncio.wait_for(st.launched.wait(), LAUNCH_WAIT_S if start_wait is None else start_wait)
            except asyncio.TimeoutError:
                # its exec hangs (a dead NFS mount): killed as soon as it starts, if ever (the worker runs it elsewhere)
                st.kill_on_start = True
                if st.killed_reason is None:
                    st.killed_reason = reason
                return
        if not st.running or st.pid is None:
            return
        if st.killed_reason is None:
            st.killed_reason = reason
        steps = ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0))
        if reason.startswith("fenced") or grace <= 0:
            # the stage is being rerun elsewhere (or asked with grace 0): no SIGTERM, so that it cannot
            # report anything (e.g. a Prefect engine marking its flow run Crashed over the rerun's state)
            steps = ((signal.SIGKILL, 5.0),)
        for sig, wait in steps:
            if st.proc is not None and st.proc.returncode is not None and not group_members(st.pid):  # type: ignore[arg-type]
                return  # (reaped, _reap about to run, nothing left in its group: its id may be another's now)
            try:
                os.killpg(st.pid, sig)  # type: ignore[arg-type]
            except ProcessLookupError:
                return
            await self.wait(st, wait)
            if not st.running:
                return

    async def kill_all(self, reason: str, grace: float = 2.0, *, only: list[StageProc] | None = None) -> None:
        """Kill every running process; for a fence (a reason starting "fenced"), every one but the pipeline
        runs (`fenceable`): a fence keeps a stage the worker reruns elsewhere from running twice, and a
        pipeline run is never rerun, the next worker adopts it (fenced, it ended Crashed on every worker
        restart or network split longer than the fence). The agent stopping still kills them all. `only`: of
        those, these (the stages of one silent worker)."""
        targets = self.fenceable() if reason.startswith(FENCED) else self.running()
        if only is not None:
            chosen = {id(s) for s in only}
            targets = [s for s in targets if id(s) in chosen]
        # (the agent stopping waits a little for a start under way, so that a start that ends, as nearly all do within
        # milliseconds, is killed with its whole process group; one that hangs no longer keeps the agent from stopping
        # for LAUNCH_WAIT_S: what it starts dies with the agent, PR_SET_PDEATHSIG, or exits before it execs)
        start_wait = STOP_START_WAIT_S if reason == AGENT_STOPPING else None
        await asyncio.gather(*(self.kill(s, reason, grace, start_wait=start_wait) for s in targets))

    def set_cpuset(self, st: StageProc, cpuset: list[int]) -> list[int]:
        eff = map_cpuset(cpuset, self._usable) or self._usable
        if st.running and st.pid:
            # the whole process group: every thread of every process we started
            for pid in _group_pids(st.pid):
                for tid in _threads(pid):
                    try:
                        os.sched_setaffinity(tid, eff)
                    except (ProcessLookupError, PermissionError):
                        pass
        st.cpuset_requested, st.cpuset = list(cpuset), eff
        return eff

    def running(self) -> list[StageProc]:
        return [s for s in self.stages.values() if s.running]

    def fenceable(self) -> list[StageProc]:
        """The running processes a fence kills: the stages, not the pipeline runs (role pipeline)."""
        return [s for s in self.stages.values() if s.running and not s.is_pipeline]

    # ------------------------------------------------------------------ logs
    def progress(self, st: StageProc, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of the stage's progress lines from byte `offset` (empty: none yet). The progress file of an
        ended stage whose log the budget removed goes once it is read to its end (`_trim_logs` kept it for this read)."""
        try:
            with open(st.progress_path, "rb") as f:
                f.seek(max(0, offset))
                data = f.read(max(0, limit))
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return b""
        st.progress_read = max(st.progress_read, max(0, offset) + len(data))
        if st.log_removed and not st.running and st.progress_read >= size:
            try:
                st.progress_path.unlink()
            except OSError:
                pass
        return data

    async def follow(self, st: StageProc, offset: int = 0, follow: bool = True) -> AsyncIterator[bytes]:
        """The stage's output from byte `offset`; `follow`: until it ends. The file is kept open while it is read: the
        log budget (`_trim_logs`, at a stage's end) may remove it meanwhile, and a reader that reopened it for each
        chunk lost the rest of it (with --max-logs-mb 0 a stage's log goes as it ends: the worker following it lost its
        last lines, the traceback of a failed stage)."""
        pos = offset
        f = None
        try:
            while True:
                finished = not st.running
                if f is None:
                    try:
                        f = open(st.log_path, "rb")
                        f.seek(max(0, pos))
                    except FileNotFoundError:
                        f = None
                        if st.log_removed:
                            yield (b"qosflow agent: this stage's log was removed to keep the agent's logs within its "
                                   b"--max-logs-mb\n")
                            return
                chunk = f.read(1 << 16) if f is not None else b""
                if chunk:
                    pos += len(chunk)
                    yield chunk
                    continue
                if finished or not follow:
                    return
                try:
                    await asyncio.wait_for(st.done.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
        finally:
            if f is not None:
                f.close()


_PRCTL: list = []


def _prctl():
    """libc's prctl (None where there is none), looked up once, in the agent's process: not in a child between fork and
    exec, where loading it (dlopen) could wait for ever on a lock another thread of the agent held at the fork."""
    if not _PRCTL:
        try:
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except Exception:  # noqa: BLE001 - no libc prctl (not Linux): stages still die with the agent's guard
            _PRCTL.append(None)
    return _PRCTL[0]


async def _exited(proc: subprocess.Popen) -> int:
    """Wait for `proc` to exit, without blocking the event loop, and reap it: a pidfd the loop watches (Linux 5.3+), else a
    thread of its own. (The process is this agent's child, not yet reaped: its pid cannot be another's meanwhile.)"""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        loop.add_reader(fd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return proc.wait()

    def wait() -> None:
        rc = proc.wait()
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(rc))

    threading.Thread(target=wait, name=f"qosflow-agent-wait-{proc.pid}", daemon=True).start()
    return await done


def _kill_orphan(started: "asyncio.Future[subprocess.Popen]") -> None:
    """The process a cancelled launch started after all: killed, with its group (nothing else knows of it)."""
    if started.cancelled() or started.exception() is not None:
        return
    proc = started.result()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    threading.Thread(target=proc.wait, daemon=True).start()  # (reaped)


def _size(path: Path) -> int | None:
    """The size of the file at `path`; None if there is none (or it cannot be read)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except ProcessLookupError:
                pass
    return out


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []
