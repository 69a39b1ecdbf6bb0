"""The shard stage: documents -> tokenizer -> router -> one token shard per path (see dipaco.shards)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import dipaco
from dipaco.config import ShardConfig, to_dict, to_toml
from dipaco.errors import DipacoError
from dipaco.grid import parse_grid
from dipaco.io import atomic_dir, sha256_dir, write_json
from dipaco.routing import Router
from dipaco.shards import FORMAT, FORMAT_VERSION
from dipaco.sharding.sources import read_corpus
from dipaco.sharding.tokenizer import encode, load_tokenizer, train_tokenizer

BATCH = 512


def _sample_texts(texts: list[str], limit_chars: int, rng: np.random.Generator) -> list[str]:
    """A seeded random sample of documents holding about ``limit_chars`` characters."""
    order = rng.permutation(len(texts))
    out, total = [], 0
    for i in order:
        if total >= limit_chars:
            break
        out.append(texts[i])
        total += len(texts[i])
    return out


def shard(inputs: list[str], cfg: ShardConfig, out: str | Path, tokenizer_dir: str | None = None,
          overwrite: bool = False, progress: bool = True) -> dict:
    """Write the shard directory ``out``; returns its manifest."""
    began = time.perf_counter()
    shape = parse_grid(cfg.grid)
    out = Path(out)
    if out.exists() and not overwrite:
        raise DipacoError(f"{out} already exists; choose another --out or pass --overwrite")
    corpus = read_corpus(inputs, cfg.data.text_column, cfg.data.label_column, cfg.data.min_chars, cfg.data.max_chars)
    docs = corpus.documents
    num_paths = int(np.prod(shape))
    rng = np.random.default_rng(cfg.seed)

    # Held-out documents stay whole and are never trained on.
    order = rng.permutation(len(docs))
    n_heldout = min(cfg.data.max_heldout_docs, int(len(docs) * cfg.data.heldout_fraction))
    heldout_ids, train_ids = sorted(order[:n_heldout].tolist()), sorted(order[n_heldout:].tolist())
    if len(train_ids) < num_paths:
        raise DipacoError(f"{len(train_ids)} training documents cannot fill {num_paths} paths; add data or use a smaller --grid")
    train_texts = [docs[i].text for i in train_ids]

    with atomic_dir(out, overwrite=overwrite) as tmp:
        tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else train_tokenizer(
            _sample_texts(train_texts, cfg.tokenizer.train_chars, rng), cfg.tokenizer.vocab_size)
        tok.save_pretrained(str(tmp / "tokenizer"))
        vocab_size = len(tok)
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32

        fit_ids = rng.choice(len(train_texts), size=min(cfg.routing.fit_sample, len(train_texts)), replace=False)
        r = cfg.routing
        router = Router.fit([train_texts[i] for i in sorted(fit_ids)], cfg.grid, r.features, r.prefix_chars,
                            r.max_tfidf_features, r.svd_dims, r.kmeans_iters, r.product_split, cfg.seed)
        router.save(tmp / "router")
        paths = router.paths

        assignment = router.assign(train_texts, cfg.routing.balance)
        is_val = rng.random(len(train_texts)) < cfg.data.val_fraction

        files, offsets = {}, {}
        for p in paths:
            (tmp / "paths" / p).mkdir(parents=True)
            for split in ("train", "val"):
                files[p, split] = open(tmp / "paths" / p / f"{split}.bin", "wb")
                offsets[p, split] = [0]
        stats = {p: {"train_docs": 0, "train_tokens": 0, "val_docs": 0, "val_tokens": 0} for p in paths}
        labels: dict[str, dict[str, int]] = {p: {} for p in paths}
        bar = tqdm(total=len(train_texts), desc="tokenize+write", unit="doc", disable=not progress, dynamic_ncols=True)
        for start in range(0, len(train_texts), BATCH):
            batch = train_texts[start:start + BATCH]
            for j, ids in enumerate(encode(tok, batch)):
                k = start + j
                p, split = assignment[k], "val" if is_val[k] else "train"
                ids.append(tok.eos_token_id)
                files[p, split].write(np.asarray(ids, dtype=dtype).tobytes())
                offsets[p, split].append(offsets[p, split][-1] + len(ids))
                stats[p][f"{split}_docs"] += 1
                stats[p][f"{split}_tokens"] += len(ids)
                label = docs[train_ids[k]].label
                if label is not None:
                    labels[p][label] = labels[p].get(label, 0) + 1
            bar.update(len(batch))
        bar.close()
        for (p, split), f in files.items():
            f.close()
            np.asarray(offsets[p, split], dtype=np.int64).tofile(tmp / "paths" / p / f"{split}.idx")

        (tmp / "heldout").mkdir()
        heldout_texts = [docs[i].text for i in heldout_ids]
        heldout_paths = router.route(heldout_texts) if heldout_texts else []
        with open(tmp / "heldout" / "docs.jsonl", "w", encoding="utf-8") as f:
            for i, p in zip(heldout_ids, heldout_paths):
                f.write(json.dumps({"text": docs[i].text, "label": docs[i].label, "path": p}, ensure_ascii=False) + "\n")

        tokenizer_hash, router_hash = sha256_dir(tmp / "tokenizer"), sha256_dir(tmp / "router")
        fingerprint = hashlib.sha256(json.dumps([tokenizer_hash, router_hash, stats], sort_keys=True).encode()).hexdigest()
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "grid": cfg.grid, "paths": stats,
            "labels_per_path": labels, "token_dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
            "eos_token_id": tok.eos_token_id, "documents": len(docs), "train_documents": len(train_ids),
            "heldout_documents": len(heldout_ids), "dropped": corpus.dropped, "inputs": corpus.inputs,
            "tokenizer": {"source": str(tokenizer_dir) if tokenizer_dir else "trained", "sha256": tokenizer_hash},
            "router": {"sha256": router_hash, **json.loads((tmp / "router" / "router.json").read_text())},
            "fingerprint": fingerprint, "config": to_dict(cfg),
            "versions": {"dipaco": dipaco.__version__}, "seconds": round(time.perf_counter() - began, 2),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_json(tmp / "manifest.json", manifest)
        (tmp / "config.toml").write_text(to_toml(cfg))
    return manifest


def purity(labels_per_path: dict[str, dict[str, int]]) -> dict:
    """Share of each path's documents in its majority label, and overall (weighted by path size)."""
    per_path = {p: (max(c.values()) / sum(c.values()) if c else None) for p, c in labels_per_path.items()}
    total = sum(sum(c.values()) for c in labels_per_path.values())
    overall = sum(max(c.values()) for c in labels_per_path.values() if c) / total if total else None
    return {"overall": overall, "per_path": per_path}
