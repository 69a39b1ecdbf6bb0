"""Routing once, closer to the oracle: the candidate rules for a document's single path, and the choice among them on
the router documents.

Every rule reads only the routing context (the first ``eval.context_tokens`` tokens, never scored):

  shard-router               the router that built the shards, on its prefix (the paper's routing once)
  prefix-loss                the path under which the routing context itself has the lowest loss: every path reads
                             those tokens once (P forward passes over ``context`` tokens), then one path answers
  prefix-loss + router prior the same, plus the shard router's log-probability of each path (a posterior: the router's
                             belief times the likelihood of the tokens seen)

Why choose on the router documents and not on the validation documents: validation documents were sorted into their
paths by this very router and sat in the sample it was fitted on, so the shard router looks better on them than on
new documents (quickstart protocol, default corpus: the chosen prefix-loss rule is 4% worse than the shard router on
validation documents and 7.5% better on held-out ones, ``bench/routing_quality.py``). Router documents are kept out of both training and the router's fit, as
held-out documents are. The shard router wins ties, and wins outright below ``MIN_DOCUMENTS`` router documents.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

MIN_DOCUMENTS = 10  # fewer router documents than this: too few to trust a rule over the shard router
ONCE_KINDS = ("shard-router", "prefix-loss")


@dataclass(frozen=True)
class OnceRule:
    kind: str            # "shard-router" | "prefix-loss"
    prior: bool = False  # prefix-loss: add the shard router's log-probability of each path

    @property
    def name(self) -> str:
        return self.kind + (" + router prior" if self.prior else "")

    def describe(self, context: int) -> str:
        if self.kind == "shard-router":
            return f"the shard router on the first {context} tokens"
        return (f"the path with the lowest loss on the first {context} tokens (every path reads them)"
                + (", weighted by the shard router's probability of each path" if self.prior else ""))

    @property
    def one_path(self) -> bool:
        """Only one path's model is needed (prefix-loss runs every path over the routing context)."""
        return self.kind == "shard-router"

    def forward_passes(self, paths: int) -> int:
        """Model forward passes per routing-context token (never scored): the shard router reads features, not the
        model (0); prefix-loss runs every one of ``paths`` paths over the context. Scored tokens take one pass either way."""
        return 0 if self.kind == "shard-router" else paths

    def to_dict(self) -> dict:
        return asdict(self)


def once_rule_of(d: dict) -> OnceRule:
    return OnceRule(d["kind"], bool(d.get("prior", False)))


def once_candidates(router) -> list[OnceRule]:
    rules = [OnceRule("shard-router"), OnceRule("prefix-loss")]
    if router_log_prior(router, np.zeros((1, len(router.paths)))) is not None:
        rules.append(OnceRule("prefix-loss", prior=True))
    return rules


def router_log_prior(router, distances: np.ndarray, temperature: float = 0.1) -> np.ndarray | None:
    """log q(path | prefix) of the shard router: a discriminative router's softmax over its logits (its distances are
    negative logits); a k-means router's c-BTM softmax(-d^2 / T) (T = 0.1, the c-BTM default); None for a router
    that has no notion of nearness (random)."""
    scale = {"discriminative": 1.0, "kmeans": 1.0 / temperature}.get(getattr(router, "kind", None))
    if scale is None:
        return None
    z = -scale * np.asarray(distances, dtype=np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def prefix_nll(scorer, paths: list[str], r: int, ids: list[list[int]], context: int) -> np.ndarray:
    """(documents, P) NLL sum of every path on the routing context (targets 1 .. context-1: the tokens every rule may
    read). A document shorter than two tokens gets zeros (every path ties; the rule falls back to the shard router)."""
    spans = [(1, min(context, len(x))) for x in ids]
    scorer.ensure([[(lo, hi, [(p, r, 1.0)]) for p in paths] if hi > lo else [] for lo, hi in spans])
    return np.array([[scorer.nll(p, r, d, lo, hi).sum(dtype=np.float64) if hi > lo else 0.0 for p in paths]
                     for d, (lo, hi) in enumerate(spans)]).reshape(len(ids), len(paths))


def decide_once(rule: OnceRule, paths: list[str], shard_routes: list[str], prefix: np.ndarray | None = None,
                log_prior: np.ndarray | None = None) -> list[str]:
    """Every document's path under ``rule``; ``prefix``: (documents, P) NLL on the routing context; ``log_prior``: the
    shard router's log-probabilities (with ``prior``). Where every path ties on the prefix, the shard router's path."""
    if rule.kind == "shard-router":
        return list(shard_routes)
    if rule.kind != "prefix-loss":
        raise ValueError(f"unknown rule {rule.kind!r}")
    score = prefix - (log_prior if rule.prior else 0.0)
    out = []
    for d, row in enumerate(score):
        best = int(row.argmin())
        out.append(shard_routes[d] if np.all(prefix[d] == prefix[d, 0]) else paths[best])
    return out


def choose_once(rules: list[OnceRule], paths: list[str], shard_routes: list[str], body: np.ndarray, prefix: np.ndarray,
                log_prior: np.ndarray | None, tokens: int) -> dict:
    """Every rule's perplexity on these (router) documents, and the chosen rule with the reason. ``body``: (documents, P)
    NLL sum of every path on each document's scored tokens; ``tokens``: how many scored tokens in all."""
    index = {p: j for j, p in enumerate(paths)}
    picks = {rule.name: decide_once(rule, paths, shard_routes, prefix, log_prior) for rule in rules}
    nll = {name: float(sum(body[d, index[p]] for d, p in enumerate(ps))) for name, ps in picks.items()}
    oracle = float(body.min(axis=1).sum()) if len(body) else 0.0
    documents = len(body)
    best = min(rules, key=lambda rule: (nll[rule.name], rule.kind != "shard-router"))
    shard = next(rule for rule in rules if rule.kind == "shard-router")
    if documents < MIN_DOCUMENTS and best != shard:
        reason = (f"only {documents} router documents (< {MIN_DOCUMENTS}): too few to trust {best.name} "
                  f"({_ppl(nll[best.name], tokens):.3f}) over the shard router ({_ppl(nll[shard.name], tokens):.3f})")
        best = shard
    elif best == shard:
        reason = f"no rule beat the shard router on {documents} router documents"
    else:
        reason = (f"lowest perplexity on {documents} router documents: {_ppl(nll[best.name], tokens):.3f} vs "
                  f"{_ppl(nll[shard.name], tokens):.3f} for the shard router (document oracle {_ppl(oracle, tokens):.3f})")
    agree = {name: float(np.mean([ps[d] == paths[int(body[d].argmin())] for d in range(documents)])) if documents else None
             for name, ps in picks.items()}
    return {"chosen": best.to_dict(), "name": best.name, "reason": reason, "documents": documents, "tokens": tokens,
            "router_documents": {name: _ppl(v, tokens) for name, v in nll.items()}, "oracle": _ppl(oracle, tokens),
            "picks_oracle_path": agree}


def _ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")
