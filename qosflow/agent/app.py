"""The agent's HTTP API (FastAPI). All routes need `Authorization: Bearer <token>`.

    GET    /v1/health?worker=1             heartbeat: host, boot id, running stages (worker=1: a worker's, ends a fence hold)
    GET    /v1/inventory                   GPUs (NVML or virtual), cores, memory, labels
    GET    /v1/stages                      every stage this agent knows
    POST   /v1/stages                      launch {stage_id, command, env, cwd, cpuset, labels}; 409 if the id exists
    GET    /v1/stages/{id}                 status (state running|exited, returncode, signal, killed_reason)
    GET    /v1/stages/{id}/wait?timeout=S  long-poll until it exits (or S seconds)
    GET    /v1/stages/{id}/logs?offset=&follow=   stream its output
    GET    /v1/stages/{id}/progress?offset=N      its `qosflow.report_progress` lines from byte N
    POST   /v1/progress                    {offsets: {id: N}} -> {stages: {id: lines from byte N}}: what the worker copies
    PUT    /v1/stages/{id}/cpuset          move it to other cores {cpuset: [...]}
    DELETE /v1/stages/{id}?reason=&grace=  kill it (SIGTERM, then SIGKILL after `grace` s); idempotent
    POST   /v1/fence/hold                  {seconds}: a stopping worker: no fence for silence that long (until a heartbeat)

A worker names itself in every request (header `X-Qosflow-Worker: <its id>`): a stage records the worker that launched
it (or adopted it last: `GET /v1/stages/{id}?adopt=1`, or a launch answered 409), and the fence kills it when *that*
worker has been silent for --fence-after, whatever other workers still ask; a hold is its worker's alone. Requests
without the header (an older worker, curl) fence the stages launched without it as before: by any request's silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from qosflow.agent.gpus import GpuSource
from qosflow.agent.runner import FENCED, Runner, StageUser, usable_cpus
from qosflow.backends.base import AGENT_STOPPING

log = logging.getLogger("qosflow.agent")

#: the header a worker names itself by (`AgentBackend.worker_id`): the owner of the stages it launches or adopts
WORKER_HEADER = "X-Qosflow-Worker"
#: the longest worker id the agent takes (a lease holder id, `name#host:pid:random`, is at most 200 characters)
MAX_WORKER_ID = 200


@dataclass
class AgentConfig:
    token: str
    name: str = field(default_factory=socket.gethostname)
    virtual_gpus: int | None = None
    gpu_mem_mb: float = 16_384.0
    cpu_cores: float | None = None  # declared cores; default: the cores this process may use
    mem_mb: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    #: kill every running stage (not the pipeline runs, role pipeline: the next worker adopts them) when no
    #: authenticated request (heartbeat) came for this long, or the agent was frozen for this long
    fence_after_s: float | None = None
    #: skip NVML detection (used when many virtual agents share one process)
    force_virtual: bool = False
    #: run stages as this account (the agent runs as root): `qosflow agent start --stage-user`
    stage_user: str | None = None
    #: the stages' logs together stay within this many MiB (the oldest ended stages' logs go first); None: no limit
    max_logs_mb: float | None = 10_240.0

    def __post_init__(self) -> None:
        if not self.token:
            from qosflow.errors import SpecError

            raise SpecError("token", "the agent needs a secret token (--token or --token-file); requests without it get 401")


try:  # the hot heartbeat/inventory answers skip FastAPI's encoder (100 hosts per refresh)
    import orjson

    def _json(data: object) -> Response:
        return Response(orjson.dumps(data), media_type="application/json")
except ImportError:  # pragma: no cover
    import json

    def _json(data: object) -> Response:
        return Response(json.dumps(data, separators=(",", ":")), media_type="application/json")


class LaunchRequest(BaseModel):
    stage_id: str = Field(min_length=1, max_length=250)
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    cpuset: list[int] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    #: the GPU indices the worker placed it on (None: read from env CUDA_VISIBLE_DEVICES, as older workers send)
    gpus: list[int] | None = None
    #: command[0] is the worker's own interpreter (its default stage command): a host that has no such file runs the
    #: stage with the agent's interpreter instead (`Runner.launch`)
    python_fallback: bool = False


def _gpu_indices(req: LaunchRequest) -> list[int]:
    """The GPU indices a launch names: its `gpus`, else the whole-number entries of CUDA_VISIBLE_DEVICES."""
    if req.gpus is not None:
        return list(req.gpus)
    raw = req.env.get("CUDA_VISIBLE_DEVICES", "")
    return [int(x) for x in raw.split(",") if x.strip().isdigit()]


#: the longest a stopping worker may hold an agent's silence fence (`POST /v1/fence/hold`)
MAX_FENCE_HOLD_S = 600.0


class FenceHoldRequest(BaseModel):
    #: how long (from now) a silence of the workers does not fence the stages
    seconds: float = Field(ge=0)


class CpusetRequest(BaseModel):
    cpuset: list[int] = Field(min_length=1)


class ProgressRequest(BaseModel):
    #: stage id -> the byte offset to read its progress lines from (the size of the worker's copy)
    offsets: dict[str, int] = Field(default_factory=dict)


def fence_clock() -> float:
    """The clock the fence measures silence and freezes on: CLOCK_BOOTTIME, monotonic (never stepped by NTP or
    `date -s`) and, unlike CLOCK_MONOTONIC, counting the time the host was suspended (systemctl suspend, hibernation):
    a host that slept while the worker ran its stages elsewhere fences them as it wakes. On time.monotonic the sleep
    did not count, and the stages ran on after the wake while their reruns ran elsewhere (the wall clock the fence used
    before did count it)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def _mem_mb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError):
        return 0.0


