"""Run everything on one machine: a local Prefect server, the blocks, the `qosflow` pool and a worker.

Used by `qosflow demo`, `qosflow init`, the end-to-end tests and the benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from qosflow.core.cluster import ClusterSpec
from qosflow.errors import QosflowError
from qosflow.prefect.server_process import any_patch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefect_database_url(url: str | None, home: str | Path) -> str:
    """The Prefect server's database URL: SQLite under `home` by default, else `url` with the async
    driver Prefect's server needs (`postgresql://...` becomes `postgresql+asyncpg://...`).

    PostgreSQL avoids SQLite's single write lock, which stalls a busy server (docs/prefect.md)."""
    if url is None or not str(url).strip():
        return f"sqlite+aiosqlite:///{home}/prefect.db"
    url = str(url).strip()
    scheme, sep, rest = url.partition("://")
    shown = (f"{scheme}://" if sep else "") + f"...@{url.rpartition('@')[2]}" if "@" in url else url  # no password in messages
    if not sep:
        raise ValueError(f"database URL {shown!r} has no scheme: write it as postgresql://USER:PASSWORD@HOST:PORT/DB "
                         "or sqlite:///PATH")
    base = scheme.split("+", 1)[0].lower()
    if base in ("postgresql", "postgres"):
        return f"postgresql+asyncpg://{rest}"
    if base == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    raise ValueError(f"database URL {shown!r}: Prefect's server runs on PostgreSQL or SQLite only; "
                     "write it as postgresql://USER:PASSWORD@HOST:PORT/DB or sqlite:///PATH")


def server_env(home: str | Path, port: int, *, ui: bool = True, database_url: str | None = None) -> dict[str, str]:
    home = str(home)
    api = f"http://127.0.0.1:{port}/api"
    return {
        "PREFECT_HOME": home,
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_DATABASE_CONNECTION_URL": prefect_database_url(database_url, home),
        "PREFECT_LOCAL_STORAGE_PATH": f"{home}/storage",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }


class ServerStartError(QosflowError, RuntimeError):
    """The local Prefect server exited, or did not answer, at start (the CLI shows it without a traceback)."""


def _log_error_line(path: Path, offset: int) -> str:
    """The last line that names an exception in the part of the server log written since `offset`
    (e.g. "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432)"), or ''."""
    import re

    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    hits = [ln.strip() for ln in text.splitlines() if re.match(r"^[\w.]+(Error|Exception)\b.*", ln.strip())]
    return hits[-1] if hits else ""


