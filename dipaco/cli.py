"""``dipaco <command>``: one thin subcommand per stage. Errors in the input exit with code 2 and one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.outputs import check_out_dir, check_out_file, check_writable, os_error_line


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with config sections (defaults < preset < file < --set < flags)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set inner.lr=1e-3 (repeatable)")


def cmd_shard(args) -> None:
    from dipaco.config import ShardConfig, resolve
    from dipaco.sharding.writer import purity, shard

    cfg = resolve(ShardConfig, args.config, args.overrides, {
        "grid": args.grid, "seed": args.seed, "num_proc": args.num_proc, "data.text_column": args.text_column,
        "data.min_chars": args.min_chars, "data.max_chars": args.max_chars, "data.split": args.split,
        "tokenizer.vocab_size": args.vocab_size, "routing.balance": args.balance, "routing.overlap": args.overlap,
        "routing.features": args.features, "routing.feature_model": args.feature_model,
        "routing.spherical": args.spherical, "routing.fit_sample": args.fit_sample, "routing.assign": args.assign,
        "routing.cluster_on": args.cluster_on, "routing.prefix_tokens": args.prefix_tokens})
    check_out_dir(args.out, "shards", inputs={"--data": args.data, "--tokenizer": args.tokenizer, "--config": args.config,
                                              "--feature-model": cfg.routing.feature_model}, overwrite=args.overwrite)
    manifest = shard(args.data, cfg, args.out, args.tokenizer, args.overwrite, progress=not args.quiet)
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
              f"the path the shard stage chose; training documents on their routed path: {agree['train']:.1%}")


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
              f"cv {h['cv']}" + (f"; balance {a['balance']}: cap {a['capacity']}, {a['spilled']} spilled" if a.get("capacity") else "")
              + (f"; overlap {a['overlap']}: {a['overlap_copies']} extra copies" if a.get("overlap", 1) > 1 else ""))


def cmd_reshard(args) -> None:
    from dipaco.sharding.reshard import reshard

    check_out_dir(args.out, "shards", inputs={"--run": args.run, "--shards": args.shards}, overwrite=args.overwrite)
    report = reshard(args.run, args.shards, args.out, target=args.target, holdout_fraction=args.holdout_fraction,
                     max_tokens=args.max_tokens, seed=args.seed, at_round=args.round, overwrite=args.overwrite,
                     progress=not args.quiet)
    print(f"wrote {args.out}: {report['moved_share']:.1%} of {report['documents']} documents moved to another path")
    print(f"router accuracy against the loss labels on {report['test_documents']} held-out router documents: "
          f"discriminative {report['accuracy']:.3f}, k-means {report['kmeans_accuracy']:.3f}; "
          f"mean loss of the chosen path {report['mean_loss_assigned_discriminative']:.4f} vs k-means "
          f"{report['mean_loss_assigned_kmeans']:.4f} (oracle {report['mean_loss_oracle']:.4f})")


def cmd_inspect(args) -> None:
    from dipaco.sharding.inspect_shards import format_summary, inspect

    default = f"{Path(args.shards).resolve().name}-paths.png"
    png = Path(args.png or default)
    if png.is_dir():  # a folder gets the default name inside it
        png = png / default
    if png.suffix.lower() != ".png":
        raise DipacoError(f"--png {args.png}: the plot is a PNG; give a file name ending in .png, or a directory")
    check_out_file(png, "--png")
    summary = inspect(args.shards, png, args.terms)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))


def cmd_train(args) -> None:
    from dipaco.config import TrainConfig, resolve
    from dipaco.train import train

    cfg = resolve(TrainConfig, args.config, args.overrides, {
        "preset": args.preset, "rounds": args.rounds, "inner_steps": args.inner_steps, "grid.shape": args.grid,
        "seed": args.seed, "device": args.device, "init_from": args.init_from, "comm.bits": args.bits,
        "streaming.fragments": args.fragments, "streaming.overlap": args.overlap, "streaming.alpha": args.alpha,
        "comm.simulate_mbit": args.simulate_bandwidth, "comm.simulate_latency_ms": args.simulate_latency})
    if args.workers is not None and args.workers < 1:  # 0 too: it is not "no workers", it is nonsense
        raise DipacoError(f"--workers must be >= 1, got {args.workers}")
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 checks: it alone writes the run directory
        # --out is a new or empty directory or a dipaco run (train decides about --resume), never an input
        check_out_dir(args.out, "run", inputs={"--shards": args.shards, "--init-from": cfg.init_from,
                                               "--config": args.config})
    if args.workers:
        from dipaco.launch import launch_local
        from dipaco.train import preflight

        preflight(cfg, args.shards, args.out, args.resume, args.workers)  # bad input: exit code 2, no worker started
        return launch_local(args.workers, _without_workers(args.argv), args.max_restarts)
    summary = train(cfg, args.shards, args.out, resume=args.resume, progress=not args.quiet)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary))


def _without_workers(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--workers", "--max-restarts"):
            skip = True
        elif not a.startswith(("--workers=", "--max-restarts=")):
            out.append(a)
    return out


def cmd_eval(args) -> None:
    from dipaco.eval.perplexity import evaluate
    from dipaco.eval.report import beside, markdown_table, write_report

    out = Path(args.out)
    if out.suffix.lower() != ".json" and not out.is_dir():
        raise DipacoError(f"--out {out}: the report is JSON; give a file name ending in .json (report.md and plots go beside it)")
    check_out_file(out, "--out", beside(out))
    if args.mixture is not None and args.mixture < 2:
        raise DipacoError(f"--mixture {args.mixture}: a mixture needs K >= 2 paths (K = 1 is the routed row); "
                          f"leave --mixture out for no mixture row")
    runs = {}
    for spec in args.run:
        name, _, path = spec.rpartition("=")
        runs[name or path.rstrip("/").split("/")[-1]] = path
    report = evaluate(runs, args.shards, args.round, progress=not args.quiet, baseline=args.baseline,
                      route_every=args.route_every, oracle=not args.no_oracle, random=not args.no_random,
                      early_stopping=args.early_stopping, mixture=args.mixture or 0, temperature=args.temperature,
                      seed=args.seed, split=args.split)
    files = write_report(report, args.out)
    print(markdown_table(report))
    print("\nwrote " + ", ".join(files.values()))


def cmd_generate(args) -> None:
    from dipaco.eval.api import load
    from dipaco.eval.generate import generate

    if args.mixture is not None and args.mixture < 2:
        raise DipacoError(f"--mixture {args.mixture}: a mixture needs K >= 2 paths; leave --mixture out for one path")
    if args.prompts_file:
        prompts = read_prompts(args.prompts_file)
    else:  # words given without quotes form one prompt
        prompts = [" ".join(args.prompt)] if args.prompt else []
    if not prompts:
        raise DipacoError("no prompt given; pass a prompt as an argument or --prompts-file FILE (one prompt a line)")
    rr = load(args.run, args.shards)
    for prompt in prompts:
        g = generate(rr, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, round=args.round, mixture=args.mixture or 0, mixture_temperature=args.mixture_temperature,
                     path=rr.check_path(args.path) if args.path else None, route_every=args.route_every)
        if g.segments and len(g.segments) > 1:
            paths = " -> ".join(f"{p} ({n} tokens)" for p, n in g.segments)
        else:
            paths = ", ".join(p if len(g.paths) == 1 else f"{p} (w={w:.3f})" for p, w in g.paths)
        if g.prompt_cut:
            print(f"# the prompt is longer than the model's {g.max_seq_len} tokens: kept its last {g.prompt_tokens} "
                  f"tokens ({g.prompt_cut} dropped); routing still read its first tokens", file=sys.stderr)
        print(f"# routing: {g.router}", file=sys.stderr)
        print(f"# path {paths}: loaded {g.bytes_loaded / 1e6:.2f} MB of {g.bytes_total / 1e6:.2f} MB "
              f"({100 * g.bytes_loaded / g.bytes_total:.0f}% of the model), {g.new_tokens} new tokens", file=sys.stderr)
        print(prompt + g.text)
        if len(prompts) > 1:
            print()


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file; anything else is one clear line."""
    from dipaco.sharding.sources import sniff_binary

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

    check_writable(Path(args.run) / "window_routers" / f"w{args.window}", "--run")
    rep = fit_window_router(args.run, args.shards, args.window, args.round, args.max_tokens, args.holdout_fraction,
                            args.seed, args.overwrite, progress=not args.quiet)
    print(f"wrote {rep['out']}: {rep['examples']} windows of {rep['window']} tokens from {rep['router_documents']} router "
          f"documents (round {rep['round']}), {rep['seconds']:.0f} s")
    if rep["accuracy"] is not None:
        print(f"on {rep['test_examples']} windows of held-aside router documents: accuracy {rep['accuracy']:.3f} against the "
              f"lowest-loss path (shard router on the previous tokens {rep['accuracy_shard_router_previous_tokens']:.3f}, "
              f"the document's path {rep['accuracy_document_path']:.3f}); mean loss {rep['loss_window_router']:.4f} "
              f"(shard router {rep['loss_shard_router_previous_tokens']:.4f}, document path {rep['loss_document_path']:.4f}, "
              f"oracle {rep['loss_oracle']:.4f})")


