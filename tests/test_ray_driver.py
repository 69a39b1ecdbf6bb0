"""The Ray driver's scheduler without Ray (``dipaco.taskqueue.schedule``): what it launches, what a quorum drops,
and what it says when a round lacks something no task will give it. Its view of storage is a real ``StateResolver``
(with the real ``Ledger`` and ``ModuleGroups``) over a fake store; the driver's loop on a real local Ray is in
tests/test_ray_keep_going.py.

The stuck state is the one a SIGKILLed driver's successor met on a bucket run: every phase and outer step of the round
committed, the validator phase of a path committed, and that path's validation missing from storage. The loop then
had nothing in flight, launched nothing and waited on nothing, forever.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from dipaco.errors import DipacoError
from dipaco.taskqueue.resolver import StateResolver
from dipaco.taskqueue.schedule import Scheduler, describe
from dipaco.taskqueue.taskstore import Ledger, ModuleGroups

PATHS = ["0-0", "0-1", "1-0", "1-1"]
GROUPS = {"embed+head": [0, 1, 2, 3], "L0.E0": [0, 1], "L0.E1": [2, 3], "L1.E0": [0, 2], "L1.E1": [1, 3]}


class FakeStore:
    """Validation losses by (version, path), and the drops a quorum writes; what a real TaskStore reads from and
    writes to RUN/queue/<lineage>."""

    def __init__(self, vals: dict):
        self.vals, self.drops = vals, {}
        self.root = "queue/abc"
        self.storage = SimpleNamespace(where=lambda key: f"s3://b/run/{key}")

    def val_loss(self, v, path):
        return self.vals.get((v, path))

    def drop(self, v, i, why):
        self.drops[(i, v)] = why


def resolver(start=1, rounds=3, done=(), versions=(), vals=None, validated=(), records=None) -> StateResolver:
    """The state of a 2x2 grid with one trainee per path, resumed from checkpoint ``start``."""
    groups = ModuleGroups({g: [g] for g in GROUPS}, {g: g for g in GROUPS}, GROUPS,
                          [sorted(g for g, ts in GROUPS.items() if i in ts) for i in range(4)])
    records = records or {}
    phases = {(i, v): {"record": records.get((i, v), {"val_loss": 4.0, "validated": True})} for i, v in done}
    ledger = Ledger(phases, {}, set(), set(validated), set(done), set(versions), set(), {})
    plan = SimpleNamespace(trainees=[(p, [p]) for p in PATHS], paths=PATHS)
    return StateResolver(FakeStore(vals or {}), plan, None, groups, start, rounds, {0, start}, ledger, validating=True)


def stuck(next_round=2, inflight=None, **kw) -> tuple[Scheduler, int]:
    """Resumed from round 1: every phase of rounds 2 and 3 and every outer step to versions 2 and 3 committed; round
    2's validations of paths 0-0 and 0-1 in storage, those of 1-0 and 1-1 not, though their phases validated."""
    state = resolver(done=[(i, v) for i in range(4) for v in (1, 2)], versions=[(g, v) for g in GROUPS for v in (2, 3)],
                     vals={(2, "0-0"): 3.0, (2, "0-1"): 3.1}, validated=[("0-0", 2), ("0-1", 2)], **kw)
    schedule = Scheduler(state)
    for handle, task in (inflight or {}).items():
        schedule.launched(handle, task)
    return schedule, next_round


def test_a_round_whose_committed_phase_left_no_validation_launches_it():
    schedule, r = stuck()
    state = schedule.state
    assert schedule.ready(r) == []  # before the round is looked at, nothing is due: the state the old loop spun in
    assert state.val_losses(2) is None
    assert state.awaiting == {("1-0", 2)}  # the first missing one stops the look; the next look finds the next
    assert schedule.ready(r) == [("val", "1-0", 2)]
    state.ledger.val_loss[("1-0", 2)] = 2.5  # it came back
    assert state.val_losses(2) is None and schedule.ready(r) == [("val", "1-1", 2)]
    state.ledger.val_loss[("1-1", 2)] = 2.6
    assert state.val_losses(2) == {"0-0": 3.0, "0-1": 3.1, "1-0": 2.5, "1-1": 2.6}


