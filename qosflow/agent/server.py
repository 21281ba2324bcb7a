"""Serve agents with uvicorn: one per process (`qosflow agent start`), or many in one process.

`serve_many` runs N agent apps on N ports in one event loop. It exists so that a benchmark can
stand up 100 agent endpoints on a 2-core machine: every endpoint is a real HTTP server on its own
port with its own virtual host, but they share a process (and its CPU) with their siblings.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Iterable

import uvicorn

from qosflow.agent.app import AgentConfig, create_app


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def make_server(cfg: AgentConfig, port: int, host: str = "127.0.0.1", log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(cfg), host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
        timeout_keep_alive=30,
    )
    return _QuietServer(config)


def serve(cfg: AgentConfig, port: int, host: str = "127.0.0.1", log_level: str = "warning") -> None:
    """Run one agent until SIGINT/SIGTERM (uvicorn's own signal handling)."""
    config = uvicorn.Config(create_app(cfg), host=host, port=port, log_level=log_level, access_log=False, timeout_keep_alive=30)
    uvicorn.Server(config).run()


async def serve_many(items: Iterable[tuple[AgentConfig, int]], host: str = "127.0.0.1") -> None:
    servers = [make_server(cfg, port, host) for cfg, port in items]
    loop = asyncio.get_running_loop()

    def _stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _stop)
    await asyncio.gather(*(s.serve() for s in servers))
