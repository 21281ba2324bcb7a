"""The optional PyTorch candidate of flows/retrain.py, run as plain functions (no Prefect): it trains
with the placement's sub-batch plan (gradient accumulation) and learns the digits. Skipped where
PyTorch is not installed (it is optional: `pip install torch`); no GPU here, so it runs on the CPU
and says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is optional and not installed here")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.mark.parametrize("acc", [1, 4])
def test_torch_candidate_learns_with_gradient_accumulation(monkeypatch, acc):
    from flows import retrain

    plan = {"job_id": "t", "node": "host0", "nodes": ["host0"], "gpus": [0], "gpu_milli": 1000, "cpu_cores": 1, "cpuset": [],
            "colocated_with": ["other"] if acc > 1 else [], "virtual_gpus": True,
            "sub_batch": {"sub_batch": retrain.GLOBAL_BATCH // acc, "accumulation_steps": acc} if acc > 1 else None}
    monkeypatch.setenv("QOSFLOW_PLACEMENT", json.dumps(plan))
    torch.manual_seed(0)
    feats = retrain.featurize.qos_fn(retrain.load_data.qos_fn(0))
    m = retrain.train_torch.qos_fn(feats, epochs=15)
    assert m["kind"] == "torch" and m["device"] == "cpu"  # virtual GPUs: never CUDA, even if present
    [ranked] = retrain.evaluate.qos_fn(feats, [m])
    assert ranked["accuracy"] > 0.85
