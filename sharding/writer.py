"""The shard stage: documents -> tokenizer -> router -> one token shard per path (the format: dipaco.shards).

Two streaming passes keep memory bounded however large the corpus grows:

1. read every record once: filter, drop exact duplicates (the first copy in the corpus's order is
   kept), and collect what the caps and the fits need, all decided by the document itself
   (``sharding.decisions``): its role (held-out, router document, training) from a keyed hash of its
   digest, and the fit sample as the bottom-k of another (each text cut to ``SAMPLE_CHARS``). The
   tokenizer and the router are fitted on that sample, the router on ``DECISION_THREADS`` threads.
2. read the records again and, batch by batch, tokenize them (the tokenizer's Rust thread pool,
   ``num_proc`` threads), route every document by its decoded first ``routing.prefix_tokens`` tokens
   (the router's one input, the same eval and generate use; the nearest path, with the ``--balance``
   offsets the router carries; ``--overlap`` copies) and append the tokens and document offsets to
   the per-path files.

The files and the manifest are written through ``dipaco.shards.ShardWriter``, the format's one writer.
Everything is written under a temporary directory renamed into place at the end (``atomic_dir``), so a
failure leaves nothing behind. Same inputs and seed give a byte-identical directory (manifest
timestamps aside).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import dipaco
from dipaco.config import ShardConfig, to_dict, to_toml
from dipaco.errors import DipacoError
from dipaco.grid import parse_grid
from dipaco.outputs import atomic_dir, check_out_dir
from dipaco.routing import Router
from dipaco.routing.fit import fit_router
from dipaco.shards import ShardWriter, read_docs
from dipaco.routing.base import top_paths
from dipaco.sharding.decisions import HELDOUT, ROUTER, TRAIN, BottomK, Roles, digest, keys
from dipaco.sharding.sources import DocumentFilter, describe_inputs, iter_rows
from dipaco.sharding.threads import decision_threads, set_num_proc
from dipaco.sharding.tokenizer import encode, load_tokenizer, tokenizer_sha256, train_tokenizer

SAMPLE_CHARS = 4096  # a sampled document keeps this many characters (tokenizer training, router fit)


def scan(inputs: list[str], cfg: ShardConfig, progress: bool = True) -> dict:
    """Pass 1: drop counts, the caps of the held-out and router candidates, and the fit sample (the
    ``routing.fit_sample`` training documents of smallest sample key, each cut to ``SAMPLE_CHARS``)."""
    d = cfg.data
    filt = DocumentFilter(d.min_chars, d.max_chars, dedup=False)
    rule = Roles(d.heldout_fraction, d.router_fraction, d.val_fraction)
    aside = {HELDOUT: BottomK(d.max_heldout_docs, d.dedup), ROUTER: BottomK(d.max_router_docs, d.dedup)}
    candidates = {HELDOUT: 0, ROUTER: 0}
    sample = BottomK(cfg.routing.fit_sample, d.dedup)
    seen: set[bytes] = set()
    documents, read = 0, {"invalid_utf8": 0}
    bar = tqdm(desc="scan", unit="doc", disable=not progress, dynamic_ncols=True)
    for text, _ in iter_rows(inputs, d.text_column, d.label_column, d.split, stats=read):
        text = filt(text)
        bar.update(1)
        if text is None:
            continue
        key = digest(text)
        if d.dedup:
            if key in seen:
                filt.dropped["duplicate"] += 1
                continue
            seen.add(key)
        documents += 1
        role_key, _, sample_key = keys(key, cfg.seed)
        wanted = rule.candidate(role_key)
        if wanted == TRAIN:
            sample.offer(sample_key, text[:SAMPLE_CHARS])
        else:
            aside[wanted].offer(role_key)
            candidates[wanted] += 1
    bar.close()
    del seen
    rule.fit(aside[HELDOUT], aside[ROUTER])
    if documents == 0:
        raise DipacoError(f"no usable documents in {', '.join(inputs)} (dropped: {filt.report()}); "
                          f"check --text-column and --min-chars")
    heldout, router = (min(candidates[r], max(0, aside[r].k)) for r in (HELDOUT, ROUTER))
    return {"roles": rule, "sample": [text for _, text in sample.result()], "dropped": filt.report(),
            "counts": {"documents": documents, "train": documents - heldout - router},
            "invalid_utf8": read["invalid_utf8"]}


def tokenizer_texts(sample: list[str], limit_chars: int) -> list[str]:
    """The tokenizer's training texts: the fit sample in its key order, up to ``limit_chars`` characters."""
    out, total = [], 0
    for text in sample:
        if total >= limit_chars:
            break
        out.append(text)
        total += len(text)
    return out


def histogram(sizes: list[int], bins: int = 10) -> dict:
    """Summary and histogram of path sizes (documents per path)."""
    a = np.asarray(sizes, dtype=np.float64)
    if not len(a):
        return {}
    counts, edges = np.histogram(a, bins=min(bins, max(1, len(a))))
    mean = float(a.mean())
    return {"min": int(a.min()), "max": int(a.max()), "mean": round(mean, 2),
            "max_over_mean": round(float(a.max()) / mean, 3) if mean else None,
            "cv": round(float(a.std()) / mean, 3) if mean else None,
            "bins": [round(float(e), 1) for e in edges], "counts": counts.tolist()}