class LocalServer:
    """`prefect server start` as a child process (SQLite under `home` unless `database_url` names a
    PostgreSQL database, UI on unless `ui=False`)."""

    def __init__(self, home: str | Path, port: int | None = None, *, ui: bool = True, log: str | Path | None = None,
                 database_url: str | None = None):
        self.home = Path(home)
        # the server's SQLite database holds its blocks, an agent token among them, and the key Prefect
        # encrypts them with; its storage, the stages' results: a home made here is its user's (0700)
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.port = port or free_port()
        self.ui = ui
        self.env = server_env(self.home, self.port, ui=ui, database_url=database_url)
        self.log_path = Path(log) if log else self.home / "server.log"
        self.proc: subprocess.Popen | None = None
        if database_url is None or not str(database_url).strip():
            from qosflow.store.leases import private_sqlite_file

            # 0600 (and so its -wal and -shm) if it is new
            private_sqlite_file(self.home / "prefect.db", "the local Prefect server's blocks and the key they are encrypted with")

    @property
    def api_url(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "LocalServer":
        env = dict(os.environ)
        env.update(self.env)
        logf = open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        log_start = logf.tell()  # the log is appended to: this start's lines begin here
        # on SQLite, the server's garbage collection runs off its event loop (see server_process.py:
        # a collection in the loop could stall every request for the 60 s of SQLite's busy timeout);
        # its write transactions take the write lock at their start (BEGIN IMMEDIATE), and it retries
        # requests that lost SQLite's write race itself; QOSFLOW_SERVER_GC_THREAD=0,
        # QOSFLOW_SERVER_SQLITE_IMMEDIATE=0 and QOSFLOW_SERVER_RETRY_S=0 together run plain `python -m prefect`
        sqlite = self.env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("sqlite")
        patched = sqlite and any_patch()
        module = "qosflow.prefect.server_process" if patched else "prefect"
        cmd = [sys.executable, "-m", module, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        if not self.ui:
            cmd.append("--no-ui")
        self.proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if self.proc.poll() is not None:  # was a RuntimeError traceback that said only the exit code
                    raise self._start_error(f"exited at start with code {self.proc.returncode}", log_start)
                try:
                    if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        except BaseException:  # Ctrl-C or SIGTERM while it starts: the server runs in its own session
            self.stop()
            raise
        self.stop()
        raise self._start_error(f"did not answer within {timeout:.0f} s", log_start)

    def _start_error(self, what: str, log_start: int) -> ServerStartError:
        why = _log_error_line(self.log_path, log_start)
        db = self.env["PREFECT_API_DATABASE_CONNECTION_URL"]
        hint = ("; is PostgreSQL running there, and do the user, password and database of --database-url exist?"
                if not db.startswith("sqlite") else "")
        return ServerStartError(f"the local Prefect server {what}{': ' + why if why else ''} (its log: {self.log_path}){hint}")

    def apply_env(self) -> None:
        """Point this process's Prefect settings at the server."""
        os.environ.update(self.env)
        try:
            from prefect.settings.models.root import Settings  # noqa: F401
            import prefect.context

            prefect.context.refresh_global_settings_context()  # type: ignore[attr-defined]
        except Exception:
            pass

    def stop(self) -> None:
        if self.proc is not None:
            from qosflow.procgroup import stop_group

            stop_group(self.proc, 15.0)  # (its whole session: the server and what it started)
        self.proc = None


# ------------------------------------------------------------------------------------ the user's server
def require_api_url(what: str) -> str:
    """The configured Prefect API URL; without one Prefect would use a temporary server that forgets
    everything when the command exits (and a worker cannot start at all)."""
    from prefect.settings import PREFECT_API_URL

    from qosflow.errors import QosflowError

    url = PREFECT_API_URL.value()
    if not url:
        raise QosflowError(
            f"PREFECT_API_URL is not set: {what} needs a running Prefect server. Start one (`python -m qosflow.prefect.server_process server "
            "start`: Prefect's `prefect server start` with qosflow's SQLite fixes) and point at it (`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`), or try `qosflow demo`"
        )
    from urllib.parse import urlsplit

    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.netloc:  # a worker retried such a URL for ever
        raise QosflowError(
            f"PREFECT_API_URL={url!r} is not an http(s) URL, so {what} can never reach a server there: set it to the "
            "server's API, e.g. `prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`"
        )
    return url


def unreachable_server(exc: BaseException, api: str) -> Exception | None:
    """The error to show when `exc` is a failed connection to the Prefect server at `api` (an httpx
    transport error, or Prefect's RuntimeError("Failed to reach API ...") raised from one), else None:
    any other error is not about the server being away."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, httpx.TransportError):
        cause = cause.__cause__
    if cause is None:
        return None
    why = str(cause) or str(exc) or type(cause).__name__  # some httpx errors have no text
    return QosflowError(f"cannot reach the Prefect server at {api} ({why}); is a Prefect server running there (e.g. `python -m "
                         "qosflow.prefect.server_process server start`, Prefect's `prefect server start` with qosflow's SQLite "
                         "fixes)?")


def check_pool_name(pool: str, option: str = "--pool", *, blocks: bool = False) -> None:
    """Fail now, before any server call, on a work pool name Prefect refuses (empty, or with one of / % & > <:
    the server answered '405 Method Not Allowed' or '404 Not Found', shown as a traceback). With `blocks`
    (`qosflow init` names the pool's blocks POOL-cluster and POOL-policy) also on one a block name cannot
    start with: lowercase letters, digits and dashes only (was a pydantic ValidationError traceback)."""
    import re

    from qosflow.errors import SpecError

    if not pool.strip():
        raise SpecError(option, "give a work pool name, e.g. --pool gpu")
    banned = "".join(c for c in "/%&><" if c in pool)
    if banned:
        raise SpecError(option, f"{pool!r}: a work pool name cannot contain {' '.join(banned)}; e.g. --pool gpu-lab")
    if blocks and not re.fullmatch(r"[a-z0-9-]+", pool):
        like = re.sub(r"[^a-z0-9-]+", "-", pool.lower()).strip("-") or "gpu"
        raise SpecError(option, f"{pool!r}: qosflow init names the pool's blocks {pool}-cluster and {pool}-policy, and "
                                f"Prefect block names take lowercase letters, digits and dashes only; e.g. --pool {like}")


async def check_pool(pool: str, *, cluster_block: str | bool = False) -> None:
    """Fail fast, naming the fix, when `pool` does not exist or is not a qosflow pool; with
    `cluster_block`, also when the cluster block the worker would use is missing or invalid (the
    worker would log it every 5 s): that name, or with True the pool's own `cluster_block` (unless
    its `cluster_file` comes first). The pool is read once. An unreachable server is left to the
    worker (it keeps trying to connect)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from qosflow.errors import SpecError

    try:
        async with get_client() as client:
            try:
                wp = await client.read_work_pool(pool)
            except ObjectNotFound:
                raise missing_pool(pool, await qosflow_pool_names(client)) from None
    except (httpx.HTTPError, OSError, RuntimeError):
        return
    if wp.type != "qosflow":
        raise wrong_pool_type(pool, wp.type)
    if cluster_block is True:
        defaults = _variable_defaults(wp)
        if defaults.get("cluster_file"):  # (it comes first; a missing one was only logged by the worker, every 5 s)
            load_named_cluster_file(str(defaults["cluster_file"]), "pool", pool)
        name, of_pool = (None if defaults.get("cluster_file") else defaults.get("cluster_block")), True
    else:
        name, of_pool = cluster_block or None, False
    if not name:
        return
    from qosflow.prefect.worker import load_cluster_block

    try:
        await load_cluster_block(name)
    except SpecError as exc:
        if not of_pool:
            raise
        raise SpecError("cluster_block", f"work pool {pool!r} names cluster block {name!r}: "
                                         f"{str(exc).removeprefix('invalid cluster_block: ')}") from None
    except (httpx.HTTPError, OSError, RuntimeError):
        return  # the server does not answer: the worker waits for it and says so


#: where a worker's cluster file was named: (how the error says it, how to point at another)
_CLUSTER_FILE_SOURCES = {
    "pool": ("the cluster_file variable of work pool {pool!r}",
             "correct the path in the pool's base job template (UI: work pool -> Edit), or clear it to use the pool's "
             "cluster_block"),
    "env": ("QOSFLOW_CLUSTER_FILE", "set it to a cluster file's path, or unset it to use the pool's cluster"),
    "arg": ("the worker's cluster_file (--cluster-file)", "give the path of a cluster file (docs/infrastructure.md)"),
}


def load_named_cluster_file(path: str, source: str, pool: str) -> Any:
    """`load_cluster_file(path)`, whose error also says where the path came from (`source`: pool, env or arg)
    and how to name another. A missing file said only "invalid cluster: cannot read /srv/lab.yaml: No such file
    or directory", every 5 s in the worker's log, with nothing on the pool variable that named it."""
    from qosflow.backends.agent import load_cluster_file
    from qosflow.errors import SpecError

    try:
        return load_cluster_file(path)
    except SpecError as exc:
        what, fix = _CLUSTER_FILE_SOURCES[source]
        raise SpecError("cluster_file", f"{what.format(pool=pool)} names {path!r}: "
                                        f"{str(exc).removeprefix('invalid cluster: ')}; {fix}") from None


def worker_online(worker: Any) -> bool:
    """Whether Prefect shows a pool's worker (`read_workers_for_work_pool`) as online."""
    status = getattr(worker, "status", None)
    return str(getattr(status, "value", status) or "").upper() == "ONLINE"


def missing_pool(pool: str, existing: "list[str] | tuple[str, ...]" = ()) -> Exception:
    """The error for a qosflow pool that does not exist, with how to create it (worker and stages).
    `existing`: the server's qosflow pools, named with the one a misspelt name ('gpus' for 'gpu') most
    likely meant: "create it" alone sent users to make a second pool."""
    from qosflow.errors import SpecError, closest_name

    msg = (f"work pool {pool!r} does not exist; create it with `qosflow init --pool {pool}` "
           f"(or `prefect work-pool create {pool} --type qosflow`)")
    if existing:
        near = closest_name(pool, list(existing))
        msg += (f", or did you mean {near!r}?" if near else "") + f" (qosflow pools on this server: {', '.join(existing)})"
    return SpecError("pool", msg)


async def qosflow_pool_names(client: Any) -> list[str]:
    """The names of the server's qosflow work pools (for `missing_pool`), [] if it does not say."""
    try:
        return sorted(wp.name for wp in await client.read_work_pools() if wp.type == "qosflow")
    except Exception:  # noqa: BLE001 - a hint only
        return []


def wrong_pool_type(pool: str, pool_type: str) -> Exception:
    """The error for a qosflow worker pointed at a pool of another type, with the two ways out."""
    from qosflow.errors import SpecError

    return SpecError(
        "pool",
        f"work pool {pool!r} has type {pool_type!r}, not 'qosflow'; the qosflow worker serves qosflow pools only: create "
        f"one with `qosflow init --pool NAME` (or `prefect work-pool create NAME --type qosflow`), or start a "
        f"{pool_type!r} worker on this pool",
    )


# ------------------------------------------------------------------------------------ blocks and pool
async def register_blocks() -> list[str]:
    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy

    out = []
    for cls in (QoSPolicy, BareMetalGPUCluster, KubernetesGPUCluster):
        await cls.register_type_and_schema()
        out.append(cls.get_block_type_slug())
    return out


async def pool_variable_defaults(pool: str) -> dict[str, Any]:
    """The variable defaults of the qosflow pool `pool`'s base job template ({} when there is no such pool,
    or it is of another type)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            wp = await client.read_work_pool(pool)
        except ObjectNotFound:
            return {}
    if wp.type != "qosflow":
        return {}
    return _variable_defaults(wp)


def _variable_defaults(wp: Any) -> dict[str, Any]:
    props = ((wp.base_job_template or {}).get("variables") or {}).get("properties") or {}
    return {k: p["default"] for k, p in props.items() if isinstance(p, dict) and "default" in p}


def pool_template(
    cluster_block: str | None = None,
    policy_block: str | None = None,
    *,
    stream_output: bool = True,
    env: dict[str, str] | None = None,
    cluster_file: str | None = None,
) -> dict[str, Any]:
    from qosflow.prefect.worker import QosflowWorker

    t = QosflowWorker.get_default_base_job_template()
    props = t["variables"]["properties"]
    if cluster_block:
        props["cluster_block"]["default"] = cluster_block
    if policy_block:
        props["policy_block"]["default"] = policy_block
    if cluster_file:
        props["cluster_file"]["default"] = str(cluster_file)
    if env:
        props["env"]["default"] = dict(env)
    props["stream_output"]["default"] = stream_output
    return t


async def setup_pool(
    pool: str,
    *,
    cluster: Any = None,
    cluster_block: str | None = None,
    policy: Any = None,
    policy_block: str | None = None,
    stream_output: bool | None = None,
    env: dict[str, str] | None = None,
    cluster_file: str | None = None,
) -> dict[str, Any]:
    """Register blocks, save the cluster/policy blocks, create or update the pool and its stage deployment.
    `env` is the stage processes' extra environment; `cluster_file` makes the pool's worker use those agents.

    An existing pool keeps the variable defaults it was given (in the UI or by an earlier call) unless this
    call sets them; a pool of another type is left alone (SpecError)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from qosflow.errors import SpecError

    async with get_client() as client:
        try:
            existing = await client.read_work_pool(pool)
        except ObjectNotFound:
            existing = None
    if existing is not None and existing.type != "qosflow":
        raise SpecError("pool", f"work pool {pool!r} exists with type {existing.type!r}; it is left as it is: choose another "
                                "name for the qosflow pool (--pool NAME)")
    await register_blocks()
    if cluster is not None:
        await cluster.asave(cluster_block or pool, overwrite=True)
        cluster_block = cluster_block or pool
    if policy is not None:
        await policy.asave(policy_block or pool, overwrite=True)
        policy_block = policy_block or pool
    template = pool_template(cluster_block, policy_block, stream_output=True if stream_output is None else stream_output, env=env,
                             cluster_file=cluster_file)
    if existing is not None:
        given = {"cluster_block": cluster_block, "policy_block": policy_block, "cluster_file": cluster_file, "env": env,
                 "stream_output": stream_output}
        old = ((existing.base_job_template or {}).get("variables") or {}).get("properties") or {}
        for k, prop in template["variables"]["properties"].items():
            if given.get(k) is None and "default" in (old.get(k) or {}):
                prop["default"] = old[k]["default"]  # set by the user (UI) or an earlier call: kept
    async with get_client() as client:
        if existing is not None:
            await client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
            created = False
        else:
            await client.create_work_pool(WorkPoolCreate(name=pool, type="qosflow", base_job_template=template))
            created = True
    from qosflow.prefect.tasks import ensure_stage_deployment

    dep = await asyncio.to_thread(ensure_stage_deployment, pool)
    return {"pool": pool, "created": created, "cluster_block": cluster_block, "policy_block": policy_block, "stage_deployment": dep}


# ------------------------------------------------------------------------------------ in-process worker
class WorkerThread(threading.Thread):
    """A `QosflowWorker` polling `pool` in a background thread with its own event loop."""

    def __init__(self, pool: str, *, cluster: ClusterSpec | None = None, policy: Any = None, estimator: Any = None, name: str | None = None, **kw: Any):
        super().__init__(daemon=True, name=f"qosflow-worker-{pool}")
        self.pool = pool
        self.kw = dict(cluster=cluster, policy=policy, estimator=estimator, name=name or f"qosflow-{pool}-{os.getpid()}", **kw)
        self.worker = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self.drain_s = 10.0

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by wait_ready()
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        from qosflow.prefect.worker import QosflowWorker

        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        worker = QosflowWorker(work_pool_name=self.pool, create_pool_if_not_found=False, **self.kw)
        self.worker = worker
        printer = lambda *a, **k: None  # noqa: E731
        task = asyncio.create_task(worker.start(printer=printer))
        # ready once synced with the pool and the scheduler exists (or stopped before: a pool that never came)
        while not task.done() and not self._stop_event.is_set():
            if worker._work_pool is not None and worker._runs_task_group is not None:
                await worker._ensure_qos()
                break
            await asyncio.sleep(0.1)
        if task.done() and not task.cancelled() and task.exception() is not None:
            # raised before `ready` is set (run() records it first): set first, wait_ready() could read no
            # error yet and return a thread whose worker had failed
            raise task.exception()  # type: ignore[misc]
        self.ready.set()
        stop = asyncio.create_task(self._stop_event.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and self.drain_s > 0:
            await worker.drain(self.drain_s)  # let ended stages finish their bookkeeping (slot, lease, outcome)
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        elif task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    def wait_ready(self, timeout: float = 60.0) -> "WorkerThread":
        if not self.is_alive() and self._loop is None and not self.ready.is_set():
            self.start()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"qosflow worker for pool {self.pool!r} did not start within {timeout:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"qosflow worker failed: {self.error!r}") from self.error
        return self

    def call(self, coro_fn, *args: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the worker's loop (e.g. to read its scheduler state)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop).result(timeout)

    def stop(self, timeout: float = 30.0, *, drain: float = 10.0) -> None:
        """Stop the worker: wait up to `drain` seconds for the flow runs it is running to be done with
        (stages that already reported their end still free their slot, release their lease and record
        their outcome), then cancel it; join the thread for up to `timeout` seconds."""
        self.drain_s = drain
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self.join(timeout)
