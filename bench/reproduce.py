"""The results page: DiPaCo against dense in the papers' regime, on two corpora; one command, resumable across sessions.

    python bench/reproduce.py [--corpus shared default] [--out reproduce-out] [--scale full|tiny] [--jobs 2]
                              [--results docs/results/jobs] [--page docs/RESULTS.md] [--readme README.md] [--report-only]
                              [--downstream]

The papers' claims live in a regime: a dense start trained far past compute-optimal, then many outer rounds. Per
corpus (the shared five-domain corpus; the default corpus `dipaco quickstart` builds, at a larger budget):

  shards   one tokenizer and one seed for every sharding (the same held-out, router and validation documents):
           k-means 2x2, 2x2 with top-2 overlap, flat k-means 4, k-means 4x4, i.i.d. (a seeded hash, 4 shards)
  start    a pilot of the pretraining peak lr (chosen on validation loss), then one dense model
  outer    a grid of outer (lr, momentum) for DiPaCo 2x2, chosen by routed perplexity on the validation documents
  rows     every row from the same start: dense at 1x and P x the steps, DiLoCo on i.i.d. and k-means shards, the flat
           mixture, DiPaCo 2x2 (chosen outer step; the papers' 0.7/0.9; path-private embedding and first and last
           blocks; top-2 overlap; after discriminative re-sharding), DiPaCo 4x4, Streaming DiLoCo in fp32 and 4 bits
  eval     held-out perplexity at the evaluated rounds (every round for dense, flat, DiPaCo 2x2 and its private
           variant); the routed rows also: once by the run's saved once rule, every-W by the rule chosen on the router
           documents (its forward passes, its one-path variant), mixture, oracles; and the same on validation documents
  report   results.json, the page, the README's results lines, plots; the headline DiPaCo row chosen on validation
  downstream  with --downstream (the eval extra): the held-out multiple-choice task (``dipaco.eval.harness_tasks``)
           through lm-evaluation-harness, routed per question, for dense, dense 4x, the flat mixture, the all-shared
           DiPaCo 2x2 and the headline row (every candidate until it is chosen); accuracy with the harness's standard
           error beside held-out perplexity of the same weights (one job per row, after it)

Every job (a training and its evaluations, or a pilot) ends by writing its durable result, a small JSON under
--results (``docs/results/jobs/<corpus>/<job>.json`` at full scale: commit them). A later invocation, in another
session, skips every job whose durable result matches its fingerprint and re-trains only what is missing (and the
start, when a missing row needs its weights: training is deterministic). ``--report-only`` writes the page from the
durable results alone, rows still missing marked "not yet run". Jobs run ``--jobs`` cores at a time, one thread each
(a 4-worker job takes 2); logs in OUT/logs/, a JSON-lines log of every job in OUT/log.jsonl. ``--scale tiny`` is
the version the test suite runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the reproduce_* modules beside this file

import reproduce_page as pages  # noqa: E402
from reproduce_corpus import DEFAULT_DATA, ROOT, SCALES, Corpus  # noqa: E402
from reproduce_jobs import plan, run_jobs, unit_child, valid  # noqa: E402
from reproduce_report import collect, results_json  # noqa: E402


def arguments(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--corpus", nargs="+", default=["shared", "default"], choices=["shared", "default"])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="the shared corpus (directory of *.jsonl[.gz] or one file); with --corpus default and a file, "
                        "that file replaces the machine's default corpus (tests)")
    p.add_argument("--out", type=Path, default=Path("reproduce-out"), help="work directory: shards and runs (re-running resumes)")
    p.add_argument("--scale", choices=list(SCALES), default="full")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cores to keep busy")
    p.add_argument("--results", type=Path, help="durable job results (default: docs/results/jobs at full scale, "
                                                "OUT/jobs otherwise)")
    p.add_argument("--page", type=Path, help="write the page (docs/RESULTS.md), its plots and results.json beside it")
    p.add_argument("--readme", type=Path, help="replace the results lines between <!-- results:begin --> and <!-- results:end --> "
                                               "(default: README.md when --page is docs/RESULTS.md)")
    p.add_argument("--report-only", action="store_true", help="write the report from the durable results alone; run nothing")
    p.add_argument("--downstream", action="store_true", help="also the held-out multiple-choice task through "
                   "lm-evaluation-harness for the rows of reproduce_corpus.DOWNSTREAM and the headline row (the eval extra)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give at least 1 core")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_unit"]:
        unit_child(json.loads(argv[1]))
        return 0
    args = arguments(argv)
    s = SCALES[args.scale]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = (args.results or (ROOT / "docs" / "results" / "jobs" if args.scale == "full" else out / "jobs")).resolve()
    log_file = out / "log.jsonl"

    def log(event: dict) -> None:
        with open(log_file, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 1), **event}) + "\n")

    corpora = [Corpus(name, out, s, args.data, results) for name in args.corpus]
    for c in corpora:
        c.downstream = args.downstream
    every = [j for c in corpora for j in c.jobs()]
    todo = plan(every, results, out)  # pure: reads the durable results, computes fingerprints
    log({"event": "plan", "jobs": len(every), "to_run": [j.key for j in todo], "results": str(results),
         "report_only": args.report_only})
    if not args.report_only:
        print(f"[jobs] {len(todo)} to run of {len(every)} ({len(every) - len(todo)} with durable results in {results}); "
              f"{args.jobs} cores; logs in {out / 'logs'}", flush=True)
        for c in corpora:
            mine = [j.name for j in todo if j.corpus == c.name]
            if mine:  # only the shardings the jobs to run read (a new session re-trains few)
                c.make_shards(c.shards_needed(mine))
        run_jobs(todo, every, args.jobs, results, out, out / "logs", log)
        todo = plan(every, results, out)  # what is left (nothing, unless a job did not write its result)
    for c in corpora:  # the report reads only the results that match their job's fingerprint
        c.valid = valid(every, results).get(c.name, {})
    report(corpora, s, args, out)
    log({"event": "report", "report_only": args.report_only})
    return 0


def report(corpora: list[Corpus], s, args: argparse.Namespace, out: Path) -> dict:
    """results.json, RESULTS.md and plots in OUT (and beside --page), the README's lines; a summary on stdout."""
    collected = {c.name: collect(c) for c in corpora}
    res = results_json(corpora, collected, args.scale, s)
    page_dir = args.page.resolve().parent / "results" if args.page else None
    pictures = {}
    for name, r in collected.items():
        files = pages.plots(name, r, out)
        if page_dir:
            page_dir.mkdir(parents=True, exist_ok=True)
            for f in files.values():
                shutil.copy(out / f, page_dir / f)
        pictures[name] = {k: ("results/" if page_dir else "") + v for k, v in files.items()}
    command = "python bench/reproduce.py" + ("" if args.scale == "full" else f" --scale {args.scale}")
    text = pages.page(res, s, pictures, command + (f" --page {args.page}" if args.page else ""))
    (out / "results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    (out / "RESULTS.md").write_text(text)
    if args.page:
        shutil.copy(out / "results.json", page_dir / "results.json")
        args.page.write_text(text)
    readme = args.readme
    if readme is None and args.page and args.page.resolve() == ROOT / "docs" / "RESULTS.md":
        readme = ROOT / "README.md"
    if readme is not None and not pages.write_readme(readme, pages.readme_lines(res)):
        print(f"reproduce: {readme} has no {pages.README_BEGIN} ... {pages.README_END} markers; its results lines were "
              f"not written (add the two markers where they belong)", file=sys.stderr)
    checked = [e for e in res["expectations"] if e["held"] is not None]
    missing = sum(len(v) for v in res["missing"].values())
    silent = len(res["expectations"]) - len(checked)
    print(f"expectations held: {sum(e['held'] for e in checked)} of {len(checked)} checked ({silent} without a verdict: "
          f"not yet run or not measured); rows not yet run: {missing}; wrote {out / 'results.json'}"
          + (f" and {args.page}" if args.page else ""))
    return res


if __name__ == "__main__":
    sys.exit(main())
