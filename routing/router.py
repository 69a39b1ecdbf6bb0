"""The offline router: prefix features + (product) k-means, frozen in a directory.

Every router reads one input, the first ``routing.prefix_tokens`` (32) tokens of a document decoded
(``dipaco.routing.prefix``), and keeps its own copy of the tokenizer for that: what decides a
document's path when it is sharded decides it when it is scored, generated or re-routed.

For grid (K_1, ..., K_L) the feature vector is split into L slices and each slice gets its own
k-means with K_l centroids; a document's path is the tuple of its nearest centroid per level
(product k-means, DiPaCo §2.4). A flat grid (K,) is plain k-means.

Every router kind (``kmeans`` here, ``random`` (``HashRouter``, the i.i.d. control), and
``discriminative`` in ``dipaco.routing.discriminative``) scores a document against every path (lower
is nearer) and routes to the nearest path; ``Router.load(dir)`` reads any kind, so
``Router.load(dir).route(texts)`` works the same for all. ``dipaco.routing.fit.fit_router`` builds them.

With ``balance`` the router also keeps a per-path offset (``bias``), calibrated on the fitting sample so
that no path takes more than F x the mean share; it is added to the distances whenever the router
routes, so evaluation routes documents the way the shards were built.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.model.grid import format_grid, parse_grid
from dipaco.routing.features import load_features
from dipaco.routing.kmeans import calibrate_bias, fit_kmeans, split_dims, squared_distances
from dipaco.routing.prefix import PrefixInput
# BaseRouter lives in its own module so that the router kinds in discriminative.py can subclass it while
# Router.load (here) dispatches to them, without an import circle; the names stay importable from here
from dipaco.routing.base import BaseRouter, _check_texts, top_paths  # noqa: F401


class HashRouter(BaseRouter):
    """The i.i.d. control (``dipaco shard --assign random``): a seeded hash of the routing text picks a
    uniform path, so shards are i.i.d. and eval still routes a document the way it was sharded."""

    kind = "random"

    def __init__(self, shape: tuple[int, ...], input: PrefixInput, seed: int = 0):
        self.shape, self.input, self.seed = tuple(shape), input, int(seed)

    def text_distances(self, texts: list[str]) -> np.ndarray:
        n, P = len(texts), len(self.paths)
        d = np.ones((n, P), dtype=np.float32)
        for i, t in enumerate(texts):
            h = hashlib.blake2b(f"{self.seed}\0{t}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
            d[i, int.from_bytes(h, "little") % P] = 0.0
        return d

    def describe(self) -> dict:
        return {"kind": self.kind, "grid": format_grid(self.shape), "seed": self.seed, "input": self.input.describe(),
                "rule": "path = blake2b(seed, routing text) mod P"}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.input.save(directory / "input")
        (directory / "router.json").write_text(json.dumps(self.describe(), indent=2))


class Router(BaseRouter):
    kind = "kmeans"

    def __init__(self, features, shape: tuple[int, ...], centroids: list[np.ndarray], dims: list[np.ndarray], split: str,
                 input: PrefixInput, spherical: bool = False, bias: np.ndarray | None = None):
        self.features, self.shape, self.centroids, self.dims, self.split = features, shape, centroids, dims, split
        self.input, self.spherical = input, spherical
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)

    @classmethod
    def fit_features(cls, feats, x: np.ndarray, shape: tuple[int, ...], input: PrefixInput, kmeans_iters: int = 25,
                     product_split: str = "interleaved", seed: int = 0, spherical: bool = True,
                     balance: float = 0.0, kmeans_restarts: int = 1) -> "Router":
        """(Product) k-means on the feature rows ``x``; with ``balance`` calibrate the path offsets on them."""
        dims = split_dims(x.shape[1], len(shape), product_split)
        centroids = [fit_kmeans(x[:, d], k, kmeans_iters, seed + level, spherical, kmeans_restarts)
                     for level, (d, k) in enumerate(zip(dims, shape))]
        router = cls(feats, shape, centroids, dims, product_split, input, spherical)
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
                "spherical": self.spherical, "balanced": self.bias is not None, "input": self.input.describe(),
                "features": self.features.describe()}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.input.save(directory / "input")
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
        if kind in ("discriminative", "window"):
            from dipaco.routing.discriminative import DiscriminativeRouter, WindowRouter

            return (WindowRouter if kind == "window" else DiscriminativeRouter).load(directory)
        if kind == "random":
            return HashRouter(parse_grid(spec["grid"]), PrefixInput.load(directory / "input"), int(spec["seed"]))
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
                   PrefixInput.load(directory / "input"), spec.get("spherical", False), bias)
