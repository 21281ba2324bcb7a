"""The predictor: step times, scaling, co-location slowdowns, CPU curves and remaining times.

Import the pieces from their modules (`qosflow.predict.predictor.Predictor`, ...); this package
imports nothing heavy itself.
"""

from qosflow.predict.prediction import Prediction

__all__ = ["Prediction", "Predictor"]


def __getattr__(name: str):
    if name == "Predictor":
        from qosflow.predict.predictor import Predictor

        return Predictor
    raise AttributeError(name)
