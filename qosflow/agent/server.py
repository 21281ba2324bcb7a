"""Serve agents with uvicorn: one per process (`qosflow agent start`), or many in one process.

`serve_many` runs N agent apps on N ports in one event loop. It exists so that a benchmark can
stand up 100 agent endpoints on a 2-core machine: every endpoint is a real HTTP server on its own
port with its own virtual host, but they share a process (and its CPU) with their siblings.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
from typing import Iterable

import uvicorn

from qosflow.agent.app import AgentConfig, create_app
from qosflow.backends.base import AGENT_STOPPING


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def make_server(cfg: AgentConfig, port: int, host: str = "127.0.0.1", log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(cfg), host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
        timeout_keep_alive=30,
    )
    return QuietServer(config)


class _Connections(set):
    """uvicorn's set of open connections, closing the ones that join it once the server is stopping.

    uvicorn's shutdown closes its listeners, then shuts down the connections in this set. A connection
    accepted just before the listeners closed joins the set a loop iteration or two later (asyncio makes
    its protocol in a task) and was never shut down: it stayed open as keep-alive, so the stopped agent
    answered on it for as long as its client kept asking (a worker's heartbeat every 2 s, long-polls),
    never finished stopping, and could still be asked to launch a stage."""

    stopping = False

    def add(self, connection) -> None:
        super().add(connection)
        if self.stopping:
            # after connection_made has set the protocol up (it adds itself first)
            asyncio.get_running_loop().call_soon(connection.shutdown)


class _AgentServer(uvicorn.Server):
    """Kills the agent's stages as soon as it is told to stop, *before* it stops answering.

    On SIGTERM/SIGINT uvicorn refuses new connections at once but drains the open ones (a worker's
    long-poll of up to 20 s, a followed log: as long as the stage runs) before the app's shutdown
    hook runs. A worker whose heartbeat is refused takes the host's stages for dead and reruns them
    elsewhere, so they ran in two places until then. Here the stages are killed first (SIGKILL, like
    an agent that dies: an engine given SIGTERM would report the flow run Crashed over its rerun),
    then uvicorn stops; a second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, runner) -> None:
        super().__init__(config)
        self.runner = runner
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.server_state.connections = _Connections()

    async def shutdown(self, sockets=None) -> None:
        self.server_state.connections.stopping = True
        await super().shutdown(sockets)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._stopping or self._loop is None or not self.runner.running():
            super().handle_exit(sig, frame)
            return
        self._stopping = True

        def stop() -> None:
            task = self._loop.create_task(self.runner.kill_all(AGENT_STOPPING, grace=0))
            task.add_done_callback(lambda _t: uvicorn.Server.handle_exit(self, sig, frame))

        self._loop.call_soon_threadsafe(stop)


def bind(host: str, port: int, *, port_option: str = "--port", host_option: str = "--host", what: str = "another agent") -> list[socket.socket]:
    """The agent's listening sockets, bound now so that a port in use or an address this host does not
    have is a clear error before anything starts (uvicorn printed only '[Errno 98] ...'). One per address
    `host` resolves to, as uvicorn (asyncio's create_server) bound them before: `localhost` is 127.0.0.1 and
    ::1 on many hosts, and a worker may reach the agent by either."""
    from qosflow.errors import SpecError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SpecError(host_option, f"{host!r} is not an address or a name this host can resolve ({exc.strerror})") from None
    socks: list[socket.socket] = []
    for family, addr in dict.fromkeys((info[0], info[4]) for info in infos):  # distinct addresses, in order
        sock = socket.socket(family, socket.SOCK_STREAM)
        socks.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
            # as asyncio does: the IPv6 socket must not claim the IPv4 address bound beside it
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            for bound in socks:
                bound.close()
            if exc.errno == errno.EADDRINUSE:
                raise SpecError(port_option, f"{host}:{port} is already in use ({what} running?): stop it or choose another {port_option}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise SpecError(host_option, f"{host} is not an address of this host: give one of its addresses, or 0.0.0.0 for all") from None
            if exc.errno == errno.EACCES:
                raise SpecError(port_option, f"no permission to listen on port {port} (ports below 1024 need root): choose another {port_option}") from None
            raise SpecError(port_option, f"cannot listen on {host}:{port}: {exc.strerror}") from None
        sock.set_inheritable(True)
    return socks


def check_tls(cert: str | None, key: str | None) -> None:
    """That the agent's certificate and key load and match, as a clear error before it starts (uvicorn
    failed at its first connection, or with an ssl traceback)."""
    import ssl

    from qosflow.errors import SpecError

    if bool(cert) != bool(key):
        raise SpecError("--tls-cert" if key else "--tls-key", "give --tls-cert and --tls-key together (the certificate chain and its private key, PEM)")
    if not cert:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise SpecError("--tls-cert", f"cannot read {exc.filename}: no such file") from None
    except PermissionError as exc:
        raise SpecError("--tls-cert", f"cannot read {exc.filename}: permission denied") from None
    except ssl.SSLError as exc:
        raise SpecError("--tls-cert", f"{cert} and {key} are not a PEM certificate chain and its private key ({exc.reason or exc})") from None


def serve(cfg: AgentConfig, port: int, host: str = "127.0.0.1", log_level: str = "warning", *,
          sockets: list[socket.socket] | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
    """Run one agent until SIGINT/SIGTERM; its stages are killed before it stops answering. With
    `tls_cert`/`tls_key` it answers HTTPS only (the token and the stages' environments are then
    encrypted on the network)."""
    check_tls(tls_cert, tls_key)
    app = create_app(cfg)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, timeout_keep_alive=30,
                            ssl_certfile=tls_cert, ssl_keyfile=tls_key)
    _AgentServer(config, app.state.runner).run(sockets=sockets or bind(host, port))


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


def main(argv: list[str] | None = None) -> None:
    """`python -m qosflow.agent.server --base-port P --count N [--virtual-gpus G] [--prefix h]`:
    N virtual agents (hosts `{prefix}{i}`) on ports P..P+N-1 in this one process. Token from
    QOSFLOW_AGENT_TOKEN. For benchmarks that need many endpoints on a small machine."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--base-port", type=int, default=None)
    ap.add_argument("--count", type=int, default=None)
    ap.add_argument("--ports", default=None, help="comma-separated ports (instead of --base-port/--count)")
    ap.add_argument("--first-index", type=int, default=0)
    ap.add_argument("--virtual-gpus", type=int, default=8)
    ap.add_argument("--prefix", default="h")
    a = ap.parse_args(argv)
    token = os.environ.get("QOSFLOW_AGENT_TOKEN", "")
    ports = [int(p) for p in a.ports.split(",")] if a.ports else [a.base_port + i for i in range(a.count)]
    items = [
        (AgentConfig(token=token, name=f"{a.prefix}{a.first_index + i}", virtual_gpus=a.virtual_gpus, force_virtual=True), port)
        for i, port in enumerate(ports)
    ]
    asyncio.run(serve_many(items))


if __name__ == "__main__":
    main()
