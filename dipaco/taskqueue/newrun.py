"""A new run on the Ray engine: its config.toml, run.json and round 0, as the in-process engine writes them (kept
apart from ``dipaco.taskqueue.runstore``, which the phases import: building a model is the driver's business)."""

from __future__ import annotations

from dipaco.storage import checkpoint
from dipaco.storage.objects import Storage
from dipaco.storage.run import RunDirectory, initial_modules
from dipaco.taskqueue.runstore import push
from dipaco.training.trainee import make_trainee


def begin_run(cfg, shards, grid, plan, directory: RunDirectory, storage: Storage, cpus: int, skeleton) -> None:
    """A new run: config.toml, run.json and round 0 (the initial modules and fresh trainee states), as the local
    engine writes them (then uploaded, for a run in a bucket); the trainees are built on ``skeleton``, the model on
    the meta device (no weights: only their optimizer and data state)."""
    modules, parameters = initial_modules(cfg, grid, shards, plan.paths[0])
    states = [make_trainee(i, p, s, grid, shards, cfg, model=skeleton).state() for i, (p, s) in enumerate(plan.trainees)]
    directory.create(grid, plan, cpus, parameters)
    checkpoint.save_round(directory.root, 0, modules, {}, states, {"trainee_paths": plan.paths, "engine": "ray"})
    storage.delete("metrics.jsonl")
    push(directory.root, storage, ["config.toml", "run.json", "checkpoints/round_0", "checkpoints/latest"])
