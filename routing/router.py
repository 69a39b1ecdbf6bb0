"""The offline router: prefix features + (product) k-means, frozen in a directory.

For grid (K_1, ..., K_L) the feature vector is split into L slices and each slice gets its own
k-means with K_l centroids; a document's path is the tuple of its nearest centroid per level
(product k-means, DiPaCo §2.4). A flat grid (K,) is plain k-means.

Every router kind (``kmeans`` here, ``discriminative`` in ``dipaco.routing.discriminative``) scores a
document against every path with ``path_distances`` (lower is nearer) and routes to the nearest path;
``Router.load(dir)`` reads either kind, so ``Router.load(dir).route(texts)`` works the same for all.

With ``balance`` the router also keeps a per-path offset (``bias``), calibrated on the fitting sample so
that no path takes more than F x the mean share; it is added to the distances whenever the router
routes, so evaluation routes documents the way the shards were built.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.grid import format_grid, parse_grid
from dipaco.routing.features import load_features, make_features
from dipaco.routing.kmeans import balanced_assignment, calibrate_bias, fit_kmeans, split_dims, squared_distances


class BaseRouter:
    """What every router kind shares: path ids, routing by nearest path, top-k, assignment."""

    kind = "base"
    features = None
    shape: tuple[int, ...] = (1,)

    def path_distances(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def paths(self) -> list[str]:
        return ["-".join(map(str, c)) for c in itertools.product(*(range(k) for k in self.shape))]

    def assign_features(self, x: np.ndarray) -> list[str]:
        paths = self.paths
        return [paths[j] for j in self.path_distances(x).argmin(axis=1).tolist()]

    def route(self, texts: list[str]) -> list[str]:
        """Path id of every text (by its prefix)."""
        texts = _check_texts(texts)
        return self.assign_features(self.features.transform(texts)) if texts else []

    def route_topk(self, texts: list[str], k: int) -> list[list[tuple[str, float]]]:
        """The k nearest paths of every text with their distances (lower = nearer), nearest first."""
        texts = _check_texts(texts)
        if not texts:
            return []
        d = self.path_distances(self.features.transform(texts))
        k = max(1, min(k, d.shape[1]))
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        paths = self.paths
        return [[(paths[j], float(d[i, j])) for j in row] for i, row in enumerate(order.tolist())]

    def assign(self, texts: list[str], balance: float = 0.0, overlap: int = 1) -> list[str] | list[list[str]]:
        """In-memory assignment: nearest path, or with ``balance`` F > 0 no path above F x the mean share
        (greedy, nearest pairs first). With ``overlap`` n > 1 every text gets a list: its assigned path,
        then its next-nearest paths, n in all."""
        texts = _check_texts(texts)
        if not texts:
            return []
        d = self.path_distances(self.features.transform(texts))
        primary = balanced_assignment(d, balance) if balance > 0 else d.argmin(axis=1)
        paths = self.paths
        if overlap <= 1:
            return [paths[j] for j in primary.tolist()]
        return [[paths[j] for j in row] for row in top_paths(d, primary, overlap)]


def top_paths(distances: np.ndarray, primary: np.ndarray, n: int) -> list[list[int]]:
    """For each row: its primary path, then the nearest other paths, ``n`` path indices in all."""
    order = np.argsort(distances, axis=1, kind="stable")
    out = []
    for row, p in zip(order.tolist(), np.asarray(primary).tolist()):
        out.append([p] + [j for j in row if j != p][: n - 1])
    return out


class Router(BaseRouter):
    kind = "kmeans"

    def __init__(self, features, shape: tuple[int, ...], centroids: list[np.ndarray], dims: list[np.ndarray], split: str,
                 spherical: bool = False, bias: np.ndarray | None = None):
        self.features, self.shape, self.centroids, self.dims, self.split = features, shape, centroids, dims, split
        self.spherical = spherical
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)

    @classmethod
    def fit(cls, texts: list[str], grid: str, features: str = "tfidf", prefix_chars: int = 1024,
            max_tfidf_features: int = 50_000, svd_dims: int = 64, kmeans_iters: int = 25,
            product_split: str = "interleaved", seed: int = 0, spherical: bool = True, balance: float = 0.0,
            feature_model: str | None = None, prefix_tokens: int = 32, feature_batch_size: int = 32,
            copy_feature_model: bool = True, progress: bool = False, kmeans_restarts: int = 16) -> "Router":
        """Fit features and (product) k-means on ``texts`` (a sample); with ``balance`` calibrate the path offsets."""
        shape = parse_grid(grid)
        texts = _check_texts(texts)
        feats = make_features(features, prefix_chars, max_tfidf_features, svd_dims, seed, feature_model,
                              prefix_tokens, feature_batch_size, copy_feature_model)
        feats.progress = progress
        feats.fit(texts)
        x = feats.transform(texts)
        return cls.fit_features(feats, x, shape, kmeans_iters, product_split, seed, spherical, balance, kmeans_restarts)

    @classmethod
    def fit_features(cls, feats, x: np.ndarray, shape: tuple[int, ...], kmeans_iters: int = 25,
                     product_split: str = "interleaved", seed: int = 0, spherical: bool = True,
                     balance: float = 0.0, kmeans_restarts: int = 1) -> "Router":
        dims = split_dims(x.shape[1], len(shape), product_split)
        centroids = [fit_kmeans(x[:, d], k, kmeans_iters, seed + level, spherical, kmeans_restarts)
                     for level, (d, k) in enumerate(zip(dims, shape))]
        router = cls(feats, shape, centroids, dims, product_split, spherical)
        if balance > 0:
            router.bias = calibrate_bias(router.path_distances(x), balance)
        return router

    # ---------------------------------------------------------------- routing
    def level_distances(self, x: np.ndarray) -> list[np.ndarray]:
        return [squared_distances(x[:, d], c) for d, c in zip(self.dims, self.centroids)]

    def path_distances(self, x: np.ndarray) -> np.ndarray:
        """(n, P) squared distance of each document to every path (sum over levels, plus the balance
        offset of the path if any), columns in ``paths`` order."""
        total = np.zeros((len(x), 1), dtype=np.float32)
        for d in self.level_distances(x):
            total = (total[:, :, None] + d[:, None, :]).reshape(len(x), -1)
        if self.bias is not None:
            total = total + self.bias[None, :]
        return total

    # ------------------------------------------------------------ persistence
    def describe(self) -> dict:
        return {"kind": self.kind, "grid": format_grid(self.shape), "product_split": self.split,
                "spherical": self.spherical, "balanced": self.bias is not None, "features": self.features.describe()}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.features.save(directory / "features")
        for level, (c, d) in enumerate(zip(self.centroids, self.dims)):
            np.save(directory / f"centroids_L{level}.npy", c)
            np.save(directory / f"dims_L{level}.npy", d.astype(np.int64))
        if self.bias is not None:
            np.save(directory / "bias.npy", self.bias)
        (directory / "router.json").write_text(json.dumps(self.describe(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> BaseRouter:
        """Any router kind written by `dipaco shard` or `dipaco reshard`."""
        directory = Path(directory)
        spec_file = directory / "router.json"
        if not spec_file.is_file():
            raise DipacoError(f"{spec_file} is missing; pass a router directory written by `dipaco shard` (SHARDS/router)")
        try:
            spec = json.loads(spec_file.read_text())
        except json.JSONDecodeError as exc:
            raise DipacoError(f"{spec_file} is not valid JSON ({exc}); re-run `dipaco shard`") from None
        kind = spec.get("kind", "kmeans")
        if kind == "discriminative":
            from dipaco.routing.discriminative import DiscriminativeRouter

            return DiscriminativeRouter.load(directory)
        if kind != "kmeans":
            raise DipacoError(f"router kind {kind!r} in {directory} is not supported by this version of dipaco")
        try:
            shape = parse_grid(spec["grid"])
            centroids = [np.load(directory / f"centroids_L{l}.npy", allow_pickle=False) for l in range(len(shape))]
            dims = [np.load(directory / f"dims_L{l}.npy", allow_pickle=False) for l in range(len(shape))]
            bias = np.load(directory / "bias.npy", allow_pickle=False) if (directory / "bias.npy").is_file() else None
        except (OSError, ValueError, KeyError) as exc:
            raise DipacoError(f"router in {directory} is incomplete or damaged ({exc}); re-run `dipaco shard`") from None
        return cls(load_features(directory / "features"), shape, centroids, dims, spec.get("product_split", "contiguous"),
                   spec.get("spherical", False), bias)


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise DipacoError("Router.route takes a list of texts, not a single string; wrap it: route([text])")
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise DipacoError(f"Router.route needs strings; item {bad[0]} is {type(texts[bad[0]]).__name__}")
    return texts
