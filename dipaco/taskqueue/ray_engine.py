"""``dipaco train --engine ray``: DiPaCo's task queue on Ray (with ``dipaco.taskqueue.ray_cluster`` and ``ray_tasks``, one
of the files that import ray).

The paper trains through a queue of inner phases on shared storage: any free worker takes the next phase, outer
executors average a module as soon as its paths' phases are in, and workers come and go. Here:

  phase (trainee i, version v)   a Ray task (``dipaco.taskqueue.phases.run_phase``, retried without limit, with a backoff, when its
                                 worker or node is lost): round v+1's H inner steps from version v of its path's modules
  outer step (group g, v -> v+1) a method call on a restartable executor actor (``dipaco.taskqueue.phases.outer_step``), made
                                 as soon as every phase (i, v) of g's trainees is committed
  the driver (``TaskQueue``)     a loop that launches what the scheduler (``dipaco.taskqueue.schedule``) finds ready,
                                 records what comes back from its commit record (``dipaco.taskqueue.resolver``) and
                                 hands every finished round to the round assembler (``dipaco.taskqueue.rounds``:
                                 metrics.jsonl, checkpoints in the local engine's format); it holds nothing the run
                                 directory does not

No barrier between rounds: phase (i, v+1) starts when *its* modules have version v+1, while other paths may still be
training round v. The run directory (``dipaco.taskqueue.taskstore``) is the source of truth and must be visible to every node;
a killed driver loses nothing (``--resume`` rebuilds the queue from it). Same config and seed, same bits as the
in-process engine at any ``comm.bits``, with any number of workers, through retries, lost nodes, restarted
executors and resumed drivers. With ``ray.quorum`` a module's outer step may go ahead without late phases, which
are then dropped (not exact; the metrics name them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import ray
from ray.exceptions import RayTaskError, TaskCancelledError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dipaco.config import TrainConfig
from dipaco.errors import DipacoError
from dipaco.model.grid import format_grid
from dipaco.storage import checkpoint
from dipaco.storage.objects import Storage
from dipaco.storage.run import RunDirectory, build_grid, check_dense_source
from dipaco.storage.shards import ShardSet
from dipaco.taskqueue.lease import Lease
from dipaco.taskqueue.phases import PhaseSpec, StepSpec, outer_step, run_phase, validate_path
from dipaco.taskqueue.newrun import begin_run
from dipaco.taskqueue.ray_cluster import ClusterUnreachable, connect, disconnect
from dipaco.taskqueue.resolver import StateResolver
from dipaco.taskqueue.rounds import RoundAssembler
from dipaco.taskqueue.runstore import choose_lineage, config_digest, driver_view, local_shards
from dipaco.taskqueue.schedule import Scheduler, describe
from dipaco.taskqueue.specs import TaskSpecs, module_layout, skeleton_model
from dipaco.taskqueue.taskstore import TaskStore
from dipaco.training.devices import phase_device, phase_resources
from dipaco.training.plan import Plan


# a loss of machines or of the connection to the cluster: never an error of the run (--keep-going waits it out)
LOSSES = (ray.exceptions.LocalRayletDiedError, ray.exceptions.RaySystemError, ray.exceptions.RpcError,
          ray.exceptions.ObjectLostError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


@ray.remote(num_cpus=1)
def _phase(spec: PhaseSpec) -> dict:
    return run_phase(spec, node=ray.get_runtime_context().get_node_id())


@ray.remote(num_cpus=1)
def _validate(**fields) -> float | None:
    return validate_path(**fields)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class _Executor:
    """Outer steps of its share of the groups; stateless (everything is read from the run directory), so a restart
    after its process or node was lost simply takes the next call (Ray retries the one in flight)."""

    def __init__(self, run: str, lineage: str, index: int):
        self.node = ray.get_runtime_context().get_node_id()
        TaskStore(run, lineage).storage.write(f"queue/{lineage}/executors/{index}.json", json.dumps(
            {"pid": os.getpid(), "node": self.node, "started": time.time()}).encode())

    def step(self, spec: StepSpec) -> dict:
        return outer_step(spec, node=self.node)


def train_ray(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool = False, progress: bool = True,
              workers: int | None = None) -> dict:
    """Train (or continue) ``run_dir`` (a local path or a URL) on Ray: the cluster at ``cfg.ray.address``, or a local
    one with ``workers`` CPUs."""
    with driver_view(str(run_dir)) as local:  # a run in a bucket: a local mirror, removed however this ends
        return _train(cfg, shards_dir, str(run_dir), local, resume, progress, workers)


def _train(cfg: TrainConfig, shards_dir, location: str, local: Path, resume: bool, progress: bool, workers) -> dict:
    shards = ShardSet(local_shards(shards_dir))
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    plan = Plan.make(cfg, grid, shards, 1)
    storage = Storage(location)
    directory = RunDirectory(local, cfg, shards)
    start = directory.check(resume)  # bad input is refused before any Ray process starts
    skeleton = skeleton_model(cfg, grid, plan.paths[0], shards)  # shapes and names only: built once
    if cfg.init_from:
        check_dense_source(cfg.init_from, shards)
    # tasks see the driver's object-store settings (an endpoint, credentials where the nodes have none of their own)
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "DIPACO_CACHE"))}
    try:
        connect(cfg.ray.address, workers, env)  # before the lease: a command that cannot join writes nothing
        signal.signal(signal.SIGTERM, _interrupt)  # after Ray's own handler (a native stack dump): one dipaco line
        with Lease(location):
            cpus = _cluster_cpus()
            # where phases train: --device cuda on a cluster without a GPU stops here, in one line
            device = phase_device(cfg.device, ray.cluster_resources().get("GPU", 0), cfg.ray.gpus_per_phase)
            if start == 0:
                begin_run(cfg, shards, grid, plan, directory, storage, cpus, skeleton)
            else:
                checkpoint.remove_partial_rounds(local)
            stats = _open_queue(cfg, shards_dir, plan, grid, directory, location, start, device, progress, skeleton).run()
    finally:
        try:
            disconnect()
        finally:
            _restore_stderr()
    return {"run": location, "rounds": cfg.rounds, "grid": format_grid(grid.shape), "trainees": len(plan.trainees),
            "workers": cpus, "engine": "ray", "device": device, **stats}


def _open_queue(cfg: TrainConfig, shards_dir, plan, grid, directory: RunDirectory, location: str, start: int,
                device: str, progress: bool, skeleton) -> TaskQueue:
    """The driver's queue from checkpoint ``start`` on: the queue lineage that grew from it (or a new one), what it
    holds, and the round assembler that continues metrics.jsonl."""
    local, storage = directory.root, Storage(location)
    meta = json.loads((checkpoint.round_dir(local, start) / "state" / "meta.json").read_text())
    lineage = choose_lineage(storage, start, config_digest(cfg, directory.schedule_steps()), meta, _say)
    store = TaskStore(location, lineage)
    store.forget_before(start)
    state = StateResolver.scan(store, plan, grid, start, cfg.rounds, local, cfg.val_batches > 0, _say)
    specs = TaskSpecs(state, cfg, shards_dir, directory.schedule_steps(), module_layout(grid, plan.paths, skeleton),
                      device)
    title = f"train {store.run if storage.remote else local.name} (ray)"
    return TaskQueue(cfg, state, specs, RoundAssembler(state, cfg, local, _cluster_cpus, title, progress), device)


_stderr_while_interrupted: int | None = None  # the real stderr, set aside from SIGTERM until Ray has shut down


def _interrupt(signum, frame):
    # While an interrupted run shuts down, Ray's native threads may log lines of their own to stderr (the error of
    # a cancelled task that can no longer reach the driver): the user asked to stop and gets one dipaco line. Only
    # while Ray runs: a signal after its shutdown has nobody to restore stderr and must not hide that line.
    global _stderr_while_interrupted
    if _stderr_while_interrupted is None and ray.is_initialized():
        sys.stderr.flush()
        _stderr_while_interrupted = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    raise KeyboardInterrupt


def _restore_stderr() -> None:
    global _stderr_while_interrupted
    if _stderr_while_interrupted is not None:
        os.dup2(_stderr_while_interrupted, 2)
        os.close(_stderr_while_interrupted)
        _stderr_while_interrupted = None


def _cluster_cpus() -> int:
    return int(ray.cluster_resources().get("CPU", 0))


def _say(line: str) -> None:
    print(f"dipaco train: {line}", file=sys.stderr, flush=True)


class TaskQueue:
    """The driver's main loop: launch what the scheduler says is ready, record what comes back, assemble the rounds
    that are finished. What it knows is what the run directory holds (``StateResolver``); the decisions are the
    scheduler's (``dipaco.taskqueue.schedule``), the rounds' output the assembler's (``dipaco.taskqueue.rounds``)."""

    def __init__(self, cfg: TrainConfig, state: StateResolver, specs: TaskSpecs, assembler: RoundAssembler,
                 device: str = "cpu"):
        self.cfg, self.state, self.specs, self.rounds = cfg, state, specs, assembler
        self.schedule = Scheduler(state, cfg.ray.quorum, cfg.ray.grace)
        # a phase's (and a validation's) request: its threads as CPUs, its GPU share on cuda; lost workers retried
        self.task_options = {"max_retries": cfg.ray.max_retries,
                             **phase_resources(device, cfg.trainee_threads, cfg.ray.gpus_per_phase)}
        self.executors = [_Executor.remote(state.store.run, state.store.lineage, k) for k in range(cfg.ray.executors)]
        self.progress_at = self.said_at = time.time()

    def run(self) -> dict:
        try:
            while not self.rounds.done():
                self.launch_ready()
                if not self.schedule.inflight:  # never wait on nothing: finish what storage holds, launch what it lacks, or end
                    self.rounds.complete()
                    if self.rounds.done():
                        break
                    self.launch_ready()
                    if not self.schedule.inflight:
                        raise DipacoError(self.schedule.missing(self.rounds.next_round))
                done, _ = ray.wait(list(self.schedule.inflight), num_returns=1, timeout=self.schedule.wait_s(time.time()))
                for handle in done:
                    self.finish(handle)
                self.progress_at = time.time() if done else self.progress_at
                self.say_waiting()
                self.drop_late()
                self.rounds.complete()
        except LOSSES as exc:  # the connection to the cluster failed, not the run
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ClusterUnreachable(f"lost the Ray cluster ({type(exc).__name__}: {first}); resume (--resume) when it "
                                     f"is back, or run with --keep-going") from None
        finally:
            self.rounds.close()
        return dict(self.rounds.counts)

    def say_waiting(self) -> None:
        """A line at most once a minute while nothing has come back for a minute and the cluster offers too few CPUs
        (or GPUs) for a single task: the run waits on machines, and says for what."""
        now = time.time()
        if now - max(self.progress_at, self.said_at) < 60:
            return
        have = ray.cluster_resources()
        short = [f"{have.get(k, 0):g} {k}" for k, key in (("CPU", "num_cpus"), ("GPU", "num_gpus"))
                 if have.get(k, 0) < self.task_options.get(key, 0)]
        if short:
            self.said_at = now
            tasks = sorted({describe(*t) for t in self.schedule.inflight.values()})
            _say(f"waiting for machines: nothing came back for {now - self.progress_at:.0f} s and the cluster offers "
                 f"{' and '.join(short)}, fewer than one task asks for; {len(tasks)} tasks wait ({tasks[0]}"
                 f"{' ...' if len(tasks) > 1 else ''}); add nodes (`ray start --address ...`)")

    # ----------------------------------------------------------------------------------------------- launching
    def launch_ready(self) -> None:
        for kind, who, v in self.schedule.ready(self.rounds.next_round):
            if kind == "phase":
                handle = self.launch_phase(who, v)
            elif kind == "step":
                executor = self.executors[list(self.state.groups.modules).index(who) % len(self.executors)]
                handle = executor.step.remote(StepSpec(**self.specs.step(who, v)))
            else:
                handle = _validate.options(**self.task_options).remote(**self.specs.validation(who, v))
            self.schedule.launched(handle, (kind, who, v))

    def launch_phase(self, i: int, v: int):
        spec = PhaseSpec(**self.specs.phase(i, v))
        options = dict(self.task_options)
        node = self.state.last_node(i, v)  # its cache holds the state this phase starts from
        if self.cfg.ray.sticky and node:
            # a state in storage too: that node if it has a free CPU now, else any (a miss costs one download); a
            # state only in that node's cache: wait for the node while it lives (a miss costs a replay)
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node, soft=True, _spill_on_unavailable="replay" not in spec.state)
        return _phase.options(**options).remote(spec)

    # ----------------------------------------------------------------------------------------------- returns
    def finish(self, handle) -> None:
        kind, who, v = self.schedule.returned(handle)
        try:
            result = ray.get(handle)
        except TaskCancelledError:
            return  # a dropped phase, stopped
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, DipacoError):
                raise DipacoError(str(cause)) from None
            raise DipacoError(f"{describe(kind, who, v)} failed: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as exc:
            raise self.lost(describe(kind, who, v), exc) from None
        if kind == "phase" and self.state.phase_committed(who, v):
            self.rounds.advance(self.cfg.inner_steps)
        elif kind == "step":
            self.state.step_committed(who, v, time.time())
        elif kind == "val":
            self.state.ledger.val_loss[(who, v)] = result

    def lost(self, task: str, exc: Exception) -> DipacoError:
        """A task lost with its worker or node: an error of the run only once its retries (when limited) are spent."""
        limited = self.cfg.ray.max_retries >= 0 and isinstance(exc, (ray.exceptions.WorkerCrashedError,
                                                                     ray.exceptions.NodeDiedError))
        if not limited:  # machines or the connection lost: not an error of the run (--keep-going waits)
            return ClusterUnreachable(f"{task} was lost with its machines ({type(exc).__name__}); resume (--resume) "
                                      f"when the cluster is back, or run with --keep-going")
        return DipacoError(f"{task} was lost {self.cfg.ray.max_retries + 1} times ({type(exc).__name__}); check the "
                           f"cluster's workers, or set ray.max_retries=-1 (without limit, the default)")

    def drop_late(self) -> None:
        dropped = self.schedule.drop_late(time.time())
        self.rounds.counts["dropped"] += len(dropped)
        for handle in self.schedule.handles(dropped):
            ray.cancel(handle)  # interrupts it; its worker process lives on for the next phase
