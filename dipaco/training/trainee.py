"""One trainee, built the same way by every engine: a path replica with its own data and its own AdamW state (kept
across rounds). What it does in a round (the inner step, the lr schedule, validation) is ``dipaco.training.phase``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dipaco.config import TrainConfig
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


_models: dict = {}  # per process: one model to train in per shape and device (a process running many phases builds one)


def reusable_model(cfg: TrainConfig, shards, device: torch.device):
    """A model of the run's shape on ``device`` for ``make_trainee(model=...)``, built once per process."""
    config = llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)
    key = (config.to_json_string(), str(device))
    if key not in _models:
        _models[key] = new_model(config).to(device)
    return _models[key]
