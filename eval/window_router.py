"""The window router of every-W routing (DiPaCo §3, test-time routing): ``dipaco fit-window-router``.

DiPaCo re-routes every W tokens with a router trained for that job: chunk i picks the path of chunk
i+1. Here the router is a multinomial logistic regression on the shard router's features of the
previous W tokens (decoded) and the document's path (one-hot: the path the run's once rule gave the
document, which chunk 0 uses; ``dipaco.eval.once_policy``), labelled with the path whose loss on the next W tokens
is lowest, fitted on the held-aside router documents of the shards (never trained on, never the held-out documents).
Why the document's path: the window alone is little evidence of where the text goes next, so a router on it
alone can do worse than staying on the document's path; with the document's path as an input it learns when
staying is best (docs/routing.md has the figures). The report keeps both (``loss_window_alone``).
Losses are computed exactly as ``dipaco eval`` scores (same windows, the routing prefix not scored),
at the run's latest round unless told otherwise. The router is saved with the run
(``RUN/window_routers/w<W>/``) with ``policy.json``: the every-W rule (``dipaco.eval.window_policy``: stay on the
document's path, the shard router, this window router with a switching margin, or the lagged loss of every path)
chosen on the same router documents, the window router's rules scored out of fold (each document's windows decided by
a router fitted on the other folds); ``dipaco eval --route-every W`` uses that rule. With too few router windows no
router is fitted (a warning) and the policy is chosen among the rules that need none (routing once unless one is
better on the router documents, and always with too few of them).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dipaco.command_config import WindowRouterConfig as W  # the defaults, declared once
from dipaco.errors import DipacoError
from dipaco.eval.documents import check_compatible, shard_router
from dipaco.eval.once_policy import find_once_policy, once_notice, route_once
from dipaco.eval.scorer import Scorer
from dipaco.eval.window_policy import all_chunk_nll, chunk_cuts, window_policy_from_losses, window_router_dir
from dipaco.io import write_json
from dipaco.routing import Router
from dipaco.routing.discriminative import fit_discriminative, fit_window
from dipaco.routing.router import BaseRouter
from dipaco.sharding.tokenizer import encode
from dipaco.storage.outputs import atomic_dir
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet


MIN_WINDOWS = 200  # fewer router windows than max(this, 25 per path): no window router is fitted
FOLDS = 5  # the window-router rules are scored on each fold of router documents by a router fitted on the others


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


def window_examples(ids: list[list[int]], context: int, w: int) -> list[tuple[int, int, int]]:
    """(document, chunk start, chunk end) of every chunk k >= 1 of every-W routing: those a window router
    chooses for (chunk 0 follows the document's routed path)."""
    return [(d, lo, hi) for d, cs in enumerate(chunk_cuts(ids, context, w)) for lo, hi in cs[1:]]


def fit_window_router(run_dir: str | Path, shards_dir: str | Path, window: int, at_round: int | None = None,
                      max_tokens: int = W.max_tokens, holdout_fraction: float = W.holdout_fraction,
                      seed: int = W.seed, overwrite: bool = False,
                      progress: bool = True) -> dict:
    """Fit and save RUN/window_routers/w<window>; returns its report (accuracies, losses, counts)."""
    began = time.perf_counter()
    run, shards, router, r, out = _check_inputs(run_dir, shards_dir, window, at_round, holdout_fraction, overwrite)
    # the document's path (chunk 0) and "stay" follow the run's once rule, the one generate and eval route by (a run
    # without one gets it chosen and saved now)
    once = find_once_policy(run, shards, progress)
    ids = [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in shards.router_docs()])]
    examples = window_examples(ids, run.config.eval.context_tokens, window)
    # every path's loss on every chunk of every router document, as eval computes it; each document's path by the
    # run's once rule, as eval routes chunk 0
    scorer = Scorer(run, ids, run.config.eval.batch_size, progress)
    chunk_nll = all_chunk_nll(scorer, run.grid.paths, r, chunk_cuts(ids, run.config.eval.context_tokens, window))
    document_paths = route_once(run, router, scorer, ids, r, once)
    enough = max(MIN_WINDOWS, 25 * len(run.grid.paths))
    if len(examples) < enough:  # no classifier: the rules that need no fitting (stay included)
        policy = window_policy_from_losses(run, shards, router, window, r, once, ids, chunk_nll, document_paths)
        warning = (f"the router documents of {shards.root} give only {len(examples)} windows of {window} tokens (fewer "
                   f"than {enough}), too few to fit a window router; every-{window} routing uses {policy['name']} "
                   f"({policy['reason']}). Re-shard with a larger data.router_fraction to fit one")
        with atomic_dir(out, overwrite=overwrite) as tmp:
            write_json(tmp / "policy.json", policy)
        report = {"window": window, "round": r, "examples": len(examples), "router_documents": len(ids),
                  "accuracy": None, "warning": warning, "policy": policy}
    else:
        data = _window_data(router, ids, examples, chunk_nll, document_paths, run.grid.paths, window)
        report = {"window": window, "round": r, "examples": len(examples), "router_documents": len(ids),
                  **_held_out_measures(router, ids, examples, data, run.grid.paths, holdout_fraction, seed)}
        final = fit_window(router.features, data["x"], data["document"], data["labels"], router.shape, data["shares"],
                           data["prefix"], seed)
        final.info.update({"purpose": f"every-{window} routing: input = the previous {window} tokens and the "
                                      f"document's path, label = the path with the lowest loss on the next {window}",
                           "run": str(run.root.resolve()), "shards_fingerprint": shards.fingerprint,
                           **{k: v for k, v in report.items() if k != "label_shares"}})
        # which rule every-W routing uses, chosen on these documents: the window router's rules with out-of-fold
        # decisions
        folds = np.random.default_rng(seed).permutation(len(ids)) % FOLDS
        held_out_logits = out_of_fold_logits(router, data["x"], data["document"], data["labels"],
                                             folds[[d for d, _, _ in examples]], data["prefix"], seed)
        report["policy"] = window_policy_from_losses(run, shards, router, window, r, once, ids, chunk_nll,
                                                     document_paths, final, held_out_logits)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            final.save(tmp)
            write_json(tmp / "policy.json", report["policy"])
    report["once_notice"] = once_notice(run.root, once)
    report["seconds"] = round(time.perf_counter() - began, 2)
    report["out"] = str(out)
    return report


