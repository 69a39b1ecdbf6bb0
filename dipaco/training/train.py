"""The round loop: every trainee takes H inner AdamW steps, then every module takes one outer step.

    for r in rounds:
        worker.run_round(r)   every trainee's phase (dipaco.training.phase: H inner steps from the global weights),
                              on the runner (dipaco.training.local_workers: this process, or local worker processes
                              side by side), then sync.after_step (dipaco.training.sync: the module averages and the
                              outer steps); Streaming DiLoCo: every trainee's step t, then the fragment syncs due after t
        validate -> log the round (dipaco.training.round_log) -> checkpoint (dipaco.storage.checkpoint.Checkpointer)

A *trainee* (``dipaco.training.trainee``) is one path replica with its own data and its own AdamW state (kept across rounds).
DiPaCo: one trainee per path on the path's shard. Dense baseline (grid '1'): one trainee on all
shards pooled. DiLoCo (grid '1' + grid.replicas_per_shard): one trainee per shard, same path.

Workers: with no launcher every trainee belongs to this process (a world of one), its phases run here or in local
worker processes (the outer step stays here: the same bits for any count). Under torchrun the
trainees are split into contiguous runs over the ranks (``dipaco.training.plan.Plan``); a worker builds only its
trainees and holds only the modules their paths use. The transport is ``dipaco.training.comm``; the run
directory's lifecycle (checks, creation, resume, round 0) is ``dipaco.storage.run.RunDirectory``. The run
directory must be shared by all workers (one machine, or a shared file system across nodes).
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import closing
from pathlib import Path

import torch

from dipaco.config import TrainConfig
from dipaco.io import write_json
from dipaco.model.grid import Grid, format_grid
from dipaco.model.path_model import PathModel, llama_config, new_model
from dipaco.storage import checkpoint
from dipaco.storage.run import RunDirectory, build_grid, initial_modules
from dipaco.storage.shards import ShardSet
from dipaco.training.comm import World, make_world
from dipaco.training.devices import deterministic, resolve_device
from dipaco.training.local_workers import InProcess, WorkerPool, default_workers
from dipaco.training.outer import OuterOptimizer
from dipaco.training.phase import Phase, validate, validation_windows
from dipaco.training.plan import Plan
from dipaco.training.round_log import RoundLog, phase_tokens
from dipaco.training.sync import ModuleSync, streams
from dipaco.training.trackers import Trackers
from dipaco.training.trainee import Trainee, make_trainee


def train(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool = False, progress: bool = True,
          workers: int | None = 1) -> dict:
    """Train (or with ``resume`` continue) the run ``run_dir``: this process's share of it under torchrun.
    ``workers``: local worker processes that run this process's phases side by side (None: one per core, at most one
    per trainee; 1: every phase in this process); the modules are the same bits for any count."""
    shards, run_dir = ShardSet(shards_dir), Path(run_dir)
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    device = resolve_device(cfg.device)
    deterministic(device)  # same bits as the Ray engine's phases on the same GPU (and as a rerun)
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun restarted us
    torch.set_num_threads(cfg.trainee_threads)  # threads per trainee: every engine pins the same count (the same bits)
    with closing(make_world(cfg, str(device))) as world:
        torch.manual_seed(cfg.seed)
        plan = Plan.make(cfg, grid, shards, world.size)
        worker = Worker.build(cfg, shards, grid, plan, world, device)
        validator = Validator(cfg, shards, grid, plan, world.rank, device)
        checkpointer = checkpoint.Checkpointer(run_dir, world, list(plan.weights), plan.paths)
        start, schedule = RunDirectory(run_dir, cfg, shards).begin(resume, world, grid, plan, worker, checkpointer)
        gather = RoundGather(run_dir, cfg, world, len(plan.trainees), max(0, cfg.rounds - start) * len(worker.trainees),
                             progress, norms=lambda: worker.outer.module_norms(worker.owned))
        to_train = len(worker.trainees) if start < cfg.rounds else 0  # a finished run starts no worker process
        with closing(phase_runner(cfg, shards_dir, grid, to_train, device, workers)) as runner:
            for r in range(start, cfg.rounds):
                report = worker.run_round(r, schedule, runner, gather.log.advance)  # the phases, the module averages
                if r + 1 == cfg.rounds:
                    worker.sync.flush()                       # the run's last round applies what is still in flight
                gather.round(r + 1, report, validator(worker.modules))
                if (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds:
                    checkpointer.save(r + 1, worker.part())
        gather.close()
        write_worker_report(run_dir, worker, world)
    return {"run": str(run_dir), "rounds": cfg.rounds, "grid": format_grid(grid.shape), "trainees": len(plan.trainees),
            "workers": world.size}


def phase_runner(cfg: TrainConfig, shards_dir, grid: Grid, trainees: int, device: torch.device, workers: int | None):
    """Where this process's ``trainees`` phases run: side by side in local worker processes where a round is its
    trainees' phases from the global weights on the CPU, else in this process."""
    count = default_workers(trainees) if workers is None else min(workers, trainees)
    if count > 1 and not streams(cfg) and device.type == "cpu":
        return WorkerPool(cfg, shards_dir, grid, count)
    return InProcess(cfg)


