"""The Ray driver's state resolver and task specs without Ray (``dipaco.taskqueue.resolver``, ``.specs``): what a
driver finds in a real queue on disk (``TaskStore`` commits, drops, checkpoints), and where each task's inputs are read
from. A 2x2 grid, one trainee per path, resumed from round 1's checkpoint."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from conftest import tiny_train_config
from dipaco.model.grid import Grid
from dipaco.taskqueue.phases import PhaseSpec, StepSpec, validate_path
from dipaco.taskqueue.resolver import StateResolver
from dipaco.taskqueue.specs import TaskSpecs
from dipaco.taskqueue.taskstore import TaskStore

PATHS = ["0-0", "0-1", "1-0", "1-1"]
GRID = Grid.build("2x2", 2)
ALL, HALF = {i: 0.25 for i in range(4)}, 0.5
PLAN = SimpleNamespace(trainees=[(p, [f"paths/{p}"]) for p in PATHS], paths=PATHS,
                       weights={"embed": ALL, "head": ALL, "L0.E0": {0: HALF, 1: HALF}, "L0.E1": {2: HALF, 3: HALF},
                                "L1.E0": {0: HALF, 2: HALF}, "L1.E1": {1: HALF, 3: HALF}})


def commit_phase(store: TaskStore, i: int, v: int, durable: bool = True, node: str = "n1") -> None:
    base, a = store.phase_key(v, i), store.new_attempt()
    objects = {"deltas.safetensors": store.put(base, a, "deltas.safetensors", b"deltas %d %d" % (i, v))}
    if durable:
        objects["state.pt"] = store.put(base, a, "state.pt", b"state %d %d" % (i, v))
    store.commit(base, a, objects, {"trainee": i, "version": v, "node": node, "state_sha256": f"sha-{i}-{v}",
                                    "val_loss": 3.0, "validated": True})


def commit_step(store: TaskStore, g: str, v: int, modules: list[str]) -> None:
    base, a = store.version_key(v, g), store.new_attempt()
    objects = {f"{m}.safetensors": store.put(base, a, f"{m}.safetensors", f"{m} {v}".encode()) for m in modules}
    objects["outer.safetensors"] = store.put(base, a, "outer.safetensors", b"momentum")
    store.commit(base, a, objects, {"group": g, "version": v})


def resumed(tmp_path, said=None) -> StateResolver:
    (tmp_path / "checkpoints" / "round_0").mkdir(parents=True, exist_ok=True)
    (tmp_path / "checkpoints" / "round_1").mkdir(exist_ok=True)
    store = TaskStore(str(tmp_path), "L")
    return StateResolver.scan(store, PLAN, GRID, 1, 3, tmp_path, True, (said if said is not None else []).append)


def test_a_resumed_driver_finds_what_storage_holds(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for i in range(4):
        commit_phase(store, i, 1)
    groups = resumed(tmp_path).groups
    for g, modules in groups.modules.items():
        if g != "L1.E1":
            commit_step(store, g, 2, modules)
    commit_phase(store, 0, 2)
    (tmp_path / "queue" / "L" / "phases" / "2" / "trainee_1").mkdir(parents=True)  # an attempt that never committed
    (tmp_path / "queue" / "L" / "phases" / "2" / "trainee_1" / "commit.json").write_text("{garbage")
    said = []
    state = resumed(tmp_path, said)
    assert len(said) == 1 and "does not parse" in said[0] and "done again" in said[0]
    assert state.ledger.done == {(0, 1), (1, 1), (2, 1), (3, 1), (0, 2)}
    assert {g for g, v in state.ledger.versions} == set(groups.modules) - {"L1.E1"}
    assert not state.round_trained(2) and state.next_step("L1.E1") == 1 and state.next_step("L0.E0") == 2
    assert [state.next_version(i) for i in range(4)] == [None, 2, 2, 2]  # trainee 0's last phase (v 2) is in
    commit_step(store, "L1.E1", 2, groups.modules["L1.E1"])
    state.step_committed("L1.E1", 1, now=123.0)
    assert state.round_trained(2) and state.ledger.finished_at[2] == 123.0  # the last group closes the round's clock


def test_a_checkpoint_wins_over_the_queue_and_a_commit_is_read_with_its_checksum(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for i in range(4):
        commit_phase(store, i, 1)
    state = resumed(tmp_path)
    for g, modules in state.groups.modules.items():
        commit_step(store, g, 2, modules)
        state.step_committed(g, 1, now=0.0)
    assert state.module_ref("L0.E0", 1) == {"key": "checkpoints/round_1/modules/L0.E0.safetensors", "sha256": ""}
    version_2 = state.module_ref("L0.E0", 2)
    assert version_2["key"].startswith("queue/L/versions/2/L0.E0/") and store.read_ref(version_2) == b"L0.E0 2"
    assert state.outer_ref("L0.E0", 1)["key"] == "checkpoints/round_1/state/outer.safetensors"
    assert set(state.path_modules("0-1", 2)) == {"embed", "L0.E0", "L1.E1", "head"}
    ref, exact = state.state_ref(2, 2)  # the committed phase (2, 1)
    assert exact and store.read_ref(ref) == b"state 2 1"
    ref, exact = state.state_ref(2, 1)  # the checkpoint's copy
    assert exact and ref["key"] == "checkpoints/round_1/state/trainee_2.pt"


def test_a_dropped_phase_leaves_the_older_state_and_its_groups_weight_to_the_others(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for i in range(3):
        commit_phase(store, i, 1)
    state = resumed(tmp_path)
    state.drop(3, 1, "late for the outer step of L0.E1 in round 2")
    assert store.dropped(1, 3) and state.settled(3, 1) and not state.phase_committed(3, 1)
    ref, exact = state.state_ref(3, 2)  # from before the dropped phase: not exact (its step moves to round 2's)
    assert not exact and ref["key"] == "checkpoints/round_1/state/trainee_3.pt"
    deltas, weights = state.step_inputs(state.groups.of_module["L0.E1"], 1)
    assert list(deltas) == [2] and weights["L0.E1"] == {2: pytest.approx(1.0)}
    deltas, weights = state.step_inputs(state.groups.of_module["embed"], 1)
    assert list(deltas) == [0, 1, 2] and sum(weights["embed"].values()) == pytest.approx(1.0)


def test_a_state_only_a_node_cache_kept_comes_with_its_replay(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for i in range(4):
        commit_phase(store, i, 1, durable=False, node="n7")  # sticky: state.pt stays in n7's cache
    state = resumed(tmp_path)
    for g, modules in state.groups.modules.items():
        commit_step(store, g, 2, modules)
        state.step_committed(g, 1, now=0.0)
    assert state.last_node(1, 2) == "n7" and state.last_node(1, 1) is None
    ref, exact = state.state_ref(1, 2)
    assert exact and ref["sha256"] == "sha-1-1"  # the cache's key: the state phase (1, 1) committed
    chain = ref["replay"]
    assert chain["from"]["key"] == "checkpoints/round_1/state/trainee_1.pt"  # the last durable copy
    assert [r["version"] for r in chain["rounds"]] == [1] and set(chain["rounds"][0]["modules"]) == set(GRID.path_modules("0-1"))


def test_validations_come_from_storage_or_the_validator_phase(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    state = resumed(tmp_path)
    assert state.validator == {p: i for i, p in enumerate(PATHS)}
    assert state.validates(1, 2) and not state.validates(1, 1)  # version 1 is the start's checkpoint
    for i in range(4):
        commit_phase(store, i, 2)
        state.phase_committed(i, 2)
    for p in PATHS[:3]:
        store.write_val(2, p, 2.0 + PATHS.index(p))
    assert state.val_losses(2) is None and state.awaiting == {("1-1", 2)}  # its phase committed, its file is gone
    state.ledger.val_loss[("1-1", 2)] = 5.0
    assert state.val_losses(2) == {"0-0": 2.0, "0-1": 3.0, "1-0": 4.0, "1-1": 5.0}
    assert StateResolver(store, PLAN, GRID, state.groups, 1, 3, {1}, state.ledger, validating=False).val_losses(2) == {}


def test_the_specs_are_what_the_task_bodies_take(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for i in range(4):
        commit_phase(store, i, 1)
    state = resumed(tmp_path)
    layout = {m: [f"{m}.weight"] for m in GRID.modules}
    specs = TaskSpecs(state, tiny_train_config(), tmp_path / "shards", 8, layout, "cpu")
    phase = PhaseSpec(**specs.phase(2, 1))
    assert (phase.trainee, phase.path, phase.version, phase.validate, phase.exact_state) == (2, "1-0", 1, False, True)
    assert phase.modules == state.path_modules("1-0", 1) and phase.val_sources == ["paths/1-0"]
    step = StepSpec(**specs.step("L0.E1", 1))
    assert step.layout == {"L0.E1": ["L0.E1.weight"]} and set(step.contributors) == {2, 3}
    assert step.paths_through == {"L0.E1": 2} and step.weights == {"L0.E1": {2: HALF, 3: HALF}}
    inspect.signature(validate_path).bind(**specs.validation("0-0", 1))
