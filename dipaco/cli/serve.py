"""``dipaco serve``: an OpenAI-compatible HTTP server for a trained run (routed, batched, modules held once), for one
Hugging Face directory (``--model``), or in front of upstream servers that each hold one path (``--upstream``)."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys

from dipaco import command_config as CC
from dipaco.cli.flags import config_args, flags_of
from dipaco.config import resolve
from dipaco.errors import DipacoError
from dipaco.taskqueue.runstore import local_shards, pull_run

API_KEY_VARIABLE = "DIPACO_API_KEY"


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="serve a run over OpenAI's HTTP API: routed, batched, modules held once")
    p.add_argument("--run", help="run directory or bucket URL to serve (routed; NAME/PATH pins a path)")
    p.add_argument("--model", metavar="DIR", help="serve a Hugging Face model directory instead (e.g. a `dipaco export`)")
    p.add_argument("--shards", help="shard directory (router and tokenizer); default: the run's own")
    p.add_argument("--name", help="the model name clients ask for (default: the run's or directory's folder name)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_VARIABLE}); needed to listen "
                                     f"beyond loopback")
    p.add_argument("--upstream", action="append", default=[], metavar="PATH=URL",
                   help="answer PATH's requests with the OpenAI-compatible server at URL (repeatable, or a file of "
                        "PATH=URL lines); this server routes and forwards")
    config_args(p, CC.ServeConfig, cmd_serve, example="max_batch=16")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model is loaded: a taken port is one line at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DipacoError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port (0 picks a free one)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> None:
    cfg = resolve(CC.ServeConfig, args.config, args.overrides, flags_of(args))
    if bool(args.run) == bool(args.model):
        raise DipacoError("serve one thing: --run RUN (a dipaco run, routed) or --model DIR (a Hugging Face directory)")
    if args.upstream and not args.run:
        raise DipacoError("--upstream needs --run: the front router routes with the run's router and tokenizer")
    if cfg.log.trackers and not args.run:
        raise DipacoError("--log-to needs --run: the tracker run that gets the throughput lives in the run directory")
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if not _loopback(cfg.host) and not api_key:
        raise DipacoError(f"--host {cfg.host} listens beyond this machine: set an API key with --api-key KEY or "
                          f"{API_KEY_VARIABLE}, or listen on 127.0.0.1")
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise DipacoError("dipaco serve needs the serve extra: pip install -e '.[serve]'") from None
    from dipaco.eval.serve.app import Server
    from dipaco.eval.serve.engine import Engine
    from dipaco.eval.serve.metrics import Metrics
    from dipaco.eval.serve.upstream import Upstreams, parse_upstreams

    from dipaco.eval.serve.throughput_log import ThroughputLog

    sock, metrics, engine, throughput = _listen(cfg.host, cfg.port), Metrics(), None, None
    try:
        run = str(pull_run(args.run)) if args.run else None
        engine = Engine(run=run, shards=local_shards(args.shards), model_dir=args.model,
                        max_memory=cfg.max_memory or None, routing=cfg.routing, route_every=cfg.route_every,
                        max_batch=cfg.max_batch, round=cfg.round, metrics=metrics, name=args.name)
        upstreams = Upstreams(parse_upstreams(args.upstream, engine.paths)) if args.upstream else None
        engine.remote = upstreams
        throughput = ThroughputLog.open(run, cfg.log, metrics, cfg.log_interval) if run else None
        server = Server(engine, metrics, api_key, cfg.max_queue, upstreams)
        logging.basicConfig(level=logging.INFO, format="dipaco serve: %(message)s", stream=sys.stderr)
        host, port = sock.getsockname()[:2]
        print(f"dipaco serve: {engine.name} ({len(engine.paths)} paths; routing: {engine.routing_cost()}; module "
              f"budget {engine.budget / 1e9:.2f} GB) on http://{host}:{port}/v1", flush=True)
        config = uvicorn.Config(server.app, log_level="warning", timeout_graceful_shutdown=30, lifespan="off")

        class Graceful(uvicorn.Server):
            def handle_exit(self, sig, frame):
                super().handle_exit(sig, frame)
                server.closing = True
                self._captured_signals.clear()  # SIGTERM ends the server once its requests are answered: exit 0

        Graceful(config).run(sockets=[sock])
    finally:
        if throughput is not None:
            throughput.close()
        if engine is not None:
            engine.close()
        sock.close()
    print("dipaco serve: stopped; requests in flight were answered", file=sys.stderr)
