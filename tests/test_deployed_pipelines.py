"""What a user who deploys a pipeline with `prefect deploy` runs into (user review, 2026-11-26): the
example flow's run parameters, a pipeline deployed without QOSFLOW_POOL, a misspelt pool, a stage
cancelled from the CLI, a deadline that cannot be met."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from qosflow import qos_flow, qos_task


def test_the_example_flow_takes_a_duration_string_as_its_run_deadline():
    """`prefect deployment run retrain/hotfix-retrain -p qos_deadline=5min` was refused by Prefect
    ("'5min' is not valid under any of the given schemas"): flows/retrain.py annotated it `float | None`
    although durations may be strings (docs/prefect.md says to annotate `float | str | None`)."""
    import jsonschema
    from prefect.utilities.callables import parameter_schema

    from flows.retrain import retrain

    schema = parameter_schema(retrain.fn).model_dump_for_openapi()
    jsonschema.validate({"qos_deadline": "5min"}, schema)
    jsonschema.validate({"qos_deadline": 300}, schema)
    assert retrain.validate_parameters({"qos_deadline": "5min"})["qos_deadline"] == "5min"
