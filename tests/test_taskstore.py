"""The Ray engine's parts that need no Ray (fast tier): the task store's commits and state lineage, the outer step as
an executor computes it (against the local engine's reduction), and the refusals of `--engine ray`."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_train_config
from dipaco.cli.commands import main
from dipaco.config import TrainConfig, resolve
from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.taskqueue.phases import StepSpec, outer_step
from dipaco.taskqueue.taskstore import TaskStore, groups, ref, tensors_bytes
from dipaco.training.comm import LocalWorld
from dipaco.training.outer import OuterOptimizer, renormalised
from dipaco.training.quant import quantize


def test_groups_join_modules_averaged_over_the_same_trainees():
    weights = {"embed": {0: .25, 1: .25, 2: .25, 3: .25}, "L0.E0": {0: .5, 1: .5}, "L0.E1": {2: .5, 3: .5},
               "head": {0: .25, 1: .25, 2: .25, 3: .25}, "B0@0-0": {0: 1.0}}
    assert groups(weights) == {"embed+head": ["embed", "head"], "L0.E0": ["L0.E0"], "L0.E1": ["L0.E1"],
                               "B0@0-0": ["B0@0-0"]}


def test_the_first_commit_wins_and_the_losers_objects_are_never_read(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    base = store.phase_key(0, 1)
    first, second = store.new_attempt(), store.new_attempt()
    objs = {a: {"state.pt": store.put(base, a, "state.pt", a.encode())} for a in (first, second)}
    assert store.commit(base, first, objs[first], {"attempt": 1})
    assert not store.commit(base, second, objs[second], {"attempt": 2})  # its objects stay, unread
    body = store.read_commit(base)
    assert body["record"] == {"attempt": 1} and store.read_ref(store.object_ref(base, body, "state.pt")) == first.encode()


def test_damaged_queue_entries_are_removed_and_redone(tmp_path):
    """A commit record that does not parse, an object that fails its checksum or is gone, a garbage validation or
    attempt file: the driver's scan drops them (one line each) and keeps what verifies."""
    store, said = TaskStore(str(tmp_path), "L"), []
    for i in range(4):
        base = store.phase_key(1, i)
        a = store.new_attempt()
        store.commit(base, a, {"deltas.safetensors": store.put(base, a, "deltas.safetensors", b"d%d" % i)}, {"i": i})
    root = tmp_path / "queue" / "L" / "phases" / "1"
    (root / "trainee_1" / "commit.json").write_text("{garbage")
    body = store.read_commit(store.phase_key(1, 2))
    (root / "trainee_2" / body["attempt"] / "deltas.safetensors").write_bytes(b"truncated")
    body = store.read_commit(store.phase_key(1, 3))
    (root / "trainee_3" / body["attempt"] / "deltas.safetensors").unlink()
    store.write_val(1, "0-0", 2.5)
    (tmp_path / "queue" / "L" / "val" / "1").mkdir(parents=True, exist_ok=True)
    (tmp_path / "queue" / "L" / "val" / "1" / "0-1.json").write_text("not json")
    (tmp_path / "queue" / "L" / "attempts" / "1" / "trainee_0").mkdir(parents=True)
    (tmp_path / "queue" / "L" / "attempts" / "1" / "trainee_0" / "x.json").write_text("garbage")
    phases, steps, dropped, vals = store.scan(0, said.append)
    assert set(phases) == {(0, 1)} and vals == {("0-0", 1)} and not steps and not dropped
    assert len(said) == 4 and all("\n" not in line for line in said)
    assert store.attempts(1, 0) == []  # a garbage attempt file counts nothing, and raises nothing
    assert store.scan(0, said.append)[0].keys() == {(0, 1)} and len(said) == 4  # removed: said once


def test_a_queue_is_read_only_with_the_checkpoint_and_config_it_grew_from(tmp_path):
    from dipaco.storage.objects import Storage
    from dipaco.taskqueue.runstore import choose_lineage

    s, said = Storage(str(tmp_path)), []
    token = choose_lineage(s, 0, "cfgA", {}, said.append)
    s.write(f"queue/{token}/versions/2/embed/commit.json", b"{}")
    assert choose_lineage(s, 1, "cfgA", {"queue": token}, said.append) == token  # a round assembled from it
    assert choose_lineage(s, 0, "cfgA", {}, said.append) != token  # a new run: never an old queue
    token = choose_lineage(s, 2, "cfgA", {}, said.append)
    s.write(f"queue/{token}/versions/3/embed/commit.json", b"{}")
    # round 2 written by another engine (no queue named in its meta), or the bits changed: a new lineage, old removed
    other = choose_lineage(s, 3, "cfgA", {}, said.append)
    assert other != token and not (tmp_path / "queue" / token).exists()
    assert choose_lineage(s, 3, "cfgB", {"queue": other}, said.append) != other
    (tmp_path / "queue" / "lineage.json").write_text("garbage")
    assert choose_lineage(s, 3, "cfgB", {}, said.append)
    assert all("\n" not in line for line in said) and any("does not parse" in line for line in said)


def test_forget_before_keeps_what_later_tasks_read(tmp_path):
    store = TaskStore(str(tmp_path), "L")
    for v in (0, 1, 2):
        store.storage.write(f"{store.phase_key(v, 0)}/commit.json", b"{}")
        store.storage.write(f"{store.version_key(v + 1, 'embed')}/commit.json", b"{}")
    store.forget_before(2)
    assert [store.storage.exists(store.phase_key(v, 0)) for v in (0, 1, 2)] == [False, False, True]
    assert [store.storage.exists(store.version_key(v, "embed")) for v in (1, 2, 3)] == [False, True, True]


