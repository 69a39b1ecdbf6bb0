"""The job graph of bench/reproduce.py: which jobs a corpus has, which of them are still to run, and running them.

A job is one unit that finishes in one sitting: a training and its evaluations, ending with its durable result
(``reproduce_store``). Two kinds of dependency:

  deps    jobs whose *results* it reads (the start's chosen lr, the outer step chosen on validation)
  needs   jobs whose *run directory* it needs on disk (every continued run starts from the start's weights)

A job is to run when its durable result is missing or stale, or when a job to run needs its run directory and that
is gone (a new session): then it re-trains (the same bits: training is deterministic) and keeps its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import reproduce_store as store

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    corpus: str
    name: str
    spec: Callable[[], dict]          # the unit: {"command": argv | None, "run": dir, "steps": [...], "record": {...}};
    #                                   called once its deps are done (it reads their results)
    deps: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    artifact: Callable[[], bool] = lambda: True   # its run (or shard) directory is complete on disk
    durable: bool = True              # False: an artifact only (re-sharding), nothing to keep
    slots: int = 1                    # cores it keeps busy
    weight: float = 0.0               # among ready jobs, heavier ones start first
    fp: str | None = None

    @property
    def key(self) -> str:
        return f"{self.corpus}:{self.name}"


def plan(jobs: list[Job], results: Path, out: Path) -> list[Job]:
    """The jobs to run, in dependency order. A job whose inputs are all known gets its fingerprint now; the others get
    theirs when they start (``launch_spec``). An artifact-only job runs only when a job to run needs it and it is gone."""
    by = {j.key: j for j in jobs}
    todo: set[str] = set()
    unknown: set[str] = set()  # fingerprint not computable yet: an input is still to run
    for j in jobs:  # jobs are listed inputs first
        inputs = [f"{j.corpus}:{d}" for d in j.deps + j.needs]
        j.fp = None
        if any(i in unknown for i in inputs):
            unknown.add(j.key)
            if j.durable:
                todo.add(j.key)
            continue
        j.fp = store.fingerprint(j.spec(), out, {i: by[i].fp for i in inputs})
        if j.durable and store.load(results, j.corpus, j.name, j.fp) is None:
            todo.add(j.key)
            unknown.add(j.key)
    work = list(todo)
    while work:  # a job to run needs its inputs' run directories: re-train (or re-shard) those that are gone
        j = by[work.pop()]
        for n in j.needs:
            k = f"{j.corpus}:{n}"
            if k not in todo and not by[k].artifact():
                todo.add(k)
                work.append(k)
    return [j for j in jobs if j.key in todo]


def valid(jobs: list[Job], results: Path) -> dict[str, dict[str, str]]:
    """{corpus: {job: fingerprint}} of the jobs whose durable result matches their fingerprint now."""
    out: dict[str, dict[str, str]] = {}
    for j in jobs:
        if j.durable and j.fp and store.load(results, j.corpus, j.name, j.fp) is not None:
            out.setdefault(j.corpus, {})[j.name] = j.fp
    return out


def launch_spec(job: Job, by: dict[str, Job], results: Path, out: Path) -> dict:
    """The unit's spec for the child, with its fingerprint (computed now: its inputs have finished)."""
    spec = job.spec()
    if job.fp is None:
        job.fp = store.fingerprint(spec, out, {f"{job.corpus}:{d}": by[f"{job.corpus}:{d}"].fp for d in job.deps + job.needs})
    return {**spec, "corpus": job.corpus, "job": job.name, "results": str(results), "fingerprint": job.fp,
            "durable": job.durable}


@dataclass
class Command:
    """One child process for ``run_commands`` (bench/routing_quality.py schedules its trainings with it too)."""
    name: str
    argv: list[str] | Callable[[], list[str]]   # a callable is resolved when the command starts (after its inputs)
    after: list[str] = field(default_factory=list)
    slots: int = 1
    weight: float = 0.0
    proc: subprocess.Popen | None = None
    began: float = 0.0


