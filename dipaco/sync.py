"""Module synchronisation of one worker: when fragments sync, their outer gradients, the outer step, the merge.

No torch.distributed: reductions go through the world's ``start_reduce`` / ``wait`` (``dipaco.comm``),
so this runs unchanged in a world of one (the plain round loop: F = 1, τ = 0, α = 0 syncs everything
after the last inner step of a round and replaces the local weights by the new global ones).

Checkpoints and streaming: a round (H inner steps) ends with a checkpoint. A reduction still in flight
then (started within the last τ steps) is waited for and its *reduced but not yet applied* outer
gradient is saved with the round (``state()``), with the step it is due; a resumed run applies it at
that step, so resuming is exact. The last round of a run is flushed instead (``flush``): pending
reductions are applied right away, so the final checkpoint holds every outer step (a run later
extended with --resume continues from that flushed state). Local weights are saved per trainee
whenever they can differ from the global ones at a round boundary (F > 1, τ > 0 or α > 0).
"""

from __future__ import annotations

import torch

from dipaco.outer import OuterOptimizer, outer_gradient, sqrt_rescale
from dipaco.streaming import Pending, merge, split_fragments, syncs_at


class ModuleSync:
    def __init__(self, cfg, modules: dict[str, dict[str, torch.Tensor]], outer: OuterOptimizer, trainees: list,
                 weights: dict[str, dict[int, float]], paths_through: dict[str, int], world):
        s = cfg.streaming
        self.H, self.F, self.tau, self.alpha = cfg.inner_steps, s.fragments, s.overlap, s.alpha
        self.sqrt = cfg.grid.sqrt_rescale
        self.modules, self.outer, self.world, self.paths_through = modules, outer, world, paths_through
        self.trainees = {tr.index: tr for tr in trainees}
        # the weights of all of a module's trainees go to the world (every holder adds every term);
        # self.weights keeps this worker's trainees: the ones that contribute and merge here
        self.all_weights = {m: ws for m, ws in weights.items() if m in modules}
        self.weights = {m: {i: w for i, w in ws.items() if i in self.trainees} for m, ws in self.all_weights.items()}
        self.fragments = {m: split_fragments(list(t), cfg.model.num_layers, self.F, s.layout) for m, t in modules.items()}
        self.pending: list[Pending] = []

    @property
    def keeps_local_weights(self) -> bool:
        """Local weights may differ from the global ones at a round boundary."""
        return self.F > 1 or self.tau > 0 or self.alpha > 0

    def after_step(self, t: int) -> None:
        """Call after global inner step t: start the fragments due, apply the reductions due."""
        for f in syncs_at(t, self.H, self.F):
            deltas = self._outer_gradients(f)
            handle = self.world.start_reduce(deltas, {m: self.all_weights[m] for m in deltas})
            self.pending.append(Pending(f, t, t + self.tau, handle))
        for p in [p for p in self.pending if p.apply_at <= t]:
            self._apply(p)

    def flush(self) -> None:
        for p in list(self.pending):
            self._apply(p)

    @torch.no_grad()
    def _outer_gradients(self, f: int) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
        """{module: {trainee: Δ_i of fragment f}} for this worker's trainees (weighting and summing is the world's)."""
        deltas = {}
        for m, contributors in self.weights.items():
            names = self.fragments[m][f]
            if not names:
                continue
            glob = {n: self.modules[m][n] for n in names}
            deltas[m] = {i: outer_gradient(glob, self.trainees[i].model.module_tensors(m)) for i in sorted(contributors)}
        return deltas

    @torch.no_grad()
    def _apply(self, p: Pending) -> None:
        reduced = p.handle.wait()
        self.pending.remove(p)
        for m, grad in reduced.items():
            if self.sqrt:
                sqrt_rescale(grad, self.paths_through[m])
            self.outer.step(m, grad)
            for i in self.weights[m]:
                local = self.trainees[i].model.params
                for n in grad:
                    merge(local[n], self.modules[m][n], self.alpha)

    # ------------------------------------------------------------------------------ checkpoints
    def state(self) -> list[dict]:
        """Pending reductions, completed (waited for) but not applied: [{fragment, started, apply_at, grads}]."""
        out = []
        for p in self.pending:
            result = p.handle.wait()
            p.handle = _Ready(result)
            out.append({"fragment": p.fragment, "started": p.started, "apply_at": p.apply_at,
                        "grads": {m: {n: t.detach().cpu() for n, t in g.items()} for m, g in result.items()}})
        return out

    def load_state(self, pending: list[dict], device) -> None:
        self.pending = [Pending(int(d["fragment"]), int(d["started"]), int(d["apply_at"]), _Ready(
            {m: {n: t.to(device) for n, t in g.items()} for m, g in d["grads"].items() if m in self.weights}))
            for d in pending]


class _Ready:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value
