"""Discriminative re-sharding (DiPaCo §2.4.2): loss labels from a trained run -> a new router -> new shards.

1. Score every held-aside router document (``SHARDS/router_docs/docs.jsonl``, never trained on) under
   every path of the run; its label is the path with the lowest loss (mean NLL per scored token; the
   routing prefix is not scored).
2. Fit a multinomial logistic regression from the shard router's prefix features (the features of the
   decoded first 32 tokens, the input every router reads) to the labels, on a
   seeded part of the router documents; shift its bias so that the predicted path distribution matches
   the target (the current shard sizes, or uniform), so no path collapses. Report the accuracy against
   the loss labels on the rest (and the k-means router's, for reference).
3. Re-route every training and validation document of SHARDS (decoded from its tokens, so the shard
   directory is all it needs) and write SHARDS2 in the same format (through ``dipaco.storage.shards.ShardWriter``,
   the format's one writer): same tokenizer, tokens unchanged, validation documents stay validation, the
   held-out and router documents keep their place.

A sharding stage: it reads a run (core) and fits a router (``dipaco.routing``) to write shards.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import dipaco
from dipaco.command_config import ReshardConfig as R  # the defaults, declared once
from dipaco.errors import DipacoError
from dipaco.model.scoring import document_nll
from dipaco.routing import Router
from dipaco.routing.discriminative import fit_discriminative
from dipaco.routing.router import top_paths
from dipaco.sharding.tokenizer import encode
from dipaco.sharding.writer import heldout_purity, histogram, route_agreement
from dipaco.storage.outputs import atomic_dir
from dipaco.storage.run import Run
from dipaco.storage.shards import DOC_FOLDERS, ShardSet, ShardWriter, read_docs


def loss_matrix(run: Run, paths: list[str], ids: list[list[int]], at_round: int | None = None,
                progress: bool = True) -> np.ndarray:
    """(documents, paths) mean next-token NLL of every document under every path."""
    cfg = run.config
    out = np.full((len(ids), len(paths)), np.inf)
    for j, path in enumerate(tqdm(paths, desc="score router docs", unit="path", disable=not progress, dynamic_ncols=True)):
        model = run.path_model(path, at_round).model
        for i, (nll, n) in enumerate(document_nll(model, ids, cfg.eval.context_tokens, cfg.model.max_seq_len,
                                                   cfg.eval.batch_size, pad_id=run.info["eos_token_id"])):
            if n:
                out[i, j] = nll / n
    return out


def reshard(run_dir: str | Path, shards_dir: str | Path, out: str | Path, target: str = R.target,
            holdout_fraction: float = R.holdout_fraction, max_tokens: int = R.max_tokens, seed: int = R.seed, at_round: int | None = None,
            overwrite: bool = False, progress: bool = True) -> dict:
    """Write SHARDS2 ``out`` re-routed by a discriminative router fitted on ``run_dir``'s loss labels."""
    began = time.perf_counter()
    out = Path(out)
    shards, run, old = _check_inputs(run_dir, shards_dir, out, target, holdout_fraction, overwrite)
    docs, ids = _router_documents(shards, run, max_tokens)
    new, scores = _fit_router(shards, run, old, docs, ids, target, holdout_fraction, seed, at_round, progress)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        shutil.copytree(shards.root / "tokenizer", tmp / "tokenizer")
        new.save(tmp / "router")
        writer = ShardWriter(tmp, shards.paths, shards.dtype, shards.eos_token_id)
        moved, total = _route_documents(shards, new, writer, progress)
        writer.close()
        # the tokenizer is copied byte for byte: keep its hash (whatever definition the source shards used)
        sealed = writer.seal(shards.manifest["tokenizer"]["sha256"])
        report = {**scores, "moved_share": moved / total if total else 0.0, "moved_documents": moved,
                  "documents": total, "seconds": round(time.perf_counter() - began, 2)}
        writer.write_manifest({
            **shards.manifest,  # the source's fields in their order; the content fields are new
            "paths": writer.stats, "labels_per_path": {p: {} for p in shards.paths},  # labels are not stored per token document
            "tokens": writer.tokens, "path_sizes": histogram(writer.documents()),
            "router": {"sha256": sealed.router_sha256, **sealed.router},
            "tokenizer": {**shards.manifest["tokenizer"], "sha256": sealed.tokenizer_sha256},
            "route_agreement": route_agreement(tmp),
            "purity": {"train": None, "heldout": heldout_purity(tmp)},
            "fingerprint": sealed.fingerprint, "reshard": {"source": str(shards.root.resolve()), "run": str(run.root.resolve()),
                                                           **report},
            "versions": {"dipaco": dipaco.__version__},
        })
        if (shards.root / "config.toml").is_file():
            shutil.copyfile(shards.root / "config.toml", tmp / "config.toml")
    return report


def _check_inputs(run_dir, shards_dir, out: Path, target: str, holdout_fraction: float, overwrite: bool):
    """(shards, run, the shards' router), or one line naming what does not fit together."""
    if out.exists() and not overwrite:
        raise DipacoError(f"{out} already exists; choose another --out or pass --overwrite")
    if target not in ("current", "uniform"):
        raise DipacoError(f"--target {target!r} is unknown; use 'current' (the shard sizes) or 'uniform'")
    if not 0.0 < holdout_fraction < 1.0:
        raise DipacoError(f"--holdout-fraction must be in (0, 1), got {holdout_fraction}")
    shards = ShardSet(shards_dir)
    run = Run(run_dir)
    if run.info.get("shards_fingerprint") != shards.fingerprint:
        raise DipacoError(f"run {run.root} was trained on other shards than {shards.root}; "
                          f"pass the shards it was trained on (--shards {run.info.get('shards_dir')})")
    if run.is_dense:
        raise DipacoError(f"run {run.root} is a dense run (one path); re-sharding needs a run with one path per shard")
    if run.grid.paths != shards.paths:
        raise DipacoError(f"run {run.root} has paths {run.grid.paths}, the shards {shards.paths}; use the matching run")
    old = Router.load(shards.root / "router")
    if old.features is None:
        raise DipacoError(f"the router of {shards.root} ({old.kind}) has no features to fit a discriminative router on; "
                          f"re-shard with --assign kmeans")
    return shards, run, old


