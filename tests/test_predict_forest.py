"""The flat forest walk gives sklearn's own per-tree predictions, bit for bit."""

import numpy as np
import pytest
from sklearn.ensemble import ExtraTreesRegressor, RandomForestRegressor

from qosflow.predict.forest import SMALL_BATCH, FlatForest, flatten, per_tree_predictions


@pytest.mark.parametrize("cls", [ExtraTreesRegressor, RandomForestRegressor])
def test_flat_walk_matches_sklearn(cls):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(400, 7))
    X[:, 3] = rng.integers(0, 4, 400)  # ties on thresholds between integers
    y = X[:, 0] * 2 + np.sin(X[:, 1]) + X[:, 3] ** 2 + rng.normal(scale=0.1, size=400)
    forest = cls(n_estimators=25, random_state=0).fit(X, y)
    Q = np.vstack([rng.normal(size=(50, 7)), X[:20]])
    Q[:, 3] = rng.integers(0, 4, len(Q))
    want = np.stack([t.predict(Q.astype(np.float32)) for t in forest.estimators_])
    got = FlatForest(forest).per_tree(Q)
    assert np.array_equal(got, want)
    assert np.allclose(got.mean(0), forest.predict(Q))
    # both paths of per_tree_predictions (small batches walk flat, large ones use `apply`)
    flatten(forest)
    assert np.array_equal(per_tree_predictions(forest, Q[:SMALL_BATCH]), want[:, :SMALL_BATCH])
    assert np.array_equal(per_tree_predictions(forest, Q), want)


def test_wrong_width_is_a_clear_error():
    forest = ExtraTreesRegressor(n_estimators=3, random_state=0).fit(np.eye(4), np.arange(4.0))
    with pytest.raises(ValueError, match="fitted on 4 features"):
        FlatForest(forest).per_tree(np.ones((1, 3)))
