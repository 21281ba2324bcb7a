"""`Prediction`: a value with an interval and what it is based on."""

from __future__ import annotations

from dataclasses import dataclass

#: slowdown said of pairs measured as unable to run together (e.g. out of GPU memory): the predictor
#: answers it, and the estimator caps every slowdown it hands to policies at it
INFEASIBLE_SLOWDOWN = 10.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted quantity.

    `low`/`high` bound it (about the 10th and 90th percentiles where a model gives them; wider for
    fallbacks). `n_samples` counts the measurements of *this* job the value rests on (0 for a pure prior).
    `basis` says where it comes from -- see docs/predictor.md for the vocabulary, e.g.
    ``samples(n=12)``, ``profile+scaling-model(train=333)``, ``reference:gavel/v100``,
    ``fallback:linear-scaling``, ``prior:none``.
    """

    value: float
    low: float
    high: float
    n_samples: int
    basis: str

    def __post_init__(self) -> None:  # plain floats, not numpy scalars
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "low", float(self.low))
        object.__setattr__(self, "high", float(self.high))
        object.__setattr__(self, "n_samples", int(self.n_samples))

    def scaled(self, factor: float, basis: str | None = None) -> "Prediction":
        lo, hi = sorted((self.low * factor, self.high * factor))
        return Prediction(self.value * factor, lo, hi, self.n_samples, basis or self.basis)
