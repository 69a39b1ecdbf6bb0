"""Routed perplexity on the held-out documents of a shard directory, and the rows to compare it with.

Protocol (DiPaCo): the first ``context_tokens`` tokens of a document are the routing context and are
never scored; every method is scored on exactly the same target tokens.

A *method* gives every document a list of segments ``(lo, hi, [(path, round, weight), ...])``: the
targets at positions [lo, hi) are scored by that path (weight 1) or by a mixture of paths
(next-token probabilities of the true token weighted). All methods of one run share a ``Scorer``
that runs each (path, round, document window) through the model at most once, so oracle, random,
every-W and mixture rows reuse the forward passes of the routed row.

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
  early-stop    ``routed`` with each path at its round of lowest validation loss (metrics.jsonl)
  mixture-k     c-BTM: the k nearest paths, weights softmax(-d^2 / T) of the router distances
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dipaco.command_config import EvalCommandConfig as E  # the defaults, declared once
from dipaco.errors import DipacoError
from dipaco.eval.once_policy import (choose_once, decide_once, once_candidates, once_rule_of, prefix_nll,
                                     router_log_prior)
from dipaco.eval.policy_files import (once_policy_file, policy_file, read_once_policy, read_window_policy,
                                      stale_policy, window_router_dir, write_once_policy)
from dipaco.eval.window_policy import (all_chunk_nll, candidates, choose, chunk_cuts, cross_fitted_oracle_nll, decide,
                                       rule_of)
from dipaco.outputs import os_error_line
from dipaco.routing import Router
from dipaco.routing.router import BaseRouter
from dipaco.run import Run
from dipaco.scoring import window_nll, windows_for
from dipaco.sharding.tokenizer import encode
from dipaco.shards import ShardSet, read_docs

Segment = tuple[int, int, list[tuple[str, int, float]]]


def heldout_tokens(shards: ShardSet, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    docs = shards.heldout()
    if not docs:
        raise DipacoError(f"{shards.root} has no held-out documents; re-shard with data.heldout_fraction > 0")
    ids = [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])]
    return docs, ids


def validation_tokens(shards: ShardSet, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """The validation documents of every path (whole documents, never trained on), from their tokens: the
    data to choose settings on, so that the held-out documents stay a test set."""
    docs, ids = [], []
    for p in shards.paths:
        tokens, offsets = shards.tokens(p, "val"), shards.doc_offsets(p, "val")
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            doc = np.asarray(tokens[a:b], dtype=np.int64)
            if len(doc) and doc[-1] == shards.eos_token_id:
                doc = doc[:-1]  # the writer's document separator
            docs.append({"label": None, "path": p})
            ids.append(doc[:max_tokens].tolist())
    if not docs:
        raise DipacoError(f"{shards.root} has no validation documents; re-shard with data.val_fraction > 0")
    return docs, ids


SPLITS = {"heldout": heldout_tokens, "val": validation_tokens}


def check_compatible(run: Run, shards: ShardSet) -> None:
    if run.info.get("tokenizer_sha256") != shards.manifest["tokenizer"]["sha256"]:
        raise DipacoError(f"run {run.root} was trained with another tokenizer than {shards.root}; evaluate it with its own "
                          f"--shards {run.info.get('shards_dir')}")
    if not run.is_dense and run.info.get("shards_fingerprint") != shards.fingerprint:
        raise DipacoError(f"run {run.root} was trained on other shards (another router) than {shards.root}; "
                          f"evaluate it with --shards {run.info.get('shards_dir')}")


def shard_router(shards: ShardSet, context: int) -> BaseRouter:
    """The router that built the shards; it must read only unscored tokens."""
    router = Router.load(shards.root / "router")
    if router.input.tokens > context:
        raise DipacoError(f"the router of {shards.root} reads the first {router.input.tokens} tokens but eval.context_tokens "
                          f"is {context}, so routing would see scored tokens; set eval.context_tokens >= {router.input.tokens}")
    return router


def route_documents(run: Run, router: BaseRouter | None, ids: list[list[int]]) -> list[str]:
    """The path of every document: the shard router on its first tokens (a dense run: its single path)."""
    if run.is_dense:
        return [run.grid.paths[0]] * len(ids)
    return router.route_ids(ids)


def router_tokens(shards: ShardSet, max_tokens: int) -> list[list[int]]:
    """The router documents' tokens (kept out of training and of the router's fit); none when the shards keep none."""
    docs = read_docs(shards.root, "router_docs")
    return [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])] if docs else []


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
    policy = choose_once_on_router_docs(run, shards, r, progress)
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


def choose_once_on_router_docs(run: Run, shards: ShardSet, r: int, progress: bool = True) -> dict:
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
    out = choose_once(once_candidates(router), paths, [router.paths[j] for j in dist.argmin(axis=1)], body,
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
    policy = choose_once_on_router_docs(run, shards, r, progress)
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


def load_window_router(run: Run, shards: ShardSet, w: int) -> BaseRouter | None:
    """The run's router for W-token windows (``dipaco fit-window-router``), or None if it has none."""
    d = window_router_dir(run, w)
    if not (d / "router.json").is_file():
        return None
    router = Router.load(d)
    if router.describe().get("shards_fingerprint") != shards.fingerprint:
        raise DipacoError(f"window router {d} was fitted on other shards than {shards.root}; "
                          f"re-fit it with dipaco fit-window-router --run {run.root} --shards {shards.root} --window {w}")
    return router