@pytest.mark.parametrize("bits", [32, 4])
def test_an_executors_outer_step_is_the_sync_engines(tmp_path, bits):
    """Two trainees' outer gradients, reduced and applied by ``outer_step`` from files, equal the world of one's
    reduction and outer Nesterov step, bit for bit (the engines share one implementation)."""
    cfg = resolve(TrainConfig, overrides=[f"comm.bits={bits}", "comm.block_size=8"])
    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g)}
    momentum = {"L0.E0/w": torch.randn(5, 7, generator=g), "L0.E0/b": torch.randn(7, generator=g)}
    deltas = {i: {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in theta.items()} for i in (0, 3)}
    weights = {0: 0.3, 3: 0.7}
    store = TaskStore(str(tmp_path), "L")
    save_file(theta, str(tmp_path / "theta.safetensors"))
    save_file(momentum, str(tmp_path / "outer.safetensors"))
    contributors = {}
    for i, d in deltas.items():
        flat = torch.cat([d["w"].reshape(-1), d["b"]])
        base, a = store.phase_key(0, i), store.new_attempt()
        data = tensors_bytes({"L0.E0": flat if bits == 32 else quantize(flat, bits, 8)})
        store.commit(base, a, {"deltas.safetensors": store.put(base, a, "deltas.safetensors", data)}, {})
        contributors[i] = store.object_ref(base, store.read_commit(base), "deltas.safetensors")
    spec = StepSpec(str(tmp_path), "L", cfg, "L0.E0", 0, {"L0.E0": ["w", "b"]}, {"L0.E0": ref("theta.safetensors")},
                    ref("outer.safetensors"), contributors, {"L0.E0": weights}, {"L0.E0": 2})
    record = outer_step(spec)
    assert record["contributors"] == [0, 3]
    body = store.read_commit(store.version_key(1, "L0.E0"))

    expected = {"L0.E0": {n: t.clone() for n, t in theta.items()}}
    opt = OuterOptimizer(expected, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    opt.load_state_dict(momentum)
    reduced = LocalWorld(bits, 8).start_reduce({"L0.E0": deltas}, {"L0.E0": weights}).wait()
    opt.step("L0.E0", reduced["L0.E0"])
    got = store.load_tensors(store.object_ref(store.version_key(1, "L0.E0"), body, "L0.E0.safetensors"))
    assert all(torch.equal(got[n], expected["L0.E0"][n]) for n in theta)
    got_momentum = store.load_tensors(store.object_ref(store.version_key(1, "L0.E0"), body, "outer.safetensors"))
    assert all(torch.equal(got_momentum[k], v) for k, v in opt.state_dict().items())
    assert outer_step(spec)["contributors"] == [0, 3]  # a retry after the commit returns the committed record


def test_renormalised_weights_share_the_whole_weight():
    assert renormalised({0: 0.2, 1: 0.3, 2: 0.5}, [0, 2]) == {0: 0.2 / 0.7, 2: 0.5 / 0.7}


def test_streaming_settings_are_refused_with_the_ray_engine():
    for extra in ("streaming.fragments=2", "streaming.overlap=1", "streaming.alpha=0.5"):
        with pytest.raises(DipacoError, match="Streaming DiLoCo .* is the local engine's"):
            resolve(TrainConfig, overrides=['engine="ray"', extra], flags={"inner_steps": 10})
    with pytest.raises(DipacoError, match="grace"):
        resolve(TrainConfig, overrides=["ray.grace=-1"])


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "1"], "--max-restarts is torchrun's"),
    (["--workers", "2", "--address", "auto"], "drop one of the two"),
])
def test_ray_engine_flag_refusals(tmp_path, capsys, args, message):
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--engine", "ray", *args])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_without_ray_the_engine_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "dipaco.taskqueue.ray_engine", raising=False)
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--engine", "ray"])
    assert rc == 2 and "pip install -e '.[ray]'" in capsys.readouterr().err


def test_a_sticky_trainees_state_comes_from_the_node_cache_only_when_its_checksum_matches(tmp_path, monkeypatch):
    from dipaco.storage.objects import sha256
    from dipaco.taskqueue.phases import StateCache
    from dipaco.taskqueue.taskstore import state_bytes

    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path / "cache"))
    cache = StateCache("s3://bucket/run", "L", 3)
    first, second = state_bytes({"step": 1}), state_bytes({"step": 2})
    cache.keep(first, sha256(first))
    assert cache.load(ref("k", sha256(first))) == ({"step": 1}, True)
    cache.keep(second, sha256(second))  # the newest state only
    assert cache.load(ref("k", sha256(first))) == (None, False)
    assert cache.load(ref("k", "")) == (None, False)  # no checksum to check it against: storage
    f = next(cache.dir.glob("trainee_3-*.pt"))
    f.write_bytes(b"damaged")
    assert cache.load(ref("k", sha256(second))) == (None, False)
    assert StateCache("s3://bucket/other", "L", 3).load(ref("k", sha256(second))) == (None, False)


def test_a_queue_is_reused_only_under_the_same_durable_rounds():
    """Checkpoints are assembled from the phases' durable states: a queue grown with sticky states every K rounds is
    not read under another K or another last round (its checkpoints would lack states), and K=1 digests as before."""
    from dipaco.taskqueue.runstore import config_digest

    def digest(*sets: str, rounds: int = 8) -> str:
        return config_digest(tiny_train_config(*sets, rounds=rounds), 80)

    plain = digest()
    assert digest("checkpoint_every=4") not in (plain, digest("checkpoint_every=2"), digest("checkpoint_every=4", rounds=12))
    assert digest("checkpoint_every=4", "ray.sticky=false") == digest("checkpoint_every=4", "ray.quorum=2") == plain
    assert digest(rounds=12) == plain  # every state durable: the round count does not matter
