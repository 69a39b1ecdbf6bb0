"""``dipaco <command>``: one thin subcommand per stage. Errors in the input exit with code 2 and one line."""

from __future__ import annotations

import argparse
import json
import sys

from dipaco.errors import DipacoError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with config sections (defaults < preset < file < --set < flags)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set inner.lr=1e-3 (repeatable)")


def cmd_shard(args) -> None:
    from dipaco.config import ShardConfig, resolve
    from dipaco.sharding.writer import purity, shard

    cfg = resolve(ShardConfig, args.config, args.overrides, {
        "grid": args.grid, "seed": args.seed, "data.text_column": args.text_column,
        "tokenizer.vocab_size": args.vocab_size, "routing.balance": args.balance})
    manifest = shard(args.data, cfg, args.out, args.tokenizer, args.overwrite, progress=not args.quiet)
    print(f"wrote {args.out}: {manifest['train_documents']} training and {manifest['heldout_documents']} held-out documents "
          f"on grid {manifest['grid']}, vocabulary {manifest['vocab_size']}; dropped {manifest['dropped']}")
    print("| path | train docs | train tokens | val docs | val tokens | top label |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for p, s in manifest["paths"].items():
        labels = manifest["labels_per_path"][p]
        top = max(labels, key=labels.get) if labels else "-"
        print(f"| {p} | {s['train_docs']} | {s['train_tokens']} | {s['val_docs']} | {s['val_tokens']} | {top} |")
    pur = purity(manifest["labels_per_path"])["overall"]
    if pur is not None:
        print(f"label purity of the paths: {pur:.3f}")


def cmd_train(args) -> None:
    from dipaco.config import TrainConfig, resolve
    from dipaco.train import train

    cfg = resolve(TrainConfig, args.config, args.overrides, {
        "preset": args.preset, "rounds": args.rounds, "inner_steps": args.inner_steps, "grid.shape": args.grid,
        "seed": args.seed, "device": args.device, "init_from": args.init_from, "comm.bits": args.bits,
        "streaming.fragments": args.fragments, "streaming.overlap": args.overlap, "streaming.alpha": args.alpha,
        "comm.simulate_mbit": args.simulate_bandwidth, "comm.simulate_latency_ms": args.simulate_latency})
    if args.workers:
        from dipaco.launch import launch_local
        from dipaco.shards import ShardSet

        ShardSet(args.shards)  # bad input fails here, with exit code 2, before any worker starts
        return launch_local(args.workers, _without_workers(args.argv), args.max_restarts)
    summary = train(cfg, args.shards, args.out, resume=args.resume, progress=not args.quiet)
    import os

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
    from dipaco.eval.report import markdown_table, write_report

    runs = {}
    for spec in args.run:
        name, _, path = spec.rpartition("=")
        runs[name or path.rstrip("/").split("/")[-1]] = path
    report = evaluate(runs, args.shards, args.round, progress=not args.quiet)
    files = write_report(report, args.out)
    print(markdown_table(report))
    print(f"\nwrote {files['json']}, {files['markdown']}, {files['plot']}")


def cmd_quickstart(args) -> None:
    from dipaco.quickstart import quickstart

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
    p.add_argument("--balance", type=float, help="cap every path at F x the mean share of documents (e.g. 1.2); 0 = off")
    p.add_argument("--tokenizer", help="use this Hugging Face tokenizer directory instead of training one")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer")
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
    p.add_argument("--out", required=True, help="report.json to write (report.md and report.png go beside it)")
    p.add_argument("--round", type=int, help="evaluate this round instead of the latest")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("quickstart", help="the whole pipeline on an embedded default corpus, offline")
    p.add_argument("--out", default="dipaco-quickstart", help="output directory (re-running continues there)")
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
    except KeyboardInterrupt:
        print(f"dipaco {args.command}: interrupted; completed outputs are kept", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
