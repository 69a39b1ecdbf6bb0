"""The shard stage's settings (``dipaco shard``): the input data and its splits, the tokenizer, the routing.

Declared as config.py declares the training sections (types, defaults, docstrings; flags, TOML and ``--set`` keys
come from them), and resolved by ``dipaco.config.resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dipaco.errors import DipacoError
from dipaco.settings import at_least, flag, fraction, positive


@dataclass
class DataConfig:
    text_column: str = flag("text")
    """Column of the input files that holds the document text."""
    label_column: str = "domain"
    """Optional column with a label per document (e.g. domain); kept for per-label reports. Missing is fine."""
    min_chars: int = flag(64)
    """Documents shorter than this many characters (after stripping) are dropped."""
    max_chars: int = flag(1_000_000)
    """Longer documents are cut to this many characters (a 100 MB line must not exhaust memory)."""
    heldout_fraction: float = 0.05
    """Share of documents kept aside, whole, for routed evaluation."""
    max_heldout_docs: int = 500
    """Cap on held-out documents."""
    val_fraction: float = 0.05
    """Share of each path's training documents written to its validation file."""
    router_fraction: float = 0.005
    """Share of documents held aside (never trained on) as router documents for discriminative
    re-sharding (`dipaco reshard`); the paper keeps 0.5%. Written whole to router_docs/docs.jsonl."""
    max_router_docs: int = 5000
    """Cap on router documents."""
    dedup: bool = True
    """Drop exact duplicates (same text after stripping, by a 128-bit hash); the first copy in the
    corpus's order (inputs in order, records in file order) is kept."""
    split: str = flag("train")
    """Split of a hub dataset given as input (local files are read whole)."""
    block_bytes: int = 64 << 20
    """The shard stage's unit of work: a JSON-lines file larger than this is cut into newline-aligned byte
    ranges of about this size, parquet into runs of row groups, a saved dataset into row ranges. Any value
    gives the same shard directory; smaller blocks spread a corpus over more workers."""

    def check(self, at: str) -> None:
        for key in ("heldout_fraction", "val_fraction", "router_fraction"):
            fraction(at + key, getattr(self, key))
        if self.heldout_fraction + self.router_fraction + self.val_fraction >= 1.0:
            raise DipacoError(f"config: {at}heldout_fraction + {at}router_fraction + {at}val_fraction must be < 1")
        if self.block_bytes < 1:
            raise DipacoError(f"config: '{at}block_bytes' must be >= 1, got {self.block_bytes}")
        for key in ("max_router_docs", "max_heldout_docs", "min_chars"):
            at_least(at + key, getattr(self, key), 0)
        if self.max_chars < max(1, self.min_chars):
            raise DipacoError(f"config: '{at}max_chars' ({self.max_chars}) must be >= {at}min_chars ({self.min_chars})")


@dataclass
class TokenizerConfig:
    vocab_size: int = flag(8192)
    """Vocabulary size of the byte-level BPE tokenizer trained when no --tokenizer is given."""
    train_chars: int = 8_000_000
    """At most this many characters train the tokenizer: a seeded sample of training documents, each cut
    to 4096 characters (BPE merges settle long before; more only costs time)."""

    def check(self, at: str) -> None:
        if self.vocab_size < 300:  # 256 bytes + merges + special tokens
            raise DipacoError(f"config: '{at}vocab_size' must be >= 300 (256 bytes + merges + special tokens), "
                              f"got {self.vocab_size}")


