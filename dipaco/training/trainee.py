"""One trainee and its inner step, shared by every engine (the synchronous round loop in ``dipaco.training.train`` and
the Ray task queue's phases in ``dipaco.taskqueue.phases``): one implementation of the AdamW step, the lr schedule, the
fixed validation windows and the loss bookkeeping, so the engines compute the same bits.

A *trainee* is one path replica with its own data and its own AdamW state (kept across rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.config import InnerConfig, TrainConfig
from dipaco.model.path_model import PathModel, llama_config, new_model
from dipaco.storage.shards import BatchSampler


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


def make_trainee(index, path, sources, grid, shards, cfg: TrainConfig, device=torch.device("cpu"), model=None) -> Trainee:
    """Trainee ``index`` on ``path`` reading the shard paths ``sources``; ``model``: a LlamaForCausalLM of the run's
    shape to train in (reused by a process that runs many phases; its weights are loaded before any step), else a
    new one on ``device``."""
    config = llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)
    model = PathModel(grid, path, config, model if model is not None else new_model(config).to(device))
    decay = [p for p in model.params.values() if p.dim() >= 2]
    no_decay = [p for p in model.params.values() if p.dim() < 2]
    # foreach: the multi-tensor AdamW (torch's default on CUDA; on CPU it does the same per-tensor arithmetic in
    # the same order, so the weights are bit-identical to the single-tensor loop, with fewer kernel launches)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.inner.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2), foreach=True)
    sampler = BatchSampler([shards.tokens(s) for s in sources], cfg.model.max_seq_len, cfg.inner.batch_size,
                           seed=cfg.seed * 1000 + index + 1, names=sources)
    size = shards.tokens_of(sources)
    return Trainee(index, path, sources, size, model, optimizer, sampler)


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
