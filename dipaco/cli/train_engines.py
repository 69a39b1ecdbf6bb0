"""Where ``dipaco train`` runs: the training engines behind one interface, as the shard stage's are
(``dipaco.sharding.engines``). Every engine runs the same phase (``dipaco.training.phase``) and the same outer step,
so an engine decides only where and when phases run, never a bit of the result. They live with the commands: an engine
reaches the whole core (the local loop, torchrun, the task queue), which stands below it.

  local      the default: every trainee belongs to this process; a round's phases run side by side in local worker
             processes, one torch thread each (``--num-proc``; default one per core, at most one per trainee), and
             the outer step runs here;
             Streaming DiLoCo (fragments synced within a round) runs its phases in this process
  torchrun   ``--workers N``: the same command on N local torchrun ranks (gloo; Streaming DiLoCo's overlapped
             fragments travel between them); also what a rank of a torchrun started elsewhere runs (its trainees in
             its own process)
  ray        ``--engine ray``: the task queue on a Ray cluster (``dipaco.taskqueue.ray_engine``), or its supervisor
             with ``--keep-going``

``engine_for(cfg, args)`` picks one from the config and the command's flags; ``TrainEngine.run(cfg, args)`` trains
and returns the run's summary (printed as JSON), or the exit code of the processes it ran the command in.
"""

from __future__ import annotations

import os

from dipaco.errors import DipacoError
from dipaco.storage.objects import Storage
from dipaco.taskqueue.ray_cluster import ClusterUnreachable


class TrainEngine:
    """One way to run ``dipaco train``; ``name``: its name in messages."""

    name = ""

    def run(self, cfg, args) -> dict | int | None:
        raise NotImplementedError


class LocalEngine(TrainEngine):
    """This process, its phases in ``workers`` local worker processes (None: one per core, at most one per trainee)."""

    name = "local"

    def __init__(self, workers: int | None = None):
        self.workers = workers

    def run(self, cfg, args) -> dict:
        from dipaco.training.train import train

        return train(cfg, args.shards, args.out, resume=args.resume, progress=not args.quiet, workers=self.workers)


class TorchrunEngine(TrainEngine):
    """The command on ``--workers`` local torchrun ranks (restarted up to ``--max-restarts`` times)."""

    name = "torchrun"

    def run(self, cfg, args) -> int:
        from dipaco.training.launch import launch_local
        from dipaco.training.plan import preflight

        preflight(cfg, args.shards, args.out, args.resume, args.workers)  # bad input: exit code 2, no rank started
        return launch_local(args.workers, args.argv, args.max_restarts)


class RayEngine(TrainEngine):
    """The task queue on Ray: the driver in this process, or its supervisor with ``--keep-going``."""

    name = "ray"

    def run(self, cfg, args) -> dict | int | None:
        check_ray_flags(cfg, args)
        if args.keep_going:
            from dipaco.taskqueue.ray_cluster import split_address
            from dipaco.taskqueue.supervise import supervise

            split_address(cfg.ray.address)
            return supervise([a for a in args.argv if a != "--keep-going"], cfg.ray.address,
                             lambda: Storage(args.out).exists("run.json"))
        try:
            from dipaco.taskqueue.ray_engine import train_ray
        except ModuleNotFoundError as exc:
            if exc.name != "ray" and not (exc.name or "").startswith("ray."):
                raise
            raise DipacoError("--engine ray needs Ray; install it with pip install -e '.[ray]' (or pip install "
                              "'ray>=2.40')") from None
        return train_ray(cfg, args.shards, args.out, resume=args.resume, progress=not args.quiet, workers=args.workers)


def check_ray_flags(cfg, args) -> None:
    """The flags --engine ray refuses, and a wrong --address (one line, before anything starts)."""
    if args.max_restarts:
        raise DipacoError("--max-restarts is torchrun's; the Ray engine retries a lost phase itself (ray.max_retries)")
    if args.workers and cfg.ray.address:
        raise DipacoError(f"--workers starts a local Ray; with --address {cfg.ray.address} the cluster's nodes are the "
                          f"workers: drop one of the two")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise DipacoError("--engine ray runs one driver, not one per torchrun rank; start it without torchrun")
    if args.keep_going and not cfg.ray.address:
        raise DipacoError("--keep-going waits for a cluster at --address; without --address the local Ray lives and "
                          "dies with this command: start a cluster (README: Ray clusters) and pass its --address")
    if cfg.ray.address and not args.keep_going:  # a wrong address costs one line, at once
        from dipaco.taskqueue.ray_cluster import reachable, start_hint

        if why := reachable(cfg.ray.address):
            raise ClusterUnreachable(f"no Ray cluster answers at --address {cfg.ray.address} ({why}); "
                                     f"{start_hint(cfg.ray.address)}")


def engine_for(cfg, args) -> TrainEngine:
    """``--engine ray``: Ray; ``--workers N``: torchrun; a rank of a running torchrun: its own trainees here; else the
    local engine with ``--num-proc`` worker processes (default: one per core)."""
    if cfg.engine == "ray":
        return RayEngine()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return LocalEngine(workers=1)
    if args.workers:
        return TorchrunEngine()
    return LocalEngine(workers=args.num_proc)
