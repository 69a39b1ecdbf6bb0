"""A served model: where its modules come from, how a request is routed, and the batcher that answers it.

``Engine`` is what the HTTP server (``dipaco.eval.serve.app``) and lm-evaluation-harness (``dipaco.eval.harness``)
both stand on: ``route(ids)`` gives a text's path as ``dipaco generate`` and ``dipaco eval`` do (the run's once rule
on its first tokens, or the shard router alone with ``routing="shard"``), ``score`` and ``generate`` run jobs through
the batcher and wait for them, from any thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.eval.serve.batcher import Batcher, Job
from dipaco.eval.serve.modules import HFModules, ModuleCache, RunModules


def default_budget() -> int:
    """Half of the memory available when the server starts: the other half is for KV caches and everything else."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"]) // 2
    except (OSError, KeyError, ValueError):
        return 8 << 30


def parse_bytes(text: str | int | None) -> int:
    """'4GB', '512MiB', '2e9' or a plain number of bytes; None or '' is the default budget."""
    if text is None or text == "":
        return default_budget()
    if isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        value = float(number) * units[s[len(number):]]
    except (ValueError, KeyError):
        raise DipacoError(f"--max-memory {text!r} is not a size; write bytes or a size like 4GB or 512MiB") from None
    if value <= 0:
        raise DipacoError(f"--max-memory {text!r} must be positive")
    return int(value)


