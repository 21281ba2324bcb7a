"""Shared fixtures. Prefect: ONE test server per session, only for the tests that ask for it.

Prefect and qosflow state go to a temporary directory (PREFECT_HOME, QOSFLOW_HOME), analytics off.
"""

from __future__ import annotations

import os
import tempfile

import pytest

_TMP = tempfile.mkdtemp(prefix="qosflow-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("QOSFLOW_HOME", os.path.join(_TMP, "qosflow"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")


@pytest.fixture(scope="session")
def prefect_server():
    """A real local Prefect server (SQLite) for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
