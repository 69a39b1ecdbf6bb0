"""Worker vs bare loop: tokens/s of one dipaco worker against a plain transformers training loop.

    python bench/worker_speed.py [--quick] [--configs tiny,h128] [--grids 1,2x2] [--reps 3] [--rounds 2] [--H 100]
                                 [--mode paired|alternate]

Both sides train the same LlamaForCausalLM (same config, batch and sequence length) in this process,
on one thread (``torch.set_num_threads(1)``; run with OMP_NUM_THREADS=1):

  bare    a plain loop: random windows of a token array -> forward -> cross-entropy -> backward ->
          clip_grad_norm_ -> AdamW.step -> zero_grad (torch's default AdamW, constant lr); 5 warm-up
          steps are not timed
  worker  the real ``dipaco.training.train.train()`` in a world of one with H inner steps per round and
          everything a round does: lr schedule, sampler, per-step loss, outer step, validation
          (``val_batches``), a checkpoint every round, metrics.jsonl; no progress bar. Grid '1' is one
          trainee on the four shards pooled (the dense baseline); '2x2' is four trainees in lockstep
          (tokens/s counts every trainee-step). tokens/s is over the wall time of the whole round loop
          (from the end of setup, i.e. after the round-0 checkpoint, to the return of train()), and
          also over the whole call including setup.

``--mode paired`` (default) takes one bare step right after every inner step of the worker, in the same
process, and takes the bare steps' time out of the worker's: both sides see the same machine load at a
granularity of one step, which is what makes the ratio usable on a shared, loaded machine.
``--mode alternate`` runs whole bare loops (as many steps as the worker) and whole worker runs in turns
(bare, worker, worker, bare, ...). Each of ``--reps`` repetitions uses a fresh bare model and run; the
table shows medians and the median of the per-rep ratios worker/bare, over wall time and over CPU time
of the process. The worker's time is broken down by timing wrappers around dipaco's own functions
(inner_step, the sampler, validate, Checkpointer.save, the outer step in ModuleSync, metrics).

Shards: a 2x2 shard directory made once with ``dipaco shard`` from the first documents of every file
of ``$DIPACO_CORPUS`` or ``../shared/corpus`` or, when that is absent, from the default corpus
(text that ships with Python). Writes ``bench/worker_speed_results.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_corpus import SHARED_CORPUS as CORPUS  # noqa: E402

# name -> (hidden, layers, heads, intermediate, seq_len, batch)
CONFIGS = {
    "tiny": (64, 4, 4, 192, 128, 8),      # the `tiny` preset
    "h128": (128, 4, 4, 384, 128, 8),
    "h256": (256, 4, 4, 768, 128, 8),
}


# ------------------------------------------------------------------------------------------ data
def make_shards(work: Path, docs_per_file: int = 200) -> tuple[Path, str]:
    shards = work / "shards"
    if (shards / "manifest.json").exists():
        return shards, json.loads((work / "source.json").read_text())["source"]
    sample = work / "sample.jsonl"
    files = sorted(CORPUS.glob("*.jsonl.gz"))
    if files:
        source = f"{CORPUS} (first {docs_per_file} documents of each file)"
        with open(sample, "w", encoding="utf-8") as out:
            for f in files:
                with gzip.open(f, "rt", encoding="utf-8") as inp:
                    for i, line in enumerate(inp):
                        if i >= docs_per_file:
                            break
                        out.write(line)
    else:
        from dipaco.sharding.sources import write_default_corpus

        source = "the default corpus (dipaco.sharding.sources, 400 kB per kind)"
        write_default_corpus(sample, budget_per_kind=400_000)
    subprocess.run([sys.executable, "-m", "dipaco.cli", "shard", "--data", str(sample), "--out", str(shards), "--grid",
                    "2x2", "--vocab-size", "4096", "--balance", "1.3", "--num-proc", "1", "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)
    (work / "source.json").write_text(json.dumps({"source": source}))
    return shards, source


# ------------------------------------------------------------------------------------ bare loop
class BareLoop:
    """A plain transformers training loop, one step at a time."""

    def __init__(self, config: tuple, vocab: int, eos: int, tokens: np.ndarray, warmup: int = 5, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, layers, heads, inter, self.seq, self.batch = config
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=self.seq,
            tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, attn_implementation="sdpa"))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.data = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.gen = torch.Generator().manual_seed(seed)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.steps, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        for _ in range(warmup):
            self._step()

    def _step(self) -> torch.Tensor:
        seq = self.seq
        starts = torch.randint(0, len(self.data) - seq - 1, (self.batch,), generator=self.gen).tolist()
        x = torch.stack([self.data[s:s + seq + 1] for s in starts])
        logits = self.model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def timed_steps(self, n: int) -> float:
        """Take n timed steps; return their wall seconds."""
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            loss = self._step()
        loss.item()
        seconds = time.perf_counter() - began
        self.steps, self.seconds, self.cpu_seconds = self.steps + n, self.seconds + seconds, self.cpu_seconds + time.process_time() - cpu
        return seconds

    def result(self) -> dict:
        tokens = self.steps * self.batch * self.seq
        return {"steps": self.steps, "seconds": self.seconds, "tokens_per_s": tokens / self.seconds,
                "cpu_seconds": self.cpu_seconds, "tokens_per_cpu_s": tokens / self.cpu_seconds, "parameters": self.parameters}


# --------------------------------------------------------------------------------------- worker
class Timers:
    """Wrap functions of dipaco's modules to add up their wall time (restored on exit)."""

    def __init__(self, paired: BareLoop | None = None):
        self.paired = paired         # take one bare step after every worker inner step (not counted for the worker)
        self.excluded = 0.0          # wall seconds of those bare steps
        self.excluded_cpu = 0.0
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.marks: dict[str, float] = {}
        self._undo = []

    def wrap(self, owner, attr: str, name: str, mark_end: bool = False) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                toc = time.perf_counter()
                self.seconds[name] = self.seconds.get(name, 0.0) + toc - tic
                self.calls[name] = self.calls.get(name, 0) + 1
                if mark_end:
                    self.marks[name] = toc
                    self.marks[name + "_cpu"] = time.process_time()

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    @contextmanager
    def installed(self):
        import dipaco.training.train as train_mod
        from dipaco.storage.checkpoint import Checkpointer
        from dipaco.storage.run import RunDirectory
        from dipaco.storage.shards import BatchSampler
        from dipaco.training.sync import ModuleSync

        self.wrap(RunDirectory, "begin", "setup_start_round", mark_end=True)
        self.wrap(train_mod, "inner_step", "inner_step")
        if self.paired is not None:
            timed_inner = train_mod.inner_step

            def inner_then_bare(*args, **kwargs):
                out = timed_inner(*args, **kwargs)
                cpu = time.process_time()
                self.excluded += self.paired.timed_steps(1)
                self.excluded_cpu += time.process_time() - cpu
                return out

            train_mod.inner_step = inner_then_bare  # restored with the timed wrapper's undo entry
        self.wrap(BatchSampler, "next", "sampler")
        self.wrap(ModuleSync, "after_step", "sync_after_step")
        self.wrap(ModuleSync, "flush", "sync_flush")
        self.wrap(train_mod, "validate", "validate")
        self.wrap(train_mod, "log_round", "metrics")
        self.wrap(Checkpointer, "save", "checkpoint")
        self.wrap(train_mod, "write_worker_report", "worker_report")
        try:
            yield self
        finally:
            for owner, attr, original in reversed(self._undo):
                setattr(owner, attr, original)
            self._undo.clear()


