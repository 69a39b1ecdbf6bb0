"""The Ray driver's scheduler: what to launch when, which late phases a quorum drops, and what a stuck round lacks;
no Ray (the driver, ``dipaco.taskqueue.ray_engine.TaskQueue``, launches and cancels the tasks it names).

Rounds are numbered as in metrics.jsonl: round r is the r-th outer step. The phase of trainee i from version v
trains round v + 1, the outer step from v to v + 1 is round v + 1's, and the validation at version v is of the
weights after round v (round v's line in metrics.jsonl). Every message says "round", never "version".

The driver's loop waits on the tasks in flight. With nothing in flight it must never wait: either something is
ready to launch (``ready``), or the round it is completing lacks something no task will provide, and it ends with
one line naming that (``missing``) instead of looping without sleeping.

A validation normally comes with the next phase of its path's validator trainee (that phase validates the global
weights before it trains). A new validation task is launched for the last round (no phase follows it), for a
validator whose phase was dropped, and for a validation storage should hold and does not: its phase committed
without writing one (a phase launched by a driver that did not need it), or the file is gone.
"""

from __future__ import annotations

from collections.abc import Hashable

from dipaco.taskqueue.resolver import StateResolver

Task = tuple  # ("phase", trainee, v) | ("step", group, v) | ("val", path, v)


def describe(kind: str, who, v: int) -> str:
    """A task in the words of every message: the round it belongs to (``v`` is the version it starts from)."""
    return {"phase": f"phase (trainee {who}, round {v + 1})", "step": f"the outer step of {who} in round {v + 1}",
            "val": f"the validation of path {who} after round {v}"}[kind]


class Scheduler:
    """The tasks in flight, and the decisions over them: launch, wait, drop late phases."""

    def __init__(self, state: StateResolver, quorum: int = 0, grace: float = 0.0):
        self.state = state
        self.quorum, self.grace = quorum, grace
        self.inflight: dict[Hashable, Task] = {}  # a launched task's handle (a Ray ObjectRef) -> the task
        self.quorum_since: dict[tuple[str, int], float] = {}  # (group, v): when its quorum of phases was in

    def busy(self) -> set[Task]:
        return set(self.inflight.values())

    def launched(self, handle: Hashable, task: Task) -> None:
        self.inflight[handle] = task

    def returned(self, handle: Hashable) -> Task:
        """The task behind a handle that came back; an outer step's return ends its quorum's wait."""
        task = self.inflight.pop(handle)
        if task[0] == "step":
            self.quorum_since.pop((task[1], task[2]), None)
        return task

    # ------------------------------------------------------------------------------------------- what to launch
    def ready(self, next_round: int) -> list[Task]:
        """Tasks to launch now (nothing already in flight): each trainee's next phase once its modules have that
        version, each group's next outer step once its phases are settled, the validations round ``next_round``
        still needs from a task of its own."""
        s, busy, out = self.state, self.busy(), []
        for i in range(s.num_trainees):
            v = s.next_version(i)
            if v is not None and ("phase", i, v) not in busy and all(s.has_version(g, v) for g in s.groups.of_trainee[i]):
                out.append(("phase", i, v))
        for g, trainees in s.groups.members.items():
            v = s.next_step(g)
            if v is not None and ("step", g, v) not in busy and all(s.settled(i, v) for i in trainees):
                out.append(("step", g, v))
        return out + [("val", p, next_round) for p in self._validations_due(next_round, busy)]

    def _validations_due(self, v: int, busy: set[Task]) -> list[str]:
        s, due = self.state, []
        for p, i in s.validator.items():
            if (p, v) in s.ledger.val_loss or ("val", p, v) in busy or not all(s.has_version(g, v) for g in s.groups.of_trainee[i]):
                continue
            lost = (p, v) in s.awaiting  # its phase committed, its validation is not in storage
            if lost or (v == s.rounds or (i, v) in s.ledger.dropped) and (p, v) not in s.ledger.validated:
                due.append(p)
        return due

    # ------------------------------------------------------------------------------------------- the quorum
    def wait_s(self, now: float) -> float:
        """How long the driver may wait for a task: until the next quorum's grace ends, else a second."""
        if not self.quorum or not self.quorum_since:
            return 1.0
        return max(0.01, min(t + self.grace - now for t in self.quorum_since.values()))

    def handles(self, tasks: list[Task]) -> list[Hashable]:
        """The handles of those tasks that are in flight."""
        return [handle for handle, task in self.inflight.items() if task in set(tasks)]

    def drop_late(self, now: float) -> list[Task]:
        """A group whose quorum of phases is in and whose grace has passed drops its late phases (in storage, for
        every module); returns the phases dropped (the driver cancels those in flight)."""
        if not self.quorum:
            return []
        s, busy, dropped = self.state, self.busy(), []
        for g, trainees in s.groups.members.items():
            v = s.next_step(g)
            if v is None or ("step", g, v) in busy:
                continue
            late = [i for i in trainees if not s.settled(i, v)]
            in_time = len(trainees) - len(late) - sum((i, v) in s.ledger.dropped for i in trainees)
            if not late or in_time < min(self.quorum, len(trainees)):
                continue
            if now - self.quorum_since.setdefault((g, v), now) < self.grace:
                continue
            for i in late:
                s.drop(i, v, f"late for the outer step of {g} in round {v + 1} (quorum {self.quorum}, "
                             f"grace {self.grace} s)")
                dropped.append(("phase", i, v))
        return dropped

    # ------------------------------------------------------------------------------------------- a stuck round
    def missing(self, r: int) -> str:
        """One line: what round r lacks, when nothing is in flight and nothing can be launched."""
        s, lacks = self.state, []
        for i in range(s.num_trainees):
            if not s.settled(i, r - 1):
                groups = [g for g in s.groups.of_trainee[i] if not s.has_version(g, r - 1)]
                lacks.append(describe("phase", i, r - 1) + (f", whose modules {', '.join(groups)} lack round "
                                                            f"{r - 1}'s outer step" if groups else ""))
        lacks += [describe("step", g, r - 1) for g in s.groups.modules if (g, r) not in s.ledger.versions]
        lacks += [describe("val", p, r) for p in s.validator if (p, r) not in s.ledger.val_loss]
        shown = "; ".join(lacks[:4]) + (f" and {len(lacks) - 4} more" if len(lacks) > 4 else "")
        return (f"round {r} cannot finish: nothing is running and nothing can start that would give it "
                f"{shown or 'its record'}; remove {s.store.storage.where('queue')} and resume (--resume): the rounds "
                f"after round {max(s.checkpoints)}'s checkpoint are trained again")
