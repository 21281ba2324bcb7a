"""What GPUs this host has: NVML when it is there, otherwise the GPUs the operator declared.

Never fake GPU numbers: declared (virtual) GPUs are reported with `"virtual": true` and no
utilisation, memory use or processes (those fields are `None`), and the host says
"no GPU: virtual GPUs".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("qosflow.agent")

NO_GPU_NOTE = "no GPU: virtual GPUs"


@dataclass
class GpuSource:
    """Either NVML (`nvml=True`) or `virtual` declared GPUs of `virtual_mem_mb` each."""

    nvml: bool
    count: int
    virtual_mem_mb: float = 16_384.0
    virtual_model: str = "virtual"
    note: str = ""

    @classmethod
    def detect(cls, virtual_gpus: int | None = None, *, virtual_mem_mb: float = 16_384.0) -> "GpuSource":
        """NVML if it initialises; else `virtual_gpus` declared GPUs (0 if none declared)."""
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # no driver / no library / no GPU
            count = int(virtual_gpus or 0)
            note = NO_GPU_NOTE if count else f"no GPU (NVML unavailable: {type(exc).__name__}) and no --virtual-gpus: CPU-only host"
            return cls(nvml=False, count=count, virtual_mem_mb=virtual_mem_mb, note=note)
        if virtual_gpus:
            log.warning("NVML found %d real GPU(s); ignoring --virtual-gpus %d", n, virtual_gpus)
        return cls(nvml=True, count=n, note=f"{n} GPU(s) via NVML")

    @property
    def virtual(self) -> bool:
        return not self.nvml

    def report(self) -> list[dict[str, Any]]:
        if not self.nvml:
            return [
                {
                    "index": i,
                    "name": self.virtual_model,
                    "uuid": f"virtual-{i}",
                    "virtual": True,
                    "memory_total_mb": self.virtual_mem_mb,
                    # no measurement exists for a declared GPU: never make one up
                    "memory_used_mb": None,
                    "utilization_gpu": None,
                    "processes": None,
                }
                for i in range(self.count)
            ]
        return _nvml_report()


def _nvml_report() -> list[dict[str, Any]]:
    import pynvml

    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        except pynvml.NVMLError:
            util = None
        procs: list[dict[str, Any]] | None
        try:
            procs = [
                {"pid": p.pid, "used_memory_mb": (p.usedGpuMemory or 0) / 2**20}
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            ]
        except pynvml.NVMLError:
            procs = None
        out.append(
            {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                "virtual": False,
                "memory_total_mb": mem.total / 2**20,
                "memory_used_mb": mem.used / 2**20,
                "utilization_gpu": util,
                "processes": procs,
            }
        )
    return out