def create_app(cfg: AgentConfig) -> FastAPI:
    if cfg.force_virtual:
        gpus = GpuSource(nvml=False, count=int(cfg.virtual_gpus or 0), virtual_mem_mb=cfg.gpu_mem_mb, note="no GPU: virtual GPUs")
    else:
        gpus = GpuSource.detect(cfg.virtual_gpus, virtual_mem_mb=cfg.gpu_mem_mb)
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix=f"qosflow-agent-{cfg.name}-"))
    runner = Runner(workdir, stage_user=StageUser.resolve(cfg.stage_user) if cfg.stage_user else None,
                    max_log_bytes=None if cfg.max_logs_mb is None else int(cfg.max_logs_mb * 2**20))
    boot_id = uuid.uuid4().hex
    boot_time = fence_clock()
    token = cfg.token.encode()
    # the fence measures silence on the monotonic clock: the wall clock of a host is stepped (NTP or chrony
    # correcting a skewed clock, `date -s`), and a step forward past --fence-after killed every stage while the
    # worker's heartbeats came every 2 s; a step back kept the fence from firing in a real network split.
    # "last_contact"/"hold_until": any request's, and a hold asked without a worker id: they fence the stages launched
    # without one (owner None), as every stage was before workers named themselves
    state = {"last_contact": fence_clock(), "hold_until": 0.0, "said_anonymous": False}
    #: worker id -> its last request, and the end of the hold it asked (the fence clock)
    contacts: dict[str, float] = {}
    holds: dict[str, float] = {}

    def worker_of(request: Request) -> str | None:
        raw = request.headers.get(WORKER_HEADER)
        if raw is None:
            if not state["said_anonymous"]:
                state["said_anonymous"] = True
                log.warning("agent %s: a request without %s (a worker older than this agent, or a script: %s %s): the stages "
                            "launched without it are fenced only when no request at all came for --fence-after, as before; "
                            "upgrade the workers, whose stages are then fenced by their own worker's silence", cfg.name,
                            WORKER_HEADER, request.method, request.url.path)
            return None
        wid = raw.strip()
        if not wid or len(wid) > MAX_WORKER_ID or not wid.isprintable():
            raise HTTPException(400, f"header {WORKER_HEADER} must name the worker in 1-{MAX_WORKER_ID} printable characters "
                                     f"(got {len(raw)}): send the worker's id, or leave the header out")
        return wid

    async def check_token(request: Request) -> None:
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not given or not hmac.compare_digest(given.encode(), token):
            raise HTTPException(401, "missing or wrong agent token", headers={"WWW-Authenticate": "Bearer"})
        wid = worker_of(request)
        now = fence_clock()
        state["last_contact"] = now
        if wid is not None and cfg.fence_after_s:
            # (read by the fence only; without one, nothing forgets them: every `qosflow agent status` named a new worker,
            # kept for as long as the agent ran)
            contacts[wid] = now
        request.state.worker = wid

    def take(st, wid: str | None) -> None:
        """Worker `wid` takes stage `st` over (it adopted it): from now on its silence, not the last owner's, fences it."""
        if wid is None or st.owner == wid:
            return
        if st.running:
            log.info("agent %s: stage %s is now worker %s's (it was %s's)", cfg.name, st.stage_id, wid, st.owner or "no worker")
        st.owner, st.owner_since = wid, fence_clock()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        fence = asyncio.create_task(_fence_loop()) if cfg.fence_after_s else None
        try:
            yield
        finally:
            if fence:
                fence.cancel()
            await runner.kill_all(AGENT_STOPPING, grace=0)
            if cfg.workdir is None:
                # the temp directory of this run of the agent: no later one serves its logs (each start makes its own),
                # and every restart left one behind in /tmp, with the logs of up to 10,000 stages
                shutil.rmtree(workdir, ignore_errors=True)

    def silences(now: float) -> dict[str | None, tuple[list, float]]:
        """The fenceable stages to fence for silence now, by owner: (the stages, the owner's silence)."""
        out: dict[str | None, tuple[list, float]] = {}
        for st in runner.fenceable():
            if st.owner is None:
                silent, held = now - state["last_contact"], now < state["hold_until"]
            else:
                silent = now - max(contacts.get(st.owner, st.owner_since), st.owner_since)
                held = now < holds.get(st.owner, 0.0)
            if silent > cfg.fence_after_s and not held:  # type: ignore[operator]
                stages, longest = out.get(st.owner, ([], 0.0))
                stages.append(st)
                out[st.owner] = (stages, max(longest, silent))
        return out

    def forget_workers(now: float) -> None:
        """Drop the workers that own no running stage and hold nothing, silent for a while (every `qosflow agent status`
        names a new one)."""
        owners = {s.owner for s in runner.running()}
        keep_s = max(600.0, 4 * (cfg.fence_after_s or 0.0))
        for wid in [w for w, t in contacts.items() if w not in owners and now - t > keep_s and now >= holds.get(w, 0.0)]:
            contacts.pop(wid, None)
            holds.pop(wid, None)

    async def _fence(reason: str, sts: list) -> None:
        try:
            await runner.kill_all(reason, only=sts)
        except Exception:  # noqa: BLE001 - a kill that failed (killpg: EPERM) must not end the fence: next tick
            log.exception("agent %s: fencing its stages failed; trying again", cfg.name)
            return
        spared = sum(1 for s in runner.running() if s.is_pipeline)
        log.warning("agent %s %s: killed %d stage(s)%s", cfg.name, reason, len(sts),
                    f"; {spared} pipeline run(s) left running: they are adopted by the next worker" if spared else "")

    async def _fence_loop() -> None:
        assert cfg.fence_after_s
        tick = min(0.5, cfg.fence_after_s / 4)
        last_tick = fence_clock()
        # the kills under way, by stage (id of its record): each runs in a task of its own, not awaited by this loop. A
        # kill can take long (5 s for a process that does not die at SIGKILL at once: a hung GPU driver call, a dead NFS
        # mount); awaited here, it held the loop up, the silence of another worker meanwhile went unfenced, and the next
        # tick took the wait for the agent being frozen: it fenced every stage, the heartbeating workers' too
        fencing: dict[int, asyncio.Task] = {}
        try:
            while True:
                await asyncio.sleep(tick)
                now = fence_clock()
                frozen, last_tick = now - last_tick - tick, now
                forget_workers(now)
                # pipeline runs (role pipeline) are not fenced: they hold no GPU and are never rerun elsewhere (the
                # next worker adopts them); fencing them ended every pipeline run of the host Crashed on a worker
                # restart or a network split longer than the fence. So is a frozen agent's: the same answer
                stages = runner.fenceable()
                if not stages:
                    continue
                if frozen > cfg.fence_after_s:
                    # this process was stopped (host frozen, SIGSTOP): every worker has given up on us
                    reason = f"{FENCED}: the agent was frozen for {frozen:.1f}s (> {cfg.fence_after_s:g}s)"
                    groups = [(reason, stages)]
                else:
                    # each stage by its own worker's silence: another worker (another pool, a status check) still asking
                    # this agent kept a cut-off worker's stages running while that worker ran them again elsewhere
                    groups = [(f"{FENCED}: no heartbeat from the worker{'' if owner is None else f' {owner}'} for {silent:.1f}s "
                               f"(> {cfg.fence_after_s:g}s)", sts) for owner, (sts, silent) in silences(now).items()]
                for reason, sts in groups:
                    # (not one already being killed, nor one still being started that a kill has marked: it is killed as
                    # soon as it has started, `Runner.kill`)
                    sts = [s for s in sts if id(s) not in fencing and not s.kill_on_start]
                    if not sts:
                        continue
                    task = asyncio.create_task(_fence(reason, sts))
                    keys = [id(s) for s in sts]
                    for k in keys:
                        fencing[k] = task
                    task.add_done_callback(lambda t, keys=keys: [fencing.pop(k) for k in keys if fencing.get(k) is t])
        finally:
            for task in set(fencing.values()):
                task.cancel()

    # no /docs, /redoc or /openapi.json: FastAPI serves those outside the app's dependencies, so they
    # answered without the token (the host name and the whole API to anyone who could connect)
    app = FastAPI(title=f"qosflow agent {cfg.name}", dependencies=[Depends(check_token)], lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner = runner
    app.state.cfg = cfg
    app.state.worker_contacts = contacts

    def _get(stage_id: str):
        st = runner.stages.get(stage_id)
        if st is None:
            raise HTTPException(404, f"no stage {stage_id!r} on agent {cfg.name} (boot {boot_id})")
        return st

    @app.get("/v1/health")
    async def health(request: Request, worker: bool = False) -> Response:
        if worker:
            # a worker heartbeats us again: its fence hold ends, the silence counts from now. Only a worker's heartbeat
            # (`worker=1`): `qosflow agent status` (GET /v1/inventory) or a monitoring probe of /v1/health during a worker
            # restart ended the hold, and the fence killed the stages the next worker was to adopt. A worker that names
            # itself ends its own hold only (another worker's heartbeat says nothing of the stopped one's stages); any
            # worker's ends the hold asked without a name (those stages are kept by any request, as before)
            wid = request.state.worker
            if wid is not None:
                holds.pop(wid, None)
            state["hold_until"] = 0.0
        return _json({
            "host": cfg.name,
            "boot_id": boot_id,
            "time": time.time(),
            "uptime_s": fence_clock() - boot_time,
            "fence_after_s": cfg.fence_after_s,
            "running": [s.stage_id for s in runner.running()],
        })

    @app.post("/v1/fence/hold")
    async def fence_hold(req: FenceHoldRequest, request: Request) -> dict:
        """A worker that stops (a restart, an upgrade) asks its agents not to fence its stages for silence for a while:
        the next worker adopts them. Without it, `--fence-after 3` killed every stage of the cluster 3 s after the worker
        stopped, and a worker restart cost every running stage its training time. The hold is the asking worker's: it
        keeps the stages that worker owns (not another worker's), until it ends or that worker heartbeats again
        (`/v1/health?worker=1`); a stage adopted meanwhile is its adopter's. A hold asked without a worker id keeps the
        stages launched without one, until any worker's heartbeat. A frozen agent still fences."""
        hold = max(0.0, min(req.seconds, MAX_FENCE_HOLD_S))
        wid = request.state.worker
        if wid is None:
            state["hold_until"] = fence_clock() + hold
        elif cfg.fence_after_s:  # (no fence, nothing to hold: nor to forget the hold)
            holds[wid] = fence_clock() + hold
        held = [s for s in runner.fenceable() if s.owner == wid]
        if hold and held:
            log.warning("agent %s: the worker%s is stopping; its %d stage(s) are not fenced for silence for %gs (the next worker "
                        "adopts them)", cfg.name, "" if wid is None else f" {wid}", len(held), hold)
        return {"hold_s": hold, "fence_after_s": cfg.fence_after_s, "stages": len(held)}

    @app.get("/v1/inventory")
    async def inventory() -> Response:
        cpus = usable_cpus()
        return _json({
            "host": cfg.name,
            "boot_id": boot_id,
            "virtual": gpus.virtual,
            "note": gpus.note,
            "gpus": gpus.report(),
            "gpu_mem_mb": cfg.gpu_mem_mb if gpus.virtual else None,
            "cpu_cores": cfg.cpu_cores if cfg.cpu_cores is not None else float(len(cpus)),
            "cpus_usable": cpus,
            "mem_mb": cfg.mem_mb if cfg.mem_mb is not None else _mem_mb(),
            "labels": cfg.labels,
            "fence_after_s": cfg.fence_after_s,
            # the account stages run as (--stage-user), None: the agent's own
            "stage_user": runner.stage_user.name if runner.stage_user is not None else None,
            "running": [s.stage_id for s in runner.running()],
        })

    @app.get("/v1/stages")
    async def stages() -> list[dict]:
        return [s.status() for s in runner.stages.values()]

    @app.post("/v1/stages", status_code=201)
    async def launch(req: LaunchRequest, request: Request):
        wid = request.state.worker
        if req.stage_id in runner.stages:
            # idempotent for the worker: the same attempt is never started twice; the worker that asks follows it
            # from now on (AgentBackend adopts it), so it is that worker's
            take(runner.stages[req.stage_id], wid)
            return JSONResponse(status_code=409, content={"detail": f"stage {req.stage_id!r} exists", "status": runner.stages[req.stage_id].status()})
        missing = sorted({g for g in _gpu_indices(req) if not 0 <= g < gpus.count})
        if missing:
            # CUDA_VISIBLE_DEVICES naming a GPU that is not there breaks the stage (or hides every GPU from it)
            have = f"GPUs 0-{gpus.count - 1}" if gpus.count > 1 else ("GPU 0" if gpus.count == 1 else "no GPU")
            raise HTTPException(422, f"agent {cfg.name} has {have}, but stage {req.stage_id!r} was placed on GPU "
                                     f"{', '.join(map(str, missing))}: the worker's view of this host is out of date "
                                     f"(restart the worker to pick up the host's size)")
        st = await runner.launch(req.stage_id, req.command, env=req.env, cwd=req.cwd, cpuset=req.cpuset, labels=req.labels,
                                 python_fallback=req.python_fallback, owner=wid, owner_since=fence_clock())
        return st.status()

    @app.get("/v1/stages/{stage_id}")
    async def status(stage_id: str, request: Request, adopt: bool = False) -> dict:
        """Its record; `adopt=1`: the asking worker takes it over (`AgentBackend.adopt`): its fence is that worker's."""
        st = _get(stage_id)
        if adopt:
            take(st, request.state.worker)
        return st.status()

    @app.get("/v1/stages/{stage_id}/wait")
    async def wait(stage_id: str, request: Request, timeout: float = 30.0, adopt: bool = False) -> dict:
        st = _get(stage_id)
        if adopt:
            take(st, request.state.worker)
        await runner.wait(st, max(0.0, min(timeout, 300.0)))
        return st.status()

    @app.get("/v1/stages/{stage_id}/logs")
    async def logs(stage_id: str, offset: int = 0, follow: bool = True):
        st = _get(stage_id)
        return StreamingResponse(runner.follow(st, offset, follow), media_type="text/plain; charset=utf-8")

    @app.post("/v1/progress")
    async def progress_many(req: ProgressRequest) -> dict:
        """Several stages' progress lines at once (the worker asks once per host and round): for each
        stage id this agent knows, its lines from its offset (at most 1 MiB each); unknown ids are left out."""
        out = {}
        for sid, offset in req.offsets.items():
            st = runner.stages.get(sid)
            if st is not None:
                out[sid] = runner.progress(st, offset).decode("utf-8", "surrogateescape")
        return {"stages": out}

    @app.get("/v1/stages/{stage_id}/progress")
    async def progress(stage_id: str, offset: int = 0) -> Response:
        """The stage's progress lines (JSON lines) from byte `offset`, at most 1 MiB: the worker appends
        them to its copy and asks again from the copy's size."""
        return Response(runner.progress(_get(stage_id), offset), media_type="application/x-ndjson")

    @app.put("/v1/stages/{stage_id}/cpuset")
    async def cpuset(stage_id: str, req: CpusetRequest) -> dict:
        st = _get(stage_id)
        runner.set_cpuset(st, req.cpuset)
        return st.status()

    @app.delete("/v1/stages/{stage_id}")
    async def kill(stage_id: str, reason: str = "cancelled", grace: float = 5.0) -> dict:
        st = _get(stage_id)
        try:
            await runner.kill(st, reason, max(0.0, min(grace, 60.0)))
        except PermissionError as exc:  # was a bare 500 'Internal Server Error' and a traceback in the agent's log
            raise HTTPException(500, f"cannot signal stage {stage_id}'s processes (group {st.pid}): {exc.strerror or exc}; "
                                     "they run as a user the agent's may not signal (a setuid program?): kill them "
                                     "as root on this host") from None
        return st.status()

    return app
