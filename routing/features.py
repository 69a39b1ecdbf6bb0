"""Routing features of a document prefix.

``tfidf`` (c-BTM style): tf-idf over the first ``prefix_chars`` characters (English stop words removed,
digits folded to 0, sublinear tf) -> truncated SVD -> L2 normalisation. Fitted once on a sample and
frozen as plain files (JSON vocabulary, .npy arrays), so loading never unpickles anything.

``lm`` (DiPaCo's): the mean of the last hidden layer of a local Hugging Face causal LM over the first
``prefix_tokens`` (32) tokens. ``encoder``: a local Hugging Face encoder (e.g. a sentence-transformers
model), mean-pooled over the same prefix. Both are L2-normalised (k-means works in cosine geometry) and
frozen with a copy of the model (safetensors only) or with its content hash, checked on load.
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
    progress = False  # tf-idf is fast; no progress bar

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
        self._fit(texts)
        return self

    def fit_transform(self, texts: list[str]) -> np.ndarray:
        """``fit(texts)`` then ``transform(texts)``, the same bits, from one pass of the vectorizer: its fit
        matrix, indices sorted per row as ``transform``'s are, is the matrix ``transform`` would build, and
        the projection then sums every row in the same order."""
        x = self._fit(texts)
        x.sort_indices()
        return _l2_normalise(np.asarray(x @ self.components.T))

    def _fit(self, texts: list[str]):
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
        return x

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


_PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _model_files(model_dir: Path) -> list[Path]:
    """The files of a model directory that a frozen router keeps (no pickled weights, nothing hidden)."""
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix not in _PICKLED
                  and not any(part.startswith(".") for part in p.relative_to(model_dir).parts))


def check_model_dir(model_dir: str | Path, kind: str) -> Path:
    model_dir = Path(model_dir)
    what = "causal LM" if kind == "lm" else "encoder"
    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        raise DipacoError(f"feature model {model_dir} is not a Hugging Face model directory (no config.json); "
                          f"pass a local {what} directory to --feature-model")
    if not list(model_dir.glob("*.safetensors")):
        raise DipacoError(f"feature model {model_dir} has no .safetensors weights (dipaco never unpickles); "
                          f"save it with model.save_pretrained(dir, safe_serialization=True)")
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise DipacoError(f"feature model {model_dir} has no tokenizer; save one there with tokenizer.save_pretrained(dir)")
    return model_dir


class HFFeatures:
    """Mean-pooled last hidden layer of a local Hugging Face model over the first ``prefix_tokens`` tokens."""

    def __init__(self, kind: str, model_dir: str | Path, prefix_tokens: int = 32, batch_size: int = 32,
                 copy_model: bool = True, sha256: str | None = None, source: str | None = None):
        if kind not in ("lm", "encoder"):
            raise DipacoError(f"feature kind {kind!r} is not a model feature; use 'lm' or 'encoder'")
        self.kind, self.prefix_tokens, self.batch_size, self.copy_model = kind, prefix_tokens, batch_size, copy_model
        self.model_dir = check_model_dir(model_dir, kind)
        self.source = source or str(self.model_dir.resolve())
        self.sha256 = sha256 or sha256_dir_files(self.model_dir)
        self.progress = False
        self._model = self._tokenizer = None
        self.dims: int | None = None

    def _load(self):
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(self.model_dir))
            cls = AutoModelForCausalLM if self.kind == "lm" else AutoModel
            model = cls.from_pretrained(str(self.model_dir), use_safetensors=True, torch_dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            what = "causal LM" if self.kind == "lm" else "encoder"
            raise DipacoError(f"cannot load feature model {self.model_dir} as a {what} "
                              f"({str(exc).splitlines()[0][:200]}); pass a Hugging Face {what} directory") from None
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if tok.pad_token_id is None:
            raise DipacoError(f"the tokenizer of feature model {self.model_dir} has no pad, eos or unk token; add one")
        tok.padding_side = "right"
        model.eval()
        self._model, self._tokenizer = model, tok
        self.dims = int(model.config.hidden_size)

    def fit(self, texts: list[str]) -> "HFFeatures":
        """Nothing to fit: the model is frozen; this loads it and fixes the dimension."""
        self._load()
        return self

    def fit_transform(self, texts: list[str]) -> np.ndarray:
        return self.fit(texts).transform(texts)

    def transform(self, texts: list[str]) -> np.ndarray:
        import torch
        from tqdm.auto import tqdm

        self._load()
        out = np.zeros((len(texts), self.dims), dtype=np.float32)
        # only the prefix matters: cut the text before tokenizing (a token is rarely over 32 characters)
        prefixes = [t[: self.prefix_tokens * 32] for t in texts]
        bar = tqdm(total=len(texts), desc=f"{self.kind} features", unit="doc", disable=not self.progress,
                   dynamic_ncols=True, leave=False)
        with torch.inference_mode():
            for start in range(0, len(prefixes), self.batch_size):
                batch = self._tokenizer(prefixes[start:start + self.batch_size], truncation=True,
                                        max_length=self.prefix_tokens, padding=True, return_tensors="pt")
                mask = batch["attention_mask"]
                inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
                if self.kind == "lm":
                    hidden = self._model(**inputs, output_hidden_states=True).hidden_states[-1]
                else:
                    hidden = self._model(**inputs).last_hidden_state
                m = mask.unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
                out[start:start + len(mean)] = mean.float().numpy()
                bar.update(len(mean))
        bar.close()
        return _l2_normalise(out)

    def describe(self) -> dict:
        return {"kind": self.kind, "model_sha256": self.sha256, "model_source": self.source,
                "model_copied": self.copy_model, "prefix_tokens": self.prefix_tokens, "batch_size": self.batch_size,
                "dims": self.dims, "pooling": "mean over the prefix tokens of the last hidden layer, L2-normalised"}

    def save(self, directory: str | Path) -> None:
        import shutil

        self._load()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.copy_model:
            for f in _model_files(self.model_dir):
                target = directory / "model" / f.relative_to(self.model_dir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
        (directory / "features.json").write_text(json.dumps(self.describe(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "HFFeatures":
        directory = Path(directory)
        spec = json.loads((directory / "features.json").read_text())
        if spec.get("model_copied"):
            model_dir = directory / "model"
            if not model_dir.is_dir():
                raise DipacoError(f"router features in {directory} lack their model copy (model/); re-run `dipaco shard`")
        else:
            model_dir = Path(spec["model_source"])
            if not model_dir.is_dir():
                raise DipacoError(f"the router's feature model {model_dir} is gone; restore it or re-run `dipaco shard` "
                                  f"with --set routing.copy_feature_model=true")
            found = sha256_dir_files(model_dir)
            if found != spec["model_sha256"]:
                raise DipacoError(f"feature model {model_dir} changed since the router was built (sha256 {found[:12]} != "
                                  f"{spec['model_sha256'][:12]}); restore the original model or re-run `dipaco shard`")
        features = cls(spec["kind"], model_dir, spec["prefix_tokens"], spec["batch_size"], spec["model_copied"],
                       sha256=spec["model_sha256"], source=spec["model_source"])
        features.dims = spec.get("dims")
        return features


def sha256_dir_files(model_dir: Path) -> str:
    """Content hash of the model files a router keeps (see ``_model_files``)."""
    import hashlib

    from dipaco.io import sha256_file

    digest = hashlib.sha256()
    for f in _model_files(model_dir):
        digest.update(str(f.relative_to(model_dir)).encode())
        digest.update(sha256_file(f).encode())
    return digest.hexdigest()


def make_features(kind: str, prefix_chars: int = 2048, max_tfidf_features: int = 50_000, svd_dims: int = 64,
                  seed: int = 0, feature_model: str | None = None, prefix_tokens: int = 32, batch_size: int = 32,
                  copy_model: bool = True):
    if kind == "tfidf":
        return TfidfFeatures(prefix_chars, max_tfidf_features, svd_dims, seed)
    if kind in ("lm", "encoder"):
        if not feature_model:
            raise DipacoError(f"routing features {kind!r} need a model; pass --feature-model DIR")
        return HFFeatures(kind, feature_model, prefix_tokens, batch_size, copy_model)
    raise DipacoError(f"routing features {kind!r} are not supported; use 'tfidf', 'lm' or 'encoder'")


def load_features(directory: str | Path):
    spec_file = Path(directory) / "features.json"
    if not spec_file.is_file():
        raise DipacoError(f"{spec_file} is missing; the router directory is incomplete, re-run `dipaco shard`")
    try:
        kind = json.loads(spec_file.read_text()).get("kind")
    except json.JSONDecodeError as exc:
        raise DipacoError(f"{spec_file} is not valid JSON ({exc}); re-run `dipaco shard`") from None
    if kind == "tfidf":
        return TfidfFeatures.load(directory)
    if kind in ("lm", "encoder"):
        return HFFeatures.load(directory)
    raise DipacoError(f"router features of kind {kind!r} in {directory} are not supported by this version of dipaco")