def worker_run(config: tuple, grid: str, shards: Path, run_dir: Path, rounds: int, H: int, val_batches: int,
               paired: BareLoop | None = None) -> dict:
    from dipaco.config import TrainConfig, resolve
    from dipaco.training.train import train

    hidden, layers, heads, inter, seq, batch = config
    cfg = resolve(TrainConfig, overrides=[
        f"model.hidden_size={hidden}", f"model.num_layers={layers}", f"model.num_heads={heads}",
        f"model.num_kv_heads={heads}", f"model.intermediate_size={inter}", f"model.max_seq_len={seq}",
        f"inner.batch_size={batch}", f'grid.shape="{grid}"', f"val_batches={val_batches}", "log_every=10",
        "checkpoint_every=1"], flags={"rounds": rounds, "inner_steps": H, "device": "cpu"})
    shutil.rmtree(run_dir, ignore_errors=True)
    timers = Timers(paired)
    with timers.installed():
        began = time.perf_counter()
        train(cfg, shards, run_dir, progress=False)
        ended, ended_cpu = time.perf_counter(), time.process_time()
    trainees = len(json.loads((run_dir / "run.json").read_text())["trainees"])
    shutil.rmtree(run_dir, ignore_errors=True)
    loop = ended - timers.marks["setup_start_round"] - timers.excluded
    loop_cpu = ended_cpu - timers.marks["setup_start_round_cpu"] - timers.excluded_cpu
    tokens = rounds * H * trainees * batch * seq
    s = timers.seconds
    # the round-0 checkpoint is written inside RunDirectory.begin (setup): take it out of the per-round numbers
    ckpt_calls = timers.calls["checkpoint"] - 1
    ckpt_round = s["checkpoint"] * ckpt_calls / timers.calls["checkpoint"] if ckpt_calls else 0.0
    per_round = {
        "inner_steps": s["inner_step"] / rounds,
        "  of which sampler": s["sampler"] / rounds,
        "outer step (sync)": (s.get("sync_after_step", 0.0) + s.get("sync_flush", 0.0)) / rounds,
        "validation": s.get("validate", 0.0) / rounds,
        "checkpoint": ckpt_round / rounds,
        "metrics": s.get("metrics", 0.0) / rounds,
    }
    accounted = s["inner_step"] + per_round["outer step (sync)"] * rounds + s.get("validate", 0.0) + ckpt_round + s.get("metrics", 0.0)
    per_round["other"] = (loop - accounted) / rounds
    return {"trainees": trainees, "rounds": rounds, "H": H, "tokens": tokens, "loop_seconds": loop,
            "total_seconds": ended - began - timers.excluded, "tokens_per_s": tokens / loop,
            "loop_cpu_seconds": loop_cpu, "tokens_per_cpu_s": tokens / loop_cpu, "tokens_per_s_with_setup": tokens / (ended - began - timers.excluded),
            "tokens_per_s_inner_steps_only": tokens / s["inner_step"],
            "round_seconds": loop / rounds, "per_round_seconds": per_round,
            "overhead_per_round_s": (loop - s["inner_step"]) / rounds}