def test_a_phase_that_did_not_validate_is_not_read_as_a_path_too_short_to_validate():
    schedule, _ = stuck(records={(2, 2): {"val_loss": None, "validated": False}, (3, 2): {"val_loss": None, "validated": True}})
    state = schedule.state
    state.store.vals[(2, "1-0")] = None
    assert state.val_losses(2) is None and ("1-0", 2) in state.awaiting
    state.ledger.val_loss[("1-0", 2)] = 2.5
    assert state.val_losses(2) == {"0-0": 3.0, "0-1": 3.1, "1-0": 2.5}  # 1-1 validated: too short for a window


def test_a_validation_in_flight_or_in_storage_is_not_launched_twice():
    schedule, r = stuck(inflight={"ref": ("val", "1-0", 2)})
    schedule.state.val_losses(2)
    assert schedule.ready(r) == []
    assert schedule.state.validates(2, 2) and not schedule.state.validates(0, 2)  # 0-0's is in storage
    assert not resolver(start=2).validates(2, 2)  # the start version is a checkpoint's


def test_the_last_round_and_a_dropped_validator_are_validated_by_tasks():
    schedule, r = stuck(next_round=3)
    assert sorted(schedule.ready(r)) == [("val", p, 3) for p in PATHS]
    schedule, r = stuck()
    schedule.state.ledger.done.discard((3, 2))
    schedule.state.ledger.dropped.add((3, 2))
    assert ("val", "1-1", 2) in schedule.ready(r)


def test_phases_wait_for_their_modules_and_steps_for_their_phases():
    state = resolver(done=[(0, 1), (1, 1)])
    schedule = Scheduler(state)
    assert sorted(schedule.ready(2)) == [("phase", 2, 1), ("phase", 3, 1), ("step", "L0.E0", 1)]
    schedule.launched("p2", ("phase", 2, 1))
    assert ("phase", 2, 1) not in schedule.ready(2)  # in flight: not launched twice
    assert schedule.returned("p2") == ("phase", 2, 1) and not schedule.inflight
    state.ledger.versions.add(("L0.E0", 2))  # trainees 0 and 1 read L0.E0, but also groups still at version 1
    assert ("phase", 0, 2) not in schedule.ready(2)
    for g in ("embed+head", "L1.E0", "L1.E1"):
        state.ledger.versions.add((g, 2))
    assert ("phase", 0, 2) in schedule.ready(2) and ("phase", 1, 2) in schedule.ready(2)


def test_a_quorum_drops_late_phases_only_after_its_grace():
    state = resolver(done=[(0, 1), (1, 1), (2, 1)])  # trainee 3 is late in round 2
    schedule = Scheduler(state, quorum=1, grace=10.0)
    schedule.launched("late", ("phase", 3, 1))
    assert schedule.drop_late(now=100.0) == [] and schedule.wait_s(now=104.0) == pytest.approx(6.0)
    assert schedule.drop_late(now=109.0) == []
    dropped = schedule.drop_late(now=111.0)
    assert dropped == [("phase", 3, 1)] and schedule.handles(dropped) == ["late"]
    assert (3, 1) in state.ledger.dropped and state.settled(3, 1)
    why = state.store.drops[(3, 1)]
    assert "late for the outer step of" in why and "in round 2 (quorum 1, grace 10.0 s)" in why
    assert Scheduler(state).drop_late(now=1e9) == [] and Scheduler(state).wait_s(now=0) == 1.0  # no quorum: never


def test_every_message_numbers_rounds_as_metrics_jsonl_does():
    """Round r is the r-th outer step: the phase from version v trains round v + 1, the validation at version v
    is of the weights after round v (round v's line)."""
    assert describe("phase", 3, 1) == "phase (trainee 3, round 2)"
    assert describe("step", "L0.E0", 1) == "the outer step of L0.E0 in round 2"
    assert describe("val", "0-1", 2) == "the validation of path 0-1 after round 2"


