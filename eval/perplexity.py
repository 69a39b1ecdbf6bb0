"""Routed perplexity on the held-out documents of a shard directory, and the rows to compare it with.

Protocol (DiPaCo): the first ``context_tokens`` tokens of a document are the routing context and are
never scored; every method is scored on exactly the same target tokens.

A *method* gives every document a list of segments scored by one path or a mixture of paths; all methods of one run
share a ``Scorer`` (``dipaco.eval.scorer``), so each (path, round, document window) runs through the model at most
once. The routing rules the methods follow live with their saved files: ``dipaco.eval.once_policy`` and
``dipaco.eval.window_policy``.

Methods:
  routed        route once per document by the rule chosen on the router documents
                (``dipaco.eval.once_policy``): the shard router on its decoded first tokens (the same
                function that sharded it), or the path under which those tokens have the lowest loss
                (optionally with the shard router as a prior); dense runs: their single path
  shard-router  the shard router alone, when another rule was chosen (the paper's routing once)
  every-W       chunk 0 (W targets) takes the document's routed path; chunk k >= 1 the path a rule picks
                from what came before it (``dipaco.eval.window_policy``): the rule chosen on the
                router documents (by ``dipaco fit-window-router``, or here for a run without one);
                "stay" (= routed) is always a candidate. Targets keep the context of their scoring
                window, so with W >= the document length the result equals ``routed`` exactly.
  window-oracle-W  the best path for every W-token chunk (with the oracle): what every-W could reach
  window-oracle-W cross-fitted  the same, but each chunk's even targets take the path best on its odd ones and the
                other way round: the window oracle less its luck of choosing on the tokens it scores
  oracle        the path with the lowest loss on each whole document (a bound no router beats)
  oracle cross-fitted  the document oracle chosen on one half of the targets and scored on the other
  random        a seeded uniform path per document
  early-stop    ``routed`` with each path at its round of lowest validation loss (``dipaco.eval.early_stopping``)
  mixture-k     c-BTM: the k nearest paths, weights softmax(-d^2 / T) of the router distances
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dipaco.command_config import EvalCommandConfig as E  # the defaults, declared once
from dipaco.errors import DipacoError
from dipaco.eval.documents import SPLITS, check_compatible, route_documents, shard_router
from dipaco.eval.early_stopping import early_stopping_rounds, val_loss_by_round
from dipaco.eval.once_policy import find_once_policy, once_rule_of, route_once
from dipaco.eval.scorer import Scorer, Segment, once_segments, segments_of, summarise
from dipaco.eval.window_policy import (all_chunk_nll, candidates, chunk_cuts, decide, find_window_policy,
                                       pick_window_rule, rule_of, window_router_dir)
from dipaco.eval.window_router import load_window_router
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet


def check_mixture(k: int, run: Run) -> None:
    """K = 0 (no mixture) or 2 to the run's paths: a mixture of more paths than a run has would be labelled with
    a K it is not. A dense run has nothing to mix and ignores K."""
    n = run.grid.num_paths
    if k < 0 or k == 1 or (k > n and not run.is_dense):
        raise DipacoError(f"--mixture {k}: run {run.root} has {n} paths; give K from 2 to {n}")


def mixture_weights(topk: list[tuple[str, float]], temperature: float) -> list[tuple[str, float]]:
    """c-BTM: softmax(-d^2 / T) over the k nearest paths' squared distances."""
    if temperature <= 0:
        raise DipacoError(f"mixture temperature {temperature} is not valid; use a positive value (c-BTM: 0.1)")
    d = np.array([dist for _, dist in topk], dtype=np.float64)
    w = np.exp(-(d - d.min()) / temperature)
    w /= w.sum()
    return [(p, float(x)) for (p, _), x in zip(topk, w)]


