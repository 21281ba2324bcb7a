"""Shared fixtures. Prefect: ONE test server per session, only for the tests that ask for it.

Prefect and qosflow state go to a temporary directory (PREFECT_HOME, QOSFLOW_HOME), analytics off.

The session's Prefect server keeps its database in PostgreSQL when QOSFLOW_TEST_POSTGRES_URL names one
(CI starts it: `.ci/run`), in a fresh database of its own that is dropped at the end; otherwise in SQLite,
as `prefect_test_harness` does. A whole CI run (workers, agents, flows and the server's own background
services writing at once) once held SQLite's write lock for a minute and a pipeline missed its deadline;
PostgreSQL is what Prefect recommends for a server with concurrent writers. Set
QOSFLOW_TEST_PREFECT_SQLITE=1 to keep SQLite anyway. On SQLite the server is the one qosflow starts for
SQLite elsewhere (`qosflow.prefect.server_process`, whose changes address that very stall), not
Prefect's plain test harness.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from contextlib import contextmanager

import pytest

_TMP = tempfile.mkdtemp(prefix="qosflow-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("QOSFLOW_HOME", os.path.join(_TMP, "qosflow"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")


@pytest.fixture
def pg_url():
    """The PostgreSQL database QOSFLOW_TEST_POSTGRES_URL names, emptied (its public schema dropped and made
    again) for the test, as a postgresql+psycopg URL; the test is skipped, saying why, when none is named or
    it does not answer. (.ci/run starts one.)"""
    url = os.environ.get("QOSFLOW_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("QOSFLOW_TEST_POSTGRES_URL is not set, so this test's PostgreSQL half cannot run "
                    "(e.g. postgresql+psycopg://qosflow:qosflow@localhost/qosflow_test; .ci/run starts one)")
    import sqlalchemy as sa

    url = url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url
    eng = sa.create_engine(url)
    try:
        with eng.begin() as conn:
            conn.exec_driver_sql("DROP SCHEMA public CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA public")
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL at QOSFLOW_TEST_POSTGRES_URL does not answer: {exc.orig}")
    finally:
        eng.dispose()
    return url


def _new_postgres_database():
    """A fresh PostgreSQL database for the Prefect test server, next to the one QOSFLOW_TEST_POSTGRES_URL
    names: (admin engine, its name, its asyncpg URL, Prefect's driver); None, saying why, when that
    PostgreSQL is not named, does not answer or may not create one (the server then uses SQLite)."""
    url = os.environ.get("QOSFLOW_TEST_POSTGRES_URL")
    if not url or os.environ.get("QOSFLOW_TEST_PREFECT_SQLITE") == "1":
        return None
    import sqlalchemy as sa

    name = f"prefect_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.SQLAlchemyError as exc:
        engine.dispose()
        print(f"[qosflow tests] no database for the Prefect test server at QOSFLOW_TEST_POSTGRES_URL "
              f"({exc.__class__.__name__}: {str(exc).splitlines()[0]}): it uses SQLite")
        return None
    return engine, name, engine.url.set(drivername="postgresql+asyncpg", database=name).render_as_string(hide_password=False)


def _drop_postgres_database(engine, name: str) -> None:
    import sqlalchemy as sa

    try:  # (WITH (FORCE): PostgreSQL 13+; a database left behind is only a leftover, never a test failure)
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    except sa.exc.SQLAlchemyError as exc:
        print(f"[qosflow tests] could not drop the test server's database {name}: {exc.__class__.__name__}")
    engine.dispose()


def _server_class(factory: str | None):
    """Prefect's subprocess test server; with `factory`, one whose uvicorn builds the app with it."""
    from prefect.server.api.server import SubprocessASGIServer

    if factory is None:
        return SubprocessASGIServer

    class FactoryServer(SubprocessASGIServer):
        def _run_uvicorn_command(self):
            import subprocess
            import sys

            from prefect.settings import get_current_settings

            args = [sys.executable, "-m", "uvicorn", "--factory", factory, "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "error", "--lifespan", "on"]
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
                   **get_current_settings().to_environment_variables(exclude_unset=True)}
            return subprocess.Popen(args=args, env=env)

    return FactoryServer


@contextmanager
def _prefect_server(database_url: str, startup_timeout: int = 120, factory: str | None = None):
    """`prefect_test_harness` with the database given (the harness always takes a temporary SQLite
    file), and optionally the app built by another uvicorn factory."""
    from contextlib import ExitStack

    import prefect.context
    import prefect.settings
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface
    from prefect.testing.utilities import _find_available_port

    with ExitStack() as stack:
        stack.enter_context(temporary_database_interface())
        stack.enter_context(prefect.settings.temporary_settings(
            updates={prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL: database_url}))
        server = _server_class(factory)(port=_find_available_port())
        prior = SubprocessASGIServer._instances.get(None)
        SubprocessASGIServer._instances[None] = server  # flows find this server, not a second one
        server.start(timeout=startup_timeout)
        stack.enter_context(prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: server.api_url}))
        stack.enter_context(prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()))
        try:
            yield
        finally:
            _drain_prefect_workers()
            server.stop()
            if prior is not None:
                SubprocessASGIServer._instances[None] = prior
            else:
                SubprocessASGIServer._instances.pop(None, None)


def _drain_prefect_workers() -> None:
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain():
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


@pytest.fixture(scope="session")
def prefect_server():
    """A real local Prefect server for the whole session (PostgreSQL when available, else SQLite); yields its API URL."""
    from prefect.settings import PREFECT_API_URL

    pg = _new_postgres_database()
    if pg is None:
        # SQLite: the server qosflow starts for SQLite everywhere else (demo, benchmarks), with
        # qosflow.prefect.server_process's changes (collection off the event loop, BEGIN IMMEDIATE
        # writes, lost write races retried in the server); Prefect's own harness runs the plain app
        db = os.path.join(tempfile.mkdtemp(prefix="prefect-test-", dir=_TMP), "prefect-test.db")
        with _prefect_server(f"sqlite+aiosqlite:///{db}", factory="qosflow.prefect.server_process:create_app"):
            yield PREFECT_API_URL.value()
        return
    engine, name, db_url = pg
    try:
        with _prefect_server(db_url):
            yield PREFECT_API_URL.value()
    finally:
        _drop_postgres_database(engine, name)
