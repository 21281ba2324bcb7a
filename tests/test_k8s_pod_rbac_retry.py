"""A pod read RBAC refused is tried again after `pod_rbac_retry_s`: an administrator who grants the rule the worker
named does not have to restart it.

Before, a 403 on the cluster-wide LIST of pods set the backend to its own namespace's pods for the life of the worker
(`_pods_namespaced_only`), and a 403 on the WATCH stopped the pod informer for good: other users' GPU pods stayed
unbooked (and could be over-committed) until a restart, although the warning had said what to grant."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
from kubernetes import client

from qosflow.backends.kubernetes import KubernetesBackend
from test_k8s_foreign_pods import NODE, emulator, foreign_pod

pytestmark = pytest.mark.timeout(90)


def test_the_cluster_wide_pod_list_is_tried_again_after_a_403_and_books_other_namespaces_pods_once_allowed(caplog):
    async def go():
        with emulator() as emu:
            # the account may not list pods cluster-wide (the first LIST); RBAC is fixed right after
            emu.add_fault(r"^/api/v1/pods$", method="GET", status=403, count=1, query=r"^(?!.*watch=(true|1))")
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default")
            be.pod_usage_every_s = 0.0
            be.pod_rbac_retry_s = 1.0
            be.pod_watch_timeout_s = 1  # (the informer's watch returns each second: it sees the retry is due)
            core = client.CoreV1Api(emu.api_client())
            core.create_namespace({"metadata": {"name": "users"}})
            try:
                core.create_namespaced_pod("users", foreign_pod("nb", gpus=1, cpu="2"))
                deadline = time.monotonic() + 20
                while core.read_namespaced_pod("nb", "users").status.phase != "Running":
                    assert time.monotonic() < deadline, "the pod never ran"
                    await asyncio.sleep(0.05)
                first = await be.foreign_pod_usage()
                assert NODE not in first, first  # (namespace default alone: the users' notebook unseen)
                assert be._pods_namespaced_only
                deadline = time.monotonic() + 20
                while True:  # the retry after pod_rbac_retry_s lists cluster-wide, now allowed
                    usage = await be.foreign_pod_usage()
                    if NODE in usage:
                        break
                    assert time.monotonic() < deadline, "the notebook was never booked after RBAC was fixed"
                    await asyncio.sleep(0.2)
                assert usage[NODE].amounts() == (1, 2.0, 1024.0)
                assert not be._pods_namespaced_only
            finally:
                await be.aclose()

    with caplog.at_level(logging.WARNING, logger="qosflow.backends"):
        asyncio.run(go())
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("may not list pods in all namespaces" in m for m in msgs) == 1, msgs
    assert any("may now list pods in all namespaces" in m for m in msgs), msgs


def test_a_refused_watch_is_tried_again_after_pod_rbac_retry_s_and_not_before():
    async def go():
        with emulator() as emu:
            emu.add_fault(r"^/api/v1/pods$", method="GET", status=403, count=1, query=r"(^|&)watch=(true|1)")
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default")
            be.pod_usage_every_s = 0.0
            be.pod_rbac_retry_s = 3600.0
            try:
                await be.foreign_pod_usage()
                inf = be._pod_informer
                deadline = time.monotonic() + 20
                while not (inf.forbidden and not inf.thread.is_alive()):
                    assert time.monotonic() < deadline, "the informer was never refused"
                    await asyncio.sleep(0.05)
                inf.start()
                assert not inf.thread.is_alive()  # (not due: stopped, as before)
                be.pod_rbac_retry_s = 0.0  # (due now: the RBAC may have been fixed, and it was: the fault was one)
                inf.start()
                deadline = time.monotonic() + 20
                while inf.usage() is None:
                    assert time.monotonic() < deadline, "the informer never followed the pods again"
                    await asyncio.sleep(0.05)
                assert not inf.forbidden
            finally:
                await be.aclose()

    asyncio.run(go())
