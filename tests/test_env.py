"""qosflow's environment variables: switches and numbers read one way, bad values named."""

import pytest

from qosflow.env import env_flag, env_number
from qosflow.errors import QosflowError


@pytest.mark.parametrize("raw, want", [("0", False), ("off", False), ("No", False), ("FALSE", False), ("1", True), ("on", True), ("yes", True), ("", True)])
def test_env_flag(monkeypatch, raw, want):
    monkeypatch.setenv("QOSFLOW_X", raw)
    assert env_flag("QOSFLOW_X") is want


def test_env_flag_unset_and_bad(monkeypatch):
    monkeypatch.delenv("QOSFLOW_X", raising=False)
    assert env_flag("QOSFLOW_X", default=False) is False
    monkeypatch.setenv("QOSFLOW_X", "maybe")
    with pytest.raises(QosflowError, match=r"QOSFLOW_X='maybe': expected one of 1, true, on, yes or 0, false, off, no"):
        env_flag("QOSFLOW_X")


def test_env_number(monkeypatch):
    monkeypatch.delenv("QOSFLOW_N", raising=False)
    assert env_number("QOSFLOW_N", 30.0) == 30.0
    monkeypatch.setenv("QOSFLOW_N", " 6 ")
    assert env_number("QOSFLOW_N", 30.0, minimum=1) == 6.0
    assert env_number("QOSFLOW_N", 3, integer=True) == 6 and isinstance(env_number("QOSFLOW_N", 3, integer=True), int)
    for bad, text in [("abc", "expected a number >= 1"), ("0.5", "expected a number >= 1"), ("nan", "expected a number"), ("inf", "expected a number")]:
        monkeypatch.setenv("QOSFLOW_N", bad)
        with pytest.raises(QosflowError, match=f"QOSFLOW_N='{bad}': {text}.*unset it for the default"):
            env_number("QOSFLOW_N", 30.0, minimum=1)
    monkeypatch.setenv("QOSFLOW_N", "2.5")
    with pytest.raises(QosflowError, match="expected a whole number >= 0"):
        env_number("QOSFLOW_N", 3, integer=True)


def test_worker_names_a_bad_lease_ttl(monkeypatch):
    from qosflow.prefect.worker import QosflowWorker

    monkeypatch.setenv("QOSFLOW_LEASE_TTL_SECONDS", "thirty")
    with pytest.raises(QosflowError, match="QOSFLOW_LEASE_TTL_SECONDS='thirty'"):
        QosflowWorker(work_pool_name="gpu")