def test_what_nothing_will_give_is_named_in_one_line():
    state = resolver(done=[(0, 1), (1, 1)], versions=[])  # trainees 2 and 3 never ran, and nothing says why
    state.has_version = lambda g, v: v == 0  # as if version 1 were not there (a damaged checkpoint, say)
    line = Scheduler(state).missing(2)
    assert "\n" not in line and line.startswith("round 2 cannot finish: ")
    assert "phase (trainee 2, round 2), whose modules L0.E1, L1.E0, embed+head lack round 1's outer step;" in line
    assert "the outer step of embed+head in round 2" in line and line.count(";") == 4  # four named, then "and 7 more"
    assert "remove s3://b/run/queue and resume (--resume)" in line and "round 1's checkpoint" in line


def test_the_driver_ends_instead_of_spinning_when_nothing_can_finish_a_round(monkeypatch, tmp_path):
    """The loop itself (``TaskQueue.run``) with its real scheduler, state and round assembler, its launcher replaced by
    one that launches nothing, over a ledger that lacks an outer step: with nothing in flight it looks once more after
    finishing what storage holds, then ends in one line (the loop it replaces called ``ray.wait`` only with something
    in flight, and looped without sleeping)."""
    ray_engine = pytest.importorskip("dipaco.taskqueue.ray_engine")
    from dipaco.config import LogConfig
    from dipaco.taskqueue.rounds import RoundAssembler

    schedule, _ = stuck()
    state = schedule.state
    state.has_version = lambda g, v: v != 2 or g != "L1.E1"  # version 2 of L1.E1 lost: paths 0-1 and 1-1 cannot validate
    state.ledger.versions.discard(("L1.E1", 2))
    cfg = SimpleNamespace(rounds=3, inner_steps=2, checkpoint_every=1, log=LogConfig())
    queue = ray_engine.TaskQueue.__new__(ray_engine.TaskQueue)
    queue.state, queue.schedule = state, schedule
    queue.rounds = RoundAssembler(state, cfg, tmp_path, workers=lambda: 1, progress=False)
    calls = []
    monkeypatch.setattr(ray_engine.TaskQueue, "launch_ready", lambda self: calls.append(schedule.ready(2)))
    with pytest.raises(DipacoError, match=r"^round 2 cannot finish: .*the outer step of L1.E1 in round 2"):
        queue.run()
    assert len(calls) == 2  # looked, finished what storage holds, looked again: then one line, no third look
    assert queue.rounds.next_round == 2 and queue.rounds.log.metrics is None  # closed


# ------------------------------------------------------------------------------------------------ the lease
def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lease(folder, **fields) -> None:
    import json
    import socket

    folder.mkdir(parents=True, exist_ok=True)
    body = {"owner": "0" * 32, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(), **fields}
    (folder / "lease.json").write_text(json.dumps(body))


def test_a_dead_or_stale_drivers_lease_is_taken_over_and_a_live_one_refused(tmp_path):
    from dipaco.taskqueue.lease import EXPIRY_S, Lease

    _write_lease(tmp_path / "a", pid=_dead_pid())  # this machine, its process gone: at once
    with Lease(str(tmp_path / "a")) as lease:
        assert json.loads((tmp_path / "a" / "lease.json").read_text())["owner"] == lease.owner
    assert not (tmp_path / "a" / "lease.json").exists()  # released
    _write_lease(tmp_path / "b", host="elsewhere", heartbeat=time.time() - EXPIRY_S - 1)  # another machine, silent
    with Lease(str(tmp_path / "b")):
        pass
    _write_lease(tmp_path / "c", host="elsewhere")  # another machine, beating
    with pytest.raises(DipacoError, match=r"is being trained by another driver \(host elsewhere"):
        Lease(str(tmp_path / "c")).acquire()


