"""Eval vs training throughput of one path (target: eval tokens/s >= 4 x training tokens/s).

    python bench/eval_speed.py --run runs/dipaco [--shards SHARDS] [--path 0-0] [--steps 10] [--out bench.json]

Training: AdamW inner steps (forward, backward, clip, step) at the run's batch size and sequence
length, on windows of the path's shard. Eval: the routed-eval scorer (batched, inference mode)
over the held-out documents at the run's eval batch size. Both count input tokens processed.
Prints a Markdown table and writes JSON. Throughput is given per wall second and per CPU second of
this process: on a shared machine the CPU figure is the steadier one (use --threads 1 there; extra
threads spin while waiting for busy cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from dipaco.eval.documents import heldout_tokens
    from dipaco.model.scoring import window_nll, windows_for
    from dipaco.storage.run import Run
    from dipaco.storage.shards import BatchSampler, ShardSet
    from dipaco.training.phase import inner_step
    from dipaco.training.trainee import Trainee

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--run", required=True)
    ap.add_argument("--shards", help="default: the run's own shard directory")
    ap.add_argument("--path", help="default: the run's first path")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (after 2 warm-up steps)")
    ap.add_argument("--eval-tokens", type=int, default=100_000, help="stop eval timing after about this many tokens")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default="bench/eval_speed.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    run = Run(args.run)
    shards = ShardSet(args.shards or run.info["shards_dir"])
    path = args.path or run.grid.paths[0]
    cfg = run.config
    seq, bs = cfg.model.max_seq_len, cfg.inner.batch_size

    # ---- training throughput: the real inner step on the path's shard
    model = run.path_model(path)
    model.model.train()
    opt = torch.optim.AdamW(model.model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay)
    sources = [path] if path in shards.paths else shards.paths
    sampler = BatchSampler([shards.tokens(s) for s in sources], seq, bs, seed=0, names=sources)
    trainee = Trainee(0, path, sources, 1, model, opt, sampler)
    for _ in range(2):
        inner_step(trainee, cfg, 1000)
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        inner_step(trainee, cfg, 1000)
    train_s, train_cpu = time.perf_counter() - began, time.process_time() - cpu
    train_tokens = args.steps * bs * seq

    # ---- eval throughput: the scorer's batched windows over held-out documents
    _, ids = heldout_tokens(shards, cfg.eval.max_tokens_per_doc)
    wanted, total = [], 0
    for d, x in enumerate(ids):
        for j in windows_for(1, len(x), seq):
            wanted.append((d, j))
            total += min(seq, len(x) - 1 - j * seq)
        if total >= args.eval_tokens:
            break
    eval_model = run.path_model(path).model
    window_nll(eval_model, ids, wanted[:cfg.eval.batch_size], seq, cfg.eval.batch_size)  # warm-up
    began, cpu = time.perf_counter(), time.process_time()
    window_nll(eval_model, ids, wanted, seq, cfg.eval.batch_size, pad_id=run.info["eos_token_id"])
    eval_s, eval_cpu = time.perf_counter() - began, time.process_time() - cpu

    rows = {"wall": (train_tokens / train_s, total / eval_s), "cpu": (train_tokens / train_cpu, total / eval_cpu)}
    result = {"run": str(run.root), "path": path, "seq_len": seq, "train_batch": bs, "eval_batch": cfg.eval.batch_size,
              "train_steps": args.steps, "train_tokens": train_tokens, "eval_tokens": total,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "target_ratio": 4.0}
    for clock, (tr, ev) in rows.items():
        result[clock] = {"train_tokens_per_s": tr, "eval_tokens_per_s": ev, "ratio": ev / tr}
    print(f"path {path}, seq_len {seq}, train batch {bs}, eval batch {cfg.eval.batch_size}, {torch.get_num_threads()} threads")
    print("| clock | train tokens/s | eval tokens/s | eval / train | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for clock, (tr, ev) in rows.items():
        print(f"| {clock} | {tr:,.0f} | {ev:,.0f} | {ev / tr:.1f}x | >= 4x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
