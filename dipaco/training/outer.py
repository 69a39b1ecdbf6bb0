"""The outer step: outer gradients, their per-module weighted average, outer Nesterov SGD. No torch.distributed.

Outer gradient of module m from trainee i: ``Δ_i = θ_m(global) − θ_m(trainee i)`` (old minus new).
Module average (``module_average``, weights from ``module_weights``): ``Δ_m = Σ_i w_i Δ_i`` over the
trainees whose path contains m, with ``w_i`` proportional to the trainee's training tokens and summing to
1 over those trainees (DiPaCo Eq. 2-3); optionally rescaled by ``sqrt(#paths through m)`` (DiPaCo §2.7).
Everything here is fp32. With a quantized transport (``comm.bits`` < 32) the module's gradient is
``Q_down(Σ_i w_i deq(Q_up(Δ_i)))`` on every layout (``dipaco.training.comm``); ``module_average`` is the one place
where the terms are added.
"""

from __future__ import annotations

import math

import torch


def module_weights(trainee_modules: list[list[str]], trainee_sizes: list[float]) -> dict[str, dict[int, float]]:
    """For every module: {trainee index: w_i}, ``w_i = size_i / Σ_j size_j`` over the module's trainees j (so
    they sum to 1; equal weights if every size is 0). ``trainee_modules[i]``: the modules of trainee i's path."""
    raw: dict[str, dict[int, float]] = {}
    for i, (modules, size) in enumerate(zip(trainee_modules, trainee_sizes)):
        for m in modules:
            raw.setdefault(m, {})[i] = float(size)
    out = {}
    for m, sizes in raw.items():
        total = sum(sizes.values())
        out[m] = {i: (s / total if total > 0 else 1.0 / len(sizes)) for i, s in sizes.items()}
    return out


def renormalised(weights: dict[int, float], contributors: list[int]) -> dict[int, float]:
    """A module's weights over a subset of its trainees (the Ray engine's quorum dropped the others), rescaled to
    sum to 1 again: the trainees present share the whole outer step."""
    total = sum(weights[i] for i in contributors)
    return {i: (weights[i] / total if total > 0 else 1.0 / len(contributors)) for i in contributors}


@torch.no_grad()
def outer_gradient(global_tensors: dict[str, torch.Tensor], local_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ_i = global - local (old minus new), fp32, for the names of ``global_tensors``."""
    return {name: g - local_tensors[name].detach().float() for name, g in global_tensors.items()}


@torch.no_grad()
def module_average(vectors: dict[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """The weighted average of a module's outer gradients, ``Δ_m = Σ_i w_i·Δ_i`` in fp32, added in
    trainee-index order (``vectors``: trainee -> Δ_i, all one shape; ``weights``: ``module_weights``'s w_i,
    normalised over all the module's trainees: ``w_i = tokens_i / Σ_j tokens_j``, no division here).
    Given a subset of the trainees it returns their share of the average (a worker's partial sum at
    32 bits, added up by the holders). Every world reduces through this one function, so the same
    contributions give the same bits whichever worker holds which trainee, and a reduce-scatter chunk
    sums to the same bits as that slice of the whole vector."""
    order = sorted(vectors)
    total = torch.zeros_like(vectors[order[0]], dtype=torch.float32)
    for i in order:
        # multiply, then add: two correctly rounded element-wise ops. add_(alpha=w) may fuse them (FMA) in the
        # vectorized body of a CPU kernel and not in its scalar tail, so the bits could depend on slice lengths.
        total.add_(vectors[i] * weights[i])
    return total


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
        # per module and tensor: the squared norms of the last outer gradient and update applied to it (a streamed
        # fragment steps some tensors at a time, so a module's norms add up its tensors' latest steps)
        self.last_squares: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.no_grad()
    def step(self, module: str, grad: dict[str, torch.Tensor]) -> None:
        buffers = self.buffers.setdefault(module, {})
        squares = self.last_squares.setdefault(module, {})
        for name, g in grad.items():  # a streamed fragment steps only some of the module's tensors
            if name not in buffers:
                buffers[name] = torch.zeros_like(g)
            buf = buffers[name].mul_(self.momentum).add_(g)
            update = g + self.momentum * buf if self.nesterov else buf
            self.modules[module][name].sub_(update, alpha=self.lr)
            squares[name] = (g.square().sum(), update.square().sum())  # read-only: the step's bits stay as they were

    def module_norms(self, modules) -> dict[str, dict[str, float]]:
        """For each of ``modules`` that has taken an outer step: the L2 norms of its last outer gradient (as applied,
        after any rescaling), of its last update (lr times the Nesterov direction: how far the weights moved) and of
        its momentum buffer, each over all of the module's tensors."""
        out = {}
        for m in modules:
            if not self.last_squares.get(m):
                continue
            grad_sq, update_sq = (sum(float(sq[k]) for sq in self.last_squares[m].values()) for k in (0, 1))
            momentum_sq = sum(float(b.square().sum()) for b in self.buffers[m].values())
            out[m] = {"outer_grad_norm": grad_sq ** 0.5, "update_norm": self.lr * update_sq ** 0.5,
                      "momentum_norm": momentum_sq ** 0.5}
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{m}/{n}": t for m, bufs in self.buffers.items() for n, t in bufs.items()}

    def load_state_dict(self, flat: dict[str, torch.Tensor]) -> None:
        self.buffers = {}
        for key, tensor in flat.items():
            module, name = key.split("/", 1)
            self.buffers.setdefault(module, {})[name] = tensor.clone()
