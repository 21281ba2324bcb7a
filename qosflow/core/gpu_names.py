"""GPU model names as qosflow uses them: NVML's product name shortened to the model.

NVML reports product names such as ``Tesla V100-SXM2-16GB`` or ``NVIDIA A100-SXM4-40GB``. The
reference throughput table, the predictor's samples, cluster descriptions and `@qos_task(gpu_model=...)`
name the model: ``v100``, ``a100``. Without shortening, a profile taken on a real GPU would never
meet the reference data, and a stage asking for ``v100`` would never fit a host whose agent
reported the full name. Models are compared without regard to case (`ClusterSpec.model_mask`).
"""

from __future__ import annotations

import re

#: the GPU type of a profile or sample taken without a GPU (`qosflow profile` on a CPU-only machine)
CPU_ONLY = "cpu"
#: words that name the vendor or the product line, not the model
_LINE = {"nvidia", "tesla", "geforce", "quadro", "grid"}
#: words that need the next one to name a model (``RTX 3090``, ``TITAN V``)
_JOINED = {"rtx", "gtx", "titan"}


def short_gpu_model(name: str | None) -> str:
    """``Tesla V100-SXM2-16GB`` -> ``v100``, ``NVIDIA GeForce RTX 3090`` -> ``rtx3090``,
    ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA RTX A6000`` -> ``rtxa6000``,
    ``NVIDIA GeForce GTX 1080 Ti`` -> ``gtx1080ti``, Kubernetes' ``NVIDIA-A100-SXM4-40GB`` -> ``a100``; a name that is
    already short (``v100``, ``generic``) comes back lower-cased; empty or None -> ``generic``."""
    if not name or not str(name).strip():
        return "generic"
    # NVML separates words with spaces, GPU feature discovery's node label with hyphens
    # (`NVIDIA-A100-SXM4-40GB`); the model is the first word after the vendor and line
    words = [w for w in re.split(r"[\s\-_]+", str(name).strip()) if w]
    if not words:
        return "generic"
    while len(words) > 1 and words[0].lower() in _LINE:
        words = words[1:]
    first, rest = words[0], words[1:]
    if first.lower() in _JOINED and rest:
        first, rest = first + rest[0], rest[1:]
    if rest and rest[0].lower() in ("ti", "super"):  # GTX 1080 Ti is not a GTX 1080
        first += rest[0]
    return first.lower()
