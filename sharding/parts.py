"""Pass 2 of the shard stage, per block: tokenize, route, write; and the merge of the blocks' parts.

A part (``WORK/parts/<block>/``) is a small shard directory without tokenizer, router or manifest, written
by ``dipaco.storage.shards.ShardWriter`` (the format's one writer) under a temporary name and renamed into place
when whole, plus ``meta.json`` (fingerprint, counts, peak RSS). The merge appends the parts in block order
(``ShardWriter.append_part``: token files concatenated, document offsets rebased, documents kept aside
concatenated), so the shard directory is the one a single process reading the corpus in order writes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dipaco.shard_config import ShardConfig
from dipaco.routing import Router
from dipaco.routing.base import top_paths
from dipaco.sharding.decisions import HELDOUT, ROUTER, TRAIN, Roles, digest, keys
from dipaco.sharding.plan import Block, block_rows
from dipaco.sharding.scan import commit, peak_rss_mb, read_meta, temp_dir
from dipaco.sharding.sources import DocumentFilter
from dipaco.sharding.threads import decision_threads
from dipaco.sharding.tokenizer import encode, load_backend_tokenizer
from dipaco.storage.shards import ShardWriter


@dataclass
class Fits:
    """What pass 2 needs from the global step: where the tokenizer and router are, and the role rule."""

    root: str  # WORK/fits (tokenizer/, router/)
    roles: Roles
    dtype: str
    eos: int  # the tokenizer's EOS id (a worker loads the Rust tokenizer alone, which does not know it)


_loaded: dict[str, tuple] = {}  # one tokenizer and router per worker process


def _load(fits: Fits):
    if fits.root not in _loaded:
        _loaded.clear()
        # the Rust tokenizer alone (the same ids; transformers is not imported in a worker), and torch only for a
        # router whose features compute with it (a model's): both take seconds to import
        tok = load_backend_tokenizer(Path(fits.root) / "tokenizer")
        with decision_threads(with_torch=False):
            router = Router.load(Path(fits.root) / "router")
        _loaded[fits.root] = (tok, router, getattr(router.features, "kind", "") in ("lm", "encoder"))
    return _loaded[fits.root]


def part_block(block: Block, cfg: ShardConfig, work: str, fits: Fits, fingerprint: str, dups) -> dict:
    """Tokenize, route and write one block into ``work/parts/<block>``; returns its meta."""
    final = Path(work) / "parts" / block.name
    if (meta := read_meta(final)) is not None:
        return meta
    tok, router, with_torch = _load(fits)
    paths, r, d = router.paths, cfg.routing, cfg.data
    tmp = temp_dir(final)
    writer = ShardWriter(tmp, paths, np.dtype(fits.dtype), fits.eos)
    filt = DocumentFilter(d.min_chars, d.max_chars, dedup=False)
    written = {HELDOUT: 0, ROUTER: 0, TRAIN: 0}
    primary = np.zeros(len(paths), dtype=np.int64)  # training documents per path, before overlap copies
    copies = 0
    pending: list = []

    def route_and_write():
        nonlocal copies
        if not pending:
            return
        future, rows = pending.pop()
        ids = future.result()
        with decision_threads(with_torch):
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
            copies += len(targets) - 1
            writer.write(ids[i], [paths[j] for j in targets], "val" if val else "train", label)

    # Tokenizing batch k (Rust, releases the GIL) overlaps with routing and writing batch k-1 (Python); batches
    # are written in order, so the output does not depend on timing. Every document is routed from its own
    # tokens (the decoded prefix), as eval and generate route it.
    pool = ThreadPoolExecutor(max_workers=1)
    batch: list = []

    def flush():
        future = pool.submit(encode, tok, [row[0] for row in batch])
        route_and_write()
        pending.append((future, list(batch)))
        batch.clear()

    skip, position = iter(int(p) for p in dups), 0  # dups: the block's duplicates' positions, ascending
    next_dup = next(skip, -1)
    try:
        for text, label in block_rows(block, cfg):
            text = filt(text)
            if text is None:
                continue
            here, position = position, position + 1
            if here == next_dup:  # an earlier copy exists in the global order (scan.dedup_buckets)
                next_dup = next(skip, -1)
                continue
            role_key, val_key, _ = keys(digest(text), cfg.seed)
            role = fits.roles.role(role_key)
            batch.append((text, None if label is None else str(label), role, role == TRAIN and fits.roles.is_val(val_key)))
            if len(batch) >= r.batch_size:
                flush()
        if batch:
            flush()
        route_and_write()
    finally:
        pool.shutdown(wait=True)
        writer.close()
    meta = {"fingerprint": fingerprint, "block": block.describe(), "stats": writer.stats, "labels": writer.labels,
            "written": {str(k): v for k, v in written.items()}, "primary": primary.tolist(), "overlap_copies": copies,
            "peak_rss_mb": peak_rss_mb()}
    (tmp / "meta.json").write_text(json.dumps(meta))
    commit(tmp, final)
    return meta
