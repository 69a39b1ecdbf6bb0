"""The outer step against numbers worked out by hand, and against torch's own Nesterov SGD."""

import torch

from dipaco.training.outer import OuterOptimizer, module_average, module_weights, outer_gradient


def test_module_weights_follow_shard_sizes_per_module():
    w = module_weights([["embed", "L0.E0"], ["embed", "L0.E1"], ["embed", "L0.E0"]], [100, 300, 300])
    assert w["embed"] == {0: 100 / 700, 1: 300 / 700, 2: 300 / 700}
    assert w["L0.E0"] == {0: 0.25, 2: 0.75}
    assert w["L0.E1"] == {1: 1.0}


def test_one_outer_step_on_two_trainees_by_hand():
    global_ = {"m": {"w": torch.tensor([1.0, 2.0])}}
    trainee_a = {"w": torch.tensor([0.0, 2.0])}  # Δ_a = [1, 0]
    trainee_b = {"w": torch.tensor([1.0, 0.0])}  # Δ_b = [0, 2]
    weights = module_weights([["m"], ["m"]], [1, 3])  # w_a = 0.25, w_b = 0.75
    deltas = {0: outer_gradient(global_["m"], trainee_a)["w"], 1: outer_gradient(global_["m"], trainee_b)["w"]}
    grad = {"w": module_average(deltas, weights["m"])}
    assert torch.allclose(grad["w"], torch.tensor([0.25, 1.5]))
    opt = OuterOptimizer(global_, lr=0.7, momentum=0.9, nesterov=True)
    opt.step("m", grad)
    # first step: buffer = g; update = g + 0.9 g = 1.9 g; θ = θ - 0.7 * 1.9 g
    assert torch.allclose(global_["m"]["w"], torch.tensor([1.0 - 0.7 * 1.9 * 0.25, 2.0 - 0.7 * 1.9 * 1.5]), atol=1e-6)
    # second step with g2: buffer = 0.9 g + g2; update = g2 + 0.9 buffer
    before = global_["m"]["w"].clone()
    g2 = {"w": torch.tensor([1.0, -1.0])}
    opt.step("m", {"w": g2["w"].clone()})
    buf = 0.9 * grad["w"] + g2["w"]
    assert torch.allclose(global_["m"]["w"], before - 0.7 * (g2["w"] + 0.9 * buf), atol=1e-6)


def test_matches_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = torch.randn(5)
    ref = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    mods = {"m": {"w": theta.clone()}}
    ours = OuterOptimizer(mods, 0.7, 0.9, True)
    for _ in range(4):
        g = torch.randn(5)
        ref.grad = g.clone()
        sgd.step()
        ours.step("m", {"w": g.clone()})
    assert torch.allclose(ref.detach(), mods["m"]["w"], atol=1e-6)


def test_state_round_trip():
    mods = {"m": {"w": torch.zeros(3)}}
    a = OuterOptimizer(mods, 0.7, 0.9)
    a.step("m", {"w": torch.ones(3)})
    b = OuterOptimizer({"m": {"w": mods["m"]["w"].clone()}}, 0.7, 0.9)
    b.load_state_dict(a.state_dict())
    a.step("m", {"w": torch.ones(3)})
    b.step("m", {"w": torch.ones(3)})
    assert torch.equal(a.modules["m"]["w"], b.modules["m"]["w"])


def test_module_norms_are_the_last_step_s_gradient_update_and_momentum_over_every_tensor():
    mods = {"m": {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, "n": {"c": torch.tensor([0.0])}}
    opt = OuterOptimizer(mods, lr=0.5, momentum=0.9, nesterov=True)
    assert opt.module_norms(["m", "n"]) == {}  # no step yet: nothing to report
    g1 = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}  # |g1| = 13
    opt.step("m", {k: v.clone() for k, v in g1.items()})
    first = opt.module_norms(["m", "n"])
    assert list(first) == ["m"]
    assert abs(first["m"]["outer_grad_norm"] - 13.0) < 1e-5
    assert abs(first["m"]["update_norm"] - 0.5 * 1.9 * 13.0) < 1e-5  # lr · |g + 0.9 b|, b = g on the first step
    assert abs(first["m"]["momentum_norm"] - 13.0) < 1e-5
    # a streamed fragment steps tensor "b" alone: the module's norms keep "a"'s last step and take "b"'s new one
    opt.step("m", {"b": torch.tensor([-1.0])})
    buf_b = 0.9 * 12.0 - 1.0
    second = opt.module_norms(["m"])["m"]
    assert abs(second["outer_grad_norm"] - (25.0 + 1.0) ** 0.5) < 1e-5
    assert abs(second["update_norm"] - 0.5 * (1.9 ** 2 * 25.0 + (-1.0 + 0.9 * buf_b) ** 2) ** 0.5) < 1e-5
    assert abs(second["momentum_norm"] - (25.0 + buf_b ** 2) ** 0.5) < 1e-5