def shard(inputs: list[str], cfg: ShardConfig, out: str | Path, tokenizer_dir: str | None = None,
          overwrite: bool = False, progress: bool = True) -> dict:
    """Write the shard directory ``out``; returns its manifest."""
    began = time.perf_counter()
    shape = parse_grid(cfg.grid)
    # before any work: --out is not an input, and an existing one is a shard directory (replaced with --overwrite)
    out = check_out_dir(out, "shards", inputs={"--data": list(inputs), "--tokenizer": tokenizer_dir,
                                               "--feature-model": cfg.routing.feature_model}, overwrite=overwrite)
    threads = set_num_proc(cfg.num_proc)
    num_paths = int(np.prod(shape))
    d, r = cfg.data, cfg.routing

    scanned = scan(inputs, cfg, progress)
    counts, roles, sample = scanned["counts"], scanned["roles"], scanned["sample"]
    if counts["train"] < num_paths:
        raise DipacoError(f"{counts['train']} training documents cannot fill {num_paths} paths; add data or use a smaller --grid")
    skipped_files: list[Path] = []  # one walk of the input directories gives both
    input_info = describe_inputs(inputs, d.split, skipped_files)
    skipped = [str(f) for f in skipped_files]
    t_scan = time.perf_counter() - began

    with atomic_dir(out, overwrite=overwrite) as tmp:
        tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else train_tokenizer(
            tokenizer_texts(sample, cfg.tokenizer.train_chars), cfg.tokenizer.vocab_size)
        tok.save_pretrained(str(tmp / "tokenizer"))
        vocab_size, eos = len(tok), tok.eos_token_id
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32
        t_tok = time.perf_counter() - began

        with decision_threads():
            router = fit_router(sample, cfg.grid, tok, cfg.seed, progress, cfg=cfg.routing)
        router.save(tmp / "router")
        paths = router.paths
        del sample
        t_router = time.perf_counter() - began

        writer = ShardWriter(tmp, paths, dtype, eos)
        filt = DocumentFilter(d.min_chars, d.max_chars, dedup=False)
        seen: set[bytes] = set()
        written = {HELDOUT: 0, ROUTER: 0, TRAIN: 0}
        primary = np.zeros(len(paths), dtype=np.int64)  # training documents per path, before overlap copies
        overlap_copies = 0
        bar = tqdm(total=counts["documents"], desc="tokenize+route+write", unit="doc", disable=not progress,
                   dynamic_ncols=True)
        batch: list[tuple[str, str | None, int, bool]] = []
        # Tokenizing batch k (Rust, releases the GIL) overlaps with routing and writing batch k-1 (Python);
        # batches are written strictly in order, so the output does not depend on timing. Every document is
        # routed from its own tokens (the decoded prefix), exactly as eval and generate will route it.
        pool = ThreadPoolExecutor(max_workers=1)
        pending: list = []

        def route_and_write():
            nonlocal overlap_copies
            if not pending:
                return
            future, rows = pending.pop()
            ids = future.result()
            with decision_threads():
                dist = router.distances_of_ids(ids)
            nearest = dist.argmin(axis=1)
            top = top_paths(dist, nearest, max(1, r.overlap))
            for i, (text, label, role, val) in enumerate(rows):
                written[role] += 1
                if role != TRAIN:
                    writer.write_doc("heldout" if role == HELDOUT else "router_docs",
                                     {"text": text, "label": label, "path": paths[int(nearest[i])]})
                    continue
                targets = top[i][:1] if val else top[i]
                primary[targets[0]] += 1
                overlap_copies += len(targets) - 1
                writer.write(ids[i], [paths[j] for j in targets], "val" if val else "train", label)

        def flush():
            future = pool.submit(encode, tok, [row[0] for row in batch])
            route_and_write()
            pending.append((future, list(batch)))
            bar.update(len(batch))
            batch.clear()

        try:
            for text, label in iter_rows(inputs, d.text_column, d.label_column, d.split):
                text = filt(text)
                if text is None:
                    continue
                key = digest(text)
                if d.dedup:
                    if key in seen:
                        continue
                    seen.add(key)
                role_key, val_key, _ = keys(key, cfg.seed)
                role = roles.role(role_key)
                batch.append((text, None if label is None else str(label), role, role == TRAIN and roles.is_val(val_key)))
                if len(batch) >= r.batch_size:
                    flush()
            if batch:
                flush()
            route_and_write()
        finally:
            pool.shutdown(wait=True)
            bar.close()
            writer.close()
        del seen
        counts.update(train=written[TRAIN], heldout=written[HELDOUT], router=written[ROUTER])
        t_write = time.perf_counter() - began

        stats, labels = writer.stats, writer.labels
        empty = [p for p, st in stats.items() if st["train_docs"] == 0]
        if empty:  # training refuses a path without data; say so now, not after the user has trained the others
            raise DipacoError(f"{len(empty)} of {num_paths} paths got no training documents (e.g. {', '.join(empty[:3])}): "
                              f"{counts['train']} training documents do not spread over grid {cfg.grid}; "
                              f"use a smaller --grid, --balance, or more data")
        sealed = writer.seal(tokenizer_sha256(tmp / "tokenizer"))
        manifest = writer.write_manifest({
            "grid": cfg.grid, "paths": stats,
            "labels_per_path": labels, "token_dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
            "eos_token_id": eos, "documents": counts["documents"], "train_documents": counts["train"],
            "heldout_documents": counts["heldout"], "router_documents": counts["router"],
            "tokens": writer.tokens,
            "dropped": {k: v for k, v in scanned["dropped"].items() if k != "truncated"},
            "truncated": scanned["dropped"]["truncated"], "invalid_utf8": scanned["invalid_utf8"],
            "inputs": input_info,
            # files in the input directories that were not read (no known extension), so none goes unnoticed
            "skipped_files": {"count": len(skipped), "examples": skipped[:5]},
            "path_sizes": histogram(writer.documents()),
            "assignment": {"assign": r.assign, "cluster_on": r.cluster_on, "prefix_tokens": r.prefix_tokens,
                           "balance": r.balance, "shares": shares(primary, r.balance),
                           "overlap": r.overlap, "overlap_copies": overlap_copies},
            "route_agreement": route_agreement(tmp),
            "purity": {"train": purity(labels)["overall"], "heldout": heldout_purity(tmp)},
            "tokenizer": {"source": str(tokenizer_dir) if tokenizer_dir else "trained", "sha256": sealed.tokenizer_sha256},
            "router": {"sha256": sealed.router_sha256, "fit_documents": min(r.fit_sample, counts["train"]), **sealed.router},
            "fingerprint": sealed.fingerprint, "config": to_dict(cfg),
            "versions": {"dipaco": dipaco.__version__}, "threads": threads,
            "seconds": round(time.perf_counter() - began, 2),
            "timing": {"scan": round(t_scan, 2), "tokenizer": round(t_tok - t_scan, 2),
                       "router": round(t_router - t_tok, 2), "write": round(t_write - t_router, 2)},
        })
        (tmp / "config.toml").write_text(to_toml(cfg))
    return manifest


