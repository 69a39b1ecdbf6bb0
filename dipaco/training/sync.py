"""The outer sync of one worker's modules, in two parts after every inner step (``after_step``):

  ``prepare(t)``  the fragments due after global step t (``streaming.syncs_at``): every trainee's outer
                  gradient ``Δ_i = θ_global − θ_i`` (``outer.outer_gradient``), and the world starts averaging
                  them per module (``World.start_reduce`` -> ``outer.module_average``, in the background)
  ``perform(t)``  the averages due at t (started τ steps earlier): wait, outer Nesterov step on the global
                  weights (``outer.OuterOptimizer``), merge every local copy (``streaming.merge``)

No torch.distributed: the world (``dipaco.training.comm.World``) carries the reductions, so this runs unchanged in a
world of one. The plain round loop is F = 1, τ = 0, α = 0: everything syncs after the last inner step of a
round and the local weights are replaced by the new global ones.

Checkpoints and streaming: a round (H inner steps) ends with a checkpoint. A reduction still in flight
then (started within the last τ steps) is waited for and its *reduced but not yet applied* outer
gradient is saved with the round (``state()``), with the step it is due; a resumed run applies it at
that step, so resuming is exact. The last round of a run is flushed instead (``flush``): pending
reductions are applied right away, so the final checkpoint holds every outer step (a run later
extended with --resume continues from that flushed state). Local weights are saved per trainee
whenever they can differ from the global ones at a round boundary (F > 1, τ > 0 or α > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dipaco.training.comm import Handle, Ready, World
from dipaco.training.engine_steps import rescale_and_step
from dipaco.training.outer import OuterOptimizer, outer_gradient
from dipaco.training.streaming import merge, split_fragments, syncs_at


@dataclass
class Pending:
    """A started reduction: fragment ``fragment`` synced after step ``started``, applied after ``apply_at``."""
    fragment: int
    started: int
    apply_at: int
    handle: Handle


def streams(cfg) -> bool:
    """Streaming DiLoCo: fragments sync within a round, or the local weights outlive it (they may differ from the
    global ones at a round boundary), so a round is every trainee's step t, then the syncs due after t, not phases
    that each start from the global weights."""
    s = cfg.streaming
    return s.fragments > 1 or s.overlap > 0 or s.alpha > 0


class ModuleSync:
    """``weights``: ``{module: {trainee: w_i}}`` over all of a module's trainees (``outer.module_weights``);
    ``paths_through``: how many paths use each module (the √P rescaling)."""

    def __init__(self, cfg, modules: dict[str, dict[str, torch.Tensor]], outer: OuterOptimizer, trainees: list,
                 weights: dict[str, dict[int, float]], paths_through: dict[str, int], world: World):
        s = cfg.streaming
        self.H, self.F, self.tau, self.alpha = cfg.inner_steps, s.fragments, s.overlap, s.alpha
        self.keeps_local_weights = streams(cfg)
        self.sqrt = cfg.grid.sqrt_rescale
        self.modules, self.outer, self.world, self.paths_through = modules, outer, world, paths_through
        self.trainees = {tr.index: tr for tr in trainees}
        # the weights of all of a module's trainees go to the world (every holder adds every term);
        # self.weights keeps this worker's trainees: the ones that contribute and merge here
        self.all_weights = {m: ws for m, ws in weights.items() if m in modules}
        self.weights = {m: {i: w for i, w in ws.items() if i in self.trainees} for m, ws in self.all_weights.items()}
        self.fragments = {m: split_fragments(list(t), cfg.model.num_layers, self.F, s.layout) for m, t in modules.items()}
        self.pending: list[Pending] = []
        # trainee -> its phase's outer gradients per module (whole rounds): used instead of its weights here
        self.arrived: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def arrive(self, trainee: int, deltas: dict[str, dict[str, torch.Tensor]]) -> None:
        """Trainee ``trainee``'s outer gradients from its phase (``dipaco.training.phase.train_phase``), maybe trained in
        another process: the round's sync uses them instead of the trainee's weights in this process."""
        self.arrived[trainee] = deltas

    def after_step(self, t: int) -> None:
        """Call after global inner step t (t = 1, 2, ...)."""
        self.prepare(t)
        self.perform(t)

    def flush(self) -> None:
        """Apply every reduction still in flight (the run's last round)."""
        self.perform(None)

    @torch.no_grad()
    def prepare(self, t: int) -> None:
        """Start the module averages of the fragments due after step t; they are applied at t + τ."""
        for f in syncs_at(t, self.H, self.F):
            deltas = self.outer_gradients(f)
            handle = self.world.start_reduce(deltas, {m: self.all_weights[m] for m in deltas})
            self.pending.append(Pending(f, t, t + self.tau, handle))
            self.arrived.clear()

    @torch.no_grad()
    def perform(self, t: int | None) -> None:
        """Apply the averages due at step t (all of them for None): outer step, then merge the local copies."""
        for p in [p for p in self.pending if t is None or p.apply_at <= t]:
            averaged = p.handle.wait()
            self.pending.remove(p)
            for m, grad in averaged.items():
                rescale_and_step(self.outer, m, grad, self.sqrt, self.paths_through[m])
                for i in self.weights[m]:
                    local = self.trainees[i].model.params
                    for n in grad:
                        merge(local[n], self.modules[m][n], self.alpha)

    def outer_gradients(self, f: int) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
        """{module: {trainee: Δ_i of fragment f}} for this worker's trainees (weighting and summing is the world's)."""
        deltas = {}
        for m, contributors in self.weights.items():
            names = self.fragments[m][f]
            if not names:
                continue
            glob = {n: self.modules[m][n] for n in names}
            deltas[m] = {i: self.outer_gradient(i, m, glob) for i in sorted(contributors)}
        return deltas

    def outer_gradient(self, i: int, m: str, glob: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Trainee i's Δ_i of module m for the tensors of ``glob`` (in their order: the flattening order)."""
        if i in self.arrived:
            return {n: self.arrived[i][m][n] for n in glob}
        return outer_gradient(glob, self.trainees[i].model.module_tensors(m))

    # ------------------------------------------------------------------------------ checkpoints
    def state(self) -> list[dict]:
        """Pending reductions, completed (waited for) but not applied: [{fragment, started, apply_at, grads}]."""
        out = []
        for p in self.pending:
            result = p.handle.wait()
            p.handle = Ready(result)
            out.append({"fragment": p.fragment, "started": p.started, "apply_at": p.apply_at,
                        "grads": {m: {n: t.detach().cpu() for n, t in g.items()} for m, g in result.items()}})
        return out

    def load_state(self, pending: list[dict], device) -> None:
        self.pending = [Pending(int(d["fragment"]), int(d["started"]), int(d["apply_at"]), Ready(
            {m: {n: t.to(device) for n, t in g.items()} for m, g in d["grads"].items() if m in self.weights}))
            for d in pending]