# ------------------------------------------------------------------------------------------ main
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="tiny only, grid 1, 2 reps of 1 round")
    ap.add_argument("--configs", default="tiny,h128", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--grids", default="1", help="worker grids: '1' (one trainee, shards pooled) and/or '2x2' (4 trainees)")
    ap.add_argument("--mode", choices=["paired", "alternate"], default="paired",
                    help="paired: one bare step after every worker inner step, in the same process (robust to load); "
                         "alternate: whole bare runs and whole worker runs take turns")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--H", type=int, default=100, help="inner steps per round")
    ap.add_argument("--val-batches", type=int, default=4, help="validation batches per round (TrainConfig default 4)")
    ap.add_argument("--work", help="keep the shards here (default: a temporary directory)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("worker_speed_results.json")))
    args = ap.parse_args(argv)
    if args.quick:
        args.configs, args.grids, args.reps, args.rounds = "tiny", "1", 2, 1
    torch.set_num_threads(1)
    import dipaco.training.train  # noqa: F401  (import everything the worker runs before timing anything)
    from dipaco.storage.shards import ShardSet

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dipaco-worker-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    shards_dir, source = make_shards(work)
    shards = ShardSet(shards_dir)
    tokens = np.concatenate([np.asarray(shards.tokens(p)) for p in shards.paths])
    results = []
    for name in args.configs.split(","):
        config = CONFIGS[name]
        for grid in args.grids.split(","):
            reps = []
            for rep in range(args.reps):
                got = {}
                if args.mode == "paired":
                    bare = BareLoop(config, shards.vocab_size, shards.eos_token_id, tokens, seed=rep)
                    got["worker"] = worker_run(config, grid, shards_dir, work / "run", args.rounds, args.H, args.val_batches, bare)
                    got["bare"] = bare.result()
                else:
                    for side in ("bare", "worker") if rep % 2 == 0 else ("worker", "bare"):
                        if side == "worker":
                            got["worker"] = worker_run(config, grid, shards_dir, work / "run", args.rounds, args.H, args.val_batches)
                        else:
                            bare = BareLoop(config, shards.vocab_size, shards.eos_token_id, tokens, seed=rep)
                            bare.timed_steps(args.rounds * args.H * (4 if grid != "1" else 1))
                            got["bare"] = bare.result()
                got["ratio"] = got["worker"]["tokens_per_s"] / got["bare"]["tokens_per_s"]
                got["ratio_cpu"] = got["worker"]["tokens_per_cpu_s"] / got["bare"]["tokens_per_cpu_s"]
                got["ratio_inner_steps_only"] = got["worker"]["tokens_per_s_inner_steps_only"] / got["bare"]["tokens_per_s"]
                reps.append(got)
                print(f"  {name} grid {grid} rep {rep + 1}: bare {got['bare']['tokens_per_s']:.0f} tok/s, worker "
                      f"{got['worker']['tokens_per_s']:.0f} tok/s, ratio {got['ratio']:.3f} (CPU time: {got['ratio_cpu']:.3f}) "
                      f"({time.perf_counter() - began:.0f}s)", file=sys.stderr)
            breakdown = {k: median([r["worker"]["per_round_seconds"][k] for r in reps]) for k in reps[0]["worker"]["per_round_seconds"]}
            results.append({
                "config": name, "hidden": config[0], "layers": config[1], "heads": config[2], "intermediate": config[3],
                "seq_len": config[4], "batch": config[5], "grid": grid, "trainees": reps[0]["worker"]["trainees"],
                "parameters": reps[0]["bare"]["parameters"],
                "bare_tokens_per_s": median([r["bare"]["tokens_per_s"] for r in reps]),
                "worker_tokens_per_s": median([r["worker"]["tokens_per_s"] for r in reps]),
                "worker_tokens_per_s_with_setup": median([r["worker"]["tokens_per_s_with_setup"] for r in reps]),
                "worker_tokens_per_s_inner_steps_only": median([r["worker"]["tokens_per_s_inner_steps_only"] for r in reps]),
                "ratio": median([r["ratio"] for r in reps]),
                "bare_tokens_per_cpu_s": median([r["bare"]["tokens_per_cpu_s"] for r in reps]),
                "worker_tokens_per_cpu_s": median([r["worker"]["tokens_per_cpu_s"] for r in reps]),
                "ratio_cpu": median([r["ratio_cpu"] for r in reps]),
                "ratio_inner_steps_only": median([r["ratio_inner_steps_only"] for r in reps]),
                "round_seconds": median([r["worker"]["round_seconds"] for r in reps]),
                "overhead_per_round_s": median([r["worker"]["overhead_per_round_s"] for r in reps]),
                "per_round_seconds": breakdown, "reps": reps})
    summary = {"mode": args.mode, "H": args.H, "rounds": args.rounds, "reps": args.reps, "val_batches": args.val_batches,
               "threads": torch.get_num_threads(), "shards": source, "vocab_size": shards.vocab_size,
               "torch": torch.__version__, "load_average_at_end": os.getloadavg(), "cpu_count": os.cpu_count(),
               "seconds": time.perf_counter() - began, "results": results}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    print(f"\nwrote {args.out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def table(summary: dict) -> str:
    head = ["model", "grid", "bare tok/s", "worker tok/s", "ratio", "ratio (CPU s)", "worker tok/s (inner steps only)",
            "ratio (inner only)", "worker tok/s (with setup)", "round s", "overhead s/round"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["results"]:
        lines.append("| " + " | ".join([
            f"{r['config']} (h{r['hidden']} L{r['layers']}, {r['batch']}x{r['seq_len']})", r["grid"],
            f"{r['bare_tokens_per_s']:.0f}", f"{r['worker_tokens_per_s']:.0f}", f"{r['ratio']:.3f}", f"{r['ratio_cpu']:.3f}",
            f"{r['worker_tokens_per_s_inner_steps_only']:.0f}", f"{r['ratio_inner_steps_only']:.3f}",
            f"{r['worker_tokens_per_s_with_setup']:.0f}", f"{r['round_seconds']:.2f}", f"{r['overhead_per_round_s']:.3f}"]) + " |")
    lines.append("\nper-round seconds of the worker (medians):\n")
    keys = list(summary["results"][0]["per_round_seconds"]) if summary["results"] else []
    lines.append("| model | grid | " + " | ".join(keys) + " |")
    lines.append("|" + "---|" * (len(keys) + 2))
    for r in summary["results"]:
        lines.append(f"| {r['config']} | {r['grid']} | " + " | ".join(f"{r['per_round_seconds'][k]:.3f}" for k in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
