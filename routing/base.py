"""What every router kind shares (``BaseRouter``): routing a document by the first ``routing.prefix_tokens``
tokens of it, decoded, to its nearest path; top-k; in-memory assignment. The kinds live in ``router.py``
(k-means, random) and ``discriminative.py`` (discriminative, window)."""

from __future__ import annotations

import itertools

import numpy as np

from dipaco.errors import DipacoError
from dipaco.routing.kmeans import balanced_assignment
from dipaco.routing.prefix import PrefixInput


class BaseRouter:
    """What every router kind shares: its input (the decoded token prefix, ``PrefixInput``), path ids,
    routing by nearest path, top-k, assignment. A kind defines ``text_distances`` (or, with features,
    ``path_distances``)."""

    kind = "base"
    features = None
    input: PrefixInput
    shape: tuple[int, ...] = (1,)

    def path_distances(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def text_distances(self, texts: list[str]) -> np.ndarray:
        """(n, P) distances (lower is nearer) of routing texts, i.e. texts that already are this router's input."""
        return self.path_distances(self.features.transform(texts))

    def distances_of_ids(self, ids) -> np.ndarray:
        """(n, P) distances of token sequences: the router reads the first ``input.tokens`` of each."""
        if not len(ids):
            return np.zeros((0, len(self.paths)), dtype=np.float32)
        return self.text_distances(self.input.texts_of_ids(ids))

    def distances(self, texts: list[str]) -> np.ndarray:
        return self.distances_of_ids(self.input.first_ids(_check_texts(texts)))

    @property
    def paths(self) -> list[str]:
        return ["-".join(map(str, c)) for c in itertools.product(*(range(k) for k in self.shape))]

    def route_ids(self, ids) -> list[str]:
        """Path id of every token sequence (by its first ``input.tokens`` tokens)."""
        paths = self.paths
        return [paths[j] for j in self.distances_of_ids(ids).argmin(axis=1).tolist()]

    def route(self, texts: list[str]) -> list[str]:
        """Path id of every text (by its first ``input.tokens`` tokens, decoded)."""
        return self.route_ids(self.input.first_ids(_check_texts(texts)))

    def route_topk_ids(self, ids, k: int) -> list[list[tuple[str, float]]]:
        """The k nearest paths of every token sequence with their distances (lower = nearer), nearest first."""
        d = self.distances_of_ids(ids)
        k = max(1, min(k, d.shape[1]))
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        paths = self.paths
        return [[(paths[j], float(d[i, j])) for j in row] for i, row in enumerate(order.tolist())]

    def route_topk(self, texts: list[str], k: int) -> list[list[tuple[str, float]]]:
        return self.route_topk_ids(self.input.first_ids(_check_texts(texts)), k)

    def assign(self, texts: list[str], balance: float = 0.0, overlap: int = 1) -> list[str] | list[list[str]]:
        """In-memory assignment: nearest path, or with ``balance`` F > 0 no path above F x the mean share
        (greedy, nearest pairs first). With ``overlap`` n > 1 every text gets a list: its assigned path,
        then its next-nearest paths, n in all."""
        texts = _check_texts(texts)
        if not texts:
            return []
        d = self.distances(texts)
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


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise DipacoError("Router.route takes a list of texts, not a single string; wrap it: route([text])")
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise DipacoError(f"Router.route needs strings; item {bad[0]} is {type(texts[bad[0]]).__name__}")
    return texts
