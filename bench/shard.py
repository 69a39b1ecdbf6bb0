"""Benchmark of the shard stage on the shared corpus (../shared/corpus) at 1x, 4x (and 16x) its size.

    python bench/shard.py [--corpus DIR] [--grid 5] [--scales 1 4 16] [--repeats 3] [--out bench/shard_results.json]

Measures, each run a fresh process (its peak RSS its own; a worker's is read from the manifest), in ``--repeats``
windows (each: every run once, each bracketed by ``encode_batch`` right before and after it; the table gives
medians, the JSON every window):

- MB/s of text (the ``text`` field, UTF-8) for the whole stage and for its per-document pass (pass 2: tokenize,
  route, write), against the tokenizer's own ``encode_batch`` on the same text and the same number of cores
  (one process per core, one Rust thread each: the physical limit of the stage on this machine);
- the speed-up from 1 to 2 workers, as local processes (``--num-proc``) and as Ray workers on two local nodes
  of one CPU each (``ray.cluster_utils.Cluster``);
- peak RSS per worker (scan, dedup and write tasks) and of the driver, at every scale;
- a projection of hours for a 300 GB corpus on 1, 8 and 64 machines like this one (assumptions printed).

The 4x and 16x corpora repeat every document with a distinct last line per copy (exact dedup keeps them all;
routing sees the same prefixes), as uncompressed JSON lines, cut into blocks of ``--block-mb``. Prints a
table, writes JSON. Skips cleanly (exit 0) without the corpus.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_corpus import SHARED_CORPUS as DEFAULT_CORPUS  # noqa: E402

TARGET_GB = 300


def child_shard(spec: dict) -> dict:
    from dipaco.config import resolve
    from dipaco.shard_config import ShardConfig
    from dipaco.sharding.writer import nmi, purity, shard

    cfg = resolve(ShardConfig, overrides=[f'grid="{spec["grid"]}"', f"num_proc={spec['workers']}",
                                          f"data.block_bytes={spec['block_bytes']}"] + spec["extra"])
    cluster, address = None, ""
    if spec["engine"] == "ray":  # N local nodes of one CPU each: N machines as Ray sees them
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(spec["workers"] - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        address = cluster.address
    try:
        began = time.perf_counter()
        m = shard(spec["data"], cfg, spec["out"], progress=False, engine=spec["engine"], address=address)
        wall = time.perf_counter() - began
    finally:
        if cluster is not None:
            cluster.shutdown()
    return {"wall_s": wall, "timing": m["timing"], "execution": m["execution"], "documents": m["documents"],
            "tokens": m["tokens"], "purity": purity(m["labels_per_path"])["overall"], "nmi": nmi(m["labels_per_path"]),
            "driver_process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child_encode(spec: dict) -> dict:
    """encode_batch over the corpus's texts on ``workers`` processes of one Rust thread each (batches of 1024).
    Each process reads its share of the texts and loads the tokenizer before the clock starts (a barrier), so the
    time is the tokenizer's alone, not the shipping of the text to the processes (seconds at 16x)."""
    import multiprocessing

    n = spec["workers"]
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=_encode_share, args=(spec["tokenizer"], spec["data"], i, n, ready, results))
             for i in range(n)]
    for p in procs:
        p.start()
    ready.wait(timeout=1800)  # a process that died before the barrier breaks it instead of hanging the benchmark
    began = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in every process
    done = [results.get(timeout=7200) for _ in procs]
    for p in procs:
        p.join()
    return {"wall_s": max(end for end, _ in done) - began, "mb": sum(mb for _, mb in done)}


