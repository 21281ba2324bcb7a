"""Per-tree predictions of a fitted scikit-learn tree ensemble, fast for small batches.

`forest.apply()` walks the trees one by one through joblib, with input validation for each tree:
about 60 µs per tree, so ~12 ms for a single row of a 200-tree forest. A scheduler asks the
predictor one configuration or pair at a time when it meets a new one, so this module keeps all
trees' nodes in flat arrays and walks every tree at once with numpy: one step per tree level for
the whole ensemble. Large batches still go through `apply` (compiled, and faster there).

The results are the same as sklearn's to the bit: like sklearn, features are cast to float32
before they are compared with the (float64) thresholds.
"""

from __future__ import annotations

import numpy as np

#: batches up to this many rows are walked here; larger ones go through sklearn's `apply`
SMALL_BATCH = 32


class FlatForest:
    """All trees of a fitted forest as flat node arrays (leaves point at themselves)."""

    def __init__(self, forest) -> None:
        trees = [est.tree_ for est in forest.estimators_]
        sizes = np.array([t.node_count for t in trees])
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        left, right, feat, thr, val = [], [], [], [], []
        for off, t in zip(offsets, trees):
            ids = np.arange(t.node_count) + off
            leaf = t.children_left < 0
            left.append(np.where(leaf, ids, t.children_left + off))
            right.append(np.where(leaf, ids, t.children_right + off))
            feat.append(np.where(leaf, 0, t.feature))
            thr.append(np.where(leaf, np.inf, t.threshold))
            val.append(t.value[:, 0, 0])
        self.left = np.concatenate(left).astype(np.intp)
        self.right = np.concatenate(right).astype(np.intp)
        self.feature = np.concatenate(feat).astype(np.intp)
        self.threshold = np.concatenate(thr).astype(np.float64)
        self.value = np.concatenate(val).astype(np.float64)
        self.roots = offsets.astype(np.intp)
        self.depth = max(int(t.max_depth) for t in trees)
        self.n_features = int(forest.n_features_in_)

    def per_tree(self, X: np.ndarray) -> np.ndarray:
        """(trees x rows) leaf values for the rows of X."""
        X = np.asarray(X, dtype=np.float32).astype(np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"X has shape {X.shape}; the forest was fitted on {self.n_features} features")
        n = X.shape[0]
        node = np.repeat(self.roots[:, None], n, axis=1)  # (trees, rows)
        rows = np.arange(n)[None, :]
        for _ in range(self.depth):
            go_left = X[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return self.value[node]


def per_tree_predictions(forest, X: np.ndarray) -> np.ndarray:
    """(trees x rows) predictions of a fitted sklearn forest (regression, one output)."""
    X = np.asarray(X)
    if X.shape[0] <= SMALL_BATCH:
        flat = getattr(forest, "_qf_flat", None)
        if flat is None:
            flat = forest._qf_flat = FlatForest(forest)
        return flat.per_tree(X)
    leaves = forest.apply(X.astype(np.float32))  # one `apply` and leaf-value look-ups
    vals = getattr(forest, "_qf_leaf_values", None)
    if vals is None:
        vals = forest._qf_leaf_values = [t.tree_.value[:, 0, 0] for t in forest.estimators_]
    return np.stack([v[leaves[:, k]] for k, v in enumerate(vals)])


def flatten(forest):
    """Build the flat form right after a fit (a few ms), so the first small prediction is fast too."""
    forest._qf_flat = FlatForest(forest)
    return forest
