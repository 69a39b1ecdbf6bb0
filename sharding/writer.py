"""The shard stage: documents -> tokenizer -> router -> one token shard per path (the format: dipaco.shards).

Two streaming passes keep memory bounded however large the corpus grows:

1. read every record once: filter, drop exact duplicates, decide each kept document's role (held-out,
   router document, or training) from a seeded random stream (when there are more held-out or router
   candidates than their cap, a seeded uniform subset of them is kept, so they come from the whole
   corpus, not its first files), and keep a seeded reservoir sample of
   ``routing.fit_sample`` training documents (each cut to ``SAMPLE_CHARS``). The tokenizer and the
   router are fitted on that sample.
2. read the records again and, batch by batch, tokenize them (the tokenizer's Rust thread pool,
   ``num_proc`` threads), route every document by its decoded first ``routing.prefix_tokens`` tokens
   (the router's one input, the same eval and generate use; nearest path, the ``--balance`` cap,
   ``--overlap`` copies) and append the tokens and document offsets to the per-path files.

The files and the manifest are written through ``dipaco.shards.ShardWriter``, the format's one writer.
Everything is written under a temporary directory renamed into place at the end (``atomic_dir``), so a
failure leaves nothing behind. Same inputs and seed give a byte-identical directory (manifest
timestamps aside).
"""

from __future__ import annotations

import os
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
from dipaco.sharding.sources import DocumentFilter, describe_inputs, iter_rows
from dipaco.sharding.tokenizer import encode, load_tokenizer, tokenizer_sha256, train_tokenizer

SAMPLE_CHARS = 4096  # a sampled document keeps this many characters (tokenizer training, router fit)
DROPPED, TRAIN, HELDOUT, ROUTER = 0, 1, 2, 3


def set_num_proc(num_proc: int) -> int:
    """Threads for the tokenizer's Rust pool (read once, at its first use in a process) and for torch."""
    n = num_proc or os.cpu_count() or 1
    if num_proc:
        os.environ["RAYON_NUM_THREADS"] = str(n)
    else:
        os.environ.setdefault("RAYON_NUM_THREADS", str(n))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return n


class _Uniform:
    """A seeded stream of uniforms, drawn in blocks (fast per document, same values however consumed)."""

    def __init__(self, *seed: int, block: int = 4096):
        self.rng, self.block, self.buf, self.i = np.random.default_rng(list(seed)), block, np.zeros(0), 0

    def __call__(self) -> float:
        if self.i >= len(self.buf):
            self.buf, self.i = self.rng.random(self.block), 0
        self.i += 1
        return float(self.buf[self.i - 1])


def scan(inputs: list[str], cfg: ShardConfig, progress: bool = True) -> dict:
    """Pass 1: roles of every input record, drop counts, and a reservoir sample of training documents."""
    d = cfg.data
    filt = DocumentFilter(d.min_chars, d.max_chars, d.dedup)
    roles = bytearray()
    draw, pick = _Uniform(cfg.seed, 1), np.random.default_rng([cfg.seed, 2])
    sample: list[tuple[str, str | None]] = []
    counts = {"documents": 0, "train": 0, "heldout": 0, "router": 0}
    aside: dict[int, list[int]] = {HELDOUT: [], ROUTER: []}  # record numbers of the candidates
    bar = tqdm(desc="scan", unit="doc", disable=not progress, dynamic_ncols=True)
    read = {"invalid_utf8": 0}
    for text, label in iter_rows(inputs, d.text_column, d.label_column, d.split, stats=read):
        text = filt(text)
        bar.update(1)
        if text is None:
            roles.append(DROPPED)
            continue
        counts["documents"] += 1
        u = draw()
        if u < d.heldout_fraction:
            aside[HELDOUT].append(len(roles))
            roles.append(HELDOUT)
            continue
        if d.heldout_fraction <= u < d.heldout_fraction + d.router_fraction:
            aside[ROUTER].append(len(roles))
            roles.append(ROUTER)
            continue
        roles.append(TRAIN)
        t = counts["train"]
        counts["train"] += 1
        item = (text[:SAMPLE_CHARS], None if label is None else str(label))
        if t < cfg.routing.fit_sample:  # reservoir sampling (Algorithm R), seeded
            sample.append(item)
        else:
            j = int(pick.integers(0, t + 1))
            if j < cfg.routing.fit_sample:
                sample[j] = item
    bar.close()
    # Keep a seeded uniform subset of the candidates when there are more than the cap (the first ones
    # would all come from the first files); the others train. They miss the fit sample, which is only a sample.
    keep_rng = np.random.default_rng([cfg.seed, 4])
    for role, cap, key in ((HELDOUT, d.max_heldout_docs, "heldout"), (ROUTER, d.max_router_docs, "router")):
        candidates = aside[role]
        if len(candidates) > cap:
            kept = set(keep_rng.choice(len(candidates), size=cap, replace=False).tolist())
            for j, i in enumerate(candidates):
                if j not in kept:
                    roles[i] = TRAIN
        counts[key] = min(cap, len(candidates))
        counts["train"] += len(candidates) - counts[key]
    if counts["documents"] == 0:
        raise DipacoError(f"no usable documents in {', '.join(inputs)} (dropped: {filt.report()}); "
                          f"check --text-column and --min-chars")
    return {"roles": roles, "sample": sample, "counts": counts, "dropped": filt.report(),
            "invalid_utf8": read["invalid_utf8"]}


