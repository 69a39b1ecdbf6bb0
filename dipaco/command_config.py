"""Config sections of the commands that use a trained run: eval, generate, reshard, fit-window-router.

Declared like the train sections in config.py (type, default, docstring; cli/flags.py makes the flags)
and resolved by config.resolve; they live apart so that config.py stays the bottom of the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dipaco.config import LogConfig, at_least, flag, positive
from dipaco.errors import DipacoError


def _held_aside(at: str, value: float) -> None:
    """Some router documents must be held aside, and some kept for the fit: (0, 1), as the commands need."""
    if not 0.0 < value < 1.0:
        raise DipacoError(f"config: '{at}holdout_fraction' must be in (0, 1), got {value}")


def _mixture(at: str, k: int | None) -> None:
    if k is not None and k < 2:
        raise DipacoError(f"config: '{at}mixture' (--mixture) is {k}: a mixture needs K >= 2 paths (K = 1 is the routed "
                          f"row); leave --mixture out for none")


def check_max_new_tokens(n: int, at: str = "") -> None:
    """One rule and one message for the CLI flag, the config key and the Python API: generation asks for >= 1 token."""
    if n < 1:
        raise DipacoError(f"config: '{at}max_new_tokens' (--max-new-tokens) is {n}: ask for at least 1 new token")


@dataclass
class EvalCommandConfig:
    """``dipaco eval``: which rows the report has besides the routed one."""
    round: int | None = flag(None)
    """Evaluate this round instead of the latest."""
    baseline: str = flag("", metavar="RUN")
    """A dense run (--grid 1) scored on the same tokens."""
    route_every: list[int] = flag([], metavar="W")
    """Also re-route every W tokens using the previous window (repeatable)."""
    early_stopping: bool = flag(False)
    """Also evaluate each path at its round of lowest validation loss (metrics.jsonl)."""
    mixture: int | None = flag(None, metavar="K")
    """Also score a c-BTM mixture of the K nearest paths (2 <= K <= paths)."""
    temperature: float = flag(0.1)
    """Mixture weights softmax(-d^2/T)."""
    oracle: bool = flag(True)
    """The oracle row (it scores every path on every document; --no-oracle skips it)."""
    random: bool = flag(True)
    """The random-routing row."""
    seed: int = flag(0)
    """Seed of random routing."""
    split: Literal["heldout", "val"] = flag("heldout")
    """Documents scored: 'heldout' (the held-out test documents) or 'val' (every path's validation documents;
    choose settings on these)."""
    log: LogConfig = field(default_factory=LogConfig)
    """--log-to: the report's table and perplexities also go to each evaluated run's trackers."""

    def check(self, at: str) -> None:
        _mixture(at, self.mixture)
        positive(at + "temperature", self.temperature)
        for w in self.route_every:
            positive(at + "route_every", w)


@dataclass
class GenerateConfig:
    """``dipaco generate``: decoding and routing of a continuation."""
    max_new_tokens: int = flag(64)
    """Tokens to generate after the prompt."""
    temperature: float = flag(0.0)
    """Sampling temperature: 0 = greedy; > 0 samples."""
    top_p: float = flag(1.0)
    """Nucleus sampling threshold."""
    seed: int = flag(0)
    """Seed of sampling."""
    round: int | None = flag(None)
    """Checkpoint round (default: the latest)."""
    path: str = flag("")
    """Use this path (e.g. 0-1) instead of routing."""
    mixture: int | None = flag(None, metavar="K")
    """Mix the K nearest paths (c-BTM; 2 <= K <= paths)."""
    mixture_temperature: float = flag(0.1)
    """Mixture weights softmax(-d^2/T)."""
    route_every: int | None = flag(None, metavar="W")
    """Re-route after every W new tokens (the run's window router for W, else the shard router); unset: W of the
    run's window router if it has exactly one; 0 keeps one path."""

    def check(self, at: str) -> None:
        _mixture(at, self.mixture)
        check_max_new_tokens(self.max_new_tokens, at)
        at_least(at + "temperature", self.temperature, 0)
        positive(at + "mixture_temperature", self.mixture_temperature)


@dataclass
class ReshardConfig:
    """``dipaco reshard``: the discriminative router fitted on a run's per-path losses."""
    target: Literal["current", "uniform"] = flag("current")
    """Path distribution the router's bias keeps: the current shard sizes or uniform."""
    holdout_fraction: float = flag(0.2)
    """Router documents kept aside to measure accuracy."""
    max_tokens: int = flag(512)
    """Tokens of each router document scored."""
    round: int | None = flag(None)
    """Score with this round instead of the latest."""
    seed: int = flag(0)
    """Seed of the held-aside split and of the router fit."""

    def check(self, at: str) -> None:
        _held_aside(at, self.holdout_fraction)
        positive(at + "max_tokens", self.max_tokens)


@dataclass
class WindowRouterConfig:
    """``dipaco fit-window-router``: the router of every-W routing, fitted on the router documents."""
    round: int | None = flag(None)
    """Label with the losses of this round (default: the latest)."""
    max_tokens: int = flag(4096)
    """Tokens of each router document used."""
    holdout_fraction: float = flag(0.2)
    """Router documents held aside to report accuracy (the saved router is then fitted on all)."""
    seed: int = flag(0)
    """Seed of the held-aside split and of the router fit."""

    def check(self, at: str) -> None:
        _held_aside(at, self.holdout_fraction)
        positive(at + "max_tokens", self.max_tokens)


@dataclass
class ServeConfig:
    """``dipaco serve``: where it listens, how it routes, what it keeps in memory, how much it takes at once."""
    host: str = flag("127.0.0.1")
    """Address to listen on; any other than loopback needs an API key (--api-key or DIPACO_API_KEY)."""
    port: int = flag(8000)
    """Port to listen on (0: a free one, printed at start)."""
    max_memory: str = flag("", metavar="BYTES")
    """Budget for resident module bytes, e.g. 4GB (default: half the memory available at start)."""
    routing: Literal["run", "shard"] = flag("run")
    """How a prompt is routed: run = the run's once rule, as generate and eval; shard = the shard router alone."""
    route_every: int = flag(0, metavar="W")
    """Re-route after every W new tokens with the run's every-W rule (0: one path per answer)."""
    max_batch: int = flag(32)
    """Rows of one path's running batch."""
    max_queue: int = flag(256)
    """Choices in flight at most; past it requests get 429 with Retry-After."""
    round: int | None = flag(None)
    """Checkpoint round to serve (default: the latest)."""
    log_interval: float = 10.0
    """Seconds between the throughput points that --log-to trackers get (also one at shutdown)."""
    log: LogConfig = field(default_factory=LogConfig)
    """--log-to: serving throughput also goes to the served run's trackers."""

    def check(self, at: str) -> None:
        at_least(at + "port", self.port, 0)
        positive(at + "log_interval", self.log_interval)
        at_least(at + "route_every", self.route_every, 0)
        positive(at + "max_batch", self.max_batch)
        positive(at + "max_queue", self.max_queue)
