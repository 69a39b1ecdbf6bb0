"""Streaming DiLoCo: fragments, the sync schedule, the τ/α merge against a hand-computed sequence, config checks."""

import shutil
from types import SimpleNamespace

import pytest
import torch

from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.training.comm import LocalWorld
from dipaco.training.outer import OuterOptimizer
from dipaco.training.streaming import block_fragment, fragment_of, offsets, syncs_at
from dipaco.training.sync import ModuleSync
from dipaco.training.train import train

from conftest import tiny_train_config


def test_fragment_layouts():
    assert [block_fragment(b, 6, 3) for b in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [block_fragment(b, 6, 3, "sequential") for b in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [block_fragment(b, 5, 2, "sequential") for b in range(5)] == [0, 0, 0, 1, 1]
    assert fragment_of("model.embed_tokens.weight", 4, 2) == 0
    assert fragment_of("model.norm.weight", 4, 2) == 1 and fragment_of("lm_head.weight", 5, 2) == 0
    assert fragment_of("model.layers.3.mlp.up_proj.weight", 4, 2) == 1


def test_schedule_offsets_spread_over_h():
    assert offsets(8, 4) == [0, 2, 4, 6]
    assert [syncs_at(t, 8, 4) for t in range(0, 11)] == [[], [], [1], [], [2], [], [3], [], [0], [], [1]]
    assert [t for t in range(1, 25) if syncs_at(t, 8, 1)] == [8, 16, 24]  # F = 1: the end of every round


class _FakeWorld(LocalWorld):
    """A world of one (fp32) that records the module outer gradients of every reduction it starts."""

    def __init__(self):
        super().__init__()
        self.started = []

    def start_reduce(self, deltas, weights):
        handle = super().start_reduce(deltas, weights)
        self.started.append({m: {n: t.clone() for n, t in g.items()} for m, g in handle.wait().items()})
        return handle


def test_overlap_and_merge_match_a_hand_computed_sequence():
    # One module, two fragments (block 0 and block 1, strided), H = 4, τ = 1, α = 0.5, outer SGD lr 1 without
    # momentum (so the new global weight is the local weight when the sync started). The fake inner step
    # subtracts 1 from every local weight.
    names = ["model.layers.0.w", "model.layers.1.w"]
    glob = {"M": {n: torch.zeros(1) for n in names}}
    local = {n: torch.zeros(1) for n in names}
    trainee = SimpleNamespace(index=0, model=SimpleNamespace(params=local, module_tensors=lambda m: local))
    cfg = SimpleNamespace(inner_steps=4, grid=SimpleNamespace(sqrt_rescale=False),
                          streaming=SimpleNamespace(fragments=2, overlap=1, alpha=0.5, layout="strided"),
                          model=SimpleNamespace(num_layers=2))
    world = _FakeWorld()
    sync = ModuleSync(cfg, glob, OuterOptimizer(glob, lr=1.0, momentum=0.0), [trainee], {"M": {0: 1.0}}, {"M": 1}, world)
    seen = []
    for t in range(1, 9):
        for v in local.values():
            v -= 1
        sync.after_step(t)
        seen.append((local[names[0]].item(), local[names[1]].item(), glob["M"][names[0]].item(), glob["M"][names[1]].item()))
    # by hand: fragment 1 syncs after steps 2 and 6 (applied at 3 and 7); fragment 0 after 4 and 8 (applied at 5, 9)
    assert seen == [(-1, -1, 0, 0), (-2, -2, 0, 0), (-3, -2.5, 0, -2), (-4, -3.5, 0, -2),
                    (-4.5, -4.5, -4, -2), (-5.5, -5.5, -4, -2), (-6.5, -6, -4, -5.5), (-7.5, -7, -4, -5.5)]
    assert [list(s["M"]) for s in world.started] == [[names[1]], [names[0]], [names[1]], [names[0]]]
    assert [s["M"][n].item() for s, n in zip(world.started, [names[1], names[0], names[1], names[0]])] == [2, 4, 3.5, 3.5]
    assert len(sync.pending) == 1 and sync.pending[0].apply_at == 9
    sync.flush()  # the last round of a run applies what is still in flight
    assert glob["M"][names[0]].item() == -7.5 and local[names[0]].item() == -7.5


@pytest.mark.parametrize("sets,needle", [
    (["streaming.fragments=3"], "must divide inner_steps"),
    (["streaming.fragments=2", "streaming.overlap=5"], "τ=5 must satisfy"),
    (["streaming.alpha=1.5"], "alpha"),
    (["streaming.layout='zigzag'"], "layout"),
    (["streaming.fragments=8"], "exceeds model.num_layers"),
    (["comm.bits=3"], "comm.bits"),
    (["comm.pattern='ring'"], "comm.pattern"),
    (["device='tpu'"], "device"),
])
def test_bad_configs_are_rejected(sets, needle):
    with pytest.raises(DipacoError, match=needle):
        tiny_train_config(*sets, inner_steps=10)


@pytest.mark.slow
def test_streaming_crash_resume_is_exact(shards_2x2, tmp_path):
    sets = ["streaming.fragments=2", "streaming.overlap=1", "streaming.alpha=0.5", "val_batches=0"]
    cfg = tiny_train_config(*sets, rounds=2, inner_steps=4)
    train(cfg, shards_2x2, tmp_path / "straight", progress=False)
    assert checkpoint.load_sync(tmp_path / "straight", 1)  # fragment 0 was in flight at the round boundary
    # a crash after round 1: drop round 2 and resume
    shutil.copytree(tmp_path / "straight", tmp_path / "crashed")
    shutil.rmtree(tmp_path / "crashed" / "checkpoints" / "round_2")
    (tmp_path / "crashed" / "checkpoints" / "latest").write_text("round_1\n")
    train(cfg, shards_2x2, tmp_path / "crashed", resume=True, progress=False)
    a = checkpoint.load_modules(tmp_path / "straight", 2)
    b = checkpoint.load_modules(tmp_path / "crashed", 2)
    for m in a:
        for n in a[m]:
            assert torch.equal(a[m][n], b[m][n]), (m, n)