def cross_fitted_oracle_nll(nll: np.ndarray) -> float:
    """NLL of one span (a chunk, a document) under its cross-fitted oracle: the targets at even positions take the path
    whose loss is lowest on the odd ones, and the other way round. ``nll``: (P, targets), every path's per-target NLL.

    The plain oracle (the path of lowest loss on the span, scored on that same span) also profits from choosing
    whichever path got lucky on these particular tokens; with short spans and several paths that luck is a good part of
    its lead. Choosing on one half and scoring on the other removes it: what is left is what (half of) the span's own
    text is worth to a one-path choice for that span. It is not a bound: a rule that pools what the whole document
    has said so far can do better (on the benchmark corpora, every-64's lagged-loss rules do)."""
    even, odd = nll[:, 0::2].sum(axis=1, dtype=np.float64), nll[:, 1::2].sum(axis=1, dtype=np.float64)
    return float(even[int(odd.argmin())] + odd[int(even.argmin())])


def cross_fitted_row(scorer: Scorer, paths: list[str], r: int, cuts: list[list[tuple[int, int]]], labels: list,
                     base: dict, routing: str) -> dict:
    """A cross-fitted oracle's row (``cross_fitted_oracle_nll`` per span): perplexity, tokens, per label. Its choice
    differs between the two halves of a span, so it has no per-path split."""
    per_doc = [(sum(cross_fitted_oracle_nll(np.stack([scorer.nll(p, r, d, lo, hi) for p in paths])) for lo, hi in cs),
                sum(hi - lo for lo, hi in cs)) for d, cs in enumerate(cuts)]
    return summarise(per_doc, {}, labels) | base | {"routing": routing}

