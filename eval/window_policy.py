"""Every-W routing that never hurts: the candidate rules for re-routing a document every W tokens, the choice among
them on the router documents (never the held-out ones), and the file that keeps the choice
(``RUN/window_routers/w<W>/policy.json``, beside the window router ``dipaco fit-window-router`` fits).

The names say what each step does: ``pick_window_rule`` picks the best rule from every path's loss on every chunk
(pure); ``window_policy_from_losses`` turns those losses on the router documents into the policy as saved;
``choose_window_policy`` scores the router documents first (for a run without a saved policy); ``find_window_policy``
reads the saved policy, or chooses one now.

Chunk 0 of a document (its first W scored tokens) takes the document's path (the run's once rule,
``dipaco.eval.once_policy``); chunk k >= 1 takes the path a *rule* picks from what came before it:

  stay                     the document's path: routing once, bit for bit
  shard-router (L)         the shard router on the L tokens before the chunk
  window-router (m)        the fitted window router (``dipaco fit-window-router``: the previous W tokens' features and
                           the document's path); it leaves the document's path only when its probability for another
                           path is higher by more than m
  lagged-loss (n, m)       the path with the lowest loss on the previous n chunks (n = 0: everything scored so far),
                           leaving the previous chunk's path only when it is beaten by more than m nats per token.
                           It needs every path's loss on the text so far: P forward passes instead of one (the paper's
                           small transformer router costs less; the scores here are what such a router learns to predict)

``pick_window_rule`` scores every path on every chunk of the router documents once, adds up each rule's chunks (a chunk's
loss does not depend on the other chunks' paths: every token keeps its preceding context) and picks the lowest;
``stay`` wins ties, and wins outright when there are too few chunks to tell rules apart. The window router is fitted
on these same documents, so its rules are scored with out-of-fold decisions (each document's windows decided by a
router fitted without it). It also picks the best of the rules that run a single path per chunk (``one_path``: all but
lagged-loss), for serving one path at a time (``dipaco generate``). The window oracle (the best path per chunk, scored
on the chunk) bounds every rule.

Why the router documents and not the validation documents: the validation documents were sorted into paths by the
shard router and sit in the sample its k-means was fitted on, so every rule that leans on the shard router looks
better there than on new text (docs/routing.md has the figures).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dipaco.eval.documents import router_tokens
from dipaco.eval.once_policy import route_once
from dipaco.eval.policy_check import damaged, read_object, rule_problem
from dipaco.eval.scorer import Scorer
from dipaco.routing.router import BaseRouter
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet

MIN_CHUNKS = 200  # fewer re-routed chunks than this: too few to trust a rule over routing once
RULE_KINDS = ("stay", "shard-router", "window-router", "lagged-loss")


@dataclass(frozen=True)
class Rule:
    kind: str                 # "stay" | "shard-router" | "window-router" | "lagged-loss"
    margin: float = 0.0
    lookback: int = 0         # shard-router: tokens read; lagged-loss: chunks (0 = everything so far)

    @property
    def name(self) -> str:
        if self.kind == "stay":
            return "stay"
        if self.kind == "shard-router":
            return f"shard-router L={self.lookback}"
        if self.kind == "window-router":
            return f"window-router m={self.margin:g}"
        return f"lagged-loss n={self.lookback or 'all'} m={self.margin:g}"

    def describe(self, w: int) -> str:
        return {"stay": "the document's path for every chunk (= routing once)",
                "shard-router": f"the shard router on the {self.lookback} tokens before each chunk",
                "window-router": f"the window router on the previous {w} tokens and the document's path, switching "
                                 f"when it prefers another path by more than {self.margin:g} in probability",
                "lagged-loss": f"the path with the lowest loss on the {'text so far' if not self.lookback else f'previous {self.lookback} chunk(s)'}"
                               f", switching when it beats the current path by more than {self.margin:g} nats/token "
                               f"(scores every path)"}[self.kind]

    @property
    def one_path(self) -> bool:
        """It runs one path per chunk, as routing once does (lagged-loss scores every path)."""
        return self.kind != "lagged-loss"

    def forward_passes(self, paths: int) -> int:
        """Model forward passes per scored token, relative to routing once (one path reads each token): lagged-loss
        runs every one of ``paths`` paths over the text; the routers read features, not the model."""
        return paths if self.kind == "lagged-loss" else 1

    def to_dict(self) -> dict:
        return asdict(self)


def candidates(w: int, prefix_tokens: int, window_router: bool) -> list[Rule]:
    rules = [Rule("stay"), Rule("shard-router", lookback=prefix_tokens)]
    if w != prefix_tokens:
        rules.append(Rule("shard-router", lookback=w))
    rules += [Rule("lagged-loss", margin=m, lookback=n) for n in (1, 2, 0) for m in (0.0, 0.05, 0.1, 0.2, 0.4)]
    if window_router:
        rules += [Rule("window-router", margin=m) for m in (0.0, 0.1, 0.2, 0.4)]
    return rules


def chunk_cuts(ids: list[list[int]], context: int, w: int) -> list[list[tuple[int, int]]]:
    """[lo, hi) of every chunk of every document: W scored tokens each, after the unscored context."""
    lo0 = max(1, context)
    return [[(lo, min(lo + w, len(x))) for lo in range(lo0, len(x), w)] for x in ids]


def decide(rule: Rule, cuts: list[list[tuple[int, int]]], first: list[str], ids: list[list[int]], paths: list[str],
           router=None, window_router=None, chunk_nll: list[np.ndarray] | None = None,
           window_logits: np.ndarray | None = None) -> list[list[str]]:
    """The path of every chunk of every document under ``rule``. ``chunk_nll[d]``: (chunks, P) NLL sums of document d
    (lagged-loss only); ``router``: the shard router; ``window_router``: the fitted one, or ``window_logits``: its
    logits for every chunk k >= 1 in document order, computed elsewhere (out of fold)."""
    out = [[first[d]] * len(cs) for d, cs in enumerate(cuts)]
    later = [(d, k, lo) for d, cs in enumerate(cuts) for k, (lo, _) in enumerate(cs) if k]
    if rule.kind == "stay" or not later:
        return out
    if rule.kind == "shard-router":
        picks = router.route_ids([ids[d][max(0, lo - rule.lookback):lo] for d, _, lo in later])
        for (d, k, _), p in zip(later, picks):
            out[d][k] = p
    elif rule.kind == "window-router":
        anchors = np.array([paths.index(first[d]) for d, _, _ in later])
        if window_logits is None:
            span = window_router.input.tokens
            x = window_router.features.transform(window_router.input.texts_of_ids([ids[d][max(0, lo - span):lo] for d, _, lo in later]))
            window_logits = window_router.window_logits(x, anchors)
        logits = np.asarray(window_logits)
        prob = np.exp(logits - logits.max(axis=1, keepdims=True))
        prob /= prob.sum(axis=1, keepdims=True)
        best = prob.argmax(axis=1)
        switch = prob[np.arange(len(best)), best] - prob[np.arange(len(best)), anchors] > rule.margin
        for (d, k, _), b, s in zip(later, best, switch):
            out[d][k] = paths[b] if s else first[d]
    elif rule.kind == "lagged-loss":
        for d, cs in enumerate(cuts):
            current = paths.index(first[d])
            sizes = np.array([hi - lo for lo, hi in cs], dtype=np.float64)
            for k in range(1, len(cs)):
                start = 0 if rule.lookback == 0 else max(0, k - rule.lookback)
                per_token = chunk_nll[d][start:k].sum(axis=0) / sizes[start:k].sum()
                best = int(per_token.argmin())
                if per_token[current] - per_token[best] > rule.margin:
                    current = best
                out[d][k] = paths[current]
    else:
        raise ValueError(f"unknown rule {rule.kind!r}")
    return out


def all_chunk_nll(scorer, paths: list[str], r: int, cuts: list[list[tuple[int, int]]]) -> list[np.ndarray]:
    """(chunks, P) NLL sums per document: every path on every chunk (scored once, shared by every rule and the oracle)."""
    scorer.ensure([[(cs[0][0], cs[-1][1], [(p, r, 1.0)]) for p in paths] if cs else [] for cs in cuts])
    return [np.array([[scorer.nll(p, r, d, lo, hi).sum(dtype=np.float64) for p in paths] for lo, hi in cs]).reshape(len(cs), len(paths))
            for d, cs in enumerate(cuts)]


def total_nll(choice: list[list[str]], chunk_nll: list[np.ndarray], paths: list[str]) -> float:
    index = {p: j for j, p in enumerate(paths)}
    return float(sum(chunk_nll[d][k, index[p]] for d, ps in enumerate(choice) for k, p in enumerate(ps)))


def pick_window_rule(rules: list[Rule], cuts, first, ids, paths, chunk_nll, router=None, window_router=None,
           window_logits: np.ndarray | None = None, where: str = "router documents") -> dict:
    """Every rule's perplexity on these chunks (of the ``where`` documents) and the chosen rule, with the reason."""
    tokens = sum(hi - lo for cs in cuts for lo, hi in cs)
    later = sum(max(0, len(cs) - 1) for cs in cuts)
    scores = {}
    for rule in rules:
        choice = decide(rule, cuts, first, ids, paths, router, window_router, chunk_nll, window_logits)
        scores[rule.name] = total_nll(choice, chunk_nll, paths)
    oracle = float(sum(c.min(axis=1).sum() for c in chunk_nll if len(c)))
    best = _pick(rules, scores, later, tokens, oracle, where)
    one_path = _pick([r for r in rules if r.one_path], scores, later, tokens, oracle, where)
    return {**best, "chunks": later, "tokens": tokens, "scores": {n: _ppl(s, tokens) for n, s in scores.items()},
            "window_oracle": _ppl(oracle, tokens), "one_path": one_path}


