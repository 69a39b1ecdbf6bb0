"""``dipaco lm-eval``: a trained run through EleutherAI's lm-evaluation-harness (``lm_eval.simple_evaluate``), routed
per request by ``dipaco.eval.harness.DipacoLM``.

The harness's own CLI finds only the models of its own package (its registry has no entry points), so this command
is how a run reaches it from a shell; from Python, ``import dipaco.eval.harness`` registers the model as "dipaco".
The harness's flags keep their names (``--num_fewshot`` and ``--num-fewshot`` are one flag); the per-sample output
(``--log_samples``) gains ``dipaco_paths``, the path of every request, and the results ``dipaco``, the requests per
path of every task.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from dipaco.errors import DipacoError


def add_lm_eval_command(sub) -> None:
    p = sub.add_parser("lm-eval", help="downstream tasks through lm-evaluation-harness, routed per request")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", help="shard directory (router and tokenizer); default: the run's own")
    p.add_argument("--tasks", required=True, help="harness task names, comma-separated (e.g. hellaswag,arc_easy)")
    p.add_argument("--route-every", "--route_every", type=int, default=0, metavar="W",
                   help="re-route every W tokens: rolling texts as dipaco eval, generations as dipaco generate")
    p.add_argument("--path", help="score every request with this path (no routing), e.g. 0-1")
    p.add_argument("--routing", choices=["run", "shard"], default="run",
                   help="run: the run's once rule (default); shard: the shard router alone")
    p.add_argument("--rolling", choices=["dipaco", "all"], default="dipaco",
                   help="loglikelihood_rolling: dipaco scores as dipaco eval (routing context unscored); all scores "
                        "every token as the harness's hf model")
    p.add_argument("--round", type=int, help="checkpoint round (default latest)")
    p.add_argument("--max-memory", help="module memory budget, e.g. 4GB (default: half the available memory)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=32, help="requests per forward pass of a path")
    p.add_argument("--num-fewshot", "--num_fewshot", type=int, help="examples in each request's context")
    p.add_argument("--limit", type=float, help="at most this many documents per task (< 1: a fraction)")
    p.add_argument("--include-path", "--include_path", action="append", default=[], metavar="DIR",
                   help="a folder of task YAMLs (repeatable)")
    p.add_argument("--heldout-tasks", "--heldout_tasks", action="store_true",
                   help="also offer heldout_ppl, heldout_choice and heldout_gen: tasks built from the shards' "
                        "held-out documents (dipaco.eval.harness_tasks)")
    p.add_argument("--output-path", "--output_path", help="folder (or .json file) for the results")
    p.add_argument("--log-samples", "--log_samples", action="store_true", help="write every sample beside the results")
    p.add_argument("--use-cache", "--use_cache", metavar="DB", help="sqlite cache of responses (the harness's)")
    p.add_argument("--gen-kwargs", "--gen_kwargs", help="generation options for every task, e.g. temperature=0.5")
    p.add_argument("--seed", type=int, default=0, help="seed of the harness's random choices (few-shot sampling)")
    p.set_defaults(func=cmd_lm_eval)


def cmd_lm_eval(args) -> None:
    from dipaco.eval import harness  # first: the one line naming the extra when the harness is missing

    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table

    if args.log_samples and not args.output_path:
        raise DipacoError("--log_samples writes beside the results; give --output_path DIR")
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    include = [str(Path(d)) for d in args.include_path]
    for d in include:
        if not Path(d).is_dir():
            raise DipacoError(f"--include_path {d}: not a folder of task YAMLs")
    if args.quiet:
        import datasets

        datasets.disable_progress_bars()
    lm = harness.DipacoLM(run=args.run, shards=args.shards, route_every=args.route_every, path=args.path,
                          routing=args.routing, rolling=args.rolling, round=args.round, max_memory=args.max_memory,
                          batch_size=args.batch_size, progress=not args.quiet)
    try:
        with tempfile.TemporaryDirectory(prefix="dipaco-tasks-") as tmp:
            if args.heldout_tasks:
                from dipaco.eval.harness_tasks import heldout_tasks

                heldout_tasks(lm.rr.shards.root, tmp)
                include.append(tmp)
            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
            # the harness's own tasks take seconds to index: only when a task is not among the local ones
            manager = TaskManager(include_path=include, include_defaults=False) if include else None
            if manager is None or any(t not in manager.all_tasks for t in tasks):
                manager = TaskManager(include_path=include or None)
            unknown = [t for t in tasks if t not in manager.all_tasks]
            if unknown:
                raise DipacoError(f"--tasks {', '.join(unknown)}: no such harness task; list them with `lm_eval ls "
                                  f"tasks`, or give the folder of a local task with --include_path")
            tracker = EvaluationTracker(output_path=args.output_path)
            model_args = {"model": f"dipaco-{lm.run.root.resolve().name}", "run": str(lm.run.root), "path": args.path,
                          "route_every": args.route_every, "routing": args.routing, "rolling": args.rolling}
            results = lm_eval.simple_evaluate(  # log_samples always: the paths ride on the samples
                model=lm, model_args={k: v for k, v in model_args.items() if v is not None}, tasks=tasks,
                num_fewshot=args.num_fewshot, limit=limit, use_cache=args.use_cache, log_samples=True,
                gen_kwargs=args.gen_kwargs, task_manager=manager, evaluation_tracker=tracker,
                random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
                fewshot_random_seed=args.seed, verbosity="ERROR" if args.quiet else None)
    finally:
        lm.close()
    harness.add_paths(results, lm)
    samples = results.pop("samples", None)
    if args.output_path:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in (samples or {}) if args.log_samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    print(f"dipaco lm-eval: {lm.run.root} ({lm.describe()}), limit {limit}, num_fewshot {args.num_fewshot}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    for task, counts in results["dipaco"]["requests_per_path"].items():
        print(f"{task}: requests per path " + json.dumps(counts, default=handle_non_serializable), file=sys.stderr)
    for task, t in results["dipaco"]["token_perplexity"].items():
        scored = "after each text's routing context, as dipaco eval" if lm.rolling == "dipaco" else "every token"
        print(f"{task}: perplexity {t['perplexity']:.4f} per token over {t['tokens']} tokens ({scored})")
    if lm.rolling == "dipaco" and results["dipaco"]["token_perplexity"]:
        print("dipaco lm-eval: note: the word and byte perplexities above count each text's routing context, which "
              "--rolling dipaco leaves unscored; --rolling all scores every token, comparable with other models",
              file=sys.stderr)