class Worker:
    """This worker's share of the run: its trainees, the global weights of the modules their paths use
    (``modules``), and those modules' outer optimizer and sync; ``owned``: the modules it writes to a
    checkpoint (it is their lowest-rank holder)."""

    def __init__(self, cfg: TrainConfig, trainees: list[Trainee], modules: dict[str, dict[str, torch.Tensor]],
                 outer: OuterOptimizer, sync: ModuleSync, owned: list[str], world: World, parameters: dict[str, int]):
        self.cfg, self.trainees, self.modules, self.outer, self.sync = cfg, trainees, modules, outer, sync
        self.owned, self.world, self.parameters = owned, world, parameters  # parameters: counts for run.json
        self.device = next(iter(next(iter(modules.values())).values())).device

    @classmethod
    def build(cls, cfg: TrainConfig, shards: ShardSet, grid: Grid, plan: Plan, world: World, device: torch.device) -> "Worker":
        mine = [i for i, r in enumerate(plan.ranks) if r == world.rank]
        trainees = [make_trainee(i, *plan.trainees[i], grid, shards, cfg, device) for i in mine]
        world.setup(plan.holders())
        held = {m for m in plan.weights if world.rank in plan.holder_ranks(m)}
        modules, counts = initial_modules(cfg, grid, shards, plan.paths[0], keep=held)
        modules = {m: {n: t.to(device) for n, t in ts.items()} for m, ts in modules.items()}
        outer = OuterOptimizer(modules, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        sync = ModuleSync(cfg, modules, outer, trainees, plan.weights, {m: len(grid.paths_through(m)) for m in modules}, world)
        owned = [m for m in modules if plan.holder_ranks(m)[0] == world.rank]
        return cls(cfg, trainees, modules, outer, sync, owned, world, counts)

    def start(self, part: checkpoint.Part | None) -> None:
        """Start from a checkpoint's part (resume), or from the initial global weights (None)."""
        if part is not None:
            for m, tensors in part.modules.items():
                for n, t in tensors.items():
                    self.modules[m][n].copy_(t)
            self.outer.load_state_dict({k: v.to(self.device) for k, v in part.outer.items()})
            for tr in self.trainees:
                tr.load_state(part.trainees[tr.index])
            self.sync.load_state(part.sync, self.device)
        if part is None or not self.sync.keeps_local_weights:
            for tr in self.trainees:  # a round starts from the global weights; AdamW state stays local
                tr.model.load_modules(self.modules)

    def run_round(self, r: int, schedule_steps: int, runner, advance) -> dict:
        """Round r + 1 of this worker's trainees, with the module averages due in it; returns its report
        (``RoundGather.round`` adds the time and bytes when it gathers)."""
        began, H = time.perf_counter(), self.cfg.inner_steps
        if self.sync.keeps_local_weights:
            results, compute = self.lockstep(r, schedule_steps, advance)
        else:
            results = runner.run(self.trainees, r, schedule_steps, self.modules, advance)
            compute = time.perf_counter() - began
            for res in results:
                self.sync.arrive(res.trainee, res.deltas)
            self.sync.after_step((r + 1) * H)
        return {"losses": {res.trainee: res.loss for res in results}, "inner": [x for res in results for x in res.inner],
                "compute_s": compute, "began": began}

    def lockstep(self, r: int, schedule_steps: int, advance) -> tuple[list, float]:
        """Streaming DiLoCo's round: every trainee's step t, then the fragment syncs due after t; (results, compute s)."""
        phases, compute, H = [Phase(tr, self.cfg, r, schedule_steps) for tr in self.trainees], 0.0, self.cfg.inner_steps
        for t in range(r * H + 1, (r + 1) * H + 1):
            tic = time.perf_counter()
            for phase in phases:
                phase.step()
            compute += time.perf_counter() - tic
            self.sync.after_step(t)                           # start the module averages due after t, apply those due at t
            advance(len(phases))
        return [phase.finish() for phase in phases], compute

    def part(self) -> checkpoint.Part:
        """This worker's share of a checkpoint (waits for the reductions in flight)."""
        pending, outer = self.sync.state(), self.outer.state_dict()
        return checkpoint.Part(
            modules={m: self.modules[m] for m in self.owned},
            trainees={tr.index: tr.state(self.sync.keeps_local_weights) for tr in self.trainees},
            outer={k: v.detach().cpu() for k, v in outer.items() if k.split("/", 1)[0] in self.owned},
            sync=[{**p, "grads": {m: g for m, g in p["grads"].items() if m in self.owned}} for p in pending])


class Validator:
    """Validation of the paths this worker validates (it is their lowest-rank trainer) on fixed windows."""

    def __init__(self, cfg: TrainConfig, shards: ShardSet, grid: Grid, plan: Plan, rank: int, device: torch.device):
        config = llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)
        self.models = {p: PathModel(grid, p, config, new_model(config).to(device))
                       for p, r in plan.validator_ranks().items() if r == rank}
        self.windows = {p: validation_windows(cfg, shards, [s for q, sources in plan.trainees if q == p for s in sources])
                        for p in self.models}
        self.batch_size, self.enabled = cfg.inner.batch_size, cfg.val_batches > 0

    def __call__(self, modules) -> dict[str, float]:
        return validate(modules, self.models, self.windows, self.batch_size) if self.enabled else {}


