"""Running statistics of log values, shared by the predictor and the learned estimator."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: relative spread (log sd) assumed for a single measurement and for fallbacks
SINGLE_SAMPLE_LOG_SD = 0.10


@dataclass
class LogStat:
    """Running count / mean / M2 of log values (Welford). Its `sd` is SINGLE_SAMPLE_LOG_SD until it
    has two values."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add_log(self, lx: float) -> None:
        """Add a value given by its log."""
        self.n += 1
        d = lx - self.mean
        self.mean += d / self.n
        self.m2 += d * (lx - self.mean)

    def add(self, x: float) -> None:
        """Add a value (> 0)."""
        self.add_log(math.log(x))

    @property
    def sd(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else SINGLE_SAMPLE_LOG_SD
