"""qosflow's database: profiles, samples, predictions, outcomes and stage history (SQLite or PostgreSQL)."""

from qosflow.store.migrations import LATEST_VERSION
from qosflow.store.models import Outcome, PredictionRecord, Profile, Sample, StageHistory
from qosflow.store.store import ENV_URL, Store, default_url, validate_sample

__all__ = [
    "ENV_URL",
    "LATEST_VERSION",
    "Outcome",
    "PredictionRecord",
    "Profile",
    "Sample",
    "StageHistory",
    "Store",
    "default_url",
    "validate_sample",
]
