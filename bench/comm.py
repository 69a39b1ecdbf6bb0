"""Communication benchmark: data-parallel vs DiLoCo vs Streaming DiLoCo vs DiPaCo 2x2 streaming.

Every method trains the same model on the same shards (the shared corpus, routed 2x2) for the same
number of inner steps with 2 gloo workers on this machine and 4 trainees (DP/DiLoCo: one replica per
shard; DiPaCo: one trainee per path), so the tokens are the same. Reported per method:

  bytes/token        bytes all workers sent, over the training tokens
  ratio              data-parallel bf16 bytes / this method's bytes
  util@X             compute / (compute + waiting on communication) at a simulated link of X Mbit/s
                     (a model calibrated on the run: each sync's measured bytes at that speed, hidden
                     behind τ inner steps of measured compute; the runs themselves use `--sim` Mbit/s
                     and their measured utilisation is shown as util(meas))
  95% bw             the lowest simulated link speed that keeps utilisation >= 95%
  tok/s/worker       training tokens per second per worker (compute only, and over wall time)
  val loss           loss of the final global weights on the same validation windows of every shard

Data-parallel is DiLoCo with H = 1 and an outer SGD of lr 1 without momentum (the parameters are
averaged after every AdamW step), its transport in bf16. The ratios compare with the data-parallel
reference: the bytes of a bf16 gradient all-reduce (reduce-scatter + all-gather) among the 2 workers
every step, computed (``dipaco.training.comm.allreduce_bytes``). dipaco's own transport below 32 bits quantizes
every trainee's outer gradient (2 per worker here) and the reduce-scatter moves each one's chunks, so a
worker sends 1.5 payloads per sync and the measured data-parallel row sends 1.5x the reference.
Usage: python bench/comm.py [--quick] [--out bench/comm_results.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_corpus import SHARED_CORPUS as CORPUS  # noqa: E402
MODEL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=4",
         "model.intermediate_size=192", "model.max_seq_len=128", "inner.batch_size=8", "inner.warmup_steps=20",
         "inner.lr=2e-3", "val_batches=0", "log_every=0"]


def methods(quick: bool, H: int) -> dict[str, list[str]]:
    dense = ['grid.shape="1"', "grid.replicas_per_shard=true"]
    stream = ["streaming.fragments=2", "streaming.alpha=0.5", "comm.bits=4"]
    out = {
        "data-parallel (bf16, every step)": dense + ["inner_steps=1", "outer.lr=1.0", "outer.momentum=0.0",
                                                    "outer.nesterov=false", "comm.bits=16"],
        f"DiLoCo H={H} fp32": dense + [f"inner_steps={H}"],
        f"DiLoCo H={H} 4-bit": dense + [f"inner_steps={H}", "comm.bits=4"],
    }
    for tau in ((1, 5) if quick else (1, 2, 3, 4, 5)):
        out[f"Streaming DiLoCo F=2 τ={tau} 4-bit"] = dense + [f"inner_steps={H}", f"streaming.overlap={tau}"] + stream
    out[f"DiPaCo 2x2 streaming F=2 τ=2 4-bit"] = [f"inner_steps={H}", "streaming.overlap=2"] + stream
    return out


def make_shards(work: Path, docs_per_file: int) -> Path:
    sample = work / "sample.jsonl"
    with open(sample, "w", encoding="utf-8") as out:
        for f in sorted(CORPUS.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as inp:
                for i, line in enumerate(inp):
                    if i >= docs_per_file:
                        break
                    out.write(line)
    shards = work / "shards"
    subprocess.run([sys.executable, "-m", "dipaco.cli", "shard", "--data", str(sample), "--out", str(shards), "--grid",
                    "2x2", "--vocab-size", "4096", "--balance", "1.3", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return shards


QUICK_MODEL = ["model.max_seq_len=64", "inner.batch_size=4"]


def run_method(shards: Path, out: Path, sets: list[str], steps: int, sim_mbit: float, quick: bool = False) -> float:
    H = int(next(s for s in sets if s.startswith("inner_steps=")).split("=")[1])
    rounds = steps // H
    args = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--quiet",
            "--workers", "2", "--rounds", str(rounds), "--device", "cpu", "--simulate-bandwidth", str(sim_mbit),
            "--set", f"checkpoint_every={rounds}"]
    for kv in MODEL + (QUICK_MODEL if quick else []) + sets:
        args += ["--set", kv]
    began = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def val_loss(run_dir: Path, shards_dir: Path, windows_per_path: int = 16) -> float:
    import torch

    from dipaco.storage.run import Run
    from dipaco.storage.shards import ShardSet
    from dipaco.training.phase import fixed_windows, next_token_loss

    run, shards = Run(run_dir), ShardSet(shards_dir)
    losses = []
    with torch.no_grad():
        for p in shards.paths:
            windows = fixed_windows([shards.tokens(p, "val")], windows_per_path, run.config.model.max_seq_len)
            model = run.path_model(p if not run.is_dense else run.grid.paths[0]).model
            losses.append(next_token_loss(model, windows).item())
    return sum(losses) / len(losses)


def utilisation(compute_per_step: float, sync_bytes: list[int], steps: int, tau: int, mbit: float,
                latency_s: float = 0.0) -> float:
    """Modelled utilisation: every sync's bytes cross a link of ``mbit``; τ steps of compute hide it."""
    hidden = tau * compute_per_step
    wait = sum(max(0.0, b * 8 / (mbit * 1e6) + latency_s - hidden) for b in sync_bytes)
    compute = compute_per_step * steps
    return compute / (compute + wait)