# ------------------------------------------------------------------------------------------ scoring
class Scorer:
    """Per-target NLL of the held-out documents under (path, round), each window computed once."""

    def __init__(self, run: Run, ids: list[list[int]], batch_size: int, progress: bool = True):
        self.run, self.ids, self.batch_size, self.progress = run, ids, batch_size, progress
        self.seq_len = run.config.model.max_seq_len
        self.cache: dict[tuple[str, int], dict[tuple[int, int], np.ndarray]] = {}

    def ensure(self, segments: list[list[Segment]]) -> None:
        """Compute every window any segment needs, loading each path model once."""
        need: dict[tuple[str, int], set[tuple[int, int]]] = {}
        for d, segs in enumerate(segments):
            for lo, hi, mix in segs:
                for path, r, _ in mix:
                    need.setdefault((path, r), set()).update((d, j) for j in windows_for(lo, hi, self.seq_len))
        for key in sorted(need):
            have = self.cache.setdefault(key, {})
            todo = sorted(need[key] - have.keys())
            if not todo:
                continue
            model = self.run.path_model(*key).model  # only this path's modules are loaded
            with tqdm(total=len(todo), desc=f"{self.run.root.name} path {key[0]} round {key[1]}", unit="win",
                      disable=not self.progress, dynamic_ncols=True, leave=False) as bar:
                have.update(window_nll(model, self.ids, todo, self.seq_len, self.batch_size,
                                       pad_id=self.run.info["eos_token_id"], progress=bar))

    def nll(self, path: str, r: int, d: int, lo: int, hi: int) -> np.ndarray:
        """NLL of targets [lo, hi) of document d (their windows must have been ensured)."""
        parts, windows = [], self.cache[(path, r)]
        for j in windows_for(lo, hi, self.seq_len):
            first = j * self.seq_len + 1
            parts.append(windows[(d, j)][max(0, lo - first):hi - first])
        return np.concatenate(parts) if parts else np.zeros(0)

    def score(self, segments: list[list[Segment]]) -> tuple[list[tuple[float, int]], dict[str, list]]:
        """Per document (NLL sum, tokens) and per top path [NLL sum, tokens, documents]."""
        self.ensure(segments)
        per_doc, per_path = [], {}
        for d, segs in enumerate(segments):
            total, count, seen = 0.0, 0, set()
            for lo, hi, mix in segs:
                if hi <= lo:
                    continue
                if len(mix) == 1:
                    nll = self.nll(mix[0][0], mix[0][1], d, lo, hi)
                else:  # -log sum_k w_k p_k(x_t), in log space
                    stack = np.stack([math.log(w) - self.nll(p, r, d, lo, hi) for p, r, w in mix if w > 0])
                    top = stack.max(axis=0)
                    nll = -(top + np.log(np.exp(stack - top).sum(axis=0)))
                s = float(nll.sum(dtype=np.float64))
                total, count = total + s, count + len(nll)
                top_path = max(mix, key=lambda m: m[2])[0]
                row = per_path.setdefault(top_path, [0.0, 0, 0])
                row[0], row[1] = row[0] + s, row[1] + len(nll)
                if top_path not in seen:
                    row[2], seen = row[2] + 1, seen | {top_path}
            per_doc.append((total, count))
        return per_doc, per_path


