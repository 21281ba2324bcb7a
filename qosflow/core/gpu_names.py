"""GPU model names as qosflow uses them: NVML's product name shortened to the model.

NVML reports product names such as ``Tesla V100-SXM2-16GB`` or ``NVIDIA A100-SXM4-40GB``. The
reference throughput table, the predictor's samples, cluster descriptions and `@qos_task(gpu_model=...)`
name the model: ``v100``, ``a100``. Without shortening, a profile taken on a real GPU would never
meet the reference data, and a stage asking for ``v100`` would never fit a host whose agent
reported the full name.
"""

from __future__ import annotations

import re

#: words that name the vendor or the product line, not the model
_LINE = {"nvidia", "tesla", "geforce", "quadro", "grid"}
#: words that need the next one to name a model (``RTX 3090``, ``TITAN V``)
_JOINED = {"rtx", "gtx", "titan"}


def short_gpu_model(name: str | None) -> str:
    """``Tesla V100-SXM2-16GB`` -> ``v100``, ``NVIDIA GeForce RTX 3090`` -> ``rtx3090``,
    ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA RTX A6000`` -> ``rtxa6000``,
    ``NVIDIA GeForce GTX 1080 Ti`` -> ``gtx1080ti``; a name that is
    already short (``v100``, ``generic``) comes back lower-cased; empty or None -> ``generic``."""
    if not name or not str(name).strip():
        return "generic"
    words = [w for w in re.split(r"\s+", str(name).strip()) if w]
    while len(words) > 1 and words[0].lower() in _LINE:
        words = words[1:]
    first = words[0].split("-")[0]
    rest = words[1:]
    if first.lower() in _JOINED and rest and "-" not in words[0]:
        first += rest[0].split("-")[0]
        rest = rest[1:]
    if rest and rest[0].lower() in ("ti", "super"):  # GTX 1080 Ti is not a GTX 1080
        first += rest[0]
    return first.lower()
