"""`prefect server start`, with Python's cyclic garbage collector run off the server's event loop.

    python -m qosflow.prefect.server_process server start --host 127.0.0.1 --port 4200

takes the same arguments as `python -m prefect ...` and runs the same command. The one difference:
automatic garbage collection is off, and a daemon thread runs it instead (young objects every
0.1 s, older every 1 s, all every 10 s).

Why (measured in `qosflow demo`, 2026-11-23; docs/prefect.md): with SQLite, Prefect's server
stopped answering every request, `/api/health` too, for about 60 s, several times per demo. A
stack dump of the stalled server showed its event-loop thread inside a garbage collection,
finalizing an unreferenced aiosqlite cursor: CPython resets the cursor's statement, which waits for
the SQLite connection's mutex. Another thread held that mutex while its statement waited on
SQLite's busy timeout (60 s in Prefect's server) for a write lock, and the transaction holding the
write lock needed the event loop to commit. Nothing moved until the busy timeout expired. A
collection in another thread may wait on the same mutex, but it waits alone: the event loop keeps
serving, the write transaction commits, and the mutex comes free.

A second change, for the same SQLite server: a write that loses SQLite's write race (SQLITE_BUSY /
SQLITE_BUSY_SNAPSHOT: in WAL mode a deferred transaction that read, then wants to write after
another writer committed, fails at once, without waiting) gets Prefect's 503 "Service Unavailable",
and Prefect's client retries it after 2, 4, 8, 16 and 32 s. In the demo these back-offs held a
stage's start for up to 52 s while the race was over within a second. The server now retries such a
request itself (`RetryLostWriteRaces`): the transaction was rolled back, so the request is replayed
(its body kept) after 0.05-1 s, doubling, for up to `QOSFLOW_SERVER_RETRY_S` seconds (default 15; 0:
off), and only then answers the 503, after which the client's own back-off applies as before.

A third: the server begins every write transaction with BEGIN IMMEDIATE (`immediate_write_transactions`;
Prefect does so only where it asks `with_for_update`, BEGIN DEFERRED elsewhere). The transaction then
takes the write lock at its start, waiting in SQLite's busy handler while another holds it, and cannot
lose the race half-way. Side by side in the demo (3 alternating pairs of runs, 2026-11-24): creating a
stage's flow run took at most 2.1 s against 5.2-12.4 s, 12 s in total per run against 34-47 s
(QOSFLOW_SERVER_SQLITE_IMMEDIATE=0 turns it off).
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

from qosflow.env import env_flag, env_number

#: the retries' jitter: a generator of its own, so that the server's waits never move the global `random`
_JITTER = random.Random()

#: seconds between collections of generation 0, 1 and 2 in the collector thread
PERIODS = (0.1, 1.0, 10.0)


def retry_budget_s() -> float:
    """How long the server retries a request that lost SQLite's write race itself
    (QOSFLOW_SERVER_RETRY_S, default 15 s; 0: off)."""
    return env_number("QOSFLOW_SERVER_RETRY_S", 15.0)


def _collector() -> None:
    n = 0
    step = PERIODS[0]
    every = [max(1, round(p / step)) for p in PERIODS]
    while True:
        time.sleep(step)
        n += 1
        gen = 2 if n % every[2] == 0 else 1 if n % every[1] == 0 else 0
        gc.collect(gen)


def collect_off_the_event_loop() -> threading.Thread:
    """Turn automatic collection off; collect in a daemon thread instead."""
    gc.disable()
    t = threading.Thread(target=_collector, name="qosflow-gc", daemon=True)
    t.start()
    return t


class RetryLostWriteRaces:
    """ASGI middleware around Prefect's app: a request whose handling ended in a retryable database
    error (Prefect answers those with 503, `is_client_retryable_exception`) is run again, with the same
    body, after a short pause, for at most `budget_s` seconds; the client sees the first other answer,
    or the last 503. A 503 without such an error (e.g. a health check) is answered at once."""

    def __init__(self, app, *, budget_s: float = 15.0, max_body: int = 8 << 20):
        self.app = app
        self.budget_s = budget_s
        self.max_body = max_body
        self.retries = 0  # requests run again (tests, logs)

    def __getattr__(self, name):  # the wrapped app's attributes (state, routes, ...) stay reachable
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.budget_s <= 0:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left while sending: nothing to replay
                return await self.app(scope, _replay(chunks, receive, last=msg), send)
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if not msg.get("more_body", False):
                break
            if size > self.max_body:  # too large to keep: run once, as it comes
                return await self.app(scope, _replay(chunks, receive, more=True), send)
        body = b"".join(chunks)
        from prefect.server.api.server import is_client_retryable_exception

        start, pause = time.monotonic(), 0.05
        while True:
            held: list[dict] = []
            passed = False

            async def hold_503(msg) -> None:
                nonlocal passed
                if passed or (msg["type"] == "http.response.start" and msg["status"] != 503):
                    passed = True
                    await send(msg)
                else:
                    held.append(msg)

            try:  # a fresh copy of the scope each time: routing rewrites it in place (e.g. a mount's path)
                await self.app(dict(scope), _replay([body], receive), hold_503)
                error = None
            except Exception as exc:  # noqa: BLE001 (re-raised below unless retried)
                error = exc
            if (held and not passed and error is not None and is_client_retryable_exception(error)
                    and time.monotonic() - start + pause <= self.budget_s):
                self.retries += 1
                await asyncio.sleep(pause * _JITTER.uniform(0.5, 1.5))
                pause = min(1.0, pause * 2)
                continue
            for msg in held:
                await send(msg)
            if error is not None:
                raise error
            return


def _replay(chunks: list[bytes], receive, *, more: bool = False, last: dict | None = None):
    """An ASGI `receive` that hands out the body read so far, then defers to the real one."""
    pending = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if pending and not more:
        pending[-1]["more_body"] = False
    if last is not None:
        pending.append(last)

    async def _receive():
        if pending:
            return pending.pop(0)
        return await receive()

    return _receive


def retry_lost_write_races(budget_s: float) -> None:
    """Wrap the app Prefect's server command creates in `RetryLostWriteRaces` (budget 0: leave it)."""
    if budget_s <= 0:
        return
    from prefect.server.api import server

    create_app = server.create_app

    def create_app_retrying(*args, **kwargs):
        return RetryLostWriteRaces(create_app(*args, **kwargs), budget_s=budget_s)

    server.create_app = create_app_retrying


