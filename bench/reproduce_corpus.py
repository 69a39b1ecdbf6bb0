"""The experiment of bench/reproduce.py for one corpus: its scale, its shards, its rows and their jobs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import reproduce_store as store
from reproduce_jobs import Job, rounds_done

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("DIPACO_CORPUS", ROOT.parent / "shared" / "corpus"))
PAPER_OUTER = (0.7, 0.9)
PLAIN = ['grid.shape="1"', "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]  # = plain AdamW
CRITICAL, UNBLOCKS = 1e13, 1e12  # job weights: the start first, then what unblocks other jobs, then long trainings
# The paper keeps the embedding and blocks 0, 5, 6, 11 of its 12 private; scaled to our 4 blocks: the embedding (tied
# with the output head) and the first and last block.
PRIVATE = ["grid.private_embedding=true", "grid.private_blocks=[0, 3]"]
HEADLINE = ("dipaco-2x2", "dipaco-2x2-private", "dipaco-2x2-overlap")  # the headline row is chosen among these
CURVES = ("dense", "flat-4", "dipaco-2x2", "dipaco-2x2-private")       # evaluated every round (the lead plot)
# --downstream: the rows scored on the held-out multiple-choice task through lm-evaluation-harness (these and the
# headline row: ``Corpus.downstream_rows``), and the task's shape
DOWNSTREAM = ("dense", "dense-4x", "flat-4", "dipaco-2x2")
DOWNSTREAM_TASK = {"passage": 48, "answer": 16, "choices": 4, "seed": 0}


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
    eval_every: int                  # rounds between evaluated (and checkpointed) rounds, except the CURVES rows
    route_every: int
    stream_workers: int              # gloo workers of the streaming runs (bytes are measured there)
    fragments: int
    router_fraction: float           # router documents (the routing rules are chosen on them)
    default_budget: int              # characters per kind of the default corpus
    shard: list[str] = field(default_factory=list)
    balance: float = 1.1


SCALES = {
    # About 4 hours of a quiet 2-core machine for both corpora.
    "full": Scale(vocab=1024, model=["preset=\"tiny\"", "model.hidden_size=48", "model.intermediate_size=128",
                                     "model.num_heads=4", "model.num_kv_heads=4", "model.max_seq_len=128",
                                     "inner.batch_size=8"],
                  pretrain_rounds=100, pretrain_H=100, pretrain_lrs=[1e-3, 3e-3, 1e-2], pretrain_pilot_rounds=10,
                  pretrain_warmup=200, H=50, rounds=32, pilot_rounds=16,
                  outer_grid=[[0.5, 0.8], [0.5, 0.9], [0.7, 0.8], [0.7, 0.9], [1.0, 0.8], [1.0, 0.9], [1.0, 0.0]],
                  factors=[4, 16], eval_tokens=512, eval_every=8, route_every=64, stream_workers=4, fragments=2,
                  router_fraction=0.02, default_budget=12_000_000),
    # The test suite's version: a couple of minutes on 2 cores.
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


@dataclass
class RunSpec:
    name: str                 # job and directory name
    label: str                # name in the tables
    shards: str               # key of the shard directory
    sets: list[str]
    rounds: int
    H: int
    trainees: int
    workers: int = 1
    needs: list[str] = field(default_factory=list)
    outer: str = ""           # "chosen" | "paper" | "" (dense: plain AdamW)
    routing: bool = False     # fit the every-W rules and score every routing at the end (and on validation)
    bytes_only: bool = False  # a short run that measures bytes per round (no evaluation)


def input_files(data: Path) -> list[Path]:
    if data.is_file():
        return [data]
    files = sorted(p for p in data.glob("*.jsonl*") if p.is_file())
    if not files:
        raise SystemExit(f"reproduce: no .jsonl/.jsonl.gz files in {data}; pass --data DIR_OR_FILE "
                         f"(e.g. the shared corpus) or set DIPACO_CORPUS")
    return files


def cli(*args: str) -> list[str]:
    return [*store.CLI, *args]


class Corpus:
    """One corpus: its directories (under --out, lost between sessions), its jobs, its durable results."""

    def __init__(self, name: str, out: Path, s: Scale, data: Path, results: Path):
        self.name, self.root, self.s, self.data, self.results = name, out, s, data, results
        self.valid: dict[str, str] | None = None  # {job: fingerprint} of the durable results that match
        self._identity: list | None = None
        self.out = out / name
        self.runs = self.out / "runs"
        self.shard_dirs = {k: self.out / f"shards-{k}" for k in ("2x2", "4", "4x4", "iid", "2x2-overlap", "2x2-disc")}
        self.downstream = False  # also the DOWNSTREAM rows' held-out multiple choice (bench/reproduce.py --downstream)

    def result(self, job: str) -> dict | None:
        """A job's durable result; once ``valid`` is set (after planning), only one whose fingerprint matches."""
        if self.valid is not None:
            return store.load(self.results, self.name, job, self.valid[job]) if job in self.valid else None
        return store.load(self.results, self.name, job)

    def validation_perplexities(self) -> dict[str, float]:
        """The headline candidates' routed perplexity on the validation documents, of those with a result."""
        labels = {sp.name: sp.label for sp in self.specs()}
        found = {n: store.method(self.result(n), "val", labels[n]).get("perplexity") for n in HEADLINE}
        return {n: v for n, v in found.items() if v is not None}

    def headline(self) -> str | None:
        """The headline row: the candidate lowest on validation, once every candidate has a result."""
        val = self.validation_perplexities()
        return min(val, key=val.get) if len(val) == len(HEADLINE) else None

    def downstream_rows(self) -> list[str]:
        """DOWNSTREAM and the headline row; every candidate while the headline cannot be chosen yet."""
        head = self.headline()
        return list(dict.fromkeys([*DOWNSTREAM, *([head] if head else HEADLINE)]))

    def identity(self) -> list:
        """What identifies the corpus in a fingerprint: the name and content hash of every input file (the default
        corpus is built from the machine's files, so a session on another machine may build another one)."""
        if self._identity is None:
            if self.name == "shared" and not self.data.exists():
                return ["missing", str(self.data)]  # (the run stops on it with a one-line message)
            self._identity = [[Path(f).name, _sha256(Path(f))] for f in self.inputs()]
        return self._identity

    # ------------------------------------------------------------------------------ shards (in process)
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

    def shard_plan(self) -> dict[str, list[str]]:
        # 4x4 clusters the routing prefix itself: with document clusters the prefix router never predicts one of
        # 16 paths on the shared corpus (8,798 training documents; path 3-0 empty at full scale), and the shard
        # stage refuses an empty path
        return {"2x2": ['grid="2x2"'], "4": ['grid="4"'], "4x4": ['grid="4x4"', 'routing.cluster_on="prefix"'],
                "iid": ['grid="4"', 'routing.assign="random"'], "2x2-overlap": ['grid="2x2"', "routing.overlap=2"]}

    def shard_settings(self) -> list[str]:
        return [f"tokenizer.vocab_size={self.s.vocab}", f"routing.balance={self.s.balance}",
                f"data.router_fraction={self.s.router_fraction}", *self.s.shard]

    def shards_needed(self, jobs: list[str]) -> set[str]:
        """The shardings these jobs read (2x2 always: it holds the one tokenizer, and the start trains on it)."""
        by = {sp.name: sp.shards for sp in self.specs()}
        rows = [j.removeprefix("downstream-") for j in jobs]  # a downstream job reads its row's shards (router)
        return {"2x2"} | {by[j] for j in rows if by.get(j) in self.shard_plan()}

    def make_shards(self, keys: set[str] | None = None) -> None:
        """The shardings (``keys``; all by default), one tokenizer and one seed (the same held-out, router and
        validation documents)."""
        from dipaco.config import resolve
        from dipaco.shard_config import ShardConfig
        from dipaco.sharding.writer import shard

        inputs = self.inputs()
        plan = {k: v for k, v in self.shard_plan().items() if keys is None or k in keys}
        for key, sets in plan.items():
            d = self.shard_dirs[key]
            if (d / "manifest.json").is_file():
                continue
            print(f"[{self.name}] shard {key} -> {d}", flush=True)
            tokenizer = None if key == "2x2" else str(self.shard_dirs["2x2"] / "tokenizer")  # one tokenizer everywhere
            shard(inputs, resolve(ShardConfig, overrides=sets + self.shard_settings()), d, tokenizer, progress=True)
        texts = {k: [json.loads(line)["text"] for line in (self.shard_dirs[k] / "heldout" / "docs.jsonl").open()] for k in plan}
        if any(texts[k] != texts["2x2"] for k in plan):
            raise SystemExit(f"reproduce: the shard directories of {self.name} hold different held-out documents; "
                             f"delete them and re-run")

    # ------------------------------------------------------------------------ settings chosen on validation
    def pretrain_pilot(self) -> dict[float, float | None]:
        out = {}
        for lr in self.s.pretrain_lrs:
            rows = (self.result(f"start-lr{lr:g}") or {}).get("rounds", [])
            out[lr] = rows[-1]["val_loss_mean"] if len(rows) >= self.s.pretrain_pilot_rounds else None
        return out

    def start_lr(self) -> float | None:
        pilot = {k: v for k, v in self.pretrain_pilot().items() if v is not None}
        return min(pilot, key=pilot.get) if len(pilot) == len(self.s.pretrain_lrs) else None

    def continued_lr(self) -> float:
        return self.start_lr() * 0.1  # the start's final lr (cosine to min_lr_ratio 0.1)

    def outer_grid(self) -> list[dict]:
        rows = []
        for lr, mom in self.s.outer_grid:
            name = f"pilot-outer-lr{lr:g}-m{mom:g}"
            res = self.result(name) or {}
            val = res.get("evals", {}).get("val", {}).get("methods", {}).get(name, {})
            rows.append({"lr": lr, "momentum": mom, "run": name, "val_perplexity": val.get("perplexity")})
        return rows

    def chosen_outer(self) -> tuple[float, float] | None:
        """The grid point with the lowest routed validation perplexity after the pilot (None until all are in)."""
        grid = self.outer_grid()
        if any(g["val_perplexity"] is None for g in grid):
            return None
        best = min(grid, key=lambda g: g["val_perplexity"])
        return best["lr"], best["momentum"]

    # ------------------------------------------------------------------------------------------ rows
    def specs(self) -> list[RunSpec]:
        s, R, H = self.s, self.s.rounds, self.s.H
        stream = [f"streaming.fragments={s.fragments}", "streaming.overlap=1", "streaming.alpha=0.5"]
        diloco = ['grid.shape="1"', "grid.replicas_per_shard=true"]
        label = f"DiPaCo 2x2, Streaming DiLoCo F={s.fragments} τ=1 α=0.5"
        out = [RunSpec("dense", "dense (same steps as one trainee)", "2x2", PLAIN, R, H, 1)]
        out += [RunSpec(f"dense-{k}x", f"dense, {k}x steps", "2x2", PLAIN, R * k, H, 1) for k in s.factors]
        out += [
            RunSpec("diloco-iid", "DiLoCo, 4 replicas on i.i.d. shards", "iid", diloco, R, H, 4, outer="chosen"),
            RunSpec("diloco-kmeans", "DiLoCo, 4 replicas on the k-means shards", "2x2", diloco, R, H, 4, outer="chosen"),
            RunSpec("flat-4", "flat mixture, 4 paths", "4", [], R, H, 4, outer="chosen", routing=True),
            RunSpec("dipaco-2x2", "DiPaCo 2x2", "2x2", [], R, H, 4, outer="chosen", routing=True),
            RunSpec("dipaco-2x2-private", "DiPaCo 2x2, private embedding and blocks 0, 3", "2x2", PRIVATE, R, H, 4,
                    outer="chosen", routing=True),
            RunSpec("dipaco-2x2-overlap", "DiPaCo 2x2, top-2 overlap in training", "2x2-overlap", [], R, H, 4,
                    outer="chosen", routing=True),
            RunSpec("dipaco-2x2-paper", "DiPaCo 2x2, papers' outer step (0.7, Nesterov 0.9)", "2x2", [], R, H, 4,
                    outer="paper"),
            RunSpec("dipaco-2x2-disc", "DiPaCo 2x2 after discriminative re-sharding", "2x2-disc", [], R, H, 4,
                    needs=["reshard"], outer="chosen", routing=True),
            RunSpec("dipaco-4x4", "DiPaCo 4x4", "4x4", [], R, H, 16, outer="chosen", routing=True),
            RunSpec("stream-fp32", label + ", fp32", "2x2", stream, R, H, 4, workers=s.stream_workers, outer="chosen"),
            RunSpec("stream-4bit", label + ", 4-bit", "2x2", stream + ["comm.bits=4"], R, H, 4, workers=s.stream_workers,
                    outer="chosen"),
            # bytes per round at the papers' H = 100 (the 400x of Streaming DiLoCo is 100 steps x 16/4 bits)
            RunSpec("bytes-4bit-h100", "bytes only: the 4-bit streaming run at H = 100, 2 rounds", "2x2",
                    stream + ["comm.bits=4"], 2, 2 * H, 4, workers=s.stream_workers, outer="chosen", bytes_only=True),
        ]
        return out

    def eval_rounds(self, sp: RunSpec) -> list[int]:
        if sp.bytes_only:
            return []
        every = 1 if sp.name in CURVES else max(1, self.s.eval_every * sp.rounds // self.s.rounds)
        return sorted({*range(every, sp.rounds + 1, every), sp.rounds})

    def train_argv(self, sp: RunSpec, outer: tuple[float, float] | None) -> list[str]:
        s, run = self.s, self.runs / sp.name
        argv = cli("train", "--shards", str(self.shard_dirs[sp.shards]), "--out", str(run), "--quiet",
                   "--rounds", str(sp.rounds), "--inner-steps", str(sp.H), "--init-from", str(self.runs / "start"))
        if sp.workers > 1:
            argv += ["--workers", str(sp.workers)]
        every = min(self.eval_rounds(sp) or [sp.rounds])
        sets = s.model + sp.sets + ["log_every=50", "val_batches=4", f"eval.max_tokens_per_doc={s.eval_tokens}",
                                    f"checkpoint_every={every}"]
        if outer is not None:
            sets += [f"outer.lr={outer[0]}", f"outer.momentum={outer[1]}", f"outer.nesterov={'true' if outer[1] else 'false'}"]
        # no re-warm: continue at the start's final lr, cosine down to a tenth of it
        sets += [f"inner.lr={self.continued_lr()}", "inner.warmup_steps=0", "inner.min_lr_ratio=0.1"]
        for kv in sets:
            argv += ["--set", kv]
        return argv

    def row_spec(self, sp: RunSpec) -> dict:
        """A row's unit: its training and its evaluations (every eval round on the held-out documents; the routing
        rows also fit the every-W rules and score every routing at the end, and on the validation documents)."""
        s, W, run = self.s, self.s.route_every, self.runs / sp.name
        outer = {"chosen": self.chosen_outer(), "paper": PAPER_OUTER}.get(sp.outer)
        record = {**asdict(sp), "outer_step": list(outer) if outer else None}
        if sp.outer == "paper" and outer == self.chosen_outer():  # the same run as DiPaCo 2x2: training it twice costs only time
            return {"command": None, "run": None, "steps": [], "record": record | {"same_run_as": "dipaco-2x2"}}
        shards = str(self.shard_dirs[sp.shards])
        steps = [{"op": "window_router", "shards": shards, "window": W, "max_tokens": max(4 * W, s.eval_tokens)}] if sp.routing else []
        route = {"route_every": [W], "oracle": True, "random": True, "early_stopping": True, "mixture": 2}
        for r in self.eval_rounds(sp):
            steps.append({"op": "eval", "key": f"heldout_r{r}", "label": sp.label, "shards": shards, "round": r,
                          "options": route if sp.routing and r == sp.rounds else {}})
        if sp.routing:
            steps.append({"op": "eval", "key": "val", "label": sp.label, "shards": shards, "round": sp.rounds,
                          "split": "val", "options": {"route_every": [W]}})
        return {"command": self.train_argv(sp, outer), "run": str(run), "complete_after": sp.rounds, "steps": steps,
                "record": record, "out": str(self.root)}

    def pretrain_argv(self, run: Path, lr: float, rounds: int) -> list[str]:
        s = self.s
        argv = cli("train", "--shards", str(self.shard_dirs["2x2"]), "--out", str(run), "--quiet", "--rounds", str(rounds),
                   "--inner-steps", str(s.pretrain_H))
        for kv in s.model + PLAIN + [f"inner.warmup_steps={s.pretrain_warmup}", "inner.min_lr_ratio=0.1", f"inner.lr={lr}",
                                     "log_every=100", "val_batches=8", f"eval.max_tokens_per_doc={s.eval_tokens}",
                                     f"checkpoint_every={max(1, rounds // 4)}"]:
            argv += ["--set", kv]
        return argv

    # ------------------------------------------------------------------------------------------ jobs
    def jobs(self) -> list[Job]:
        """Every job of the corpus, inputs first."""
        s, n = self.s, self.name
        base = {"corpus": self.identity(), "scale": asdict(s), "shards": self.shard_plan(), "shard_settings": self.shard_settings(),
                "out": str(self.root)}
        done = lambda run, rounds: (lambda: rounds_done(run) >= rounds)  # noqa: E731
        jobs, pilots = [], []
        for lr in s.pretrain_lrs:  # the pilot is a shortened pretraining with the same schedule shape
            run = self.runs / f"start-lr{lr:g}"
            jobs.append(Job(n, f"start-lr{lr:g}", lambda run=run, lr=lr: {
                **base, "command": self.pretrain_argv(run, lr, s.pretrain_pilot_rounds), "run": str(run),
                "complete_after": s.pretrain_pilot_rounds, "steps": [], "record": {"lr": lr}},
                artifact=done(run, s.pretrain_pilot_rounds), weight=CRITICAL))
            pilots.append(f"start-lr{lr:g}")
        start = self.runs / "start"
        jobs.append(Job(n, "start", lambda: {
            **base, "command": self.pretrain_argv(start, self.start_lr(), s.pretrain_rounds), "run": str(start),
            "complete_after": s.pretrain_rounds, "record": {"lr": self.start_lr()},
            "steps": [{"op": "eval", "key": "heldout", "label": "pretrained start", "shards": str(self.shard_dirs["2x2"]),
                       "round": s.pretrain_rounds}]}, deps=pilots, artifact=done(start, s.pretrain_rounds), weight=CRITICAL))
        grid = []
        for lr, mom in s.outer_grid:
            sp = RunSpec(f"pilot-outer-lr{lr:g}-m{mom:g}", f"pilot-outer-lr{lr:g}-m{mom:g}", "2x2", [], s.pilot_rounds, s.H, 4)
            jobs.append(Job(n, sp.name, lambda sp=sp, o=(lr, mom): {
                **base, "command": self.train_argv(sp, o), "run": str(self.runs / sp.name), "complete_after": sp.rounds,
                "record": {"lr": o[0], "momentum": o[1]},
                "steps": [{"op": "eval", "key": "val", "label": sp.name, "shards": str(self.shard_dirs["2x2"]),
                           "round": sp.rounds, "split": "val"}]}, deps=["start"], needs=["start"],
                artifact=done(self.runs / sp.name, sp.rounds), weight=UNBLOCKS))
            grid.append(sp.name)
        for sp in self.specs():
            if sp.name == "dipaco-2x2-disc":  # the re-sharding reads the DiPaCo 2x2 run's weights: an artifact only
                jobs.append(Job(n, "reshard", lambda: {**base, "command": cli(
                    "reshard", "--run", str(self.runs / "dipaco-2x2"), "--shards", str(self.shard_dirs["2x2"]), "--out",
                    str(self.shard_dirs["2x2-disc"]), "--quiet", "--max-tokens", str(s.eval_tokens)), "run": None},
                    needs=["dipaco-2x2"], artifact=lambda: (self.shard_dirs["2x2-disc"] / "manifest.json").is_file(),
                    durable=False, weight=UNBLOCKS))
            deps = ["start"] + (grid if sp.outer else []) + (["dipaco-2x2"] if sp.outer == "paper" else [])
            jobs.append(Job(n, sp.name, lambda sp=sp: {**base, **self.row_spec(sp)}, deps=deps, needs=["start", *sp.needs],
                            artifact=done(self.runs / sp.name, sp.rounds), slots=min(2, sp.workers),
                            weight=sp.trainees * sp.rounds * sp.H))
        rows = self.downstream_rows() if self.downstream else []
        for sp in (sp for sp in self.specs() if sp.name in rows):
            shards = str(self.shard_dirs[sp.shards])  # the perplexity too: the row may be re-trained to other weights
            steps = [{"op": "eval", "key": "heldout", "label": sp.label, "shards": shards, "round": sp.rounds},
                     {"op": "downstream", "key": "heldout_choice", "shards": shards, **DOWNSTREAM_TASK}]
            jobs.append(Job(n, f"downstream-{sp.name}", lambda sp=sp, steps=steps: {
                **base, "command": None, "run": str(self.runs / sp.name), "steps": steps, "record": {"row": sp.name}},
                deps=[sp.name], needs=[sp.name]))
        return jobs


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def pretrain_tokens_per_step(s: Scale) -> int:
    value = lambda key: int(next(x.split("=")[1] for x in s.model if x.startswith(key)))  # noqa: E731
    return value("inner.batch_size") * value("model.max_seq_len")


def paths_of(grid: str | None) -> int | None:
    return math.prod(int(k) for k in str(grid).split("x")) if grid else None


def dump(obj) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False)
