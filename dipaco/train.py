"""The round loop: every trainee takes H inner AdamW steps, then every module takes one outer step.

A *trainee* is one path replica with its own data and its own AdamW state (kept across rounds).
DiPaCo: one trainee per path on the path's shard. Dense baseline (grid '1'): one trainee on all
shards pooled. DiLoCo (grid '1' + grid.replicas_per_shard): one trainee per shard, same path.

Workers: with no launcher every trainee runs in this process (a world of one). Under torchrun the
trainees are split into contiguous runs over the ranks (trainee i on rank ⌊i·N/T⌋); a worker builds
only its trainees and holds only the modules their paths use. When modules sync is ``dipaco.sync``
(plain rounds or Streaming DiLoCo fragments); the transport is ``dipaco.comm``. Checkpoints: every
worker writes its trainees' states and the modules it is the lowest-rank holder of into the round's
directory; rank 0 gathers the outer buffers, completes the round and writes metrics. The run directory
must be shared by all workers (one machine, or a shared file system across nodes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import dipaco
from dipaco import checkpoint
from dipaco.comm import make_world
from dipaco.config import InnerConfig, TrainConfig, from_dict, read_toml, to_dict, to_toml
from dipaco.errors import DipacoError
from dipaco.grid import Grid, format_grid, parse_grid
from dipaco.io import atomic_write_text, read_json, write_json
from dipaco.model import PathModel, count_parameters, init_modules, llama_config, new_model
from dipaco.outer import OuterOptimizer, module_weights
from dipaco.run import build_grid, check_dense_source, init_from_dense
from dipaco.sync import ModuleSync
from dipaco.shards import BatchSampler, ShardSet


@dataclass
class Trainee:
    index: int
    path: str            # the grid path it trains
    sources: list[str]   # the shard paths it reads
    size: int            # training tokens: its weight in the module averages
    model: PathModel
    optimizer: torch.optim.AdamW
    sampler: BatchSampler
    step: int = 0

    def state(self, with_params: bool = False) -> dict:
        out = {"optimizer": _to_cpu(self.optimizer.state_dict()), "step": self.step, "sampler": self.sampler.state()}
        if with_params:  # streaming: local weights differ from the global ones at a round boundary
            out["params"] = {n: p.detach().cpu().clone() for n, p in self.model.params.items()}
        return out

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.sampler.set_state(state["sampler"])
        with torch.no_grad():
            for n, t in state.get("params", {}).items():
                self.model.params[n].copy_(t)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def plan_trainees(grid: Grid, shards: ShardSet, cfg: TrainConfig) -> list[tuple[str, list[str]]]:
    """(grid path, shard paths it reads) for every trainee."""
    if grid.shape == parse_grid(shards.grid):
        return [(p, [p]) for p in shards.paths]
    if grid.num_paths == 1:
        if cfg.grid.replicas_per_shard:
            return [(grid.paths[0], [p]) for p in shards.paths]
        return [(grid.paths[0], shards.paths)]
    raise DipacoError(f"training grid {format_grid(grid.shape)} does not match the shards' grid {shards.grid}; "
                      f"leave grid.shape empty, use '1' for the dense baseline, or re-shard with --grid {format_grid(grid.shape)}")


def assign(num_trainees: int, workers: int) -> list[int]:
    """The rank of every trainee: contiguous runs, as even as possible."""
    if workers > num_trainees:
        raise DipacoError(f"{workers} workers but only {num_trainees} trainees; use at most {num_trainees} workers "
                          f"(or more trainees: a larger grid or grid.replicas_per_shard)")
    return [i * workers // num_trainees for i in range(num_trainees)]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise DipacoError("device 'cuda' requested but CUDA is not available; use --device cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def make_trainee(index, path, sources, grid, shards, cfg: TrainConfig, device=torch.device("cpu")) -> Trainee:
    model = PathModel(grid, path, llama_config(cfg.model, shards.vocab_size, shards.eos_token_id),
                      new_model(llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)).to(device))
    decay = [p for p in model.params.values() if p.dim() >= 2]
    no_decay = [p for p in model.params.values() if p.dim() < 2]
    # foreach: the multi-tensor AdamW (torch's default on CUDA; on CPU it does the same per-tensor arithmetic in
    # the same order, so the weights are bit-identical to the single-tensor loop, and a step takes ~40% less time)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.inner.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2), foreach=True)
    sampler = BatchSampler([shards.tokens(s) for s in sources], cfg.model.max_seq_len, cfg.inner.batch_size,
                           seed=cfg.seed * 1000 + index + 1, names=sources)
    size = trainee_size(shards, sources)
    return Trainee(index, path, sources, size, model, optimizer, sampler)


def trainee_size(shards: ShardSet, sources: list[str]) -> int:
    return sum(shards.train_tokens(s) for s in sources)


def lr_at(step: int, total: int, inner: InnerConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio of the peak at step ``total`` (the schedule's length,
    fixed when the run is created: ``schedule_steps``); steps past it keep that final lr."""
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = min(1.0, (step - inner.warmup_steps) / max(1, total - inner.warmup_steps))
    return inner.lr * (inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # no KV cache: nothing reads it
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def inner_step(tr: Trainee, cfg: TrainConfig, total_steps: int) -> torch.Tensor:
    """One AdamW step; returns the detached loss (read with .item() later: no device sync per step)."""
    lr = lr_at(tr.step, total_steps, cfg.inner)
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    device = next(iter(tr.model.params.values())).device
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = next_token_loss(tr.model.model, tr.sampler.next().to(device))
    loss.backward()
    if cfg.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(tr.model.model.parameters(), cfg.inner.grad_clip)
    tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step += 1
    return loss.detach()


def fixed_windows(arrays: list[np.ndarray], count: int, seq_len: int) -> torch.Tensor | None:
    """``count`` evenly spaced windows over the arrays: the same tokens every round."""
    usable = [a for a in arrays if len(a) > seq_len + 1]
    if not usable or count <= 0:
        return None
    rows = []
    for j in range(count):
        a = usable[j % len(usable)]
        k = j // len(usable)
        per = max(1, math.ceil(count / len(usable)))
        start = int((len(a) - seq_len - 1) * k / per)
        rows.append(torch.from_numpy(np.asarray(a[start:start + seq_len + 1], dtype=np.int64)))
    return torch.stack(rows)


@torch.no_grad()
def validate(modules, val_models: dict[str, PathModel], val_windows: dict[str, torch.Tensor], batch_size: int) -> dict[str, float]:
    """Loss of the global weights of every path on its fixed validation windows."""
    out = {}
    for path, model in val_models.items():
        windows = val_windows.get(path)
        if windows is None:
            continue
        model.load_modules(modules)
        model.model.eval()
        device = next(iter(model.params.values())).device
        losses = [next_token_loss(model.model, windows[i:i + batch_size].to(device)).item() * len(windows[i:i + batch_size])
                  for i in range(0, len(windows), batch_size)]
        out[path] = sum(losses) / len(windows)
    return out


# inner_steps too: a round's global steps (r·H + 1 ...) and the trainees' step counters must keep lining up
_COMPATIBLE_SECTIONS = ("model", "grid", "inner", "outer", "streaming", "seed", "inner_steps")


def check_resumable(cfg: TrainConfig, run_dir: Path, resume: bool, shards: ShardSet) -> int:
    """The round a run in ``run_dir`` would start from, or the error that says why it cannot (no side effects)."""
    latest = checkpoint.latest_round(run_dir) if run_dir.exists() else None
    if latest is not None and not resume:
        raise DipacoError(f"{run_dir} already holds a run (round {latest}); pass --resume to continue it or choose another --out")
    if latest is None:
        return 0
    old = to_dict(from_dict(TrainConfig, read_toml(run_dir / "config.toml")))
    new = to_dict(cfg)
    for key in _COMPATIBLE_SECTIONS:
        if old[key] != new[key]:
            raise DipacoError(f"cannot resume {run_dir}: its config '{key}' differs from the one given; "
                              f"resume with the run's own config ({run_dir / 'config.toml'}) or train into a new --out")
    info = read_json(run_dir / "run.json", "run description")
    if info["shards_fingerprint"] != shards.fingerprint:
        raise DipacoError(f"cannot resume {run_dir}: it was trained on other shards ({info['shards_dir']}); pass those --shards")
    return latest


def schedule_steps(run_dir: Path) -> int:
    """The lr schedule's length in inner steps, fixed when the run was created (run.json; runs made before it
    was recorded: their config.toml, which is written once, at creation). Extending a run with --resume and
    more --rounds does not stretch the cosine: the extra steps run at the final lr."""
    info = read_json(run_dir / "run.json", "run description")
    if "schedule_steps" in info:
        return int(info["schedule_steps"])
    first = from_dict(TrainConfig, read_toml(run_dir / "config.toml"))
    return first.rounds * first.inner_steps


def prepare_run(cfg: TrainConfig, run_dir: Path, resume: bool, shards: ShardSet, grid: Grid) -> int:
    """Check or create the run directory; return the round to start from."""
    latest = check_resumable(cfg, run_dir, resume, shards)
    if latest:
        checkpoint.remove_partial_rounds(run_dir)
    return latest


def preflight(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool, workers: int) -> None:
    """Every check a worker would make on its inputs, made once before ``--workers`` launches torchrun, so that
    bad input gets one line and exit code 2 instead of an error per worker and a launcher traceback."""
    shards = ShardSet(shards_dir)
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    assign(len(plan_trainees(grid, shards, cfg)), workers)
    resolve_device(cfg.device)
    check_resumable(cfg, Path(run_dir), resume, shards)
    if cfg.init_from:
        check_dense_source(cfg.init_from, shards)


@dataclass
class Setup:
    """Everything a worker builds before its first round."""
    grid: Grid
    plan: list[tuple[str, list[str]]]   # every trainee's (path, sources), all ranks
    ranks: list[int]                    # every trainee's rank
    trainees: list[Trainee]             # this worker's trainees
    weights: dict[str, dict[int, float]]
    modules: dict[str, dict[str, torch.Tensor]]  # global weights of the modules this worker holds
    outer: OuterOptimizer
    sync: ModuleSync
    val_models: dict[str, PathModel]    # paths this worker validates (it is their lowest-rank holder)
    val_windows: dict[str, torch.Tensor]
    param_counts: dict[str, int]


def build(cfg: TrainConfig, shards: ShardSet, grid: Grid, world, device: torch.device) -> Setup:
    torch.manual_seed(cfg.seed)
    plan = plan_trainees(grid, shards, cfg)
    ranks = assign(len(plan), world.size)
    mine = [i for i, r in enumerate(ranks) if r == world.rank]
    trainees = [make_trainee(i, *plan[i], grid, shards, cfg, device) for i in mine]
    weights = module_weights([grid.path_modules(p) for p, _ in plan], [trainee_size(shards, s) for _, s in plan])
    world.setup({m: {i: ranks[i] for i in ws} for m, ws in weights.items()})
    config = llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)
    held = [m for m, ws in weights.items() if any(ranks[i] == world.rank for i in ws)]
    every = init_modules(grid, config, cfg.seed)
    counts = {"total": count_parameters(every), "per_path": count_parameters(every, grid.path_modules(plan[0][0]))}
    modules = {m: t for m, t in every.items() if m in held}
    del every
    if cfg.init_from:
        init_from_dense(modules, cfg.init_from, shards)
    modules = {m: {n: t.to(device) for n, t in ts.items()} for m, ts in modules.items()}
    outer = OuterOptimizer(modules, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    sync = ModuleSync(cfg, modules, outer, trainees, weights, {m: len(grid.paths_through(m)) for m in modules}, world)
    paths = {p: min(ranks[i] for i, (q, _) in enumerate(plan) if q == p) for p, _ in plan}
    val_models = {p: PathModel(grid, p, config, new_model(config).to(device)) for p, r in paths.items() if r == world.rank}
    val_windows = {p: fixed_windows([shards.tokens(s, "val") for q, sources in plan if q == p for s in sources],
                                    cfg.val_batches * cfg.inner.batch_size, cfg.model.max_seq_len) for p in val_models}
    return Setup(grid, plan, ranks, trainees, weights, modules, outer, sync, val_models, val_windows, counts)


def write_run_info(cfg, run_dir: Path, shards: ShardSet, shards_dir, grid: Grid, su: Setup, world) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.toml", to_toml(cfg))
    write_json(run_dir / "run.json", {
        "grid": format_grid(grid.shape), "grid_detail": grid.describe(), "vocab_size": shards.vocab_size,
        "eos_token_id": shards.eos_token_id, "shards_dir": str(Path(shards_dir).resolve()),
        "shards_fingerprint": shards.fingerprint, "shards_grid": shards.grid,
        "tokenizer_sha256": shards.manifest["tokenizer"]["sha256"],
        "trainees": [{"path": p, "sources": s, "tokens": trainee_size(shards, s), "worker": r}
                     for (p, s), r in zip(su.plan, su.ranks)],
        "workers": world.size,
        "schedule_steps": cfg.rounds * cfg.inner_steps,  # the lr schedule's length, kept when a run is extended
        "parameters": su.param_counts,
        "versions": {"dipaco": dipaco.__version__, "torch": torch.__version__}})
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)


