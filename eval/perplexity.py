"""Routed perplexity on the held-out documents of a shard directory.

Each document is routed by its first ``context_tokens`` tokens (decoded to text: the router sees
exactly the unscored prefix, never a scored token) and the rest is scored by that one path.
A dense run (one path) scores every document with its single path.
"""

from __future__ import annotations

import math
from pathlib import Path

from tqdm.auto import tqdm

from dipaco.errors import DipacoError
from dipaco.routing import Router
from dipaco.run import Run
from dipaco.scoring import document_nll
from dipaco.shards import ShardSet
from dipaco.sharding.tokenizer import encode


def heldout_tokens(shards: ShardSet, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    docs = shards.heldout()
    if not docs:
        raise DipacoError(f"{shards.root} has no held-out documents; re-shard with data.heldout_fraction > 0")
    ids = [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])]
    return docs, ids


def check_compatible(run: Run, shards: ShardSet) -> None:
    if run.info.get("tokenizer_sha256") != shards.manifest["tokenizer"]["sha256"]:
        raise DipacoError(f"run {run.root} was trained with another tokenizer than {shards.root}; evaluate it on its own shards "
                          f"({run.info.get('shards_dir')})")
    if not run.is_dense and run.info.get("shards_fingerprint") != shards.fingerprint:
        raise DipacoError(f"run {run.root} was trained on other shards (another router) than {shards.root}; "
                          f"evaluate it with --shards {run.info.get('shards_dir')}")


def route_documents(run: Run, shards: ShardSet, ids: list[list[int]], context: int) -> list[str]:
    if run.is_dense:
        return [run.grid.paths[0]] * len(ids)
    tok = shards.tokenizer()
    prefixes = tok.batch_decode([i[:context] for i in ids])
    return Router.load(shards.root / "router").route(prefixes)


def evaluate_run(run: Run, shards: ShardSet, docs: list[dict], ids: list[list[int]], round: int | None = None,
                 progress: bool = True) -> dict:
    check_compatible(run, shards)
    cfg = run.config.eval
    r = run.latest() if round is None else round
    routes = route_documents(run, shards, ids, cfg.context_tokens)
    per_doc = [(0.0, 0)] * len(ids)
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(routes):
        by_path.setdefault(p, []).append(i)
    bar = tqdm(total=len(ids), desc=f"eval {run.root.name}", unit="doc", disable=not progress, dynamic_ncols=True)
    for path, members in sorted(by_path.items()):
        model = run.path_model(path, r).model  # only this path's modules are loaded
        scores = document_nll(model, [ids[i] for i in members], cfg.context_tokens, run.config.model.max_seq_len,
                              cfg.batch_size, pad_id=run.info["eos_token_id"])
        for i, s in zip(members, scores):
            per_doc[i] = s
        bar.update(len(members))
    bar.close()
    return summarise(per_doc, routes, [d.get("label") for d in docs]) | {"round": r, "run": str(run.root)}


def summarise(per_doc: list[tuple[float, int]], routes: list[str], labels: list[str | None]) -> dict:
    def ppl(rows):
        nll, n = sum(r[0] for r in rows), sum(r[1] for r in rows)
        return {"perplexity": math.exp(nll / n) if n else None, "tokens": n, "documents": sum(1 for r in rows if r[1])}

    out = ppl(per_doc)
    out["per_path"] = {p: ppl([s for s, q in zip(per_doc, routes) if q == p]) for p in sorted(set(routes))}
    if any(l is not None for l in labels):
        out["per_label"] = {l: ppl([s for s, m in zip(per_doc, labels) if m == l])
                            for l in sorted({str(l) for l in labels if l is not None})}
    return out


def evaluate(runs: dict[str, str | Path], shards_dir: str | Path, round: int | None = None, progress: bool = True) -> dict:
    """Report for several runs on the same held-out tokens: {"methods": {name: {...}}, ...}."""
    shards = ShardSet(shards_dir)
    loaded = {name: Run(path) for name, path in runs.items()}
    max_tokens = max(r.config.eval.max_tokens_per_doc for r in loaded.values())
    contexts = {r.config.eval.context_tokens for r in loaded.values()}
    if len(contexts) > 1:
        raise DipacoError(f"runs use different eval.context_tokens {sorted(contexts)}; compare runs with the same setting")
    docs, ids = heldout_tokens(shards, max_tokens)
    methods = {name: evaluate_run(run, shards, docs, ids, round, progress) for name, run in loaded.items()}
    return {"shards": str(Path(shards_dir).resolve()), "context_tokens": contexts.pop(), "heldout_documents": len(docs),
            "methods": methods}
