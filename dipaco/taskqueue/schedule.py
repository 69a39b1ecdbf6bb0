"""What the Ray driver (``dipaco.taskqueue.ray_engine.TaskQueue``) launches next, what a round still lacks, and a
finished round's line in metrics.jsonl; no Ray.

The driver's loop waits on the tasks in flight. With nothing in flight it must never wait: either something is
ready to launch (``ready``), or the round it is completing lacks something no task will provide, and it ends with
one line naming that (``missing``) instead of looping without sleeping.

A validation normally comes with the next phase of its path's validator trainee (that phase validates the global
weights before it trains). A new validation task is launched for the last round (no phase follows it), for a
validator whose phase was dropped, and for a validation storage should hold and does not: its phase committed
without writing one (a phase launched by a driver that did not need it), or the file is gone.
"""

from __future__ import annotations

from dipaco.io import log
from dipaco.training.engine_steps import round_line


def next_version(q, i: int) -> int | None:
    """Trainee i's first version whose phase is not settled (committed or dropped), or None."""
    return next((v for v in range(q.start, q.rounds) if not q.settled(i, v)), None)


def next_step(q, g: str) -> int | None:
    """Group g's first version v whose step to v + 1 is not committed, or None."""
    return next((v for v in range(q.start, q.rounds) if (g, v + 1) not in q.ledger.versions), None)


def ready(q) -> list[tuple]:
    """Tasks to launch now: ("phase", i, v), ("step", g, v), ("val", path, v); nothing already in flight."""
    busy, out = set(q.inflight.values()), []
    for i in range(q.num_trainees):  # each trainee's next phase, once its modules have that version
        v = next_version(q, i)
        if v is not None and ("phase", i, v) not in busy and all(q.has_version(g, v) for g in q.groups.of_trainee[i]):
            out.append(("phase", i, v))
    for g, trainees in q.groups.members.items():  # each group's next outer step, once its phases are in
        v = next_step(q, g)
        if v is not None and ("step", g, v) not in busy and all(q.settled(i, v) for i in trainees):
            out.append(("step", g, v))
    v = q.next_round
    for p, i in q.validator.items():
        if (p, v) in q.ledger.val_loss or ("val", p, v) in busy or not all(q.has_version(g, v) for g in q.groups.of_trainee[i]):
            continue
        lost = (p, v) in q.awaiting  # its phase committed, its validation is not in storage
        if lost or (v == q.rounds or (i, v) in q.ledger.dropped) and (p, v) not in q.ledger.validated:
            out.append(("val", p, v))
    return out


def phase_validates(q, i: int, v: int) -> bool:
    """Whether phase (i, v) must validate its path at v: it is the path's validator, and storage holds none yet."""
    path = q.plan.trainees[i][0]
    return v > q.start and q.validator.get(path) == i and (path, v) not in q.ledger.validated


def val_losses(q, v: int) -> dict[str, float] | None:
    """Every path's validation loss at version v, or None while one is still coming. A validation that storage
    lacks although its phase committed is noted in ``q.awaiting`` (``ready`` then launches it)."""
    out = {}
    for p, i in q.validator.items():
        if (p, v) not in q.ledger.val_loss:
            try:
                loss = q.store.val_loss(v, p)
            except q.damaged:
                loss = None
            record = q.ledger.phases[(i, v)]["record"] if (i, v) in q.ledger.done else None
            if loss is None and record is not None and record["val_loss"] is None and record.get("validated", True):
                q.ledger.val_loss[(p, v)] = None  # its validation file is too short for one window, as in the sync engine
            elif loss is None:
                if record is not None:
                    q.awaiting.add((p, v))
                return None
            else:
                q.ledger.val_loss[(p, v)] = loss
                q.awaiting.discard((p, v))
        if q.ledger.val_loss[(p, v)] is not None:
            out[p] = q.ledger.val_loss[(p, v)]
    return out