def start_round(cfg, run_dir: Path, resume: bool, shards: ShardSet, shards_dir, grid: Grid, su: Setup,
                world) -> tuple[int, int]:
    """Rank 0 checks (or creates) the run directory; every rank gets the round to start from and the lr
    schedule's length (or the error)."""
    result = None
    if world.rank == 0:
        try:
            start = prepare_run(cfg, run_dir, resume, shards, grid)
            if start == 0:
                write_run_info(cfg, run_dir, shards, shards_dir, grid, su, world)
            result = (start, schedule_steps(run_dir))
        except DipacoError as exc:
            result = exc
    result = world.broadcast(result if world.rank == 0 else None)
    if isinstance(result, DipacoError):
        raise DipacoError(str(result))
    result, total = result
    if result > 0:
        load_round(run_dir, result, su)
    if result == 0 or not su.sync.keeps_local_weights:
        for tr in su.trainees:  # a round starts from the global weights; AdamW state stays local
            tr.model.load_modules(su.modules)
    if result == 0:
        save_round(run_dir, 0, su, world)
    return result, total


def load_round(run_dir: Path, r: int, su: Setup) -> None:
    device = next(iter(next(iter(su.modules.values())).values())).device
    for m, tensors in checkpoint.load_modules(run_dir, r, list(su.modules)).items():
        for n, t in tensors.items():
            su.modules[m][n].copy_(t)
    outer_state, trainee_states, _ = checkpoint.load_state(run_dir, r, [tr.index for tr in su.trainees])
    su.outer.load_state_dict({k: v.to(device) for k, v in outer_state.items() if k.split("/", 1)[0] in su.modules})
    for tr, state in zip(su.trainees, trainee_states):
        tr.load_state(state)
    su.sync.load_state(checkpoint.load_sync(run_dir, r), device)


