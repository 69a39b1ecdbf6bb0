"""Benchmark of the shard stage on the whole shared corpus (../shared/corpus), at 1x and 4x its size.

    python bench/shard.py [--corpus DIR] [--grid 5] [--scales 1 4] [--out bench/out/shard.json]

Each run is a fresh process (``dipaco shard`` through its Python API) so that its peak RSS is its own.
The 4x corpus repeats every document four times with a distinct last line per copy, so exact dedup keeps
them all while routing sees the same prefixes. Prints a table and writes JSON. Skips cleanly (exit 0)
without the corpus. Reports wall time, docs/s, MB/s (uncompressed text), peak RSS, and purity / NMI of
the paths against the corpus's ``domain`` field.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_corpus import SHARED_CORPUS as DEFAULT_CORPUS  # noqa: E402


def child(data: list[str], out: str, grid: str, extra: list[str]) -> None:
    from dipaco.config import ShardConfig, resolve
    from dipaco.sharding.writer import nmi, purity, shard

    cfg = resolve(ShardConfig, overrides=[f'grid="{grid}"'] + extra)
    began = time.perf_counter()
    m = shard(data, cfg, out, progress=False)
    wall = time.perf_counter() - began
    print(json.dumps({"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "documents": m["documents"], "tokens": m["tokens"], "timing": m["timing"],
                      "purity": purity(m["labels_per_path"])["overall"], "nmi": nmi(m["labels_per_path"]),
                      "path_docs": {p: s["train_docs"] + s["val_docs"] for p, s in m["paths"].items()},
                      "labels_per_path": m["labels_per_path"], "dropped": m["dropped"], "threads": m["threads"]}))


def corpus_stats(files: list[Path]) -> tuple[int, int]:
    docs = chars = 0
    for f in files:
        with (gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else open(f, encoding="utf-8")) as fh:
            for line in fh:
                docs += 1
                chars += len(json.loads(line)["text"].encode("utf-8"))
    return docs, chars


def repeat_corpus(files: list[Path], times: int, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        target = out / f.name.replace(".jsonl.gz", ".jsonl")
        with gzip.open(f, "rt", encoding="utf-8") as fh, open(target, "w", encoding="utf-8") as w:
            rows = [json.loads(line) for line in fh]
            for k in range(times):
                for r in rows:
                    w.write(json.dumps({**r, "text": r["text"] + f"\n\n[copy {k}]"}, ensure_ascii=False) + "\n")
        written.append(target)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--grid", default="5")
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--set", dest="extra", action="append", default=[], help="shard config override")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "shard.json"))
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child[0])
        child(spec["data"], spec["out"], spec["grid"], spec["extra"])
        return 0
    corpus = Path(args.corpus)
    files = sorted(corpus.glob("*.jsonl.gz")) if corpus.is_dir() else []
    if not files:
        print(f"skipped: no corpus at {corpus} (*.jsonl.gz)")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="dipaco-bench-") as tmp:
        tmp = Path(tmp)
        for scale in args.scales:
            data = files if scale == 1 else repeat_corpus(files, scale, tmp / f"x{scale}")
            docs, nbytes = corpus_stats(data)
            spec = {"data": [str(f) for f in data], "out": str(tmp / f"shards-x{scale}"), "grid": args.grid,
                    "extra": args.extra}
            began = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r.update({"scale": scale, "input_documents": docs, "input_mb": nbytes / 1e6,
                      "process_wall_s": time.perf_counter() - began, "docs_per_s": docs / r["wall_s"],
                      "mb_per_s": nbytes / 1e6 / r["wall_s"]})
            results.append(r)
            shutil.rmtree(tmp / f"shards-x{scale}", ignore_errors=True)
            if scale != 1:
                shutil.rmtree(tmp / f"x{scale}", ignore_errors=True)
    print(f"shard benchmark: grid {args.grid}, tf-idf features, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end (a shared machine inflates wall time)")
    print("| corpus | documents | MB | wall s | docs/s | MB/s | peak RSS MB | purity | NMI | scan/tok/router/write s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        t = r["timing"]
        print(f"| {r['scale']}x | {r['input_documents']} | {r['input_mb']:.1f} | {r['wall_s']:.1f} | {r['docs_per_s']:.0f} | "
              f"{r['mb_per_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['purity']:.3f} | {r['nmi']:.3f} | "
              f"{t['scan']}/{t['tokenizer']}/{t['router']}/{t['write']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"grid": args.grid, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                               "targets": {"wall_s_1x": 60, "peak_rss_mb": 2048, "purity": 0.85},
                               "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
