"""A routed dipaco run as a model of EleutherAI's lm-evaluation-harness: ``simple_evaluate(model="dipaco",
model_args="run=RUN[,route_every=W][,path=ID][,routing=shard][,rolling=all]")`` once this module is imported, or
``dipaco lm-eval`` (dipaco/cli/lm_eval_command.py), because the harness's own CLI finds models only in its own package.

Routing, per request, by its context only (never its continuation), so every choice of a multiple-choice question is
scored by one path:

- ``loglikelihood`` and ``generate_until``: the context's tokens are routed as a document is, by the run's once rule on
  its first ``eval.context_tokens`` tokens (``dipaco.eval.once_policy.route_once``, the function ``dipaco eval`` routes
  with). A context shorter than that is routed by the tokens it has: the shard router reads what there is, a
  prefix-loss rule scores what there is and, under two tokens, falls back to the shard router. The model then reads the
  whole context (the last ``max_seq_len`` tokens with the continuation, as the harness's ``hf`` model does).
- ``loglikelihood_rolling`` (``rolling=dipaco``, the default) scores a text as ``dipaco eval`` scores a held-out
  document: its first ``eval.context_tokens`` tokens route it and are never scored, the rest is scored in
  non-overlapping windows of ``max_seq_len`` tokens by the routed path, or with ``route_every=W`` by the path the run's
  every-W rule picks for every W tokens (``dipaco eval --route-every W``). The log-likelihood is that of the scored
  tokens only, so the harness's word and byte perplexities, which count the whole text, are not comparable with other
  models' there: ``rolling=all`` scores every token the way the harness's ``hf`` model does (windows of the harness,
  the first token read after the tokenizer's BOS, else EOS), routed once by the text's first tokens.
- ``generate_until`` with ``route_every=W`` is re-routed after every W new tokens by the run's every-W rule for
  generation, as ``dipaco generate --route-every W`` is (segments of one path each).
- ``path=ID`` skips routing (one path, as an exported path is); ``routing=shard`` routes by the shard router alone.

The path of every request rides on its response (``.route``: a path id, or the path of every W-token chunk or segment), through
the harness's response cache too; ``add_paths(results)`` writes them into the per-sample output as ``dipaco_paths``
and a count per task into ``results["dipaco"]``. Requests of all paths are submitted at once to the serving engine
(``dipaco.eval.serve.engine``), which batches them by path and loads only the paths they need.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np
from tqdm.auto import tqdm

from dipaco.errors import DipacoError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:
    raise DipacoError('lm-evaluation-harness is not installed; install the eval extra: pip install -e ".[eval]"') \
        from None

from dipaco.eval.documents import shard_router
from dipaco.eval.once_policy import route_once
from dipaco.eval.scorer import Scorer, once_segments, segments_of
from dipaco.eval.serve.batcher import Job
from dipaco.eval.serve.engine import Engine

ROLLING = ("dipaco", "all")


class Scored(tuple):
    """(log-likelihood, is_greedy) of a continuation; ``.route``: the path that scored it."""
    route = None


class RollingLL(float):
    """A text's log-likelihood; ``.route``: its path (or every chunk's path), ``.tokens``: the tokens scored."""
    route = None
    tokens = 0


class Generated(str):
    """A generated continuation; ``.route``: the path that wrote it."""
    route = None


def _tagged(cls, value, route, **extra):
    out = cls(value)
    out.route = route
    for k, v in extra.items():
        setattr(out, k, v)
    return out


class EngineScorer(Scorer):
    """``dipaco.eval.scorer.Scorer`` whose forward passes run through the engine's batcher: every path's windows are
    submitted at once, so dipaco eval's routing and scoring functions run unchanged on the harness's texts."""

    def __init__(self, lm: "DipacoLM", ids: list[list[int]], desc: str):
        super().__init__(lm.engine.rr.run, ids, lm.engine.batcher.max_batch, lm.progress)
        self.lm, self.desc = lm, desc

    def ensure(self, segments) -> None:
        keys, jobs = [], []
        for key, todo in self.missing(segments).items():
            for d, j in todo:
                keys.append((key, (d, j)))
                jobs.append(Job(key[0], self.ids[d][j * self.seq_len:(j + 1) * self.seq_len + 1], 0, None,
                                prompt_logprobs=True))
        for (key, dj), done in zip(keys, self.lm.run_jobs(jobs, self.desc)):
            self.cache.setdefault(key, {})[dj] = -np.array([lp for lp, _ in done.prompt], dtype=np.float32)


@register_model("dipaco")
class DipacoLM(TemplateLM):
    """A trained dipaco run, routed per request (module docstring)."""

    def __init__(self, run=None, shards=None, route_every=0, path=None, routing="run", rolling="dipaco", round=None,
                 max_memory=None, batch_size=None, max_batch_size=None, max_gen_toks=256, progress=True, device=None,
                 **unknown):
        super().__init__()
        if unknown:
            raise DipacoError(f"model_args {', '.join(sorted(unknown))} unknown to the dipaco model; it takes run, "
                              f"shards, route_every, path, routing, rolling, round, max_memory, max_gen_toks")
        if run is None:
            raise DipacoError("the dipaco model needs a run: --model_args run=RUN (a trained run directory)")
        if rolling not in ROLLING:
            raise DipacoError(f"rolling={rolling!r} is not valid; use 'dipaco' (score as dipaco eval: the routing "
                              f"context unscored) or 'all' (every token, as the harness's hf model)")
        if device not in (None, "cpu"):
            raise DipacoError(f"device={device!r}: the dipaco model runs on the CPU; leave --device out")
        self.route_every = int(route_every or 0)
        if self.route_every < 0:
            raise DipacoError(f"route_every={route_every} is not valid; use W > 0 tokens, or 0 to route once")
        if self.route_every and (rolling != "dipaco" or path is not None):
            raise DipacoError("route_every re-routes generations and rolling=dipaco texts; it goes with neither path= "
                              "nor rolling=all: drop one of them")
        size = batch_size if isinstance(batch_size, int) or str(batch_size or "").isdigit() else 32  # "auto": default
        self.engine = Engine(run=str(run), shards=shards, routing=routing, max_memory=max_memory,
                             max_batch=int(size or 32), round=round, route_every=self.route_every)
        self.rr, self.rolling, self.progress = self.engine.rr, rolling, bool(progress)
        self.run = self.rr.run
        self.context = self.run.config.eval.context_tokens
        self.r = self.engine.source.round
        try:
            self.path = None if path is None else self.rr.check_path(str(path))
            self.router = None if self.run.is_dense else shard_router(self.rr.shards, self.context)
        except DipacoError:
            self.engine.close()  # its threads
            raise
        self.max_gen = int(max_gen_toks)
        self.tokenizer = self.engine.tokenizer

    # ------------------------------------------------------------------ harness contract
    @property
    def eot_token_id(self) -> int:
        return self.engine.eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id  # as the harness's hf model: BOS, else EOS
        return bos if bos is not None else self.engine.eos

    @property
    def max_length(self) -> int:
        return self.engine.max_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.rr.shards.root / "tokenizer")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return list(self.tokenizer(string, add_special_tokens=False)["input_ids"])

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ routing
    def policy(self) -> dict | None:
        """The once policy requests are routed by (None: a dense run or a pinned path)."""
        if self.path is not None or self.run.is_dense:
            return None
        if self.engine.routing == "shard":
            return {"chosen": {"kind": "shard-router"}, "name": "shard-router", "reason": "routing=shard"}
        return self.rr.find_once_policy()

    def describe(self) -> str:
        if self.path is not None:
            return f"path {self.path} for every request (path=)"
        if self.run.is_dense:
            return "the single path of a dense run"
        policy = self.policy()
        every = f"; rolling: every {self.route_every} tokens by the run's every-W rule" if self.route_every else ""
        return f"once per request by its context's first {self.context} tokens, {policy['name']}{every}"

    def routes(self, texts: list[list[int]], desc: str) -> list[str]:
        """The path of every token list under the run's once rule, as ``dipaco eval`` routes a document (identical
        routing prefixes are routed once; a prefix-loss rule's forward passes go through the batcher together)."""
        if self.path is not None:
            return [self.path] * len(texts)
        if self.run.is_dense:
            return [self.rr.paths[0]] * len(texts)
        keys = list(dict.fromkeys(tuple(t[:self.context]) for t in texts))
        ids = [list(k) for k in keys]
        scorer = EngineScorer(self, ids, f"{desc}: routing")
        picks = route_once(self.run, self.router, scorer, ids, self.r, self.policy())
        by_key = dict(zip(keys, picks))
        return [by_key[tuple(t[:self.context])] for t in texts]

    # ------------------------------------------------------------------ jobs
    def run_jobs(self, jobs: list[Job], desc: str, on_token=None) -> list:
        """Submit every job at once (the batcher groups them by path, longest first within a path) and wait, with a
        progress bar. ``on_token(i, completion)`` may cancel job i after each new token (a stop sequence)."""
        from dipaco.eval.serve.engine import Completion, _collector

        results = [Completion() for _ in jobs]
        if not jobs:
            return results
        left, done, lock = [len(jobs)], threading.Event(), threading.Lock()
        bar = tqdm(total=len(jobs), desc=desc, disable=not self.progress, dynamic_ncols=True)

        def emitter(i: int, job: Job):
            collect = _collector(results[i], lock, left, done)

            def emit(kind, payload):
                if kind in ("done", "error"):
                    bar.update(1)  # before the last one wakes the caller, who closes the bar
                collect(kind, payload)
                if kind == "token" and on_token is not None:
                    job.cancelled = job.cancelled or on_token(i, results[i])
            return emit

        order = sorted(range(len(jobs)), key=lambda i: (jobs[i].path, -len(jobs[i].ids)))
        for i in order:
            jobs[i].emit = emitter(i, jobs[i])
        for i in order:
            self.engine.submit(jobs[i])
        done.wait()
        bar.close()
        failed = next((r.error for r in results if r.error), None)
        if failed:
            raise DipacoError(failed)
        return results

    # ------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[Scored]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[Scored]:
        L = self.max_length
        for (context, continuation), _, cont in requests:
            if len(cont) > L:
                raise DipacoError(f"a continuation of {len(cont)} tokens is longer than the model's {L}-token window")
        paths = self.routes([ctx for _, ctx, _ in requests], "loglikelihood")
        unique: dict[tuple, int] = {}
        for (_, ctx, cont), p in zip(requests, paths):
            unique.setdefault((p, tuple((ctx + cont)[-(L + 1):])), len(unique))
        jobs = [Job(p, list(ids), 0, None, top_logprobs=1, prompt_logprobs=True) for p, ids in unique]
        done = self.run_jobs(jobs, "loglikelihood")
        out = []
        for (key, ctx, cont), p in zip(requests, paths):
            ids = (ctx + cont)[-(L + 1):]
            scored = done[unique[(p, tuple(ids))]].prompt[len(ids) - 1 - len(cont):]
            ll = float(sum(lp for lp, _ in scored))
            greedy = all(top[0][0] == t for (_, top), t in zip(scored, cont))
            out.append(_tagged(Scored, (ll, greedy), p))
            self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    # ------------------------------------------------------------------ rolling
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[RollingLL]:
        texts = [req.args[0] for req in requests]
        ids = [self.tok_encode(t) for t in texts]
        out = self._rolling_dipaco(ids) if self.rolling == "dipaco" else self._rolling_all(ids)
        for text, res in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), res)
        return out

    def _rolling_dipaco(self, ids: list[list[int]]) -> list[RollingLL]:
        """Each text as dipaco eval scores a held-out document (``RunMethods.routed`` / ``every_w``)."""
        first = self.routes(ids, "loglikelihood_rolling")
        scorer = EngineScorer(self, ids, "loglikelihood_rolling")
        if self.route_every:
            from dipaco.eval.window_policy import all_chunk_nll, chunk_cuts, decide, find_window_policy, rule_of
            from dipaco.eval.window_router import load_window_router

            w = self.route_every
            window = load_window_router(self.run, self.rr.shards, w)
            policy = find_window_policy(self.run, self.rr.shards, self.router, w, self.r, self.policy(), self.progress)
            rule, cuts = rule_of(policy["chosen"]), chunk_cuts(ids, self.context, w)
            chunk_nll = all_chunk_nll(scorer, self.rr.paths, self.r, cuts) if rule.kind == "lagged-loss" else None
            choice = decide(rule, cuts, first, ids, self.rr.paths, self.router, window, chunk_nll)
            segments, routes = segments_of(cuts, choice, self.r), choice
        else:
            segments, routes = once_segments(first, ids, self.context, self.r), first
        per_doc, _ = scorer.score(segments)
        return [_tagged(RollingLL, -nll, route, tokens=n) for (nll, n), route in zip(per_doc, routes)]

    def _rolling_all(self, ids: list[list[int]]) -> list[RollingLL]:
        """Every token, in the harness's rolling windows (those of its hf model), by the text's routed path."""
        paths = self.routes(ids, "loglikelihood_rolling")
        windows, owner = [], []
        for d, (x, p) in enumerate(zip(ids, paths)):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=x, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((p, ctx + cont, len(cont)))
                owner.append(d)
        done = self.run_jobs([Job(p, x, 0, None, prompt_logprobs=True) for p, x, _ in windows], "loglikelihood_rolling")
        total = [0.0] * len(ids)
        for (_, x, n), d, res in zip(windows, owner, done):
            total[d] += float(sum(lp for lp, _ in res.prompt[len(x) - 1 - n:]))
        return [_tagged(RollingLL, t, p, tokens=len(x)) for t, p, x in zip(total, paths, ids)]

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[Generated]:
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        contexts, jobs, stops = [], [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise DipacoError(f"max_gen_toks {max_new} leaves no room for the context in the model's "
                                  f"{self.max_length}-token window; set a smaller max_gen_toks in the task's "
                                  f"generation_kwargs (or --gen_kwargs)")
            ctx = self.tok_encode(context) or [self.prefix_token_id]
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
            contexts.append(ctx)
            stops.append([s for s in until if s])
            jobs.append(Job("", ctx[-(self.max_length - max_new):], max_new, None,
                            temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                            top_p=float(kwargs.get("top_p", 1.0)), seed=kwargs.get("seed", i)))
        for job, p in zip(jobs, self.routes(contexts, "generate_until")):
            job.path = p

        def stopped(i: int, tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens[-64:], skip_special_tokens=True)  # a stop sequence ends in these
            return any(s in text for s in stops[i])

        if self.route_every and not self.run.is_dense:
            new, routes = self._generate_every_w(jobs, stopped)
        else:
            done = self.run_jobs(jobs, "generate_until", on_token=lambda i, res: stopped(i, res.tokens))
            new, routes = [res.tokens for res in done], [job.path for job in jobs]
        out = []
        for req, tokens, route, until in zip(requests, new, routes, stops):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for s in until:
                text = text.split(s)[0]
            out.append(_tagged(Generated, text, route))
            self.cache_hook.add_partial("generate_until", req.args, out[-1])
        return out

    def _generate_every_w(self, jobs: list[Job], stopped) -> tuple[list[list[int]], list[list[str]]]:
        """Generation re-routed after every W new tokens, as ``dipaco generate --route-every W``: each segment is a job
        of the context so far on its path, and the engine's every-W rule picks the next path from what came before.
        Returns every request's new tokens and the path of each of its segments."""
        first = [job.path for job in jobs]
        current, new, spans, paths = list(first), [[] for _ in jobs], [[] for _ in jobs], [[] for _ in jobs]
        todo = list(range(len(jobs)))
        while todo:
            segment = [Job(current[i], jobs[i].ids + new[i], min(self.route_every, jobs[i].max_new - len(new[i])), None,
                           temperature=jobs[i].temperature, top_p=jobs[i].top_p,
                           seed=None if jobs[i].seed is None else jobs[i].seed + len(spans[i])) for i in todo]
            done = self.run_jobs(segment, f"generate_until, segment {len(spans[todo[0]]) + 1}",
                                 on_token=lambda k, res: stopped(todo[k], new[todo[k]] + res.tokens))
            going = []
            for i, res in zip(todo, done):
                new[i] += res.tokens
                spans[i].append(len(res.tokens))
                paths[i].append(current[i])
                if res.finish == "length" and len(new[i]) < jobs[i].max_new:  # not ended by a stop or end of text
                    current[i] = self.engine.next_path(jobs[i].ids + new[i], first[i], current[i], spans[i])
                    going.append(i)
            todo = going
        return new, paths


def add_paths(results: dict, lm: DipacoLM | None = None) -> dict:
    """Write every request's path into the harness's per-sample output (``dipaco_paths``, one entry per request of
    the sample, from its first response) and into ``results["dipaco"]``: the requests per path of every task and, for
    a rolling task, the perplexity per scored token (with ``rolling=dipaco``, the number ``dipaco eval`` reports for
    the same documents: the harness's word and byte perplexities count the unscored routing context too)."""
    counts, tokens = {}, {}
    for task, samples in (results.get("samples") or {}).items():
        count, nll, n = Counter(), 0.0, 0
        for sample in samples:
            first = [resps[0] if resps else None for resps in sample["resps"]]
            routes = [getattr(r, "route", None) for r in first]
            sample["dipaco_paths"] = routes
            for r in routes:  # a request re-routed every W tokens counts once under each path it used
                count.update(str(p) for p in dict.fromkeys(r if isinstance(r, list) else [r]))
            for r in first:
                if isinstance(r, RollingLL):
                    nll, n = nll - float(r), n + r.tokens
        counts[task] = dict(sorted(count.items()))
        if n:
            tokens[task] = {"perplexity": math.exp(nll / n), "tokens": n}
    info = {"requests_per_path": counts, "token_perplexity": tokens}
    if lm is not None:
        info |= {"run": str(lm.run.root), "round": lm.r, "routing": lm.describe(), "rolling": lm.rolling}
    results["dipaco"] = info
    return results
