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
SQLITE_BUSY_SNAPSHOT: WAL mode answers a deferred transaction that read, then wants to write after
another writer committed, at once, without waiting) gets Prefect's 503 "Service Unavailable". Prefect's
client retries a 503 after 2, 4, 8, 16 and 32 s unless the answer carries a ``Retry-After`` header;
in the demo these back-offs held a stage's start for up to 52 s while the server was idle again
within a second. So the server's 503 answers say ``Retry-After`` a random 0.5-1.5 s
(`QOSFLOW_SERVER_RETRY_AFTER`, the mean in seconds; 0 leaves Prefect's answer as it is), and the
clients qosflow starts against this server allow 60 retries (`PREFECT_CLIENT_MAX_RETRIES`, set by
`qosflow.prefect.local.server_env`), about the minute of patience Prefect's own back-off gives.
"""

from __future__ import annotations

import gc
import random
import threading
import time

from qosflow.env import env_flag, env_number

#: seconds between collections of generation 0, 1 and 2 in the collector thread
PERIODS = (0.1, 1.0, 10.0)


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


def retry_soon(mean_s: float) -> None:
    """Make the Prefect server's retryable 503 answers carry ``Retry-After`` (uniform in
    [0.5, 1.5] x `mean_s` seconds, so that clients that lost the same race do not meet again)."""
    if mean_s <= 0:
        return
    from prefect.server.api import server

    handler = server.custom_internal_exception_handler

    async def custom_internal_exception_handler(request, exc):  # the name create_app() looks up
        response = await handler(request, exc)
        if response.status_code == 503 and "retry-after" not in response.headers:
            response.headers["Retry-After"] = f"{mean_s * random.uniform(0.5, 1.5):.2f}"
        return response

    custom_internal_exception_handler.__wrapped__ = handler  # type: ignore[attr-defined]
    server.custom_internal_exception_handler = custom_internal_exception_handler


def main() -> None:
    if env_flag("QOSFLOW_SERVER_GC_THREAD"):
        collect_off_the_event_loop()
    retry_soon(env_number("QOSFLOW_SERVER_RETRY_AFTER", 1.0))
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()
