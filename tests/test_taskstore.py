"""The Ray engine's parts that need no Ray (fast tier): the task store's commits and state lineage, the outer step as
an executor computes it (against the sync engine's reduction), and the refusals of `--engine ray`."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from dipaco import checkpoint
from dipaco.cli import main
from dipaco.comm import LocalWorld
from dipaco.config import TrainConfig, resolve
from dipaco.errors import DipacoError
from dipaco.outer import OuterOptimizer, renormalised
from dipaco.phases import StepSpec, outer_step
from dipaco.quant import quantize
from dipaco.taskstore import TaskStore, groups


def test_groups_join_modules_averaged_over_the_same_trainees():
    weights = {"embed": {0: .25, 1: .25, 2: .25, 3: .25}, "L0.E0": {0: .5, 1: .5}, "L0.E1": {2: .5, 3: .5},
               "head": {0: .25, 1: .25, 2: .25, 3: .25}, "B0@0-0": {0: 1.0}}
    assert groups(weights) == {"embed+head": ["embed", "head"], "L0.E0": ["L0.E0"], "L0.E1": ["L0.E1"],
                               "B0@0-0": ["B0@0-0"]}


def test_the_first_commit_wins_and_a_late_duplicate_changes_nothing(tmp_path):
    store = TaskStore(tmp_path)
    final = store.phase_dir(0, 1)
    first, second = store.staging(final), store.staging(final)
    (first / "phase.json").write_text('{"attempt": 1}')
    (second / "phase.json").write_text('{"attempt": 2}')
    assert store.commit(first, final) and not store.commit(second, final)
    assert store.phase_info(0, 1) == {"attempt": 1} and not second.exists()
    assert store.committed(0, 1) and not store.committed(0, 0)


def test_a_trainee_after_a_dropped_phase_starts_from_its_state_before_it(tmp_path):
    store = TaskStore(tmp_path)
    assert store.state_source(2, 0, {0}) == (checkpoint.round_dir(tmp_path, 0) / "state" / "trainee_2.pt", True)
    assert store.state_source(2, 1, {0}) == (store.phase_dir(0, 2) / "state.pt", True)
    store.drop(1, 2, "late")
    store.drop(2, 2, "late")  # dropped twice in a row: back to the phase before both
    assert store.state_source(2, 3, {0}) == (store.phase_dir(0, 2) / "state.pt", False)
    assert store.state_source(2, 3, {0, 2}) == (checkpoint.round_dir(tmp_path, 2) / "state" / "trainee_2.pt", False)
    assert store.dropped(1, 2) and not store.dropped(1, 1)


def test_forget_before_keeps_what_later_tasks_read(tmp_path):
    store = TaskStore(tmp_path)
    for v in (0, 1, 2):
        store.phase_dir(v, 0).mkdir(parents=True)
        store.version_dir(v + 1, "embed").mkdir(parents=True)
    store.forget_before(2)
    assert [store.phase_dir(v, 0).exists() for v in (0, 1, 2)] == [False, False, True]
    assert [store.version_dir(v, "embed").exists() for v in (1, 2, 3)] == [False, True, True]


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
    store = TaskStore(tmp_path)
    save_file(theta, str(tmp_path / "theta.safetensors"))
    save_file(momentum, str(tmp_path / "outer.safetensors"))
    for i, d in deltas.items():
        flat = torch.cat([d["w"].reshape(-1), d["b"]])
        store.phase_dir(0, i).mkdir(parents=True)
        save_file({"L0.E0": flat if bits == 32 else quantize(flat, bits, 8)}, str(store.phase_dir(0, i) / "deltas.safetensors"))
    spec = StepSpec(str(tmp_path), cfg, "L0.E0", 0, {"L0.E0": ["w", "b"]}, {"L0.E0": str(tmp_path / "theta.safetensors")},
                    str(tmp_path / "outer.safetensors"), {i: str(store.phase_dir(0, i)) for i in deltas},
                    {"L0.E0": weights}, {"L0.E0": 2})
    record = outer_step(spec)
    assert record["contributors"] == [0, 3] and store.version_ready(1, "L0.E0")

    expected = {"L0.E0": {n: t.clone() for n, t in theta.items()}}
    opt = OuterOptimizer(expected, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    opt.load_state_dict(momentum)
    reduced = LocalWorld(bits, 8).start_reduce({"L0.E0": deltas}, {"L0.E0": weights}).wait()
    opt.step("L0.E0", reduced["L0.E0"])
    got = checkpoint.load_tensors(store.version_dir(1, "L0.E0") / "L0.E0.safetensors")
    assert all(torch.equal(got[n], expected["L0.E0"][n]) for n in theta)
    got_momentum = checkpoint.load_tensors(store.version_dir(1, "L0.E0") / "outer.safetensors")
    assert all(torch.equal(got_momentum[k], v) for k, v in opt.state_dict().items())
    assert outer_step(spec)["contributors"] == [0, 3]  # a retry after the commit returns the committed record


def test_renormalised_weights_share_the_whole_weight():
    assert renormalised({0: 0.2, 1: 0.3, 2: 0.5}, [0, 2]) == {0: 0.2 / 0.7, 2: 0.5 / 0.7}


def test_streaming_settings_are_refused_with_the_ray_engine():
    for extra in ("streaming.fragments=2", "streaming.overlap=1", "streaming.alpha=0.5"):
        with pytest.raises(DipacoError, match="Streaming DiLoCo .* is the sync engine's"):
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
    monkeypatch.delitem(sys.modules, "dipaco.ray_engine", raising=False)
    rc = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--engine", "ray"])
    assert rc == 2 and "pip install -e '.[ray]'" in capsys.readouterr().err