class RoundGather:
    """Every worker's round report, gathered to rank 0, which writes it to the run's round log
    (``dipaco.training.round_log``)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, world: World, num_trainees: int, rounds: int, progress: bool,
                 norms=dict):
        """``rounds``: the progress bar's length in rounds of this worker's trainees; ``norms()``: the norms of the
        modules this worker owns after the round's outer steps (``OuterOptimizer.module_norms``)."""
        self.cfg, self.world, self.num_trainees, self.norms = cfg, world, num_trainees, norms
        # bytes and comm/wait seconds since the previous round's line: a reduction counts in the line of the round
        # it ends in, also when it ends between two rounds (while validating or checkpointing); counting from each
        # round's start lost those, so a run's total depended on timing
        self.counted = world.stats()
        self.trackers = Trackers.open(run_dir, cfg.log) if world.rank == 0 else None  # --log-to: the same records
        self.log = RoundLog(run_dir, rounds * cfg.inner_steps, f"train {run_dir.name}", progress, writes=world.rank == 0,
                            listeners=[self.trackers] if self.trackers else [])

    def round(self, r: int, report: dict, val: dict[str, float]) -> None:
        stats = self.world.stats()
        reports = self.world.gather({"losses": report["losses"], "val": val, "inner": report["inner"],
                                     "compute_s": report["compute_s"], "seconds": time.perf_counter() - report["began"],
                                     "module_norms": self.norms(), **{k: v - self.counted[k] for k, v in stats.items()}})
        self.counted = stats
        if self.world.rank != 0:
            return
        losses = {i: l for p in reports for i, l in p["losses"].items()}
        by_rank = {k: [p[k] for p in reports] for k in ("bytes_sent", "bytes_received", "compute_s", "comm_s", "wait_s")}
        mean = {k: sum(by_rank[k]) / len(reports) for k in ("compute_s", "comm_s", "wait_s")}
        self.log.round(r, [losses[i] for i in range(self.num_trainees)], {k: v for p in reports for k, v in p["val"].items()},
                       seconds=max(p["seconds"] for p in reports), tokens=phase_tokens(self.cfg) * self.num_trainees,
                       workers=len(reports), bytes_sent=sum(by_rank["bytes_sent"]),
                       bytes_received=sum(by_rank["bytes_received"]), inner=[x for p in reports for x in p["inner"]],
                       **mean, module_norms={m: n for p in reports for m, n in p["module_norms"].items()}, by_worker=by_rank)

    def close(self) -> None:
        self.log.close()
        if self.trackers is not None:
            self.trackers.close()


def write_worker_report(run_dir: Path, worker: Worker, world: World) -> None:
    """RUN/workers/rank_<r>.json: this worker's trainees, the modules it holds (with a digest of their
    final global weights, equal on all holders) and the bytes it exchanged per module."""
    digests = {m: hashlib.sha256(b"".join(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                          for t in ts.values())).hexdigest() for m, ts in worker.modules.items()}
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "workers" / f"rank_{world.rank}.json", {
        "rank": world.rank, "workers": world.size, "trainees": [tr.index for tr in worker.trainees],
        "modules": digests, "module_bytes": world.module_bytes})
