"""Which trainee trains what, where: every trainee's path and shards, its rank, its weight in each module's average
(``Plan``), and the checks a launcher makes before it starts workers on that plan (``preflight``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dipaco.config import TrainConfig
from dipaco.errors import DipacoError
from dipaco.model.grid import Grid, format_grid, parse_grid
from dipaco.storage.run import RunDirectory, build_grid, check_dense_source
from dipaco.storage.shards import ShardSet
from dipaco.training.devices import resolve_device
from dipaco.training.outer import module_weights


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


@dataclass
class Plan:
    """Every trainee's path, shards, rank and size (training tokens), and every module's weights
    ``{module: {trainee: w_i}}`` in its outer-gradient average (``outer.module_weights``: ∝ size, sum 1)."""
    trainees: list[tuple[str, list[str]]]
    ranks: list[int]
    sizes: list[int]
    weights: dict[str, dict[int, float]]

    @classmethod
    def make(cls, cfg: TrainConfig, grid: Grid, shards: ShardSet, workers: int) -> "Plan":
        trainees = plan_trainees(grid, shards, cfg)
        ranks = assign(len(trainees), workers)
        sizes = [shards.tokens_of(s) for _, s in trainees]
        return cls(trainees, ranks, sizes, module_weights([grid.path_modules(p) for p, _ in trainees], sizes))

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.trainees]

    def holders(self) -> dict[str, dict[int, int]]:
        """{module: {trainee: rank}} over the module's trainees (``World.setup``)."""
        return {m: {i: self.ranks[i] for i in ws} for m, ws in self.weights.items()}

    def holder_ranks(self, module: str) -> list[int]:
        return sorted({self.ranks[i] for i in self.weights[module]})

    def validator_ranks(self) -> dict[str, int]:
        """The rank that validates each path: the lowest rank training it."""
        return {p: min(self.ranks[i] for i, q in enumerate(self.paths) if q == p) for p in self.paths}


def preflight(cfg: TrainConfig, shards_dir: str | Path, run_dir: str | Path, resume: bool, workers: int) -> None:
    """Every check a worker would make on its inputs, made once before ``--workers`` launches torchrun, so that
    bad input gets one line and exit code 2 instead of an error per worker and a launcher traceback."""
    shards = ShardSet(shards_dir)
    grid = build_grid(cfg, cfg.grid.shape or shards.grid)
    assign(len(plan_trainees(grid, shards, cfg)), workers)
    resolve_device(cfg.device)
    RunDirectory(run_dir, cfg, shards).check(resume)
    if cfg.init_from:
        check_dense_source(cfg.init_from, shards)