def _pick(rules: list[Rule], scores: dict[str, float], later: int, tokens: int, oracle: float, where: str) -> dict:
    """The rule with the lowest total NLL (``stay`` on ties, and when there are too few chunks to trust another)."""
    by_name = {rule.name: rule for rule in rules}
    best = min(rules, key=lambda rule: (scores[rule.name], rule.kind != "stay"))
    if later < MIN_CHUNKS and best.kind != "stay":
        reason = (f"only {later} re-routed chunks in the {where} (< {MIN_CHUNKS}): too few to trust "
                  f"{best.name} ({_ppl(scores[best.name], tokens):.3f}) over routing once ({_ppl(scores['stay'], tokens):.3f})")
        best = by_name["stay"]
    elif best.kind == "stay":
        reason = f"no rule beat routing once on {later} chunks of the {where}"
    else:
        reason = (f"lowest perplexity on {later} chunks of the {where}: {_ppl(scores[best.name], tokens):.3f} vs "
                  f"{_ppl(scores['stay'], tokens):.3f} routing once (window oracle {_ppl(oracle, tokens):.3f})")
    return {"chosen": best.to_dict(), "name": best.name, "reason": reason}


def rule_of(d: dict) -> Rule:
    return Rule(d["kind"], float(d.get("margin", 0.0)), int(d.get("lookback", 0)))