def save_round(run_dir: Path, r: int, su: Setup, world) -> None:
    """Every worker writes its trainees' states and the modules it is the lowest-rank holder of straight into
    the round's temporary directory (made by rank 0); rank 0 gathers the small rest (outer buffers, streamed
    reductions), completes the round and moves ``latest``; every rank learns whether that worked."""
    owned = [m for m in su.modules if _holders(su, m)[0] == world.rank]
    pending = su.sync.state()  # waits for reductions still in flight
    tmp = world.broadcast(_attempt(lambda: str(checkpoint.begin_round(run_dir, r))) if world.rank == 0 else None)
    error = tmp if isinstance(tmp, DipacoError) else _attempt(lambda: _write_part(Path(tmp), su, owned), world.rank)
    outer = su.outer.state_dict()
    part = {"error": error,
            "outer": {k: v.detach().cpu() for k, v in outer.items() if k.split("/", 1)[0] in owned},
            "sync": [{**p, "grads": {m: g for m, g in p["grads"].items() if m in owned}} for p in pending]}
    parts = world.gather(part)
    outcome = None
    if world.rank == 0:
        outcome = next((p["error"] for p in parts if isinstance(p["error"], DipacoError)), None)
        if outcome is None:
            outcome = _attempt(lambda: _finish(run_dir, r, Path(tmp), su, parts))
        if isinstance(outcome, DipacoError) and not isinstance(tmp, DipacoError):
            checkpoint.abort_round(Path(tmp))
    outcome = world.broadcast(outcome)
    if isinstance(outcome, DipacoError):
        raise DipacoError(str(outcome))


