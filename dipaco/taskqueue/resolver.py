"""The Ray driver's state resolver: what the run directory holds, and where a task reads each input from; no Ray.

Storage is the source of truth (``dipaco.taskqueue.taskstore``). A driver that starts, or resumes after a crash,
scans the queue (``StateResolver.scan``); every task that comes back is recorded from its commit record, never from
what the task returned. Versions count outer steps: version v of a module is its weights after round v, and the
phase of trainee i from version v trains round v + 1.

Where an input is read from: a checkpoint round wins over the queue (its copy of a committed object checks against
the same sha256); a trainee state that only a node cache kept (sticky trainees) comes with the chain of phases to
replay where that cache is gone.
"""

from __future__ import annotations

from pathlib import Path

from dipaco.storage import checkpoint
from dipaco.taskqueue.taskstore import Damaged, Ledger, ModuleGroups, TaskStore, ref
from dipaco.training.outer import renormalised


class StateResolver:
    """The driver's view of the queue of one lineage: committed phases, outer steps, drops and validations."""

    def __init__(self, store: TaskStore, plan, grid, groups: ModuleGroups, start: int, rounds: int,
                 checkpoints: set[int], ledger: Ledger, validating: bool):
        self.store, self.plan, self.grid, self.groups = store, plan, grid, groups
        self.start, self.rounds = start, rounds
        self.checkpoints = checkpoints  # rounds whose checkpoint the tasks read (those after the start are assembled)
        self.ledger = ledger
        # each path's validator: the first trainee of the path (none when validation is off)
        self.validator = {p: plan.paths.index(p) for p in plan.paths} if validating else {}
        self.awaiting: set[tuple[str, int]] = set()  # validations storage lacks although their phase committed

    @classmethod
    def scan(cls, store: TaskStore, plan, grid, start: int, rounds: int, local: Path, validating: bool,
             say) -> StateResolver:
        """What storage holds from checkpoint ``start`` on (anything damaged is removed, and ``say`` tells why)."""
        groups = ModuleGroups.of(plan, grid)
        checkpoints = {r for r in checkpoint.list_rounds(local) if r <= start}
        ledger = Ledger.scan(store, start, rounds, len(plan.trainees), groups, local, say)
        return cls(store, plan, grid, groups, start, rounds, checkpoints, ledger, validating)

    @property
    def num_trainees(self) -> int:
        return len(self.plan.trainees)

    # ------------------------------------------------------------------------------------------- what is settled
    def settled(self, i: int, v: int) -> bool:
        """Phase (i, v) is committed or dropped: nothing more will come of it."""
        return (i, v) in self.ledger.done or (i, v) in self.ledger.dropped

    def has_version(self, g: str, v: int) -> bool:
        return v == self.start or (g, v) in self.ledger.versions

    def round_trained(self, r: int) -> bool:
        """Every phase of round r settled and every group's outer step of round r committed."""
        return (all(self.settled(i, r - 1) for i in range(self.num_trainees))
                and all((g, r) in self.ledger.versions for g in self.groups.modules))

    def next_version(self, i: int) -> int | None:
        """Trainee i's first version whose phase is not settled, or None."""
        return next((v for v in range(self.start, self.rounds) if not self.settled(i, v)), None)

    def next_step(self, g: str) -> int | None:
        """Group g's first version v whose outer step to v + 1 is not committed, or None."""
        return next((v for v in range(self.start, self.rounds) if (g, v + 1) not in self.ledger.versions), None)

    # ------------------------------------------------------------------------------------------- what came back
    def phase_committed(self, i: int, v: int) -> bool:
        """Phase (i, v) came back: its commit record is read. False for a phase a quorum dropped meanwhile."""
        if (i, v) in self.ledger.dropped:
            return False
        self.ledger.phases[(i, v)] = self.store.read_commit(self.store.phase_key(v, i))
        self.ledger.done.add((i, v))
        return True

    def step_committed(self, g: str, v: int, now: float) -> None:
        """Group g's outer step from v came back; ``now`` closes round v + 1's clock when it was the last group."""
        self.ledger.steps[(g, v + 1)] = self.store.read_commit(self.store.version_key(v + 1, g))
        self.ledger.versions.add((g, v + 1))
        if all((h, v + 1) in self.ledger.versions for h in self.groups.modules):
            self.ledger.finished_at[v + 1] = now

    def drop(self, i: int, v: int, why: str) -> None:
        self.store.drop(v, i, why)
        self.ledger.dropped.add((i, v))

    def last_node(self, i: int, v: int) -> str | None:
        """The node that committed phase (i, v - 1) (its cache holds the state phase (i, v) starts from)."""
        last = self.ledger.phases.get((i, v - 1))
        return last["record"].get("node") if last and (i, v - 1) not in self.ledger.dropped else None

    # ------------------------------------------------------------------------------------------- validations
    def validates(self, i: int, v: int) -> bool:
        """Whether phase (i, v) must validate its path at v: it is the path's validator, and storage holds none yet."""
        path = self.plan.trainees[i][0]
        return v > self.start and self.validator.get(path) == i and (path, v) not in self.ledger.validated

    def val_losses(self, v: int) -> dict[str, float] | None:
        """Every path's validation loss at version v, or None while one is still coming. A validation that storage
        lacks although its phase committed is noted in ``awaiting`` (the scheduler then launches it)."""
        out = {}
        for p, i in self.validator.items():
            if (p, v) not in self.ledger.val_loss and not self._look_up_val(p, i, v):
                return None
            if self.ledger.val_loss[(p, v)] is not None:
                out[p] = self.ledger.val_loss[(p, v)]
        return out

    def _look_up_val(self, p: str, i: int, v: int) -> bool:
        try:
            loss = self.store.val_loss(v, p)
        except Damaged:
            loss = None
        record = self.ledger.phases[(i, v)]["record"] if (i, v) in self.ledger.done else None
        if loss is None and record is not None and record["val_loss"] is None and record.get("validated", True):
            self.ledger.val_loss[(p, v)] = None  # its validation file is too short for one window, as in the local engine
        elif loss is None:
            if record is not None:
                self.awaiting.add((p, v))
            return False
        else:
            self.ledger.val_loss[(p, v)] = loss
            self.awaiting.discard((p, v))
        return True

    # ------------------------------------------------------------------------------------------- what tasks read
    def module_ref(self, m: str, v: int) -> dict:
        """Version v of module m: round v's checkpoint when there is one (checkpoints win), else the queue's commit."""
        if v in self.checkpoints:
            return ref(f"checkpoints/round_{v}/modules/{m}.safetensors")
        g = self.groups.of_module[m]
        return self.store.object_ref(self.store.version_key(v, g), self.ledger.steps[(g, v)], f"{m}.safetensors")

    def path_modules(self, path: str, v: int) -> dict[str, dict]:
        return {m: self.module_ref(m, v) for m in self.grid.path_modules(path)}

    def outer_ref(self, g: str, v: int) -> dict:
        if v in self.checkpoints:
            return ref(f"checkpoints/round_{v}/state/outer.safetensors")
        return self.store.object_ref(self.store.version_key(v, g), self.ledger.steps[(g, v)], "outer.safetensors")

    def state_ref(self, i: int, v: int) -> tuple[dict, bool]:
        """(ref, is_exact) of trainee i's state at version v: the committed phase (i, v-1), or round v's checkpoint.
        After a dropped phase it is the state from before that phase (not exact: its step is moved to the round's)."""
        u = v
        while True:
            if u in self.checkpoints:  # assembled from this queue: the phase's checksum holds for the copy too
                body = self.ledger.phases.get((i, u - 1)) if (i, u - 1) not in self.ledger.dropped else None
                digest = body["objects"]["state.pt"]["sha256"] if body and "state.pt" in body["objects"] else ""
                return ref(f"checkpoints/round_{u}/state/trainee_{i}.pt", digest), u == v
            if (i, u - 1) not in self.ledger.dropped:
                body = self.ledger.phases[(i, u - 1)]
                if "state.pt" not in body["objects"]:  # sticky: in the cache of the node that trained it
                    return self.replay_ref(i, u), u == v
                return self.store.object_ref(self.store.phase_key(u - 1, i), body, "state.pt"), u == v
            u -= 1

    def replay_ref(self, i: int, v: int) -> dict:
        """Trainee i's state at v, kept only in a node cache (``dipaco.taskqueue.phases.durable_state``): its checksum
        (the cache's key) and, for a phase that runs where that cache is gone, its last durable state and the rounds
        since, each with its modules' refs. Checkpoint rounds are durable, so the rounds lie after the last checkpoint,
        whose queue entries are kept."""
        path = self.plan.trainees[i][0]
        versions, u = [v - 1], v - 1
        while u not in self.checkpoints and "state.pt" not in self.ledger.phases[(i, u - 1)]["objects"]:
            u -= 1
            versions.append(u)
        start, _ = self.state_ref(i, u)
        steps = [{"version": w, "modules": self.path_modules(path, w)} for w in reversed(versions)]
        return {**ref("", self.ledger.phases[(i, v - 1)]["record"]["state_sha256"]), "replay": {"from": start, "rounds": steps}}

    def step_inputs(self, g: str, v: int) -> tuple[dict[int, dict], dict[str, dict[int, float]]]:
        """The outer step of group g from v: ({trainee: its deltas' ref}, {module: {trainee: weight}}). When a quorum
        dropped some phases, the others share the whole weight."""
        members = self.groups.members[g]
        contributors = [i for i in members if (i, v) in self.ledger.done]
        weights = {m: self.plan.weights[m] for m in self.groups.modules[g]}
        if len(contributors) < len(members):
            weights = {m: renormalised(ws, contributors) for m, ws in weights.items()}
        deltas = {i: self.store.object_ref(self.store.phase_key(v, i), self.ledger.phases[(i, v)], "deltas.safetensors")
                  for i in contributors}
        return deltas, weights