@dataclass
class RoutingConfig:
    assign: Literal["kmeans", "random"] = flag("kmeans")
    """How documents get paths: 'kmeans' (routing features + k-means, the paper's) or 'random' (a seeded
    hash of the routing prefix: uniform i.i.d. shards, the DiLoCo paper's main setting, as a control)."""
    prefix_tokens: int = flag(32)
    """The router's input, for every command (shard, eval, generate, reshard): the first this-many tokens
    of a document, decoded (paper: 32). Evaluation never scores them (eval.context_tokens >= this)."""
    cluster_on: Literal["prefix", "document"] = flag("document")
    """What k-means clusters to define the paths: 'document' (tf-idf of the first prefix_chars characters;
    a logistic regression on the prefix then learns those clusters and is the router, so sharding and
    eval still route by the prefix alone) or 'prefix' (the routing prefix itself). Chosen on routed
    validation perplexity (bench/routing_quality.py): 'document' 86.97 vs 97.07 on the default corpus,
    149.10 vs 148.17 on the shared one."""
    features: Literal["tfidf", "lm", "encoder"] = flag("tfidf")
    """Features of the routing prefix: 'tfidf' (tf-idf + truncated SVD, c-BTM style), 'lm' (mean of the
    last hidden layer of a local causal LM, the paper's) or 'encoder' (mean-pooled local Hugging Face
    encoder)."""
    feature_model: str = flag("", metavar="DIR")
    """Local Hugging Face model directory for 'lm' / 'encoder' features (weights as safetensors, with
    its tokenizer)."""
    copy_feature_model: bool = True
    """Freeze a copy of the feature model inside the router (routing needs nothing else); false stores
    only its path and content hash, checked whenever the router is loaded."""
    feature_batch_size: int = 32
    """'lm' / 'encoder': documents per forward pass."""
    prefix_chars: int = 1024
    """cluster_on='document': the document features read the first this-many characters."""
    max_tfidf_features: int = 50_000
    """Vocabulary cap of the tf-idf vectorizer."""
    svd_dims: int = 64
    """Dimensions after truncated SVD (c-BTM uses 100)."""
    fit_sample: int = flag(20_000)
    """Documents (a seeded sample) used to fit features and k-means."""
    kmeans_iters: int = 25
    """Lloyd iterations of faiss k-means."""
    kmeans_restarts: int = 16
    """Seeded k-means runs per level; the one with the lowest objective is kept (one run can land in a poor
    local optimum, e.g. splitting the largest domain and merging two small ones)."""
    spherical: bool = flag(True)
    """Spherical k-means: centroids re-normalised to unit length (cosine geometry, which suits the
    L2-normalised features; on the shared corpus it separates the domains more reliably)."""
    batch_size: int = 1024
    """Documents routed, tokenized and appended per batch while streaming the corpus."""
    overlap: int = flag(1)
    """Paths a training document goes to: 1 = its nearest only; n > 1 = its n nearest paths (paper: 2
    in the 16x16 model). Validation, held-out and router documents always go to one path."""
    balance: float = flag(0.0)
    """If > 0, the router carries per-path offsets fitted on the fit sample so that no path takes more than
    this many times the mean share of its documents; every document then goes to its nearest path with
    the offsets (the path eval routes it to). On the corpus the cap holds up to sampling error; the
    manifest reports the shares reached. 0: nearest path, no offsets."""
    product_split: Literal["interleaved", "contiguous"] = "interleaved"
    """How product k-means splits the feature vector over levels: 'interleaved' (dim d -> level d mod L,
    so every level sees high- and low-variance SVD directions) or 'contiguous' (the paper's halves)."""

    def check(self, at: str) -> None:
        if self.features != "tfidf" and not self.feature_model:
            raise DipacoError(f"config: {at}features={self.features!r} needs a model; pass --feature-model DIR "
                              f"(a local Hugging Face {'causal LM' if self.features == 'lm' else 'encoder'} directory)")
        for key in ("svd_dims", "prefix_chars", "prefix_tokens", "feature_batch_size", "fit_sample", "kmeans_iters",
                    "kmeans_restarts", "batch_size", "overlap", "max_tfidf_features"):
            positive(at + key, getattr(self, key))
        if self.balance and self.balance < 1.0:
            raise DipacoError(f"config: '{at}balance' must be 0 (off) or >= 1.0, got {self.balance}")


@dataclass
class ShardConfig:
    grid: str = flag("2x2")
    """Modules per level: '2x2' = two levels of two modules (4 paths), '5' = flat, '1' = one path."""
    seed: int = flag(0)
    """Seed for splits, samples and k-means (every split and sample is a keyed hash of the document under it)."""
    num_proc: int = flag(0)
    """Worker processes of this machine, one block of the corpus each at a time (with --engine ray: CPUs of the
    local Ray it starts); 0 = all cores. Any number gives the same shard directory."""
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def check(self, at: str) -> None:
        if self.num_proc < 0:
            raise DipacoError(f"config: '{at}num_proc' must be >= 0 (0 = all cores), got {self.num_proc}")