# ---------------------------------------------------------------------- the run's every-W policy
def window_router_dir(run: Run, w: int) -> Path:
    return run.root / "window_routers" / f"w{w}"


def window_policy_file(run: Run, w: int) -> Path:
    return window_router_dir(run, w) / "policy.json"


def fit_window_router_again(run: Run, shards, w: int) -> str:
    return f"dipaco fit-window-router --run {run.root} --shards {shards.root} --window {w} --overwrite"


def read_window_policy(run: Run, shards, w: int) -> dict | None:
    """The every-``w`` rule saved with the run (``dipaco fit-window-router``), or None when it has none. A rule that
    needs the window router needs its files beside it."""
    f = window_policy_file(run, w)
    if not f.exists():
        return None
    rewrite = fit_window_router_again(run, shards, w)
    policy = read_object(f, rewrite)
    rules = [policy.get("chosen")] + ([policy["one_path"].get("chosen") if isinstance(policy["one_path"], dict) else None]
                                      if "one_path" in policy else [])
    problem = next((p for p in (rule_problem(rule, RULE_KINDS) for rule in rules) if p), None)
    if problem is None and not isinstance(policy.get("reason"), str):
        problem = "no 'reason' of the rule"
    if problem is None and any(r["kind"] == "window-router" for r in rules) and not (f.parent / "router.json").is_file():
        problem = "its rule needs the window router, and router.json is missing"
    if problem is not None:
        raise damaged(f, problem, rewrite)
    return policy