# ------------------------------------------------------------------------------------------ methods
@dataclass
class RunMethods:
    """The methods of one run on one set of documents, each adding its row under the run's ``name``; they share the
    run's scorer, so a forward pass one method needs is never run twice."""

    run: Run
    shards: ShardSet
    ids: list[list[int]]
    labels: list
    r: int
    name: str
    progress: bool = True
    rows: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        self.scorer = Scorer(self.run, self.ids, self.run.config.eval.batch_size, self.progress)
        self.context = self.run.config.eval.context_tokens
        self.paths = self.run.grid.paths
        self.base = {"run": str(self.run.root), "round": self.r, "grid": self.run.info["grid"]}

    def add(self, method: str, segments: list[list[Segment]], **extra) -> None:
        per_doc, per_path = self.scorer.score(segments)
        for p in self.paths:  # a path no document reached still gets its (empty) row
            per_path.setdefault(p, [0.0, 0, 0])
        row = summarise(per_doc, per_path, self.labels) | self.base | extra
        self.rows[self.name if method == "routed" else f"{self.name} {method}"] = row

    def dense(self) -> None:
        self.add("routed", once_segments(route_documents(self.run, None, self.ids), self.ids, self.context, self.r),
                 routing="the single path of a dense run")

    def routed(self) -> None:
        """The run's once rule (``routes``), and the shard router's row beside it when the rule is another."""
        self.router = shard_router(self.shards, self.context)
        self.once_choice = find_once_policy(self.run, self.shards, self.progress)
        once = once_rule_of(self.once_choice["chosen"])
        self.routes = route_once(self.run, self.router, self.scorer, self.ids, self.r, self.once_choice)
        reads = self.router.input.tokens if once.one_path else self.context
        self.add("routed", once_segments(self.routes, self.ids, self.context, self.r), once_policy=self.once_choice,
                 routing=f"once, {once.name}: {once.describe(reads)}; chosen on the router documents "
                         f"({self.once_choice['reason']})")
        if once.kind != "shard-router":  # the paper's routing once, for comparison
            shard_routes = route_documents(self.run, self.router, self.ids)
            self.add("shard-router", once_segments(shard_routes, self.ids, self.context, self.r),
                     routing=f"once, shard router on the first {self.router.input.tokens} tokens")

    def every_w(self, w: int, oracle: bool) -> None:
        """Every-W routing by the run's every-W rule (and the best rule that runs one path, when that is another);
        with ``oracle``, the window oracles and every candidate rule scored on these documents."""
        window = load_window_router(self.run, self.shards, w)
        policy = find_window_policy(self.run, self.shards, self.router, w, self.r, self.once_choice, self.progress)
        rule, cuts = rule_of(policy["chosen"]), chunk_cuts(self.ids, self.context, w)
        chunk_nll = all_chunk_nll(self.scorer, self.paths, self.r, cuts) if rule.kind == "lagged-loss" or oracle else None
        choice = decide(rule, cuts, self.routes, self.ids, self.paths, self.router, window, chunk_nll)
        self.add(f"every-{w}", segments_of(cuts, choice, self.r), routing=f"every {w} tokens, {rule.name}: "
                 f"{rule.describe(w)}; chosen on the router documents ({policy['reason']})", policy=policy,
                 window_router=str(window_router_dir(self.run, w)) if window else None)
        single = policy.get("one_path")
        if single and single["name"] != policy["name"]:  # what serving one path at a time gets
            one = rule_of(single["chosen"])
            picks = decide(one, cuts, self.routes, self.ids, self.paths, self.router, window)
            self.add(f"every-{w} one-path", segments_of(cuts, picks, self.r),
                     routing=f"every {w} tokens, {one.name}: {one.describe(w)}; the best rule that runs one path, "
                             f"chosen on the router documents ({single['reason']})", policy=single)
        if oracle:
            self.window_oracle(w, cuts, chunk_nll, window)

    def window_oracle(self, w: int, cuts: list[list[tuple[int, int]]], chunk_nll: list[np.ndarray], window) -> None:
        """The bound every-W routing could reach: the best path for every chunk, scored on the chunk."""
        best = [[self.paths[int(j)] for j in c.argmin(axis=1)] if len(c) else [] for c in chunk_nll]
        self.add(f"window-oracle-{w}", segments_of(cuts, best, self.r), routing=f"best path per {w}-token chunk (oracle)")
        self.rows[f"{self.name} window-oracle-{w} cross-fitted"] = cross_fitted_row(
            self.scorer, self.paths, self.r, cuts, self.labels, self.base, f"best path per {w}-token chunk chosen on "
            "the chunk's other half of the targets (even/odd positions), scored on this half")
        # every candidate rule on these documents too, for the record (the choice was made on router documents)
        rules = candidates(w, self.router.input.tokens, window is not None)
        self.rows[f"{self.name} every-{w}"]["every_rule_here"] = pick_window_rule(
            rules, cuts, self.routes, self.ids, self.paths, chunk_nll, self.router, window)["scores"]

    def early_stop(self) -> None:
        picks = early_stopping_rounds(self.run)
        self.add("early-stop", once_segments(self.routes, self.ids, self.context, picks), routing="once", round=None,
                 rounds=picks)

    def mixture(self, k: int, temperature: float) -> None:
        topk = self.router.route_topk_ids(self.ids, k)
        mixes = [[(p, self.r, w) for p, w in mixture_weights(t, temperature)] for t in topk]
        lo = max(1, self.context)
        self.add(f"mixture-{k}", [[(lo, len(x), m)] for x, m in zip(self.ids, mixes)],
                 routing=f"mixture of the {k} nearest paths, T={temperature}")

    def random(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        picks = [self.paths[i] for i in rng.integers(0, self.run.grid.num_paths, len(self.ids))]
        self.add("random", once_segments(picks, self.ids, self.context, self.r),
                 routing=f"uniform random path per document (seed {seed})")

    def oracle(self) -> None:
        """The path of lowest loss on each whole document, and its cross-fitted twin."""
        lo, r = max(1, self.context), self.r
        self.scorer.ensure([[(lo, len(x), [(p, r, 1.0)]) for p in self.paths] for x in self.ids])

        def loss(p: str, d: int, x: list[int]) -> float:
            return float(self.scorer.nll(p, r, d, lo, len(x)).sum(dtype=np.float64)) if len(x) > lo else 0.0

        best = [min(self.paths, key=lambda p: loss(p, d, x)) for d, x in enumerate(self.ids)]
        self.add("oracle", once_segments(best, self.ids, self.context, r), routing="best path per document (oracle)")
        self.rows[f"{self.name} oracle cross-fitted"] = cross_fitted_row(
            self.scorer, self.paths, r, [[(lo, len(x))] if len(x) > lo else [] for x in self.ids], self.labels,
            self.base, "best path per document chosen on the document's other half of the targets (even/odd "
                       "positions), scored on this half")


def evaluate_run(run: Run, shards: ShardSet, docs: list[dict], ids: list[list[int]], round: int | None = None,
                 progress: bool = True, route_every: list[int] = (), oracle: bool = False, random: bool = False,
                 early_stopping: bool = False, mixture: int = 0, temperature: float = E.temperature, seed: int = E.seed,
                 name: str = "run") -> dict[str, dict]:
    """Rows {method name: summary} for one run: ``name`` (routed) plus the requested extras."""
    check_compatible(run, shards)
    r = run.latest() if round is None else round
    if r not in run.rounds:
        raise DipacoError(f"run {run.root} has no round {r}; available: {run.rounds}")
    methods = RunMethods(run, shards, ids, [d.get("label") for d in docs], r, name, progress)
    if run.is_dense:
        methods.dense()
        return methods.rows
    methods.routed()
    for w in route_every:
        methods.every_w(w, oracle)
    if early_stopping:
        methods.early_stop()
    if mixture > 1:
        methods.mixture(mixture, temperature)
    if random:
        methods.random(seed)
    if oracle:
        methods.oracle()
    return methods.rows


def evaluate(runs: dict[str, str | Path], shards_dir: str | Path, round: int | None = None, progress: bool = True,
             baseline: str | Path | None = None, route_every: list[int] = (), oracle: bool = False,
             random: bool = False, early_stopping: bool = False, mixture: int = 0, temperature: float = E.temperature,
             seed: int = E.seed, split: str = E.split) -> dict:
    """Report for several runs on the same tokens: {"methods": {name: {...}}, ...}.

    ``split`` "heldout" scores the held-out documents (the test set); "val" the validation documents
    of every path (to choose settings on). ``baseline`` adds a dense run (grid 1) as the row "dense
    baseline"; the extra methods apply to every routed (non-dense) run.
    """
    if split not in SPLITS:
        raise DipacoError(f"--split {split!r} is unknown; use 'heldout' (test documents) or 'val' (validation documents)")
    if any(w < 1 for w in route_every):
        raise DipacoError(f"--route-every {min(route_every)} is not valid; give a window of at least 1 token")
    if mixture < 0 or mixture == 1 or (mixture > 1 and temperature <= 0):
        raise DipacoError(f"--mixture {mixture} with temperature {temperature} is not valid; use k >= 2 and T > 0 (c-BTM: 0.1)")
    shards = ShardSet(shards_dir)
    loaded = {name: Run(path) for name, path in runs.items()}
    for run in loaded.values():
        if round is not None and round not in run.rounds:
            raise DipacoError(f"run {run.root} has no round {round}; available: {run.rounds}")
    if baseline is not None:
        b = Run(baseline)
        if not b.is_dense:
            raise DipacoError(f"--baseline {baseline} has grid {b.info['grid']}; give a dense run (trained with --grid 1)")
        loaded["dense baseline"] = b
    if not loaded:
        raise DipacoError("no run to evaluate; pass --run RUN")
    for run in loaded.values():
        check_mixture(mixture, run)
    max_tokens = max(r.config.eval.max_tokens_per_doc for r in loaded.values())
    contexts = {r.config.eval.context_tokens for r in loaded.values()}
    if len(contexts) > 1:
        raise DipacoError(f"runs use different eval.context_tokens {sorted(contexts)}; compare runs with the same setting")
    docs, ids = SPLITS[split](shards, max_tokens)
    methods, early, curves = {}, {}, {}
    for name, run in loaded.items():
        rows = evaluate_run(run, shards, docs, ids, round, progress, route_every, oracle, random, early_stopping,
                            mixture, temperature, seed, name)
        methods.update(rows)
        for row in rows.values():
            if row.get("rounds"):
                early[name] = row["rounds"]
        curve = val_loss_by_round(run)
        if len(curve) > 1:
            curves[name] = {str(r): {"val_loss_mean": sum(v.values()) / len(v), "val_perplexity": math.exp(sum(v.values()) / len(v)),
                                     "per_path": v} for r, v in sorted(curve.items())}
    report = {"shards": str(Path(shards_dir).resolve()), "context_tokens": contexts.pop(), "split": split,
              "documents": len(docs), "heldout_documents": len(docs) if split == "heldout" else None, "methods": methods}
    if early:
        report["early_stopping"] = early
    if curves:
        report["rounds_curve"] = curves
    return report
