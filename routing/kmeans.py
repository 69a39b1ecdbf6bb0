"""k-means with faiss: flat and product (one k-means per slice of the feature vector)."""

from __future__ import annotations

import faiss
import numpy as np

from dipaco.errors import DipacoError


def fit_kmeans(x: np.ndarray, k: int, iters: int = 25, seed: int = 0, spherical: bool = False,
               restarts: int = 1) -> np.ndarray:
    """Centroids (k, d) fitted on every row of ``x`` (callers pass a sample); with ``restarts`` > 1 the
    best of that many seeded runs (lowest objective) is kept."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if len(x) < k:
        raise DipacoError(f"{len(x)} documents cannot fill {k} clusters; use a smaller grid or more documents")
    if k == 1:
        return x.mean(axis=0, keepdims=True)
    km = faiss.Kmeans(x.shape[1], k, niter=iters, seed=seed, spherical=spherical, verbose=False, nredo=max(1, restarts),
                      min_points_per_centroid=1, max_points_per_centroid=max(1, len(x) // k + 1))
    km.train(x)
    return np.ascontiguousarray(km.centroids, dtype=np.float32)


def row_dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` in float64, each entry summed over the columns in one fixed order, so that a row's result
    has the same bits however the rows are batched and on any number of threads (a BLAS picks its kernel
    and its split by the matrix shape and the thread count, and a near tie would then flip a path)."""
    x, w = np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64)
    out = np.zeros((x.shape[0], w.shape[0]))
    for j in range(x.shape[1]):
        out += np.multiply.outer(x[:, j], w[:, j])
    return out


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(n, k) squared L2 distances (float32), each row's bits independent of the batch (``row_dot``)."""
    x = np.asarray(x, dtype=np.float64)
    c = np.asarray(centroids, dtype=np.float64)
    ones = np.ones((1, x.shape[1]))
    d = row_dot(x * x, ones) - 2.0 * row_dot(x, c) + row_dot(ones, c * c)
    return np.maximum(d, 0.0).astype(np.float32)


def split_dims(dims: int, levels: int, mode: str = "interleaved") -> list[np.ndarray]:
    """Which feature dimensions each level's k-means sees.

    'contiguous' splits the vector into consecutive parts (the paper's halves); 'interleaved' gives
    dimension d to level d mod L, so that with SVD features (sorted by variance) every level gets a
    share of the strong directions.
    """
    if dims < levels:
        raise DipacoError(f"{dims} feature dimensions cannot be split over {levels} levels; raise routing.svd_dims")
    if mode == "interleaved":
        return [np.arange(l, dims, levels) for l in range(levels)]
    return [part for part in np.array_split(np.arange(dims), levels)]


def balanced_assignment(distances: np.ndarray, capacity_factor: float) -> np.ndarray:
    """Nearest-centroid assignment where no cluster takes more than ``capacity_factor`` x the mean share.

    Greedy over (document, cluster) pairs in order of distance: each document goes to the nearest
    cluster that still has room, so overflow spills to the next-nearest cluster. Deterministic.
    """
    n, k = distances.shape
    capacity = int(np.ceil(capacity_factor * n / k))
    if capacity_factor <= 0 or capacity * k < n:
        raise DipacoError(f"balance factor {capacity_factor} leaves room for only {capacity * k} of {n} documents; use >= 1.0")
    order = np.argsort(distances, axis=None, kind="stable")
    assignment = np.full(n, -1, dtype=np.int64)
    load = np.zeros(k, dtype=np.int64)
    remaining = n
    for flat in order:
        doc, cluster = divmod(int(flat), k)
        if assignment[doc] < 0 and load[cluster] < capacity:
            assignment[doc] = cluster
            load[cluster] += 1
            remaining -= 1
            if remaining == 0:
                break
    return assignment


def calibrate_bias(distances: np.ndarray, capacity_factor: float, iters: int = 5000) -> np.ndarray:
    """Per-cluster offsets b such that argmin(distances + b) puts no cluster above ``capacity_factor`` x the
    mean share of these rows (a sample); the documents nearest a boundary move first.

    Each step raises the offset of every overloaded cluster just enough to push its excess, and 1% of the
    capacity more, to the members' next-best clusters (an auction-like fixed point; the slack makes it
    settle in tens of steps instead of thousands, and leaves the cap some room for the sampling error of
    new documents). Deterministic. Applied to new documents, the offsets keep the expected shares under
    the cap without seeing the whole corpus.
    """
    d = np.asarray(distances, dtype=np.float64)
    n, k = d.shape
    bias = np.zeros(k)
    if capacity_factor <= 0 or k == 1 or n == 0:
        return bias.astype(np.float32)
    capacity = int(np.floor(capacity_factor * n / k))
    if capacity * k < n:
        capacity = int(np.ceil(n / k))
    slack = max(1, int(np.ceil(0.01 * capacity)))
    for _ in range(iters):
        biased = d + bias
        a = biased.argmin(axis=1)
        over = np.bincount(a, minlength=k) - capacity
        if (over <= 0).all():
            break
        for c in np.flatnonzero(over > 0).tolist():
            members = np.flatnonzero(a == c)
            others = biased[members].copy()
            others[:, c] = np.inf
            margin = others.min(axis=1) - biased[members, c]
            excess = min(len(members), int(over[c]) + slack)
            step = np.partition(margin, excess - 1)[excess - 1]
            # past the boundary by more than float32 rounding (routing adds the offsets in float32)
            bias[c] += step + 1e-4 * (1.0 + abs(step))
    return bias.astype(np.float32)
