"""Scheduling policies, one module each, behind one interface (`Policy.schedule`).

Baselines: fifo, sjf, srtf, tiresias, sjf-ffs, sjf-bsbf, genie. qosflow's own policy registers as
`qosflow` (module `qosflow.policies.qosflow_policy`). Packing policies for fractional-GPU
requests (first-fit, best-fit, fgd) live in `qosflow.packing`.
"""

from __future__ import annotations

import importlib
from typing import Any

from qosflow.errors import UnknownNameError
from qosflow.policies.base import Decision, Policy, SchedulerView, commit

#: policy name -> module defining it (imported on first use)
BUILTIN = {
    "fifo": "qosflow.policies.fifo",
    "sjf": "qosflow.policies.sjf",
    "srtf": "qosflow.policies.srtf",
    "tiresias": "qosflow.policies.tiresias",
    "sjf-ffs": "qosflow.policies.sjf_ffs",
    "sjf-bsbf": "qosflow.policies.sjf_bsbf",
    "genie": "qosflow.policies.genie",
    "qosflow": "qosflow.policies.qosflow_policy",
}

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    names = set(_REGISTRY)
    for name, mod in BUILTIN.items():
        if importlib.util.find_spec(mod) is not None:
            names.add(name)
    return sorted(names)


def get_policy(name: str, **options: Any) -> Policy:
    key = name.strip().lower()
    if key not in _REGISTRY and key in BUILTIN:
        try:
            importlib.import_module(BUILTIN[key])
        except ModuleNotFoundError as exc:
            if exc.name != BUILTIN[key]:
                raise
    if key not in _REGISTRY:
        raise UnknownNameError("policy", name, available())
    return _REGISTRY[key](**options)


def parse_policies(spec: str) -> list[str]:
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    if not names:
        raise UnknownNameError("policy", spec, available())
    for n in names:
        if n not in BUILTIN and n not in _REGISTRY:
            raise UnknownNameError("policy", n, available())
    return names


__all__ = ["Decision", "Policy", "SchedulerView", "available", "commit", "get_policy", "parse_policies", "register"]
