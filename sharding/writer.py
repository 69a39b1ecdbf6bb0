"""The shard stage: documents -> tokenizer -> router -> one token shard per path (the format: dipaco.storage.shards).

Plan, blocks, merge (``sharding.plan``, ``.scan``, ``.parts``), on any engine (``sharding.engines``):

1. plan: the corpus cut into blocks in one global order (files, parquet row groups, byte ranges of big
   JSON-lines files);
2. pass 1, a task per block (``scan.scan_block``): filter, digest, each document's candidate role, the
   block's bottom-k of the fit sample. Then one global step (``scan.join``): exact dedup over all blocks
   (the first copy in the global order wins), the roles' caps, the fit sample, the counts;
3. the fits, once, in the driver: the tokenizer and the router (on ``DECISION_THREADS`` threads);
4. pass 2, a task per block (``parts.part_block``): tokenize, route by the decoded first
   ``routing.prefix_tokens`` tokens (with the ``--balance`` offsets the router carries; ``--overlap``
   copies), write the block's part;
5. merge: the parts appended in block order, offsets rebased, the manifest written.

Every per-document decision is a function of the document, the seed and the fitted router
(``sharding.decisions``), so one process, N local processes and Ray on many nodes write a byte-identical
shard directory (manifest timings, thread and worker counts aside). Passes and fits commit into a work
directory beside ``out`` (``.<out>.work``): a driver killed mid-stage is resumed with ``resume=True``
(``--resume``), which reuses every committed part whose fingerprint matches and refuses one that does not.
The shard directory itself is written under a temporary name and renamed into place (``atomic_dir``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
# the fit step saves the tokenizer through transformers (seconds to import): loaded with the driver, before the
# stage starts, not in the middle of it (dipaco.sharding.tokenizer imports it lazily, for pass-2 workers)
from transformers import PreTrainedTokenizerFast  # noqa: F401

import dipaco
from dipaco.config import to_dict, to_toml
from dipaco.shard_config import ShardConfig
from dipaco.errors import DipacoError
from dipaco.io import sha256_dir
from dipaco.model.grid import parse_grid
from dipaco.routing import Router
from dipaco.routing.fit import document_target, fit_router
from dipaco.sharding.engines import make_engine
from dipaco.sharding.parts import Fits, part_block
from dipaco.sharding.plan import largest_first, make_plan, settings_key
from dipaco.sharding.scan import SampleBound, commit, join, peak_rss_mb, read_meta, scan_block, temp_dir
from dipaco.sharding.sources import describe_inputs
from dipaco.sharding.threads import decision_threads, in_decision_threads, set_num_proc
from dipaco.sharding.tokenizer import load_tokenizer, tokenizer_sha256, train_tokenizer
from dipaco.storage.outputs import atomic_dir, check_out_dir
from dipaco.storage.shards import ShardWriter, read_docs

WORK_MARK = "work.json"


class ResumeRefused(DipacoError):
    """--resume met work made under another fingerprint: refused, and the work is left as it was."""


def _sha(*items) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def work_dir(out: Path, settings: str, resume: bool) -> Path:
    """``.<out>.work`` beside ``out``: kept when ``resume``, else started afresh (only one dipaco made)."""
    work = out.parent / f".{out.name}.work"
    if work.exists():
        if read_meta_file(work / WORK_MARK) is None:
            raise DipacoError(f"{work} exists and dipaco did not write it; move it away (dipaco keeps its shard work there)")
        if not resume:
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).write_text(json.dumps({"kind": "dipaco shard work", "settings": settings}))
    return work


def read_meta_file(f: Path) -> dict | None:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def check_committed(work: Path, folder: str, expected: dict[str, str]) -> int:
    """--resume: the committed parts of ``folder`` that will be reused; one whose fingerprint differs (or
    whose block the plan no longer has) is refused in one line."""
    reused = 0
    for part in sorted((work / folder).glob("[0-9]*")):
        meta = read_meta(part)
        if meta is None:
            continue
        if meta.get("fingerprint") != expected.get(part.name):
            raise ResumeRefused(f"--resume: {part} was made from other inputs, config or seed than this command's "
                              f"({meta.get('block', '?')}); rerun without --resume to start over")
        reused += 1
    return reused


def tokenizer_texts(sample: list[str], limit_chars: int) -> list[str]:
    """The tokenizer's training texts: the fit sample in its key order, up to ``limit_chars`` characters."""
    out, total = [], 0
    for text in sample:
        if total >= limit_chars:
            break
        out.append(text)
        total += len(text)
    return out


