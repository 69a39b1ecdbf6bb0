"""GPU check: a 2x2 run on one GPU with both engines, compared bit for bit, with tokens/s and MFU.

    python bench/gpu_check.py                       # builds a small corpus and shards, trains, compares, reports
    python bench/gpu_check.py --shards DIR          # on shards you already have

On a machine without CUDA it prints one line saying so and exits 0 (nothing is measured). With a GPU it trains
the same config and seed twice, ``dipaco train --device cuda`` (in-process) and ``dipaco train --engine ray
--device cuda`` (a local Ray that sees the GPU; each phase asks for ``ray.gpus_per_phase`` of it), then reports:

  * bit-identity of the final modules, outer momentum and trainee states (AdamW moments, step, data cursor)
  * tokens/s of the inner steps (the round lines' ``tokens_per_s``, wall clock of the whole round)
  * MFU in bf16: 6·N·tokens/s (+ attention: 12·layers·hidden·seq per token) over the GPU's dense bf16 peak

It writes a table to stdout and JSON to ``--json``. The engines need the ``ray`` extra; without it only the
in-process run is measured and the comparison says why it was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# Dense bf16 peak (TFLOP/s, no sparsity) by the device name's model; unknown cards report MFU as None.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def peak_tflops(name: str) -> float | None:
    for model, peak in BF16_PEAK_TFLOPS.items():
        if model in name:
            return peak
    return None


def flops_per_token(n_params: int, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N for the weights (forward + backward) and 12·L·d·T for attention scores."""
    return 6.0 * n_params + 12.0 * layers * hidden * seq


def make_shards(out: Path) -> Path:
    """A small real corpus (text that ships with Python) on a 2x2 grid."""
    from dipaco.config import resolve
    from dipaco.shard_config import ShardConfig
    from dipaco.sharding.sources import write_default_corpus
    from dipaco.sharding.writer import shard

    shards = out / "shards"
    if not (shards / "manifest.json").exists():
        corpus = out / "corpus.jsonl"
        if not corpus.exists():
            write_default_corpus(corpus, 400_000)
        cfg = resolve(ShardConfig, overrides=['grid="2x2"', "tokenizer.vocab_size=4096", "routing.balance=1.2"])
        shard([str(corpus)], cfg, shards, progress=False)
    return shards


def train(engine: str, shards: Path, run: Path, args, sets: list[str]) -> tuple[float, list[dict]]:
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(run), "--device", args.device,
           "--preset", args.preset, "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--quiet",
           *[a for kv in sets for a in ("--set", kv)]]
    if engine == "ray":
        cmd += ["--engine", "ray", "--workers", str(args.workers)]
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: the {engine} run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return time.perf_counter() - began, [r for r in rows if r.get("kind") == "round"]


def compare(a: Path, b: Path) -> dict:
    """Files of the last round that differ between two runs (modules, outer momentum, trainee states)."""
    from safetensors.torch import load_file

    ra, rb = (run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() for run in (a, b))
    differ, compared, worst = [], 0, 0.0
    for f in sorted(list((ra / "modules").glob("*.safetensors")) + list((ra / "state").glob("*"))):
        g = rb / f.relative_to(ra)
        if f.suffix == ".safetensors":
            ta, tb = load_file(str(f)), load_file(str(g))
        elif f.suffix == ".pt":
            ta, tb = flat(torch.load(f, weights_only=True)), flat(torch.load(g, weights_only=True))
        else:
            continue
        compared += 1
        for k in ta:
            x, y = ta[k], tb.get(k)
            if y is None or not torch.equal(x, y):
                differ.append(f"{f.relative_to(ra)}:{k}")
                if y is not None and x.is_floating_point():
                    worst = max(worst, float((x.double() - y.double()).abs().max()))
    return {"files": compared, "identical": not differ, "differing": differ[:20], "max_abs_diff": worst}


