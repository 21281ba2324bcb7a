"""qosflow: QoS-aware scheduling of deep-learning pipelines on shared GPU clusters, inside Prefect 3.

Top-level names are imported lazily so that `import qosflow` (and `qosflow --help`) stays fast.
"""

__version__ = "0.1.0"

#: public name -> (module, attribute); add yours here, imported on first access
_LAZY = {
    # Prefect integration (qosflow.prefect, qosflow.placement_api)
    "placement": ("qosflow.placement_api", "placement"),
    "PlacementInfo": ("qosflow.placement_api", "PlacementInfo"),
    "qos_task": ("qosflow.prefect.tasks", "qos_task"),
    "qos_flow": ("qosflow.prefect.tasks", "qos_flow"),
    # predictor (qosflow.progress)
    "report_progress": ("qosflow.progress", "report_progress"),
    "track": ("qosflow.progress", "track"),
    "report_resumed": ("qosflow.progress", "report_resumed"),
    # elastic start (qosflow.placement_api)
    "accumulation_steps": ("qosflow.placement_api", "accumulation_steps"),
    "granted_gpus": ("qosflow.placement_api", "granted_gpus"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'qosflow' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
