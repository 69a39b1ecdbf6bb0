"""The outer step: per-module weighted outer gradients and outer Nesterov SGD. No torch.distributed.

Outer gradient of module m from trainee i: ``Δ_i = θ_m(global) − θ_m(trainee i)`` (old minus new).
Module average: ``Δ_m = Σ_i w_i Δ_i`` over the trainees whose path contains m, with ``w_i`` proportional
to the trainee's shard size and summing to 1 over those trainees (DiPaCo Eq. 2-3); optionally
rescaled by ``sqrt(#paths through m)`` (DiPaCo §2.7). Everything here is fp32.
"""

from __future__ import annotations

import math

import torch


def module_weights(trainee_modules: list[list[str]], trainee_sizes: list[float]) -> dict[str, dict[int, float]]:
    """For every module: {trainee index: weight}, weights ∝ size and summing to 1 over the module's trainees."""
    raw: dict[str, dict[int, float]] = {}
    for i, (modules, size) in enumerate(zip(trainee_modules, trainee_sizes)):
        for m in modules:
            raw.setdefault(m, {})[i] = float(size)
    out = {}
    for m, sizes in raw.items():
        total = sum(sizes.values())
        out[m] = {i: (s / total if total > 0 else 1.0 / len(sizes)) for i, s in sizes.items()}
    return out


@torch.no_grad()
def add_weighted_outer_gradient(accumulator: dict[str, torch.Tensor], global_tensors: dict[str, torch.Tensor],
                                local_tensors: dict[str, torch.Tensor], weight: float) -> None:
    """accumulator += weight * (global - local), in fp32 (accumulator starts at zeros)."""
    for name, acc in accumulator.items():
        acc.add_(global_tensors[name] - local_tensors[name].detach().float(), alpha=weight)


def zeros_like_module(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t, dtype=torch.float32) for n, t in tensors.items()}


def sqrt_rescale(grad: dict[str, torch.Tensor], paths_through: int) -> None:
    for t in grad.values():
        t.mul_(math.sqrt(paths_through))


class OuterOptimizer:
    """SGD with (Nesterov) momentum over the global module tensors; buffers are per module.

    The update matches ``torch.optim.SGD(nesterov=True, dampening=0)``:
    ``b ← μ b + g``; ``θ ← θ − lr (g + μ b)`` (or ``θ − lr b`` without Nesterov).
    """

    def __init__(self, modules: dict[str, dict[str, torch.Tensor]], lr: float, momentum: float, nesterov: bool = True):
        self.modules, self.lr, self.momentum, self.nesterov = modules, lr, momentum, nesterov
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, module: str, grad: dict[str, torch.Tensor]) -> None:
        buffers = self.buffers.setdefault(module, {})
        for name, g in grad.items():  # a streamed fragment steps only some of the module's tensors
            if name not in buffers:
                buffers[name] = torch.zeros_like(g)
            buf = buffers[name].mul_(self.momentum).add_(g)
            update = g + self.momentum * buf if self.nesterov else buf
            self.modules[module][name].sub_(update, alpha=self.lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{m}/{n}": t for m, bufs in self.buffers.items() for n, t in bufs.items()}

    def load_state_dict(self, flat: dict[str, torch.Tensor]) -> None:
        self.buffers = {}
        for key, tensor in flat.items():
            module, name = key.split("/", 1)
            self.buffers.setdefault(module, {})[name] = tensor.clone()