def _tokenizer_texts(sample: list[tuple[str, str | None]], limit_chars: int) -> list[str]:
    out, total = [], 0
    for text, _ in sample:
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


class StreamAssigner:
    """Batch assignment of training documents while streaming: nearest path (the router's distances,
    balance offsets included), a hard cap of ``capacity`` documents per path when balancing (overflow
    spills to the next-nearest path with room: the only case where a document trains on another path
    than the router answers; counted in ``spilled``), and ``overlap`` - 1 extra paths for training documents."""

    def __init__(self, num_paths: int, capacity: int | None, overlap: int):
        self.capacity, self.overlap = capacity, max(1, overlap)
        self.load = np.zeros(num_paths, dtype=np.int64)
        self.spilled = 0
        self.overlap_copies = 0

    def assign(self, d: np.ndarray, is_val: list[bool]) -> list[list[int]]:
        order = np.argsort(d, axis=1, kind="stable")
        out = []
        for row, val in zip(order.tolist(), is_val):
            primary = row[0]
            if self.capacity is not None:
                for j in row:
                    if self.load[j] < self.capacity:
                        primary = j
                        break
                if primary != row[0]:
                    self.spilled += 1
            self.load[primary] += 1
            chosen = [primary]
            if not val and self.overlap > 1:
                chosen += [j for j in row if j != primary][: self.overlap - 1]
                self.overlap_copies += len(chosen) - 1
            out.append(chosen)
        return out


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
            _tokenizer_texts(sample, cfg.tokenizer.train_chars), cfg.tokenizer.vocab_size)
        tok.save_pretrained(str(tmp / "tokenizer"))
        vocab_size, eos = len(tok), tok.eos_token_id
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32
        t_tok = time.perf_counter() - began

        router = fit_router([t for t, _ in sample], cfg.grid, tok, cfg.seed, progress, cfg=cfg.routing)
        router.save(tmp / "router")
        paths = router.paths
        del sample
        t_router = time.perf_counter() - began

        capacity = int(np.ceil(r.balance * counts["train"] / num_paths)) if r.balance > 0 else None
        assigner = StreamAssigner(num_paths, capacity, r.overlap)
        writer = ShardWriter(tmp, paths, dtype, eos)
        val_draw = _Uniform(cfg.seed, 3)
        filt = DocumentFilter(d.min_chars, d.max_chars, dedup=False)  # roles already hold the dedup decision
        bar = tqdm(total=len(roles), desc="tokenize+route+write", unit="doc", disable=not progress, dynamic_ncols=True)
        batch: list[tuple[str, str | None, int]] = []
        # Tokenizing batch k (Rust, releases the GIL) overlaps with routing and writing batch k-1 (Python);
        # batches are written strictly in order, so the output does not depend on timing. Every document is
        # routed from its own tokens (the decoded prefix), exactly as eval and generate will route it.
        pool = ThreadPoolExecutor(max_workers=1)
        pending: list = []

        def route_and_write():
            if not pending:
                return
            future, rows = pending.pop()
            ids = future.result()
            dist = router.distances_of_ids(ids)
            train_rows = [i for i, (_, _, role) in enumerate(rows) if role == TRAIN]
            for i, (text, label, role) in enumerate(rows):
                if role != TRAIN:
                    writer.write_doc("heldout" if role == HELDOUT else "router_docs",
                                     {"text": text, "label": label, "path": paths[int(dist[i].argmin())]})
            if train_rows:
                is_val = [val_draw() < d.val_fraction for _ in train_rows]
                for i, val, targets in zip(train_rows, is_val, assigner.assign(dist[train_rows], is_val)):
                    writer.write(ids[i], [paths[j] for j in targets], "val" if val else "train", rows[i][1])

        def flush():
            future = pool.submit(encode, tok, [t for t, _, _ in batch])
            route_and_write()
            pending.append((future, list(batch)))
            bar.update(len(batch))
            batch.clear()

        try:
            for role, (text, label) in zip(roles, iter_rows(inputs, d.text_column, d.label_column, d.split)):
                if role == DROPPED:
                    bar.update(1)
                    continue
                text = filt(text)
                batch.append((text, None if label is None else str(label), role))
                if len(batch) >= r.batch_size:
                    flush()
            if batch:
                flush()
            route_and_write()
        finally:
            pool.shutdown(wait=True)
            bar.close()
            writer.close()
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
                           "balance": r.balance, "capacity": capacity, "spilled": assigner.spilled,
                           "overlap": r.overlap, "overlap_copies": assigner.overlap_copies},
            "route_agreement": route_agreement(tmp, assigner.spilled, counts["train"]),
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


def route_agreement(root: Path, spilled: int, train_documents: int) -> dict:
    """Share of held-out documents whose path, as written by the shard stage, is the path the frozen router
    (``Router.load(root/router)``, as ``dipaco eval`` loads it) answers from the text alone; 1.0 when routing
    is one function. Training documents differ only where the ``--balance`` cap spilled them."""
    docs = read_docs(root, "heldout")
    routes = Router.load(root / "router").route([x["text"] for x in docs]) if docs else []
    same = sum(r == x["path"] for r, x in zip(routes, docs))
    return {"heldout": same / len(docs) if docs else None, "heldout_documents": len(docs),
            "train": 1.0 - spilled / train_documents if train_documents else None}


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
