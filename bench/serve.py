"""Serving throughput and memory: ``dipaco serve`` against ``transformers serve`` on the same exported path.

    python bench/serve.py [--run RUN] [--work DIR] [--requests 48] [--max-tokens 64] [--out bench/serve_results.json]

Without --run it builds a model like the quickstart's (the embedded default corpus sharded 2x2, with a 4,096-token
vocabulary, the tiny preset) with a short training (speed does not depend on how well a model is trained), plus a
4x4 run for the memory figure. Then, in one run and on the same cores:

1. path 0-1 exported (``dipaco export``) and served by ``transformers serve DIR``; the same path served by
   ``dipaco serve --run RUN`` and asked for as ``NAME/0-1`` (pinned). Clients: 1, 4 and 16 concurrent, each sending
   greedy completions of --max-tokens tokens (both servers get the same prompts); tokens/s is completion tokens over
   wall time, latency is per request (p50, p99). The two servers alternate by concurrency, so drift hits both alike.
2. ``dipaco serve`` routed (model NAME): prompts from every domain, 16 clients; which paths answered.
3. Memory: every path of the 4x4 run asked once; the server's resident module bytes against the sum of the 16
   exported paths' weight files (what serving each path as its own model would hold).

Prints a Markdown table and writes JSON. Needs the serve and test extras plus ``transformers[serving]``' FastAPI and
``accelerate`` for ``transformers serve`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = ["def read_config(path):\n", "The history of the city", "import numpy as np\n", "It was a dark and stormy",
           "class Parser:\n    def", "In the beginning God", "SELECT name, age FROM", "The results show that the",
           "#include <stdio.h>\n", "Chapter I. The boy", "for i in range(10):", "We propose a new method"]


def build(work: Path) -> tuple[Path, Path]:
    """A 2x2 run as the quickstart trains it (shortened) and a 4x4 run, both tiny preset."""
    from dipaco.config import TrainConfig, resolve
    from dipaco.shard_config import ShardConfig
    from dipaco.sharding.sources import default_corpus_documents
    from dipaco.sharding.writer import shard
    from dipaco.training.train import train

    runs = {}
    corpus = work / "corpus.jsonl"
    if not corpus.exists():
        with open(corpus, "w") as f:
            for d in default_corpus_documents():
                f.write(json.dumps({"text": d.text, "domain": d.label}) + "\n")
    for grid, rounds in (("2x2", 4), ("4x4", 1)):
        shards, run = work / f"shards-{grid}", work / f"run-{grid}"
        if not (shards / "manifest.json").exists():
            shard([str(corpus)], resolve(ShardConfig, overrides=[f'grid="{grid}"', "tokenizer.vocab_size=4096",
                                                                 "routing.balance=1.1"]), shards, progress=False)
        if not (run / "checkpoints" / "latest").exists():
            cfg = resolve(TrainConfig, overrides=["val_batches=0"], flags={"preset": "tiny", "rounds": rounds,
                                                                           "inner_steps": 25})
            train(cfg, shards, run, progress=False)
        runs[grid] = run
    return runs["2x2"], runs["4x4"]


def post(url: str, body: dict) -> tuple[float, int]:
    started = time.perf_counter()
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - started, int(answer["usage"]["completion_tokens"])


def load(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` greedy completions over ``clients`` concurrent clients."""
    bodies = [{"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
              for i in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda b: post(url + "/v1/completions", b), bodies))
    wall = time.perf_counter() - started
    latencies = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {"clients": clients, "requests": requests, "tokens": tokens, "seconds": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "latencies": latencies, **_percentiles(latencies)}


def _percentiles(latencies: list[float]) -> dict:
    latencies = sorted(latencies)
    return {"p50_s": round(statistics.median(latencies), 4),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4)}