def test_a_folder_holding_only_a_dead_drivers_lease_is_dipacos(tmp_path, capsys):
    """The first driver of a --keep-going run stopped before it wrote run.json: the next one must not call the lease
    it left "files dipaco did not write"."""
    from dipaco.cli.commands import main
    from dipaco.taskqueue.lease import only_a_lease

    out = tmp_path / "run"
    _write_lease(out, pid=_dead_pid())
    (out / "queue").mkdir()
    assert only_a_lease(out)
    rc = main(["train", "--shards", str(tmp_path / "no-shards"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "did not write" not in err and "no-shards" in err, err
    (out / "notes.txt").write_text("mine")
    assert not only_a_lease(out)
    assert main(["train", "--shards", str(tmp_path / "no-shards"), "--out", str(out), "--quiet"]) == 2
    assert "holds files dipaco did not write" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the supervisor
class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_a_long_outage_is_said_when_it_begins_once_a_minute_and_when_it_ends(monkeypatch, capsys):
    from dipaco.taskqueue import supervise

    clock, answers = FakeClock(), iter(["Connection refused"] * 75 + [None])  # 75 probes, 2 s apart: 150 s
    monkeypatch.setattr(supervise, "time", clock)
    monkeypatch.setattr(supervise, "reachable", lambda address: next(answers))
    assert supervise._wait_for("10.0.0.5:6379", {"signal": None})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(x.startswith("dipaco train: ") for x in lines), lines
    assert "waiting for the Ray cluster at 10.0.0.5:6379 (Connection refused)" in lines[0]
    assert "(for 60 s)" in lines[1] and "(for 120 s)" in lines[2]
    assert "answers again after 150 s; resuming from storage" in lines[3]


def test_a_driver_that_ray_ended_is_restarted_and_one_that_keeps_crashing_is_not(monkeypatch, capsys):
    """Exit codes as the supervisor sees them: 0 done, 2 an error of the run, 75 the cluster lost, -9 / 1 a driver
    ended by Ray (its head gone) or crashing."""
    from dipaco.taskqueue import supervise

    started = []

    class Child:
        def __init__(self, cmd, env):
            started.append(cmd)
            self.returncode = codes.pop(0)

        def poll(self):
            return self.returncode

    monkeypatch.setattr(supervise.subprocess, "Popen", Child)
    monkeypatch.setattr(supervise, "reachable", lambda address: None)
    monkeypatch.setattr(supervise.signal, "signal", lambda *a: None)
    codes = [-9, 75, 1, 0]
    assert supervise.supervise(["train", "--out", "r"], "h:1", lambda: True) == 0
    assert len(started) == 4 and all(c[-1] == "--resume" for c in started)
    codes = [-9, 2]
    assert supervise.supervise(["train"], "h:1", lambda: False) == 2  # the run's own error: it ends at once
    codes = [1] * 5 + [0]
    assert supervise.supervise(["train"], "h:1", lambda: False) == 1
    assert "ended 5 times in a row within 60 s (exit code 1)" in capsys.readouterr().err and codes == [0]


def test_a_driver_waiting_on_machines_says_so_once_a_minute(monkeypatch, capsys):
    ray_engine = pytest.importorskip("dipaco.taskqueue.ray_engine")
    q = ray_engine.TaskQueue.__new__(ray_engine.TaskQueue)
    now = time.time()
    q.task_options, q.schedule = {"num_cpus": 1}, Scheduler(resolver())
    q.schedule.launched("a", ("phase", 2, 1))
    q.schedule.launched("b", ("step", "L0.E1", 1))
    cluster = {"CPU": 0.0}
    monkeypatch.setattr(ray_engine.ray, "cluster_resources", lambda: cluster)
    clock = [now + 30]
    monkeypatch.setattr(ray_engine.time, "time", lambda: clock[0])
    q.progress_at = q.said_at = now
    q.say_waiting()
    assert capsys.readouterr().err == ""  # 30 s: not yet
    clock[0] = now + 61
    q.say_waiting()
    clock[0] = now + 90
    q.say_waiting()  # said 29 s ago
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "waiting for machines: nothing came back for 61 s" in err[0] and "0 CPU" in err[0], err
    assert "phase (trainee 2, round 2)" in err[0] and "add nodes" in err[0]
    cluster["CPU"] = 2.0  # machines enough: phases just take long; nothing to say
    clock[0] = now + 200
    q.say_waiting()
    assert capsys.readouterr().err == ""