def in_background(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread (a failed stage exits without waiting for it); its result or exception
    comes with ``.result()``."""
    future: Future = Future()

    def call():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=call, daemon=True).start()
    return future


def fit_step(work: Path, scanned: dict, cfg: ShardConfig, tokenizer_dir: str | None, fingerprint: str,
             progress: bool) -> tuple[Fits, dict]:
    """The tokenizer and the router, fitted once on the sample and committed to ``work/fits`` (reused on resume)."""
    final = work / "fits"
    meta = read_meta(final)
    if meta is not None and meta["fingerprint"] != fingerprint:
        raise ResumeRefused(f"--resume: {final} was fitted for other inputs, config or seed than this command's; "
                          f"rerun without --resume to start over")
    if meta is None:
        began = time.perf_counter()
        tmp = temp_dir(final)
        # The router's document target needs no tokenizer: it is computed on one thread while the
        # tokenizer trains on the others and the router's prefix features are fitted; the router waits for
        # it only to fit its classifier. That thread pins its own threads too (OpenMP's count is per
        # calling thread), so the bits are those of the sequential fit. torch is imported (a second, on an
        # otherwise idle core) only for a model's features; tf-idf and the target never compute with it.
        with_torch = cfg.routing.features != "tfidf"
        with decision_threads(with_torch), ThreadPoolExecutor(1) as beside:
            target = beside.submit(in_decision_threads, document_target, scanned["sample"], cfg.grid, cfg.seed,
                                   cfg.routing, with_torch=False)
            tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else train_tokenizer(
                tokenizer_texts(scanned["sample"], cfg.tokenizer.train_chars), cfg.tokenizer.vocab_size)
            tok.save_pretrained(str(tmp / "tokenizer"))
            t_tok = time.perf_counter() - began
            router = fit_router(scanned["sample"], cfg.grid, tok, cfg.seed, progress, cfg=cfg.routing,
                                target=target.result)
        router.save(tmp / "router")
        vocab_size = len(tok)
        meta = {"fingerprint": fingerprint, "vocab_size": vocab_size, "eos": tok.eos_token_id, "paths": router.paths,
                "dtype": np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32).name,
                "timing": {"tokenizer": round(t_tok, 2), "router": round(time.perf_counter() - began - t_tok, 2)}}
        (tmp / "meta.json").write_text(json.dumps(meta))
        commit(tmp, final)
    return Fits(str(final), scanned["roles"], meta["dtype"], int(meta["eos"])), meta


def shard(inputs: list[str], cfg: ShardConfig, out: str | Path, tokenizer_dir: str | None = None,
          overwrite: bool = False, progress: bool = True, engine: str = "local", address: str = "",
          resume: bool = False, max_retries: int = 3) -> dict:
    """Write the shard directory ``out``; returns its manifest. ``engine``: 'local' (``cfg.num_proc`` processes
    of this machine) or 'ray' (the cluster at ``address``, or a local Ray); ``resume``: reuse the committed
    work of a killed run of the same command."""
    began = time.perf_counter()
    shape = parse_grid(cfg.grid)
    # before any work: --out is not an input, and an existing one is a shard directory (replaced with --overwrite)
    out = check_out_dir(out, "shards", inputs={"--data": list(inputs), "--tokenizer": tokenizer_dir,
                                               "--feature-model": cfg.routing.feature_model}, overwrite=overwrite)
    threads = set_num_proc(cfg.num_proc)
    num_paths = int(np.prod(shape))
    blocks = make_plan(list(inputs), cfg)
    settings = settings_key(cfg, tokenizer_sha256(tokenizer_dir) if tokenizer_dir else None)
    fps = {b.name: b.fingerprint(settings) for b in blocks}
    work = work_dir(out, settings, resume)
    runner = None
    try:
        reused = check_committed(work, "scan", fps) if resume else 0
        runner = make_engine(engine, cfg.num_proc, address, len(blocks), max_retries, progress)
        bound = SampleBound(str(work), cfg.routing.fit_sample, cfg.data.dedup)
        order = largest_first(blocks)
        metas = runner.run(scan_block, [(b, cfg, str(work), fps[b.name]) for b in blocks], "scan",
                           on_result=lambda i, meta: bound.add(blocks[i].name), order=order)
        scanned = join(str(work), blocks, metas, cfg, runner.run)
        counts = scanned["counts"]
        if counts["documents"] == 0:
            raise DipacoError(f"no usable documents in {', '.join(map(str, inputs))} (dropped: {scanned['dropped']}); "
                              f"check --text-column and --min-chars")
        if counts["train"] < num_paths:
            raise DipacoError(f"{counts['train']} training documents cannot fill {num_paths} paths; add data or use a smaller --grid")
        t_scan = time.perf_counter() - began
        # the manifest's hashes of the inputs: read beside the fits, which leave a core idle at times
        skipped_files: list[Path] = []  # one walk of the input directories gives both
        input_info = in_background(describe_inputs, list(inputs), cfg.data.split, skipped_files)
        fits, fitted = fit_step(work, scanned, cfg, tokenizer_dir, _sha(settings, sorted(fps.values())), progress)
        del scanned["sample"]
        t_fit = time.perf_counter() - began
        sums = _sha(tokenizer_sha256(Path(fits.root) / "tokenizer"), sha256_dir(Path(fits.root) / "router"))
        part_fps = {name: _sha(fp, sums) for name, fp in fps.items()}
        reused += check_committed(work, "parts", part_fps) if resume else 0
        parts = runner.run(part_block, [(b, cfg, str(work), fits, part_fps[b.name], scanned["dups"].get(b.name, []))
                                        for b in blocks], "tokenize+route+write", order=order)
        t_write = time.perf_counter() - began
        execution = {**runner.describe(), "blocks": len(blocks), "reused_parts": reused,
                     "scan_sample_texts": sum(m.get("sample_texts", 0) for m in metas), "peak_rss_mb": {
            "driver": peak_rss_mb(), "scan_worker": max(m["peak_rss_mb"] for m in metas),
            "dedup_worker": scanned["dedup_peak_rss_mb"], "write_worker": max(m["peak_rss_mb"] for m in parts)}}
        manifest = merge(work, out, overwrite, blocks, parts, fits, fitted, scanned, cfg, tokenizer_dir, {
            "inputs": input_info.result(), "skipped": [str(f) for f in skipped_files], "threads": threads, "began": began,
            "timing": {"scan": round(t_scan, 2), **fitted["timing"], "write": round(t_write - t_fit, 2)},
            "execution": execution})
    except Exception as exc:
        if not isinstance(exc, ResumeRefused):  # a bad input or a failed task: nothing worth resuming
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if runner is not None:
            runner.close()
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def merge(work: Path, out: Path, overwrite: bool, blocks, parts: list[dict], fits: Fits, fitted: dict, scanned: dict,
          cfg: ShardConfig, tokenizer_dir: str | None, info: dict) -> dict:
    """Append the parts in block order into the shard directory ``out`` and write its manifest."""
    r, counts, paths = cfg.routing, scanned["counts"], fitted["paths"]
    with atomic_dir(out, overwrite=overwrite) as tmp:
        shutil.copytree(Path(fits.root) / "tokenizer", tmp / "tokenizer")
        shutil.copytree(Path(fits.root) / "router", tmp / "router")
        writer = ShardWriter(tmp, paths, np.dtype(fitted["dtype"]), fitted["eos"])
        written = {"1": 0, "2": 0, "3": 0}
        primary = np.zeros(len(paths), dtype=np.int64)
        copies = 0
        try:
            for b, meta in zip(blocks, parts):
                writer.append_part(work / "parts" / b.name, meta["stats"], meta["labels"])
                for k, v in meta["written"].items():
                    written[k] += v
                primary += meta["primary"]
                copies += meta["overlap_copies"]
        finally:
            writer.close()
        counts.update(train=written["1"], heldout=written["2"], router=written["3"])
        stats, labels = writer.stats, writer.labels
        empty = [p for p, st in stats.items() if st["train_docs"] == 0]
        if empty:  # training refuses a path without data; say so now, not after the user has trained the others
            raise DipacoError(f"{len(empty)} of {len(paths)} paths got no training documents (e.g. {', '.join(empty[:3])}): "
                              f"{counts['train']} training documents do not spread over grid {cfg.grid}; "
                              f"use a smaller --grid, --balance, or more data")
        sealed = writer.seal(tokenizer_sha256(tmp / "tokenizer"))
        dropped, skipped = scanned["dropped"], info["skipped"]
        manifest = writer.write_manifest({
            "grid": cfg.grid, "paths": stats,
            "labels_per_path": labels, "token_dtype": fitted["dtype"], "vocab_size": fitted["vocab_size"],
            "eos_token_id": fitted["eos"], "documents": counts["documents"], "train_documents": counts["train"],
            "heldout_documents": counts["heldout"], "router_documents": counts["router"],
            "tokens": writer.tokens,
            "dropped": {k: v for k, v in dropped.items() if k != "truncated"},
            "truncated": dropped["truncated"], "invalid_utf8": scanned["invalid_utf8"],
            "inputs": info["inputs"],
            # files in the input directories that were not read (no known extension), so none goes unnoticed
            "skipped_files": {"count": len(skipped), "examples": skipped[:5]},
            "path_sizes": histogram(writer.documents()),
            "assignment": {"assign": r.assign, "cluster_on": r.cluster_on, "prefix_tokens": r.prefix_tokens,
                           "balance": r.balance, "shares": shares(primary, r.balance),
                           "overlap": r.overlap, "overlap_copies": copies},
            "route_agreement": route_agreement(tmp),
            "purity": {"train": purity(labels)["overall"], "heldout": heldout_purity(tmp)},
            "tokenizer": {"source": str(tokenizer_dir) if tokenizer_dir else "trained", "sha256": sealed.tokenizer_sha256},
            "router": {"sha256": sealed.router_sha256, "fit_documents": min(r.fit_sample, counts["train"]), **sealed.router},
            "fingerprint": sealed.fingerprint, "config": to_dict(cfg),
            "versions": {"dipaco": dipaco.__version__}, "threads": info["threads"],
            "seconds": round(time.perf_counter() - info["began"], 2), "timing": info["timing"],
            "execution": info["execution"],
        })
        (tmp / "config.toml").write_text(to_toml(cfg))
    return manifest


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
