"""Reproduce the papers' claims at CPU scale: one command, resumable, progress shown.

    python bench/reproduce.py [--data DIR_OR_FILE] [--out reproduce-out] [--scale full|tiny] [--jobs 2]
                              [--page docs/RESULTS.md]

Stages (each is skipped when its output is complete, so re-running continues where it stopped):

  1. shards     the corpus routed on a 2x2 grid (k-means, balanced) and, with the same tokenizer and
                the same held-out documents, on a flat grid of 4 paths
  2. pretrain   one dense model (one path of the same size as a DiPaCo path) trained on all shards;
                every other run starts from its weights (``--init-from``), as in the papers
  3. runs       dense (same inner steps as one trainee), dense with P times the steps, DiLoCo (4
                replicas of one path on the 4 k-means shards), a flat mixture of 4 paths, DiPaCo 2x2,
                and DiPaCo 2x2 with Streaming DiLoCo (fragments, τ=1, α=0.5, 4-bit). Multi-trainee runs
                use one torchrun worker per trainee (gloo on 127.0.0.1), so bytes are measured
  4. eval       routed held-out perplexity of every run at several rounds (the first ``context``
                tokens route and are never scored; every run is scored on the same tokens), plus
                routing every W tokens and per-path early stopping for the final DiPaCo model
  5. report     results.json, RESULTS.md (table, expectations checked, every setting) and plots

Jobs run ``--jobs`` at a time, one thread each (tiny models waste a second thread). Logs of every job
are in OUT/logs/. ``--scale tiny`` is a minutes-long version used by the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("DIPACO_CORPUS", ROOT.parent / "shared" / "corpus"))


@dataclass
class Scale:
    """Every number that sizes the experiment; all of it is written into the results."""
    vocab: int
    model: list[str]             # --set overrides of the path model (one path = one dense model)
    H: int                       # inner steps per round
    pretrain_rounds: int
    rounds: int                  # rounds of every continued run (steps per trainee = rounds * H)
    compute_factor: int          # the compute-matched dense run takes this many times the steps
    pretrain_lr: float
    lr: float                    # peak inner lr of the continued runs (re-warmed, cosine to 10%)
    warmup: int
    eval_tokens: int             # held-out documents are cut to this many tokens
    eval_every: int              # rounds between evaluated checkpoints
    workers: int                 # torchrun workers of a 4-trainee run (1 = all in one process)
    fragments: int
    route_every: int
    shard: list[str] = field(default_factory=list)
    one_eval_job: bool = False   # evaluate everything in one process after all training (saves imports)


SCALES = {
    # ~40 min on a quiet 2-core machine; the model is the `tiny` preset (one path: 4 blocks, width 64).
    "full": Scale(vocab=4096, model=["preset=\"tiny\"", "inner.batch_size=8", "model.max_seq_len=128"],
                  H=100, pretrain_rounds=20, rounds=8, compute_factor=4, pretrain_lr=2e-3, lr=1e-3, warmup=50,
                  eval_tokens=512, eval_every=2, workers=4, fragments=2, route_every=64),
    # The test suite's version: a minute or two.
    "tiny": Scale(vocab=512, model=["model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
                                    "model.num_kv_heads=2", "model.max_seq_len=64", "inner.batch_size=4"],
                  H=4, pretrain_rounds=2, rounds=2, compute_factor=2, pretrain_lr=2e-3, lr=1e-3, warmup=2,
                  eval_tokens=96, eval_every=2, workers=1, fragments=2, route_every=16,
                  shard=["routing.svd_dims=16", "routing.kmeans_restarts=2"], one_eval_job=True),
}


@dataclass
class RunSpec:
    name: str          # directory name
    label: str         # name in the table
    shards: str        # "2x2" or "4"
    sets: list[str]
    rounds: int
    workers: int
    trainees: int


def run_specs(s: Scale) -> list[RunSpec]:
    plain = ['grid.shape="1"', "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]  # = plain AdamW
    k, w = s.compute_factor, s.workers
    stream = [f"streaming.fragments={s.fragments}", "streaming.overlap=1", "streaming.alpha=0.5", "comm.bits=4"]
    return [
        RunSpec(f"dense-{k}x", f"dense, {k}x steps (compute-matched)", "2x2", plain, s.rounds * k, 1, 1),
        RunSpec("dipaco-2x2", "DiPaCo 2x2", "2x2", [], s.rounds, w, 4),
        RunSpec("dipaco-2x2-streaming", f"DiPaCo 2x2, Streaming DiLoCo F={s.fragments} τ=1 α=0.5 4-bit", "2x2",
                stream, s.rounds, w, 4),
        RunSpec("diloco-4", "DiLoCo, 4 replicas on the k-means shards", "2x2",
                ['grid.shape="1"', "grid.replicas_per_shard=true"], s.rounds, w, 4),
        RunSpec("flat-4", "flat mixture, 4 paths", "4", [], s.rounds, w, 4),
        RunSpec("dense", "dense (same steps as one trainee)", "2x2", plain, s.rounds, 1, 1),
    ]


def ablation_specs(s: Scale) -> list[RunSpec]:
    """Diagnosis (``--ablations``): the outer Nesterov step (lr 0.7, momentum 0.9) replaced by a plain
    average of the trainees (lr 1, no momentum); one process, the maths is the same with any workers."""
    avg = ["outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]
    return [RunSpec("ablation-dipaco-avg", "ablation: DiPaCo 2x2, outer = plain average", "2x2", avg, s.rounds, 1, 4),
            RunSpec("ablation-diloco-avg", "ablation: DiLoCo, outer = plain average", "2x2",
                    ['grid.shape="1"', "grid.replicas_per_shard=true", *avg], s.rounds, 1, 4)]


# ------------------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    name: str
    argv: list[str]
    after: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    began: float = 0.0


def run_jobs(jobs: list[Job], capacity: int, logs: Path, describe) -> dict[str, float]:
    """Run jobs (dependencies first, longest queued first), at most ``capacity`` at a time. A torchrun
    job counts as one: its workers time-share the cores rather than leave one idle."""
    from tqdm.auto import tqdm

    logs.mkdir(parents=True, exist_ok=True)
    pending, running, done = list(jobs), [], {}
    bar = tqdm(total=len(jobs), desc="jobs", unit="job", dynamic_ncols=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    while pending or running:
        for job in list(pending):
            if all(a in done for a in job.after) and len(running) < capacity:
                with open(logs / f"{job.name}.log", "w") as log:  # the child keeps its own descriptor
                    job.proc = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
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


# ---------------------------------------------------------------------------------------- stages
def input_files(data: Path) -> list[Path]:
    if data.is_file():
        return [data]
    files = sorted(p for p in data.glob("*.jsonl*") if p.is_file())
    if not files:
        raise SystemExit(f"reproduce: no .jsonl/.jsonl.gz files in {data}; pass --data DIR_OR_FILE "
                         f"(e.g. the shared corpus) or set DIPACO_CORPUS")
    return files


def make_shards(out: Path, files: list[Path], s: Scale) -> dict[str, Path]:
    from dipaco.config import ShardConfig, resolve
    from dipaco.sharding.writer import shard

    dirs = {"2x2": out / "shards-2x2", "4": out / "shards-4"}
    common = [f"tokenizer.vocab_size={s.vocab}", "routing.balance=1.2", *s.shard]
    for grid, d in dirs.items():
        if (d / "manifest.json").is_file():
            print(f"[shards] {d} is complete, reusing it")
            continue
        print(f"[shards] routing {', '.join(f.name for f in files)} on grid {grid} -> {d}")
        cfg = resolve(ShardConfig, overrides=[f'grid="{grid}"', *common])
        tokenizer = str(dirs["2x2"] / "tokenizer") if grid != "2x2" else None  # the same tokenizer everywhere
        shard([str(f) for f in files], cfg, d, tokenizer, progress=True)
    a = [json.loads(l)["text"] for l in open(dirs["2x2"] / "heldout" / "docs.jsonl", encoding="utf-8")]
    b = [json.loads(l)["text"] for l in open(dirs["4"] / "heldout" / "docs.jsonl", encoding="utf-8")]
    if a != b:
        raise SystemExit("reproduce: the two shard directories hold different held-out documents; delete them and re-run")
    return dirs


def train_argv(shards: Path, run: Path, sets: list[str], rounds: int, s: Scale, workers: int, init_from: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(run), "--quiet",
            "--rounds", str(rounds), "--inner-steps", str(s.H)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    if init_from is not None:
        argv += ["--init-from", str(init_from)]
    for kv in s.model + sets + ["log_every=50", "val_batches=4", f"eval.max_tokens_per_doc={s.eval_tokens}"]:
        argv += ["--set", kv]
    if (run / "checkpoints").is_dir():
        argv.append("--resume")
    return argv


def rounds_done(run: Path) -> int:
    from dipaco import checkpoint

    return (checkpoint.latest_round(run) or 0) if run.is_dir() else 0


def eval_rounds(total: int, every: int) -> list[int]:
    return sorted(set(range(0, total + 1, every)) | {total})


# ------------------------------------------------------------------------- the eval child process
def eval_child(spec: str) -> None:
    """Evaluations of one run at several rounds (one process: imports cost more than a tiny eval),
    each written atomically to its own file, so an interrupted job keeps what it finished."""
    from dipaco.eval.perplexity import evaluate
    from dipaco.io import write_json

    specs = json.loads(spec)
    for a in specs if isinstance(specs, list) else [specs]:
        for item in a["rounds"]:
            if Path(item["out"]).is_file():
                continue
            report = evaluate({a["label"]: a["run"]}, a["shards"], item["round"], progress=False,
                              route_every=item.get("route_every", []), early_stopping=item.get("early_stopping", False),
                              oracle=item.get("oracle", False), random=item.get("random", False))
            write_json(item["out"], report)


# ---------------------------------------------------------------------------------------- report
def metrics_of(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "round"]


def dp_bytes(per_path: int, replicas: int, steps: int) -> int:
    """Bytes all workers send when ``replicas`` data-parallel copies all-reduce bf16 gradients every step: a
    reduce-scatter + all-gather, 2(n−1)/n of the gradient per replica (not dipaco's transport, which below
    32 bits all-gathers every trainee's own payload)."""
    from dipaco.comm import allreduce_bytes

    return replicas * allreduce_bytes(per_path, replicas, 16) * steps


def collect(out: Path, specs: list[RunSpec], s: Scale, dirs: dict[str, Path], job_seconds: dict) -> dict:
    evals = out / "eval"
    start = json.loads((evals / f"pretrain_r{s.pretrain_rounds}.json").read_text())["methods"]["pretrained"]
    rows, curves = {}, {"pretrained (start)": {"steps": [0], "compute": [0], "perplexity": [start["perplexity"]]}}
    for sp in specs:
        run = out / "runs" / sp.name
        info = json.loads((run / "run.json").read_text())
        rounds = metrics_of(run)
        steps = sp.rounds * s.H
        final = json.loads((evals / f"{sp.name}_r{sp.rounds}.json").read_text())["methods"]
        seconds = sum(r["seconds"] for r in rounds)
        tokens = sum(r["tokens"] for r in rounds)
        sent = sum(r["bytes_sent"] for r in rounds)
        dp = dp_bytes(info["parameters"]["per_path"], sp.trainees, steps) if sp.trainees > 1 else 0
        rows[sp.name] = {
            "label": sp.label, "settings": sp.sets, "shards": sp.shards, "rounds": sp.rounds, "steps_per_trainee": steps,
            "trainees": sp.trainees, "workers": info["workers"], "parameters_total": info["parameters"]["total"],
            "parameters_per_path": info["parameters"]["per_path"], "perplexity": final[sp.label]["perplexity"],
            "per_label": {k: v["perplexity"] for k, v in final[sp.label].get("per_label", {}).items()},
            "scored_tokens": final[sp.label]["tokens"], "train_seconds": seconds, "job_seconds": job_seconds.get(sp.name),
            "tokens": tokens, "tokens_per_s_per_worker": tokens / seconds / info["workers"] if seconds else None,
            "bytes_sent": sent, "dp_bf16_bytes": dp, "bytes_ratio_vs_dp": (dp / sent) if sent and dp else None,
            "extra_rows": {k: {"perplexity": v["perplexity"], "routing": v.get("routing"), "rounds": v.get("rounds")}
                           for k, v in final.items() if k != sp.label}}
        xs, ys = [0], [start["perplexity"]]
        for r in eval_rounds(sp.rounds, s.eval_every * (sp.rounds // s.rounds)):
            if r == 0:
                continue
            m = json.loads((evals / f"{sp.name}_r{r}.json").read_text())["methods"][sp.label]
            xs.append(r * s.H)
            ys.append(m["perplexity"])
        curves[sp.label] = {"steps": xs, "compute": [x * sp.trainees for x in xs], "perplexity": ys}
    return {"scale": asdict(s), "shards": {k: str(v) for k, v in dirs.items()},
            "heldout_documents": start["documents"], "scored_tokens": start["tokens"],
            "pretrained_perplexity": start["perplexity"], "runs": rows, "curves": curves}


def expectations(res: dict, s: Scale) -> list[dict]:
    r = res["runs"]
    k = s.compute_factor
    ppl = {n: v["perplexity"] for n, v in r.items()}
    dip = r["dipaco-2x2"]["extra_rows"]
    every = dip.get(f"DiPaCo 2x2 every-{s.route_every}", {}).get("perplexity")
    early = dip.get("DiPaCo 2x2 early-stop", {}).get("perplexity")
    stream, plain = r["dipaco-2x2-streaming"], r["dipaco-2x2"]
    loss_gap = math.log(stream["perplexity"]) / math.log(plain["perplexity"]) - 1
    out = [
        ("DiPaCo 2x2 < flat mixture", ppl["dipaco-2x2"] < ppl["flat-4"], f"{ppl['dipaco-2x2']:.2f} vs {ppl['flat-4']:.2f}"),
        ("flat mixture ≲ DiLoCo (within 2% or better)", ppl["flat-4"] <= 1.02 * ppl["diloco-4"],
         f"{ppl['flat-4']:.2f} vs {ppl['diloco-4']:.2f}"),
        ("DiLoCo < dense", ppl["diloco-4"] < ppl["dense"], f"{ppl['diloco-4']:.2f} vs {ppl['dense']:.2f}"),
        (f"DiPaCo 2x2 close to dense with {k}x steps (within 5%)", ppl["dipaco-2x2"] <= 1.05 * ppl[f"dense-{k}x"],
         f"{ppl['dipaco-2x2']:.2f} vs {ppl[f'dense-{k}x']:.2f} ({100 * (ppl['dipaco-2x2'] / ppl[f'dense-{k}x'] - 1):+.1f}%)"),
        (f"routing every {s.route_every} tokens < once per document", every is not None and every < ppl["dipaco-2x2"],
         f"{every:.2f} vs {ppl['dipaco-2x2']:.2f}" if every else "not evaluated"),
        ("per-path early stopping ≤ last round", early is not None and early <= ppl["dipaco-2x2"],
         f"{early:.2f} vs {ppl['dipaco-2x2']:.2f}" if early else "not evaluated"),
        ("Streaming + 4-bit no more than 2% worse than fp32 (held-out loss)", loss_gap <= 0.02, f"{100 * loss_gap:+.2f}% loss"),
    ]
    if stream["bytes_ratio_vs_dp"]:
        out.append(("Streaming 4-bit: ≥ 400x fewer bytes than bf16 data-parallel of one path on as many workers",
                    stream["bytes_ratio_vs_dp"] >= 400,
                    f"{stream['bytes_ratio_vs_dp']:.0f}x"))
    return [{"claim": c, "held": bool(h), "measured": m} for c, h, m in out]


def markdown(res: dict, s: Scale, plot_name: str) -> str:
    def f(x, p=2):
        return "n/a" if x is None else f"{x:,.{p}f}"

    lines = ["| run | held-out ppl | params total | params/path | steps/trainee | trainees (workers) | "
             "bytes sent | x fewer than DP bf16 | train wall s | tokens/s/worker |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| pretrained start (all runs) | {f(res['pretrained_perplexity'])} | | | | | | | | |"]
    for name, r in res["runs"].items():
        lines.append(f"| {r['label']} | {f(r['perplexity'])} | {r['parameters_total']:,} | {r['parameters_per_path']:,} | "
                     f"{r['steps_per_trainee']} | {r['trainees']} ({r['workers']}) | {r['bytes_sent']:,} | "
                     f"{f(r['bytes_ratio_vs_dp'], 0)} | {f(r['train_seconds'], 0)} | {f(r['tokens_per_s_per_worker'], 0)} |")
        for extra, e in r["extra_rows"].items():
            lines.append(f"| &nbsp;&nbsp;{extra} | {f(e['perplexity'])} | | | | | | | | |")
    labels = sorted({l for r in res["runs"].values() for l in r["per_label"]})
    if labels:
        lines += ["", "Held-out perplexity per domain:", "", "| run | " + " | ".join(labels) + " |",
                  "| --- |" + " ---: |" * len(labels)]
        for r in res["runs"].values():
            lines.append(f"| {r['label']} | " + " | ".join(f(r["per_label"].get(l)) for l in labels) + " |")
    lines += ["", "Expectations from the papers, checked on these numbers:", "", "| expectation | held? | measured |",
              "| --- | --- | --- |"]
    lines += [f"| {e['claim']} | {'yes' if e['held'] else '**no**'} | {e['measured']} |" for e in res["expectations"]]
    lines += ["", f"![held-out perplexity over training]({plot_name})", "",
              f"{res['heldout_documents']} held-out documents, {res['scored_tokens']:,} scored tokens (the first 32 tokens "
              f"of every document route and are not scored); wall time recorded by the script (all its invocations in this --out) "
              f"{res.get('wall_seconds', 0) / 60:.1f} min on {os.cpu_count()} cores with --jobs {res.get('jobs')}.", "",
              "Settings (`bench/reproduce.py`, scale " + f"`{res['scale_name']}`):", "", "```json",
              json.dumps(res["scale"], indent=1, ensure_ascii=False), "```"]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for label, c in res["curves"].items():
        style = dict(marker="o", ms=3) if len(c["steps"]) > 1 else dict(marker="*", ms=12, ls="")
        axes[0].plot(c["steps"], c["perplexity"], label=label, **style)
        axes[1].plot(c["compute"], c["perplexity"], label=label, **style)
    axes[0].set_xlabel("inner steps per trainee (wall-clock when trainees run in parallel)")
    axes[1].set_xlabel("inner steps of all trainees together (compute)")
    axes[0].set_ylabel("routed held-out perplexity")
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("Every run continues from the same pretrained dense model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_eval"]:
        eval_child(argv[1])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="corpus directory (*.jsonl[.gz]) or file")
    p.add_argument("--out", type=Path, default=Path("reproduce-out"), help="work directory (re-running resumes)")
    p.add_argument("--scale", choices=list(SCALES), default="full")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="jobs (processes) at a time")
    p.add_argument("--workers", type=int, help="workers of the 4-trainee runs (default: the scale's)")
    p.add_argument("--ablations", action="store_true", help="also run the outer-optimizer ablations (plain averaging)")
    p.add_argument("--page", type=Path, help="also write the table and plot into this Markdown page (e.g. docs/RESULTS.md)")
    args = p.parse_args(argv)
    s = SCALES[args.scale]
    if args.workers:
        s.workers = args.workers
    began = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.data.exists():
        raise SystemExit(f"reproduce: corpus {args.data} not found; pass --data DIR_OR_FILE or set DIPACO_CORPUS")
    files = input_files(args.data)
    dirs = make_shards(out, files, s)

    runs = out / "runs"
    pretrain = runs / "pretrain"
    plain = ['grid.shape="1"', "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]
    jobs: list[Job] = []
    if rounds_done(pretrain) < s.pretrain_rounds:
        sets = plain + [f"inner.lr={s.pretrain_lr}", f"inner.warmup_steps={max(s.warmup, s.H // 2)}"]
        jobs.append(Job("pretrain", train_argv(dirs["2x2"], pretrain, sets, s.pretrain_rounds, s, 1, None)))
    specs = run_specs(s) + (ablation_specs(s) if args.ablations else [])
    evals = out / "eval"
    evals.mkdir(exist_ok=True)

    eval_specs: list[tuple[dict, list[str]]] = []

    def eval_job(name, label, run, shards, items, after):
        """Evaluate ``run`` at every (round, extras) in ``items`` not already on disk."""
        todo = [{"round": r, "out": str(evals / f"{name}_r{r}.json"), **extra} for r, extra in items
                if not (evals / f"{name}_r{r}.json").is_file()]
        if todo:
            eval_specs.append(({"label": label, "run": str(run), "shards": str(shards), "rounds": todo}, after))

    trained = {j.name for j in jobs}
    eval_job("pretrain", "pretrained", pretrain, dirs["2x2"], [(s.pretrain_rounds, {})], sorted(trained))
    for sp in specs:
        run = runs / sp.name
        after = [n for n in ["pretrain"] if n in trained]
        if rounds_done(run) < sp.rounds:
            sets = sp.sets + [f"inner.lr={s.lr}", f"inner.warmup_steps={s.warmup}"]
            jobs.append(Job(sp.name, train_argv(dirs[sp.shards], run, sets, sp.rounds, s, sp.workers, pretrain),
                            after=after))
            trained.add(sp.name)
        items = []
        for r in eval_rounds(sp.rounds, s.eval_every * (sp.rounds // s.rounds)):
            extra = {}
            if r == sp.rounds and sp.name.startswith("dipaco-2x2"):
                extra = {"route_every": [s.route_every], "early_stopping": True}
                if sp.name == "dipaco-2x2":
                    extra |= {"oracle": True, "random": True}
            if r > 0:
                items.append((r, extra))
        eval_job(sp.name, sp.label, run, dirs[sp.shards], items, [sp.name] if sp.name in trained else [])

    child = [sys.executable, str(Path(__file__).resolve()), "_eval"]
    if s.one_eval_job and eval_specs:
        jobs.append(Job("eval", child + [json.dumps([e for e, _ in eval_specs])], after=sorted(trained)))
    for e, after in ([] if s.one_eval_job else eval_specs):
        jobs.append(Job(f"eval-{Path(e['run']).name}", child + [json.dumps([e])], after=after))

    total_rounds = {sp.name: sp.rounds for sp in specs} | {"pretrain": s.pretrain_rounds}

    def describe(name: str) -> str:
        if name in total_rounds:
            return f"{name} {len(metrics_of(runs / name))}/{total_rounds[name]}"
        return name

    print(f"[jobs] {len(jobs)} to run ({sum(1 for j in jobs if not j.name.startswith('eval'))} trainings), "
          f"{args.jobs} at a time; logs in {out / 'logs'}")
    # longest first: trainings before evals, more trainee-steps first (dependencies still hold)
    weight = {sp.name: sp.rounds * sp.trainees for sp in specs} | {"pretrain": 10 ** 9}
    jobs.sort(key=lambda j: -weight.get(j.name, 0))
    job_seconds = run_jobs(jobs, args.jobs, out / "logs", describe)
    times_file = out / "job_seconds.json"  # kept across resumed invocations
    old = json.loads(times_file.read_text()) if times_file.is_file() else {}
    job_seconds = old | job_seconds
    job_seconds["_wall"] = float(old.get("_wall", 0.0)) + time.perf_counter() - began
    times_file.write_text(json.dumps(job_seconds, indent=1))

    res = collect(out, specs, s, dirs, job_seconds)
    res["scale_name"], res["jobs"] = args.scale, args.jobs
    res["wall_seconds"] = round(job_seconds["_wall"], 1)
    res["expectations"] = expectations(res, s)
    plot(res, out / "perplexity_rounds.png")
    block = markdown(res, s, "perplexity_rounds.png")
    (out / "RESULTS.md").write_text(block + "\n")
    (out / "results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    if args.page:
        pictures = args.page.parent / "results"
        pictures.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "perplexity_rounds.png", pictures / "perplexity_rounds.png")
        shutil.copy(out / "results.json", pictures / "results.json")
        write_page(args.page, markdown(res, s, "results/perplexity_rounds.png"))
    print()
    print(block)
    print(f"\nwrote {out / 'RESULTS.md'}, {out / 'results.json'}, {out / 'perplexity_rounds.png'}"
          + (f" and {args.page}" if args.page else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