def _check_inputs(run_dir, shards_dir, window: int, at_round: int | None, holdout_fraction: float,
                  overwrite: bool) -> tuple[Run, ShardSet, BaseRouter, int, Path]:
    """The run, its shards, the shard router, the round and the output folder, or a one-line error."""
    if window < 1:
        raise DipacoError(f"--window {window} is not valid; give a window of at least 1 token (e.g. 64)")
    if not 0.0 < holdout_fraction < 1.0:
        raise DipacoError(f"--holdout-fraction must be in (0, 1), got {holdout_fraction}")
    run, shards = Run(run_dir), ShardSet(shards_dir)
    check_compatible(run, shards)
    if run.is_dense:
        raise DipacoError(f"run {run.root} is dense (one path); a window router chooses between paths")
    out = window_router_dir(run, window)
    if out.exists() and not overwrite:
        raise DipacoError(f"{out} already exists; pass --overwrite to fit it again")
    router = shard_router(shards, run.config.eval.context_tokens)
    if router.features is None:
        raise DipacoError(f"the router of {shards.root} ({router.kind}) has no features to learn a window router from; "
                          f"shard with --assign kmeans")
    r = run.latest() if at_round is None else at_round
    if r not in run.rounds:
        raise DipacoError(f"run {run.root} has no round {r}; available: {run.rounds}")
    return run, shards, router, r, out