def stale_window_policy(saved: dict, once_name: str) -> str | None:
    """Why a saved every-W ``policy.json`` must not be followed, or None: one chosen while routing once used another
    rule than ``once_name`` (its "stay" was another path)."""
    if saved["once_rule"] != once_name:
        return f"was chosen when routing once used {saved['once_rule']} (re-run dipaco fit-window-router --overwrite)"
    return None


def find_window_policy(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict,
                       progress: bool = True) -> dict:
    """The rule of every-W routing for this run: the one ``dipaco fit-window-router`` chose on the router documents
    (``RUN/window_routers/w<W>/policy.json``), or, for a run without one (or a stale one,
    ``stale_window_policy``), the one the router documents choose now among the rules that need no fitting. ``router``: the shard router; ``once``: the
    run's once policy."""
    saved = read_window_policy(run, shards, w)
    why = "chosen now on the router documents"
    if saved is not None:
        stale = stale_window_policy(saved, once["name"])
        f = window_policy_file(run, w)
        if stale is None:
            return saved | {"source": str(f)}
        why += f": {f} {stale}"
    return choose_window_policy(run, shards, router, w, r, once, progress) | {"source": why}


def choose_window_policy(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict,
                         progress: bool = True) -> dict:
    """The every-W rule among those that need no fitting (stay, the shard router, the lagged loss), chosen on every
    chunk of the router documents (never the validation or held-out ones: the module docstring says why)."""
    ids = router_tokens(shards, run.config.eval.max_tokens_per_doc)
    scorer = Scorer(run, ids, run.config.eval.batch_size, progress)
    chunk_nll = all_chunk_nll(scorer, run.grid.paths, r, chunk_cuts(ids, run.config.eval.context_tokens, w))
    routes = route_once(run, router, scorer, ids, r, once)
    return window_policy_from_losses(run, shards, router, w, r, once, ids, chunk_nll, routes)


def window_policy_from_losses(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict,
                              ids: list[list[int]], chunk_nll: list[np.ndarray], routes: list[str],
                              window_router: BaseRouter | None = None, window_logits: np.ndarray | None = None) -> dict:
    """Every candidate rule scored on every chunk of the router documents ``ids`` (``chunk_nll``: every path's loss on
    each; ``routes``: each document's path by the once rule ``once``, for chunk 0 and "stay"); the best, as saved in
    policy.json. The window-router rules need the fitted ``window_router`` and, since it was fitted on these documents,
    its out-of-fold ``window_logits``. ``router``: the shard router."""
    context = run.config.eval.context_tokens
    rules = candidates(w, router.input.tokens, window_router is not None)
    out = pick_window_rule(rules, chunk_cuts(ids, context, w), routes, ids, run.grid.paths, chunk_nll, router,
                           window_router, window_logits)
    if not ids:  # stay, as with any too-small sample; say why
        out["reason"] = out["one_path"]["reason"] = (f"{shards.root} keeps no router documents to choose on (re-shard "
                                                     f"with data.router_fraction > 0)")
    return out | {"window": w, "round": r, "split": "router_docs", "documents": len(ids), "once_rule": once["name"]}


def _ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")
