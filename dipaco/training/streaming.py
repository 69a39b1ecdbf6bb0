"""Streaming DiLoCo (arXiv 2501.18512): fragments, their sync schedule, and the τ/α merge. Pure.

Fragments are global over the model's blocks and cut every module the same way:

  strided (default)  block b is in fragment ``b mod F``
  sequential         blocks split into F contiguous runs (the first ``num_layers mod F`` runs one longer)

The embedding joins fragment 0 and the final norm / output head join the fragment of the last
block. A module's fragment f is the module's parameters in fragment f (possibly empty: skipped).

Schedule: inner steps are counted globally, ``t = 1, 2, ...`` (t = the number of inner steps done).
Fragment f starts a sync after step t when ``(t − offset_f) mod H == 0`` with ``offset_f = f·H/F``
(offsets spread evenly over H; fragment 0 syncs at the end of every round). The reduction started
at t is applied after step ``t + τ``: the outer optimizer steps the global fragment with the
reduced outer gradient, then every local copy merges ``θ_local ← α·θ_local + (1−α)·θ_global``.
F = 1, τ = 0, α = 0 is plain DiLoCo / DiPaCo (replace the local weights by the new global ones).
"""

from __future__ import annotations

import torch

from dipaco.model.path_model import component_of


def block_fragment(block: int, num_layers: int, fragments: int, layout: str = "strided") -> int:
    if layout == "strided":
        return block % fragments
    base, extra = divmod(num_layers, fragments)
    bounds, start = [], 0
    for f in range(fragments):
        start += base + (1 if f < extra else 0)
        bounds.append(start)
    return next(f for f, end in enumerate(bounds) if block < end)


def fragment_of(param_name: str, num_layers: int, fragments: int, layout: str = "strided") -> int:
    """The fragment a model parameter belongs to."""
    comp = component_of(param_name)
    if comp == "embed":
        return 0
    if comp == "head":
        return block_fragment(num_layers - 1, num_layers, fragments, layout)
    return block_fragment(int(comp.split(".")[1]), num_layers, fragments, layout)


def split_fragments(names, num_layers: int, fragments: int, layout: str = "strided") -> list[list[str]]:
    """Parameter names grouped by fragment (order kept within each fragment)."""
    out: list[list[str]] = [[] for _ in range(fragments)]
    for n in names:
        out[fragment_of(n, num_layers, fragments, layout)].append(n)
    return out


def offsets(H: int, fragments: int) -> list[int]:
    return [f * H // fragments for f in range(fragments)]


def syncs_at(t: int, H: int, fragments: int) -> list[int]:
    """Fragments whose sync starts after global inner step ``t`` (t >= 1)."""
    return [f for f, o in enumerate(offsets(H, fragments)) if t >= o and (t - o) % H == 0] if t >= 1 else []


@torch.no_grad()
def merge(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> None:
    """θ_local ← α·θ_local + (1−α)·θ_global, in place (α = 0 replaces)."""
    if alpha == 0.0:
        local.copy_(global_)
    else:
        local.mul_(alpha).add_(global_.to(local.dtype), alpha=1.0 - alpha)