def missing(q) -> str:
    """One line: what round ``q.next_round`` lacks, when nothing is in flight and nothing can be launched."""
    v = q.next_round
    lacks = []
    for i in range(q.num_trainees):
        if not q.settled(i, v - 1):
            groups = [g for g in q.groups.of_trainee[i] if not q.has_version(g, v - 1)]
            lacks.append(f"phase (trainee {i}, round {v})" + (f", whose modules {', '.join(groups)} lack version {v - 1}"
                                                               if groups else ""))
    lacks += [f"the outer step of {g} to round {v}" for g in q.groups.modules if (g, v) not in q.ledger.versions]
    lacks += [f"the validation of path {p} at round {v}" for p in q.validator if (p, v) not in q.ledger.val_loss]
    shown = "; ".join(lacks[:4]) + (f" and {len(lacks) - 4} more" if len(lacks) > 4 else "")
    return (f"round {v} cannot finish: nothing is running and nothing can start that would give it "
            f"{shown or 'its record'}; remove {q.store.storage.where('queue')} and resume (--resume): the rounds after "
            f"round {max(q.checkpoints)}'s checkpoint are trained again")


def log_round(q, v: int, val: dict[str, float], workers: int) -> list[float]:
    """Round v's line in metrics.jsonl (and its phases' inner-step lines), from the commit records; adds its counts to
    ``q.counts`` (the summary line's); returns the trainees' losses."""
    phases, by_trainee = [], []  # a dropped phase has no loss
    for i in range(q.num_trainees):
        tries = q.store.attempts(v - 1, i)
        if (i, v - 1) in q.ledger.dropped:
            phases.append({"trainee": i, "path": q.plan.paths[i], "dropped": True, "attempts": len(tries),
                           "nodes": sorted({a["node"] for a in tries})})
            by_trainee.append(None)
            continue
        info = q.ledger.phases[(i, v - 1)]["record"]
        for rec in info["inner"]:
            log(q.metrics, **rec)
        by_trainee.append(info["train_loss"])
        q.counts["retried"] += len(tries) > 1
        phases.append({k: info[k] for k in ("trainee", "path", "node", "host", "pid", "load_s", "val_s", "compute_s",
                                            "save_s", "bytes_sent", "bytes_loaded")} | {"attempts": len(tries)}
                      | {k: info.get(k, 0) for k in ("storage_read", "storage_written", "state_cached", "replayed")})
    losses = [x for x in by_trainee if x is not None]
    steps = [q.ledger.steps[(g, v)]["record"] for g in q.groups.modules]
    io = {k: sum(r.get(k, 0) for r in phases + steps) for k in ("storage_read", "storage_written")}
    for k, n in io.items():  # the summary line: what this command's rounds read and wrote
        q.counts[k] += n
    tokens = len(losses) * q.inner_steps * q.cfg.inner.batch_size * q.cfg.model.max_seq_len
    # from the previous round's last outer step to this one's (phases of both rounds may overlap in between)
    seconds = q.ledger.finished_at[v] - q.ledger.finished_at.get(v - 1, q.ledger.finished_at[q.start])
    log(q.metrics, **round_line(
        v, by_trainee, val, seconds, tokens, workers=workers,
        bytes_sent=sum(p.get("bytes_sent", 0) for p in phases), bytes_received=sum(s["bytes_received"] for s in steps),
        engine="ray", bytes_loaded=sum(p.get("bytes_loaded", 0) for p in phases),
        storage_read=io["storage_read"], storage_written=io["storage_written"],
        compute_s=mean_of(phases, "compute_s"), load_s=mean_of(phases, "load_s"), save_s=mean_of(phases, "save_s"),
        dropped=[p["trainee"] for p in phases if p.get("dropped")], retried=[p["trainee"] for p in phases if p["attempts"] > 1],
        phases=phases, steps=[{k: s[k] for k in ("group", "node", "pid", "seconds", "contributors")} for s in steps]))
    q.metrics.flush()
    return losses


def describe(kind: str, who, v: int) -> str:
    return {"phase": f"phase (trainee {who}, round {v + 1})", "step": f"the outer step of {who} to round {v + 1}",
            "val": f"the validation of path {who} at round {v}"}[kind]


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None