def cmd_export(args) -> None:
    from dipaco.eval.api import load

    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    check_out_dir(args.out, "export", inputs={"--run": args.run, "--shards": args.shards}, overwrite=args.overwrite)
    rr = load(args.run, args.shards)
    out = rr.export(rr.check_path(args.path), args.out, args.round, args.overwrite)
    loaded, total = rr.bytes_of([args.path], args.round)
    print(f"exported path {args.path} of {args.run} to {out} ({loaded / 1e6:.2f} MB of {total / 1e6:.2f} MB of modules); "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")


def cmd_quickstart(args) -> None:
    from dipaco.quickstart import quickstart

    check_out_dir(args.out, "quickstart")
    quickstart(args.out, args.rounds, args.inner_steps, args.preset, args.overrides, progress=not args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description="Train modular language models the DiPaCo way.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("shard", help="route a corpus into per-path token shards")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE_OR_DIR",
                   help="JSON lines (.jsonl/.jsonl.gz), parquet, CSV or text files or directories, or a hub dataset name")
    p.add_argument("--out", required=True, help="shard directory to create")
    p.add_argument("--grid", help="modules per level: 2x2, 4, 1 (default 2x2)")
    p.add_argument("--text-column", help="column holding the text (default 'text')")
    p.add_argument("--split", help="split of a hub dataset (default 'train')")
    p.add_argument("--min-chars", type=int, help="drop documents shorter than this (default 64)")
    p.add_argument("--max-chars", type=int, help="cut documents longer than this (default 1000000)")
    p.add_argument("--features", choices=["tfidf", "lm", "encoder"], help="routing features of the prefix (default tfidf)")
    p.add_argument("--feature-model", metavar="DIR", help="local Hugging Face causal LM (lm) or encoder (encoder) directory")
    p.add_argument("--spherical", action=argparse.BooleanOptionalAction, default=None,
                   help="spherical k-means (default on; --no-spherical for plain k-means)")
    p.add_argument("--fit-sample", type=int, help="documents sampled to fit the tokenizer and router (default 20000)")
    p.add_argument("--balance", type=float, help="cap every path at F x the mean share of documents (e.g. 1.2); 0 = off")
    p.add_argument("--assign", choices=["kmeans", "random"],
                   help="kmeans (default): routing features + k-means; random: a seeded uniform path per document (i.i.d. control)")
    p.add_argument("--cluster-on", choices=["prefix", "document"],
                   help="k-means on the routing prefix, or on whole-document features learned back from the prefix")
    p.add_argument("--prefix-tokens", type=int, help="tokens of the document prefix every router reads (default 32)")
    p.add_argument("--overlap", type=int, help="training documents go to their n nearest paths (paper: 2); default 1")
    p.add_argument("--num-proc", type=int, help="tokenizer/feature threads (default: all cores)")
    p.add_argument("--tokenizer", help="use this Hugging Face tokenizer directory instead of training one")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer (>= 300; default 8192)")
    p.add_argument("--seed", type=int)
    p.add_argument("--overwrite", action="store_true", help="replace --out once the new shards are complete")
    _config_args(p)
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("train", help="train path workers with DiLoCo-style module averaging")
    p.add_argument("--shards", required=True, help="shard directory from `dipaco shard`")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--preset", choices=["tiny", "small", "base"], help="model size preset (default tiny)")
    p.add_argument("--rounds", type=int, help="outer steps")
    p.add_argument("--inner-steps", type=int, help="H: inner steps per round")
    p.add_argument("--grid", help="'1' trains the dense baseline on all shards; default: the shards' grid")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last complete round")
    p.add_argument("--workers", type=int, help="launch a local torchrun with this many worker processes (127.0.0.1)")
    p.add_argument("--max-restarts", type=int, default=0, help="with --workers: torchrun restarts after a crash "
                   "(each restart resumes from the last complete round)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="cuda: NCCL + bf16 autocast (default auto)")
    p.add_argument("--init-from", metavar="RUN_OR_DIR",
                   help="start every module from a dense model: a dipaco --grid 1 run or a Hugging Face Llama directory")
    p.add_argument("--bits", type=int, choices=[4, 8, 16, 32], help="bits per outer-gradient value on the wire")
    p.add_argument("--fragments", type=int, help="Streaming DiLoCo: fragments per module (must divide H)")
    p.add_argument("--overlap", type=int, help="Streaming DiLoCo: τ, inner steps a reduction overlaps compute")
    p.add_argument("--alpha", type=float, help="Streaming DiLoCo: merge weight of the local weights (0 replaces)")
    p.add_argument("--simulate-bandwidth", type=float, metavar="MBIT", help="slow every collective to this link speed")
    p.add_argument("--simulate-latency", type=float, metavar="MS", help="per-message latency of the simulated link")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="routed perplexity on the held-out documents")
    p.add_argument("--run", action="append", required=True, metavar="[NAME=]RUN", help="run directory (repeatable)")
    p.add_argument("--shards", required=True, help="the shard directory the runs were trained on")
    p.add_argument("--out", required=True, help="report.json to write (report.md and PNG plots go beside it)")
    p.add_argument("--round", type=int, help="evaluate this round instead of the latest")
    p.add_argument("--baseline", metavar="RUN", help="a dense run (--grid 1) scored on the same tokens")
    p.add_argument("--route-every", type=int, action="append", default=[], metavar="W",
                   help="also re-route every W tokens using the previous window (repeatable)")
    p.add_argument("--early-stopping", action="store_true",
                   help="also evaluate each path at its round of lowest validation loss (metrics.jsonl)")
    p.add_argument("--mixture", type=int, metavar="K",
                   help="also score a c-BTM mixture of the K nearest paths (2 <= K <= paths)")
    p.add_argument("--temperature", type=float, default=0.1, help="mixture weights softmax(-d^2/T) (default 0.1)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle row (it scores every path on every document)")
    p.add_argument("--no-random", action="store_true", help="skip the random-routing row")
    p.add_argument("--seed", type=int, default=0, help="seed of random routing")
    p.add_argument("--split", default="heldout", choices=["heldout", "val"],
                   help="heldout: the held-out test documents (default); val: every path's validation documents "
                        "(choose settings on these)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="route a prompt and continue it with one path")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", help="shard directory (router and tokenizer); default: the run's own")
    p.add_argument("prompt", nargs="*", help="prompt text, quoted (or use --prompts-file)")
    p.add_argument("--prompts-file", help="text file, one prompt a line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round", type=int, help="checkpoint round (default latest)")
    p.add_argument("--path", help="use this path instead of routing")
    p.add_argument("--mixture", type=int, metavar="K", help="mix the K nearest paths (c-BTM; 2 <= K <= paths)")
    p.add_argument("--mixture-temperature", type=float, default=0.1, help="mixture weights softmax(-d^2/T)")
    p.add_argument("--route-every", type=int, metavar="W",
                   help="re-route after every W new tokens (the run's window router for W, else the shard router); "
                        "default: W of the run's window router if it has exactly one; 0 keeps one path")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("fit-window-router", help="fit the router of every-W routing on the router documents")
    p.add_argument("--run", required=True, help="run directory (the router is saved in RUN/window_routers/w<W>)")
    p.add_argument("--shards", required=True, help="the shard directory the run was trained on")
    p.add_argument("--window", type=int, required=True, metavar="W", help="tokens per window, e.g. 64")
    p.add_argument("--round", type=int, help="label with the losses of this round (default latest)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of each router document used")
    p.add_argument("--holdout-fraction", type=float, default=0.2,
                   help="router documents held aside to report accuracy (the saved router is then fitted on all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace the run's window router for W")
    p.set_defaults(func=cmd_fit_window_router)

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
    p.add_argument("--target", default="current", choices=["current", "uniform"],
                   help="path distribution the router's bias keeps: the current shard sizes or uniform")
    p.add_argument("--holdout-fraction", type=float, default=0.2, help="router documents kept to measure accuracy")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens of each router document scored")
    p.add_argument("--round", type=int, help="score with this round instead of the latest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace --out once the new shards are complete")
    p.set_defaults(func=cmd_reshard)

    p = sub.add_parser("inspect", help="per-path summary of a shard directory and a PNG of path sizes")
    p.add_argument("shards", help="shard directory")
    p.add_argument("--png", help="where to write the plot: a .png file, or a directory to write <shards name>-paths.png "
                   "in (default ./<shards name>-paths.png)")
    p.add_argument("--terms", type=int, default=8, help="top terms per path (tf-idf routers)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("quickstart", help="the whole pipeline on an embedded default corpus, offline")
    p.add_argument("--out", default="dipaco-quickstart",
                   help="output directory, new or empty (re-running continues in a quickstart directory)")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training config value")
    p.set_defaults(func=cmd_quickstart)

    for p in sub.choices.values():
        p.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = args.func(args)
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