@dataclass
class Completion:
    """What one job produced: new tokens with their log-probabilities, the prompt's, and why it ended."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt: list[tuple[float, list]] | None = None
    finish: str = ""
    error: str | None = None


class Engine:
    """A run (or one Hugging Face directory) being served: its tokenizer, router and batcher."""

    def __init__(self, run: str | Path | None = None, shards: str | Path | None = None, model_dir: str | Path | None = None,
                 max_memory: int | None = None, routing: str = "run", route_every: int = 0, max_batch: int = 32,
                 round: int | None = None, metrics=None, name: str | None = None):
        if (run is None) == (model_dir is None):
            raise DipacoError("serve one thing: --run RUN (a dipaco run) or --model DIR (a Hugging Face directory)")
        if routing not in ("run", "shard"):
            raise DipacoError(f"--routing {routing!r} is not valid; use 'run' (the run's once rule) or 'shard' "
                              f"(the shard router alone: no forward pass to route)")
        self.metrics, self.route_every, self.routing = metrics, int(route_every or 0), routing
        if self.route_every < 0:
            raise DipacoError(f"--route-every {route_every} is not valid; use W > 0 tokens, or 0 to keep one path")
        if run is not None:
            from dipaco.eval.api import load

            self.rr = load(run, shards, progress=False)
            self.source = RunModules(self.rr.run, round)
            self.tokenizer = self.rr.tokenizer
            self.name = name or self.rr.run.root.resolve().name
            self.eos = int(self.rr.run.info["eos_token_id"])
            self.max_len = int(self.rr.run.config.model.max_seq_len)
            self._rule = self._once_rule()
        else:
            from transformers import AutoTokenizer

            self.rr = None
            self.source = HFModules(model_dir)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.name = name or Path(model_dir).resolve().name
            self.eos = int(self.source.config.eos_token_id if self.source.config.eos_token_id is not None
                           else self.tokenizer.eos_token_id)
            self.max_len = int(getattr(self.source.config, "max_position_embeddings", 2048))
            self._rule = None
        self.paths = list(self.source.paths)
        self.budget = parse_bytes(max_memory)
        self.cache = ModuleCache(self.source, self.budget, metrics)
        self.batcher = Batcher(self.cache, self.eos, max_batch, metrics, max_position=self.max_len).start()
        self._window = self._every_w() if self.route_every else None
        self.remote = None  # the front router's upstreams: paths scored (for routing) and answered elsewhere

    # ---------------------------------------------------------------- routing
    def _once_rule(self):
        from dipaco.eval.once_policy import OnceRule

        if self.rr.run.is_dense:
            return None
        if self.routing == "shard":
            return OnceRule("shard-router")
        return None  # the run's own rule (RUN/routing/once.json, chosen and saved now if the run has none)

    def routing_cost(self) -> str:
        """What routing one request costs, in words (for the log and /v1/models)."""
        if self.rr is None or self.rr.run.is_dense:
            return "no routing (one path)"
        from dipaco.eval.once_policy import once_rule_of

        rule = self._rule or once_rule_of(self.rr.find_once_policy()["chosen"])
        context = self.rr.run.config.eval.context_tokens
        if rule.kind == "shard-router":
            return f"the shard router on the first {self.rr.router.input.tokens} tokens: no forward pass"
        return (f"{rule.name}: {len(self.paths)} forward passes of up to {context} tokens per request (every path "
                f"scores the prompt's start); --routing shard routes with the shard router alone, no forward pass")

    def route(self, ids: list[int]) -> tuple[str, str]:
        """(path, how it was routed) of a prompt given as token ids: the path ``dipaco generate`` gives it."""
        if self.rr is None:
            return self.paths[0], "one model: no routing"
        from dipaco.eval.generate import route_ids

        started = time.perf_counter()
        path, how, _ = route_ids(self.rr, ids, score=self.score, rule=self._rule)
        if self.metrics is not None:
            self.metrics.routed(time.perf_counter() - started)
        return path, how

    def _every_w(self):
        from dipaco.eval.generate import every_w_rule

        if self.rr is None or self.rr.run.is_dense:
            return None
        rule, why = every_w_rule(self.rr, self.route_every)
        return rule, self.rr.window_router(self.route_every), why

    def next_path(self, tokens: list[int], first: str, current: str, spans: list[int]) -> str:
        """The path of the next W tokens under the run's every-W rule."""
        from dipaco.eval.generate import next_path

        rule, window, _ = self._window
        return next_path(self.rr, rule, window, tokens, first, current, spans, self.score)

    # ---------------------------------------------------------------- jobs
    def submit(self, job: Job) -> None:
        self.batcher.submit(job)

    def run_jobs(self, jobs: list[Job], timeout: float | None = None) -> list[Completion]:
        """Submit every job at once (the batcher batches them by path) and wait for all of them."""
        results = [Completion() for _ in jobs]
        left = [len(jobs)]
        done = threading.Event()
        lock = threading.Lock()
        for job, result in zip(jobs, results):
            job.emit = _collector(result, lock, left, done)
        for job in jobs:
            self.submit(job)
        if jobs and not done.wait(timeout):
            for job in jobs:
                job.cancelled = True
            raise DipacoError(f"{len(jobs)} jobs did not finish in {timeout} s")
        return results

    def score(self, requests: list[tuple[str, list[int]]]) -> list[np.ndarray]:
        """Every target's NLL (len(ids) - 1 values) of each (path, ids): ``dipaco.eval.generate.loaded_scorer``'s
        contract, run through the batcher (or, for a path served upstream, by its upstream)."""
        far = [i for i, (p, _) in enumerate(requests) if self.remote is not None and self.remote.serves(p)]
        near = [i for i in range(len(requests)) if i not in set(far)]
        out: list = [None] * len(requests)
        if far:
            for i, nll in zip(far, self.remote.score([requests[i] for i in far])):
                out[i] = nll
        jobs = [Job(requests[i][0], list(requests[i][1]), 0, None, prompt_logprobs=True) for i in near]
        for i, r in zip(near, self.run_jobs(jobs)):
            if r.error:
                raise DipacoError(r.error)
            out[i] = -np.array([lp for lp, _ in r.prompt], dtype=np.float64)
        return out

    def close(self) -> None:
        self.batcher.stop()


def _collector(result: Completion, lock: threading.Lock, left: list[int], done: threading.Event):
    def emit(kind: str, payload) -> None:
        if kind == "prompt":
            result.prompt = payload
        elif kind == "token":
            token, lp, top = payload
            result.tokens.append(token)
            result.logprobs.append(lp)
            result.top.append(top)
        else:
            if kind == "error":
                result.error = str(payload)
            result.finish = payload if kind == "done" else "error"
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
    return emit
