"""Speed vs CPU cores (CODA, ICDCS'20): a saturating curve and where adding cores stops helping.

Step time on c cores is fitted as t(c) = s + p / c (a serial part s and a part p split over cores,
Amdahl's form) by non-negative least squares on measured (cores, step time) pairs. Speed relative to
saturation is s / t(c); the saturation point is the fewest cores reaching 95 % of the asymptotic speed.

Amdahl's form cannot fall with more cores. When the samples do -- the most cores measured are more than
5 % slower (below 95 % of the speed) than the fastest count: oversubscription, threads waiting for each
other on busy cores -- the curve follows them instead: the mean step time per measured core count, linear
in between and flat beyond the ends. Speed is then relative to the fastest measured count, and the
saturation point is the knee: the fewest measured cores reaching 95 % of that speed. (Within 5 %, more
cores "a little slower" is read as no effect: a flat curve at the mean.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: CODA measured 4-6 cores per GPU to saturate CV training; used when a job has no CPU samples
DEFAULT_SATURATION_CORES = 4.0
SATURATION_LEVEL = 0.95


@dataclass(frozen=True)
class CpuCurve:
    serial: float  # s (seconds per step that more cores do not shorten)
    parallel: float  # p (seconds per step on one core that cores split)
    n_samples: int
    basis: str
    #: (cores, mean step time) per measured core count, when the samples fall with more cores (the curve
    #: follows them, see the module docstring); empty for Amdahl's form
    points: tuple[tuple[float, float], ...] = ()

    def step_time(self, cores: float) -> float:
        if self.points:
            c, t = zip(*self.points)
            return float(np.interp(cores, c, t))
        return self.serial + self.parallel / max(cores, 1e-9)

    def speed_fraction(self, cores: float) -> float:
        """Speed with `cores` relative to unlimited cores (with `points`: to the fastest measured count), in (0, 1]."""
        if self.points:
            return min(t for _c, t in self.points) / self.step_time(cores)
        return self.serial / self.step_time(cores) if self.serial > 0 else min(1.0, cores / self.saturation_cores)

    def speedup(self, cores: float, base: float = 1.0) -> float:
        return self.step_time(base) / self.step_time(cores)

    @property
    def saturation_cores(self) -> float:
        if self.points:  # the knee: the fewest measured cores within 95 % of the fastest
            best = min(t for _c, t in self.points)
            return float(next(c for c, t in self.points if best / t >= SATURATION_LEVEL))
        if self.serial <= 0:
            return math.inf
        if self.parallel <= 0:
            return 1.0
        return max(1.0, self.parallel / (self.serial * (1 / SATURATION_LEVEL - 1)))


def default_curve(saturation_cores: float = DEFAULT_SATURATION_CORES) -> CpuCurve:
    # choose p/s so that the 95 % point is at `saturation_cores`
    s = 1.0
    p = saturation_cores * s * (1 / SATURATION_LEVEL - 1)
    return CpuCurve(s, p, 0, f"fallback:coda-default(saturation={saturation_cores:g} cores)")


def fit_curve(cores: Sequence[float], step_times: Sequence[float]) -> CpuCurve | None:
    """Fit t(c) = s + p/c; None when the samples cover fewer than two core counts."""
    c = np.asarray(cores, dtype=float)
    t = np.asarray(step_times, dtype=float)
    ok = (c > 0) & (t > 0) & np.isfinite(t)
    c, t = c[ok], t[ok]
    if len(np.unique(c)) < 2:
        return None
    A = np.stack([np.ones_like(c), 1.0 / c], axis=1)
    sol, *_ = np.linalg.lstsq(A, t, rcond=None)
    s, p = float(sol[0]), float(sol[1])
    if s < 0:  # all parallel: refit with s = 0 ... keep a tiny serial part so speed stays defined
        s, p = 1e-9, float((t * (1 / c)).sum() / ((1 / c) ** 2).sum())
    uc = sorted({int(x) if float(x).is_integer() else float(x) for x in c})
    pts = tuple((float(k), float(t[c == k].mean())) for k in np.unique(c))  # mean step time per core count
    best = min(m for _k, m in pts)
    if pts[-1][1] > best / SATURATION_LEVEL:  # the most cores measured are slower than fewer, beyond noise: follow
        return CpuCurve(best, 0.0, int(len(c)), f"samples(n={len(c)},cores={uc},slower-with-more)", pts)
    if p < 0:  # more cores made it a little slower or no effect: flat curve
        s, p = float(t.mean()), 0.0
    return CpuCurve(s, p, int(len(c)), f"samples(n={len(c)},cores={uc})")