def _attempt(fn, rank: int = 0):
    """fn()'s result, or its exception as a DipacoError (to pass to the other ranks instead of hanging them)."""
    try:
        return fn()
    except DipacoError as exc:
        return exc
    except Exception as exc:
        return DipacoError(f"writing the checkpoint failed on worker {rank}: {type(exc).__name__}: {exc}")


def _write_part(tmp: Path, su: Setup, owned: list[str]) -> None:
    checkpoint.write_modules(tmp, {m: su.modules[m] for m in owned})
    checkpoint.write_trainees(tmp, {tr.index: tr.state(su.sync.keeps_local_weights) for tr in su.trainees})


def _finish(run_dir: Path, r: int, tmp: Path, su: Setup, parts: list[dict]) -> None:
    outer_state = {k: v for p in parts for k, v in p["outer"].items()}
    pending = {}
    for p in parts:
        for d in p["sync"]:
            pending.setdefault((d["started"], d["fragment"]), {**d, "grads": {}})["grads"].update(d["grads"])
    checkpoint.finish_round(run_dir, r, tmp, list(su.weights), outer_state, len(su.plan),
                            {"trainee_paths": [p for p, _ in su.plan]}, [pending[k] for k in sorted(pending)])


def _holders(su: Setup, m: str) -> list[int]:
    return sorted({su.ranks[i] for i in su.weights[m]})


