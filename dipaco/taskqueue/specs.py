"""What the Ray driver hands each task: a phase's, an outer step's or a validation's inputs, resolved from storage
(``dipaco.taskqueue.resolver``) into small specs (names, refs and numbers); no Ray, no tensors.

The specs are the keyword arguments of ``dipaco.taskqueue.phases``' ``PhaseSpec``, ``StepSpec`` and
``validate_path``: the driver builds the task from them, so this unit stays below the task bodies' imports."""

from __future__ import annotations

import torch

from dipaco.model.path_model import PathModel, llama_config
from dipaco.taskqueue.resolver import StateResolver


def skeleton_model(cfg, grid, path: str, shards):
    """The run's dense model on the meta device (shapes and names, no weights): what the driver needs of a model."""
    with torch.device("meta"):
        return PathModel(grid, path, llama_config(cfg.model, shards.vocab_size, shards.eos_token_id)).model


def module_layout(grid, paths: list[str], model) -> dict[str, list[str]]:
    """{module: its tensor names in model order} over every path (the order outer gradients are flattened in)."""
    layout: dict[str, list[str]] = {}
    for p in dict.fromkeys(paths):
        layout.update(PathModel(grid, p, model.config, model).module_params)
    return layout


class TaskSpecs:
    """Builds the specs of the tasks the scheduler names, from what the state resolver says storage holds."""

    def __init__(self, state: StateResolver, cfg, shards_location: str, schedule_steps: int, layout: dict,
                 device: str = "cpu"):
        self.state, self.cfg, self.device = state, cfg, device
        self.shards_location, self.schedule_steps, self.layout = str(shards_location), schedule_steps, layout
        plan = state.plan
        # a path's validation windows come from all its trainees' shards
        self.val_sources = {p: [s for q, ss in plan.trainees if q == p for s in ss] for p in plan.paths}

    def phase(self, i: int, v: int) -> dict:
        """``PhaseSpec``'s fields for phase (i, v)."""
        s = self.state
        path, sources = s.plan.trainees[i]
        state, exact = s.state_ref(i, v)
        return dict(run=s.store.run, lineage=s.store.lineage, shards=self.shards_location, cfg=self.cfg, grid=s.grid,
                    trainee=i, path=path, sources=sources, version=v, schedule_steps=self.schedule_steps,
                    modules=s.path_modules(path, v), state=state, exact_state=exact, validate=s.validates(i, v),
                    val_sources=self.val_sources[path], device=self.device)

    def step(self, g: str, v: int) -> dict:
        """``StepSpec``'s fields for group g's outer step from v."""
        s = self.state
        modules = s.groups.modules[g]
        deltas, weights = s.step_inputs(g, v)
        return dict(run=s.store.run, lineage=s.store.lineage, cfg=self.cfg, group=g, version=v,
                    layout={m: self.layout[m] for m in modules}, modules={m: s.module_ref(m, v) for m in modules},
                    outer=s.outer_ref(g, v), contributors=deltas, weights=weights,
                    paths_through={m: len(s.grid.paths_through(m)) for m in modules})

    def validation(self, path: str, v: int) -> dict:
        """``validate_path``'s arguments for ``path`` at version v."""
        s = self.state
        return dict(run=s.store.run, lineage=s.store.lineage, shards_dir=self.shards_location, cfg=self.cfg,
                    grid=s.grid, path=path, sources=self.val_sources[path], version=v,
                    modules=s.path_modules(path, v), device=self.device)
