"""``dipaco <command>``: one thin subcommand per stage. Errors in the input exit with code 2 and one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dipaco import command_config as CC, config as C, shard_config as S
from dipaco.cli.flags import Parser, add_flags, config_args, flags_of, set_arg
from dipaco.cli.lm_eval_command import add_lm_eval_command
from dipaco.cli.serve import add_serve_command
from dipaco.errors import DipacoError
from dipaco.storage.objects import Storage, is_url
from dipaco.storage.outputs import check_out_dir, check_out_file, check_writable, os_error_line
from dipaco.taskqueue.ray_cluster import ClusterUnreachable
from dipaco.taskqueue.runstore import local_shards, pull_run
from dipaco.taskqueue.supervise import LOST
from dipaco.training.trackers import log_eval_report


def _resolve(args, cls):
    return C.resolve(cls, args.config, args.overrides, flags_of(args))


def cmd_shard(args) -> None:
    from dipaco.sharding.writer import purity, shard

    cfg = _resolve(args, S.ShardConfig)
    check_out_dir(args.out, "shards", inputs={"--data": args.data, "--tokenizer": args.tokenizer, "--config": args.config,
                                              "--feature-model": cfg.routing.feature_model}, overwrite=args.overwrite)
    manifest = shard(args.data, cfg, args.out, args.tokenizer, args.overwrite, progress=not args.quiet,
                     engine=args.engine, address=args.address, resume=args.resume)
    print(f"wrote {args.out} in {manifest['seconds']:.1f} s: {manifest['train_documents']} training, "
          f"{manifest['heldout_documents']} held-out and {manifest['router_documents']} router documents on grid "
          f"{manifest['grid']}, vocabulary {manifest['vocab_size']}; dropped {manifest['dropped']}, "
          f"truncated {manifest['truncated']}, invalid UTF-8 replaced in {manifest['invalid_utf8']}")
    skipped = manifest["skipped_files"]
    if skipped["count"]:
        print(f"skipped {skipped['count']} files of unknown type in the --data directories (e.g. "
              f"{', '.join(skipped['examples'][:3])}); manifest.json counts them under skipped_files")
    print_paths(manifest)
    pur = purity(manifest["labels_per_path"])["overall"]
    if pur is not None:
        print(f"label purity of the paths: {pur:.3f}")
    agree = manifest["route_agreement"]
    if agree["heldout"] is not None:
        print(f"routing: the frozen router gives {agree['heldout']:.1%} of the {agree['heldout_documents']} held-out documents "
              f"the path the shard stage chose")


def print_paths(manifest: dict) -> None:
    """The per-path table with a text histogram of path sizes (printed with or without --balance)."""
    sizes = {p: s["train_docs"] + s["val_docs"] for p, s in manifest["paths"].items()}
    biggest = max(sizes.values()) or 1
    print("| path | train docs | train tokens | val docs | val tokens | top label | size |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for p, s in manifest["paths"].items():
        labels = manifest["labels_per_path"].get(p) or {}
        top = max(labels, key=labels.get) if labels else "-"
        bar = "#" * max(1 if sizes[p] else 0, round(30 * sizes[p] / biggest))
        print(f"| {p} | {s['train_docs']} | {s['train_tokens']} | {s['val_docs']} | {s['val_tokens']} | {top} | {bar} |")
    h = manifest.get("path_sizes") or {}
    a = manifest.get("assignment") or {}
    if h:
        print(f"path sizes (documents): min {h['min']}, max {h['max']}, mean {h['mean']}, max/mean {h['max_over_mean']}, "
              f"cv {h['cv']}" + (f"; balance {a['balance']}: largest path at {a['shares']['max_over_mean']} x the mean share "
                                  f"of training documents" if a.get("balance") else "")
              + (f"; overlap {a['overlap']}: {a['overlap_copies']} extra copies" if a.get("overlap", 1) > 1 else ""))


def cmd_reshard(args) -> None:
    from dipaco.sharding.reshard import reshard

    cfg = _resolve(args, CC.ReshardConfig)
    check_out_dir(args.out, "shards", inputs={"--run": args.run, "--shards": args.shards}, overwrite=args.overwrite)
    report = reshard(args.run, args.shards, args.out, target=cfg.target, holdout_fraction=cfg.holdout_fraction,
                     max_tokens=cfg.max_tokens, seed=cfg.seed, at_round=cfg.round, overwrite=args.overwrite,
                     progress=not args.quiet)
    print(f"wrote {args.out}: {report['moved_share']:.1%} of {report['documents']} documents moved to another path")
    print(f"router accuracy against the loss labels on {report['test_documents']} held-out router documents: "
          f"discriminative {report['accuracy']:.3f}, k-means {report['kmeans_accuracy']:.3f}; "
          f"mean loss of the chosen path {report['mean_loss_assigned_discriminative']:.4f} vs k-means "
          f"{report['mean_loss_assigned_kmeans']:.4f} (oracle {report['mean_loss_oracle']:.4f})")


def cmd_inspect(args) -> None:
    from dipaco.sharding.inspect_shards import format_summary, inspect

    png = None
    if args.png is not None:  # the plot only when asked for: inspecting never writes into the current directory
        png = Path(args.png)
        if png.is_dir():  # a folder gets the default name inside it
            png = png / f"{Path(args.shards).resolve().name}-paths.png"
        if png.suffix.lower() != ".png":
            raise DipacoError(f"--png {args.png}: the plot is a PNG; give a file name ending in .png, or a directory")
        check_out_file(png, "--png")
    summary = inspect(args.shards, png, args.terms)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))


def cmd_train(args) -> int | None:
    from dipaco.cli.train_engines import engine_for
    from dipaco.taskqueue.lease import only_a_lease

    cfg = _resolve(args, C.TrainConfig)
    for flag, value in (("--workers", args.workers), ("--num-proc", args.num_proc)):
        if value is not None and value < 1:  # 0 too: it is not "no workers", it is nonsense
            raise DipacoError(f"{flag} must be >= 1, got {value}")
    if args.num_proc is not None and (args.workers or cfg.engine == "ray"):
        raise DipacoError("--num-proc sets the local engine's worker processes; with "
                          f"{'--workers (torchrun)' if args.workers else '--engine ray'} drop it")
    remote = is_url(args.out)
    if remote and cfg.engine != "ray":
        raise DipacoError(f"--out {args.out}: a run in object storage is trained by the task queue; add --engine ray "
                          f"(or train into a local --out)")
    if os.environ.get("RANK", "0") == "0" and not remote and not only_a_lease(args.out):  # rank 0 alone writes the run
        # --out is a new or empty directory or a dipaco run (train decides about --resume), never an input
        check_out_dir(args.out, "run", inputs={"--shards": args.shards, "--init-from": cfg.init_from,
                                               "--config": args.config})
    ours = {"lease.json", "queue", "config.toml", "run.json", "metrics.jsonl", "checkpoints"}  # a run's names
    if remote and (found := sorted(set(Storage(args.out).list("")) - ours)) and not Storage(args.out).exists("run.json"):
        raise DipacoError(f"--out {args.out} holds objects dipaco did not write ({', '.join(found[:3])}"
                          f"{' ...' if len(found) > 3 else ''}); choose a new or empty prefix")
    if args.resume and not Storage(args.out).exists("run.json"):
        raise DipacoError(f"--resume: {args.out} holds no run (no run.json); drop --resume to start a new run there")
    result = engine_for(cfg, args).run(cfg, args)
    if isinstance(result, dict) and os.environ.get("RANK", "0") == "0":
        print(json.dumps(result))
    return result if isinstance(result, int) else None


def cmd_eval(args) -> None:
    from dipaco.eval.once_policy import once_notice
    from dipaco.eval.perplexity import evaluate
    from dipaco.eval.report import beside, markdown_table, write_report

    cfg = _resolve(args, CC.EvalCommandConfig)
    out = Path(args.out)
    if out.suffix.lower() != ".json" and not out.is_dir():
        raise DipacoError(f"--out {out}: the report is JSON; give a file name ending in .json (report.md and plots go beside it)")
    check_out_file(out, "--out", beside(out))
    runs = {}
    for spec in args.run:
        name, _, path = spec.rpartition("=")
        runs[name or path.rstrip("/").split("/")[-1]] = str(pull_run(path))  # a run in a bucket: its local copy
    report = evaluate(runs, local_shards(args.shards), cfg.round, progress=not args.quiet, baseline=cfg.baseline or None,
                      route_every=cfg.route_every, oracle=cfg.oracle, random=cfg.random,
                      early_stopping=cfg.early_stopping, mixture=cfg.mixture or 0, temperature=cfg.temperature,
                      seed=cfg.seed, split=cfg.split)
    for row in report["methods"].values():  # a run without a once rule got one chosen (and saved) just now
        if notice := once_notice(row["run"], row.get("once_policy", {})):
            print(f"dipaco eval: note: {notice}", file=sys.stderr)
    files = write_report(report, args.out)
    log_eval_report(report, cfg.log)  # --log-to: the table also goes to the tracker run of every run it scored
    print(markdown_table(report))
    print("\nwrote " + ", ".join(files.values()))


def cmd_generate(args) -> None:
    from dipaco.eval.api import load
    from dipaco.eval.generate import generate
    from dipaco.eval.once_policy import once_notice

    cfg = _resolve(args, CC.GenerateConfig)
    # every prompt given, in this order: the positional words (one prompt), each --prompt, each line of --prompts-file
    prompts = ([" ".join(args.words)] if args.words else []) + args.prompt
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        raise DipacoError("no prompt given; pass a prompt as an argument, --prompt TEXT or --prompts-file FILE "
                          "(one prompt a line)")
    rr = load(pull_run(args.run), local_shards(args.shards), progress=not args.quiet)
    for n, prompt in enumerate(prompts):
        g = generate(rr, prompt, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                     seed=cfg.seed, round=cfg.round, mixture=cfg.mixture or 0, mixture_temperature=cfg.mixture_temperature,
                     path=rr.check_path(cfg.path) if cfg.path else None, route_every=cfg.route_every)
        if g.segments and len(g.segments) > 1:
            paths = " -> ".join(f"{p} ({n} tokens)" for p, n in g.segments)
        else:
            paths = ", ".join(p if len(g.paths) == 1 else f"{p} (w={w:.3f})" for p, w in g.paths)
        if g.prompt_cut:
            print(f"# the prompt is longer than the model's {g.max_seq_len} tokens: kept its last {g.prompt_tokens} "
                  f"tokens ({g.prompt_cut} dropped); routing still read its first tokens", file=sys.stderr)
        if n == 0 and rr.once_chosen_now:  # the run had no once rule: say which was chosen, and where it was saved
            print(f"# {once_notice(rr.run.root, rr.once_chosen_now)}", file=sys.stderr)
        print(f"# routing: {g.router}", file=sys.stderr)
        print(f"# path {paths}: loaded {g.bytes_loaded / 1e6:.2f} MB of {g.bytes_total / 1e6:.2f} MB "
              f"({100 * g.bytes_loaded / g.bytes_total:.0f}% of the model), {g.new_tokens} new tokens", file=sys.stderr)
        print(prompt + g.text)
        if len(prompts) > 1:
            print()


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file; anything else is one clear line."""
    from dipaco.sharding.readers import sniff_binary

    hint = "give a UTF-8 text file, one prompt a line"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DipacoError(f"cannot read --prompts-file {path} ({exc.strerror}); {hint}") from None
    what = sniff_binary(raw[:8192])
    if what:
        raise DipacoError(f"--prompts-file {path} looks binary ({what}), not text; {hint}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DipacoError(f"--prompts-file {path} is not valid UTF-8 (line {line}); {hint}") from None
    return [line for line in text.splitlines() if line.strip()]


def cmd_fit_window_router(args) -> None:
    from dipaco.eval.window_router import fit_window_router

    cfg = _resolve(args, CC.WindowRouterConfig)
    check_writable(Path(args.run) / "window_routers" / f"w{args.window}", "--run")
    rep = fit_window_router(args.run, args.shards, args.window, cfg.round, cfg.max_tokens, cfg.holdout_fraction,
                            cfg.seed, args.overwrite, progress=not args.quiet)
    if rep.get("warning"):
        print(f"dipaco fit-window-router: warning: {rep['warning']}", file=sys.stderr)
    if rep.get("once_notice"):
        print(f"{rep['once_notice']}; every-W routing builds on it")
    print(f"wrote {rep['out']}: {rep['examples']} windows of {rep['window']} tokens from {rep['router_documents']} router "
          f"documents (round {rep['round']}), {rep['seconds']:.0f} s")
    if rep["accuracy"] is not None:
        print(f"on {rep['test_examples']} windows of held-aside router documents: accuracy {rep['accuracy']:.3f} against the "
              f"lowest-loss path (shard router on the previous tokens {rep['accuracy_shard_router_previous_tokens']:.3f}, "
              f"the document's path {rep['accuracy_document_path']:.3f}); mean loss {rep['loss_window_router']:.4f} "
              f"(shard router {rep['loss_shard_router_previous_tokens']:.4f}, document path {rep['loss_document_path']:.4f}, "
              f"oracle {rep['loss_oracle']:.4f})")
    policy = rep["policy"]
    print(f"every-{rep['window']} routing will use {policy['name']}: {policy['reason']}; perplexity of every rule on the "
          f"router documents: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(policy["scores"].items(), key=lambda kv: kv[1])))


def cmd_choose_routing(args) -> None:
    from dipaco.eval.once_policy import save_once_policy

    check_writable(Path(args.run) / "routing", "--run")
    policy = save_once_policy(args.run, args.shards, args.round, args.overwrite, progress=not args.quiet)
    print(f"wrote {policy['out']}: routing once uses {policy['name']}: {policy['reason']}")
    if policy.get("router_documents"):
        print("perplexity on the router documents: " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(policy["router_documents"].items(), key=lambda kv: kv[1]))
            + f" (document oracle {policy['oracle']:.3f})")


def cmd_export(args) -> None:
    from dipaco.eval.api import load

    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    run, shards = pull_run(args.run), local_shards(args.shards)  # from a bucket: local copies
    check_out_dir(args.out, "export", inputs={"--run": str(run), "--shards": str(shards)}, overwrite=args.overwrite)
    rr = load(run, shards)
    out = rr.export(rr.check_path(args.path), args.out, args.round, args.overwrite)
    loaded, total = rr.bytes_of([args.path], args.round)
    print(f"exported path {args.path} of {args.run} to {out} ({loaded / 1e6:.2f} MB of {total / 1e6:.2f} MB of modules); "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")


def cmd_quickstart(args) -> None:
    from dipaco.cli.quickstart import quickstart

    flags = flags_of(args)  # --rounds, --inner-steps, --preset: given ones replace quickstart's defaults
    quickstart(args.out, **flags, overrides=args.overrides, progress=not args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dipaco", description="Train modular language models the DiPaCo way.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_pipeline_commands, add_serve_command, _add_tool_commands, add_lm_eval_command):
        add(sub)
    for p in sub.choices.values():
        p.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _add_pipeline_commands(sub) -> None:
    """The pipeline's commands: shard, train, eval, generate."""
    p = sub.add_parser("shard", help="route a corpus into per-path token shards")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE_OR_DIR",
                   help="JSON lines (.jsonl/.jsonl.gz), parquet, CSV or text files or directories, s3:// or gs:// URLs "
                        "(the s3 / gcs extras), a save_to_disk directory, or a hub dataset name")
    p.add_argument("--out", required=True, help="shard directory to create")
    p.add_argument("--tokenizer", help="use this Hugging Face tokenizer directory instead of training one")
    p.add_argument("--overwrite", action="store_true", help="replace --out once the new shards are complete")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: --num-proc processes of this machine (default); ray: Ray tasks, retried when a worker is lost")
    p.add_argument("--address", default="", metavar="ADDR",
                   help="with --engine ray: the cluster to join ('auto' or the head's host:port); default: a local Ray")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run of the same command: reuse its committed blocks (beside --out, in .<out>.work)")
    config_args(p, S.ShardConfig, cmd_shard, example="routing.svd_dims=32")

    p = sub.add_parser("train", help="train path workers with DiLoCo-style module averaging")
    p.add_argument("--shards", required=True, help="shard directory from `dipaco shard`")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last complete round")
    p.add_argument("--workers", type=int, help="launch a local torchrun with this many worker processes (127.0.0.1); "
                   "without it the local engine trains in this process and runs the trainees' phases side by side in "
                   "one worker process per core (at most one per trainee: the same bits as one process); with "
                   "--engine ray: the CPUs of the local Ray it starts (default: one per core)")
    p.add_argument("--num-proc", type=int, help="the local engine's worker processes: the trainees' phases run side "
                   "by side in this many (default: one per core, at most one per trainee; 1: every phase in this "
                   "process); the same bits for any count")
    p.add_argument("--max-restarts", type=int, default=0, help="with --workers: torchrun restarts after a crash "
                   "(each restart resumes from the last complete round)")
    p.add_argument("--keep-going", action="store_true", help="with --engine ray --address: survive the loss of the "
                   "cluster (wait for it, then resume from what storage holds); ends when the run is done or on an "
                   "error that is not a loss of machines")
    config_args(p, C.TrainConfig, cmd_train, example="inner.lr=1e-3")

    p = sub.add_parser("eval", help="routed perplexity on the held-out documents")
    p.add_argument("--run", action="append", required=True, metavar="[NAME=]RUN", help="run directory (repeatable)")
    p.add_argument("--shards", required=True, help="the shard directory the runs were trained on")
    p.add_argument("--out", required=True, help="report.json to write (report.md and PNG plots go beside it)")
    config_args(p, CC.EvalCommandConfig, cmd_eval, example="temperature=0.05")

    p = sub.add_parser("generate", help="route a prompt and continue it with one path")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", help="shard directory (router and tokenizer); default: the run's own")
    p.add_argument("words", nargs="*", metavar="PROMPT", help="prompt text, quoted (words without quotes form one prompt)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable: one prompt each)")
    p.add_argument("--prompts-file", help="text file, one prompt a line")
    config_args(p, CC.GenerateConfig, cmd_generate, example="top_p=0.9")


def _add_tool_commands(sub) -> None:
    """The commands around the pipeline: routing choices, export, reshard, inspect, the quickstart."""
    p = sub.add_parser("fit-window-router", help="fit the router of every-W routing on the router documents")
    p.add_argument("--run", required=True, help="run directory (the router is saved in RUN/window_routers/w<W>)")
    p.add_argument("--shards", required=True, help="the shard directory the run was trained on")
    p.add_argument("--window", type=int, required=True, metavar="W", help="tokens per window, e.g. 64")
    p.add_argument("--overwrite", action="store_true", help="replace the run's window router for W")
    config_args(p, CC.WindowRouterConfig, cmd_fit_window_router, example="max_tokens=2048")

    p = sub.add_parser("choose-routing", help="choose how documents are routed once, on the router documents")
    p.add_argument("--run", required=True, help="run directory (the choice is saved in RUN/routing/once.json)")
    p.add_argument("--shards", required=True, help="the shard directory the run was trained on")
    p.add_argument("--round", type=int, help="score with this checkpoint round (default latest)")
    p.add_argument("--overwrite", action="store_true", help="replace the run's saved choice")
    p.set_defaults(func=cmd_choose_routing)

    p = sub.add_parser("export", help="write one path as a plain Hugging Face model directory")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--path", required=True, help="path id, e.g. 0-1 (a dense run: 0)")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--round", type=int, help="checkpoint round (default latest)")
    p.add_argument("--shards", help="shard directory for the tokenizer; default: the run's own")
    p.add_argument("--overwrite", action="store_true", help="replace --out once the new export is complete")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("reshard", help="discriminative re-sharding from a trained run's per-path losses")
    p.add_argument("--run", required=True, help="run directory trained on --shards")
    p.add_argument("--shards", required=True, help="the shard directory the run was trained on")
    p.add_argument("--out", required=True, help="new shard directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace --out once the new shards are complete")
    config_args(p, CC.ReshardConfig, cmd_reshard, example="max_tokens=256")

    p = sub.add_parser("inspect", help="per-path summary of a shard directory (--png: and a plot of path sizes)")
    p.add_argument("shards", help="shard directory")
    p.add_argument("--png", help="also plot the path sizes: a .png file, or a directory to write <shards name>-paths.png "
                   "in (default: no plot)")
    p.add_argument("--terms", type=int, default=8, help="top terms per path (tf-idf routers)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("quickstart", help="the whole pipeline on an embedded default corpus, offline")
    p.add_argument("--out", default="dipaco-quickstart",
                   help="output directory, new or empty (re-running continues in a quickstart directory)")
    add_flags(p, C.TrainConfig, only=("preset", "rounds", "inner_steps"), show_defaults=False)  # quickstart's own defaults
    set_arg(p, "inner.lr=1e-3")  # a key of `dipaco train`
    p.set_defaults(func=cmd_quickstart)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = args.func(args)
    except ClusterUnreachable as exc:  # under --keep-going the supervisor waits for the cluster (it said so)
        if os.environ.get("DIPACO_SUPERVISED"):
            return LOST
        print(f"dipaco {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except DipacoError as exc:
        print(f"dipaco {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file-system error the checks could not foresee (disk full, a race): one line too
        print(f"dipaco {args.command}: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dipaco {args.command}: interrupted; completed outputs are kept", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