def shares(primary: np.ndarray, balance: float) -> dict:
    """What ``--balance`` reached on the whole corpus: each path's share of the training documents (their
    first path; overlap copies aside) over the mean share, and whether the largest stayed within the cap.
    The cap is met exactly on the fit sample (the router's offsets); on the corpus up to sampling error."""
    total = int(primary.sum())
    over_mean = (primary * len(primary) / total) if total else np.zeros(len(primary))
    out = {"documents": primary.tolist(), "max_over_mean": round(float(over_mean.max()), 4),
           "min_over_mean": round(float(over_mean.min()), 4)}
    if balance > 0:
        out["within_cap"] = bool(over_mean.max() <= balance)
    return out


def route_agreement(root: Path) -> dict:
    """Share of held-out documents whose path, as written by the shard stage, is the path the frozen router
    (``Router.load(root/router)``, as ``dipaco eval`` loads it) answers from the text alone; 1.0 when routing
    is one function. (Training documents sit on the path the router answers by construction: their first one.)"""
    docs = read_docs(root, "heldout")
    routes = Router.load(root / "router").route([x["text"] for x in docs]) if docs else []
    same = sum(r == x["path"] for r, x in zip(routes, docs))
    return {"heldout": same / len(docs) if docs else None, "heldout_documents": len(docs)}


def heldout_purity(root: Path) -> float | None:
    counts: dict[str, dict[str, int]] = {}
    for x in read_docs(root, "heldout"):
        if x.get("label") is not None:
            c = counts.setdefault(x["path"], {})
            c[x["label"]] = c.get(x["label"], 0) + 1
    return purity(counts)["overall"] if counts else None


def purity(labels_per_path: dict[str, dict[str, int]]) -> dict:
    """Share of each path's documents in its majority label, and overall (weighted by path size)."""
    per_path = {p: (max(c.values()) / sum(c.values()) if c else None) for p, c in labels_per_path.items()}
    total = sum(sum(c.values()) for c in labels_per_path.values())
    overall = sum(max(c.values()) for c in labels_per_path.values() if c) / total if total else None
    return {"overall": overall, "per_path": per_path}


def nmi(labels_per_path: dict[str, dict[str, int]]) -> float | None:
    """Normalised mutual information (arithmetic mean) between paths and labels, from the counts."""
    from sklearn.metrics import normalized_mutual_info_score

    names = sorted({l for c in labels_per_path.values() for l in c})
    if not names:
        return None
    paths, labs, weights = [], [], []
    for i, c in enumerate(labels_per_path.values()):
        for j, name in enumerate(names):
            if c.get(name):
                paths.append(i)
                labs.append(j)
                weights.append(c[name])
    return float(normalized_mutual_info_score(np.repeat(labs, weights), np.repeat(paths, weights)))
