"""Routing features of a document prefix.

``tfidf`` (c-BTM style): tf-idf over the first ``prefix_chars`` characters (English stop words removed,
digits folded to 0, sublinear tf) -> truncated SVD -> L2 normalisation. Fitted once on a sample and
frozen as plain files (JSON vocabulary, .npy arrays), so loading never unpickles anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from dipaco.errors import DipacoError

_DIGITS = re.compile(r"\d+")


def fold_text(text: str) -> str:
    """Lower-case and fold every number to '0' (c-BTM)."""
    return _DIGITS.sub("0", text.lower())


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


class TfidfFeatures:
    kind = "tfidf"

    def __init__(self, prefix_chars: int = 2048, max_features: int = 50_000, dims: int = 64, seed: int = 0):
        self.prefix_chars, self.max_features, self.dims, self.seed = prefix_chars, max_features, dims, seed
        self.vectorizer: TfidfVectorizer | None = None
        self.components: np.ndarray | None = None  # (dims, vocabulary)

    def _new_vectorizer(self, vocabulary=None) -> TfidfVectorizer:
        return TfidfVectorizer(preprocessor=fold_text, stop_words="english", sublinear_tf=True,
                               max_features=None if vocabulary is not None else self.max_features,
                               vocabulary=vocabulary, dtype=np.float32)

    def _prefixes(self, texts) -> list[str]:
        return [t[: self.prefix_chars] for t in texts]

    def fit(self, texts: list[str]) -> "TfidfFeatures":
        self.vectorizer = self._new_vectorizer()
        try:
            x = self.vectorizer.fit_transform(self._prefixes(texts))
        except ValueError as exc:  # e.g. "empty vocabulary; perhaps the documents only contain stop words"
            raise DipacoError(f"cannot fit tf-idf routing features: {exc}; the corpus needs documents with words") from None
        dims = min(self.dims, x.shape[1] - 1, x.shape[0] - 1)
        if dims < 1:
            raise DipacoError(f"too little text to fit routing features ({x.shape[0]} documents, {x.shape[1]} terms); add documents")
        svd = TruncatedSVD(n_components=dims, random_state=self.seed, algorithm="randomized", n_iter=7)
        svd.fit(x)
        self.components = svd.components_.astype(np.float32)
        self.dims = dims
        return self

    def transform(self, texts: list[str]) -> np.ndarray:
        x = self.vectorizer.transform(self._prefixes(texts))
        return _l2_normalise(np.asarray(x @ self.components.T))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocabulary = {term: int(i) for term, i in sorted(self.vectorizer.vocabulary_.items(), key=lambda kv: kv[1])}
        (directory / "vocabulary.json").write_text(json.dumps(vocabulary, ensure_ascii=False))
        np.save(directory / "idf.npy", self.vectorizer.idf_.astype(np.float32))
        np.save(directory / "svd_components.npy", self.components)
        (directory / "features.json").write_text(json.dumps(self.describe(), indent=2))

    def describe(self) -> dict:
        return {"kind": self.kind, "prefix_chars": self.prefix_chars, "max_features": self.max_features,
                "dims": self.dims, "seed": self.seed, "preprocessing": "lowercase, digits->0, english stop words, sublinear tf"}

    @classmethod
    def load(cls, directory: str | Path) -> "TfidfFeatures":
        directory = Path(directory)
        try:
            spec = json.loads((directory / "features.json").read_text())
            vocabulary = json.loads((directory / "vocabulary.json").read_text(encoding="utf-8"))
            idf = np.load(directory / "idf.npy", allow_pickle=False)
            components = np.load(directory / "svd_components.npy", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DipacoError(f"router features in {directory} are missing or damaged ({exc}); re-run `dipaco shard`") from None
        features = cls(spec["prefix_chars"], spec["max_features"], spec["dims"], spec["seed"])
        features.vectorizer = features._new_vectorizer(vocabulary)
        features.vectorizer.idf_ = idf
        features.components = components
        return features


def load_features(directory: str | Path):
    spec_file = Path(directory) / "features.json"
    if not spec_file.is_file():
        raise DipacoError(f"{spec_file} is missing; the router directory is incomplete, re-run `dipaco shard`")
    kind = json.loads(spec_file.read_text()).get("kind")
    if kind == "tfidf":
        return TfidfFeatures.load(directory)
    raise DipacoError(f"router features of kind {kind!r} in {directory} are not supported by this version of dipaco")