def train(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
    shards, run_dir = ShardSet(shards_dir), Path(run_dir)
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    device = resolve_device(cfg.device)
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun restarted us
    world = make_world(cfg, str(device))
    try:
        return _train(cfg, shards, shards_dir, run_dir, resume, progress, grid, device, world)
    finally:
        world.close()


def _train(cfg, shards, shards_dir, run_dir, resume, progress, grid, device, world) -> dict:
    su = build(cfg, shards, grid, world, device)
    start, total = start_round(cfg, run_dir, resume, shards, shards_dir, grid, su, world)  # total: lr schedule steps
    H = cfg.inner_steps
    metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if world.rank == 0 else None
    bar = tqdm(total=max(0, cfg.rounds - start) * H * len(su.trainees), desc=f"train {run_dir.name}", unit="step",
               disable=not progress or world.rank != 0, dynamic_ncols=True, mininterval=1.0)
    for r in range(start, cfg.rounds):
        began, compute, step_losses, inner_logs = time.perf_counter(), 0.0, {tr.index: [] for tr in su.trainees}, []
        before = world.stats()  # cumulative: a reduction still in flight is counted in the round it ends in
        for tr in su.trainees:
            tr.model.model.train()
        for t in range(r * H + 1, (r + 1) * H + 1):
            tic = time.perf_counter()
            for tr in su.trainees:
                loss = inner_step(tr, cfg, total)
                step_losses[tr.index].append(loss)
                if cfg.log_every and tr.step % cfg.log_every == 0:
                    inner_logs.append(dict(kind="inner", round=r + 1, step=tr.step, trainee=tr.index, path=tr.path,
                                           loss=loss, lr=tr.optimizer.param_groups[0]["lr"]))
            bar.update(len(su.trainees))
            compute += time.perf_counter() - tic
            su.sync.after_step(t)
        if r + 1 == cfg.rounds:
            su.sync.flush()
        losses = round_losses(step_losses, inner_logs, H)
        val = validate(su.modules, su.val_models, su.val_windows, cfg.inner.batch_size) if cfg.val_batches else {}
        report = world.gather({"losses": losses, "val": val, "inner": inner_logs, "compute_s": compute,
                               "seconds": time.perf_counter() - began,
                               **{k: v - before[k] for k, v in world.stats().items()}})
        if metrics is not None:
            log_round(metrics, r + 1, report, cfg, len(su.plan))
            bar.set_postfix(round=r + 1, loss=f"{sum(sum(p['losses'].values()) for p in report) / len(su.plan):.3f}")
        if (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds:
            save_round(run_dir, r + 1, su, world)
    bar.close()
    if metrics is not None:
        metrics.close()
    write_worker_report(run_dir, su, world)
    return {"run": str(run_dir), "rounds": cfg.rounds, "grid": format_grid(grid.shape), "trainees": len(su.plan),
            "workers": world.size}


def round_losses(step_losses: dict[int, list[torch.Tensor]], inner_logs: list[dict], H: int) -> dict[int, float]:
    """Every trainee's mean inner loss of the round, read from the device once per round (not per step);
    the logged losses (tensors until now) become floats."""
    values = {i: torch.stack(ls).tolist() if ls else [] for i, ls in step_losses.items()}
    for rec in inner_logs:
        rec["loss"] = rec["loss"].item()
    losses = {}
    for i, vs in values.items():
        total = 0.0
        for v in vs:  # the same float additions, in the same order, as summing every step's loss.item() / H
            total += v / H
        losses[i] = total
    return losses


def write_worker_report(run_dir: Path, su: Setup, world) -> None:
    """RUN/workers/rank_<r>.json: this worker's trainees, the modules it holds (with a digest of their
    final global weights, equal on all holders) and the bytes it exchanged per module."""
    digests = {m: hashlib.sha256(b"".join(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                          for t in ts.values())).hexdigest() for m, ts in su.modules.items()}
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "workers" / f"rank_{world.rank}.json", {
        "rank": world.rank, "workers": world.size, "trainees": [tr.index for tr in su.trainees],
        "modules": digests, "module_bytes": world.module_bytes})


def log_round(metrics, r: int, report: list[dict], cfg: TrainConfig, num_trainees: int) -> None:
    """One 'round' line (plus the buffered 'inner' lines) from every worker's report."""
    for rec in sorted((x for p in report for x in p["inner"]), key=lambda x: (x["step"], x["trainee"])):
        log(metrics, **rec)
    losses = {i: l for p in report for i, l in p["losses"].items()}
    losses = [losses[i] for i in range(num_trainees)]
    val = {k: v for p in report for k, v in p["val"].items()}
    seconds = max(p["seconds"] for p in report)
    tokens = cfg.inner_steps * num_trainees * cfg.inner.batch_size * cfg.model.max_seq_len
    by_rank = {k: [p[k] for p in report] for k in ("bytes_sent", "bytes_received", "compute_s", "comm_s", "wait_s")}
    log(metrics, kind="round", round=r, train_loss=sum(losses) / len(losses), train_loss_by_trainee=losses,
        val_loss=val, val_loss_mean=(sum(val.values()) / len(val)) if val else None, seconds=seconds, tokens=tokens,
        tokens_per_s=tokens / seconds, workers=len(report), bytes_sent=sum(by_rank["bytes_sent"]),
        bytes_received=sum(by_rank["bytes_received"]), compute_s=sum(by_rank["compute_s"]) / len(report),
        comm_s=sum(by_rank["comm_s"]) / len(report), wait_s=sum(by_rank["wait_s"]) / len(report),
        by_worker=by_rank)


def log(stream, **record) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()
