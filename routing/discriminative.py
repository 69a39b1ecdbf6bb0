"""The discriminative router (DiPaCo §2.4.2): a multinomial logistic regression from prefix features to
the path under which a document has the lowest loss, with a bias that keeps the path distribution on
target (no path collapses).

It reads the same input as every router (the decoded token prefix, ``PrefixInput``) through a feature
pipeline (usually the one of the router it replaces) and stores its weights as .npy files;
``Router.load`` reads it. Three uses: discriminative re-sharding (labels = lowest-loss path), the
router fitted on prefixes to document-level k-means clusters (``routing.cluster_on = "document"``),
and the window router of every-W routing (labels = lowest loss on the next W tokens).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.model.grid import format_grid, parse_grid
from dipaco.routing.base import BaseRouter
from dipaco.routing.features import load_features
from dipaco.routing.kmeans import row_dot
from dipaco.routing.prefix import PrefixInput


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class DiscriminativeRouter(BaseRouter):
    kind = "discriminative"

    def __init__(self, features, shape: tuple[int, ...], coef: np.ndarray, intercept: np.ndarray, input: PrefixInput,
                 info: dict | None = None):
        self.features, self.shape, self.input = features, shape, input
        self.coef = np.asarray(coef, dtype=np.float32)            # (P, d)
        self.intercept = np.asarray(intercept, dtype=np.float32)  # (P,)
        self.info = info or {}

    def logits(self, x: np.ndarray) -> np.ndarray:
        return (row_dot(x, self.coef) + self.intercept[None, :]).astype(np.float32)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return _softmax(self.logits(x).astype(np.float64))

    def path_distances(self, x: np.ndarray) -> np.ndarray:
        """Negative logits: lower is nearer, so routing is the most probable path."""
        return -self.logits(x)

    def describe(self) -> dict:
        return {"kind": self.kind, "grid": format_grid(self.shape), "input": self.input.describe(),
                "features": self.features.describe(), **self.info}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.input.save(directory / "input")
        self.features.save(directory / "features")
        np.save(directory / "coef.npy", self.coef)
        np.save(directory / "intercept.npy", self.intercept)
        (directory / "router.json").write_text(json.dumps(self.describe(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "DiscriminativeRouter":
        directory = Path(directory)
        try:
            spec = json.loads((directory / "router.json").read_text())
            shape = parse_grid(spec["grid"])
            coef = np.load(directory / "coef.npy", allow_pickle=False)
            intercept = np.load(directory / "intercept.npy", allow_pickle=False)
        except (OSError, ValueError, KeyError) as exc:
            raise DipacoError(f"discriminative router in {directory} is incomplete or damaged ({exc}); "
                              f"re-run `dipaco reshard`") from None
        info = {k: v for k, v in spec.items() if k not in ("kind", "grid", "features", "input")}
        return DiscriminativeRouter(load_features(directory / "features"), shape, coef, intercept,
                                    PrefixInput.load(directory / "input"), info)


def match_bias(logits: np.ndarray, target: np.ndarray, iters: int = 500, tol: float = 1e-4) -> np.ndarray:
    """Offsets b such that the mean softmax(logits + b) over these rows equals ``target`` (a distribution).

    Fixed point b <- b + log(target) - log(mean probability): the classic prior-shift correction.
    """
    target = np.asarray(target, dtype=np.float64)
    target = target / target.sum()
    b = np.zeros(logits.shape[1])
    for _ in range(iters):
        mean = _softmax(logits + b).mean(axis=0)
        step = np.log(np.maximum(target, 1e-12)) - np.log(np.maximum(mean, 1e-12))
        b += step
        if np.abs(mean - target).max() < tol:
            break
    return b - b.mean()


def _multinomial(x: np.ndarray, labels: np.ndarray, P: int, seed: int, C: float) -> tuple[np.ndarray, np.ndarray, int]:
    """(coef (P, d), intercept (P,), classes seen) of a multinomial logistic regression; paths no example
    preferred start far below the others (a bias lifts them to their target share)."""
    from sklearn.linear_model import LogisticRegression

    present = np.unique(labels)
    coef, intercept = np.zeros((P, x.shape[1])), np.zeros(P)
    if len(present) >= 2:
        clf = LogisticRegression(C=C, max_iter=2000, random_state=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on tiny samples
            clf.fit(x, labels)
        if len(present) == 2:  # binary: sklearn keeps one row; the softmax form is (-w/2, +w/2)
            coef[present[0]], coef[present[1]] = -clf.coef_[0] / 2, clf.coef_[0] / 2
            intercept[present[0]], intercept[present[1]] = -clf.intercept_[0] / 2, clf.intercept_[0] / 2
        else:
            coef[present], intercept[present] = clf.coef_, clf.intercept_
    absent = np.setdiff1d(np.arange(P), present)
    if len(absent):
        intercept[absent] = intercept[present].min() - 5.0
    return coef, intercept, len(present)


def fit_discriminative(features, x: np.ndarray, labels: np.ndarray, shape: tuple[int, ...], target: np.ndarray,
                       input: PrefixInput, seed: int = 0, C: float = 1.0) -> DiscriminativeRouter:
    """Multinomial logistic regression on (x, labels: path indices), intercept shifted to ``target`` shares."""
    P = int(np.prod(shape))
    x, labels = np.asarray(x, dtype=np.float64), np.asarray(labels, dtype=np.int64)
    coef, intercept, seen = _multinomial(x, labels, P, seed, C)
    bias = match_bias(x @ coef.T + intercept, target)
    info = {"classes_seen": seen, "fit_documents": int(len(labels)), "C": C,
            "target": [round(float(t), 6) for t in np.asarray(target) / np.sum(target)]}
    return DiscriminativeRouter(features, shape, coef, intercept + bias, input, info)


class WindowRouter(DiscriminativeRouter):
    """The router of every-W routing: a multinomial logistic regression on the features of the previous W
    tokens *and* the document's path (one-hot), so that it can learn when leaving the document's path pays.
    (On the shared corpus, a router on the window alone chose worse than staying on the document's path;
    see ``dipaco.eval.window_router``.) ``route_windows(windows, document_paths)`` routes."""

    kind = "window"

    def __init__(self, features, shape, coef, intercept, input: PrefixInput, anchor_coef: np.ndarray, info: dict | None = None):
        super().__init__(features, shape, coef, intercept, input, info)
        self.anchor_coef = np.asarray(anchor_coef, dtype=np.float32)  # (P, P): logit of path p when the document is on q

    def window_logits(self, x: np.ndarray, anchors: np.ndarray) -> np.ndarray:
        return self.logits(x) + self.anchor_coef[:, np.asarray(anchors, dtype=np.int64)].T

    def route_windows(self, windows, document_paths: list[str]) -> list[str]:
        """The path of every window (token ids, the router reads the first ``input.tokens``), given the path of
        its document."""
        if not len(windows):
            return []
        paths = self.paths
        x = self.features.transform(self.input.texts_of_ids(windows))
        anchors = [paths.index(p) for p in document_paths]
        return [paths[j] for j in self.window_logits(x, anchors).argmax(axis=1).tolist()]

    def save(self, directory: str | Path) -> None:
        super().save(directory)
        np.save(Path(directory) / "anchor_coef.npy", self.anchor_coef)

    @classmethod
    def load(cls, directory: str | Path) -> "WindowRouter":
        base = DiscriminativeRouter.load(directory)
        try:
            anchor = np.load(Path(directory) / "anchor_coef.npy", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DipacoError(f"window router in {directory} is incomplete or damaged ({exc}); "
                              f"re-run `dipaco fit-window-router`") from None
        return cls(base.features, base.shape, base.coef, base.intercept, base.input, anchor, base.info)


def fit_window(features, x: np.ndarray, anchors: np.ndarray, labels: np.ndarray, shape: tuple[int, ...],
               target: np.ndarray, input: PrefixInput, seed: int = 0, C: float = 1.0) -> WindowRouter:
    """Logistic regression on [features of the window, one-hot of the document's path] -> lowest-loss path,
    intercept shifted to ``target`` shares."""
    P = int(np.prod(shape))
    x, labels, anchors = np.asarray(x, dtype=np.float64), np.asarray(labels, dtype=np.int64), np.asarray(anchors, dtype=np.int64)
    coef, intercept, seen = _multinomial(np.hstack([x, np.eye(P)[anchors]]), labels, P, seed, C)
    coef, anchor_coef = coef[:, : x.shape[1]], coef[:, x.shape[1]:]
    bias = match_bias(x @ coef.T + anchor_coef[:, anchors].T + intercept, target)
    info = {"classes_seen": seen, "fit_windows": int(len(labels)), "C": C,
            "target": [round(float(t), 6) for t in np.asarray(target) / np.sum(target)]}
    return WindowRouter(features, shape, coef, intercept + bias, input, anchor_coef, info)
