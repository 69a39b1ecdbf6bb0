"""``dipaco quickstart``: the whole pipeline on an embedded default corpus, offline, in minutes.

Builds a corpus from text that ships with Python (and common Unix files where present), shards it on
a 2x2 grid, trains DiPaCo and the dense baseline with the same inner steps per trainee, evaluates
both on the same held-out tokens and prints the table. Re-running continues where it stopped.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import dipaco
from dipaco.config import TrainConfig, resolve
from dipaco.shard_config import ShardConfig
from dipaco.eval.perplexity import evaluate
from dipaco.eval.report import markdown_table, write_report
from dipaco.io import write_json
from dipaco.sharding.sources import write_default_corpus
from dipaco.sharding.writer import purity, shard
from dipaco.storage import checkpoint
from dipaco.storage.outputs import QUICKSTART_MARKER, check_out_dir
from dipaco.storage.shards import MANIFEST, ShardSet
from dipaco.training.train import train


def _resume(cfg: TrainConfig, run: Path) -> bool | None:
    """Whether to resume the run (False: start it); None: it is trained (reused)."""
    done = checkpoint.latest_round(run) if run.exists() else None
    if done is not None and done >= cfg.rounds:
        print(f"  {run} already trained ({done} rounds), reusing it")
        return None
    return done is not None


def _train_side_by_side(cfgs: dict[str, TrainConfig], runs: dict, shards: Path, progress: bool,
                        here: str = "dipaco-2x2") -> None:
    """Every run at once: run ``here`` in this process, its phases in one worker process per core, and each other run
    (the dense baseline: one trainee, one core) in a process of its own beside it, so no core waits for another run;
    each run's numbers are the same as trained alone."""
    for name, (run, _) in runs.items():
        print(f"[3/4] train {name} -> {run}" + (" (beside)" if name != here else ""))
    todo = {name: resume for name, (run, _) in runs.items() if (resume := _resume(cfgs[name], run)) is not None}
    others = [name for name in todo if name != here]
    with ProcessPoolExecutor(max_workers=max(1, len(others)), mp_context=multiprocessing.get_context("spawn")) as side:
        beside = [side.submit(train, cfgs[name], shards, runs[name][0], todo[name], False, 1) for name in others]
        if here in todo:
            train(cfgs[here], shards, runs[here][0], resume=todo[here], progress=progress, workers=None)
        for future in beside:
            future.result()


def quickstart(out: str | Path = "dipaco-quickstart", rounds: int = 8, inner_steps: int = 50, preset: str = "tiny",
               overrides: list[str] = (), progress: bool = True, budget_per_kind: int = 1_500_000) -> dict:
    began, out = time.perf_counter(), Path(out)
    # every setting and the output directory are checked before the corpus is built: bad input fails in a second
    # a small vocabulary: in the tiny preset the output layer and its softmax are most of a step's compute
    shard_cfg = resolve(ShardConfig, overrides=["grid=\"2x2\"", "tokenizer.vocab_size=2048", "routing.balance=1.1"])
    flags = {"preset": preset, "rounds": rounds, "inner_steps": inner_steps}
    runs = {"dipaco-2x2": (out / "runs" / "dipaco-2x2", []), "dense": (out / "runs" / "dense", ["grid.shape=\"1\""])}
    cfgs = {name: resolve(TrainConfig, overrides=list(overrides) + extra, flags=flags) for name, (_, extra) in runs.items()}
    check_out_dir(out, "quickstart")  # new, empty, or a quickstart directory (re-running continues there)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / QUICKSTART_MARKER).exists():
        write_json(out / QUICKSTART_MARKER, {"format": "dipaco-quickstart", "dipaco_version": dipaco.__version__})
    corpus, shards = out / "corpus.jsonl", out / "shards"

    print(f"[1/4] default corpus -> {corpus}")
    if not corpus.exists():
        counts = write_default_corpus(corpus, budget_per_kind)
        print("  documents per kind: " + ", ".join(f"{k} {n}" for k, n in counts.items()))

    print(f"[2/4] shard on a 2x2 grid -> {shards}")
    if not (shards / MANIFEST).exists():
        manifest = shard([str(corpus)], shard_cfg, shards, progress=progress)
    else:
        manifest = ShardSet(shards).manifest
    sizes = ", ".join(f"{p}: {s['train_docs']} docs" for p, s in manifest["paths"].items())
    print(f"  paths: {sizes}; label purity {purity(manifest['labels_per_path'])['overall']:.2f}")

    _train_side_by_side(cfgs, runs, shards, progress)

    print(f"[4/4] evaluate on the held-out documents -> {out / 'report.json'}")
    report = evaluate({name: run for name, (run, _) in runs.items()}, shards, progress=progress)
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    files = write_report(report, out / "report.json")
    print()
    print(markdown_table(report))
    print(f"\nwall time {report['wall_seconds']:.0f} s; outputs in {out}/ (report: {files['markdown']}, plot: {files['plot']})")
    print(f"next: dipaco generate --run {runs['dipaco-2x2'][0]} \"def main():\", or serve it over OpenAI's API with "
          f"dipaco serve --run {runs['dipaco-2x2'][0]} (pip install -e '.[serve]'; docs/serving.md)")
    return report
