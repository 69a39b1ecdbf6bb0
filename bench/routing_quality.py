"""Routing quality under the quickstart protocol: is the router that shards the one that answers well?

    python bench/routing_quality.py [--corpus shared default fresh] [--seed 0 1 2] [--out bench/out/routing_quality] [--jobs 2]

For each corpus (the shared five-domain corpus, the default corpus `dipaco quickstart` builds from the machine,
and a fresh four-domain corpus from other files on the machine, ``bench/fresh_corpus.py``), with the settings the
quickstart had until 2026-12-07 (grid 2x2, --balance 1.1, vocabulary 4096, the tiny path, 16 rounds x 50 inner steps, from scratch):

  1. shard twice with the run's seed (so one tokenizer and the same held-out, router and validation documents):
     k-means on the routing prefix (``cluster_on=prefix``), and k-means on whole-document features
     learned back from the prefix (``cluster_on=document``); both route by the first 32 tokens
  2. train DiPaCo 2x2 on each, and one dense model with the same inner steps as one path
  3. choose the variant by routed perplexity on the *validation* documents (never the held-out ones); each
     variant routes once by the rule its router documents choose (``dipaco.eval.once_policy``)
  4. ``dipaco choose-routing`` (the once rule, saved) and ``dipaco fit-window-router`` for W = 64 on the chosen
     variant: the window router on the router documents, the every-64 rule chosen on them too
  5. score the held-out documents: routed once (the chosen rule), the shard router alone, oracle, random, every-64
     with the chosen rule (and, for the record, every other rule), the window oracle and its cross-fitted version
     (chosen on half of each chunk's targets, scored on the other half), and the dense model (every row on the same
     tokens)

It prints per corpus: the once rule, routed once / oracle (and the shard router's), DiPaCo vs dense, the every-64
rule and every-64 vs once, the window oracles, and, for a corpus measured under several seeds (``--seed``: the
sharding splits and k-means, initialisation and data order; the corpus stays the same), every-64 vs once for each.
Everything goes to OUT/routing_quality.json and bench/routing_quality_results.json, where the results of other
corpora and seeds already there are kept. Re-running resumes: finished shards, runs and reports are reused (delete
OUT/<corpus>/reports and the runs' routing/ and window_routers/ folders to choose and score again). Training runs
as `--jobs` processes at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_corpus import input_files  # noqa: E402
from reproduce_jobs import Command as Job, rounds_done, run_commands as run_jobs  # noqa: E402
from shared_corpus import SHARED_CORPUS as DEFAULT_DATA  # noqa: E402

ROUNDS, H, W = 16, 50, 64
SHARD_SETS = ["grid=\"2x2\"", "tokenizer.vocab_size=4096", "routing.balance=1.1",
              # router documents for the window router: the paper keeps 0.5% of a corpus far larger than these
              "data.router_fraction=0.02"]
VARIANTS = ("prefix", "document")


def corpus_inputs(name: str, work: Path, data: Path) -> list[str]:
    """The corpus files; ``work`` is the seed-0 folder, where the built corpora live (every seed reads the same)."""
    if name == "fresh":  # four domains from files on this machine that dipaco was never tuned on
        from fresh_corpus import build

        path = work / "corpus.jsonl"
        if not path.is_file():
            build(path, 1_500_000)
        return [str(path)]
    if name == "shared":
        if not data.exists():
            raise SystemExit(f"routing_quality: corpus {data} not found; pass --data or set DIPACO_CORPUS")
        return [str(f) for f in input_files(data)]
    from dipaco.sharding.sources import write_default_corpus

    path = work / "corpus.jsonl"
    if not path.is_file():
        write_default_corpus(path)  # exactly what `dipaco quickstart` builds
    return [str(path)]


def make_shards(inputs: list[str], work: Path, seed: int) -> dict[str, Path]:
    from dipaco.config import resolve
    from dipaco.shard_config import ShardConfig
    from dipaco.sharding.writer import shard

    dirs = {v: work / f"shards-{v}" for v in VARIANTS}
    for v, d in dirs.items():
        if not (d / "manifest.json").is_file():
            print(f"[shard] {d}")
            cfg = resolve(ShardConfig, overrides=SHARD_SETS + [f'routing.cluster_on="{v}"', f"seed={seed}"])
            shard(inputs, cfg, d, progress=True)
    return dirs


def train_job(name: str, shards: Path, run: Path, seed: int, *sets: str) -> Job | None:
    if rounds_done(run) >= ROUNDS:
        return None
    argv = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(run), "--quiet",
            "--rounds", str(ROUNDS), "--inner-steps", str(H), "--preset", "tiny", "--set", f"seed={seed}"]
    for kv in sets:
        argv += ["--set", kv]
    if (run / "checkpoints").is_dir():
        argv.append("--resume")
    return Job(name, argv)


def cached_eval(out: Path, **kwargs) -> dict:
    from dipaco.eval.perplexity import evaluate
    from dipaco.io import write_json

    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, evaluate(progress=False, **kwargs))
    return json.loads(out.read_text())


def work_dir(out: Path, name: str, seed: int) -> Path:
    return out / name if seed == 0 else out / f"{name}-seed{seed}"


def one_corpus(name: str, out: Path, data: Path, jobs: int, seed: int = 0) -> dict:
    from dipaco.eval.once_policy import save_once_policy
    from dipaco.eval.window_router import fit_window_router
    from dipaco.storage.shards import ShardSet

    began = time.perf_counter()
    work = work_dir(out, name, seed)
    work.mkdir(parents=True, exist_ok=True)
    (out / name).mkdir(parents=True, exist_ok=True)
    inputs = corpus_inputs(name, out / name, data)
    shards = make_shards(inputs, work, seed)
    runs = {v: work / "runs" / f"dipaco-{v}" for v in VARIANTS} | {"dense": work / "runs" / "dense"}
    todo = [train_job(f"{name}-dipaco-{v}", shards[v], runs[v], seed) for v in VARIANTS]
    todo.append(train_job(f"{name}-dense", shards["prefix"], runs["dense"], seed, 'grid.shape="1"'))
    todo = [j for j in todo if j is not None]
    if todo:
        print(f"[train] {', '.join(j.name for j in todo)}, {jobs} at a time; logs in {work / 'logs'}")
        run_jobs(todo, jobs, work / "logs", lambda n: n)

    reports = work / "reports"
    val = {v: cached_eval(reports / f"val-{v}.json", runs={"dipaco": runs[v]}, shards_dir=shards[v], split="val",
                          baseline=runs["dense"], oracle=True) for v in VARIANTS}
    val_ppl = {v: val[v]["methods"]["dipaco"]["perplexity"] for v in VARIANTS}
    chosen = min(VARIANTS, key=val_ppl.get)
    print(f"[choose] routed validation perplexity: " + ", ".join(f"{v} {p:.2f}" for v, p in val_ppl.items())
          + f" -> cluster_on={chosen}")

    # every-64: the rule fit-window-router chooses on the router documents, scored on the held-out ones (one
    # evaluation of the chosen variant gives every row: its paths score each held-out window once)
    # routing once: the rule chosen on the router documents (dipaco choose-routing), saved before the every-W rule
    # is chosen, so that chunk 0 and "stay" follow it
    once_file = runs[chosen] / "routing" / "once.json"
    if not once_file.is_file():
        once = save_once_policy(runs[chosen], shards[chosen], progress=False)
        print(f"[once] routing once uses {once['name']}: {once['reason']}")
    once = json.loads(once_file.read_text())
    window_dir = runs[chosen] / "window_routers" / f"w{W}"
    if not (window_dir / "policy.json").is_file():
        print(f"[window] fitting the every-{W} router of {runs[chosen]} and choosing its rule on the router documents")
        rep = fit_window_router(runs[chosen], shards[chosen], W, progress=False, overwrite=window_dir.exists())
        if rep.get("warning"):
            print(f"[window] warning: {rep['warning']}")
    window_info = json.loads((window_dir / "router.json").read_text()) if (window_dir / "router.json").is_file() else {}
    policy = json.loads((window_dir / "policy.json").read_text())
    test = {v: cached_eval(reports / f"heldout-{v}-every{W}.json", runs={"dipaco": runs[v]}, shards_dir=shards[v],
                           baseline=runs["dense"], oracle=True, random=True, route_every=[W]) if v == chosen else
            cached_eval(reports / f"heldout-{v}-once.json", runs={"dipaco": runs[v]}, shards_dir=shards[v]) for v in VARIANTS}
    test_window = test[chosen]

    m = test[chosen]["methods"]
    routed, oracle, dense = m["dipaco"]["perplexity"], m["dipaco oracle"]["perplexity"], m["dense baseline"]["perplexity"]
    every = test_window["methods"][f"dipaco every-{W}"]
    window_oracle = test_window["methods"][f"dipaco window-oracle-{W}"]["perplexity"]
    crossed = {k: test_window["methods"][f"dipaco {k} cross-fitted"]["perplexity"] for k in (f"window-oracle-{W}", "oracle")}
    manifest = ShardSet(shards[chosen]).manifest
    shard_routed = m["dipaco shard-router"]["perplexity"] if "dipaco shard-router" in m else routed
    figures = {
        "routed_over_oracle": routed / oracle,
        "shard_router_over_oracle": shard_routed / oracle,
        "routed_vs_oracle_pct": 100 * (routed / oracle - 1),
        "dipaco_vs_dense_pct": 100 * (routed / dense - 1),
        f"every{W}_vs_once_pct": 100 * (every["perplexity"] / routed - 1),
        f"window_oracle{W}_vs_once_pct": 100 * (window_oracle / routed - 1),
        f"window_oracle{W}_cross_fitted_vs_once_pct": 100 * (crossed[f"window-oracle-{W}"] / routed - 1),
        "oracle_vs_once_pct": 100 * (oracle / routed - 1),
        f"every{W}_vs_oracle_pct": 100 * (every["perplexity"] / oracle - 1),
    }
    return {
        "corpus": name, "seed": seed, "inputs": inputs, "chosen": chosen, "figures": figures,
        "heldout": {"documents": test[chosen]["documents"], "scored_tokens": m["dipaco"]["tokens"],
                    "routed": routed, "once_rule": once["name"], "shard_router": shard_routed, "oracle": oracle, "random": m["dipaco random"]["perplexity"], "dense": dense,
                    f"every{W}": every["perplexity"], f"every{W}_rule": policy["name"], f"window_oracle{W}": window_oracle,
                    f"window_oracle{W}_cross_fitted": crossed[f"window-oracle-{W}"], "oracle_cross_fitted": crossed["oracle"],
                    f"every{W}_every_rule": every.get("every_rule_here"),
                    "other_variant_routed": test[[v for v in VARIANTS if v != chosen][0]]["methods"]["dipaco"]["perplexity"],
                    "per_label": {k: v["perplexity"] for k, v in m["dipaco"].get("per_label", {}).items()},
                    "dense_per_label": {k: v["perplexity"] for k, v in m["dense baseline"].get("per_label", {}).items()}},
        "validation": {v: {"routed": val[v]["methods"]["dipaco"]["perplexity"],
                           "once_rule": val[v]["methods"]["dipaco"].get("once_policy", {}).get("name"),
                           "shard_router": val[v]["methods"].get("dipaco shard-router", val[v]["methods"]["dipaco"])["perplexity"],
                           "oracle": val[v]["methods"]["dipaco oracle"]["perplexity"],
                           "dense": val[v]["methods"]["dense baseline"]["perplexity"], "documents": val[v]["documents"]}
                       for v in VARIANTS},
        "once_policy": once,
        f"every{W}_policy": policy,
        "window_router": {k: window_info.get(k) for k in ("examples", "test_examples", "accuracy",
                                                           "accuracy_shard_router_previous_tokens", "accuracy_document_path",
                                                           "loss_window_router", "loss_shard_router_previous_tokens",
                                                           "loss_document_path", "loss_oracle")},
        "shards": {v: {"route_agreement": ShardSet(shards[v]).manifest["route_agreement"],
                       "purity": ShardSet(shards[v]).manifest["purity"],
                       "path_docs": {p: s["train_docs"] + s["val_docs"] for p, s in ShardSet(shards[v]).manifest["paths"].items()}}
                   for v in VARIANTS},
        "router_documents": manifest["router_documents"],
        "seconds_this_invocation": round(time.perf_counter() - began, 1),
    }


def table(results: list[dict]) -> str:
    lines = ["| corpus | variant (val) | once rule (router docs) | routed once | shard router | oracle | once / oracle "
             "| shard router / oracle | dense | DiPaCo vs dense | every-64 rule (router docs) | every-64 | vs once | window oracle-64 "
             "| cross-fitted | random |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        h, f = r["heldout"], r["figures"]
        lines.append(f"| {r['corpus']}{'' if not r.get('seed') else ' seed ' + str(r['seed'])} | {r['chosen']} | {h['once_rule']} | {h['routed']:.2f} | {h['shard_router']:.2f} "
                     f"| {h['oracle']:.2f} | {f['routed_over_oracle']:.3f} | {f['shard_router_over_oracle']:.3f} "
                     f"| {h['dense']:.2f} | {f['dipaco_vs_dense_pct']:+.1f}% | {h[f'every{W}_rule']} | {h[f'every{W}']:.2f} "
                     f"| {f[f'every{W}_vs_once_pct']:+.1f}% | {h[f'window_oracle{W}']:.2f} | {h[f'window_oracle{W}_cross_fitted']:.2f} "
                     f"| {h['random']:.2f} |")
    return "\n".join(lines)


def seeds_table(results: list[dict]) -> str:
    """Every-64 vs once for each seed of a corpus measured under more than one seed: the spread next to the difference."""
    lines = ["| corpus | seeds | every-64 vs once, each seed | mean | once / oracle, each seed | every-64 / oracle, each seed "
             "| document oracle vs once |",
             "| --- | ---: | --- | ---: | --- | --- | --- |"]
    for corpus in dict.fromkeys(r["corpus"] for r in results):
        rs = sorted((r for r in results if r["corpus"] == corpus), key=lambda r: r.get("seed", 0))
        if len(rs) < 2:
            continue
        gains = [r["figures"][f"every{W}_vs_once_pct"] for r in rs]
        lines.append(f"| {corpus} | {', '.join(str(r.get('seed', 0)) for r in rs)} | "
                     + ", ".join(f"{g:+.1f}%" for g in gains) + f" | {sum(gains) / len(gains):+.2f}% | "
                     + ", ".join(f"{r['figures']['routed_over_oracle']:.3f}" for r in rs) + " | "
                     + ", ".join(f"{r['heldout'][f'every{W}'] / r['heldout']['oracle']:.3f}" for r in rs) + " | "
                     + ", ".join(f"{100 * (r['heldout']['oracle'] / r['heldout']['routed'] - 1):+.1f}%" for r in rs) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def merged(path: Path, protocol: dict, results: list[dict]) -> dict:
    """The summary at ``path`` with these results in place of earlier ones for the same (corpus, seed); other
    corpora, seeds and notes that an earlier invocation (or a person) left there are kept."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    key = lambda r: (r["corpus"], r.get("seed", 0))  # noqa: E731
    new = {key(r) for r in results}
    kept = [r for r in old.get("results", []) if key(r) not in new]
    order = {c: i for i, c in enumerate(("shared", "default", "fresh"))}
    return old | {"protocol": old.get("protocol", {}) | protocol,
                  "results": sorted(kept + results, key=lambda r: (order.get(r["corpus"], 9), r.get("seed", 0)))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--corpus", nargs="+", default=["shared", "default", "fresh"], choices=["shared", "default", "fresh"],
                   help="run several invocations with one corpus each to use more cores (each has its own folder)")
    p.add_argument("--seed", nargs="+", type=int, default=[0],
                   help="seeds of the whole protocol (sharding splits and k-means, initialisation, data order); seed 0 "
                        "works in OUT/<corpus>, seed k in OUT/<corpus>-seed<k>; the corpus itself is the same")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared corpus (directory of *.jsonl[.gz])")
    p.add_argument("--out", type=Path, default=Path("bench/out/routing_quality"))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "routing_quality_results.json",
                   help="where the summary goes (besides OUT/routing_quality.json); results of other corpora and "
                        "seeds already there are kept")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    out = args.out.resolve()
    protocol = {"grid": "2x2", "balance": 1.1, "vocab": 4096, "preset": "tiny", "rounds": ROUNDS, "inner_steps": H,
                "window": W, "shard_settings": SHARD_SETS,
                "choice": "cluster_on by routed perplexity on the validation documents",
                "once_rule": "chosen on the router documents (dipaco choose-routing; eval/once_policy.py)",
                "every_w_rule": "chosen on the router documents, window-router rules out of fold (dipaco fit-window-router)",
                "seeds": "seed k sets the sharding seed (splits, samples, k-means) and the training seed"}
    results = []
    for corpus in args.corpus:
        for seed in args.seed:
            results.append(one_corpus(corpus, out, args.data, args.jobs, seed))
            for f in (out / "routing_quality.json", args.json):  # after each, so an interrupted invocation keeps it
                summary = merged(f, protocol, results)
                f.write_text(json.dumps(summary, indent=1) + "\n")
    print()
    print(table(results))
    spread = seeds_table(summary["results"])
    if spread:
        print("\nacross seeds (every result in " + str(args.json) + "):\n" + spread)
    print(f"\nwrote {out / 'routing_quality.json'} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
