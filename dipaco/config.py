"""Configuration: one dataclass section per stage, with model presets.

A setting is declared once, here: its type (``Literal`` for a choice), its default and its docstring. The
command-line flags, their help and choices, the TOML files and the ``--set`` overrides all come from these
declarations (cli/flags.py makes the flags); every section checks its own values in ``check``.
Precedence (lowest first): dataclass defaults -> preset -> TOML file -> ``--set`` -> named CLI flags.
Unknown keys and wrong types are errors. The resolved config is written next to every output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dipaco import settings
from dipaco.errors import DipacoError
from dipaco.settings import at_least, flag, fraction, nest, positive
from dipaco.settings import to_dict, to_toml  # noqa: F401  (importers read them here)

Bits = Literal[4, 8, 16, 32]  # dipaco.training.quant.SUPPORTED_BITS (a test keeps the two equal)
Preset = Literal["tiny", "small", "base"]  # the keys of PRESETS (a test keeps the two equal)


# ----------------------------------------------------------------------------------------- shard
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


# ----------------------------------------------------------------------------------------- train
@dataclass
class ModelConfig:
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks per path."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when smaller than num_heads)."""
    intermediate_size: int = 192
    """MLP hidden width."""
    max_seq_len: int = 128
    """Training sequence length (also the eval window)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head."""
    rope_theta: float = 10000.0
    """RoPE base."""

    def check(self, at: str) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
            positive(at + key, getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise DipacoError(f"config: {at}hidden_size ({self.hidden_size}) must be divisible by {at}num_heads "
                              f"({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise DipacoError(f"config: {at}num_heads ({self.num_heads}) must be divisible by {at}num_kv_heads "
                              f"({self.num_kv_heads})")


@dataclass
class GridConfig:
    shape: str = flag("", "--grid")
    """Modules per level for training; '' takes the shard directory's grid; '1' is the dense baseline."""
    level_sizes: list[int] = field(default_factory=list)
    """Blocks per level (must sum to model.num_layers); empty splits the blocks evenly."""
    private_blocks: list[int] = field(default_factory=list)
    """Blocks that every path keeps to itself (paper: 0, 5, 6, 11)."""
    private_embedding: bool = False
    """Give every path its own input embedding (model.embed_tokens). With model.tie_embeddings (the default)
    the output head is that same tensor, so it becomes path-private too."""
    private_head: bool = False
    """Give every path its own final norm (model.norm) and output head (lm_head). Needs
    model.tie_embeddings = false: a tied head is the embedding, which private_head cannot split off (make it
    private with private_embedding; then private_head adds the final norm)."""
    sqrt_rescale: bool = False
    """Rescale a module's averaged outer gradient by sqrt(paths through it) (DiPaCo §2.7)."""
    replicas_per_shard: bool = False
    """With shape '1': one trainee per shard (DiLoCo) instead of one trainee on all shards pooled."""


@dataclass
class InnerConfig:
    lr: float = 2e-3
    """Peak AdamW learning rate (paper 4e-4 at 150M; tiny CPU models like more)."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of the peak."""
    warmup_steps: int = 50
    """Linear warmup steps (paper: 1000)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2 (not given by the paper; torchft uses 0.95)."""
    grad_clip: float = 1.0
    """Gradient norm clip (0 disables)."""
    batch_size: int = 8
    """Sequences per inner step per trainee."""

    def check(self, at: str) -> None:
        positive(at + "lr", self.lr)
        positive(at + "batch_size", self.batch_size)


@dataclass
class OuterConfig:
    lr: float = 0.7
    """Outer SGD learning rate (DiLoCo's best)."""
    momentum: float = 0.9
    """Outer momentum."""
    nesterov: bool = True
    """Nesterov momentum (the papers use it)."""

    def check(self, at: str) -> None:
        positive(at + "lr", self.lr)
        fraction(at + "momentum", self.momentum)


@dataclass
class StreamingConfig:
    fragments: int = flag(1)
    """F: fragments per module that sync on staggered schedules (Streaming DiLoCo); 1 = plain rounds."""
    layout: Literal["strided", "sequential"] = "strided"
    """Which blocks form a fragment: 'strided' (block b in fragment b mod F) or 'sequential' (runs of blocks)."""
    overlap: int = flag(0)
    """τ: inner steps a fragment's reduction overlaps with compute before it is merged (0 = blocking)."""
    alpha: float = flag(0.0)
    """Merge θ_local ← α·θ_local + (1−α)·θ_global after a sync (0 replaces; the paper uses 0.5 with τ > 0)."""

    def check(self, at: str) -> None:
        at_least(at + "fragments", self.fragments, 1)
        if not 0.0 <= self.alpha <= 1.0:
            raise DipacoError(f"config: '{at}alpha' must be in [0, 1] (0 replaces, 0.5 averages), got {self.alpha}")


@dataclass
class CommConfig:
    bits: Bits = flag(32)
    """Bits per outer-gradient value on the wire: 32 (fp32, exact), 16 (bf16), 8 or 4 (blockwise int + bf16
    scale). Below 32 the module's gradient is Q_down(Σ w_i·deq(Q_up(Δ_i))) on any number of workers (the world
    of one included): every trainee's outer gradient quantized once, as if sent from its own worker, the sum
    quantized once more, as a reduce-scatter's chunk owner sends it back."""
    block_size: int = 128
    """Values per quantization block (one bf16 scale each)."""
    pattern: Literal["auto", "allgather", "reduce_scatter"] = "auto"
    """Collective: 'allgather' (every holder sends its payloads to every other), 'reduce_scatter' (chunks to
    their owners, added, all-gathered), or 'auto' (the one that moves fewer bytes: reduce-scatter from 3
    holders, and below 32 bits also for 2 holders unless each has one trainee). The result does not depend on it."""
    simulate_mbit: float = flag(0.0, "--simulate-bandwidth", metavar="MBIT")
    """If > 0, every collective takes at least bytes·8/(this many Mbit/s) + latency (a slow link on one machine)."""
    simulate_latency_ms: float = flag(0.0, "--simulate-latency", metavar="MS")
    """Per-message latency added by the link simulation (ms, per peer step of a collective)."""

    def check(self, at: str) -> None:
        if self.block_size < 2 or self.block_size % 2:
            raise DipacoError(f"config: '{at}block_size' must be an even number >= 2, got {self.block_size}")
        if self.simulate_mbit < 0 or self.simulate_latency_ms < 0:
            raise DipacoError(f"config: '{at}simulate_mbit' and '{at}simulate_latency_ms' must be >= 0")


@dataclass
class RayConfig:
    address: str = flag("", metavar="ADDR")
    """Ray cluster to join with --engine ray: 'auto' (the one on this machine) or the head's host:port that `ray start
    --head` prints; '' starts a local Ray on this machine with --workers CPUs (default: one per core)."""
    max_retries: int = -1
    """Retries of a phase whose worker process or node was lost (a retry computes the same bytes, after a backoff);
    -1: without limit (preemption is not an error). An exception raised by the phase's own code is never retried."""
    quorum: int = flag(0)
    """If > 0, a module's outer step may go ahead with this many of its trainees (all, if it has fewer) once
    ``grace`` seconds have passed since it had them; the late phases are dropped: their results are discarded and
    their trainees restart from the new modules. 0 waits for every phase (exact, the default)."""
    grace: float = flag(0.0, metavar="SECONDS")
    """With a quorum: seconds a module waits for its late phases after the quorum is in."""
    threads: int = 0
    """Older name of the top-level 'threads' (kept so that older configs load): a value > 0 here is used when
    'threads' is left at its default."""
    executors: int = 1
    """Outer-step executors (restartable Ray actors); the module groups are spread over them."""
    sticky: bool = True
    """A phase prefers the node that trained its trainee last (a soft affinity: another node when that one is busy or gone)
    and reads the trainee state from that node's local cache, checked against its commit record's checksum;
    storage keeps the durable copy, so a lost node costs a download, never bits."""
    gpus_per_phase: float = 1.0
    """With --device cuda (or auto on a cluster with GPUs): the GPUs a phase asks Ray for; a fraction (0.5) packs
    that many phases on one GPU."""

    def check(self, at: str) -> None:
        at_least(at + "max_retries", self.max_retries, -1)
        at_least(at + "quorum", self.quorum, 0)
        at_least(at + "threads", self.threads, 0)
        positive(at + "executors", self.executors)
        if self.grace < 0:
            raise DipacoError(f"config: '{at}grace' must be >= 0 seconds, got {self.grace}")
        if not 0 < self.gpus_per_phase <= 64:
            raise DipacoError(f"config: '{at}gpus_per_phase' must be in (0, 64] (a fraction shares a GPU), "
                              f"got {self.gpus_per_phase}")


@dataclass
class EvalConfig:
    context_tokens: int = 32
    """Leading tokens of each document used for routing and never scored (paper: 32)."""
    max_tokens_per_doc: int = 4096
    """Held-out documents are cut to this many tokens to bound eval time."""
    batch_size: int = 16
    """Windows per forward pass in evaluation."""

    def check(self, at: str) -> None:
        at_least(at + "context_tokens", self.context_tokens, 1)


@dataclass
class TrainConfig:
    preset: Preset = flag("tiny")
    """Model size preset, applied before the file and flags."""
    rounds: int = flag(10)
    """Outer steps."""
    inner_steps: int = flag(50)
    """H: inner steps per trainee per round."""
    seed: int = flag(0)
    """Seed for initialisation and data order."""
    val_batches: int = 4
    """Batches of each path's validation file scored after every round (0 disables)."""
    log_every: int = 10
    """Inner steps between training-loss lines in metrics.jsonl."""
    checkpoint_every: int = 1
    """Rounds between checkpoints (the last round is always saved; resume starts from the last one saved)."""
    threads: int = flag(1)
    """torch threads per trainee, honoured by every engine (in-process, torchrun, ray). The engines give the same bits
    at the same thread count; a different count may change the last bits (another summation order in a kernel)."""
    device: Literal["auto", "cpu", "cuda"] = flag("auto")
    """Device: 'auto' (cuda when available), 'cpu' or 'cuda' (bf16 autocast, fp32 master weights and outer state)."""
    engine: Literal["sync", "ray"] = flag("sync")
    """'sync': one synchronous job (every trainee in this process, or torchrun workers: --workers, torchrun); 'ray':
    a task queue on Ray (pip install -e '.[ray]'): one task per trainee and round, each module's outer step as soon
    as its phases are in, workers that may come and go (the [ray] section)."""
    init_from: str = flag("", metavar="RUN_OR_DIR")
    """Start every module from a dense model: a dipaco '--grid 1' run directory (its latest round) or a
    Hugging Face Llama directory of the same shape; '' starts from a seeded random model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def trainee_threads(self) -> int:
        """``threads``, or an older config's ``ray.threads`` where ``threads`` is left at its default."""
        return self.threads if self.threads != 1 or not self.ray.threads else self.ray.threads

    def check(self, at: str) -> None:
        """The top-level values and what spans sections (each section has checked itself)."""
        for key in ("rounds", "inner_steps", "checkpoint_every", "threads"):
            positive(at + key, getattr(self, key))
        if self.grid.private_head and self.model.tie_embeddings and not self.grid.private_embedding:
            raise DipacoError("config: grid.private_head=true with model.tie_embeddings=true would keep only the final norm "
                              "private (the tied output head is the shared embedding); set model.tie_embeddings=false to "
                              "give every path its own output head, or grid.private_embedding=true to make the embedding "
                              "and its tied head private together")
        s = self.streaming  # its own check ran: fragments >= 1
        validate_streaming(self.inner_steps, s.fragments, s.overlap, self.model.num_layers)
        if self.engine == "ray" and (s.fragments > 1 or s.overlap > 0 or s.alpha > 0):
            raise DipacoError("config: --engine ray runs whole rounds (a phase is H inner steps, then the outer step); "
                              "Streaming DiLoCo (streaming.fragments > 1, overlap > 0, alpha > 0) is the sync engine's: "
                              "drop those settings or train with --engine sync")


# ---------------------------------------------------------------------------------- resolution
PRESETS: dict[str, dict] = {
    # A round of 50 steps takes seconds on one CPU core.
    "tiny": {"model": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                           intermediate_size=192, max_seq_len=128), "inner": dict(batch_size=8)},
    "small": {"model": dict(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=8,
                            intermediate_size=768, max_seq_len=256), "inner": dict(batch_size=16)},
    # The paper's path: 12 blocks, hidden 896, 16 heads of 64 (~150M with a 32k vocabulary).
    "base": {"model": dict(hidden_size=896, num_layers=12, num_heads=14, num_kv_heads=14,
                           intermediate_size=3584, max_seq_len=1024, tie_embeddings=False),
             "inner": dict(batch_size=32, lr=4e-4, warmup_steps=1000)},
}