def child_dedup(spec: dict) -> dict:
    """Peak RSS of the global dedup over ``docs`` synthetic digests (1% duplicates) in 100 blocks: the task
    that holds every bucket (one task, as the in-process engine runs it up to 4M documents), and the
    driver's share afterwards (the duplicates' positions)."""
    import numpy as np

    from dipaco.sharding.scan import BUCKETS, dedup_buckets

    work, n, blocks = Path(spec["work"]), spec["docs"], 100
    rng = np.random.default_rng(0)
    digests = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).astype(np.uint64)
    digests[rng.choice(n, n // 100, replace=False)] = digests[rng.choice(n, n // 100, replace=False)]
    names = []
    for b, part in enumerate(np.array_split(digests, blocks)):
        root = work / "scan" / f"{b:06d}"
        root.mkdir(parents=True)
        bucket = (part[:, 0] >> np.uint64(56)).astype(np.int64)
        order = np.argsort(bucket, kind="stable")
        np.save(root / "digests.npy", part[order])
        np.save(root / "where.npy", order.astype(np.uint32))
        np.save(root / "cands.npy", np.ones(len(part), np.uint8))
        np.save(root / "bounds.npy", np.searchsorted(bucket[order], np.arange(BUCKETS + 1)).astype(np.int64))
        names.append(root.name)
    del digests, part
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    began = time.perf_counter()
    res = dedup_buckets(str(work), names, 0, BUCKETS)
    wall = time.perf_counter() - began
    task = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    dups = sum(len(v) for v in res["dups"].values())
    return {"docs": n, "duplicates": dups, "wall_s": wall, "task_mb_per_million": task / (n / 1e6),
            "driver_mb_per_million": dups * 8 / 1e6 / (n / 1e6)}


def _encode_share(tokenizer: str, files: list[str], i: int, n: int, ready, results) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers is imported: one Rust thread per process
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    texts = [t for j, t in enumerate(_texts(files)) if j % n == i]
    tok.encode_batch(["warm up"], add_special_tokens=False)
    ready.wait()
    for k in range(0, len(texts), 1024):
        tok.encode_batch(texts[k:k + 1024], add_special_tokens=False)
    results.put((time.perf_counter(), sum(len(t.encode("utf-8")) for t in texts) / 1e6))


def _texts(files: list[str]):
    for f in files:
        with (gzip.open(f, "rt", encoding="utf-8") if f.endswith(".gz") else open(f, encoding="utf-8")) as fh:
            for line in fh:
                text = json.loads(line)["text"].strip()
                if len(text) >= 64:
                    yield text


def corpus_stats(files: list[Path]) -> tuple[int, float]:
    docs = chars = 0
    for f in files:
        with (gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else open(f, encoding="utf-8")) as fh:
            for line in fh:
                docs += 1
                chars += len(json.loads(line)["text"].encode("utf-8"))
    return docs, chars / 1e6


def repeat_corpus(files: list[Path], times: int, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        target = out / f.name.replace(".jsonl.gz", ".jsonl")
        with gzip.open(f, "rt", encoding="utf-8") as fh, open(target, "w", encoding="utf-8") as w:
            rows = [json.loads(line) for line in fh]
            for k in range(times):
                for r in rows:
                    w.write(json.dumps({**r, "text": r["text"] + (f"\n\n[copy {k}]" if times > 1 else "")},
                                       ensure_ascii=False) + "\n")
        written.append(target)
    return written


def run_child(kind: str, spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def projection(mb_per_s_machine: float, speedup_2: float) -> dict:
    """Hours for TARGET_GB on 1, 8, 64 machines: pass 1 and 2 scale with machines at the measured 2-worker
    efficiency; the fits and the merge are fixed costs measured separately (passed in by the caller)."""
    return {m: TARGET_GB * 1e3 / (mb_per_s_machine * m * min(1.0, speedup_2 / 2) ** (m > 1)) / 3600 for m in (1, 8, 64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--grid", default="5")
    ap.add_argument("--scales", type=int, nargs="*", default=[1, 4, 16],
                    help="corpus sizes to run (none: only the dedup memory figure, added to an existing --out)")
    ap.add_argument("--engines", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    ap.add_argument("--block-mb", type=float, default=8.0, help="data.block_bytes of the runs, in MB")
    ap.add_argument("--repeats", type=int, default=3, help="windows: every run once, each between two encode_batch (medians reported)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="shard config override")
    ap.add_argument("--out", default=str(ROOT / "bench" / "shard_results.json"))
    ap.add_argument("--dedup-docs", type=int, default=2_000_000, help="synthetic digests for the dedup memory figure")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind = {"shard": child_shard, "encode": child_encode, "dedup": child_dedup}[args.child[0]]
        print(json.dumps(kind(json.loads(args.child[1]))))
        return 0
    corpus = Path(args.corpus)
    files = sorted(corpus.glob("*.jsonl.gz")) if corpus.is_dir() else []
    if not files:
        print(f"skipped: no corpus at {corpus} (*.jsonl.gz)")
        return 0
    rows, encode = [], {}
    with tempfile.TemporaryDirectory(prefix="dipaco-bench-") as tmp:
        tmp = Path(tmp)
        for scale in args.scales:
            data = repeat_corpus(files, scale, tmp / f"x{scale}")
            docs, mb = corpus_stats(data)
            # 1x: every engine at 1 and 2 workers (the speed-ups); larger: two local processes (throughput, memory)
            runs = [(e, w) for w in (1, 2) for e in args.engines] if scale == 1 else [("local", 2)]
            reps: dict[tuple, list[dict]] = {run: [] for run in runs}
            tokenizer = tmp / f"tokenizer-x{scale}"
            # every run is bracketed by encode_batch on the same text and worker count, right before and right after
            # it; its ratios are against the mean of the two (this machine's speed drifts by tens of percent within
            # minutes), and after / before is kept as the drift. An encode right after a run is the next run's
            # "before" when nothing ran in between.
            fresh: dict[int, float] = {}  # worker count -> encode_batch MB/s measured since the last run

            def measure(n: int) -> float:
                e = run_child("encode", {"data": [str(f) for f in data], "tokenizer": str(tokenizer), "workers": n})
                encode.setdefault(scale, {}).setdefault(n, []).append(e["mb"] / e["wall_s"])
                return e["mb"] / e["wall_s"]

            def shard_run(engine: str, workers: int) -> dict:
                out = tmp / f"shards-x{scale}-{engine}{workers}"
                r = run_child("shard", {"data": [str(f) for f in data], "out": str(out), "grid": args.grid,
                                        "extra": args.extra, "engine": engine, "workers": workers,
                                        "block_bytes": int(args.block_mb * 1e6)})
                if not tokenizer.exists():  # the same tokenizer every run (fitted on the same sample)
                    shutil.copytree(out / "tokenizer", tokenizer)
                shutil.rmtree(out, ignore_errors=True)
                return r

            shard_run("local", 2)  # a warm-up, not counted: the tokenizer for encode_batch, the file cache warm
            for rep in range(args.repeats):
                for engine, workers in runs:
                    before = fresh.get(workers) or measure(workers)
                    r = shard_run(engine, workers)
                    after = measure(workers)
                    fresh = {workers: after}
                    speed = (before + after) / 2
                    t = r["timing"]
                    r.update(rep=rep, stage_mb_s=mb / r["wall_s"], pass_mb_s=mb / t["write"], encode_mb_s=speed,
                             encode_before_after=[before, after], drift=after / before, fixed_s=t["tokenizer"] + t["router"])
                    r["stage_vs_encode"] = r["stage_mb_s"] / speed
                    r["pass_vs_encode"] = r["pass_mb_s"] / speed
                    reps[(engine, workers)].append(r)
                    print(f"{scale}x {engine} {workers} (window {rep + 1}/{args.repeats}): {r['wall_s']:.1f} s, stage "
                          f"{r['stage_mb_s']:.2f} MB/s, pass {r['pass_mb_s']:.2f} MB/s, encode {before:.2f} before, "
                          f"{after:.2f} after: {r['stage_vs_encode']:.2f}x / {r['pass_vs_encode']:.2f}x", flush=True)
            for (engine, workers), rs in reps.items():
                rows.append(summarise(rs, scale=scale, engine=engine, workers=workers, input_documents=docs, input_mb=mb))
            shutil.rmtree(tmp / f"x{scale}", ignore_errors=True)
        dedup = run_child("dedup", {"work": str(tmp / "dedup"), "docs": args.dedup_docs}) if args.dedup_docs else None
    if not rows:  # only the dedup figure: add it to the last full run's JSON
        out = Path(args.out)
        saved = json.loads(out.read_text()) if out.is_file() else {}
        out.write_text(json.dumps({**saved, "dedup_memory": dedup}, indent=1))
        print(json.dumps(dedup))
        return 0
    report(rows, encode, dedup, args)
    return 0


def median(values):
    return statistics.median(values)


def summarise(reps: list[dict], **fields) -> dict:
    """One row of the table: the median of each figure over the windows (the spread of the ratios kept), and every
    window's run under ``repeats``."""
    row = {**fields, "repeats": reps}
    for key in ("wall_s", "stage_mb_s", "pass_mb_s", "encode_mb_s", "fixed_s", "stage_vs_encode", "pass_vs_encode",
                "driver_process_peak_rss_mb"):
        row[key] = median([r[key] for r in reps])
    row["timing"] = {k: round(median([r["timing"][k] for r in reps]), 2) for k in reps[0]["timing"]}
    row["spread"] = {k: [min(r[k] for r in reps), max(r[k] for r in reps)] for k in ("stage_vs_encode", "pass_vs_encode")}
    row["execution"] = reps[0]["execution"] | {"peak_rss_mb": {k: max(r["execution"]["peak_rss_mb"][k] for r in reps)
                                                               for k in reps[0]["execution"]["peak_rss_mb"]}}
    for key in ("documents", "tokens", "purity", "nmi"):
        row[key] = reps[0][key]
    return row


def report(rows: list[dict], encode: dict, dedup: dict | None, args) -> None:
    def find(scale, engine, workers):
        return next((r for r in rows if (r["scale"], r["engine"], r["workers"]) == (scale, engine, workers)), None)

    def passes(r):
        return r["timing"]["scan"] + r["timing"]["write"]

    speedup = {}
    for engine in ("local", "ray"):
        a, b = find(1, engine, 1), find(1, engine, 2)
        if a and b:  # per window (the runs of one window are minutes apart), then the median
            pairs = list(zip(a["repeats"], b["repeats"]))
            speedup[engine] = {"stage": median([x["wall_s"] / y["wall_s"] for x, y in pairs]),
                               "passes": median([passes(x) / passes(y) for x, y in pairs]),
                               "passes_each_window": [round(passes(x) / passes(y), 3) for x, y in pairs]}
    def spread(r, key):
        lo, hi = r["spread"][key]
        return f"{lo:.2f}-{hi:.2f}"

    big = max(rows, key=lambda r: r["scale"])
    per_machine = big["input_mb"] / (big["timing"]["scan"] + big["timing"]["write"])  # both passes, both cores
    # the projection scales by a measured speed-up (Ray's, else local processes'), never an assumed one
    eff = speedup.get("ray", speedup.get("local", {})).get("passes")
    hours = projection(per_machine, eff) if eff else {}
    print(f"\nshard benchmark: grid {args.grid}, tf-idf features, blocks of {args.block_mb} MB, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end (the machine is shared: other work inflates wall time)")
    drifts = [x["drift"] for r in rows for x in r["repeats"]]
    print(f"medians over {args.repeats} windows (each: every run once; a run's ratios are against the mean of encode_batch "
          f"right before and right after it, whose ratio after / before ranged {min(drifts):.2f}-{max(drifts):.2f}), "
          f"the ratios' range in brackets")
    print("| corpus | engine | workers | MB | wall s | stage MB/s | pass MB/s | encode_batch MB/s | stage / encode | "
          "pass / encode | scan/tok/router/write s | peak RSS MB: driver / worker max |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        t, rss = r["timing"], r["execution"]["peak_rss_mb"]
        worker = max(rss["scan_worker"], rss["dedup_worker"], rss["write_worker"])
        print(f"| {r['scale']}x | {r['engine']} | {r['workers']} | {r['input_mb']:.0f} | {r['wall_s']:.1f} | "
              f"{r['stage_mb_s']:.2f} | {r['pass_mb_s']:.2f} | {r['encode_mb_s']:.2f} | {r['stage_vs_encode']:.2f} "
              f"[{spread(r, 'stage_vs_encode')}] | {r['pass_vs_encode']:.2f} [{spread(r, 'pass_vs_encode')}] | "
              f"{t['scan']}/{t['tokenizer']}/{t['router']}/{t['write']} | "
              f"{r['driver_process_peak_rss_mb']:.0f} / {worker:.0f} |")
    for engine, s in speedup.items():
        print(f"speed-up 1 -> 2 workers ({engine}): whole stage {s['stage']:.2f}x, passes {s['passes']:.2f}x "
              f"(each window: {', '.join(f'{x:.2f}' for x in s['passes_each_window'])})")
    fixed = big["fixed_s"]
    if not hours:
        print("no 300 GB projection: it needs the 1 -> 2 worker speed-up, measured at 1x (add 1 to --scales)")
    else:
        print(f"300 GB projection (passes at {per_machine:.2f} MB/s per 2-core machine, measured at {big['scale']}x; "
              f"{eff:.2f}x per doubling of workers carried to every machine; plus the fits, a fixed {fixed:.0f} s at a "
              f"full fit sample; inputs read as fast as here, the driver's merge and dedup not counted): "
              + ", ".join(f"{m} machines {h + fixed / 3600:.1f} h" for m, h in hours.items()))
    if dedup:
        print(f"global dedup of {dedup['docs']:,} digests ({dedup['duplicates']:,} duplicates) in one task: "
              f"{dedup['wall_s']:.1f} s, {dedup['task_mb_per_million']:.0f} MB per million documents in the task; "
              f"the driver keeps {dedup['driver_mb_per_million']:.2f} MB per million documents (the duplicates' positions)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"grid": args.grid, "dedup_memory": dedup, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                               "block_mb": args.block_mb, "encode_batch_mb_s": encode, "speedup_1_to_2": speedup,
                               "projection_hours_300gb": {m: h + fixed / 3600 for m, h in hours.items()} or None,
                               "goals": {"pass_vs_encode": 0.9, "stage_vs_encode_4x": 0.8, "speedup_1_to_2": 1.7},
                               "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