def run_commands(commands: list[Command], capacity: int, logs: Path, describe=lambda name: name,
                 log: Callable[[dict], None] = lambda event: None, kept: str = "") -> dict[str, float]:
    """Run commands (inputs first, heavier first among the ready ones), keeping at most ``capacity`` cores busy. The
    first failure stops everything with the command's last log lines."""
    from tqdm.auto import tqdm

    logs.mkdir(parents=True, exist_ok=True)
    pending, running, done = sorted(commands, key=lambda c: -c.weight), [], {}
    known = {c.name for c in commands}
    bar = tqdm(total=len(commands), desc="jobs", unit="job", dynamic_ncols=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    file = lambda c: logs / f"{c.name.replace(':', '_')}.log"  # noqa: E731
    while pending or running:
        for c in list(pending):
            busy = sum(r.slots for r in running)
            if any(a in known and a not in done for a in c.after) or (busy + c.slots > capacity and running):
                continue
            argv = c.argv() if callable(c.argv) else c.argv
            with open(file(c), "w") as f:  # the child keeps its own descriptor
                c.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            c.began = time.perf_counter()
            pending.remove(c)
            running.append(c)
            log({"event": "start", "job": c.name})
        for c in list(running):
            rc = c.proc.poll()
            if rc is None:
                continue
            running.remove(c)
            seconds = time.perf_counter() - c.began
            log({"event": "end", "job": c.name, "rc": rc, "seconds": round(seconds, 1)})
            if rc != 0:
                for r in running:
                    r.proc.terminate()
                tail = file(c).read_text(errors="replace").strip().splitlines()[-15:]
                raise SystemExit(f"reproduce: job {c.name} failed (exit {rc}){kept}; last lines of {file(c)}:\n" + "\n".join(tail))
            done[c.name] = seconds
            bar.update(1)
        bar.set_postfix_str(", ".join(describe(r.name) for r in running)[:120])
        time.sleep(0.5)
    bar.close()
    return done


def run_jobs(todo: list[Job], every: list[Job], capacity: int, results: Path, out: Path, logs: Path,
             log: Callable[[dict], None]) -> dict[str, float]:
    """Run the jobs to do, each a ``_unit`` child of bench/reproduce.py; a job's result is durable as soon as it
    ends, so an interrupted invocation keeps every job that finished."""
    by = {j.key: j for j in every}
    script = str(Path(__file__).with_name("reproduce.py"))

    def command(job: Job) -> Command:
        argv = lambda: [sys.executable, script, "_unit", json.dumps(launch_spec(job, by, results, out))]  # noqa: E731
        return Command(job.key, argv, [f"{job.corpus}:{d}" for d in job.deps + job.needs], job.slots, job.weight)

    return run_commands([command(j) for j in todo], capacity, logs, log=log,
                        kept=f"; the jobs that finished are kept in {results}")


# ------------------------------------------------------------------------------------- the child
def unit_child(spec: dict) -> None:
    """One job: its command (a training, resumed if a checkpoint is there; a re-sharding), then, unless its durable
    result is already there, its steps (window router, evaluations), then the durable result."""
    began = time.perf_counter()
    run = Path(spec["run"]) if spec.get("run") else None
    if spec.get("command") and not (spec.get("complete_after") and _complete(run, spec["complete_after"])):
        argv = list(spec["command"])
        if run is not None and (run / "checkpoints").is_dir() and "--resume" not in argv:
            argv.append("--resume")
        if argv[:3] == store.CLI:  # in this process: the imports cost more than a tiny training
            from dipaco.cli.commands import main

            if argv[3] == "train" and "--workers" not in argv:  # one core per job: the scheduler counts a job one slot
                argv += ["--num-proc", "1"]                      # (not in the spec: the bits are the same for any count)

            rc = main(argv[3:])
            if rc:
                raise SystemExit(f"reproduce: {' '.join(argv[3:5])} exited {rc}")
        else:
            subprocess.run(argv, check=True, cwd=ROOT)
    results = Path(spec["results"])
    kept = store.load(results, spec["corpus"], spec["job"], spec["fingerprint"]) if spec["durable"] else None
    if kept is not None:  # re-trained for a job that needs its run directory: the same weights as when it was measured?
        if kept.get("weights_sha256") and kept["weights_sha256"] != weights_sha256(run):
            print(f"reproduce: WARNING: {run} re-trained to other weights than its durable result was measured on "
                  f"(another machine or library version?); results that depend on it mix the two", file=sys.stderr)
        return
    if not spec["durable"]:
        return  # an artifact only
    evals, window = {}, {}
    for step in spec.get("steps", []):
        if step["op"] == "window_router":
            window = _fit_window_router(run, step)
        elif step["op"] == "downstream":
            evals[step["key"]] = _downstream(run, step)
        else:
            evals[step["key"]] = _evaluate(run, step)
    data = {"fingerprint": spec["fingerprint"], "job": spec["job"], "corpus": spec["corpus"], "protocol": store.PROTOCOL,
            "record": spec.get("record", {}), "command": _relative(spec.get("command"), spec.get("out")),
            "rounds": _round_rows(run), "run_info": _run_info(run), "evals": evals, "window_router": window,
            "weights_sha256": weights_sha256(run),
            "seconds": round(time.perf_counter() - began, 1)}
    store.save(results, spec["corpus"], spec["job"], data)


def weights_sha256(run: Path | None) -> str | None:
    """One hash of the latest checkpoint's module files (training is deterministic: a re-trained run matches)."""
    import hashlib

    r = rounds_done(run) if run is not None else 0
    files = sorted((run / "checkpoints" / f"round_{r}" / "modules").glob("*.safetensors")) if r else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _complete(run: Path | None, rounds: int) -> bool:
    return run is not None and rounds_done(run) >= rounds


def _evaluate(run: Path, step: dict) -> dict:
    from dipaco.eval.perplexity import evaluate

    rep = evaluate({step["label"]: str(run)}, step["shards"], step.get("round"), progress=False,
                   split=step.get("split", "heldout"), **step.get("options", {}))
    return store.compact_report(rep)


def _fit_window_router(run: Path, step: dict) -> dict:
    from dipaco.eval.window_router import fit_window_router

    folder = run / "window_routers" / f"w{step['window']}"
    rep = fit_window_router(run, step["shards"], step["window"], max_tokens=step["max_tokens"], progress=False,
                            overwrite=folder.exists())
    keep = ("examples", "test_examples", "accuracy", "accuracy_document_path", "loss_window_router",
            "loss_document_path", "loss_oracle")
    policy = json.loads((folder / "policy.json").read_text()) if (folder / "policy.json").is_file() else {}
    return {**{k: rep.get(k) for k in keep}, "policy": {k: policy.get(k) for k in ("name", "reason", "scores")}}


def _downstream(run: Path, step: dict) -> dict:
    """The held-out multiple-choice task (``dipaco.eval.harness_tasks.choice_task``) through lm-evaluation-harness,
    every question routed by its passage (``dipaco.eval.harness``): accuracy with the harness's standard error."""
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    from dipaco.eval.harness import DipacoLM, add_paths
    from dipaco.eval.harness_tasks import choice_task
    from dipaco.storage.shards import ShardSet

    shards = ShardSet(step["shards"])
    lm = DipacoLM(run=str(run), shards=step["shards"], progress=False)
    try:
        with tempfile.TemporaryDirectory(prefix="dipaco-downstream-") as tmp:
            name = choice_task(tmp, shards.tokenizer(), shards.heldout(), step["passage"], step["answer"], step["choices"],
                               step["seed"])
            res = lm_eval.simple_evaluate(model=lm, tasks=[name], log_samples=True, random_seed=0, numpy_random_seed=0,
                                          torch_random_seed=0, fewshot_random_seed=0,
                                          task_manager=TaskManager(include_path=tmp, include_defaults=False))
    finally:
        lm.close()
    add_paths(res, lm)
    r = res["results"][name]
    return {"task": name, **{k: step[k] for k in ("passage", "answer", "choices", "seed")},
            "questions": len(res["samples"][name]), "routing": res["dipaco"]["routing"],
            "requests_per_path": res["dipaco"]["requests_per_path"][name],
            **{m: float(r[f"{m},none"]) for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}}


def _round_rows(run: Path | None) -> list[dict]:
    keep = ("round", "val_loss_mean", "seconds", "bytes_sent")
    return [{k: r.get(k) for k in keep} for r in round_rows(run)] if run else []


def _run_info(run: Path | None) -> dict:
    f = run / "run.json" if run else None
    if not f or not f.is_file():
        return {}
    info = json.loads(f.read_text())
    return {"parameters": info.get("parameters"), "workers": info.get("workers"), "grid": info.get("grid")}


def _relative(argv: list[str] | None, out: str | None) -> list[str] | None:
    if not argv:
        return None
    return [a.replace(out, "OUT") if out else a for a in argv[1:]]  # the interpreter's path says nothing


def rounds_done(run: Path) -> int:
    if not run.is_dir():
        return 0
    from dipaco.storage import checkpoint  # (torch: only when there is a run to look at)

    return checkpoint.latest_round(run) or 0


def round_rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []
    return [r for r in rows if r.get("kind") == "round"]
