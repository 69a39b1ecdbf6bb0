"""The Ray driver's round assembler: every finished round, in order, becomes its lines in metrics.jsonl (through
the round log every engine writes with, ``dipaco.training.round_log``) and, on checkpoint rounds, the checkpoint
every engine reads; no Ray.

A round is finished when every phase of it is settled (committed or dropped by a quorum), every group's outer step
of it is committed and every path's validation after it is known (``dipaco.taskqueue.resolver``). Its line is
built from the commit records, so a resumed driver logs a round that an earlier driver trained; a round that
metrics.jsonl already has is not logged twice. After a checkpoint, what no task can read any more is forgotten;
after the last round the queue is removed (the checkpoint holds everything).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dipaco.taskqueue.resolver import StateResolver
from dipaco.taskqueue.runstore import TRACKER_FILES, assemble, push
from dipaco.training.round_log import RoundLog, phase_tokens
from dipaco.training.trackers import Trackers

PHASE_FIELDS = ("trainee", "path", "node", "host", "pid", "load_s", "val_s", "compute_s", "save_s", "bytes_sent",
                "bytes_loaded")
PHASE_COUNTERS = ("storage_read", "storage_written", "state_cached", "replayed")
STEP_FIELDS = ("group", "node", "pid", "seconds", "contributors")


class RoundAssembler:
    """Finished rounds -> metrics.jsonl, the progress bar and checkpoints; ``counts`` sums what the rounds it logged
    report (the summary line's)."""

    def __init__(self, state: StateResolver, cfg, local: Path, workers: Callable[[], int], desc: str = "train",
                 progress: bool = True):
        self.state, self.cfg, self.local = state, cfg, local
        self.workers = workers  # the cluster's CPUs when a round is logged (machines come and go)
        self.next_round = state.start + 1
        self.counts = {"retried": 0, "dropped": 0, "storage_read": 0, "storage_written": 0}
        total = (cfg.rounds - state.start) * state.num_trainees * cfg.inner_steps
        self.trackers = Trackers.open(local, cfg.log)  # --log-to: the rounds' records, caught up where they lack some
        # phases a resumed driver found committed count as done
        self.log = RoundLog(local, total, desc, progress, done_steps=len(state.ledger.done) * cfg.inner_steps,
                            listeners=[self.trackers] if self.trackers else [])

    def advance(self, steps: int) -> None:
        self.log.advance(steps)

    def done(self) -> bool:
        return self.next_round > self.cfg.rounds

    def close(self) -> None:
        self.log.close()
        if self.trackers is not None:
            self.trackers.close()

    def complete(self) -> None:
        """Log (and checkpoint) every finished round, in order, then forget what no task can read any more."""
        while not self.done():
            r = self.next_round
            val = self.state.val_losses(r) if self.state.round_trained(r) else None
            if val is None:
                return
            if r not in self.state.ledger.logged:
                self.log_round(r, val)
                # a run in a bucket: its metrics there, and the trackers' files that a later driver continues
                push(self.local, self.state.store.storage, ["metrics.jsonl", *TRACKER_FILES])
            if r % self.cfg.checkpoint_every == 0 or r == self.cfg.rounds:
                self.checkpoint(r)
            self.next_round += 1
        self.state.store.storage.delete("queue")  # the last round is a checkpoint: the queue holds nothing more

    def checkpoint(self, r: int) -> None:
        """Round r's checkpoint, assembled from the queue's committed objects (``dipaco.taskqueue.runstore.assemble``)."""
        s = self.state
        states = [(*s.state_ref(i, r), r * self.cfg.inner_steps) for i in range(s.num_trainees)]
        assemble(s.store, self.local, r, {m: s.module_ref(m, r) for m in s.groups.of_module},
                 [s.outer_ref(g, r) for g in s.groups.modules], states, {"trainee_paths": s.plan.paths, "engine": "ray"})
        previous = max(s.checkpoints)
        s.checkpoints.add(r)
        s.store.forget_before(previous)  # tasks still running read versions >= the previous checkpoint

    # ------------------------------------------------------------------------------------------- the round log
    def log_round(self, r: int, val: dict[str, float]) -> dict:
        """Round r's lines in metrics.jsonl (its phases' inner-step lines, then the round's), from the commit
        records; adds its counts to ``counts``; returns the round line."""
        phases, by_trainee, inner = self.phase_rows(r)
        steps = [self.state.ledger.steps[(g, r)]["record"] for g in self.state.groups.modules]
        io = {k: sum(row.get(k, 0) for row in phases + steps) for k in ("storage_read", "storage_written")}
        for k, n in io.items():  # the summary line: what this command's rounds read and wrote
            self.counts[k] += n
        self.counts["retried"] += sum(1 for p in phases if not p.get("dropped") and p["attempts"] > 1)
        finished = self.state.ledger.finished_at
        # from the previous round's last outer step to this one's (phases of both rounds may overlap in between)
        seconds = finished[r] - finished.get(r - 1, finished[self.state.start])
        return self.log.round(
            r, by_trainee, val, seconds=seconds, tokens=sum(x is not None for x in by_trainee) * phase_tokens(self.cfg),
            workers=self.workers(), bytes_sent=sum(p.get("bytes_sent", 0) for p in phases),
            bytes_received=sum(s["bytes_received"] for s in steps), inner=inner, engine="ray",
            bytes_loaded=sum(p.get("bytes_loaded", 0) for p in phases),
            storage_read=io["storage_read"], storage_written=io["storage_written"],
            compute_s=mean_of(phases, "compute_s"), load_s=mean_of(phases, "load_s"), save_s=mean_of(phases, "save_s"),
            dropped=[p["trainee"] for p in phases if p.get("dropped")],
            retried=[p["trainee"] for p in phases if p["attempts"] > 1],
            phases=phases, steps=[{k: s[k] for k in STEP_FIELDS} for s in steps],
            module_norms={m: n for s in steps for m, n in s.get("module_norms", {}).items()})

    def phase_rows(self, r: int) -> tuple[list[dict], list[float | None], list[dict]]:
        """Round r's phases as its line lists them, each trainee's loss (None for a dropped phase) and the committed
        phases' inner-step records."""
        s, phases, by_trainee, inner = self.state, [], [], []
        for i in range(s.num_trainees):
            tries = s.store.attempts(r - 1, i)
            if (i, r - 1) in s.ledger.dropped:
                phases.append({"trainee": i, "path": s.plan.paths[i], "dropped": True, "attempts": len(tries),
                               "nodes": sorted({a["node"] for a in tries})})
                by_trainee.append(None)
                continue
            info = s.ledger.phases[(i, r - 1)]["record"]
            inner += info["inner"]
            by_trainee.append(info["train_loss"])
            phases.append({k: info[k] for k in PHASE_FIELDS} | {"attempts": len(tries)}
                          | {k: info.get(k, 0) for k in PHASE_COUNTERS})
        return phases, by_trainee, inner


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None