def immediate_write_transactions() -> None:
    """On SQLite, begin every transaction Prefect opens for writing with BEGIN IMMEDIATE (Prefect
    does so only where it asks `with_for_update`; elsewhere BEGIN DEFERRED). An immediate transaction
    takes the write lock at its start, waiting in SQLite's busy handler for it, so it cannot lose the
    write race half-way (SQLITE_BUSY_SNAPSHOT) and need a replay; reads outside such transactions are
    unchanged."""
    from contextlib import asynccontextmanager

    from prefect.server.database import configurations

    cls = configurations.AioSqliteConfiguration
    if getattr(cls.begin_transaction, "_qosflow_immediate", False):
        return
    begin = cls.begin_transaction

    @asynccontextmanager
    async def begin_transaction(self, session, with_for_update: bool = False):
        async with begin(self, session, with_for_update=True) as transaction:
            yield transaction

    begin_transaction._qosflow_immediate = True  # type: ignore[attr-defined]
    cls.begin_transaction = begin_transaction


def any_patch() -> bool:
    """Is any of this module's changes switched on (else plain `python -m prefect` is the same)?"""
    return env_flag("QOSFLOW_SERVER_GC_THREAD") or env_flag("QOSFLOW_SERVER_SQLITE_IMMEDIATE") or retry_budget_s() > 0


_COLLECTOR: threading.Thread | None = None


def create_app(*args, **kwargs):
    """A uvicorn app factory: Prefect's server app with this module's changes, for a server that
    uvicorn starts directly rather than through `prefect server start`, e.g. the test suite's
    (`uvicorn --factory qosflow.prefect.server_process:create_app`). The same switches apply."""
    global _COLLECTOR
    if env_flag("QOSFLOW_SERVER_GC_THREAD") and _COLLECTOR is None:
        _COLLECTOR = collect_off_the_event_loop()
    if env_flag("QOSFLOW_SERVER_SQLITE_IMMEDIATE"):
        immediate_write_transactions()
    from prefect.server.api import server

    app = server.create_app(*args, **kwargs)
    budget = retry_budget_s()
    return RetryLostWriteRaces(app, budget_s=budget) if budget > 0 else app


def main() -> None:
    if env_flag("QOSFLOW_SERVER_GC_THREAD"):
        collect_off_the_event_loop()
    if env_flag("QOSFLOW_SERVER_SQLITE_IMMEDIATE"):
        immediate_write_transactions()
    retry_lost_write_races(retry_budget_s())
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()
