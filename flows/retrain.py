"""A real multi-stage retraining pipeline on scikit-learn's digits dataset.

    load data -> featurize -> train candidates in parallel (GPU-shaped stages) -> evaluate -> register the best

The candidates are small neural nets: a softmax regression trained with explicit mini-batch gradient
accumulation (numpy; it honours a sub-batch plan from `qosflow.placement()` exactly: the optimizer
sees the same global batch) and scikit-learn MLPs (their mini-batch size follows the sub-batch plan).
`train_torch` uses PyTorch and CUDA when they are installed (optional). Every stage reports its
progress (`qosflow.report_progress`), which the worker compares with its prediction.

Run locally without any worker:   python -m flows.retrain
Through the qosflow pool:         QOSFLOW_POOL=gpu python -m flows.retrain
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np

import qosflow
from qosflow.prefect.tasks import qos_flow, qos_task

GLOBAL_BATCH = 64


def _threads() -> int:
    n = qosflow.placement().threads
    os.environ["OMP_NUM_THREADS"] = str(n)
    return n


@qos_task(gpus=0, cpu_cores=1, expected_duration=8, priority="normal", retries=1, retry_delay_seconds=1)
def load_data(seed: int = 0) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return {"X": d.data.astype(np.float32), "y": d.target.astype(np.int64), "seed": seed}


@qos_task(gpus=0, cpu_cores=1, expected_duration=8)
def featurize(data: dict[str, Any]) -> dict[str, Any]:
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    Xtr, Xte, ytr, yte = train_test_split(data["X"], data["y"], test_size=0.25, random_state=data["seed"], stratify=data["y"])
    sc = StandardScaler().fit(Xtr)
    return {"Xtr": sc.transform(Xtr).astype(np.float32), "Xte": sc.transform(Xte).astype(np.float32), "ytr": ytr, "yte": yte, "scaler": sc}


@qos_task(gpus=1, cpu_cores=1, gpu_mem_mb=2048, shareable=True, expected_duration=9, batch_size=GLOBAL_BATCH, retries=1)
def train_softmax(feats: dict[str, Any], epochs: int = 30, lr: float = 0.5) -> dict[str, Any]:
    """Softmax regression with mini-batch SGD; each optimizer step accumulates the gradients of the
    sub-batches of the placement's plan, so a shared GPU changes memory use, not the result."""
    _threads()
    p = qosflow.placement()
    X, y = feats["Xtr"], feats["ytr"]
    n, d = X.shape
    k = int(y.max()) + 1
    rng = np.random.default_rng(0)
    W = np.zeros((d, k), dtype=np.float64)
    b = np.zeros(k)
    Y = np.eye(k)[y]
    steps_per_epoch = -(-n // GLOBAL_BATCH)
    total = epochs * steps_per_epoch
    step = 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(steps_per_epoch):
            idx = order[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
            gW = np.zeros_like(W)
            gb = np.zeros_like(b)
            off = 0
            for m in p.micro_batches(len(idx)):  # gradient accumulation over the sub-batches
                mi = idx[off : off + m]
                off += m
                z = X[mi] @ W + b
                z -= z.max(axis=1, keepdims=True)
                pr = np.exp(z)
                pr /= pr.sum(axis=1, keepdims=True)
                err = pr - Y[mi]
                gW += X[mi].T @ err
                gb += err.sum(axis=0)
            W -= lr * gW / len(idx)
            b -= lr * gb / len(idx)
            step += 1
            if step % 10 == 0 or step == total:
                qosflow.report_progress(step, total)
    return {"kind": "softmax", "W": W, "b": b, "sub_batch": p.sub_batch, "node": p.node, "gpus": list(p.gpus)}


@qos_task(gpus=1, cpu_cores=1, gpu_mem_mb=4096, shareable=True, expected_duration=12, batch_size=GLOBAL_BATCH, retries=1)
def train_mlp(feats: dict[str, Any], hidden: int = 64, epochs: int = 25) -> dict[str, Any]:
    """A scikit-learn MLP trained epoch by epoch (partial_fit), mini-batches sized by the placement."""
    _threads()
    from sklearn.neural_network import MLPClassifier

    p = qosflow.placement()
    X, y = feats["Xtr"], feats["ytr"]
    clf = MLPClassifier(hidden_layer_sizes=(hidden,), batch_size=p.sub_batch_size(GLOBAL_BATCH), learning_rate_init=1e-3, random_state=0)
    classes = np.unique(y)
    for e in range(epochs):
        clf.partial_fit(X, y, classes=classes)
        qosflow.report_progress(e + 1, epochs)
    return {"kind": f"mlp{hidden}", "model": clf, "sub_batch": p.sub_batch, "node": p.node, "gpus": list(p.gpus)}


@qos_task(gpus=1, cpu_cores=1, gpu_mem_mb=4096, expected_duration=15)
def train_torch(feats: dict[str, Any], epochs: int = 20) -> dict[str, Any]:  # pragma: no cover - optional
    """Optional PyTorch candidate: uses CUDA when present, the CPU otherwise."""
    import torch

    _threads()
    p = qosflow.placement()
    dev = "cuda" if torch.cuda.is_available() and not p.virtual_gpus else "cpu"
    X = torch.tensor(feats["Xtr"], device=dev)
    y = torch.tensor(feats["ytr"], device=dev)
    model = torch.nn.Sequential(torch.nn.Linear(X.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    acc = p.accumulation_steps
    for e in range(epochs):
        perm = torch.randperm(len(X), device=dev)
        for s in range(0, len(X), GLOBAL_BATCH):
            idx = perm[s : s + GLOBAL_BATCH]
            opt.zero_grad()
            for chunk in idx.chunk(acc):
                loss = torch.nn.functional.cross_entropy(model(X[chunk]), y[chunk]) * len(chunk) / len(idx)
                loss.backward()
            opt.step()
        qosflow.report_progress(e + 1, epochs)
    return {"kind": "torch", "model": model.cpu(), "device": dev}


def _predict(m: dict[str, Any], X: np.ndarray) -> np.ndarray:
    if m["kind"] == "softmax":
        return np.argmax(X @ m["W"] + m["b"], axis=1)
    if m["kind"] == "torch":  # pragma: no cover - optional
        import torch

        with torch.no_grad():
            return m["model"](torch.tensor(X)).argmax(1).numpy()
    return m["model"].predict(X)


@qos_task(gpus=0, cpu_cores=1, expected_duration=7)
def evaluate(feats: dict[str, Any], models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in models:
        acc = float((_predict(m, feats["Xte"]) == feats["yte"]).mean())
        out.append({"kind": m["kind"], "accuracy": acc, "model": m})
    return sorted(out, key=lambda r: -r["accuracy"])


@qos_task(gpus=0, cpu_cores=1, expected_duration=6)
def register(ranked: list[dict[str, Any]], name: str = "digits") -> dict[str, Any]:
    from qosflow.paths import data_dir

    best = ranked[0]
    reg = Path(os.environ.get("QOSFLOW_REGISTRY") or data_dir() / "registry") / name
    reg.mkdir(parents=True, exist_ok=True)
    version = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    path = reg / f"{version}.pkl"
    with open(path, "wb") as fh:
        pickle.dump(best["model"], fh)
    return {"name": name, "version": version, "path": str(path), "kind": best["kind"], "accuracy": round(best["accuracy"], 4),
            "candidates": {r["kind"]: round(r["accuracy"], 4) for r in ranked}}


PLAN = {
    "load_data": [],
    "featurize": ["load_data"],
    "train_softmax": ["featurize"],
    "train_mlp": ["featurize"],
    "evaluate": ["featurize", "train_softmax", "train_mlp"],
    "register": ["evaluate"],
}


@qos_flow(name="retrain", plan=PLAN, log_prints=True)
def retrain(name: str = "digits", hidden: int = 64, seed: int = 0, qos_deadline: float | str | None = None, qos_priority: str | None = None) -> dict[str, Any]:
    data = load_data.submit(seed)
    feats = featurize.submit(data)
    a = train_softmax.submit(feats)
    b = train_mlp.submit(feats, hidden=hidden)
    ranked = evaluate.submit(feats, [a, b])
    info = register.submit(ranked, name=name).result()
    print(f"registered {info['kind']} for {name}: accuracy {info['accuracy']:.3f} ({info['candidates']})")
    return info


if __name__ == "__main__":
    print(retrain())