def merged(windows: list[dict]) -> dict:
    """Windows of one server and concurrency: the median window's tokens/s, latency percentiles over every request."""
    latencies = [t for w in windows for t in w["latencies"]]
    return {"clients": windows[0]["clients"], "requests": sum(w["requests"] for w in windows),
            "tokens_per_s": statistics.median(w["tokens_per_s"] for w in windows),
            "windows_tokens_per_s": [w["tokens_per_s"] for w in windows], **_percentiles(latencies)}


def path_counts(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("dipaco_path_requests_total{")}


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--run", help="a trained 2x2 run to serve (default: build one in --work)")
    ap.add_argument("--run-4x4", help="a trained 4x4 run for the memory figure (default: build one in --work)")
    ap.add_argument("--work", default="/tmp/dipaco-bench-serve")
    ap.add_argument("--requests", type=int, default=48, help="requests per measurement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="windows per server and concurrency, alternating the order")
    ap.add_argument("--path", default="0-1")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server (the same for both); a tiny "
                    "model gains nothing from a second thread, and spinning threads suffer most from other load")
    ap.add_argument("--out", default="bench/serve_results.json")
    args = ap.parse_args(argv)

    from dipaco.eval.api import load as load_run
    from serve_helpers import ServerProcess

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_before = list(os.getloadavg())  # other work on the machine skews every figure: it is kept with them
    run2, run4 = (Path(args.run), Path(args.run_4x4)) if args.run and args.run_4x4 else build(work)
    rr = load_run(run2, progress=False)
    export = work / f"export-{args.path}"
    if not (export / "config.json").exists():
        rr.export(args.path, export)
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **threads}
    hf_url = f"http://127.0.0.1:{args.port}"
    hf = subprocess.Popen([str(Path(sys.executable).with_name("transformers")), "serve", "--port", str(args.port),
                           "--host", "127.0.0.1", str(export)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ours = ServerProcess("--run", str(run2), "--name", "bench", env=threads)
    rows = []
    try:
        wait_up(hf_url, hf)
        for url, model in ((hf_url, str(export)), (ours.url, f"bench/{args.path}")):  # warm-up: loads, first passes
            load(url, model, 4, 8, 8)
        servers = (("transformers serve", hf_url, str(export)), ("dipaco serve, pinned", ours.url, f"bench/{args.path}"))
        for clients in (1, 4, 16):
            windows = {name: [] for name, _, _ in servers}
            for w in range(args.repeats):  # A B, then B A: drift between windows falls on both servers alike
                for name, url, model in (servers if w % 2 == 0 else servers[::-1]):
                    windows[name].append(load(url, model, clients, args.requests, args.max_tokens))
            for name, _, _ in servers:
                r = merged(windows[name])
                rows.append({"server": name, **r})
                print(f"{name:22s} clients {clients:2d}: {r['tokens_per_s']:8.1f} tokens/s {r['windows_tokens_per_s']} "
                      f" p50 {r['p50_s']:.3f} s  p99 {r['p99_s']:.3f} s", flush=True)
        before = path_counts(ours.url)
        routed = merged([load(ours.url, "bench", 16, args.requests, args.max_tokens)])
        rows.append({"server": "dipaco serve, routed", **routed})
        paths = {p: n - before.get(p, 0) for p, n in path_counts(ours.url).items() if n > before.get(p, 0)}
        batch_max = ours.metric("dipaco_batch_size_max")
    finally:
        hf.terminate()
        ours.stop()
    memory = resident_bytes(run4, work)
    torch.set_num_threads(args.threads)  # routing is timed in this process: the servers' threads
    route_ms = routing_cost(run2, work)

    by = {(r["server"], r["clients"]): r for r in rows}
    ratio = {c: round(by[("dipaco serve, pinned", c)]["tokens_per_s"] / by[("transformers serve", c)]["tokens_per_s"], 3)
             for c in (1, 4, 16)}
    scaling = round(by[("dipaco serve, pinned", 16)]["tokens_per_s"] / by[("dipaco serve, pinned", 1)]["tokens_per_s"], 2)
    print("\n| server | clients | tokens/s | p50 s | p99 s |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['p50_s']:.3f} | {r['p99_s']:.3f} |")
    print(f"\npinned / transformers serve: {ratio} (goal >= 0.9 at every concurrency)")
    print(f"dipaco pinned, 16 clients / 1 client: {scaling}x (goal >= 6x); largest batch {batch_max:.0f}")
    print(f"routed: requests per path {paths}; routing one prompt: {route_ms} ms")
    print(f"4x4 memory: {memory['resident_paths']} paths resident on {memory['resident_bytes']:,} bytes of modules "
          f"(distinct modules' files: {memory['distinct_module_bytes']:,}; tensors behind the paths' parameters, by "
          f"storage: {memory['parameter_bytes']:,}); the 16 exported paths hold {memory['exported_bytes']:,} "
          f"({memory['exported_bytes'] / memory['parameter_bytes']:.2f}x)")
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_average_before_after": [load_before, list(os.getloadavg())],
              "threads_per_server": args.threads, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "requests_per_window": args.requests, "path": args.path, "rows": rows,
              "pinned_over_transformers": ratio, "pinned_16_over_1": scaling, "largest_batch": batch_max,
              "routed_paths": paths, "routing_ms_per_prompt": route_ms, "memory_4x4": memory,
              "versions": {"transformers": __import__("transformers").__version__, "torch": __import__("torch").__version__}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def routing_cost(run2: Path, work: Path) -> dict:
    """Milliseconds to route one prompt, in process: the shard router, and a prefix-loss rule (every path scores the
    prompt's first tokens) on a copy of the run whose once rule says so."""
    import shutil

    from dipaco.eval.serve.engine import Engine

    copy = work / "run-2x2-prefix-loss"
    if not copy.exists():
        shutil.copytree(run2, copy)
        (copy / "routing").mkdir(exist_ok=True)
        (copy / "routing" / "once.json").write_text(json.dumps(
            {"chosen": {"kind": "prefix-loss", "prior": False}, "name": "prefix-loss", "reason": "set by bench/serve.py"}))
    out = {}
    for name, run, routing in (("shard router", run2, "shard"), ("prefix-loss", copy, "run")):
        engine = Engine(run=run, routing=routing)
        try:
            prompts = [engine.rr.encode(p) for p in PROMPTS]
            for ids in prompts[:2]:  # warm-up: every path loaded
                engine.route(ids)
            started = time.perf_counter()
            for _ in range(4):
                for ids in prompts:
                    engine.route(ids)
            out[name] = round(1000 * (time.perf_counter() - started) / (4 * len(prompts)), 2)
        finally:
            engine.close()
    return out


def resident_bytes(run4: Path, work: Path) -> dict:
    """Every path of the 4x4 run asked once: the server's resident module bytes, the distinct modules' bytes, and what
    the 16 exported paths hold on disk."""
    from dipaco.eval.api import load as load_run
    from serve_helpers import ServerProcess

    rr = load_run(run4, progress=False)
    exported = 0
    for p in rr.paths:
        out = work / "export-4x4" / p
        if not (out / "config.json").exists():
            rr.export(p, out)
        exported += sum(f.stat().st_size for f in out.glob("*.safetensors"))
    server = ServerProcess("--run", str(run4), "--name", "m")
    try:
        for p in rr.paths:
            post(server.url + "/v1/completions", {"model": f"m/{p}", "prompt": "x", "max_tokens": 1})
        resident = int(server.metric("dipaco_resident_module_bytes"))
        measured = int(server.metric("dipaco_resident_parameter_bytes"))
        paths = int(server.metric("dipaco_resident_paths"))
    finally:
        server.stop()
    distinct, _ = rr.bytes_of(rr.paths)
    return {"paths": len(rr.paths), "resident_paths": paths, "resident_bytes": resident, "parameter_bytes": measured,
            "distinct_module_bytes": distinct, "exported_bytes": exported}


if __name__ == "__main__":
    sys.exit(main())