def _window_data(router, ids: list[list[int]], examples: list[tuple[int, int, int]], chunk_nll: list[np.ndarray],
                 document_paths: list[str], paths: list[str], window: int) -> dict:
    """What the window router learns from, one row per example: every path's loss on the chunk (``losses``), the best
    path (``labels``), the shard router's features of the previous ``window`` tokens (``x``, read through ``prefix``),
    the document's path (``document``), and the label counts plus one (``shares``, the balance of the fit)."""
    losses = np.concatenate([c[1:] for c in chunk_nll])  # in the order of ``examples``
    labels = losses.argmin(axis=1)
    prefix = router.input.with_tokens(window)
    x = router.features.transform(prefix.texts_of_ids([ids[d][lo - window:lo] for d, lo, _ in examples]))
    document = np.array([paths.index(p) for p in document_paths])[[d for d, _, _ in examples]]
    shares = np.bincount(labels, minlength=len(paths)).astype(np.float64) + 1.0
    return {"losses": losses, "labels": labels, "prefix": prefix, "x": x, "document": document, "shares": shares}


def _held_out_measures(router, ids: list[list[int]], examples: list[tuple[int, int, int]], data: dict, paths: list[str],
                       holdout_fraction: float, seed: int) -> dict:
    """Accuracy and mean loss on held-aside router documents (whole documents, so no window leaks) of the window
    router, the shard router on the previous tokens, a router on the window alone, the document's path and the oracle."""
    losses, labels, x, document = data["losses"], data["labels"], data["x"], data["document"]
    docs_order = np.random.default_rng(seed).permutation(len(ids))
    test_docs = set(docs_order[:max(1, int(round(len(ids) * holdout_fraction)))].tolist())
    test = np.array([d in test_docs for d, _, _ in examples])
    held = fit_window(router.features, x[~test], document[~test], labels[~test], router.shape, data["shares"],
                      data["prefix"], seed)
    predicted = held.window_logits(x[test], document[test]).argmax(axis=1)
    previous = np.array([paths.index(p) for p in router.route_ids(
        [ids[d][lo - router.input.tokens:lo] for d, lo, _ in examples])])[test]
    window_alone = fit_discriminative(router.features, x[~test], labels[~test], router.shape, data["shares"],
                                      data["prefix"], seed)
    alone = window_alone.path_distances(x[test]).argmin(axis=1)
    t = np.flatnonzero(test)
    n_tokens = np.array([hi - lo for _, lo, hi in examples])[test].sum()

    def mean_loss(choice):
        return float(losses[t, choice].sum() / n_tokens) if len(t) else None

    def accuracy(choice):
        return float((choice == labels[test]).mean()) if len(t) else None

    return {"test_examples": int(test.sum()),
            "label_shares": (np.bincount(labels, minlength=len(paths)) / len(labels)).round(4).tolist(),
            "accuracy": accuracy(predicted), "accuracy_shard_router_previous_tokens": accuracy(previous),
            "accuracy_document_path": accuracy(document[test]),
            "loss_window_router": mean_loss(predicted), "loss_shard_router_previous_tokens": mean_loss(previous),
            "loss_window_alone": mean_loss(alone), "loss_document_path": mean_loss(document[test]),
            "loss_oracle": mean_loss(labels[test])}


def out_of_fold_logits(router, x: np.ndarray, document: np.ndarray, labels: np.ndarray, fold: np.ndarray, prefix,
                       seed: int) -> np.ndarray:
    """The window router's logits for every example (a window of a router document), each from a router fitted on the
    other folds of documents: how the window-router rules are scored on the documents the router is fitted on. A fold
    with nothing left to fit on (every document in it) gets logits that keep the document's path."""
    paths = int(np.prod(router.shape))
    out = np.zeros((len(labels), paths))
    out[np.arange(len(labels)), document] = 1.0
    for f in np.unique(fold):
        inside = fold == f
        if inside.all():
            continue
        shares = np.bincount(labels[~inside], minlength=paths).astype(np.float64) + 1.0
        model = fit_window(router.features, x[~inside], document[~inside], labels[~inside], router.shape, shares, prefix, seed)
        out[inside] = model.window_logits(x[inside], document[inside])
    return out
