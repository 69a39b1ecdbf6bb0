"""``dipaco train --engine ray``: DiPaCo's task queue on Ray (with ``dipaco.taskqueue.ray_cluster``, one of the two files that
import ray).

The paper trains through a queue of inner phases on shared storage: any free worker takes the next phase, outer
executors average a module as soon as its paths' phases are in, and workers come and go. Here:

  phase (trainee i, version v)   a Ray task (``dipaco.taskqueue.phases.run_phase``, retried without limit, with a backoff, when its
                                 worker or node is lost): H inner steps from version v of its path's modules
  outer step (group g, v -> v+1) a method call on a restartable executor actor (``dipaco.taskqueue.phases.outer_step``), made
                                 as soon as every phase (i, v) of g's trainees is committed
  the driver (``TaskQueue``)     launches what is ready, assembles every finished round into the sync engine's
                                 checkpoint format, writes metrics.jsonl; it holds nothing the run directory does not

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
import torch
from ray.exceptions import RayTaskError, TaskCancelledError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm

from dipaco.config import TrainConfig
from dipaco.errors import DipacoError
from dipaco.model.grid import format_grid
from dipaco.model.path_model import PathModel, llama_config
from dipaco.storage import checkpoint
from dipaco.storage.objects import Storage
from dipaco.storage.run import Plan, RunDirectory, build_grid, check_dense_source
from dipaco.storage.shards import ShardSet
from dipaco.taskqueue.lease import Lease
from dipaco.taskqueue.phases import PhaseSpec, StepSpec, outer_step, run_phase, validate_path
from dipaco.taskqueue.newrun import begin_run
from dipaco.taskqueue.ray_cluster import ClusterUnreachable, connect, disconnect
from dipaco.taskqueue.runstore import assemble, choose_lineage, config_digest, driver_view, local_shards, push
from dipaco.taskqueue.schedule import describe, log_round, missing, phase_validates, ready, val_losses
from dipaco.taskqueue.taskstore import Damaged, Ledger, ModuleGroups, TaskStore, ref
from dipaco.training.devices import phase_device, phase_resources
from dipaco.training.outer import renormalised


# a loss of machines or of the connection to the cluster: never an error of the run (--keep-going waits it out)
LOSSES = (ray.exceptions.LocalRayletDiedError, ray.exceptions.RaySystemError, ray.exceptions.RpcError,
          ray.exceptions.ObjectLostError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


@ray.remote(num_cpus=1)
def _phase(spec: PhaseSpec) -> dict:
    return run_phase(spec, node=ray.get_runtime_context().get_node_id())


@ray.remote(num_cpus=1)
def _validate(*args) -> float | None:
    return validate_path(*args)


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
    if cfg.init_from:
        check_dense_source(cfg.init_from, shards)
    # tasks see the driver's object-store settings (an endpoint, credentials where the nodes have none of their own)
    env = {k: v for k, v in os.environ.items() if k.startswith(("DIPACO_TEST_", "AWS_", "DIPACO_CACHE"))}
    try:
        connect(cfg.ray.address, workers, env)  # before the lease: a command that cannot join writes nothing
        signal.signal(signal.SIGTERM, _interrupt)  # after Ray's own handler (a native stack dump): one dipaco line
        with Lease(location):
            cpus = int(ray.cluster_resources().get("CPU", 0))
            # where phases train: --device cuda on a cluster without a GPU stops here, in one line
            device = phase_device(cfg.device, ray.cluster_resources().get("GPU", 0), cfg.ray.gpus_per_phase)
            if start == 0:
                begin_run(cfg, shards, grid, plan, directory, storage, cpus)
            else:
                checkpoint.remove_partial_rounds(local)
            meta = json.loads((checkpoint.round_dir(local, start) / "state" / "meta.json").read_text())
            lineage = choose_lineage(storage, start, config_digest(cfg, directory.schedule_steps()), meta, _say)
            store = TaskStore(location, lineage)
            store.forget_before(start)
            queue = TaskQueue(cfg, shards_dir, shards, grid, plan, store, local, start, directory.schedule_steps(),
                              progress, device)
            stats = queue.run()
    finally:
        try:
            disconnect()
        finally:
            _restore_stderr()
    return {"run": location, "rounds": cfg.rounds, "grid": format_grid(grid.shape), "trainees": len(plan.trainees),
            "workers": cpus, "engine": "ray", "device": device, **stats}


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


def _say(line: str) -> None:
    print(f"dipaco train: {line}", file=sys.stderr, flush=True)


class TaskQueue:
    """The driver's view of the queue: what is committed, dropped and in flight; what is ready to launch."""

    def __init__(self, cfg: TrainConfig, shards_location, shards: ShardSet, grid, plan: Plan, store: TaskStore, local: Path,
                 start: int, schedule_steps: int, progress: bool, device: str = "cpu"):
        self.cfg, self.shards, self.grid, self.plan, self.store = cfg, shards, grid, plan, store
        # a phase's (and a validation's) request: its threads as CPUs, its GPU share on cuda; lost workers retried
        self.device = device
        self.task_options = {"max_retries": cfg.ray.max_retries,
                             **phase_resources(device, cfg.trainee_threads, cfg.ray.gpus_per_phase)}
        self.shards_location, self.local = str(shards_location), local  # local: the driver's view of the run
        self.start, self.rounds, self.inner_steps, self.schedule = start, cfg.rounds, cfg.inner_steps, schedule_steps
        self.num_trainees = len(plan.trainees)
        self.groups = ModuleGroups.of(plan, grid)
        with torch.device("meta"):
            skeleton = PathModel(grid, plan.paths[0], llama_config(cfg.model, shards.vocab_size, shards.eos_token_id))
        self.layout = {}
        for p in dict.fromkeys(plan.paths):
            self.layout.update(PathModel(grid, p, skeleton.config, skeleton.model).module_params)
        self.validator = {p: plan.paths.index(p) for p in plan.paths} if cfg.val_batches > 0 else {}
        self.val_sources = {p: [s for q, ss in plan.trainees if q == p for s in ss] for p in plan.paths}
        self.checkpoints = {r for r in checkpoint.list_rounds(local) if r <= start}
        self.executors = [_Executor.remote(store.run, store.lineage, k) for k in range(cfg.ray.executors)]
        self.ledger = Ledger.scan(store, start, self.rounds, self.num_trainees, self.groups, local, _say)
        self.inflight: dict = {}  # ObjectRef -> ("phase", i, v) | ("step", g, v) | ("val", path, v)
        self.quorum_since: dict[tuple[str, int], float] = {}
        self.next_round = start + 1
        self.bar = tqdm(total=(self.rounds - start) * self.num_trainees * self.inner_steps, desc=f"train {local.name if not store.storage.remote else store.run} (ray)", unit="step",
                        disable=not progress, dynamic_ncols=True, mininterval=1.0)
        self.bar.update(len(self.ledger.done) * self.inner_steps)
        self.metrics = open(local / "metrics.jsonl", "a", encoding="utf-8")
        self.counts = {"retried": 0, "dropped": 0, "storage_read": 0, "storage_written": 0}
        self.awaiting: set[tuple[str, int]] = set()  # validations storage lacks although their phase committed
        self.damaged = Damaged
        self.progress_at = self.said_at = time.time()

    # ----------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict:
        try:
            while self.next_round <= self.rounds:
                self.launch_ready()
                if not self.inflight:  # never wait on nothing: finish what storage holds, launch what it lacks, or end
                    self.complete_rounds()
                    if self.next_round > self.rounds:
                        break
                    self.launch_ready()
                    if not self.inflight:
                        raise DipacoError(missing(self))
                done, _ = ray.wait(list(self.inflight), num_returns=1, timeout=self.wait_s())
                for ref in done:
                    self.finish(ref)
                self.progress_at = time.time() if done else self.progress_at
                self.say_waiting()
                self.apply_quorum()
                self.complete_rounds()
        except LOSSES as exc:  # the connection to the cluster failed, not the run
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ClusterUnreachable(f"lost the Ray cluster ({type(exc).__name__}: {first}); resume (--resume) when it "
                                     f"is back, or run with --keep-going") from None
        finally:
            self.bar.close()
            self.metrics.close()
        return dict(self.counts)

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
            tasks = sorted({describe(*t) for t in self.inflight.values()})
            _say(f"waiting for machines: nothing came back for {now - self.progress_at:.0f} s and the cluster offers "
                 f"{' and '.join(short)}, fewer than one task asks for; {len(tasks)} tasks wait ({tasks[0]}"
                 f"{' ...' if len(tasks) > 1 else ''}); add nodes (`ray start --address ...`)")

    def wait_s(self) -> float:
        if not self.cfg.ray.quorum or not self.quorum_since:
            return 1.0
        return max(0.01, min(t + self.cfg.ray.grace - time.time() for t in self.quorum_since.values()))

    def settled(self, i: int, v: int) -> bool:
        return (i, v) in self.ledger.done or (i, v) in self.ledger.dropped

    def has_version(self, g: str, v: int) -> bool:
        return v == self.start or (g, v) in self.ledger.versions

    def busy(self) -> set:
        return set(self.inflight.values())

    def launch_ready(self) -> None:
        for kind, who, v in ready(self):
            if kind == "phase":
                self.launch_phase(who, v)
            elif kind == "step":
                self.launch_step(who, v)
            else:
                files = {m: self.module_ref(m, v) for m in self.grid.path_modules(who)}
                task = _validate.options(**self.task_options).remote(
                    self.store.run, self.store.lineage, self.shards_location, self.cfg, self.grid, who,
                    self.val_sources[who], v, files, self.device)
                self.inflight[task] = ("val", who, v)

    # ----------------------------------------------------------------------------------------------- what tasks read
    def module_ref(self, m: str, v: int) -> dict:
        """Version v of module m: round v's checkpoint when there is one (checkpoints win), else the queue's commit."""
        if v in self.checkpoints:
            return ref(f"checkpoints/round_{v}/modules/{m}.safetensors")
        g = self.groups.of_module[m]
        return self.store.object_ref(self.store.version_key(v, g), self.ledger.steps[(g, v)], f"{m}.safetensors")

    def outer_ref(self, g: str, v: int) -> dict:
        if v in self.checkpoints:
            return ref(f"checkpoints/round_{v}/state/outer.safetensors")
        return self.store.object_ref(self.store.version_key(v, g), self.ledger.steps[(g, v)], "outer.safetensors")

    def state_ref(self, i: int, v: int) -> tuple[dict, bool]:
        """(ref, is_exact) of trainee i's state at version v: the committed phase (i, v-1), or round v's checkpoint.
        After a dropped phase it is the state from before that phase (not exact: its step is moved to the round's)."""
        u = v
        while True:
            if u in self.checkpoints:  # assembled from this queue: the phase's checksum holds for the copy too
                body = self.ledger.phases.get((i, u - 1)) if (i, u - 1) not in self.ledger.dropped else None
                digest = body["objects"]["state.pt"]["sha256"] if body and "state.pt" in body["objects"] else ""
                return ref(f"checkpoints/round_{u}/state/trainee_{i}.pt", digest), u == v
            if (i, u - 1) not in self.ledger.dropped:
                body = self.ledger.phases[(i, u - 1)]
                if "state.pt" not in body["objects"]:  # sticky: in the cache of the node that trained it
                    return self.replay_ref(i, u), u == v
                return self.store.object_ref(self.store.phase_key(u - 1, i), body, "state.pt"), u == v
            u -= 1

    def replay_ref(self, i: int, v: int) -> dict:
        """Trainee i's state at v, kept only in a node cache (``dipaco.taskqueue.phases.durable_state``): its checksum
        (the cache's key) and, for a phase that runs where that cache is gone, its last durable state and the rounds
        since, each with its modules' refs. Checkpoint rounds are durable, so the rounds lie after the last checkpoint,
        whose queue entries are kept."""
        path = self.plan.trainees[i][0]
        rounds, u = [v - 1], v - 1
        while u not in self.checkpoints and "state.pt" not in self.ledger.phases[(i, u - 1)]["objects"]:
            u -= 1
            rounds.append(u)
        start, _ = self.state_ref(i, u)
        steps = [{"version": w, "modules": {m: self.module_ref(m, w) for m in self.grid.path_modules(path)}}
                 for w in reversed(rounds)]
        return {**ref("", self.ledger.phases[(i, v - 1)]["record"]["state_sha256"]), "replay": {"from": start, "rounds": steps}}

    def launch_phase(self, i: int, v: int) -> None:
        path, sources = self.plan.trainees[i]
        state, exact = self.state_ref(i, v)
        files = {m: self.module_ref(m, v) for m in self.grid.path_modules(path)}
        validate = phase_validates(self, i, v)
        spec = PhaseSpec(self.store.run, self.store.lineage, self.shards_location, self.cfg, self.grid, i, path, sources, v,
                         self.schedule, files, state, exact, validate, self.val_sources[path], self.device)
        options = dict(self.task_options)
        last = self.ledger.phases.get((i, v - 1))  # the committed phase before it: its node caches the state
        node = last["record"].get("node") if last and (i, v - 1) not in self.ledger.dropped else None
        if self.cfg.ray.sticky and node:
            # a state in storage too: that node if it has a free CPU now, else any (a miss costs one download); a
            # state only in that node's cache: wait for the node while it lives (a miss costs a replay)
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True,
                                                                            _spill_on_unavailable="replay" not in state)
        self.inflight[_phase.options(**options).remote(spec)] = ("phase", i, v)

    def launch_step(self, g: str, v: int) -> None:
        contributors = [i for i in self.groups.members[g] if (i, v) in self.ledger.done]
        weights = {m: self.plan.weights[m] for m in self.groups.modules[g]}
        if len(contributors) < len(self.groups.members[g]):  # a quorum dropped some: the rest share the whole weight
            weights = {m: renormalised(ws, contributors) for m, ws in weights.items()}
        deltas = {i: self.store.object_ref(self.store.phase_key(v, i), self.ledger.phases[(i, v)], "deltas.safetensors")
                  for i in contributors}
        spec = StepSpec(self.store.run, self.store.lineage, self.cfg, g, v, {m: self.layout[m] for m in self.groups.modules[g]},
                        {m: self.module_ref(m, v) for m in self.groups.modules[g]}, self.outer_ref(g, v), deltas, weights,
                        {m: len(self.grid.paths_through(m)) for m in self.groups.modules[g]})
        executor = self.executors[list(self.groups.modules).index(g) % len(self.executors)]
        self.inflight[executor.step.remote(spec)] = ("step", g, v)

    def finish(self, ref) -> None:
        kind, who, v = self.inflight.pop(ref)
        try:
            result = ray.get(ref)
        except TaskCancelledError:
            return  # a dropped phase, stopped
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, DipacoError):
                raise DipacoError(str(cause)) from None
            raise DipacoError(f"{describe(kind, who, v)} failed: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as exc:
            limited = self.cfg.ray.max_retries >= 0 and isinstance(exc, (ray.exceptions.WorkerCrashedError,
                                                                         ray.exceptions.NodeDiedError))
            if not limited:  # machines or the connection lost: not an error of the run (--keep-going waits)
                raise ClusterUnreachable(f"{describe(kind, who, v)} was lost with its machines ({type(exc).__name__}); "
                                         f"resume (--resume) when the cluster is back, or run with --keep-going") from None
            raise DipacoError(f"{describe(kind, who, v)} was lost {self.cfg.ray.max_retries + 1} times "
                              f"({type(exc).__name__}); check the cluster's workers, or set ray.max_retries=-1 "
                              f"(without limit, the default)") from None
        if kind == "phase" and (who, v) not in self.ledger.dropped:
            self.ledger.phases[(who, v)] = self.store.read_commit(self.store.phase_key(v, who))
            self.ledger.done.add((who, v))
            self.bar.update(self.inner_steps)
        elif kind == "step":
            self.ledger.steps[(who, v + 1)] = self.store.read_commit(self.store.version_key(v + 1, who))
            self.ledger.versions.add((who, v + 1))
            if all((g, v + 1) in self.ledger.versions for g in self.groups.modules):
                self.ledger.finished_at[v + 1] = time.time()
            self.quorum_since.pop((who, v), None)
        elif kind == "val":
            self.ledger.val_loss[(who, v)] = result

    def apply_quorum(self) -> None:
        """A group whose quorum of phases is in and whose grace has passed drops its late phases (for every module)."""
        q, now, busy = self.cfg.ray.quorum, time.time(), self.busy()
        if not q:
            return
        for g, trainees in self.groups.members.items():
            v = next((v for v in range(self.start, self.rounds) if (g, v + 1) not in self.ledger.versions), None)
            if v is None or ("step", g, v) in busy:
                continue
            late = [i for i in trainees if not self.settled(i, v)]
            if not late or len(trainees) - len(late) - sum((i, v) in self.ledger.dropped for i in trainees) < min(q, len(trainees)):
                continue
            since = self.quorum_since.setdefault((g, v), now)
            if now - since < self.cfg.ray.grace:
                continue
            for i in late:
                self.store.drop(v, i, f"late for the outer step of {g} (quorum {q}, grace {self.cfg.ray.grace} s)")
                self.ledger.dropped.add((i, v))
                self.counts["dropped"] += 1
                for ref, task in list(self.inflight.items()):
                    if task == ("phase", i, v):
                        ray.cancel(ref)  # interrupts it; its worker process lives on for the next phase

    # ----------------------------------------------------------------------------------------------- rounds
    def complete_rounds(self) -> None:
        """Log (and checkpoint) every finished round, in order, then forget what no task can read any more."""
        while self.next_round <= self.rounds:
            v = self.next_round
            if not (all(self.settled(i, v - 1) for i in range(self.num_trainees)) and all((g, v) in self.ledger.versions for g in self.groups.modules)):
                return
            val = self.val_losses(v)
            if val is None:
                return
            if v not in self.ledger.logged:
                self.log_round(v, val)
            if v % self.cfg.checkpoint_every == 0 or v == self.rounds:
                states = [(*self.state_ref(i, v), v * self.inner_steps) for i in range(self.num_trainees)]
                assemble(self.store, self.local, v, {m: self.module_ref(m, v) for m in self.groups.of_module},
                         [self.outer_ref(g, v) for g in self.groups.modules], states,
                         {"trainee_paths": self.plan.paths, "engine": "ray"})
                previous = max(self.checkpoints)
                self.checkpoints.add(v)
                self.store.forget_before(previous)  # tasks still running read versions >= the previous checkpoint
            self.next_round += 1
        self.store.storage.delete("queue")  # the last round is a checkpoint: the queue holds nothing more

    def val_losses(self, v: int) -> dict[str, float] | None:
        return val_losses(self, v)

    def log_round(self, v: int, val: dict[str, float]) -> None:
        losses = log_round(self, v, val, workers=int(ray.cluster_resources().get("CPU", 0)))
        push(self.local, self.store.storage, ["metrics.jsonl"])  # a run in a bucket: its metrics there too
        self.bar.set_postfix(round=v, loss=f"{sum(losses) / max(1, len(losses)):.3f}")
