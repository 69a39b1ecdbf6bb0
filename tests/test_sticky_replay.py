"""Sticky trainees between checkpoints: a phase keeps its trainee's state in the node cache only, and a phase that
runs where that cache is gone replays the phases since the last durable copy, to the same bits (no Ray: the phase
function itself, on a local run directory built by the in-process engine)."""

from __future__ import annotations

import shutil

import pytest

from conftest import tiny_train_config

pytestmark = pytest.mark.slow

ROUNDS, H = 3, 4


def test_a_phase_off_its_node_replays_to_the_cached_state(shards_2x2, tmp_path, monkeypatch):
    from dipaco.errors import DipacoError
    from dipaco.storage.run import build_grid
    from dipaco.storage.shards import ShardSet
    from dipaco.taskqueue.phases import PhaseSpec, durable_state, run_phase
    from dipaco.taskqueue.taskstore import TaskStore, ref
    from dipaco.training.plan import Plan
    from dipaco.training.train import train

    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    reference = tiny_train_config(rounds=ROUNDS, inner_steps=H)
    train(reference, shards_2x2, run, progress=False)  # round 1's modules are the queue's version 1, bit for bit
    cfg = tiny_train_config("checkpoint_every=3", rounds=ROUNDS, inner_steps=H)
    assert [durable_state(cfg, v) for v in (1, 2, 3)] == [False, False, True]
    assert durable_state(tiny_train_config("checkpoint_every=3", "ray.sticky=false", rounds=ROUNDS), 1)
    assert durable_state(tiny_train_config("checkpoint_every=3", "ray.quorum=1", rounds=ROUNDS), 1)

    shards = ShardSet(shards_2x2)
    grid = build_grid(cfg, shards.grid)
    path, sources = Plan.make(cfg, grid, shards, 1).trainees[1]
    modules = {v: {m: ref(f"checkpoints/round_{v}/modules/{m}.safetensors") for m in grid.path_modules(path)}
               for v in (0, 1, 2)}
    start = ref("checkpoints/round_0/state/trainee_1.pt")

    def phase(v: int, state: dict) -> dict:
        spec = PhaseSpec(str(run), "L", str(shards_2x2), cfg, grid, 1, path, sources, v, ROUNDS * H, modules[v], state,
                         True, False, sources)
        return run_phase(spec)

    def chain(after: dict, v: int) -> dict:  # what the driver hands phase (1, v): the state ``after`` committed
        return {**ref("", after["state_sha256"]),
                "replay": {"from": start, "rounds": [{"version": w, "modules": modules[w]} for w in range(v)]}}

    first = phase(0, start)
    store = TaskStore(str(run), "L")
    assert "state.pt" not in store.read_commit(store.phase_key(0, 1))["objects"]  # only in this node's cache
    assert first["state_cached"] is False and first["replayed"] == 0
    second = phase(1, chain(first, 1))
    on_its_node = phase(2, chain(second, 2))
    assert second["state_cached"] is on_its_node["state_cached"] is True and on_its_node["replayed"] == 0
    shutil.rmtree(tmp_path / "cache" / "states")  # the node is gone
    elsewhere = phase(2, chain(second, 2))
    assert elsewhere["state_cached"] is False and elsewhere["replayed"] == 2
    assert elsewhere["state_sha256"] == on_its_node["state_sha256"] and elsewhere["train_loss"] == on_its_node["train_loss"]
    assert elsewhere["storage_read"] > on_its_node["storage_read"]  # the durable state and two rounds' modules
    assert [f.name for f in (tmp_path / "cache" / "states").rglob("*.pt")] == [f"trainee_1-{elsewhere['state_sha256']}.pt"]

    shutil.rmtree(tmp_path / "cache" / "states")
    with pytest.raises(DipacoError, match="replaying trainee 1's phases 1..2 gave another state"):
        phase(2, {**chain(second, 2), "sha256": "0" * 64})
