"""Routing once, closer to the oracle: the candidate rules for a document's single path, the choice among them on the
router documents, the file that keeps the choice (``RUN/routing/once.json``), and routing by it.

The names say what each step does: ``pick_once_rule`` picks the best rule from every path's losses (pure);
``choose_once_policy`` scores the router documents and picks (the policy: the chosen rule, the reason, the scores);
``find_once_policy`` reads the run's saved policy, or chooses and saves it, for whichever command comes first;
``save_once_policy`` is ``dipaco choose-routing``; ``route_once`` gives every document its path under the policy.

Every rule reads only the routing context (the first ``eval.context_tokens`` tokens, never scored):

  shard-router               the router that built the shards, on its prefix (the paper's routing once)
  prefix-loss                the path under which the routing context itself has the lowest loss: every path reads
                             those tokens once (P forward passes over ``context`` tokens), then one path answers
  prefix-loss + router prior the same, plus the shard router's log-probability of each path (a posterior: the router's
                             belief times the likelihood of the tokens seen)

Why choose on the router documents and not on the validation documents: validation documents were sorted into their
paths by this very router and sat in the sample it was fitted on, so the shard router looks better on them than on
new documents (docs/routing.md has the figures, from ``bench/routing_quality.py``). Router documents are kept out of both training and the router's fit, as
held-out documents are. The shard router wins ties, and wins outright below ``MIN_DOCUMENTS`` router documents.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.eval.documents import check_compatible, route_documents, router_tokens, shard_router
from dipaco.eval.policy_check import damaged, read_object, rule_problem
from dipaco.eval.scorer import Scorer
from dipaco.io import write_json
from dipaco.routing.router import BaseRouter
from dipaco.storage.outputs import atomic_dir, os_error_line
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet

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


def pick_once_rule(rules: list[OnceRule], paths: list[str], shard_routes: list[str], body: np.ndarray, prefix: np.ndarray,
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


# ------------------------------------------------------------------------- the run's once policy
def once_policy_file(run: Run) -> Path:
    return run.root / "routing" / "once.json"


def choose_routing_again(run: Run, shards) -> str:
    return f"dipaco choose-routing --run {run.root} --shards {shards.root} --overwrite"


def read_once_policy(run: Run, shards) -> dict | None:
    """The once rule saved with the run (``source``: the file), or None when it has none."""
    f = once_policy_file(run)
    if not f.exists():
        return None
    rewrite = choose_routing_again(run, shards)
    policy = read_object(f, rewrite)
    problem = rule_problem(policy.get("chosen"), ONCE_KINDS)
    if problem is None and not (isinstance(policy.get("name"), str) and isinstance(policy.get("reason"), str)):
        problem = "no 'name' and 'reason' of the rule"
    if problem is not None:
        raise damaged(f, problem, rewrite)
    return policy | {"source": str(f)}


def write_once_policy(run: Run, policy: dict, overwrite: bool = False) -> Path:
    """Save ``policy`` as RUN/routing/once.json, atomically (the folder is written whole, then renamed into place)."""
    f = once_policy_file(run)
    with atomic_dir(f.parent, overwrite=overwrite) as tmp:
        write_json(tmp / f.name, policy)
    return f


def find_once_policy(run: Run, shards: ShardSet, progress: bool = True) -> dict:
    """The run's once rule, decided once and found by every command (eval, generate, fit-window-router, the Python API):
    ``RUN/routing/once.json``. A run without it gets it chosen by the first command that needs it, on the router
    documents at the run's latest round (what ``dipaco choose-routing`` does, so which command came first does not
    matter), and saved there. A run directory that cannot take the file (read-only, a user's files in RUN/routing)
    gets the same choice for this command only. A chosen-now policy says so: ``chosen_now``, ``saved_to`` (None when
    not saved) and ``source``; ``once_notice`` words it for a command's output."""
    saved = read_once_policy(run, shards)
    if saved is not None:
        return saved
    r = run.latest()
    policy = choose_once_policy(run, shards, r, progress)
    f = once_policy_file(run)
    try:
        write_once_policy(run, policy, overwrite=f.parent.is_dir())  # an empty routing/ (or dipaco's) is replaced
    except (OSError, DipacoError) as exc:
        again = read_once_policy(run, shards)
        if again is not None:  # another command saved it meanwhile: the saved rule is the one every command follows
            return again
        why = os_error_line(exc) if isinstance(exc, OSError) else str(exc)
        return policy | {"chosen_now": True, "saved_to": None,
                         "source": f"chosen on the router documents at round {r} for this command only: it could not "
                                   f"be saved to {f} ({why}), so the next command chooses again"}
    return policy | {"chosen_now": True, "saved_to": str(f),
                     "source": f"chosen on the router documents at round {r} and saved to {f}, which every later "
                               f"command follows (dipaco choose-routing --overwrite chooses again)"}


def once_notice(run_dir: str | Path, policy: dict) -> str | None:
    """One line for a command's output when ``policy`` was chosen just now (``find_once_policy``), else None."""
    if not policy.get("chosen_now"):
        return None
    return f"run {run_dir} had no once rule: routing once uses {policy['name']}, {policy['source']}"


def choose_once_policy(run: Run, shards: ShardSet, r: int, progress: bool = True) -> dict:
    """Every once rule scored on the router documents (every path on every document, once); the best."""
    context = run.config.eval.context_tokens
    router = shard_router(shards, context)
    ids = [x for x in router_tokens(shards, run.config.eval.max_tokens_per_doc) if len(x) > max(1, context)]
    if not ids:
        return {"chosen": {"kind": "shard-router"}, "name": "shard-router", "documents": 0, "round": r,
                "reason": f"{shards.root} keeps no router documents to choose on (re-shard with data.router_fraction > 0)"}
    scorer = Scorer(run, ids, run.config.eval.batch_size, progress)
    lo, paths = max(1, context), run.grid.paths
    scorer.ensure([[(lo, len(x), [(p, r, 1.0)]) for p in paths] for x in ids])
    body = np.array([[scorer.nll(p, r, d, lo, len(x)).sum(dtype=np.float64) for p in paths]
                     for d, x in enumerate(ids)]).reshape(len(ids), len(paths))
    dist = router.distances_of_ids(ids)
    out = pick_once_rule(once_candidates(router), paths, [router.paths[j] for j in dist.argmin(axis=1)], body,
                         prefix_nll(scorer, paths, r, ids, context), router_log_prior(router, dist),
                         sum(len(x) - lo for x in ids))
    return out | {"round": r, "split": "router_docs"}


def save_once_policy(run_dir: str | Path, shards_dir: str | Path, at_round: int | None = None, overwrite: bool = False,
                     progress: bool = True) -> dict:
    """``dipaco choose-routing``: choose the once rule on the router documents and save it as RUN/routing/once.json,
    which eval, every-W routing and generate then follow."""
    run, shards = Run(run_dir), ShardSet(shards_dir)
    check_compatible(run, shards)
    if run.is_dense:
        raise DipacoError(f"run {run.root} is dense (one path); routing chooses between paths")
    out = once_policy_file(run).parent
    if out.exists() and not overwrite:
        raise DipacoError(f"{out} already exists; pass --overwrite to choose again")
    r = run.latest() if at_round is None else at_round
    if r not in run.rounds:
        raise DipacoError(f"run {run.root} has no round {r}; available: {run.rounds}")
    policy = choose_once_policy(run, shards, r, progress)
    return policy | {"out": str(write_once_policy(run, policy, overwrite))}


def route_once(run: Run, router: BaseRouter | None, scorer: Scorer, ids: list[list[int]], r: int,
               policy: dict | None) -> list[str]:
    """Every document's path under the run's once rule (a dense run: its single path)."""
    rule = once_rule_of(policy["chosen"]) if policy else None
    if run.is_dense or rule is None or rule.kind == "shard-router":
        return route_documents(run, router, ids)
    dist = router.distances_of_ids(ids)
    shard_routes = [router.paths[j] for j in dist.argmin(axis=1)]  # what route_ids answers
    prefix = prefix_nll(scorer, run.grid.paths, r, ids, run.config.eval.context_tokens)
    return decide_once(rule, run.grid.paths, shard_routes, prefix, router_log_prior(router, dist))


def _ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")
