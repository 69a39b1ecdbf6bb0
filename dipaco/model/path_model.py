"""The path model: a transformers ``LlamaForCausalLM`` assembled from a path's module tensors.

Module tensors are keyed by the Hugging Face parameter names (``model.layers.3.mlp.up_proj.weight``),
so a path's state dict is just the union of its modules' dicts, and an exported path is a plain
Llama checkpoint.
"""

from __future__ import annotations

import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.config import ModelConfig
from dipaco.model.grid import Grid

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def llama_config(model: ModelConfig, vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=model.max_seq_len,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        attn_implementation="sdpa",
    )


def component_of(param_name: str) -> str:
    """Which grid component (``embed``, ``head``, ``block.{b}``) owns a parameter. A tied output head has no
    parameter of its own (named_parameters lists it once, as the embedding): it goes with ``embed``."""
    if param_name.startswith("model.embed_tokens."):
        return "embed"
    if param_name.startswith(("model.norm.", "lm_head.")):
        return "head"
    match = _BLOCK.match(param_name)
    if match:
        return f"block.{int(match.group(1))}"
    raise ValueError(f"parameter {param_name} belongs to no grid component")


def new_model(config: LlamaConfig, seed: int | None = None) -> LlamaForCausalLM:
    if seed is not None:
        torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = config.eos_token_id
    return model


class PathModel:
    """One path's dense model plus the map from its modules to its parameters."""

    def __init__(self, grid: Grid, path: str, config: LlamaConfig, model: LlamaForCausalLM | None = None):
        self.grid, self.path, self.config = grid, path, config
        self.model = model if model is not None else new_model(config)
        # named_parameters() lists a tied weight once (as the embedding), which is what we want.
        self.params = dict(self.model.named_parameters())
        by_component: dict[str, list[str]] = {}
        for name in self.params:
            by_component.setdefault(component_of(name), []).append(name)
        self.module_params = {
            m: [n for c in grid.module_components(m) for n in by_component.get(c, [])]
            for m in grid.path_modules(path)
        }

    @property
    def modules(self) -> list[str]:
        return list(self.module_params)

    @torch.no_grad()
    def load_modules(self, modules: dict[str, dict[str, torch.Tensor]], only: list[str] | None = None) -> None:
        """Copy module tensors into the model (all of this path's modules, or ``only`` those)."""
        for m in only if only is not None else self.module_params:
            tensors = modules[m]
            for name in self.module_params[m]:
                self.params[name].copy_(tensors[name])

    def module_tensors(self, module: str) -> dict[str, torch.Tensor]:
        """Live views of one module's parameters in this model."""
        return {name: self.params[name] for name in self.module_params[module]}


def init_modules(grid: Grid, config: LlamaConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every module starts from one seeded dense model (as every DiPaCo path starts from one model)."""
    reference = new_model(config, seed)
    params = dict(reference.named_parameters())
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for path in grid.paths:
        view = PathModel(grid, path, config, reference)
        for m, names in view.module_params.items():
            if m not in modules:
                modules[m] = {n: params[n].detach().clone().float() for n in names}
    return modules


def count_parameters(modules: dict[str, dict[str, torch.Tensor]], names: list[str] | None = None) -> int:
    chosen = modules if names is None else {m: modules[m] for m in names}
    return sum(t.numel() for tensors in chosen.values() for t in tensors.values())