def lowest_bandwidth(compute_per_step: float, sync_bytes: list[int], steps: int, tau: int, target: float = 0.95) -> float:
    lo, hi = 1e-3, 1e7  # Mbit/s
    if utilisation(compute_per_step, sync_bytes, steps, tau, lo) >= target:
        return lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if utilisation(compute_per_step, sync_bytes, steps, tau, mid) >= target else (mid, hi)
    return hi


def bare_loop_tokens_per_s(batch: int, seq: int, steps: int = 30) -> float:
    """A bare transformers training loop on the same model (one process, one thread, like a worker)."""
    code = f"""
import time, torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings={seq}, tie_word_embeddings=True, attn_implementation="sdpa")
m = LlamaForCausalLM(cfg); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randint(0, 4096, ({batch}, {seq + 1}))
def step():
    out = m(input_ids=x[:, :-1], labels=None).logits
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()); loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # the same inner step as a trainee's
    opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(5): step()
t = time.perf_counter()
for _ in range({steps}): step()
print({batch} * {seq} * {steps} / (time.perf_counter() - t))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def analyse(name: str, sets: list[str], run_dir: Path, shards: Path, steps: int, speeds: list[float]) -> dict:
    rounds = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"kind": "round"' in l]
    tau = int(next((s.split("=")[1] for s in sets if s.startswith("streaming.overlap=")), 0))
    H = int(next(s for s in sets if s.startswith("inner_steps=")).split("=")[1])
    F = int(next((s.split("=")[1] for s in sets if s.startswith("streaming.fragments=")), 1))
    tokens = sum(r["tokens"] for r in rounds)
    sent = sum(r["bytes_sent"] for r in rounds)
    workers = rounds[0]["workers"]
    compute = max(sum(r["by_worker"]["compute_s"][w] for r in rounds) for w in range(workers))
    wait = max(sum(r["by_worker"]["wait_s"][w] for r in rounds) for w in range(workers))
    wall = sum(r["seconds"] for r in rounds)
    # bytes the busiest worker sends per sync (its link carries them); syncs: F per H steps
    per_worker = max(sum(r["by_worker"]["bytes_sent"][w] for r in rounds) for w in range(workers))
    syncs = steps // H * F
    sync_bytes = [per_worker / syncs] * syncs
    per_step = compute / steps
    return {
        "method": name, "settings": sets, "tokens": tokens, "bytes_sent": sent, "bytes_per_token": sent / tokens,
        "compute_s": compute, "wait_s": wait, "wall_s": wall,
        "utilisation_measured": compute / (compute + wait),
        "utilisation_model": {str(s): utilisation(per_step, sync_bytes, steps, tau, s) for s in speeds},
        "lowest_mbit_for_95pct": lowest_bandwidth(per_step, sync_bytes, steps, tau),
        "tokens_per_s_per_worker_compute": tokens / workers / compute,
        "tokens_per_s_per_worker_wall": tokens / workers / wall,
        "val_loss": val_loss(run_dir, shards),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--quick", action="store_true",
                    help="200 inner steps, H=100, τ in {1, 5}, batch 4 x 64 tokens")
    ap.add_argument("--steps", type=int, help="inner steps per trainee (default 200 quick, 1000 full)")
    ap.add_argument("--H", type=int, default=100, help="inner steps per round for DiLoCo and streaming")
    ap.add_argument("--sim", type=float, default=1000.0, help="simulated link of the runs themselves (Mbit/s)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("comm_results.json")))
    ap.add_argument("--work", help="keep shards and runs here (default: a temporary directory)")
    args = ap.parse_args()
    if not any(CORPUS.glob("*.jsonl.gz")):
        print(f"bench/comm.py: skipped: the shared corpus ({CORPUS}/*.jsonl.gz) is absent")
        return 0
    steps = args.steps or (200 if args.quick else 1000)
    speeds = [1, 10, 100, 1000, 10000]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dipaco-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    shards = work / "shards" if (work / "shards" / "manifest.json").exists() else make_shards(work, 300 if args.quick else 2000)
    results = []
    for i, (name, sets) in enumerate(methods(args.quick, args.H).items()):
        run_dir = work / f"run{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_method(shards, run_dir, sets, steps, args.sim, args.quick)
        results.append(analyse(name, sets, run_dir, shards, steps, speeds))
        print(f"  done {name} ({time.perf_counter() - began:.0f}s)", file=sys.stderr)
    bare = bare_loop_tokens_per_s(4, 64) if args.quick else bare_loop_tokens_per_s(8, 128)
    from dipaco.training.comm import allreduce_bytes

    dp = results[0]
    per_path = json.loads((work / "run0" / "run.json").read_text())["parameters"]["per_path"]
    per_step = allreduce_bytes(per_path, 2, 16)  # each worker, every step
    reference = {"bytes_sent": 2 * per_step * steps,
                 "lowest_mbit_for_95pct": lowest_bandwidth(dp["compute_s"] / steps, [per_step] * steps, steps, 0)}
    fp32 = next(r for r in results if r["method"].startswith("DiLoCo") and "fp32" in r["method"])
    for r in results:
        r["ratio_vs_dp_bf16"] = reference["bytes_sent"] / max(1, r["bytes_sent"])
        r["ratio_vs_dp_fp32"] = 2 * reference["bytes_sent"] / max(1, r["bytes_sent"])
        r["bandwidth_reduction_vs_dp"] = reference["lowest_mbit_for_95pct"] / r["lowest_mbit_for_95pct"]
        r["val_loss_vs_diloco_fp32"] = r["val_loss"] / fp32["val_loss"] - 1
    summary = {"quick": args.quick, "steps_per_trainee": steps, "H": args.H, "workers": 2, "trainees": 4,
               "simulated_link_of_runs_mbit": args.sim, "bare_transformers_tokens_per_s": bare,
               "dp_bf16_allreduce_reference": reference,
               "note": "2 gloo workers on one shared CPU machine (2 cores, other jobs running): times are noisy",
               "seconds": time.perf_counter() - began, "methods": results}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary, speeds))
    print(f"\nwrote {args.out}")
    return 0


def table(summary: dict, speeds: list[float]) -> str:
    head = ["method", "bytes/token", "x fewer than DP bf16", *[f"util@{s}Mbit" for s in speeds], "util(meas)",
            "95% bw Mbit", "tok/s/worker (compute/wall)", "val loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["methods"]:
        lines.append("| " + " | ".join([
            r["method"], f"{r['bytes_per_token']:.1f}", f"{r['ratio_vs_dp_bf16']:.3g}",
            *[f"{100 * r['utilisation_model'][str(s)]:.0f}%" for s in speeds], f"{100 * r['utilisation_measured']:.0f}%",
            f"{r['lowest_mbit_for_95pct']:.3g}",
            f"{r['tokens_per_s_per_worker_compute']:.0f}/{r['tokens_per_s_per_worker_wall']:.0f}",
            f"{r['val_loss']:.3f}"]) + " |")
    lines.append(f"\nbare transformers loop (1 thread, one model): {summary['bare_transformers_tokens_per_s']:.0f} tokens/s; "
                 f"a worker runs 2 trainees in lockstep")
    ref = summary["dp_bf16_allreduce_reference"]
    lines.append(f"ratios against a bf16 all-reduce among the 2 workers every step: {ref['bytes_sent']:,} bytes in all")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
