"""The module grid: levels, modules, paths. Pure Python, no tensors.

A path takes one module per level; ``shape = (K_1, ..., K_L)`` gives ``prod(K_l)`` paths. Path ids
join the chosen module index of every level with '-' ("0-1" on a 2x2 grid, "3" on a flat grid).

Module ids:
  ``embed`` / ``head``          the shared input embedding / final norm and output head
  ``L{l}.E{k}``                 module k of level l (the level's blocks that are not private)
  ``B{b}@{path}``, ``embed@{path}``, ``head@{path}``   components a path keeps private
A component is ``embed``, ``head`` or ``block.{b}``; model.py maps components to parameters. With tied
embeddings (the default) the output head's weight *is* the embedding, so it belongs to ``embed`` and
``head`` holds only the final norm; the config refuses a private head whose weight is a shared embedding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from dipaco.errors import DipacoError


def parse_grid(text: str) -> tuple[int, ...]:
    """'2x2' -> (2, 2); '5' -> (5,); '1' -> (1,)."""
    parts = str(text).lower().strip().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise DipacoError(f"grid {text!r} is not valid; write modules per level like 2x2, 4 or 1") from None
    if not shape or any(k < 1 for k in shape):
        raise DipacoError(f"grid {text!r} is not valid; every level needs at least one module (e.g. 2x2)")
    return shape


def format_grid(shape: tuple[int, ...]) -> str:
    return "x".join(str(k) for k in shape)


@dataclass(frozen=True)
class Grid:
    shape: tuple[int, ...]
    level_blocks: tuple[tuple[int, ...], ...]
    private_blocks: frozenset[int] = frozenset()
    private_embedding: bool = False
    private_head: bool = False

    @classmethod
    def build(cls, shape, num_blocks: int, level_sizes=(), private_blocks=(), private_embedding=False,
              private_head=False) -> "Grid":
        shape = parse_grid(shape) if isinstance(shape, str) else tuple(shape)
        levels = len(shape)
        if level_sizes:
            if len(level_sizes) != levels or sum(level_sizes) != num_blocks or min(level_sizes) < 1:
                raise DipacoError(
                    f"grid.level_sizes {list(level_sizes)} does not fit: need {levels} positive sizes summing to "
                    f"model.num_layers={num_blocks}")
            sizes = list(level_sizes)
        else:
            if num_blocks < levels:
                raise DipacoError(
                    f"grid {format_grid(shape)} has {levels} levels but the model has only {num_blocks} blocks; "
                    f"use fewer levels or raise model.num_layers")
            base, extra = divmod(num_blocks, levels)
            sizes = [base + (1 if l < extra else 0) for l in range(levels)]
        starts = [sum(sizes[:l]) for l in range(levels)]
        level_blocks = tuple(tuple(range(s, s + n)) for s, n in zip(starts, sizes))
        bad = [b for b in private_blocks if not 0 <= b < num_blocks]
        if bad:
            raise DipacoError(f"grid.private_blocks {bad} out of range; blocks are 0..{num_blocks - 1}")
        return cls(shape, level_blocks, frozenset(private_blocks), bool(private_embedding), bool(private_head))

    # ------------------------------------------------------------------ paths
    @property
    def num_paths(self) -> int:
        return math.prod(self.shape)

    @property
    def paths(self) -> list[str]:
        return ["-".join(str(i) for i in combo) for combo in itertools.product(*(range(k) for k in self.shape))]

    def path_index(self, path: str) -> tuple[int, ...]:
        try:
            index = tuple(int(p) for p in path.split("-"))
        except ValueError:
            index = ()
        if len(index) != len(self.shape) or any(not 0 <= i < k for i, k in zip(index, self.shape)):
            raise DipacoError(f"path id {path!r} is not on grid {format_grid(self.shape)}; valid ids: {', '.join(self.paths[:8])}...")
        return index

    # ---------------------------------------------------------------- modules
    def path_modules(self, path: str) -> list[str]:
        index = self.path_index(path)
        modules = [f"embed@{path}" if self.private_embedding else "embed"]
        for level, k in enumerate(index):
            if any(b not in self.private_blocks for b in self.level_blocks[level]):
                modules.append(f"L{level}.E{k}")
            modules += [f"B{b}@{path}" for b in self.level_blocks[level] if b in self.private_blocks]
        modules.append(f"head@{path}" if self.private_head else "head")
        return modules

    @property
    def modules(self) -> list[str]:
        seen: dict[str, None] = {}
        for path in self.paths:
            for m in self.path_modules(path):
                seen.setdefault(m, None)
        return list(seen)

    def paths_through(self, module: str) -> list[str]:
        return [p for p in self.paths if module in self.path_modules(p)]

    def module_components(self, module: str) -> list[str]:
        name = module.split("@")[0]
        if name in ("embed", "head"):
            return [name]
        if name.startswith("B"):
            return [f"block.{int(name[1:])}"]
        level = int(name[1:].split(".")[0])
        return [f"block.{b}" for b in self.level_blocks[level] if b not in self.private_blocks]

    def describe(self) -> dict:
        return {
            "shape": format_grid(self.shape),
            "level_blocks": [list(b) for b in self.level_blocks],
            "private_blocks": sorted(self.private_blocks),
            "private_embedding": self.private_embedding,
            "private_head": self.private_head,
            "paths": self.num_paths,
            "modules": len(self.modules),
        }
