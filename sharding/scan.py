"""Pass 1 of the shard stage, per block, and the global step that joins the blocks (dedup, roles, fit sample).

A block's scan part (``WORK/scan/<block>/``, committed by renaming a finished temporary directory):

  digests.npy   the 128-bit digest of every document the filter keeps, as two uint64 (big-endian halves),
                sorted by the digest's first byte (a *bucket*; ``bounds.npy`` holds the 257 bucket offsets)
  where.npy     each digest's position among the block's kept documents (uint32)
  cands.npy     each document's candidate role (``decisions.Roles.candidate``)
  sample.json   the block's bottom-k of the fit sample (keys and texts) and of the held-out / router keys
  sample_keys.npy  the fit sample's keys alone (two uint64 halves each), for the driver's running bound
  meta.json     fingerprint, drop counts, documents kept, peak RSS

A block keeps a sample text only if its key is at most the *sample bound*: the k-th smallest sample key among
the blocks finished so far (``SampleBound``, kept by the driver in ``WORK/sample_bound``). The final sample's
k-th key can only be smaller, so no text of the final sample is lost and the bytes are those of an unbounded
scan; but the scan writes about k (1 + ln(n / k)) texts for n training documents instead of up to k per block
(at scale, the first 4 KB of every document: most of the corpus written again).

Exact dedup is global and exact: a document is a duplicate when an equal digest comes earlier in the global
order (an earlier block, or earlier in its block), so the first copy wins whatever the split. The check runs
per range of buckets (``dedup_buckets``), each a task holding only its share of the digests as numpy arrays
(about 75 bytes per document while sorting, at most ``DEDUP_DOCS_PER_TASK`` per task), never a Python set.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import uuid
from pathlib import Path

import numpy as np

from dipaco.shard_config import ShardConfig
from dipaco.sharding.decisions import HELDOUT, ROUTER, TRAIN, BottomK, Roles, digest, keys
from dipaco.sharding.plan import Block, block_rows
from dipaco.sharding.sources import DocumentFilter

SAMPLE_CHARS = 4096  # a sampled document keeps this many characters (tokenizer training, router fit)
BUCKETS = 256  # digests are grouped by their first byte
DEDUP_DOCS_PER_TASK = 4_000_000  # bounds a dedup task's memory: it holds every digest of its buckets


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def commit(tmp: Path, final: Path) -> bool:
    """Rename a finished temporary directory into place; False (and ``tmp`` removed) when another attempt of
    the same task committed first (its content is the same: the first commit wins)."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def temp_dir(final: Path) -> Path:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def read_meta(part: Path) -> dict | None:
    try:
        return json.loads((part / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _key_halves(keys: list[int]) -> np.ndarray:
    return np.array([(k >> 64, k & 0xFFFFFFFFFFFFFFFF) for k in keys], dtype=np.uint64).reshape(-1, 2)


class SampleBound:
    """The driver's running bottom-k of the sample keys of finished blocks; its k-th key, once k are known, is
    written (atomically, as hex) to ``WORK/sample_bound`` for the blocks that start later."""

    def __init__(self, work: str, k: int, distinct: bool):
        self.path = Path(work) / "sample_bound"
        self.path.unlink(missing_ok=True)  # a bound is only valid for this command's blocks
        self.keys, self.written = BottomK(k, distinct), None

    def add(self, name: str) -> None:
        halves = np.load(self.path.parent / "scan" / name / "sample_keys.npy")
        for hi, lo in halves.tolist():
            self.keys.offer((hi << 64) | lo)
        bound = self.keys.threshold()
        if bound is not None and bound >= 0 and bound != self.written:
            tmp = self.path.with_name(f".sample_bound.tmp-{os.getpid()}")
            tmp.write_text(f"{bound:032x}")
            os.replace(tmp, self.path)
            self.written = bound


def read_sample_bound(work: str) -> int | None:
    try:
        return int((Path(work) / "sample_bound").read_text(), 16)
    except (OSError, ValueError):
        return None


def scan_block(block: Block, cfg: ShardConfig, work: str, fingerprint: str) -> dict:
    """Scan one block into ``work/scan/<block>``; returns its meta (an existing committed part is kept)."""
    final = Path(work) / "scan" / block.name
    if (meta := read_meta(final)) is not None:
        return meta
    d = cfg.data
    filt = DocumentFilter(d.min_chars, d.max_chars, dedup=False)
    rule = Roles(d.heldout_fraction, d.router_fraction, d.val_fraction)
    aside = {HELDOUT: BottomK(d.max_heldout_docs, d.dedup), ROUTER: BottomK(d.max_router_docs, d.dedup)}
    sample = BottomK(cfg.routing.fit_sample, d.dedup, limit=read_sample_bound(work))
    found, cands, read = [], [], {"invalid_utf8": 0}
    for text, _ in block_rows(block, cfg, read):
        text = filt(text)
        if text is None:
            continue
        key = digest(text)
        role_key, _, sample_key = keys(key, cfg.seed)
        wanted = rule.candidate(role_key)
        found.append(key)
        cands.append(wanted)
        if wanted == TRAIN:
            sample.offer(sample_key, text[:SAMPLE_CHARS])
        else:
            aside[wanted].offer(role_key)
    halves = np.frombuffer(b"".join(found), dtype=">u8").reshape(-1, 2).astype(np.uint64)
    bucket = (halves[:, 0] >> np.uint64(56)).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    tmp = temp_dir(final)
    np.save(tmp / "digests.npy", halves[order])
    np.save(tmp / "where.npy", order.astype(np.uint32))
    np.save(tmp / "cands.npy", np.asarray(cands, dtype=np.uint8)[order])
    np.save(tmp / "bounds.npy", np.searchsorted(bucket[order], np.arange(BUCKETS + 1)).astype(np.int64))
    sampled = sample.result()
    np.save(tmp / "sample_keys.npy", _key_halves([k for k, _ in sampled]))
    with open(tmp / "sample.json", "w", encoding="utf-8") as f:  # 128-bit keys as hex
        json.dump({"sample": [[f"{k:032x}", text] for k, text in sampled],
                   **{str(r): [f"{k:032x}" for k, _ in aside[r].result()] for r in (HELDOUT, ROUTER)}}, f, ensure_ascii=False)
    meta = {"fingerprint": fingerprint, "block": block.describe(), "kept": len(found), "sample_texts": len(sampled),
            "dropped": filt.report(), "invalid_utf8": read["invalid_utf8"], "peak_rss_mb": peak_rss_mb()}
    (tmp / "meta.json").write_text(json.dumps(meta))
    commit(tmp, final)
    return meta


def dedup_buckets(work: str, names: list[str], lo: int, hi: int) -> dict:
    """Duplicates among the digests of buckets [lo, hi) of every block (``names`` in global order).

    Returns {block name: positions of its duplicates}, the candidate roles' counts among first copies, and
    this task's peak RSS."""
    parts = []
    for b, name in enumerate(names):
        root = Path(work) / "scan" / name
        bounds = np.load(root / "bounds.npy")
        a, z = int(bounds[lo]), int(bounds[hi])
        if z > a:
            dig = np.load(root / "digests.npy", mmap_mode="r")[a:z]
            parts.append((np.asarray(dig), np.full(z - a, b, np.int32), np.load(root / "where.npy", mmap_mode="r")[a:z],
                          np.load(root / "cands.npy", mmap_mode="r")[a:z]))
    if not parts:
        return {"dups": {}, "cands": [0] * 4, "peak_rss_mb": peak_rss_mb()}
    dig = np.concatenate([p[0] for p in parts])
    blk = np.concatenate([p[1] for p in parts])
    pos = np.concatenate([p[2] for p in parts]).astype(np.int64)
    cand = np.concatenate([p[3] for p in parts])
    del parts
    order = np.lexsort((pos, blk, dig[:, 1], dig[:, 0]))  # equal digests together, in global order
    dig, blk, pos, cand = dig[order], blk[order], pos[order], cand[order]
    first = np.ones(len(dig), dtype=bool)
    first[1:] = (dig[1:] != dig[:-1]).any(axis=1)
    dups = {names[b]: np.sort(pos[~first & (blk == b)]) for b in np.unique(blk[~first])}
    return {"dups": dups, "cands": np.bincount(cand[first], minlength=4).tolist(), "peak_rss_mb": peak_rss_mb()}


def bucket_ranges(total_docs: int) -> list[tuple[int, int]]:
    """Contiguous bucket ranges, enough that each task holds about ``DEDUP_DOCS_PER_TASK`` digests."""
    tasks = min(BUCKETS, max(1, -(-total_docs // DEDUP_DOCS_PER_TASK)))
    edges = np.linspace(0, BUCKETS, tasks + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges, edges[1:]) if b > a]


def join(work: str, blocks: list[Block], metas: list[dict], cfg: ShardConfig, run) -> dict:
    """The global step after pass 1: dedup, the roles' caps, the fit sample, the counts.

    ``run(fn, list of argument tuples)`` runs tasks on the stage's engine and returns their results in order."""
    d = cfg.data
    names = [b.name for b in blocks]
    dropped: dict[str, int] = {}
    for m in metas:
        for k, v in m["dropped"].items():
            dropped[k] = dropped.get(k, 0) + v
    kept = sum(m["kept"] for m in metas)
    dups: dict[str, list] = {}  # block name -> positions of its duplicates (int64 arrays: 8 bytes per duplicate)
    cands = np.zeros(4, dtype=np.int64)
    rss = []
    if d.dedup:
        for res in run(dedup_buckets, [(work, names, lo, hi) for lo, hi in bucket_ranges(kept)]):
            cands += res["cands"]
            rss.append(res["peak_rss_mb"])
            for name, positions in res["dups"].items():
                dups.setdefault(name, []).append(np.asarray(positions, dtype=np.int64))
        dups = {k: np.sort(np.concatenate(v)) for k, v in dups.items()}
    else:
        for name in names:
            cands += np.bincount(np.load(Path(work) / "scan" / name / "cands.npy"), minlength=4)
    dropped["duplicate"] = sum(len(v) for v in dups.values())
    rule = Roles(d.heldout_fraction, d.router_fraction, d.val_fraction)
    sample = BottomK(cfg.routing.fit_sample, d.dedup)
    aside = {HELDOUT: BottomK(d.max_heldout_docs, d.dedup), ROUTER: BottomK(d.max_router_docs, d.dedup)}
    for name in names:  # bottom-k's merge in any order; bounded by 2k + 64 items at any time
        with open(Path(work) / "scan" / name / "sample.json", encoding="utf-8") as f:
            part = json.load(f)
        for key, text in part["sample"]:
            sample.offer(int(key, 16), text)
        for role in (HELDOUT, ROUTER):
            for key in part[str(role)]:
                aside[role].offer(int(key, 16))
    rule.fit(aside[HELDOUT], aside[ROUTER])
    documents = kept - dropped["duplicate"]
    heldout, router = (min(int(cands[r]), max(0, aside[r].k)) for r in (HELDOUT, ROUTER))
    return {"roles": rule, "sample": [text for _, text in sample.result()], "dropped": dropped, "dups": dups,
            "counts": {"documents": documents, "train": documents - heldout - router},
            "invalid_utf8": sum(m["invalid_utf8"] for m in metas), "dedup_peak_rss_mb": max(rss, default=0.0)}
