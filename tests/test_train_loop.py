"""Small pieces of the round loop that must not change results (no training here: fast)."""

from __future__ import annotations

import torch

from dipaco.train import round_losses


def test_round_losses_equal_per_step_item_sums():
    torch.manual_seed(0)
    H = 7
    steps = {0: [torch.rand(()) * 8 for _ in range(H)], 3: [torch.rand(()) * 8 for _ in range(H)]}
    logs = [{"trainee": 3, "loss": steps[3][4]}, {"trainee": 0, "loss": steps[0][6]}]
    got = round_losses(steps, logs, H)
    for i, ls in steps.items():
        want = 0.0
        for l in ls:  # what the loop did before: accumulate loss.item() / H every step
            want += l.item() / H
        assert got[i] == want  # exactly, not approximately
    assert logs == [{"trainee": 3, "loss": steps[3][4].item()}, {"trainee": 0, "loss": steps[0][6].item()}]


def test_foreach_adamw_is_bit_identical_to_the_single_tensor_loop():
    def train(foreach):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=2e-3, betas=(0.9, 0.95), foreach=foreach)
        gen = torch.Generator().manual_seed(1)
        for s in range(30):
            for g in opt.param_groups:
                g["lr"] = 2e-3 * (s + 1) / 30
            x = torch.randn(4, 16, generator=gen)
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_round_written_by_several_workers_moves_latest_only_when_whole(tmp_path):
    import pytest

    from dipaco import checkpoint
    from dipaco.errors import DipacoError

    modules = {"a": {"w": torch.ones(2, 3)}, "b": {"w": torch.zeros(4)}}
    states = {0: {"step": 1}, 1: {"step": 2}}
    checkpoint.save_round(tmp_path, 0, modules, {}, [states[0], states[1]], {"trainee_paths": ["0", "1"]})
    tmp = checkpoint.begin_round(tmp_path, 1)
    checkpoint.write_modules(tmp, {"a": modules["a"]})          # worker 0's part
    checkpoint.write_trainees(tmp, {0: states[0]})
    with pytest.raises(DipacoError, match="must be shared"):   # worker 1's part never arrived
        checkpoint.finish_round(tmp_path, 1, tmp, ["a", "b"], {}, 2, {"trainee_paths": ["0", "1"]})
    assert checkpoint.latest_round(tmp_path) == 0
    checkpoint.write_modules(tmp, {"b": modules["b"]})          # worker 1's part
    checkpoint.write_trainees(tmp, {1: states[1]})
    checkpoint.finish_round(tmp_path, 1, tmp, ["a", "b"], {}, 2, {"trainee_paths": ["0", "1"]})
    assert checkpoint.latest_round(tmp_path) == 1 and not tmp.exists()
    loaded = checkpoint.load_modules(tmp_path, 1)
    assert torch.equal(loaded["a"]["w"], modules["a"]["w"]) and torch.equal(loaded["b"]["w"], modules["b"]["w"])
    assert [s["step"] for s in checkpoint.load_state(tmp_path, 1)[1]] == [1, 2]
