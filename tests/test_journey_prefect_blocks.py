"""A first user's bare-metal cluster block whose `agent_ca_cert` names a file (as a cluster file's `tls_ca_file:`
does) instead of holding the certificate: it said only "not a PEM CA certificate (...): no start line: cadata does
not contain a certificate (_ssl.c:4020)", which neither says that the field takes the PEM text nor what to give."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from qosflow.prefect.blocks import BareMetalGPUCluster


def _block(ca: str) -> BareMetalGPUCluster:
    return BareMetalGPUCluster(hosts=["gpu-a"], backend="agents", agent_url="https://{host}:8701", agent_token=SecretStr("t"),
                               agent_ca_cert=ca)


@pytest.mark.parametrize("exists", [False, True])
def test_a_ca_certificate_given_as_a_path_says_the_field_takes_its_text(tmp_path, exists):
    ca = tmp_path / "ca.pem"
    if exists:
        ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValidationError) as err:
        _block(str(ca))
    msg = str(err.value)
    assert f"agent_ca_cert takes the CA certificate's PEM text (-----BEGIN CERTIFICATE----- ...), not a path: '{ca}'" in msg, msg
    assert ("is a file on this machine" if exists else "names no file on this machine either") in msg, msg
    assert "give the file's contents" in msg and "tls_ca_file takes a path" in msg, msg


def test_text_that_is_no_certificate_is_still_refused_as_before():
    with pytest.raises(ValidationError, match="invalid agent_ca_cert: not a PEM CA certificate"):
        _block("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