def _router_documents(shards: ShardSet, run: Run, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """The shards' router documents longer than the routing context, and their tokens (at most max_tokens)."""
    paths, docs = shards.paths, shards.router_docs()
    context = run.config.eval.context_tokens
    ids = [t[:max_tokens] for t in encode(shards.tokenizer(), [d["text"] for d in docs])]
    keep = [i for i, t in enumerate(ids) if len(t) > context + 1]
    if len(keep) < max(10, 2 * len(paths)):
        raise DipacoError(f"{shards.root} has {len(keep)} router documents longer than {context} tokens; re-shard with a "
                          f"larger data.router_fraction (need at least {max(10, 2 * len(paths))})")
    return [docs[i] for i in keep], [ids[i] for i in keep]


def _fit_router(shards: ShardSet, run: Run, old: Router, docs: list[dict], ids: list[list[int]], target: str,
                holdout_fraction: float, seed: int, at_round: int | None, progress: bool) -> tuple[Router, dict]:
    """The discriminative router fitted on the run's best path per router document (its loss label), and its scores
    on the held-back share of those documents beside the k-means router's."""
    paths = shards.paths
    losses = loss_matrix(run, paths, ids, at_round, progress)
    labels = losses.argmin(axis=1)
    x = old.features.transform(old.input.texts_of_ids(ids))  # the same prefix features eval will route by
    order = np.random.default_rng(seed).permutation(len(docs))
    n_test = max(1, int(np.floor(len(docs) * holdout_fraction + 0.5)))
    test, fit = np.sort(order[:n_test]), np.sort(order[n_test:])
    sizes = np.asarray([shards.manifest["paths"][p]["train_docs"] + shards.manifest["paths"][p]["val_docs"] for p in paths],
                       dtype=np.float64)
    target_shares = sizes + 1.0 if target == "current" else np.ones(len(paths))
    new = fit_discriminative(old.features, x[fit], labels[fit], old.shape, target_shares, old.input, seed)
    new.info.update({"run": str(run.root.resolve()), "round": run.latest() if at_round is None else at_round,
                     "source_shards": shards.fingerprint, "target_mode": target})
    predicted = new.path_distances(x[test]).argmin(axis=1)
    kmeans_pred = old.path_distances(x[test]).argmin(axis=1)
    return new, {"router_documents": len(docs), "fit_documents": int(len(fit)), "test_documents": int(len(test)),
                 "accuracy": float((predicted == labels[test]).mean()),
                 "kmeans_accuracy": float((kmeans_pred == labels[test]).mean()),
                 "label_shares": (np.bincount(labels, minlength=len(paths)) / len(labels)).round(4).tolist(),
                 "mean_loss_assigned_kmeans": float(losses[test, kmeans_pred].mean()),
                 "mean_loss_assigned_discriminative": float(losses[test, predicted].mean()),
                 "mean_loss_oracle": float(losses[test, labels[test]].mean())}


def _route_documents(shards: ShardSet, new: Router, writer: ShardWriter, progress: bool) -> tuple[int, int]:
    """Every training and validation document of the shards written to the path(s) ``new`` routes it to, and the
    held-out and router documents' files with their new path; (documents moved to another path, documents)."""
    paths = shards.paths
    overlap = int(shards.manifest.get("config", {}).get("routing", {}).get("overlap", 1))
    moved = total = 0
    seen: set[bytes] = set()
    batch: list[tuple[np.ndarray, str, str]] = []  # (tokens, old path, split)

    def flush():
        nonlocal moved, total
        d = new.distances_of_ids([t[:-1] for t, _, _ in batch])  # without the EOS the writer appended
        primary = d.argmin(axis=1)
        for (tokens, was, split), targets in zip(batch, top_paths(d, primary, overlap)):
            chosen = targets if split == "train" else targets[:1]
            writer.write(tokens, [paths[j] for j in chosen], split, None)
            moved += paths[chosen[0]] != was
            total += 1
        batch.clear()

    bar = tqdm(total=sum(shards.manifest["paths"][p]["train_docs"] + shards.manifest["paths"][p]["val_docs"] for p in paths),
               desc="re-shard", unit="doc", disable=not progress, dynamic_ncols=True)
    for p in paths:
        for split in ("train", "val"):
            tokens, offsets = shards.tokens(p, split), shards.doc_offsets(p, split)
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                bar.update(1)
                doc = np.asarray(tokens[a:b])
                if overlap > 1 and split == "train":  # an overlapped document is stored once per path
                    digest = hashlib.blake2b(doc.tobytes(), digest_size=16).digest()
                    if digest in seen:
                        continue
                    seen.add(digest)
                batch.append((doc, p, split))
                if len(batch) >= 512:
                    flush()
    if batch:
        flush()
    bar.close()
    for folder in DOC_FOLDERS:
        rows = read_docs(shards.root, folder)
        for r, path in zip(rows, new.route([r["text"] for r in rows]) if rows else []):
            writer.write_doc(folder, {**r, "path": path})
    return moved, total

