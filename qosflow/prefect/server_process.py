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
"""

from __future__ import annotations

import gc
import threading
import time

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


def main() -> None:
    collect_off_the_event_loop()
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()