# ------------------------------------------------------------------------------------------ methods
def _ppl(nll: float, n: int) -> float | None:
    return math.exp(nll / n) if n else None


def summarise(per_doc: list[tuple[float, int]], per_path: dict[str, list], labels: list[str | None]) -> dict:
    nll, n = sum(s for s, _ in per_doc), sum(c for _, c in per_doc)
    out = {"perplexity": _ppl(nll, n), "tokens": n, "documents": sum(1 for _, c in per_doc if c), "nll_sum": nll}
    out["per_path"] = {p: {"perplexity": _ppl(v[0], v[1]), "tokens": v[1], "documents": v[2]}
                       for p, v in sorted(per_path.items())}
    if any(l is not None for l in labels):
        out["per_label"] = {}
        for label in sorted({str(l) for l in labels if l is not None}):
            rows = [s for s, l in zip(per_doc, labels) if l is not None and str(l) == label]
            ln, lc = sum(s for s, _ in rows), sum(c for _, c in rows)
            out["per_label"][label] = {"perplexity": _ppl(ln, lc), "tokens": lc, "documents": sum(1 for _, c in rows if c)}
    return out


def once_segments(routes: list[str], ids: list[list[int]], context: int, rounds: dict[str, int] | int) -> list[list[Segment]]:
    lo = max(1, context)
    return [[(lo, len(x), [(p, rounds if isinstance(rounds, int) else rounds[p], 1.0)])] for p, x in zip(routes, ids)]


def segments_of(cuts: list[list[tuple[int, int]]], choice: list[list[str]], r: int) -> list[list[Segment]]:
    return [[(lo, hi, [(p, r, 1.0)]) for (lo, hi), p in zip(cs, ps)] for cs, ps in zip(cuts, choice)]


def every_w_policy(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict,
                   progress: bool = True) -> dict:
    """The rule of every-W routing for this run: the one ``dipaco fit-window-router`` chose on the router documents
    (``RUN/window_routers/w<W>/policy.json``), or, for a run without one (or a stale one, ``stale_policy``), the one the
    router documents choose now among the rules that need no fitting. ``router``: the shard router; ``once``: the
    run's once policy."""
    saved = read_window_policy(run, shards, w)
    why = "chosen now on the router documents"
    if saved is not None:
        stale = stale_policy(saved, once["name"])
        f = policy_file(run, w)
        if stale is None:
            return saved | {"source": str(f)}
        why += f": {f} {stale}"
    return choose_on_router_docs(run, shards, router, w, r, once, progress) | {"source": why}


def choose_on_router_docs(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict,
                          progress: bool = True) -> dict:
    """The every-W rule among those that need no fitting (stay, the shard router, the lagged loss), chosen on every
    chunk of the router documents (never the validation or held-out ones: ``dipaco.eval.window_policy`` says why)."""
    ids = router_tokens(shards, run.config.eval.max_tokens_per_doc)
    scorer = Scorer(run, ids, run.config.eval.batch_size, progress)
    chunk_nll = all_chunk_nll(scorer, run.grid.paths, r, chunk_cuts(ids, run.config.eval.context_tokens, w))
    routes = route_once(run, router, scorer, ids, r, once)
    return choose_every_w(run, shards, router, w, r, once, ids, chunk_nll, routes)


def choose_every_w(run: Run, shards: ShardSet, router: BaseRouter, w: int, r: int, once: dict, ids: list[list[int]],
                   chunk_nll: list[np.ndarray], routes: list[str], window_router: BaseRouter | None = None,
                   window_logits: np.ndarray | None = None) -> dict:
    """Every candidate rule scored on every chunk of the router documents ``ids`` (``chunk_nll``: every path's loss on
    each; ``routes``: each document's path by the once rule ``once``, for chunk 0 and "stay"); the best, as saved in
    policy.json. The window-router rules need the fitted ``window_router`` and, since it was fitted on these documents,
    its out-of-fold ``window_logits``. ``router``: the shard router."""
    context = run.config.eval.context_tokens
    rules = candidates(w, router.input.tokens, window_router is not None)
    out = choose(rules, chunk_cuts(ids, context, w), routes, ids, run.grid.paths, chunk_nll, router, window_router,
                 window_logits)
    if not ids:  # stay, as with any too-small sample; say why
        out["reason"] = out["one_path"]["reason"] = (f"{shards.root} keeps no router documents to choose on (re-shard "
                                                     f"with data.router_fraction > 0)")
    return out | {"window": w, "round": r, "split": "router_docs", "documents": len(ids), "once_rule": once["name"]}


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