def flat(obj, prefix: str = "") -> dict:
    """A nested state (dicts, lists, tensors, numbers) as {dotted key: tensor}."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj if isinstance(obj, torch.Tensor) else torch.tensor(obj)} if obj is not None else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench/out/gpu_check")
    ap.add_argument("--shards", default="", help="shards to train on (default: build a small 2x2 set under --out)")
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2, help="CPUs of the local Ray (phases queue for the one GPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--json", default="bench/gpu_check_results.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same two runs and comparison on the CPU (checks this script where no GPU is)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "run it where a GPU is, nothing was measured")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = Path(args.shards) if args.shards else make_shards(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = {"sync": out / f"sync-{stamp}", "ray": out / f"ray-{stamp}"}
    sets = (["ray.gpus_per_phase=0.5"] if args.device == "cuda" else []) + args.set  # two phases share the GPU: the queue keeps it busy
    results, rows = {}, {}
    for engine, run in runs.items():
        if engine == "ray" and not _has_ray():
            results[engine] = {"skipped": "the ray extra is not installed (pip install -e '.[ray]')"}
            continue
        seconds, rows[engine] = train(engine, shards, run, args, sets)
        results[engine] = {"seconds": round(seconds, 1), **speed(rows[engine], run, shards)}
    identity = compare(runs["sync"], runs["ray"]) if "ray" in rows else {"skipped": results["ray"]["skipped"]}
    report = {"device": device_name(args.device), "torch": torch.__version__, "preset": args.preset,
              "rounds": args.rounds, "inner_steps": args.inner_steps, "overrides": sets, "engines": results,
              "bit_identity": identity, "bf16_peak_tflops": peak_tflops(device_name(args.device))}
    print_table(report)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401  (only asked whether it is installed; the engine imports it itself)
    except ImportError:
        return False
    return True


def speed(rounds: list[dict], run: Path, shards: Path) -> dict:
    """Tokens/s over the rounds after the first (the first pays CUDA start-up and cache warm-up), and MFU."""
    from dipaco.config import TrainConfig, resolve
    from dipaco.model.path_model import llama_config, new_model
    from dipaco.storage.shards import ShardSet

    cfg = resolve(TrainConfig, run / "config.toml")
    steady = rounds[1:] or rounds
    tokens, seconds = sum(r["tokens"] for r in steady), sum(r["seconds"] for r in steady)
    tps = tokens / seconds if seconds else None
    s = ShardSet(shards)
    with torch.device("meta"):  # a path is one whole model: count it without allocating it
        n_path = sum(p.numel() for p in new_model(llama_config(cfg.model, s.vocab_size, s.eos_token_id)).parameters())
    fpt = flops_per_token(n_path, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.max_seq_len)
    peak = peak_tflops(device_name(cfg.device))
    return {"tokens_per_s": round(tps) if tps else None, "path_parameters": n_path,
            "mfu_bf16": round(tps * fpt / (peak * 1e12), 4) if tps and peak else None,
            "loss_last_round": rounds[-1]["train_loss"]}


def print_table(report: dict) -> None:
    print(f"gpu_check on {report['device']} (torch {report['torch']}), preset {report['preset']}, "
          f"{report['rounds']} rounds x {report['inner_steps']} inner steps")
    print(f"{'engine':<8}{'seconds':>9}{'tokens/s':>12}{'MFU bf16':>10}{'last loss':>11}")
    for name, r in report["engines"].items():
        if "skipped" in r:
            print(f"{name:<8} skipped: {r['skipped']}")
            continue
        mfu = f"{100 * r['mfu_bf16']:.1f}%" if r["mfu_bf16"] is not None else "n/a"
        print(f"{name:<8}{r['seconds']:>9}{r['tokens_per_s']:>12}{mfu:>10}{r['loss_last_round']:>11.4f}")
    ident = report["bit_identity"]
    if "skipped" in ident:
        print(f"bit identity: skipped ({ident['skipped']})")
    else:
        print(f"bit identity over {ident['files']} files: {'identical' if ident['identical'] else 'DIFFERENT'}"
              + ("" if ident["identical"] else f" (max |diff| {ident['max_abs_diff']:.3g}; {ident['differing'][:3]})"))


if __name__ == "__main__":
    sys.exit(main())
