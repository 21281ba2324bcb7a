"""`_with_pipeline_deadline`: the deadline a stage's Job carries to the policy is its stage deadline (its share of its
pipeline's, or its own, whichever is earlier), as a budget from when the worker queues it."""
import math

import pytest

from qosflow.core.qos import QoSSpec
from qosflow.prefect.worker import PAST_DEADLINE_BUDGET_S, _with_pipeline_deadline

NOW = 1_000_000.0


def test_a_stage_without_a_deadline_of_its_own_gets_its_pipelines_share():
    assert _with_pipeline_deadline(QoSSpec(), NOW + 120.0, NOW).deadline == pytest.approx(120.0)


def test_its_own_earlier_deadline_is_kept_and_a_later_one_tightened():
    assert _with_pipeline_deadline(QoSSpec(deadline=60.0), NOW + 120.0, NOW).deadline == 60.0
    assert _with_pipeline_deadline(QoSSpec(deadline=600.0), NOW + 120.0, NOW).deadline == pytest.approx(120.0)


def test_a_passed_deadline_is_a_budget_it_cannot_meet_not_none():
    spec = _with_pipeline_deadline(QoSSpec(), NOW - 30.0, NOW)
    assert spec.deadline == PAST_DEADLINE_BUDGET_S and spec.has_qos_target


def test_no_stage_deadline_leaves_the_spec_as_it_is():
    spec = QoSSpec(deadline=60.0, gpus=2)
    assert _with_pipeline_deadline(spec, None, NOW) is spec
    assert _with_pipeline_deadline(QoSSpec(), math.nan, NOW).deadline is None