def read_metrics(run: Run) -> list[dict]:
    f = run.root / "metrics.jsonl"
    if not f.is_file():
        return []
    rows = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise DipacoError(f"{f} line {n} is not JSON; repair or remove that line") from None
    return rows


def val_loss_by_round(run: Run) -> dict[int, dict[str, float]]:
    """{round: {path: validation loss of the global weights after that round}} from metrics.jsonl."""
    out = {}
    for row in read_metrics(run):
        if row.get("kind") == "round" and row.get("val_loss"):
            out[int(row["round"])] = {p: float(v) for p, v in row["val_loss"].items()}
    return out


def early_stopping_rounds(run: Run) -> dict[str, int]:
    """Per path, the checkpointed round with the lowest validation loss (ties: the earliest)."""
    available = set(run.rounds)
    picks: dict[str, tuple[float, int]] = {}
    for r, losses in sorted(val_loss_by_round(run).items()):
        if r not in available:
            continue
        for p, loss in losses.items():
            if math.isfinite(loss) and (p not in picks or loss < picks[p][0]):
                picks[p] = (loss, r)
    if not picks:
        raise DipacoError(f"{run.root / 'metrics.jsonl'} has no validation losses for checkpointed rounds; "
                          f"train with val_batches > 0 or drop --early-stopping")
    latest = run.latest()
    return {p: picks[p][1] if p in picks else latest for p in run.grid.paths}


