"""The Ray driver's round assembler without Ray (``dipaco.taskqueue.rounds``): a round whose phases, outer steps and
validations a real queue on disk holds becomes its metrics.jsonl lines and, on checkpoint rounds, the checkpoint every
engine reads. A 2x2 grid, one trainee per path, resumed from round 1; trainee 3's phase of round 2 dropped by a quorum,
trainee 1's retried once."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from dipaco.config import LogConfig
from dipaco.storage import checkpoint
from dipaco.taskqueue.resolver import StateResolver
from dipaco.taskqueue.rounds import RoundAssembler
from dipaco.taskqueue.taskstore import TaskStore, state_bytes, tensors_bytes
from test_ray_state import GRID, PATHS, PLAN

H = 4


def config(rounds: int, checkpoint_every: int) -> SimpleNamespace:
    return SimpleNamespace(rounds=rounds, inner_steps=H, checkpoint_every=checkpoint_every,
                           inner=SimpleNamespace(batch_size=2), model=SimpleNamespace(max_seq_len=8), log=LogConfig())


def phase_record(i: int) -> dict:
    inner = [{"kind": "inner", "step": H + k + 1, "trainee": i, "loss": 4.0 - k} for k in range(H)]
    return {"trainee": i, "path": PATHS[i], "version": 1, "node": "n1", "host": "h", "pid": 100 + i, "load_s": 1.0,
            "val_s": 0.5, "compute_s": 2.0 + i, "save_s": 0.25, "bytes_sent": 1000, "bytes_loaded": 4000,
            "inner": inner, "train_loss": 3.0 + i, "val_loss": None, "validated": False, "storage_read": 10,
            "storage_written": 20, "state_sha256": f"sha-{i}"}


def round_2_in_the_queue(run) -> TaskStore:
    """Round 1's checkpoint (what a phase of round 2 started from), then round 2 as the queue holds it."""
    (run / "checkpoints" / "round_0").mkdir(parents=True)
    (run / "checkpoints" / "round_1" / "state").mkdir(parents=True)
    for i in range(4):
        torch.save({"step": H, "trainee": i}, run / "checkpoints" / "round_1" / "state" / f"trainee_{i}.pt")
    store = TaskStore(str(run), "L")
    for i in range(3):
        base, a = store.phase_key(1, i), store.new_attempt()
        objects = {name: store.put(base, a, name, data) for name, data in
                   (("deltas.safetensors", b"d"), ("state.pt", state_bytes({"step": 2 * H, "trainee": i})))}
        store.commit(base, a, objects, phase_record(i))
    for i in (0, 1, 1, 2, 3):
        store.record_attempt(1, i, {"node": "n1", "started": 1.0})
    store.drop(1, 3, "late for the outer step in round 2")
    state = StateResolver.scan(store, PLAN, GRID, 1, 3, run, True, print)
    for g, modules in state.groups.modules.items():
        base, a = store.version_key(2, g), store.new_attempt()
        objects = {f"{m}.safetensors": store.put(base, a, f"{m}.safetensors", tensors_bytes({"w": torch.ones(2)}))
                   for m in modules}
        momentum = {f"{m}/w": torch.full((2,), 0.5) for m in modules}
        objects["outer.safetensors"] = store.put(base, a, "outer.safetensors", tensors_bytes(momentum))
        store.commit(base, a, objects, {"group": g, "node": "n2", "pid": 7, "seconds": 0.1,
                                        "contributors": [0, 1, 2], "bytes_received": 500, "storage_read": 1,
                                        "module_norms": {m: {"outer_grad_norm": 1.0} for m in modules}})
    for i, p in enumerate(PATHS):
        store.write_val(2, p, 2.0 + i)
    return store


def lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_finished_round_is_logged_once_with_its_phases_and_steps(tmp_path):
    store = round_2_in_the_queue(tmp_path)
    state = StateResolver.scan(store, PLAN, GRID, 1, 3, tmp_path, True, print)
    rounds = RoundAssembler(state, config(rounds=3, checkpoint_every=5), tmp_path, workers=lambda: 5, progress=False)
    rounds.complete()
    assert rounds.next_round == 3 and not rounds.done()  # round 3 is not trained yet
    *inner, line = lines(tmp_path)
    assert [(x["step"], x["trainee"]) for x in inner] == [(H + k + 1, i) for k in range(H) for i in range(3)]
    assert line["kind"] == "round" and line["round"] == 2 and line["engine"] == "ray" and line["workers"] == 5
    assert line["train_loss_by_trainee"] == [3.0, 4.0, 5.0, None] and line["train_loss"] == 4.0
    assert line["val_loss"] == {p: 2.0 + i for i, p in enumerate(PATHS)} and line["val_loss_mean"] == 3.5
    assert line["dropped"] == [3] and line["retried"] == [1] and line["tokens"] == 3 * H * 2 * 8
    assert line["bytes_sent"] == 3000 and line["bytes_received"] == 500 * len(state.groups.modules)
    assert line["storage_read"] == 3 * 10 + len(state.groups.modules) and line["compute_s"] == 3.0
    assert line["phases"][3] == {"trainee": 3, "path": "1-1", "dropped": True, "attempts": 1, "nodes": ["n1"]}
    assert line["phases"][1]["attempts"] == 2 and line["steps"][0]["contributors"] == [0, 1, 2]
    assert sorted(line["module_norms"]) == sorted(GRID.modules)  # every group's outer step gives its modules' norms
    assert rounds.counts == {"retried": 1, "dropped": 0, "storage_read": line["storage_read"], "storage_written": 60}
    rounds.close()
    again = StateResolver.scan(store, PLAN, GRID, 1, 3, tmp_path, True, print)  # a driver resumed after it
    RoundAssembler(again, config(rounds=3, checkpoint_every=5), tmp_path, workers=lambda: 5, progress=False).complete()
    assert len(lines(tmp_path)) == len(inner) + 1  # round 2 is not logged twice


def test_the_last_round_becomes_a_checkpoint_and_the_queue_goes(tmp_path):
    store = round_2_in_the_queue(tmp_path)
    state = StateResolver.scan(store, PLAN, GRID, 1, 2, tmp_path, True, print)
    rounds = RoundAssembler(state, config(rounds=2, checkpoint_every=5), tmp_path, workers=lambda: 1, progress=False)
    rounds.complete()
    assert rounds.done() and state.checkpoints == {0, 1, 2} and not (tmp_path / "queue").exists()
    assert checkpoint.latest_round(tmp_path) == 2
    meta = json.loads((tmp_path / "checkpoints" / "round_2" / "state" / "meta.json").read_text())
    assert meta["queue"] == "L" and meta["engine"] == "ray" and meta["trainee_paths"] == PATHS
    states = [torch.load(tmp_path / "checkpoints" / "round_2" / "state" / f"trainee_{i}.pt") for i in range(4)]
    assert [s["step"] for s in states] == [2 * H] * 4  # the dropped trainee's older state, moved to the round's step
    assert states[3]["trainee"] == 3 and states[0]["trainee"] == 0
    from safetensors.torch import load_file
    outer = load_file(tmp_path / "checkpoints" / "round_2" / "state" / "outer.safetensors")
    assert set(outer) == {f"{m}/w" for m in GRID.modules}
    rounds.close()
