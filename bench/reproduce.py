"""The results page: DiPaCo against dense in the papers' regime, on two corpora; one command, resumable.

    python bench/reproduce.py [--corpus shared default] [--out reproduce-out] [--scale full|tiny]
                              [--jobs 2] [--page docs/RESULTS.md]

The papers' claims live in a regime: a dense start trained far past compute-optimal, then many outer
rounds. Per corpus (the shared five-domain corpus; the default corpus `dipaco quickstart` builds, at a
larger budget), every step below is skipped when its output is complete:

  1. shards     one tokenizer and one seed for every sharding (so the same held-out, router and
                validation documents): k-means 2x2, flat k-means 4, k-means 4x4, and i.i.d. (a seeded
                hash, 4 shards); every router reads the first 32 tokens
  2. start      a pilot of the pretraining peak lr (short runs, chosen on validation loss), then one
                dense model trained to ``pretrain_tokens_per_param``; its validation curve must flatten
  3. outer      a grid of outer (lr, momentum) for DiPaCo 2x2, ``pilot_rounds`` rounds each from the start,
                chosen by routed perplexity on the validation documents
  4. runs       every row from the same start, ``rounds`` outer rounds of H steps, the inner lr
                continuing at the start's final lr (no re-warm): dense at 1x and P x the steps,
                DiLoCo on i.i.d. and on k-means shards, flat 4, DiPaCo 2x2 (chosen outer step, and the
                papers' 0.7/0.9), DiPaCo 2x2 after one discriminative re-sharding, DiPaCo 4x4, and DiPaCo
                2x2 with Streaming DiLoCo (F=2, τ=1, α=0.5) in fp32 and in 4 bits on 4 gloo workers
  5. eval       routed held-out perplexity of every run over rounds (the first 32 tokens route and are
                never scored; every row on the same tokens); the best DiPaCo run (chosen on the
                validation documents) also gets every-64 with a fitted window router, oracle, random,
                per-path early stopping and a mixture of 2
  6. report     results.json (with the expectations checked), RESULTS.md sections and plots

Jobs run ``--jobs`` cores at a time, one thread each (a 4-worker job takes 2). Logs are in OUT/logs/.
``--scale tiny`` is a minutes-long version used by the test suite. ``--report-only`` writes the page from
whatever has finished (rows still running are marked pending), so partial results can be committed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("DIPACO_CORPUS", ROOT.parent / "shared" / "corpus"))
PAPER_OUTER = (0.7, 0.9)
PLAIN = ['grid.shape="1"', "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]  # = plain AdamW
CRITICAL, UNBLOCKS = 1e13, 1e12  # job weights: the start first, then what unblocks other jobs, then long trainings


@dataclass
class Scale:
    """Every number that sizes the experiment; all of it goes into results.json."""
    vocab: int
    model: list[str]                 # --set overrides of the path model (one path = one dense model)
    pretrain_rounds: int             # the start: pretrain_rounds x pretrain_H steps
    pretrain_H: int
    pretrain_lrs: list[float]        # pilot of the pretraining peak lr (chosen on validation loss)
    pretrain_pilot_rounds: int
    pretrain_warmup: int
    H: int                           # inner steps per round of every continued run
    rounds: int                      # outer rounds of every continued run
    pilot_rounds: int                # outer rounds of the outer-optimizer grid pilot
    outer_grid: list[list[float]]    # [lr, momentum] pairs (Nesterov); [1, 0] is the plain average
    factors: list[int]               # dense with P x the steps, for every P used
    eval_tokens: int                 # held-out and validation documents are cut to this many tokens
    eval_every: int                  # rounds between evaluated (and checkpointed) rounds
    route_every: int
    stream_workers: int              # gloo workers of the streaming runs (bytes are measured there)
    fragments: int
    router_fraction: float           # router documents (discriminative and window routers fit on them)
    default_budget: int              # characters per kind of the default corpus
    shard: list[str] = field(default_factory=list)
    balance: float = 1.1


SCALES = {
    # About 3 hours of a quiet 2-core machine for both corpora (see docs/RESULTS.md for the measured time).
    "full": Scale(vocab=1024, model=["preset=\"tiny\"", "model.hidden_size=48", "model.intermediate_size=128",
                                     "model.num_heads=4", "model.num_kv_heads=4", "model.max_seq_len=128",
                                     "inner.batch_size=8"],
                  pretrain_rounds=100, pretrain_H=100, pretrain_lrs=[1e-3, 3e-3, 1e-2], pretrain_pilot_rounds=10,
                  pretrain_warmup=200, H=50, rounds=32, pilot_rounds=16,
                  outer_grid=[[0.5, 0.8], [0.5, 0.9], [0.7, 0.8], [0.7, 0.9], [1.0, 0.8], [1.0, 0.9], [1.0, 0.0]],
                  factors=[4, 16], eval_tokens=512, eval_every=8, route_every=64, stream_workers=4, fragments=2,
                  router_fraction=0.02, default_budget=12_000_000),
    # The test suite's version: a few minutes on 2 cores.
    "tiny": Scale(vocab=512, model=["model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
                                    "model.num_kv_heads=2", "model.max_seq_len=64", "inner.batch_size=4"],
                  pretrain_rounds=2, pretrain_H=4, pretrain_lrs=[2e-3, 5e-3], pretrain_pilot_rounds=1,
                  pretrain_warmup=2, H=4, rounds=2, pilot_rounds=1, outer_grid=[[0.7, 0.9], [1.0, 0.0]],
                  factors=[4], eval_tokens=96, eval_every=2, route_every=16, stream_workers=1, fragments=2,
                  router_fraction=0.2, default_budget=150_000,
                  # 348 documents on 16 paths: the document-level clusters leave a 4x4 path empty; k-means on the
                  # prefix with the balance offsets fills all 16
                  shard=["routing.svd_dims=16", "routing.kmeans_restarts=2", 'routing.cluster_on="prefix"']),
}


# ------------------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    name: str
    argv: list[str] | Callable[[], list[str]]   # a callable is resolved when the job starts (after its deps)
    after: list[str] = field(default_factory=list)
    slots: int = 1                               # cores it keeps busy
    weight: float = 0.0                          # among ready jobs, heavier ones start first
    proc: subprocess.Popen | None = None
    began: float = 0.0


def run_jobs(jobs: list[Job], capacity: int, logs: Path, describe=lambda name: name) -> dict[str, float]:
    """Run jobs (dependencies first, heavier first among the ready ones), keeping at most ``capacity`` cores
    busy. The first failure stops everything with the job's last log lines."""
    from tqdm.auto import tqdm

    logs.mkdir(parents=True, exist_ok=True)
    pending, running, done = sorted(jobs, key=lambda j: -j.weight), [], {}
    known = {j.name for j in jobs}
    bar = tqdm(total=len(jobs), desc="jobs", unit="job", dynamic_ncols=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    while pending or running:
        for job in list(pending):
            busy = sum(j.slots for j in running)
            ready = all(a in done or a not in known for a in job.after)
            if ready and (busy + job.slots <= capacity or not running):
                argv = job.argv() if callable(job.argv) else job.argv
                with open(logs / f"{job.name}.log", "w") as log:  # the child keeps its own descriptor
                    job.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                job.began = time.perf_counter()
                pending.remove(job)
                running.append(job)
        for job in list(running):
            rc = job.proc.poll()
            if rc is None:
                continue
            running.remove(job)
            if rc != 0:
                for j in running:
                    j.proc.terminate()
                tail = (logs / f"{job.name}.log").read_text(errors="replace").strip().splitlines()[-15:]
                raise SystemExit(f"reproduce: job {job.name} failed (exit {rc}); last lines of "
                                 f"{logs / (job.name + '.log')}:\n" + "\n".join(tail))
            done[job.name] = time.perf_counter() - job.began
            bar.update(1)
        bar.set_postfix_str(", ".join(describe(j.name) for j in running)[:120])
        time.sleep(1.0)
    bar.close()
    return done


# ---------------------------------------------------------------------------------------- helpers
def input_files(data: Path) -> list[Path]:
    if data.is_file():
        return [data]
    files = sorted(p for p in data.glob("*.jsonl*") if p.is_file())
    if not files:
        raise SystemExit(f"reproduce: no .jsonl/.jsonl.gz files in {data}; pass --data DIR_OR_FILE "
                         f"(e.g. the shared corpus) or set DIPACO_CORPUS")
    return files


def rounds_done(run: Path) -> int:
    from dipaco import checkpoint

    return (checkpoint.latest_round(run) or 0) if run.is_dir() else 0  # (a link to a run counts as that run)


def round_rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []
    return [r for r in rows if r.get("kind") == "round"]


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dipaco.cli", *args]


# ------------------------------------------------------------------------------------- the corpus
@dataclass
class RunSpec:
    name: str                 # directory name
    label: str                # name in the tables
    shards: str               # key of the shard directory
    sets: list[str]
    rounds: int
    H: int
    trainees: int
    workers: int = 1
    after: list[str] = field(default_factory=list)
    outer: str = ""           # "chosen" | "paper" | "" (dense: plain AdamW)
    init: bool = True         # start from the pretrained model
    bytes_only: bool = False  # a short run that measures bytes per round (no evaluation)


class Corpus:
    """Everything for one corpus: its directories, its jobs, and the results read back from disk."""

    def __init__(self, name: str, out: Path, s: Scale, data: Path):
        self.name, self.out, self.s, self.data = name, out / name, s, data
        self.runs, self.evals, self.reports = self.out / "runs", self.out / "eval", self.out / "reports"
        self.shard_dirs = {k: self.out / f"shards-{k}" for k in ("2x2", "4", "4x4", "iid", "2x2-disc")}

    # ------------------------------------------------------------------ inputs and shards (in process)
    def inputs(self) -> list[str]:
        if self.name == "shared":
            if not self.data.exists():
                raise SystemExit(f"reproduce: corpus {self.data} not found; pass --data DIR_OR_FILE or set DIPACO_CORPUS")
            return [str(f) for f in input_files(self.data)]
        if self.data != DEFAULT_DATA and self.data.is_file():  # tests pass a small corpus file
            return [str(self.data)]
        from dipaco.sharding.sources import write_default_corpus

        path = self.out / "corpus.jsonl"
        if not path.is_file():
            self.out.mkdir(parents=True, exist_ok=True)
            write_default_corpus(path, self.s.default_budget)
        return [str(path)]

    def make_shards(self) -> None:
        from dipaco.config import ShardConfig, resolve
        from dipaco.sharding.writer import shard

        inputs = self.inputs()
        common = [f"tokenizer.vocab_size={self.s.vocab}", f"routing.balance={self.s.balance}",
                  f"data.router_fraction={self.s.router_fraction}", *self.s.shard]
        plan = {"2x2": ['grid="2x2"'], "4": ['grid="4"'], "4x4": ['grid="4x4"'], "iid": ['grid="4"', 'routing.assign="random"']}
        for key, sets in plan.items():
            d = self.shard_dirs[key]
            if (d / "manifest.json").is_file():
                continue
            print(f"[{self.name}] shard {key} -> {d}")
            tokenizer = None if key == "2x2" else str(self.shard_dirs["2x2"] / "tokenizer")  # one tokenizer everywhere
            shard(inputs, resolve(ShardConfig, overrides=sets + common), d, tokenizer, progress=True)
        held = {k: (self.shard_dirs[k] / "heldout" / "docs.jsonl").read_text().count("\n") for k in plan}
        texts = {k: [json.loads(l)["text"] for l in (self.shard_dirs[k] / "heldout" / "docs.jsonl").open()] for k in plan}
        if any(texts[k] != texts["2x2"] for k in plan):
            raise SystemExit(f"reproduce: the shard directories of {self.name} hold different held-out documents ({held}); "
                             f"delete them and re-run")

    # ------------------------------------------------------------------------------ training jobs
    def train_argv(self, spec: RunSpec, outer: tuple[float, float] | None, lr: float) -> list[str]:
        s, run = self.s, self.runs / spec.name
        argv = cli("train", "--shards", str(self.shard_dirs[spec.shards]), "--out", str(run), "--quiet",
                   "--rounds", str(spec.rounds), "--inner-steps", str(spec.H))
        if spec.workers > 1:
            argv += ["--workers", str(spec.workers)]
        if spec.init:
            argv += ["--init-from", str(self.runs / "start")]
        sets = s.model + spec.sets + ["log_every=50", "val_batches=4", f"eval.max_tokens_per_doc={s.eval_tokens}",
                                      f"checkpoint_every={min(s.eval_every, spec.rounds)}"]
        if outer is not None:
            sets += [f"outer.lr={outer[0]}", f"outer.momentum={outer[1]}", f"outer.nesterov={'true' if outer[1] else 'false'}"]
        if spec.init:  # no re-warm: continue at the start's final lr, cosine down to a tenth of it
            sets += [f"inner.lr={lr}", "inner.warmup_steps=0", "inner.min_lr_ratio=0.1"]
        for kv in sets:
            argv += ["--set", kv]
        if (run / "checkpoints").is_dir():
            argv.append("--resume")
        return argv

    def train_or_reuse(self, spec: RunSpec, outer: tuple[float, float] | None) -> list[str]:
        """The training command, or, for the papers' row when the grid chose the papers' outer step, a link to
        the chosen DiPaCo 2x2 run (the same run: training it twice would only cost time)."""
        if spec.outer == "paper" and tuple(self.chosen_outer()) == PAPER_OUTER:
            return [sys.executable, "-c", "import os, sys; os.path.lexists(sys.argv[2]) or os.symlink(sys.argv[1], sys.argv[2])",
                    "dipaco-2x2", str(self.runs / spec.name)]
        return self.train_argv(spec, outer, self.continued_lr())

    def start_lr(self) -> float:
        """The chosen pretraining peak lr (pilot on validation loss)."""
        pilot = self.pretrain_pilot()
        return min(pilot, key=lambda lr: pilot[lr] if pilot[lr] is not None else math.inf)

    def pretrain_pilot(self) -> dict[float, float | None]:
        out = {}
        for lr in self.s.pretrain_lrs:
            rows = round_rows(self.runs / f"start-lr{lr:g}")
            out[lr] = rows[-1]["val_loss_mean"] if len(rows) >= self.s.pretrain_pilot_rounds else None
        return out

    def continued_lr(self) -> float:
        return self.start_lr() * 0.1  # the start's final lr (cosine to min_lr_ratio 0.1)

    def chosen_outer(self) -> tuple[float, float]:
        """The grid point with the lowest routed validation perplexity after the pilot."""
        grid = self.outer_grid()
        scored = [g for g in grid if g["val_perplexity"] is not None]
        if not scored:
            return PAPER_OUTER
        best = min(scored, key=lambda g: g["val_perplexity"])
        return best["lr"], best["momentum"]

    def outer_grid(self) -> list[dict]:
        rows = []
        for lr, mom in self.s.outer_grid:
            name = f"pilot-outer-lr{lr:g}-m{mom:g}"
            rep = read(self.reports / f"val-{name}.json")
            rows.append({"lr": lr, "momentum": mom, "run": name,
                         "val_perplexity": rep["methods"][name]["perplexity"] if rep else None,
                         "val_loss_metrics": (round_rows(self.runs / name) or [{}])[-1].get("val_loss_mean")})
        return rows

    def specs(self) -> list[RunSpec]:
        s, R, H = self.s, self.s.rounds, self.s.H
        stream = [f"streaming.fragments={s.fragments}", "streaming.overlap=1", "streaming.alpha=0.5"]
        diloco = ['grid.shape="1"', "grid.replicas_per_shard=true"]
        out = [RunSpec("dense", "dense (same steps as one trainee)", "2x2", PLAIN, R, H, 1)]
        out += [RunSpec(f"dense-{k}x", f"dense, {k}x steps", "2x2", PLAIN, R * k, H, 1) for k in s.factors]
        out += [
            RunSpec("diloco-iid", "DiLoCo, 4 replicas on i.i.d. shards", "iid", diloco, R, H, 4, outer="chosen"),
            RunSpec("diloco-kmeans", "DiLoCo, 4 replicas on the k-means shards", "2x2", diloco, R, H, 4, outer="chosen"),
            RunSpec("flat-4", "flat mixture, 4 paths", "4", [], R, H, 4, outer="chosen"),
            RunSpec("dipaco-2x2", "DiPaCo 2x2", "2x2", [], R, H, 4, outer="chosen"),
            RunSpec("dipaco-2x2-paper", "DiPaCo 2x2, papers' outer step (0.7, Nesterov 0.9)", "2x2", [], R, H, 4,
                    outer="paper"),
            RunSpec("dipaco-2x2-disc", "DiPaCo 2x2 after discriminative re-sharding", "2x2-disc", [], R, H, 4,
                    after=["reshard"], outer="chosen"),
            RunSpec("dipaco-4x4", "DiPaCo 4x4", "4x4", [], R, H, 16, outer="chosen"),
            RunSpec("stream-fp32", f"DiPaCo 2x2, Streaming DiLoCo F={s.fragments} τ=1 α=0.5, fp32", "2x2", stream, R, H, 4,
                    workers=s.stream_workers, outer="chosen"),
            RunSpec("stream-4bit", f"DiPaCo 2x2, Streaming DiLoCo F={s.fragments} τ=1 α=0.5, 4-bit", "2x2",
                    stream + ["comm.bits=4"], R, H, 4, workers=s.stream_workers, outer="chosen"),
            # bytes per round at the papers' H = 100 (the 400x of Streaming DiLoCo is 100 steps x 16/4 bits)
            RunSpec("bytes-4bit-h100", "bytes only: the 4-bit streaming run at H = 100, 2 rounds", "2x2",
                    stream + ["comm.bits=4"], 2, 2 * H, 4, workers=s.stream_workers, outer="chosen", bytes_only=True),
        ]
        return out

    def jobs(self) -> list[Job]:
        s, n = self.s, self.name
        jobs: list[Job] = []
        names = lambda *xs: [f"{n}:{x}" for x in xs]  # noqa: E731
        plain_pretrain = PLAIN + [f"inner.warmup_steps={s.pretrain_warmup}", "inner.min_lr_ratio=0.1"]

        def pretrain_argv(run: Path, lr: float, rounds: int) -> list[str]:
            argv = cli("train", "--shards", str(self.shard_dirs["2x2"]), "--out", str(run), "--quiet", "--rounds",
                       str(rounds), "--inner-steps", str(s.pretrain_H))
            for kv in s.model + plain_pretrain + [f"inner.lr={lr}", "log_every=100", "val_batches=8",
                                                  f"eval.max_tokens_per_doc={s.eval_tokens}",
                                                  f"checkpoint_every={max(1, rounds // 4)}"]:
                argv += ["--set", kv]
            return argv + (["--resume"] if (run / "checkpoints").is_dir() else [])

        pilots = []
        for lr in s.pretrain_lrs:  # the pilot is a shortened pretraining with the same schedule shape
            run = self.runs / f"start-lr{lr:g}"
            if rounds_done(run) < s.pretrain_pilot_rounds:
                jobs.append(Job(f"{n}:start-lr{lr:g}", pretrain_argv(run, lr, s.pretrain_pilot_rounds), weight=CRITICAL))
            pilots.append(f"{n}:start-lr{lr:g}")
        start = self.runs / "start"
        if rounds_done(start) < s.pretrain_rounds:
            jobs.append(Job(f"{n}:start", lambda: pretrain_argv(start, self.start_lr(), s.pretrain_rounds), after=pilots,
                            weight=CRITICAL))

        def outer_of(spec: RunSpec):
            return {"chosen": self.chosen_outer, "paper": lambda: PAPER_OUTER}.get(spec.outer, lambda: None)()

        grid_evals = []
        for lr, mom in s.outer_grid:
            spec = RunSpec(f"pilot-outer-lr{lr:g}-m{mom:g}", "", "2x2", [], s.pilot_rounds, s.H, 4)
            if rounds_done(self.runs / spec.name) < spec.rounds:
                jobs.append(Job(f"{n}:{spec.name}", lambda spec=spec, o=(lr, mom): self.train_argv(spec, o, self.continued_lr()),
                                after=names("start"), weight=UNBLOCKS))
            jobs += self.eval_jobs(spec.name, spec.name, "2x2", [{"round": spec.rounds, "split": "val", "out": f"val-{spec.name}"}],
                                   after=names(spec.name))
            grid_evals.append(f"{n}:eval-val-{spec.name}")
        for spec in self.specs():
            deps = names("start", *spec.after) + (grid_evals if spec.outer in ("chosen", "paper") else [])
            if rounds_done(self.runs / spec.name) < spec.rounds:
                jobs.append(Job(f"{n}:{spec.name}", lambda spec=spec: self.train_or_reuse(spec, outer_of(spec)),
                                after=deps, slots=2 if spec.workers > 2 else spec.workers,
                                weight=spec.trainees * spec.rounds * spec.H))
            if spec.bytes_only:
                continue
            every = s.eval_every * (spec.rounds // s.rounds)
            items = [{"round": r, "out": f"{spec.name}_r{r}"} for r in range(every, spec.rounds + 1, every)]
            if spec.name.startswith(("dipaco", "stream")):
                items.append({"round": spec.rounds, "split": "val", "out": f"val-{spec.name}"})
            reused = ["dipaco-2x2"] if spec.outer == "paper" else []  # when the grid chose the papers' step
            jobs += self.eval_jobs(spec.name, spec.label, spec.shards, items, after=names(spec.name, *reused))
        if not (self.shard_dirs["2x2-disc"] / "manifest.json").is_file():
            jobs.append(Job(f"{n}:reshard", cli("reshard", "--run", str(self.runs / "dipaco-2x2"), "--shards",
                                                  str(self.shard_dirs["2x2"]), "--out", str(self.shard_dirs["2x2-disc"]),
                                                  "--quiet", "--max-tokens", str(s.eval_tokens)), after=names("dipaco-2x2"),
                            weight=UNBLOCKS))
        jobs.append(Job(f"{n}:best", lambda: [sys.executable, str(Path(__file__).resolve()), "_best",
                                              json.dumps({"corpus": n, "dir": str(self.out), "scale": asdict(s)})],
                        after=[f"{n}:eval-{x.name}" for x in self.specs() if x.name.startswith(("dipaco", "stream"))]))
        jobs.append(Job(f"{n}:eval-start", [sys.executable, str(Path(__file__).resolve()), "_eval", json.dumps(
            {"label": "pretrained start", "run": str(start), "shards": str(self.shard_dirs["2x2"]),
             "items": [{"round": s.pretrain_rounds, "out": str(self.evals / "start.json")}]})], after=names("start"),
                        weight=UNBLOCKS))
        return [j for j in jobs if not self._done(j)]

    def eval_jobs(self, name: str, label: str, shards: str, items: list[dict], after: list[str]) -> list[Job]:
        folder = {"val": self.reports}
        todo = [{**i, "out": str(folder.get(i.get("split"), self.evals) / f"{i['out']}.json")} for i in items]
        todo = [i for i in todo if not Path(i["out"]).is_file()]
        if not todo:
            return []
        spec = {"label": label, "run": str(self.runs / name), "shards": str(self.shard_dirs[shards]), "items": todo}
        return [Job(f"{self.name}:eval-{name}", [sys.executable, str(Path(__file__).resolve()), "_eval", json.dumps(spec)],
                    after=after, weight=UNBLOCKS)]

    def _done(self, job: Job) -> bool:
        if job.name.endswith(":best"):
            return (self.reports / "best.json").is_file()
        if job.name.endswith(":eval-start"):
            return (self.evals / "start.json").is_file()
        return False


# ------------------------------------------------------------------- child processes (eval, best)
def eval_child(spec: dict) -> None:
    """Evaluations of one run (one process: imports cost more than a tiny eval), each written atomically."""
    from dipaco.eval.perplexity import evaluate
    from dipaco.io import write_json

    for item in spec["items"]:
        if Path(item["out"]).is_file():
            continue
        Path(item["out"]).parent.mkdir(parents=True, exist_ok=True)
        extra = {k: v for k, v in item.items() if k not in ("round", "out")}
        write_json(item["out"], evaluate({spec["label"]: spec["run"]}, spec["shards"], item["round"], progress=False, **extra))


def best_child(spec: dict) -> None:
    """Choose the best DiPaCo run on the validation documents, fit its window router, score every routing."""
    from dipaco.eval.perplexity import evaluate
    from dipaco.eval.window_router import fit_window_router
    from dipaco.io import write_json

    s, out = Scale(**spec["scale"]), Path(spec["dir"])
    corpus = Corpus(spec["corpus"], out.parent, s, DEFAULT_DATA)
    val = {}
    for sp in corpus.specs():
        rep = read(corpus.reports / f"val-{sp.name}.json")
        if rep is not None:
            val[sp.name] = rep["methods"][sp.label]["perplexity"]
    best = min(val, key=val.get)
    sp = next(x for x in corpus.specs() if x.name == best)
    run, shards = corpus.runs / best, corpus.shard_dirs[sp.shards]
    W = s.route_every
    folder = run / "window_routers" / f"w{W}"
    if not (folder / "policy.json").is_file():  # the window router, and the every-W rule chosen on the router documents
        fit_window_router(run, shards, W, max_tokens=max(4 * W, s.eval_tokens), progress=False, overwrite=folder.exists())
    window = json.loads((folder / "router.json").read_text()) if (folder / "router.json").is_file() else {}
    window["policy"] = json.loads((folder / "policy.json").read_text())
    test = evaluate({sp.label: run}, shards, progress=False, route_every=[W], oracle=True, random=True, early_stopping=True,
                    mixture=2)
    val_every = evaluate({sp.label: run}, shards, progress=False, route_every=[W], split="val")
    write_json(corpus.reports / "best.json", {"run": best, "label": sp.label, "val_perplexity": val, "test": test,
                                               "val_every": val_every, "window_router": window})


# ---------------------------------------------------------------------------------------- results
def dp_bytes(per_path: int, replicas: int, steps: int) -> int:
    """Bytes all workers send when ``replicas`` data-parallel copies all-reduce bf16 gradients every step: a
    reduce-scatter + all-gather, 2(n−1)/n of the gradient per replica (not dipaco's transport, which below
    32 bits all-gathers every trainee's own payload)."""
    from dipaco.comm import allreduce_bytes

    return replicas * allreduce_bytes(per_path, replicas, 16) * steps


def collect(c: Corpus) -> dict:
    s = c.s
    start_eval = read(c.evals / "start.json")
    start_rows = round_rows(c.runs / "start")
    info = read(c.runs / "start" / "run.json")
    per_path = info["parameters"]["per_path"] if info else None
    tokens_per_step = int(next(x.split("=")[1] for x in s.model if x.startswith("inner.batch_size"))) * \
        int(next(x.split("=")[1] for x in s.model if x.startswith("model.max_seq_len")))
    curve = [{"round": r["round"], "steps": r["round"] * s.pretrain_H,
              "tokens_per_param": r["round"] * s.pretrain_H * tokens_per_step / per_path,
              "val_loss": r["val_loss_mean"], "val_perplexity": math.exp(r["val_loss_mean"])}
             for r in start_rows if per_path and r.get("val_loss_mean")]
    res = {"pretrain": {"lr_pilot": {f"{k:g}": v for k, v in c.pretrain_pilot().items()},
                        "lr": c.start_lr() if all(v is not None for v in c.pretrain_pilot().values()) else None,
                        "steps": s.pretrain_rounds * s.pretrain_H, "tokens": s.pretrain_rounds * s.pretrain_H * tokens_per_step,
                        "parameters": per_path, "curve": curve,
                        "heldout_perplexity": start_eval["methods"]["pretrained start"]["perplexity"] if start_eval else None},
           "pretrain_tokens_per_param": curve[-1]["tokens_per_param"] if curve else None,
           "outer_rounds": s.rounds, "outer_grid": c.outer_grid(), "runs": {}, "curves": {}}
    res["outer_chosen"] = list(c.chosen_outer()) if any(g["val_perplexity"] for g in res["outer_grid"]) else None
    if start_eval:
        res["heldout_documents"] = start_eval["documents"]
        res["scored_tokens"] = start_eval["methods"]["pretrained start"]["tokens"]
    for sp in c.specs():
        run = c.runs / sp.name
        final = read(c.evals / f"{sp.name}_r{sp.rounds}.json")
        rows = round_rows(run)
        row = {"label": sp.label, "shards": sp.shards, "settings": sp.sets, "rounds": sp.rounds, "H": sp.H,
               "steps_per_trainee": sp.rounds * sp.H, "trainees": sp.trainees, "rounds_done": len(rows),
               "perplexity": final["methods"][sp.label]["perplexity"] if final else None}
        ri = read(run / "run.json")
        if ri:
            row |= {"workers": ri["workers"], "parameters_total": ri["parameters"]["total"],
                    "parameters_per_path": ri["parameters"]["per_path"]}
        if ri and rows:
            sent = sum(r["bytes_sent"] for r in rows)
            dp = dp_bytes(ri["parameters"]["per_path"], sp.trainees, sp.rounds * sp.H) if ri["workers"] > 1 else 0
            row |= {"train_seconds": sum(r["seconds"] for r in rows), "bytes_sent": sent, "dp_bf16_bytes": dp,
                    "bytes_ratio_vs_dp": dp / sent if sent and dp else None}
        row["outer"] = {"chosen": res["outer_chosen"], "paper": list(PAPER_OUTER)}.get(sp.outer)  # None: plain AdamW
        row["same_run_as"] = "dipaco-2x2" if run.is_symlink() else None  # the grid chose the papers' outer step
        row["bytes_only"] = sp.bytes_only
        if final:
            m = final["methods"][sp.label]
            row |= {"per_label": {k: v["perplexity"] for k, v in m.get("per_label", {}).items()}, "scored_tokens": m["tokens"]}
        val = read(c.reports / f"val-{sp.name}.json")
        if val:
            row["val_perplexity"] = val["methods"][sp.label]["perplexity"]
        res["runs"][sp.name] = row
        if sp.bytes_only:
            continue
        every = s.eval_every * (sp.rounds // s.rounds)
        xs, ys = ([0], [res["pretrain"]["heldout_perplexity"]]) if start_eval else ([], [])
        for r in range(every, sp.rounds + 1, every):
            e = read(c.evals / f"{sp.name}_r{r}.json")
            if e:
                xs.append(r * sp.H)
                ys.append(e["methods"][sp.label]["perplexity"])
        res["curves"][sp.label] = {"steps": xs, "compute": [x * sp.trainees for x in xs], "perplexity": ys}
    best = read(c.reports / "best.json")
    if best:
        W = s.route_every
        m = best["test"]["methods"]
        lab = best["label"]
        res["best_dipaco"] = {
            "run": best["run"], "label": lab, "chosen_on_validation": best["val_perplexity"],
            "rows": {k[len(lab):].strip() or "once": {"perplexity": v["perplexity"], "routing": v.get("routing"),
                                                       "rounds": v.get("rounds")} for k, v in m.items()},
            "val_once": best["val_every"]["methods"][lab]["perplexity"],
            f"val_every{W}": best["val_every"]["methods"][f"{lab} every-{W}"]["perplexity"],
            "window_router": {k: best["window_router"].get(k) for k in
                              ("examples", "test_examples", "accuracy", "accuracy_document_path",
                               "accuracy_shard_router_previous_tokens", "loss_window_router", "loss_document_path",
                               "loss_oracle")},
            "policy": best["window_router"].get("policy"), "route_every": W}
    return res


EXPECTATIONS = [
    ("diloco_below_dense", "DiLoCo (4 replicas, k-means shards) below dense at the same steps per trainee"),
    ("dipaco_below_dense_5pct", "DiPaCo 2x2 at least 5% below dense at the same steps per path"),
    ("dipaco_near_dense_px", "DiPaCo 2x2 within 3% of dense with 4x the steps"),
    ("dipaco_4x4_below_2x2", "DiPaCo 4x4 below DiPaCo 2x2"),
    ("every64_below_once", "routing every 64 tokens (the rule chosen on validation) at or below routing once per document, "
                           "best DiPaCo run"),
    ("discriminative_not_worse", "DiPaCo 2x2 after discriminative re-sharding not worse than on k-means shards"),
    ("fourbit_within_1pct", "Streaming DiPaCo 2x2 in 4 bits within 1% (perplexity) of the same run in fp32"),
    ("bytes_400x", "Streaming 4-bit DiPaCo at the papers' H = 100 sends at least 400x fewer bytes than bf16 data-parallel "
                   "of one path on as many workers"),
]


def expectations(res: dict, s: Scale) -> list[dict]:
    runs = res["runs"]
    ppl = {k: v.get("perplexity") for k, v in runs.items()}

    def cmp(a, b, factor, fmt="{:.2f} vs {:.2f}"):
        if ppl.get(a) is None or ppl.get(b) is None:
            return None, "pending"
        return ppl[a] <= factor * ppl[b], fmt.format(ppl[a], ppl[b]) + f" ({100 * (ppl[a] / ppl[b] - 1):+.1f}%)"

    out = {"diloco_below_dense": cmp("diloco-kmeans", "dense", 1.0),
           "dipaco_below_dense_5pct": cmp("dipaco-2x2", "dense", 0.95),
           "dipaco_near_dense_px": cmp("dipaco-2x2", "dense-4x", 1.03),
           "dipaco_4x4_below_2x2": cmp("dipaco-4x4", "dipaco-2x2", 1.0),
           "discriminative_not_worse": cmp("dipaco-2x2-disc", "dipaco-2x2", 1.0),
           "fourbit_within_1pct": cmp("stream-4bit", "stream-fp32", 1.01)}
    if out["diloco_below_dense"][0] is not None and ppl.get("diloco-iid"):
        held, text = out["diloco_below_dense"]
        out["diloco_below_dense"] = (held, text + f"; i.i.d. shards: {ppl['diloco-iid']:.2f}")
    best = res.get("best_dipaco")
    W = s.route_every
    if best:
        once, every = best["rows"]["once"]["perplexity"], best["rows"][f"every-{W}"]["perplexity"]
        out["every64_below_once"] = (every <= once, f"{every:.2f} vs {once:.2f} ({best['label']}; "
                                                   f"validation {best[f'val_every{W}']:.2f} vs {best['val_once']:.2f})")
    else:
        out["every64_below_once"] = (None, "pending")
    ratio, main = runs.get("bytes-4bit-h100", {}).get("bytes_ratio_vs_dp"), runs.get("stream-4bit", {}).get("bytes_ratio_vs_dp")
    out["bytes_400x"] = (ratio >= 400, f"{ratio:.0f}x at H = {2 * s.H}" + (f"; {main:.0f}x in the main run at H = {s.H} "
                                                                         f"(4 bits at H = {s.H} cannot pass {s.H * 16 / 4.125:.0f}x on equal "
                                                                         f"collectives)" if main else "")) if ratio else (None, "pending")
    return [{"id": i, "claim": claim, "held": out[i][0], "measured": out[i][1]} for i, claim in EXPECTATIONS]


# ------------------------------------------------------------------------------------------ report
def fmt(x, p=2) -> str:
    return "pending" if x is None else f"{x:,.{p}f}"


def markdown(name: str, res: dict, s: Scale, plots: dict[str, str]) -> str:
    p = res["pretrain"]
    lines = [f"### Corpus: {name}", ""]
    lines.append(f"Start: {fmt(p['parameters'], 0)} parameters per path, {fmt(p['steps'], 0)} steps, "
                 f"{fmt(res['pretrain_tokens_per_param'], 1)} tokens per parameter, peak lr {p['lr']} "
                 f"(pilot, validation loss after {s.pretrain_pilot_rounds * s.pretrain_H} steps: "
                 + ", ".join(f"{k}: {fmt(v, 3)}" for k, v in p["lr_pilot"].items())
                 + f"); held-out perplexity {fmt(p['heldout_perplexity'])}. Continued runs: {s.rounds} rounds of H = {s.H}.")
    lines += ["", f"![pretraining validation curve]({plots['pretrain']})", "",
              f"Outer optimizer grid (DiPaCo 2x2, {s.pilot_rounds} rounds from the start; routed perplexity on the "
              f"validation documents; chosen: **{res.get('outer_chosen')}**; the papers': {list(PAPER_OUTER)}):", "",
              "| outer lr | momentum | validation ppl |", "| ---: | ---: | ---: |"]
    lines += [f"| {g['lr']} | {g['momentum']} | {fmt(g['val_perplexity'])} |" for g in res["outer_grid"]]
    lines += ["", "| run | held-out ppl | validation ppl | params total | params/path | steps/trainee | trainees (workers) "
                  "| bytes sent | x fewer than DP bf16 | train s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              f"| pretrained start (all runs) | {fmt(p['heldout_perplexity'])} | | | | | | | | |"]
    for name, r in res["runs"].items():
        label = r["label"] + (" (the same run: the grid chose it)" if r.get("same_run_as") else "")
        ppl = "n/a" if r.get("bytes_only") else fmt(r["perplexity"])
        # only the DiPaCo rows are scored on the validation documents (they are the candidates for the routing
        # study), and only multi-worker runs send bytes: "-" marks what is not measured, "pending" what is running
        scored_on_val = name.startswith(("dipaco", "stream")) and not r.get("bytes_only")
        val = fmt(r.get("val_perplexity")) if scored_on_val else "-"
        ratio = fmt(r.get("bytes_ratio_vs_dp"), 0) if r.get("workers") != 1 else "-"
        lines.append(f"| {label} | {ppl} | {val} | "
                     f"{fmt(r.get('parameters_total'), 0)} | {fmt(r.get('parameters_per_path'), 0)} | {r['steps_per_trainee']} | "
                     f"{r['trainees']} ({r.get('workers', '-')}) | {fmt(r.get('bytes_sent'), 0)} | "
                     f"{ratio} | {fmt(r.get('train_seconds'), 0)} |")
    best = res.get("best_dipaco")
    if best:
        lines += ["", f"Routing, for the best DiPaCo run on the validation documents (**{best['label']}**):", "",
                  "| routing | held-out ppl | how |", "| --- | ---: | --- |"]
        lines += [f"| {k} | {fmt(v['perplexity'])} | {re.sub(r'[^ ]*/runs/', 'runs/', v.get('routing') or '')} |"
                  for k, v in best["rows"].items()]
        w = best["window_router"]
        if w.get("examples"):
            lines += ["", f"Window router: {w['examples']} windows of the router documents; on {w['test_examples']} "
                          f"held-aside windows it picks the lowest-loss path {fmt(w['accuracy'], 3)} of the time (the "
                          f"document's path: {fmt(w['accuracy_document_path'], 3)})."]
        if best.get("policy"):
            lines += ["", f"Every-{s.route_every} rule chosen on the router documents: **{best['policy']['name']}** "
                          f"({best['policy']['reason']})."]
    labels = sorted({l for r in res["runs"].values() for l in r.get("per_label", {})})
    if labels:
        lines += ["", "Held-out perplexity per domain:", "", "| run | " + " | ".join(labels) + " |",
                  "| --- |" + " ---: |" * len(labels)]
        lines += [f"| {r['label']} | " + " | ".join(fmt(r.get("per_label", {}).get(l)) for l in labels) + " |"
                  for r in res["runs"].values() if not r.get("bytes_only")]
    lines += ["", "Expectations:", "", "| id | claim | held? | measured |", "| --- | --- | --- | --- |"]
    lines += [f"| `{e['id']}` | {e['claim']} | {'yes' if e['held'] else 'pending' if e['held'] is None else '**no**'} | "
              f"{e['measured']} |" for e in res["expectations"]]
    lines += ["", f"![held-out perplexity over training]({plots['rounds']})", ""]
    return "\n".join(lines)


def plot_corpus(name: str, res: dict, folder: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {"pretrain": f"pretrain_{name}.png", "rounds": f"rounds_{name}.png"}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    c = res["pretrain"]["curve"]
    ax.plot([x["tokens_per_param"] for x in c], [x["val_perplexity"] for x in c], marker="o", ms=2)
    ax.set_xlabel("tokens per parameter")
    ax.set_ylabel("validation perplexity (dense start)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(f"{name}: the start saturates")
    fig.tight_layout()
    fig.savefig(folder / files["pretrain"], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for label, cv in res["curves"].items():
        if len(cv["steps"]) < 2:
            continue
        axes[0].plot(cv["steps"], cv["perplexity"], label=label, marker="o", ms=3)
        axes[1].plot(cv["compute"], cv["perplexity"], label=label, marker="o", ms=3)
    axes[0].set_xlabel("inner steps per trainee (wall-clock when trainees run in parallel)")
    axes[1].set_xlabel("inner steps of all trainees together (compute)")
    axes[1].set_xscale("log")
    axes[0].set_ylabel("routed held-out perplexity")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{name}: every run continues from the same saturated dense start")
    fig.tight_layout()
    fig.savefig(folder / files["rounds"], dpi=110)
    plt.close(fig)
    return files


def write_page(page: Path, block: str) -> None:
    """Replace the generated block of a hand-written page (or create the page)."""
    begin, end = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"
    text = page.read_text() if page.is_file() else f"# Results\n\n{begin}\n{end}\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


def report(corpora: list[Corpus], s: Scale, out: Path, page: Path | None, scale_name: str, wall: float) -> dict:
    results = {"scale_name": scale_name, "scale": asdict(s), "wall_seconds": round(wall, 1), "corpora": {},
               "pretrain_tokens_per_param": {}, "outer_rounds": s.rounds, "outer_grid": {}, "expectations": []}
    blocks, pictures = [], (page.parent / "results") if page else out
    pictures.mkdir(parents=True, exist_ok=True)
    for c in corpora:
        res = collect(c)
        res["expectations"] = expectations(res, s)
        results["corpora"][c.name] = res
        results["pretrain_tokens_per_param"][c.name] = res["pretrain_tokens_per_param"]
        results["outer_grid"][c.name] = res["outer_grid"]
        results["expectations"] += [{**e, "corpus": c.name} for e in res["expectations"]]
        files = plot_corpus(c.name, res, out) if res["pretrain"]["curve"] else {"pretrain": "", "rounds": ""}
        if page and files["pretrain"]:
            for f in files.values():
                shutil.copy(out / f, pictures / f)
        prefix = "results/" if page else ""
        blocks.append(markdown(c.name, res, s, {k: prefix + v for k, v in files.items()}))
    train_s = sum(r.get("train_seconds") or 0 for res in results["corpora"].values() for r in res["runs"].values())
    blocks.append(f"Compute: the continued runs' training took {train_s / 3600:.1f} process-hours in all (the train s "
                  f"column, summed; the starts, pilots and evaluations come on top). Wall time recorded by the "
                  f"invocations of this --out that ran to their end: {wall / 60:.1f} min on {os.cpu_count()} cores "
                  f"(scale `{scale_name}`; an interrupted invocation records none).")
    block = "\n".join(blocks)
    (out / "RESULTS.md").write_text(block + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    if page:
        shutil.copy(out / "results.json", pictures / "results.json")
        write_page(page, block)
    return results


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_eval"]:
        eval_child(json.loads(argv[1]))
        return 0
    if argv[:1] == ["_best"]:
        best_child(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--corpus", nargs="+", default=["shared", "default"], choices=["shared", "default"])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="the shared corpus (directory of *.jsonl[.gz] or one file); with --corpus default and a file, "
                        "that file replaces the machine's default corpus (tests)")
    p.add_argument("--out", type=Path, default=Path("reproduce-out"), help="work directory (re-running resumes)")
    p.add_argument("--scale", choices=list(SCALES), default="full")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cores to keep busy")
    p.add_argument("--page", type=Path, help="also write the tables and plots into this Markdown page (docs/RESULTS.md)")
    p.add_argument("--report-only", action="store_true", help="write results.json and the page from what has finished")
    args = p.parse_args(argv)
    s = SCALES[args.scale]
    began = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpora = [Corpus(name, out, s, args.data) for name in args.corpus]
    times_file = out / "job_seconds.json"
    times = json.loads(times_file.read_text()) if times_file.is_file() else {}
    if not args.report_only:
        for c in corpora:
            c.make_shards()
        jobs = [j for c in corpora for j in c.jobs()]
        print(f"[jobs] {len(jobs)} to run ({sum(1 for j in jobs if ':eval' not in j.name)} trainings and steps), "
              f"{args.jobs} cores; logs in {out / 'logs'}")
        times |= run_jobs(jobs, args.jobs, out / "logs")
    times["_wall"] = float(times.get("_wall", 0.0)) + time.perf_counter() - began
    times_file.write_text(json.dumps(times, indent=1))
    res = report(corpora, s, out, args.page, args.scale, times["_wall"])
    print((out / "RESULTS.md").read_text())
    held = [e for e in res["expectations"] if e["held"] is not None]
    print(f"expectations held: {sum(e['held'] for e in held)} of {len(held)} checked "
          f"({len(res['expectations']) - len(held)} pending); wrote {out / 'results.json'}" + (f" and {args.page}" if args.page else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
