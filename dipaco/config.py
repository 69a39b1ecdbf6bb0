"""Configuration: the training sections, the model presets, and ``resolve`` for every command's sections (the shard
stage's are in shard_config.py, the trained-run commands' in command_config.py).

A setting is declared once, here: its type (``Literal`` for a choice), its default and its docstring. The
command-line flags, their help and choices, the TOML files and the ``--set`` overrides all come from these
declarations (cli/flags.py makes the flags); every section checks its own values in ``check``.
Precedence (lowest first): dataclass defaults -> preset -> TOML file -> ``--set`` -> named CLI flags.
Unknown keys and wrong types are errors. The resolved config is written next to every output.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dipaco import settings
from dipaco.errors import DipacoError
from dipaco.settings import at_least, flag, fraction, nest, positive
from dipaco.settings import to_dict, to_toml  # noqa: F401  (importers read them here)

Bits = Literal[4, 8, 16, 32]  # dipaco.training.quant.SUPPORTED_BITS (a test keeps the two equal)
Preset = Literal["tiny", "small", "base"]  # the keys of PRESETS (a test keeps the two equal)


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
    storage keeps the durable copy at every checkpoint round (``checkpoint_every``), so a lost node costs a download
    and the replay of its phases since, never bits."""
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


TRACKERS = ("tensorboard", "wandb")  # what log.to may name (dipaco.training.trackers writes them)


@dataclass
class LogConfig:
    to: str = flag("", "--log-to", metavar="TRACKERS")
    """Trackers that also get the figures: tensorboard, wandb or both, comma-separated. The run directory keeps their
    files (RUN/tensorboard/; RUN/wandb/ with the W&B run id), so a resumed run continues the same tracker run; empty:
    metrics.jsonl only."""
    wandb_project: str = "dipaco"
    """The W&B project of the run (WANDB_MODE=offline writes it under RUN/wandb/ without a network)."""

    @property
    def trackers(self) -> list[str]:
        return [t.strip() for t in self.to.split(",") if t.strip()]

    def check(self, at: str) -> None:
        for name in self.trackers:
            if name not in TRACKERS:
                raise DipacoError(f"config: '{at}to' (--log-to) names {name!r}; choose among {', '.join(TRACKERS)}, "
                                  f"comma-separated (e.g. --log-to tensorboard,wandb)")
            if not _installed(name):  # here, so that a missing package costs one line before any work starts
                raise DipacoError(f"--log-to {name} needs the {name} package: pip install -e '.[{name}]'")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # a package set aside in sys.modules (as if not installed)
        return False


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
    """Rounds between checkpoints (the last round is always saved; resume starts from the last one saved). With
    --engine ray and sticky trainees it is also how often a trainee's AdamW state goes to storage: in between it stays
    in the cache of the node that trained it, and a phase that runs elsewhere replays the phases since the last
    checkpoint (the same bits, more compute)."""
    threads: int = flag(1)
    """torch threads per trainee, honoured by every engine (in-process, torchrun, ray). The engines give the same bits
    at the same thread count; a different count may change the last bits (another summation order in a kernel)."""
    device: Literal["auto", "cpu", "cuda"] = flag("auto")
    """Device: 'auto' (cuda when available), 'cpu' or 'cuda' (bf16 autocast, fp32 master weights and outer state)."""
    engine: Literal["local", "ray"] = flag("local", renamed={"sync": "local"})
    """'local': one synchronous job (every trainee in this process, or torchrun workers: --workers, torchrun); 'ray':
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
    log: LogConfig = field(default_factory=LogConfig)

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
                              "Streaming DiLoCo (streaming.fragments > 1, overlap > 0, alpha > 0) is the local engine's: "
                              "drop those settings or train with --engine local")


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
