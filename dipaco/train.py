"""The round loop: every trainee takes H inner AdamW steps, then every module takes one outer step.

A *trainee* is one path replica with its own data and its own AdamW state (kept across rounds).
DiPaCo: one trainee per path on the path's shard. Dense baseline (grid '1'): one trainee on all
shards pooled. DiLoCo (grid '1' + grid.replicas_per_shard): one trainee per shard, same path.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import dipaco
from dipaco import checkpoint
from dipaco.comm import LocalWorld
from dipaco.config import InnerConfig, TrainConfig, from_dict, read_toml, to_dict, to_toml
from dipaco.errors import DipacoError
from dipaco.grid import Grid, format_grid, parse_grid
from dipaco.io import atomic_write_text, write_json
from dipaco.model import PathModel, count_parameters, init_modules, llama_config
from dipaco.outer import OuterOptimizer, add_weighted_outer_gradient, module_weights, sqrt_rescale, zeros_like_module
from dipaco.run import build_grid
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

    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step, "sampler": self.sampler.state()}

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.sampler.set_state(state["sampler"])


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


def make_trainee(index, path, sources, grid, shards, cfg: TrainConfig) -> Trainee:
    model = PathModel(grid, path, llama_config(cfg.model, shards.vocab_size, shards.eos_token_id))
    decay = [p for p in model.params.values() if p.dim() >= 2]
    no_decay = [p for p in model.params.values() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.inner.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2))
    sampler = BatchSampler([shards.tokens(s) for s in sources], cfg.model.max_seq_len, cfg.inner.batch_size,
                           seed=cfg.seed * 1000 + index + 1, names=sources)
    size = sum(shards.train_tokens(s) for s in sources)
    return Trainee(index, path, sources, size, model, optimizer, sampler)


def lr_at(step: int, total: int, inner: InnerConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio of the peak at the last step."""
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = min(1.0, (step - inner.warmup_steps) / max(1, total - inner.warmup_steps))
    return inner.lr * (inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def inner_step(tr: Trainee, cfg: TrainConfig, total_steps: int) -> float:
    lr = lr_at(tr.step, total_steps, cfg.inner)
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    loss = next_token_loss(tr.model.model, tr.sampler.next())
    loss.backward()
    if cfg.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(tr.model.model.parameters(), cfg.inner.grad_clip)
    tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step += 1
    return loss.item()


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
        losses = [next_token_loss(model.model, windows[i:i + batch_size]).item() * len(windows[i:i + batch_size])
                  for i in range(0, len(windows), batch_size)]
        out[path] = sum(losses) / len(windows)
    return out


_COMPATIBLE_SECTIONS = ("model", "grid", "inner", "outer", "seed")


def prepare_run(cfg: TrainConfig, run_dir: Path, resume: bool, shards: ShardSet, grid: Grid) -> int:
    """Check or create the run directory; return the round to start from."""
    latest = checkpoint.latest_round(run_dir) if run_dir.exists() else None
    if latest is not None and not resume:
        raise DipacoError(f"{run_dir} already holds a run (round {latest}); pass --resume to continue it or choose another --out")
    if latest is None:
        return 0
    checkpoint.remove_partial_rounds(run_dir)
    old = to_dict(from_dict(TrainConfig, read_toml(run_dir / "config.toml")))
    new = to_dict(cfg)
    for key in _COMPATIBLE_SECTIONS:
        if old[key] != new[key]:
            raise DipacoError(f"cannot resume {run_dir}: its config '{key}' differs from the one given; "
                              f"resume with the run's own config ({run_dir / 'config.toml'}) or train into a new --out")
    info = json.loads((run_dir / "run.json").read_text())
    if info["shards_fingerprint"] != shards.fingerprint:
        raise DipacoError(f"cannot resume {run_dir}: it was trained on other shards ({info['shards_dir']}); pass those --shards")
    return latest


def train(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
    shards, run_dir = ShardSet(shards_dir), Path(run_dir)
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    start = prepare_run(cfg, run_dir, resume, shards, grid)
    torch.manual_seed(cfg.seed)
    trainees = [make_trainee(i, p, s, grid, shards, cfg) for i, (p, s) in enumerate(plan_trainees(grid, shards, cfg))]
    weights = module_weights([tr.model.modules for tr in trainees], [tr.size for tr in trainees])
    val_models = {p: PathModel(grid, p, trainees[0].model.config) for p in dict.fromkeys(tr.path for tr in trainees)}
    val_windows = {p: fixed_windows([shards.tokens(s, "val") for tr in trainees if tr.path == p for s in tr.sources],
                                    cfg.val_batches * cfg.inner.batch_size, cfg.model.max_seq_len) for p in val_models}
    if start == 0:
        modules = init_modules(grid, trainees[0].model.config, cfg.seed)
        outer = OuterOptimizer(modules, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.toml", to_toml(cfg))
        write_json(run_dir / "run.json", {
            "grid": format_grid(grid.shape), "grid_detail": grid.describe(), "vocab_size": shards.vocab_size,
            "eos_token_id": shards.eos_token_id, "shards_dir": str(Path(shards_dir).resolve()),
            "shards_fingerprint": shards.fingerprint, "shards_grid": shards.grid,
            "tokenizer_sha256": shards.manifest["tokenizer"]["sha256"],
            "trainees": [{"path": tr.path, "sources": tr.sources, "tokens": tr.size} for tr in trainees],
            "parameters": {"total": count_parameters(modules),
                           "per_path": count_parameters(modules, trainees[0].model.modules)},
            "versions": {"dipaco": dipaco.__version__, "torch": torch.__version__}})
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        save_round(run_dir, 0, modules, outer, trainees)
    else:
        modules = checkpoint.load_modules(run_dir, start)
        outer = OuterOptimizer(modules, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        outer_state, trainee_states, _ = checkpoint.load_state(run_dir, start)
        outer.load_state_dict(outer_state)
        for tr, state in zip(trainees, trainee_states):
            tr.load_state(state)

    world, H, total = LocalWorld(), cfg.inner_steps, cfg.rounds * cfg.inner_steps
    metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
    bar = tqdm(total=(cfg.rounds - start) * H * len(trainees), desc=f"train {run_dir.name}", unit="step",
               disable=not progress, dynamic_ncols=True)
    for r in range(start, cfg.rounds):
        began, losses = time.perf_counter(), [0.0] * len(trainees)
        for tr in trainees:  # every round starts from the global weights; AdamW state stays local
            tr.model.load_modules(modules)
            tr.model.model.train()
        for t in range(H):
            for tr in trainees:
                loss = inner_step(tr, cfg, total)
                losses[tr.index] += loss / H
                if cfg.log_every and tr.step % cfg.log_every == 0:
                    log(metrics, kind="inner", round=r + 1, step=tr.step, trainee=tr.index, path=tr.path, loss=loss,
                        lr=tr.optimizer.param_groups[0]["lr"])
                bar.update()
        for m, contributors in weights.items():  # outer step, module by module
            grad = zeros_like_module(modules[m])
            for i, w in contributors.items():
                add_weighted_outer_gradient(grad, modules[m], trainees[i].model.module_tensors(m), w)
            world.reduce_module(m, grad)
            if cfg.grid.sqrt_rescale:
                sqrt_rescale(grad, len(grid.paths_through(m)))
            outer.step(m, grad)
        val = validate(modules, val_models, val_windows, cfg.inner.batch_size) if cfg.val_batches else {}
        seconds = time.perf_counter() - began
        tokens = H * len(trainees) * cfg.inner.batch_size * cfg.model.max_seq_len
        log(metrics, kind="round", round=r + 1, train_loss=sum(losses) / len(losses),
            train_loss_by_trainee=losses, val_loss=val, val_loss_mean=(sum(val.values()) / len(val)) if val else None,
            seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, bytes_sent=world.bytes_sent)
        bar.set_postfix(round=r + 1, loss=f"{sum(losses) / len(losses):.3f}")
        save_round(run_dir, r + 1, modules, outer, trainees)
    bar.close()
    metrics.close()
    return {"run": str(run_dir), "rounds": cfg.rounds, "grid": format_grid(grid.shape), "trainees": len(trainees)}


def save_round(run_dir: Path, r: int, modules, outer: OuterOptimizer, trainees: list[Trainee]) -> None:
    checkpoint.save_round(run_dir, r, modules, outer.state_dict(), [tr.state() for tr in trainees],
                          {"trainee_paths": [tr.path for tr in trainees]})


def log(stream, **record) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()
