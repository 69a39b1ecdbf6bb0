"""The offline router: prefix features + (product) k-means, frozen in a directory.

For grid (K_1, ..., K_L) the feature vector is split into L slices and each slice gets its own
k-means with K_l centroids; a document's path is the tuple of its nearest centroid per level
(product k-means, DiPaCo §2.4). A flat grid (K,) is plain k-means.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.grid import format_grid, parse_grid
from dipaco.routing.features import TfidfFeatures, load_features
from dipaco.routing.kmeans import balanced_assignment, fit_kmeans, split_dims, squared_distances


class Router:
    def __init__(self, features, shape: tuple[int, ...], centroids: list[np.ndarray], dims: list[np.ndarray], split: str):
        self.features, self.shape, self.centroids, self.dims, self.split = features, shape, centroids, dims, split

    @classmethod
    def fit(cls, texts: list[str], grid: str, features: str = "tfidf", prefix_chars: int = 2048,
            max_tfidf_features: int = 50_000, svd_dims: int = 64, kmeans_iters: int = 25,
            product_split: str = "interleaved", seed: int = 0) -> "Router":
        shape = parse_grid(grid)
        if features != "tfidf":
            raise DipacoError(f"routing features {features!r} are not supported yet; use 'tfidf'")
        feats = TfidfFeatures(prefix_chars, max_tfidf_features, svd_dims, seed).fit(texts)
        x = feats.transform(texts)
        dims = split_dims(x.shape[1], len(shape), product_split)
        centroids = [fit_kmeans(x[:, d], k, kmeans_iters, seed + level) for level, (d, k) in enumerate(zip(dims, shape))]
        return cls(feats, shape, centroids, dims, product_split)

    # ---------------------------------------------------------------- routing
    @property
    def paths(self) -> list[str]:
        return ["-".join(map(str, c)) for c in itertools.product(*(range(k) for k in self.shape))]

    def level_distances(self, x: np.ndarray) -> list[np.ndarray]:
        return [squared_distances(x[:, d], c) for d, c in zip(self.dims, self.centroids)]

    def assign_features(self, x: np.ndarray) -> list[str]:
        nearest = np.stack([d.argmin(axis=1) for d in self.level_distances(x)], axis=1)
        return ["-".join(map(str, row)) for row in nearest.tolist()]

    def route(self, texts: list[str]) -> list[str]:
        """Path id of every text (by its prefix)."""
        texts = _check_texts(texts)
        return self.assign_features(self.features.transform(texts)) if texts else []

    def path_distances(self, x: np.ndarray) -> np.ndarray:
        """(n, P) squared distance of each document to every path (sum over levels), columns in ``paths`` order."""
        total = np.zeros((len(x), 1), dtype=np.float32)
        for d in self.level_distances(x):
            total = (total[:, :, None] + d[:, None, :]).reshape(len(x), -1)
        return total

    def assign(self, texts: list[str], balance: float = 0.0) -> list[str]:
        """Shard-time assignment: nearest path, or with ``balance`` F > 0 no path above F x the mean share."""
        texts = _check_texts(texts)
        if not texts:
            return []
        x = self.features.transform(texts)
        if balance <= 0:
            return self.assign_features(x)
        paths = self.paths
        return [paths[j] for j in balanced_assignment(self.path_distances(x), balance).tolist()]

    def route_topk(self, texts: list[str], k: int) -> list[list[tuple[str, float]]]:
        """The k nearest paths of every text with their squared distances, nearest first."""
        texts = _check_texts(texts)
        if not texts:
            return []
        d = self.path_distances(self.features.transform(texts))
        k = max(1, min(k, d.shape[1]))
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        paths = self.paths
        return [[(paths[j], float(d[i, j])) for j in row] for i, row in enumerate(order.tolist())]

    # ------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.features.save(directory / "features")
        for level, (c, d) in enumerate(zip(self.centroids, self.dims)):
            np.save(directory / f"centroids_L{level}.npy", c)
            np.save(directory / f"dims_L{level}.npy", d.astype(np.int64))
        (directory / "router.json").write_text(json.dumps(
            {"kind": "kmeans", "grid": format_grid(self.shape), "product_split": self.split,
             "features": self.features.describe()}, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "Router":
        directory = Path(directory)
        spec_file = directory / "router.json"
        if not spec_file.is_file():
            raise DipacoError(f"{spec_file} is missing; pass a router directory written by `dipaco shard` (SHARDS/router)")
        try:
            spec = json.loads(spec_file.read_text())
            shape = parse_grid(spec["grid"])
            centroids = [np.load(directory / f"centroids_L{l}.npy", allow_pickle=False) for l in range(len(shape))]
            dims = [np.load(directory / f"dims_L{l}.npy", allow_pickle=False) for l in range(len(shape))]
        except (OSError, ValueError, KeyError) as exc:
            raise DipacoError(f"router in {directory} is incomplete or damaged ({exc}); re-run `dipaco shard`") from None
        return cls(load_features(directory / "features"), shape, centroids, dims, spec.get("product_split", "contiguous"))


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise DipacoError("Router.route takes a list of texts, not a single string; wrap it: route([text])")
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise DipacoError(f"Router.route needs strings; item {bad[0]} is {type(texts[bad[0]]).__name__}")
    return texts