# ------------------------------------------------------------------------------------------ evaluate
def evaluate_run(run: Run, shards: ShardSet, docs: list[dict], ids: list[list[int]], round: int | None = None,
                 progress: bool = True, route_every: list[int] = (), oracle: bool = False, random: bool = False,
                 early_stopping: bool = False, mixture: int = 0, temperature: float = E.temperature, seed: int = E.seed,
                 name: str = "run") -> dict[str, dict]:
    """Rows {method name: summary} for one run: ``name`` (routed) plus the requested extras."""
    check_compatible(run, shards)
    context = run.config.eval.context_tokens
    r = run.latest() if round is None else round
    if r not in run.rounds:
        raise DipacoError(f"run {run.root} has no round {r}; available: {run.rounds}")
    labels = [d.get("label") for d in docs]
    scorer = Scorer(run, ids, run.config.eval.batch_size, progress)
    base = {"run": str(run.root), "round": r, "grid": run.info["grid"]}
    rows: dict[str, dict] = {}

    def add(method: str, segments, **extra):
        per_doc, per_path = scorer.score(segments)
        for p in run.grid.paths:  # a path no document reached still gets its (empty) row
            per_path.setdefault(p, [0.0, 0, 0])
        rows[name if method == "routed" else f"{name} {method}"] = summarise(per_doc, per_path, labels) | base | extra

    if run.is_dense:
        add("routed", once_segments(route_documents(run, None, ids), ids, context, r), routing="the single path of a dense run")
        return rows
    router = shard_router(shards, context)
    once_choice = find_once_policy(run, shards, progress)
    once = once_rule_of(once_choice["chosen"])
    routes = route_once(run, router, scorer, ids, r, once_choice)
    add("routed", once_segments(routes, ids, context, r), once_policy=once_choice,
        routing=f"once, {once.name}: {once.describe(router.input.tokens if once.one_path else context)}; chosen on the "
                f"router documents ({once_choice['reason']})")
    if once.kind != "shard-router":  # the paper's routing once, for comparison
        add("shard-router", once_segments(route_documents(run, router, ids), ids, context, r),
            routing=f"once, shard router on the first {router.input.tokens} tokens")
    chunk_nll: dict[int, list[np.ndarray]] = {}
    for w in route_every:
        window = load_window_router(run, shards, w)
        policy = every_w_policy(run, shards, router, w, r, once_choice, progress)
        rule, cuts = rule_of(policy["chosen"]), chunk_cuts(ids, context, w)
        if rule.kind == "lagged-loss" or oracle:
            chunk_nll[w] = all_chunk_nll(scorer, run.grid.paths, r, cuts)
        choice = decide(rule, cuts, routes, ids, run.grid.paths, router, window, chunk_nll.get(w))
        add(f"every-{w}", segments_of(cuts, choice, r), routing=f"every {w} tokens, {rule.name}: {rule.describe(w)}; "
            f"chosen on the router documents ({policy['reason']})", policy=policy,
            window_router=str(window_router_dir(run, w)) if window else None)
        single = policy.get("one_path")
        if single and single["name"] != policy["name"]:  # what serving one path at a time gets
            one = rule_of(single["chosen"])
            add(f"every-{w} one-path", segments_of(cuts, decide(one, cuts, routes, ids, run.grid.paths, router, window), r),
                routing=f"every {w} tokens, {one.name}: {one.describe(w)}; the best rule that runs one path, chosen on "
                        f"the router documents ({single['reason']})", policy=single)
        if oracle:  # the bound every-W routing could reach: the best path for every chunk, scored on the chunk
            best = [[run.grid.paths[int(j)] for j in c.argmin(axis=1)] if len(c) else [] for c in chunk_nll[w]]
            add(f"window-oracle-{w}", segments_of(cuts, best, r), routing=f"best path per {w}-token chunk (oracle)")
            rows[f"{name} window-oracle-{w} cross-fitted"] = cross_fitted_row(
                scorer, run.grid.paths, r, cuts, labels, base, f"best path per {w}-token chunk chosen on the chunk's "
                "other half of the targets (even/odd positions), scored on this half")
            # every candidate rule on these documents too, for the record (the choice above was made on router documents)
            rows[f"{name} every-{w}"]["every_rule_here"] = choose(
                candidates(w, router.input.tokens, window is not None), cuts, routes, ids, run.grid.paths, chunk_nll[w],
                router, window)["scores"]
    if early_stopping:
        picks = early_stopping_rounds(run)
        add("early-stop", once_segments(routes, ids, context, picks), routing="once", round=None, rounds=picks)
    if mixture > 1:
        mixes = [[(p, r, w) for p, w in mixture_weights(t, temperature)] for t in router.route_topk_ids(ids, mixture)]
        lo = max(1, context)
        add(f"mixture-{mixture}", [[(lo, len(x), m)] for x, m in zip(ids, mixes)],
            routing=f"mixture of the {mixture} nearest paths, T={temperature}")
    if random:
        rng = np.random.default_rng(seed)
        picks = [run.grid.paths[i] for i in rng.integers(0, run.grid.num_paths, len(ids))]
        add("random", once_segments(picks, ids, context, r), routing=f"uniform random path per document (seed {seed})")
    if oracle:
        every = [(p, r, 1.0) for p in run.grid.paths]
        lo = max(1, context)
        scorer.ensure([[(lo, len(x), [m]) for m in every] for x in ids])
        best = [min(run.grid.paths, key=lambda p: float(scorer.nll(p, r, d, lo, len(x)).sum(dtype=np.float64)) if len(x) > lo else 0.0)
                for d, x in enumerate(ids)]
        add("oracle", once_segments(best, ids, context, r), routing="best path per document (oracle)")
        rows[f"{name} oracle cross-fitted"] = cross_fitted_row(
            scorer, run.grid.paths, r, [[(lo, len(x))] if len(x) > lo else [] for x in ids], labels, base,
            "best path per document chosen on the document's other half of the targets (even/odd positions), scored on this half")
    return rows


def cross_fitted_row(scorer: Scorer, paths: list[str], r: int, cuts: list[list[tuple[int, int]]], labels: list,
                     base: dict, routing: str) -> dict:
    """A cross-fitted oracle's row (``cross_fitted_oracle_nll`` per span): perplexity, tokens, per label. Its choice
    differs between the two halves of a span, so it has no per-path split."""
    per_doc = [(sum(cross_fitted_oracle_nll(np.stack([scorer.nll(p, r, d, lo, hi) for p in paths])) for lo, hi in cs),
                sum(hi - lo for lo, hi in cs)) for d, cs in enumerate(cuts)]
    return summarise(per_doc, {}, labels) | base | {"routing": routing}


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
