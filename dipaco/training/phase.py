"""One phase: what a trainee does in one round, the one function every training engine calls. An engine only decides
where and when phases run (this process, local worker processes, torchrun ranks, Ray tasks).

  ``train_phase``           given a trainee (its state loaded) and its path's modules at version v (the global weights):
                          the validation of those weights (when asked), H inner steps from them, and the result: the
                          outer gradients ``Δ_i = θ_global − θ_i`` of its modules, its mean loss and inner records (the
                          trainee itself holds the new state)
  ``Phase``               the inner steps of one trainee's round, one at a time: ``train_phase`` takes them all at once;
                          Streaming DiLoCo's in-process loop takes every trainee's step t, then the fragment syncs due
                          after t (``dipaco.training.sync``), so fragments are averaged mid-round
  ``validation_windows``  a path's fixed validation windows (the same tokens every round, on every engine)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.training.engine_steps import inner_record
from dipaco.training.outer import outer_gradient

if TYPE_CHECKING:  # annotations only: the one phase stays on the lowest floors (every engine imports it)
    from dipaco.config import InnerConfig, TrainConfig
    from dipaco.model.path_model import PathModel
    from dipaco.training.trainee import Trainee


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


@dataclass
class PhaseResult:
    """What a phase returns besides the trainee's new state (held by the trainee)."""
    trainee: int
    loss: float                                   # the mean inner loss of the round
    inner: list[dict]                             # its inner-step records (losses as floats)
    deltas: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> Δ_i, in model order
    val: float | None = None                      # the validation loss of the global weights, when asked
    val_s: float = 0.0
    compute_s: float = 0.0


class Phase:
    """Trainee ``trainee``'s inner steps of round ``version + 1`` (lr from a schedule of ``schedule_steps`` steps)."""

    def __init__(self, trainee: Trainee, cfg: TrainConfig, version: int, schedule_steps: int):
        self.trainee, self.cfg, self.version, self.schedule_steps = trainee, cfg, version, schedule_steps
        self.losses: list[torch.Tensor] = []
        self.inner: list[dict] = []
        trainee.model.model.train()

    def step(self) -> None:
        """One AdamW step; its loss stays on the device until ``finish`` (no device sync per step)."""
        loss = inner_step(self.trainee, self.cfg, self.schedule_steps)
        self.losses.append(loss)
        if (record := inner_record(self.cfg, self.trainee, self.version + 1, loss)) is not None:
            self.inner.append(record)

    def finish(self) -> PhaseResult:
        i = self.trainee.index
        loss = round_losses({i: self.losses}, self.inner, self.cfg.inner_steps)[i]
        return PhaseResult(i, loss, self.inner)


def train_phase(trainee: Trainee, cfg: TrainConfig, version: int, schedule_steps: int,
              modules: dict[str, dict[str, torch.Tensor]], validation: Callable | None = None) -> PhaseResult:
    """Trainee ``trainee``'s round ``version + 1`` from ``modules`` (module -> tensors: at least its path's modules at
    version ``version``); ``validation(model)``: the validation loss of the global weights loaded in ``model``, taken
    before the first step. Returns the phase's result with every module's Δ_i."""
    trainee.model.load_modules(modules)
    glob = {m: {n: modules[m][n] for n in names} for m, names in trainee.model.module_params.items()}
    began = time.perf_counter()
    val = validation(trainee.model) if validation is not None else None
    validated = time.perf_counter()
    phase = Phase(trainee, cfg, version, schedule_steps)
    for _ in range(cfg.inner_steps):
        phase.step()
    result = phase.finish()
    result.deltas = {m: outer_gradient(g, trainee.model.module_tensors(m)) for m, g in glob.items()}
    result.val, result.val_s, result.compute_s = val, validated - began, time.perf_counter() - validated
    return result


def validation_windows(cfg: TrainConfig, shards, sources: list[str]) -> torch.Tensor | None:
    """A path's validation windows: ``val_batches`` batches evenly spaced over the validation files of ``sources``
    (all its trainees' shards); None when they hold no window."""
    return fixed_windows([shards.tokens(s, "val") for s in sources], cfg.val_batches * cfg.inner.batch_size,
                         cfg.model.max_seq_len)