def _user_error(fn):
    """settings.py is generic and raises SettingError; what config.py hands out raises the user's DipacoError."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except settings.SettingError as exc:
            raise DipacoError(str(exc)) from None
    return wrapped


apply_dict = _user_error(settings.apply_dict)
from_dict = _user_error(settings.from_dict)
parse_override = _user_error(settings.parse_override)
read_toml = _user_error(settings.read_toml)
validate = _user_error(settings.validate)


def resolve(cls, file: str | Path | None = None, overrides: list[str] = (), flags: dict | None = None):
    """Build a config of dataclass ``cls``: defaults -> preset -> file -> --set -> flags, then check it."""
    file_values = read_toml(file) if file else {}
    override_values = [parse_override(o) for o in overrides]
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    cfg = cls()
    if cls is TrainConfig:
        preset = flags.get("preset") or _last_preset(file_values, override_values) or cfg.preset
        if not isinstance(preset, str) or preset not in PRESETS:
            raise DipacoError(f"config: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        apply_dict(cfg, PRESETS[preset])
        cfg.preset = preset
    apply_dict(cfg, file_values)
    for values in override_values:
        apply_dict(cfg, values)
    apply_dict(cfg, nest(flags))
    validate(cfg)
    return cfg


def _last_preset(file_values: dict, override_values: list[dict]) -> str | None:
    preset = file_values.get("preset")
    for values in override_values:
        preset = values.get("preset", preset)
    return preset


def validate_streaming(H: int, fragments: int, overlap: int, num_layers: int) -> None:
    """Reject schedules that cannot run (fragments against blocks and inner steps), with the fix in the message."""
    if fragments > num_layers:
        raise DipacoError(f"config: 'streaming.fragments' ({fragments}) exceeds model.num_layers ({num_layers}); "
                          f"use at most one fragment per block")
    if H % fragments:
        raise DipacoError(f"config: 'streaming.fragments' ({fragments}) must divide inner_steps H ({H}); "
                          f"pick F among the divisors of H")
    if overlap < 0 or overlap >= H // fragments:
        raise DipacoError(f"config: 'streaming.overlap' τ={overlap} must satisfy 0 <= τ < H/F = {H // fragments} "
                          f"(one fragment in flight at a time); lower τ or F, or raise inner_steps")
